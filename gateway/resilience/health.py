"""Backend health: passive (every request's outcome) and active (a probe per backend at an interval).

Passive: each outcome adds to per-minute counters of its target (requests, errors, latency sum, TTFT sum), a
Redis HASH ``tandem:health:<target>:<minute>`` that expires after two minutes (batched: added at most once a
second per replica), so every replica reads the same numbers; ``stats`` sums the current and the previous minute
(a 60-120 s window). In process without Redis.

Active: ``ActiveProber`` calls one probe coroutine per backend every ``interval_s`` (e.g. ``GET /v1/models``
upstream, ``engine.ready`` locally) with a timeout and stores the result in ``tandem:probe:<backend>``
(expires after three intervals). A backend is unhealthy when its last probe failed, or when its passive error
rate over at least ``min_requests`` outcomes reaches ``max_error_rate``. Breakers decide admission; health is
a signal for routing (policies) and for ``/health/ready``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Awaitable, Callable

from gateway.config.schema import HealthSettings
from gateway.state import SharedState, now_ms
from gateway.tasks import cancel_task

log = logging.getLogger("tandem.health")


@dataclass
class TargetHealth:
    """Passive and active health of one target over the last one to two minutes.

    latency_s / ttft_s: mean end-to-end latency and time to first token, seconds (None: no sample).
    probe_ok: result of the last active probe (None: never probed or expired).
    """

    target: str
    requests: int = 0
    errors: int = 0
    latency_s: float | None = None
    ttft_s: float | None = None
    probe_ok: bool | None = None
    probe_latency_s: float | None = None
    probe_error: str = ""

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0

    def healthy(self, cfg: HealthSettings) -> bool:
        if self.probe_ok is False:
            return False
        return not (self.requests >= cfg.min_requests and self.error_rate >= cfg.max_error_rate)


class HealthTracker:
    """Passive health counters and the last active probe result per target (shared through ``SharedState``)."""

    def __init__(self, state: SharedState, config: HealthSettings | None = None, flush_interval_s: float = 1.0):
        self.state = state
        self.config = config or HealthSettings()
        self.flush_interval_s = flush_interval_s
        self._local: dict[str, dict[str, int]] = {}     # in-process buckets (no Redis, or Redis down)
        self._pending: dict[str, dict[str, int]] = {}   # deltas not yet added to Redis
        self._probes: dict[str, dict] = {}
        self._last_flush = 0.0
        self._flush_task: asyncio.Task | None = None

    def _bucket(self, target: str, minute: int) -> str:
        return self.state.key("health", f"{target}:{minute}")

    async def record(self, target: str, ok: bool, latency_s: float | None = None, ttft_s: float | None = None,
                     now: int | None = None) -> None:
        """Add one outcome of ``target`` (latency and TTFT in seconds when known).

        With Redis the counts are batched in process and added to Redis at most every ``flush_interval_s``
        (one pipelined round trip for all targets), so recording costs no Redis call per request.
        """
        now = now_ms() if now is None else now
        key = self._bucket(target, now // 60000)
        d = {"n": 1, "e": 0 if ok else 1}
        if latency_s is not None:
            d["lat"], d["latn"] = int(latency_s * 1000), 1
        if ttft_s is not None:
            d["ttft"], d["ttftn"] = int(ttft_s * 1000), 1
        if self.state.redis is None:
            self._merge(self._local, {key: d})
            self._expire_local(now)
            return
        self._merge(self._pending, {key: d})
        t = time.monotonic()
        if t - self._last_flush >= self.flush_interval_s and (self._flush_task is None or self._flush_task.done()):
            self._last_flush = t
            self._flush_task = asyncio.get_running_loop().create_task(self.flush())

    @staticmethod
    def _merge(into: dict[str, dict[str, int]], deltas: dict[str, dict[str, int]]) -> None:
        for key, d in deltas.items():
            h = into.setdefault(key, {})
            for f, v in d.items():
                h[f] = h.get(f, 0) + v

    def _expire_local(self, now: int) -> None:
        for old in [k for k in self._local if int(k.rsplit(":", 1)[1]) < now // 60000 - 1]:
            del self._local[old]

    async def flush(self) -> None:
        """Add the batched counts to Redis (in process while Redis is unreachable)."""
        pending, self._pending = self._pending, {}
        if not pending:
            return

        async def write(r) -> None:
            pipe = r.pipeline(transaction=False)
            for key, d in pending.items():
                for f, v in d.items():
                    pipe.hincrby(key, f, v)
                pipe.pexpire(key, 120_000)
            await pipe.execute()

        def local() -> None:
            self._merge(self._local, pending)
            self._expire_local(now_ms())

        await self.state.call(write, local)

    async def stats(self, target: str, now: int | None = None) -> TargetHealth:
        """Health of ``target``: passive counters of this and the previous minute plus the last probe."""
        now = now_ms() if now is None else now
        if self.state.redis is not None:
            await self.flush()
        minute = now // 60000
        keys = [self._bucket(target, minute - 1), self._bucket(target, minute)]
        probe_key = self.state.key("probe", target)

        async def read(r) -> tuple[list[dict], dict]:
            pipe = r.pipeline(transaction=False)
            for k in keys:
                pipe.hgetall(k)
            pipe.hgetall(probe_key)
            res = await pipe.execute()
            return res[:-1], res[-1]

        buckets, probe = await self.state.call(
            read, lambda: ([self._local.get(k, {}) for k in keys], self._probes.get(probe_key, {})))
        tot = {f: sum(int(b.get(f, 0)) for b in buckets) for f in ("n", "e", "lat", "latn", "ttft", "ttftn")}
        th = TargetHealth(target=target, requests=tot["n"], errors=tot["e"],
                          latency_s=tot["lat"] / tot["latn"] / 1000 if tot["latn"] else None,
                          ttft_s=tot["ttft"] / tot["ttftn"] / 1000 if tot["ttftn"] else None)
        if probe and int(probe.get("exp", 0)) > now:
            th.probe_ok = str(probe.get("ok")) == "1"
            th.probe_latency_s = int(probe.get("lat", 0)) / 1000
            th.probe_error = str(probe.get("err", ""))
        return th

    async def last_probe(self, target: str, now: int | None = None) -> dict | None:
        """The last active probe of ``target`` while it counts: ``{"ok", "at" (ISO time), "latency_s",
        "error"}``; None when never probed or expired."""
        now = now_ms() if now is None else now
        key = self.state.key("probe", target)
        p = await self.state.call(lambda r: r.hgetall(key), lambda: self._probes.get(key, {}))
        if not p or int(p.get("exp", 0)) <= now:
            return None
        at = datetime.fromtimestamp(int(p.get("at", 0)) / 1000, timezone.utc)
        return {"ok": str(p.get("ok")) == "1", "at": at.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
                "latency_s": int(p.get("lat", 0)) / 1000, "error": str(p.get("err", ""))}

    async def record_probe(self, target: str, ok: bool, latency_s: float, error: str = "",
                           now: int | None = None) -> None:
        """Store an active probe's result; it counts for three probe intervals."""
        now = now_ms() if now is None else now
        ttl = int(max(self.config.interval_s, 1.0) * 3000)
        key = self.state.key("probe", target)
        mapping = {"ok": int(ok), "lat": int(latency_s * 1000), "err": error[:200], "at": now, "exp": now + ttl}

        async def write(r) -> None:
            pipe = r.pipeline(transaction=True)
            pipe.hset(key, mapping=mapping)
            pipe.pexpire(key, ttl)
            await pipe.execute()

        def local() -> None:
            self._probes[key] = mapping

        local()  # keep the last result in process too, for an outage
        await self.state.call(write, lambda: None)


