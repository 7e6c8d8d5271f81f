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
from typing import Any, Callable

from gateway.resilience.breaker import BreakerConfig, Breakers
from gateway.resilience.health import ActiveProber, HealthConfig, HealthTracker
from gateway.resilience.ratelimit import Limit, RateLimiter, RateLimitResult, RateReservation
from gateway.resilience.attempts import Candidate, Result, RetryPolicy, call_with_fallback
from gateway.state import SharedState, StateConfig

log = logging.getLogger("tandem.gateway.resilience")


def _get(obj: Any, name: str, default: Any = None) -> Any:
    """``obj.name`` for pydantic models and dicts alike, ``default`` when absent or None."""
    if obj is None:
        return default
    v = obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)
    return default if v is None else v


def _fields(obj: Any, cls: type) -> dict:
    """The fields of dataclass ``cls`` that ``obj`` sets."""
    import dataclasses

    return {f.name: _get(obj, f.name) for f in dataclasses.fields(cls) if _get(obj, f.name) is not None}


class Resilience:
    """State, limiter, breakers and health of one gateway process.

    Args:
        cfg: the gateway config (``gateway.config.schema.GatewayConfig``); only its state section is fixed for the
            process lifetime, the rest is re-read by ``configure`` on every config apply.
    """

    def __init__(self, cfg: Any):
        st = _get(cfg, "state")
        self.state = SharedState(StateConfig(
            redis_url=_get(st, "redis_url"), timeout_s=_get(st, "socket_timeout_s", 0.25),
            key_prefix=_get(st, "key_prefix", "tandem"), fail_closed_limits=_get(st, "fail_closed_limits", False)))
        self.limiter = RateLimiter(self.state)
        self.breakers = Breakers(self.state)
        self.health = HealthTracker(self.state)
        self.prober: ActiveProber | None = None
        self.policy = RetryPolicy()
        self.key_limits: dict[str, Limit] = {}
        self.tenant_limits: dict[str, Limit] = {}
        self.default_completion_tokens = 512
        self.configure(cfg)

    def configure(self, cfg: Any) -> None:
        """(Re)read limits, retry and breaker settings from a config generation."""
        res = _get(cfg, "resilience")
        self.policy = RetryPolicy(**_fields(_get(res, "retry"), RetryPolicy))
        self.breakers.config = BreakerConfig(**_fields(_get(res, "breaker"), BreakerConfig))
        self.health.config = HealthConfig(**_fields(_get(res, "health"), HealthConfig))
        limits = _get(cfg, "limits")
        self.limiter.window_ms = int(_get(limits, "window_s", 60.0) * 1000)
        self.default_completion_tokens = _get(limits, "default_completion_tokens", 512)
        self.tenant_limits = {t: Limit("tenant", t, _get(v, "rpm"), _get(v, "tpm"))
                              for t, v in (_get(limits, "tenants", {}) or {}).items()}
        self.key_limits = {}
        for k in _get(_get(cfg, "auth"), "keys", []) or []:
            if _get(k, "rpm") is None and _get(k, "tpm") is None:
                continue
            h = _get(k, "sha256")
            if h is None and _get(k, "env"):
                import os

                secret = os.environ.get(_get(k, "env"))
                h = hashlib.sha256(secret.encode()).hexdigest() if secret else None
            if h:
                self.key_limits[h] = Limit("key", h[:16], _get(k, "rpm"), _get(k, "tpm"))

    def start(self, backends: Callable[[], dict]) -> None:
        """Start active probes (``resilience.health.interval_s``; 0 = off) of the backends the current config
        has (``backends()``, read each round): ``GET /models`` upstream, engine readiness locally."""
        self.prober = ActiveProber(self.health, lambda: {name: _probe_for(b) for name, b in backends().items()})
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
    def estimate_tokens(self, prompt_tokens: int | None, max_tokens: int | None) -> int:
        """Tokens reserved at admission: estimated prompt + max_tokens (or the configured default)."""
        return int(prompt_tokens or 0) + int(max_tokens if max_tokens is not None else self.default_completion_tokens)

    async def admit(self, tenant: str, token: str | None, tokens: int, request_id: str) -> RateLimitResult:
        """Check and record the RPM/TPM limits of the request's virtual key and tenant."""
        limits = []
        if token and self.key_limits:       # hash the key only when some key has limits
            lim = self.key_limits.get(hashlib.sha256(token.encode()).hexdigest())
            if lim is not None:
                limits.append(lim)
        if (lim := self.tenant_limits.get(tenant)) is not None:
            limits.append(lim)
        return await self.limiter.acquire(limits, tokens, request_id)

    async def settle(self, reservation: RateReservation | None, usage: dict | None) -> None:
        """Replace a reservation with the real usage (prompt + completion tokens) when the upstream reported it."""
        if reservation is None or not usage:
            return
        total = usage.get("total_tokens")
        if total is None:
            total = int(usage.get("prompt_tokens") or 0) + int(usage.get("completion_tokens") or 0)
        await self.limiter.reconcile(reservation, int(total))

    # -- the attempt loop --------------------------------------------------------------------------------------
    def candidate(self, target: Any, backend: Any) -> Candidate:
        """A route target as the loop sees it (breaker key ``backend/model`` or the backend name)."""
        cfg = backend.cfg
        timeouts = _get(cfg, "timeouts")
        local = backend.kind == "local"
        lims = []
        if _get(cfg, "rpm") is not None or _get(cfg, "tpm") is not None:
            lims.append(Limit("backend", backend.name, _get(cfg, "rpm"), _get(cfg, "tpm")))
        return Candidate(
            name=f"{backend.name}/{target.model}" if target.model else backend.name, target=target,
            max_model_len=getattr(backend, "max_model_len", None),
            # the local engine queues under load: its first token is bounded by the request deadline only
            first_token_timeout_s=self.policy.deadline_s if local else _get(timeouts, "first_token_s"),
            inter_chunk_timeout_s=_get(timeouts, "inter_chunk_s", _get(timeouts, "read_s")),
            limits=lims)

    async def forward(self, candidates: list[Candidate], attempt, *, stream: bool, required_len: int | None,
                      request_id: str, tokens: int, on_finish=None) -> Result:
        """``call_with_fallback`` with this gateway's breakers, health, limiter and retry policy."""
        return await call_with_fallback(candidates, attempt, stream=stream, policy=self.policy,
                                        breakers=self.breakers, health=self.health, limiter=self.limiter,
                                        required_len=required_len, request_id=request_id, tokens=tokens,
                                        on_finish=on_finish, batch_events=True)


def _probe_for(backend: Any):
    async def probe() -> None:
        if backend.kind == "local":
            if not backend.available:
                raise RuntimeError(backend.unavailable_reason or "engine not ready")
            return
        if not backend.available:
            raise RuntimeError(backend.unavailable_reason)
        r = await backend.client.get("models")
        if r.status_code >= 500:
            raise RuntimeError(f"GET /models: HTTP {r.status_code}")

    return probe
