"""Load of the engine replicas behind ``prefix_affinity`` routes, as the routing policy reads it
(``policies/affinity.py``), and their per-replica metrics.

Each target of a ``prefix_affinity`` route is an OpenAI-compatible engine (``tandem engine serve`` or vLLM):
its ``GET /metrics`` (the base URL without ``/v1``) is read every ``affinity.metrics_interval_s`` for
``vllm:num_requests_running``, ``vllm:num_requests_waiting`` and ``vllm:kv_cache_usage_perc`` (0..1). Between two
reads the gateway's own in-flight change is added: load = running + waiting at the last read + (in flight now -
in flight at that read), at least the in flight now. A replica whose metrics do not answer is ``alive=False``.

Metrics (in the gateway's registry): ``tandem_replica_routed_total{route, target}`` (upstream calls started),
``tandem_replica_affinity_total{route, target, outcome}`` (``hit``: the chosen replica served this prefix
last time this gateway saw it; ``miss``: new prefix or another replica), ``tandem_replica_spillovers_total
{route, target}`` (requests whose home replica, the label, was over its load bound or dead).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections import OrderedDict
from dataclasses import dataclass

import httpx
from prometheus_client import CollectorRegistry, Counter

from gateway.tasks import cancel_task
from gateway.resilience.outcomes import UpstreamResponse
from policies import ReplicaLoad

log = logging.getLogger("tandem.replicas")

_METRIC = re.compile(r"^(vllm:num_requests_running|vllm:num_requests_waiting|vllm:kv_cache_usage_perc)"
                     r"(?:\{[^}]*\})?\s+([0-9.eE+-]+|NaN)", re.M)
_LRU_SIZE = 50_000


def parse_load(text: str) -> ReplicaLoad:
    """A replica's load from its Prometheus text (label sets summed)."""
    v = {"vllm:num_requests_running": 0.0, "vllm:num_requests_waiting": 0.0, "vllm:kv_cache_usage_perc": 0.0}
    for name, value in _METRIC.findall(text):
        if value != "NaN":
            v[name] += float(value)
    return ReplicaLoad(v["vllm:num_requests_running"], v["vllm:num_requests_waiting"], v["vllm:kv_cache_usage_perc"])


@dataclass
class _Replica:
    url: str                       # .../metrics
    scraped: ReplicaLoad = ReplicaLoad()
    in_flight_at_scrape: int = 0