FAILING_ROUNDS = 2   # probes failed in a row before the log says so (ActiveProber._say)
OFF_RECHECK_S = 1.0  # while probing is off (interval_s 0), how often the loop looks whether a reload turned it on


class ActiveProber:
    """Runs ``probes[target]()`` for every target each ``config.interval_s`` seconds and records the results.

    ``probes`` is a dict or a function returning one (read each round, e.g. after a config reload).

    A probe is any coroutine function that raises (or times out after ``config.timeout_s``) when the backend
    is not healthy. ``start`` launches a background task; ``stop`` cancels it. The period is read each round, so
    a reload that sets ``interval_s`` to 0 stops probing and one that sets it above 0 starts it (an observability
    trial's reload to 0 probed every upstream ~470 times a second, and one from 0 never started).
    """

    def __init__(self, tracker: HealthTracker, probes: dict[str, Callable[[], Awaitable[object]]]
                 | Callable[[], dict[str, Callable[[], Awaitable[object]]]]):
        self.tracker = tracker
        self.probes = probes  # or a function returning them, called each round
        self._task: asyncio.Task | None = None
        self._failing: dict[str, int] = {}   # target -> probes failed in a row

    async def probe_once(self) -> dict[str, bool]:
        """Probe every target concurrently once; returns target -> ok."""
        probes = self.probes() if callable(self.probes) else self.probes
        names = list(probes)
        results = await asyncio.gather(*(self._probe(t, probes[t]) for t in names))
        return dict(zip(names, results))

    async def probe(self, target: str) -> bool | None:
        """Probe ``target`` now and record the result (a question that cannot wait for the next round: the
        gateway has just started); None when it has no probe."""
        probes = self.probes() if callable(self.probes) else self.probes
        return None if target not in probes else await self._probe(target, probes[target])

    async def _probe(self, target: str, probe: Callable[[], Awaitable[object]]) -> bool:
        t0 = time.monotonic()
        try:
            await asyncio.wait_for(probe(), self.tracker.config.timeout_s)
            ok, err = True, ""
        except Exception as exc:
            ok, err = False, f"{type(exc).__name__}: {exc}"
        await self.tracker.record_probe(target, ok, time.monotonic() - t0, err)
        self._say(target, ok, err)
        return ok

    def _say(self, target: str, ok: bool, err: str) -> None:
        """Log a target whose probe failed ``FAILING_ROUNDS`` times in a row (once), and its first pass after:
        a new user's trial saw nothing in the log of a canary backend that could not be reached, only in
        ``/health/ready``. One failed round is not said: a blip (one timeout, a connection reset) is not news."""
        failed = 0 if ok else self._failing.get(target, 0) + 1
        if failed == FAILING_ROUNDS:
            log.warning("health probe of %s failed %d times in a row: %s (/health/ready lists it unavailable)",
                        target, failed, err)
        elif ok and self._failing.get(target, 0) >= FAILING_ROUNDS:
            log.info("health probe of %s passes again", target)
        self._failing[target] = failed

    async def _loop(self) -> None:
        while True:
            interval = self.tracker.config.interval_s
            if interval <= 0:                  # off: look again later (a reload may turn it on)
                await asyncio.sleep(OFF_RECHECK_S)
                continue
            try:
                await self.probe_once()
            except Exception:
                log.exception("active health probe round failed")
            await asyncio.sleep(interval)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        self._task = await cancel_task(self._task)

