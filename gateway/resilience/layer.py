"""The gateway's resilience layer: wires shared state, rate limits, breakers, health and the attempt loop
(``gateway/resilience/attempts.py``) into the request path.

``Resilience`` lives as long as the gateway process (config reloads call ``configure`` and keep the state).
The request path calls ``admit`` (RPM/TPM per virtual key and tenant, 429 with ``Retry-After`` and OpenAI's
``x-ratelimit-*`` headers) and then ``forward`` (retries, fallback, breakers, per-backend limits, streaming
failure handling, token reconciliation). Config sections read here (all optional): ``state``, ``limits``,
``resilience`` and the backends' ``rpm`` / ``tpm`` / ``timeouts``; see ``config.example.yaml``.
"""

from __future__ import annotations

import hashlib
import logging
import os
from typing import Any, Callable

from gateway.config.schema import GatewayConfig, RetrySettings
from gateway.resilience.breaker import Breakers, iso_ms
from gateway.resilience.health import ActiveProber, HealthTracker
from gateway.resilience.ratelimit import Limit, RateLimiter, RateLimitResult, RateReservation
from gateway.resilience.streaming import OpenStreams
from gateway.resilience.attempts import Candidate, Result, call_with_fallback
from gateway.state import SharedState
from policies import candidates, tenant_label

log = logging.getLogger("tandem.gateway.resilience")


