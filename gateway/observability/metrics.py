"""The gateway's Prometheus metrics (``GET /metrics``, text format), in one
``CollectorRegistry`` per app (no module-level registry).

Per request (label ``model`` = the public model, ``tenant`` = the virtual
key's tenant, ``backend`` = the backend that answered or ``none``):

- ``tandem_requests_total{model, route, backend, status, attempt, tenant}``: finished
  requests; ``attempt`` is the kind of the call that produced the answer:
  ``initial``, ``retry`` (the same target again) or ``fallback`` (another
  target), ``none`` when no backend was called (refused, 4xx).
- ``tandem_request_duration_seconds{model, route, backend}``: end to end
  (arrival to last byte), histogram.
- ``tandem_time_to_first_token_seconds{model, backend}``: streams, arrival to
  the first chunk sent to the client.
- ``tandem_upstream_latency_seconds{backend, outcome}``: one per upstream
  call (a stream: to its first content, or its failure before it; else the whole
  answer). A stream's outcome is known there: one that fails before content is
  its failure (``timeout``, ``stream_cut``, ...), not its 200 headers.
- ``tandem_upstream_attempts_total{backend, attempt, outcome}``; retries and
  fallbacks: ``tandem_retries_total{route, backend}``,
  ``tandem_fallbacks_total{route, backend}`` (backend = the one called).
- ``tandem_input_tokens_total``, ``tandem_output_tokens_total``,
  ``tandem_cost_usd_total`` ``{backend, tenant}``.
- ``tandem_cache_lookups_total{route, outcome}`` (``hit``, ``miss``,
  ``bypass``) and ``tandem_cache_mismatches_total{route}`` (spot-checked hits
  that differed from their recomputation: the key space is switched off).
- ``tandem_rate_limit_rejections_total{tenant, code}`` (code
  ``rate_limit_exceeded``, ``budget_exceeded``, ...).
- ``tandem_stream_errors_total{model, backend}``: streams that ended with an
  error event after their 200 (the backend failed or cut mid-stream: the
  client got ``stream_interrupted``); ``tandem_requests_total`` counts them
  under 200, the status they were answered with.
- ``tandem_usage_estimated_total{backend, tenant}``: usage records the
  gateway counted itself (no usage from the backend, or a client gone
  mid-stream).

At scrape time: ``tandem_requests_in_flight``, ``tandem_redis_degraded``
(0/1), ``tandem_usage_journal_entries`` (settles waiting for Redis),
``tandem_config_info{version, source}`` (1), ``tandem_breaker_state
{backend, target}`` (0 closed, 1 half-open, 2 open), ``tandem_budget_usd``
``{tenant, period}`` and ``tandem_budget_spent_usd{tenant, period}``.
With the local engine co-located, the engine's ``vllm:*`` metrics
(``engine.metrics.EngineMetrics``) are in the same registry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from engine.metrics import EngineMetrics
from gateway.billing.prices import NANO

# Seconds. End-to-end and upstream latency of LLM calls span milliseconds to minutes.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)

BREAKER_VALUES = {"closed": 0, "half_open": 1, "half-open": 1, "open": 2}


@dataclass(frozen=True)
class LiveGauges:
    """The gateway's state read at scrape time: requests in flight, Redis degraded, the active config version."""

    in_flight: int = 0
    redis_degraded: bool = False
    config_version: int | None = None
    config_source: str = ""
    usage_journal: int = 0                 # settles made during a Redis outage, not replayed yet
    engine_restarts: int | None = None     # the local engine's restarts after its core died (None: no local one)


class _Live:
    """Scrape-time gauges: ``live()`` (read at each scrape) and ``cache`` (breaker states and budgets, refreshed
    asynchronously just before each scrape)."""

    def __init__(self, live: Callable[[], LiveGauges], cache: dict):
        self.live = live
        self.cache = cache

    def describe(self):
        return []

    def collect(self):
        now = self.live()
        g = GaugeMetricFamily("tandem_requests_in_flight", "Requests being served (streams until their end).")
        g.add_metric([], float(now.in_flight))
        yield g
        g = GaugeMetricFamily("tandem_redis_degraded", "1 while Redis is configured but unreachable "
                                                       "(serving on in-process state).")
        g.add_metric([], 1.0 if now.redis_degraded else 0.0)
        yield g
        g = GaugeMetricFamily("tandem_usage_journal_entries", "Usage settled during a Redis outage and not yet "
                                                              "replayed onto Redis.")
        g.add_metric([], float(now.usage_journal))
        yield g
        if now.engine_restarts is not None:
            c = CounterMetricFamily("tandem_engine_restarts", "Times the local engine was started again after its "
                                                              "core process died.")
            c.add_metric([], float(now.engine_restarts))
            yield c
        g = GaugeMetricFamily("tandem_config_info", "The active config version (value 1).",
                              labels=["version", "source"])
        if now.config_version is not None:
            g.add_metric([str(now.config_version), str(now.config_source)], 1.0)
        yield g
        g = GaugeMetricFamily("tandem_breaker_state", "Circuit breaker per target: 0 closed, 1 half-open, 2 open.",
                              labels=["backend", "target"])
        for (backend, target), v in sorted(self.cache.get("breakers", {}).items()):
            g.add_metric([backend, target], float(v))
        yield g
        b = GaugeMetricFamily("tandem_budget_usd", "Budget per tenant and period, USD.", labels=["tenant", "period"])
        s = GaugeMetricFamily("tandem_budget_spent_usd", "Spent (and reserved) in the current budget period, USD.",
                              labels=["tenant", "period"])
        for (tenant, period), (spent, limit) in sorted(self.cache.get("budgets", {}).items()):
            b.add_metric([tenant, period], limit)
            s.add_metric([tenant, period], spent)
        yield b
        yield s


