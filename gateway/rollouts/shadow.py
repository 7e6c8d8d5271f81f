"""Shadow traffic: a sample of a route's chat requests sent, in the background, to a candidate and (for the
parity report) again to the primary, both streamed and asked for logprobs and token ids; the client's answer never
waits for them and is never changed by them.

Who is compared (``plans``): a route's ``shadow`` (report ``shadow/<route>``) pairs the target the policy picked
for the request with the shadow's backend; a running or paused rollout (report: its name) pairs its baseline with
its candidate. Each pair counts once against its ``max_concurrency``: over it, the pair is dropped and counted
(``tandem_shadow_requests_total{outcome="dropped"}`` and the report's ``shadow_dropped``). Both calls go straight to
the backends (no retries, no breakers: the primary's health is the client traffic's to judge) and are billed to the
``shadow`` ledger line, never to the request's tenant. The tasks belong to the ``ShadowRunner`` (one per gateway),
which cancels them on stop.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass

from gateway.billing.prices import Price, cost_nusd, usage_tokens
from gateway.billing.usage import UsageRecord
from gateway.errors import BackendError
from gateway.rollouts.parity import Side, compare
from gateway.rollouts.spec import SHADOW_TENANT
from gateway.values import ChatStream
from policies import Target

log = logging.getLogger("tandem.shadow")


@dataclass(frozen=True)
class Plan:
    """One comparison to make: report ``name``, the two targets, the sampled share, the concurrency bound."""

    name: str
    primary: Target
    candidate: Target
    percent: float
    max_concurrency: int
    top_logprobs: int


def plans(snap, active: dict[str, list[dict]], route: str, picked: Target | None) -> list[Plan]:
    """The comparisons a request on ``route`` may take part in (before sampling); ``active``: the controller's
    live rollouts by route; ``picked``: the target the policy chose for the request (None: none)."""
    out = []
    cfg = snap.compiled.config.routes.get(route)
    if (cfg is None or cfg.shadow is None) and not active.get(route):
        return out                       # the common case: nothing to compare on this route
    if cfg is not None and cfg.shadow is not None and picked is not None:
        s = cfg.shadow
        out.append(Plan(f"shadow/{route}", picked, Target(s.target, s.model, id=s.target), s.percent,
                        s.max_concurrency, s.top_logprobs))
    targets = {t.id: t for t in snap.compiled.policy.routes[route].targets} if route in snap.compiled.policy.routes \
        else {}
    for r in active.get(route, []):
        base, cand = targets.get(r["baseline"]), targets.get(r["candidate"])
        if base is not None and cand is not None:
            spec = r["spec"]
            out.append(Plan(r["name"], base, cand, spec["sample_percent"], spec["max_concurrency"],
                            spec["top_logprobs"]))
    return out


def shadow_body(body: dict, model: str, top: int, ids: bool) -> dict:
    """The client's chat body as a shadow call sends it: streamed with usage, logprobs (``top`` alternatives) and,
    when ``ids``, the engine's token ids (vLLM's ``return_token_ids``)."""
    out = {k: v for k, v in body.items() if k not in ("priority", "stream_options", "n")}
    out.update(model=model, stream=True, stream_options={"include_usage": True}, logprobs=True)
    if top:
        out["top_logprobs"] = top
    if ids:
        out["return_token_ids"] = True
    return out


async def read_side(events: ChatStream, started: float) -> tuple[Side, dict | None]:
    """Read a streamed chat answer (its events) into a ``Side`` and its usage (None when the stream gave none);
    the stream is closed once read."""
    try:
        return await _read(events, started)
    finally:
        await events.aclose()


async def _read(events: ChatStream, started: float) -> tuple[Side, dict | None]:
    ids, strings, lps, tops, times, usage, text = [], [], [], [], [], None, []
    async for batch in events:
        for ev in batch:
            if ev.done:
                return _side(ids, strings, lps, tops, times, text, started), usage
            if ev.error or ev.malformed:
                err = ev.error
                return Side(False, error=str(err.get("message", "")) if isinstance(err, dict) else ""), usage
            usage = ev.usage or usage
            for ch in ev.choices:
                n_before = len(ids) + len(strings) + len(text)
                ids += ch.token_ids or []
                for e in ((ch.logprobs or {}).get("content") or []):
                    strings.append(e.get("token"))
                    lps.append(e.get("logprob"))
                    tops.append({t["token"]: t["logprob"] for t in e.get("top_logprobs") or []})
                if ch.content and not ch.logprobs:
                    text.append(ch.content)
                if len(ids) + len(strings) + len(text) > n_before:
                    times.append(time.monotonic())
    return _side(ids, strings, lps, tops, times, text, started), usage


def _side(ids: list, strings: list, lps: list, tops: list, times: list, text: list, started: float) -> Side:
    tokens = ids or strings or text
    ttft = times[0] - started if times else None
    tpot = (times[-1] - times[0]) / (len(tokens) - 1) if times and len(tokens) > 1 else None
    return Side(True, tokens, bool(ids), lps, tops, ttft, tpot)


class ShadowRunner:
    """Shadow and parity calls of one gateway: ``offer`` samples a request and starts its pairs as tasks it
    owns; ``stop`` cancels them. ``store``: ``gateway.rollouts.store.RolloutStore``; ``usage``: the ledger;
    ``counter``: ``tandem_shadow_requests_total`` (labels rollout, outcome); ``local_price``: backend name -> the
    price the ledger bills it at instead of its configured ``prices`` (``Gateway.local_billing_price``: the local
    engine's from ``local.cost``), so a shadow call costs what the same call from a client would; ``spent``:
    ``GatewayMetrics.spent``, the tokens and cost metrics every billed call adds to (the ``shadow`` tenant's
    here)."""

    def __init__(self, store, usage, counter, rng: random.Random | None = None,
                 local_price=lambda backend: None, spent=lambda backend, tenant, tokens, nusd: None):
        self.store, self.usage, self.counter = store, usage, counter
        self.local_price, self.spent = local_price, spent
        self.rng = rng or random.Random()
        self.in_flight: dict[str, int] = {}
        self.tasks: set[asyncio.Task] = set()
        self.no_ids: set[str] = set()      # backends that refused return_token_ids

    def offer(self, snap, active: dict, req, decision) -> int:
        """Start the sampled pairs of ``req`` (served on ``decision``); returns how many started. Only whole-turn
        chat requests with one choice are mirrored."""
        if req.endpoint != "chat/completions" or (req.body.get("n") or 1) != 1 or req.anthropic_body is not None:
            return 0
        started = 0
        picked = decision.attempts[0] if decision.attempts else None
        for plan in plans(snap, active, decision.route, picked):
            if self.rng.random() * 100 >= plan.percent:
                continue
            if self.in_flight.get(plan.name, 0) >= plan.max_concurrency:
                self.counter.labels(plan.name, "dropped").inc()
                self._spawn(self.store.count_dropped(plan.name))
                continue
            self.in_flight[plan.name] = self.in_flight.get(plan.name, 0) + 1
            self.counter.labels(plan.name, "sent").inc()
            self._spawn(self._pair(snap, req, plan))
            started += 1
        return started

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _pair(self, snap, req, plan: Plan) -> None:
        try:
            (p, pu), (c, cu) = await asyncio.gather(self._call(snap, req, plan, plan.primary, "primary"),
                                                    self._call(snap, req, plan, plan.candidate, "candidate"))
            if not (p.ok and c.ok):
                log.info("shadow %s of %s: primary %s; candidate %s", plan.name, req.request_id,
                         p.error or "ok", c.error or "ok")
            await self.store.push_record(plan.name, {**compare(p, c), "at": time.time()})
            for side, target, result, usage in (("primary", plan.primary, p, pu),
                                                ("candidate", plan.candidate, c, cu)):
                await self._bill(snap, req, plan, side, target, usage, failed=not result.ok)
        except Exception:  # noqa: BLE001 -- a shadow never fails anything but itself
            log.exception("shadow pair %s of %s failed", plan.name, req.request_id)
        finally:
            self.in_flight[plan.name] -= 1

    async def _call(self, snap, req, plan: Plan, target: Target, side: str) -> tuple[Side, dict | None]:
        backend = snap.backends.get(target.backend)
        if backend is None or not backend.available or "chat/completions" not in backend.endpoints:
            return Side(False, error=f"{target.backend}: unavailable"), None
        rid = f"{req.request_id}-{plan.name}-{side}"
        model = backend.upstream_model(req.public_model, target.model)
        ids = target.backend not in self.no_ids
        deadline = snap.compiled.config.resilience.retry.deadline_s
        started = time.monotonic()
        try:
            async with asyncio.timeout(deadline):
                try:
                    chunks = await backend.open_chat_stream(req, rid, shadow_body(req.body, model, plan.top_logprobs, ids))
                except BackendError as e:
                    if not (ids and e.kind == "http" and e.status == 400):
                        raise
                    self.no_ids.add(target.backend)      # an upstream that does not take vLLM's extra field
                    chunks = await backend.open_chat_stream(req, rid,
                                                            shadow_body(req.body, model, plan.top_logprobs, False))
                return await read_side(chunks, started)
        except Exception as e:  # noqa: BLE001 -- any failure of the side is its error, counted in the report
            return Side(False, error=f"{type(e).__name__}: {e}"), None

    async def _bill(self, snap, req, plan: Plan, side: str, target: Target, usage: dict | None,
                    failed: bool = False) -> None:
        """One usage record of a shadow side (the ``shadow`` tenant's): its tokens at its price, or, a side that
        failed before its usage, a failed record of no cost (an ops trial counted 480 canary records to 520
        primary ones, its 40 failed calls in none)."""
        tokens = usage_tokens(usage)
        if tokens is None:
            if failed:
                await self.usage.settle(UsageRecord(f"{req.request_id}:{plan.name}:{side}", SHADOW_TENANT,
                                                    target.backend, 0, 0, 0, 0, failed=True))
            return
        backend = snap.backends.get(target.backend)
        price = self.local_price(target.backend) or Price.of(getattr(backend.cfg, "prices", None))
        nusd = cost_nusd(price, *tokens)
        self.spent(target.backend, SHADOW_TENANT, tokens, nusd)
        await self.usage.settle(UsageRecord(f"{req.request_id}:{plan.name}:{side}", SHADOW_TENANT, target.backend,
                                            *tokens, nusd))

    async def stop(self) -> None:
        for t in list(self.tasks):
            t.cancel()
        if self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)