class Resilience:
    """State, limiter, breakers and health of one gateway process.

    Args:
        cfg: the gateway config (``gateway.config.schema.GatewayConfig``); only its state section is fixed for the
            process lifetime, the rest is re-read by ``configure`` on every config apply.
    """

    def __init__(self, cfg: GatewayConfig):
        self.state = SharedState(cfg.state)
        self.limiter = RateLimiter(self.state)
        self.breakers = Breakers(self.state)
        self.health = HealthTracker(self.state)
        self.prober: ActiveProber | None = None
        self.streams = OpenStreams()     # the streams relayed or awaiting a first token, for a drain to end
        self.configure(cfg)

    def configure(self, cfg: GatewayConfig) -> None:
        """(Re)read limits, retry, breaker and health settings from a config generation."""
        self.state.replica_scoped = frozenset(n for n, b in cfg.backends.items() if b.type == "local")
        self.state.fail_closed_limits = cfg.state.fail_closed_limits
        self.policy: RetrySettings = cfg.resilience.retry
        self.breakers.config = cfg.resilience.breaker
        self.health.config = cfg.resilience.health
        limits = cfg.limits
        self.limiter.window_ms = int(limits.window_s * 1000)
        self.tenant_limits = {t: Limit("tenant", t, v.rpm, v.tpm) for t, v in limits.tenants.items()}
        self.key_limits: dict[str, Limit] = {}
        for k in cfg.auth.keys:
            if k.rpm is None and k.tpm is None:
                continue
            h = k.sha256
            if h is None and k.env:
                secret = os.environ.get(k.env)
                h = hashlib.sha256(secret.encode()).hexdigest() if secret else None
            if h:
                self.key_limits[h] = Limit("key", h[:16], k.rpm, k.tpm)

    def start(self, backends: Callable[[], dict]) -> None:
        """Start active probes (``resilience.health.interval_s``; 0 = off) of the backends the current config
        has (``backends()``, read each round): ``GET /models`` upstream, engine readiness locally. A local
        engine still loading is not probed: loading is not a failure (``/health/ready`` says ``engine is
        loading`` already), and a failed probe recorded then would outlive the load by up to three rounds; nor is
        an upstream whose key is unset (never callable in this config generation: its warning said so)."""
        self.prober = ActiveProber(self.health, lambda: {name: b.probe for name, b in backends().items()
                                                         if not (b.loading or b.key_missing)})
        self.prober.start()

    async def stop(self) -> None:
        if self.prober is not None:
            await self.prober.stop()
        await self.state.close()

    @property
    def degraded(self) -> bool:
        """Redis configured but unreachable: serving on in-process state."""
        return self.state.degraded

    # -- admission ---------------------------------------------------------------------------------------------
    async def admit(self, tenant: str, token: str | None, tokens: int, request_id: str,
                    guessed: int = 0) -> RateLimitResult:
        """Check and record the RPM/TPM limits of the request's virtual key and tenant. ``guessed``: the part of
        ``tokens`` that is the gateway's default completion (a request without ``max_tokens``), held to the smallest
        TPM limit: such a request is never "too large" for a length it did not ask for (an ops trial's
        ``tpm: 300`` key refused every chat without max_tokens for good); its settle counts what it used."""
        limits = []
        if token and self.key_limits:       # hash the key only when some key has limits
            lim = self.key_limits.get(hashlib.sha256(token.encode()).hexdigest())
            if lim is not None:
                limits.append(lim)
        if (lim := self.tenant_limits.get(tenant_label(tenant))) is not None:   # "": anonymous, as budgets
            limits.append(lim)
        if guessed and (tpms := [lim.tpm for lim in limits if lim.tpm is not None]):
            tokens = max(tokens - guessed, min(tokens, min(tpms)))
        return await self.limiter.acquire(limits, tokens, request_id)

    async def release(self, reservation: RateReservation | None) -> None:
        """Undo an admission of ``admit`` entirely: the request is refused before any backend (its budget)."""
        await self.limiter.release(reservation)

    async def settle(self, reservation: RateReservation | None, usage: dict | None) -> None:
        """Replace a reservation with the real usage (prompt + completion tokens) when the upstream reported it."""
        if reservation is None or not usage:
            return
        total = usage.get("total_tokens")
        if total is None:
            total = int(usage.get("prompt_tokens") or 0) + int(usage.get("completion_tokens") or 0)
        await self.limiter.reconcile(reservation, int(total))

    async def backend_renewed(self, routes: dict, backend: str, why: str) -> None:
        """``backend`` is new since its failures (the local engine loaded again after its core died): close the
        breakers of its targets in ``routes`` (name -> Route), ``why`` logged. A trial's 6 s restart otherwise left
        its route refusing requests for the rest of a 30 s cooldown."""
        ids = sorted({t.id for r in routes.values() for t in (*r.targets, *r.fallbacks) if t.backend == backend})
        for target in ids:
            await self.breakers.reset(target, f"{why} ({backend})")

    # -- status ------------------------------------------------------------------------------------------------
    async def status(self, routes: dict, backends: dict) -> tuple[dict, dict]:
        """What ``/health/ready`` and ``/admin/config`` report: (backends, targets).

        targets: target id -> ``{backend, breaker (closed | open | half_open), cooldown_until (ISO time or
        None), retry_after_s, reason, last_probe}`` for every target and fallback of ``routes``.
        backends: name -> ``{available, reason}``; a configured backend is reported unavailable while its last
        probe failed or every breaker of its targets is open (routing still tries it as breakers allow).
        """
        ids = sorted({(t.id, t.backend) for r in routes.values() for t in (*r.targets, *r.fallbacks)})
        probes = {n: await self.health.last_probe(n) for n in backends}
        targets = {}
        for tid, backend in ids:
            br = await self.breakers.get(tid)
            targets[tid] = {"backend": backend, "breaker": br.state,
                            "cooldown_until": iso_ms(br.open_until_ms) if br.open_until_ms else None,
                            "retry_after_s": round(br.retry_after_s, 3), "reason": br.reason,
                            "last_probe": probes.get(backend)}
        out = {}
        for name, b in backends.items():
            mine = [t for t in targets.values() if t["backend"] == name]
            probe = probes.get(name)
            reason = b.unavailable_reason
            if b.available and probe is not None and not probe["ok"]:
                reason = f"last probe failed at {probe['at']}: {probe['error']}"
            elif b.available and mine and all(t["breaker"] == "open" for t in mine):
                reason = "breaker open until " + min(t["cooldown_until"] for t in mine)
            out[name] = {"available": b.available and reason == b.unavailable_reason, "reason": reason}
        return out, targets

    async def status_or_none(self, routes: dict, backends: dict) -> tuple[dict, dict] | None:
        """``status``, or None when it cannot be read (Redis slow or down): for the answers and warnings of a
        change or a rollout start, which stand without it."""
        try:
            return await self.status(routes, backends)
        except Exception as e:  # noqa: BLE001
            log.info("backend health not read: %s", e)
            return None

    @staticmethod
    def down_backends(health: tuple[dict, dict]) -> dict[str, tuple[str, tuple[str, ...]]]:
        """The backends ``health`` (``status``'s answer) finds unavailable: name -> (why, the target ids on it)."""
        status, targets = health
        return {n: (v["reason"], tuple(t for t, tv in targets.items() if tv["backend"] == n))
                for n, v in status.items() if not v["available"]}

    @staticmethod
    def routes_serving(routes: dict, backends: dict, targets: dict) -> list[str]:
        """The routes that can serve now, from ``status``'s answer: those with a candidate (``policies.candidates``:
        the order a request tries, weight-0 targets included) whose backend is available and whose breaker is not
        open (``/health/ready`` is ``degraded`` when there is none)."""
        return sorted(name for name, r in routes.items()
                      if any(backends.get(t.backend, {}).get("available") and targets.get(t.id, {}).get("breaker")
                             != "open" for t in candidates(r)))

    # -- the attempt loop --------------------------------------------------------------------------------------
    def candidate(self, target: Any, backend: Any) -> Candidate:
        """A route target as the loop sees it. Its name, the key of its breaker and health counters, is the
        target's ``id`` (default ``backend/model``, or ``backend`` when the target names no model), so
        every route naming that id shares one breaker."""
        cfg = backend.cfg
        first_token_s, inter_chunk_s = backend.stream_timeouts(self.policy.deadline_s)
        lims = [Limit("backend", backend.name, cfg.rpm, cfg.tpm)] if cfg.rpm is not None or cfg.tpm is not None else []
        return Candidate(
            name=target.id, target=target,
            max_model_len=getattr(backend, "max_model_len", None),
            first_token_timeout_s=first_token_s, inter_chunk_timeout_s=inter_chunk_s,
            limits=lims)

    async def forward(self, candidates: list[Candidate], attempt, *, stream: bool, required_len: int | None,
                      request_id: str, tokens: int, on_finish=None, prompt_param: str | None = None,
                      answer_len: int | None = 0) -> Result:
        """``call_with_fallback`` with this gateway's breakers, health, limiter and retry policy."""
        return await call_with_fallback(candidates, attempt, stream=stream, policy=self.policy,
                                        breakers=self.breakers, health=self.health, limiter=self.limiter,
                                        required_len=required_len, request_id=request_id, tokens=tokens,
                                        on_finish=on_finish, batch_events=True, prompt_param=prompt_param,
                                        streams=self.streams, answer_len=answer_len)

    def interrupt_streams(self, reason: str) -> int:
        """End every stream still relayed with the ``stream_interrupted`` event naming ``reason``, and each
        committed from now on (``OpenStreams``); how many are open now."""
        return self.streams.interrupt(reason)