class GatewayMetrics:
    """The gateway's metric objects in ``registry``.

    Args:
        registry: this app's ``CollectorRegistry``.
        live: returns the gateway's ``LiveGauges`` (called at scrape time).
    """

    def __init__(self, registry: CollectorRegistry, live: Callable[[], LiveGauges] = LiveGauges) -> None:
        self.registry = registry
        self.cache: dict = {"breakers": {}, "budgets": {}}
        registry.register(_Live(live, self.cache))
        r = registry
        self.requests = Counter("tandem_requests", "Finished requests.",
                                ["model", "route", "backend", "status", "attempt", "tenant"], registry=r)
        self.duration = Histogram("tandem_request_duration_seconds", "End-to-end request latency, seconds.",
                                  ["model", "route", "backend"], buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("tandem_time_to_first_token_seconds",
                              "Streams: arrival to the first chunk sent, seconds (the client's wait, earlier "
                              "attempts included; backend: the one that answered).", ["model", "backend"],
                              buckets=TTFT_BUCKETS, registry=r)
        self.upstream_latency = Histogram("tandem_upstream_latency_seconds",
                                          "One upstream call (a stream: to its first content), seconds.",
                                          ["backend", "outcome"], buckets=LATENCY_BUCKETS, registry=r)
        self.attempts = Counter("tandem_upstream_attempts", "Upstream calls.", ["backend", "attempt", "outcome"],
                                registry=r)
        self.retries = Counter("tandem_retries", "Calls that retried a target already tried.", ["route", "backend"],
                               registry=r)
        self.fallbacks = Counter("tandem_fallbacks", "Calls that fell back to another target.", ["route", "backend"],
                                 registry=r)
        self.input_tokens = Counter("tandem_input_tokens", "Prompt tokens.", ["backend", "tenant"], registry=r)
        self.output_tokens = Counter("tandem_output_tokens", "Completion tokens.", ["backend", "tenant"], registry=r)
        self.cost = Counter("tandem_cost_usd", "Cost in USD (backend prices).", ["backend", "tenant"], registry=r)
        self.stream_errors = Counter("tandem_stream_errors", "Streams that ended with an error event after their "
                                     "200 (the backend failed mid-stream).", ["model", "backend"], registry=r)
        self.usage_estimated = Counter("tandem_usage_estimated", "Usage records counted by the gateway (the backend "
                                       "gave none, or the client left mid-stream).", ["backend", "tenant"],
                                       registry=r)
        self.rejections = Counter("tandem_rate_limit_rejections", "Requests refused with 429 by the gateway.",
                                  ["tenant", "code"], registry=r)
        self.cache_lookups = Counter("tandem_cache_lookups", "Response cache lookups (gateway/cache/).",
                                     ["route", "outcome"], registry=r)
        self.cache_mismatches = Counter("tandem_cache_mismatches", "Spot-checked cache hits whose recomputation "
                                        "differed (the key space is switched off).", ["route"], registry=r)
        self.engine = None          # engine.metrics.EngineMetrics once the local engine is up
        self._engine_obj = None
        self._children: dict[tuple, object] = {}

    def spent(self, backend: str, tenant: str, tokens, nusd: int) -> None:
        """A billed call: ``tokens`` (prompt, completion, ...) and ``nusd`` (nano-USD) added to the token and cost
        counters of ``backend`` and ``tenant`` (a label: ``anonymous``, ``shadow``)."""
        self.child(self.input_tokens, backend, tenant).inc(tokens[0])
        self.child(self.output_tokens, backend, tenant).inc(tokens[1])
        self.child(self.cost, backend, tenant).inc(nusd / NANO)

    def child(self, metric, *labels: str):
        """``metric.labels(*labels)``, cached: prometheus_client's ``labels()`` costs ~4 us a call, a dict
        lookup ~0.1 us (label sets are few: models x routes x backends x statuses x the configured tenants)."""
        key = (id(metric), labels)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = metric.labels(*labels)
        return c

    def ensure_engine(self, local) -> None:
        """Register the co-located engine's vLLM metrics once it is loaded, and have them follow the next engine
        (a restart, a reload's new one: ``EngineMetrics.follow``). Cheap when done: one identity check."""
        engine = getattr(local, "engine", None) if local is not None else None
        if engine is None or engine is self._engine_obj:
            return
        if self._engine_obj is not None:
            self._engine_obj = engine
            self.engine.follow(engine)
            return
        self._engine_obj = engine
        self.engine = EngineMetrics(self.registry, engine, local.served_model_name or engine.served_model_name)
        self.engine.attach()