class ReplicaLoads:
    """Loads and metrics of the replicas of the current config's ``prefix_affinity`` routes (one per gateway).

    ``configure`` on every config version; ``start``/``stop`` the polling task; ``loads()`` for the policy;
    ``track(attempt)`` wraps the attempt function to count in-flight calls; ``note(route, pick)`` after a decision.
    """

    def __init__(self, registry: CollectorRegistry):
        self._replicas: dict[str, _Replica] = {}
        self.in_flight: dict[str, int] = {}
        self.interval_s = 0.5
        self._route_of: dict[str, str] = {}
        self._last: OrderedDict[str, str] = OrderedDict()      # prefix key -> target id it went to
        self._task: asyncio.Task | None = None
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(2.0, connect=0.5))
        r = registry
        self.routed = Counter("tandem_replica_routed", "Upstream calls per engine replica.", ["route", "target"],
                              registry=r)
        self.affinity = Counter("tandem_replica_affinity", "Prefix affinity hits/misses per chosen replica.",
                                ["route", "target", "outcome"], registry=r)
        self.spillovers = Counter("tandem_replica_spillovers", "Requests whose home replica (label) was over its "
                                  "load bound or dead.", ["route", "target"], registry=r)

    def configure(self, compiled, backends: dict) -> None:
        """Track the targets of the ``prefix_affinity`` routes of a new config version (``compiled``: its
        ``gateway.config.compile.Compiled``), keeping the state of replicas that stay; calls in flight on
        removed ones still finish and are counted down."""
        wanted: dict[str, str] = {}
        self._route_of = {}
        intervals = []
        for name, r in compiled.policy.routes.items():
            if r.select != "prefix_affinity":
                continue
            intervals.append(compiled.config.routes[name].affinity.metrics_interval_s)
            for t in r.targets:
                b = backends.get(t.backend)
                if b is not None and b.kind == "openai":
                    wanted[t.id] = re.sub(r"/v1$", "", b.cfg.base_url) + "/metrics"
                    self._route_of[t.id] = name
        self.interval_s = min(intervals, default=0.5)
        self._replicas = {tid: self._replicas[tid] if tid in self._replicas and self._replicas[tid].url == url
                          else _Replica(url) for tid, url in wanted.items()}

    @property
    def tracked(self) -> bool:
        """Some route of the current config selects by prefix affinity."""
        return bool(self._replicas)

    def loads(self) -> dict[str, ReplicaLoad]:
        """target id -> its load now (the last read plus this gateway's in-flight change since)."""
        out = {}
        for tid, r in self._replicas.items():
            now = self.in_flight.get(tid, 0)
            s = r.scraped
            extra = now - r.in_flight_at_scrape
            running = max(s.running + extra, float(now))
            out[tid] = ReplicaLoad(running, s.waiting, s.kv_usage, s.alive)
        return out

    async def poll_once(self) -> None:
        """Read every replica's ``/metrics`` once, concurrently."""

        async def one(tid: str, r: _Replica) -> None:
            at = self.in_flight.get(tid, 0)
            try:
                resp = await self._client.get(r.url)
                resp.raise_for_status()
                r.scraped, r.in_flight_at_scrape = parse_load(resp.text), at
            except (httpx.HTTPError, OSError) as e:
                if r.scraped.alive:
                    log.warning("replica %s: metrics unreachable (%s); ranked last until they answer", tid,
                                type(e).__name__)
                r.scraped, r.in_flight_at_scrape = ReplicaLoad(alive=False), at

        await asyncio.gather(*(one(t, r) for t, r in list(self._replicas.items())))

    async def _loop(self) -> None:
        while True:
            if self._replicas:
                try:
                    await self.poll_once()
                except Exception:  # noqa: BLE001 -- a bad scrape must not stop the loop
                    log.exception("replica metrics poll failed")
            await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        self._task = await cancel_task(self._task)
        await self._client.aclose()

    # -- per request ---------------------------------------------------------------------------------------------
    def note(self, route: str, pick) -> None:
        """Count a ``prefix_affinity`` decision: affinity hit or miss of the chosen replica, spill-over of its
        home. ``pick``: the decision's ``policies.Pick``."""
        if not pick.prefix_key or pick.target is None:
            return
        chosen = pick.target.id
        prev = self._last.pop(pick.prefix_key, None)
        self._last[pick.prefix_key] = chosen
        if len(self._last) > _LRU_SIZE:
            self._last.popitem(last=False)
        self.affinity.labels(route, chosen, "hit" if prev == chosen else "miss").inc()
        if chosen != pick.home:
            self.spillovers.labels(route, pick.home).inc()

    def hold(self, tid: str):
        """Count one call in flight on replica ``tid`` from now: returns the function that ends it (idempotent),
        or None when ``tid`` is not a tracked replica. The gateway's attempt loop (``track``) and the endpoint
        picker (``gateway/picker/``) count through here."""
        if tid not in self._replicas:
            return None
        self.in_flight[tid] = self.in_flight.get(tid, 0) + 1
        self.routed.labels(self._route_of.get(tid, ""), tid).inc()
        done = False

        def end() -> None:
            nonlocal done
            if not done:
                done = True
                self.in_flight[tid] -= 1

        return end

    def track(self, attempt):
        """``attempt`` (one upstream call of the attempt loop) counting calls in flight per tracked replica, from
        the call until its answer is read or its stream closed."""

        async def tracked(c) -> UpstreamResponse:
            end = self.hold(c.target.id)
            if end is None:
                return await attempt(c)
            try:
                resp = await attempt(c)
            except BaseException:
                end()
                raise
            if resp.events is None:
                end()
                return resp
            close = resp.aclose

            async def aclose() -> None:
                end()
                if close is not None:
                    await close()

            resp.aclose = aclose
            return resp

        return tracked
