"""Observability of the request path: OpenTelemetry traces and GenAI metrics,
Prometheus metrics (``gateway/observability/metrics.py``), the JSON request log
(``gateway/observability/request_log.py``) and cost accounting / budgets
(``gateway/billing/usage.py``), tied together per request by ``Observability``.

Traces follow the OpenTelemetry GenAI semantic conventions
(https://opentelemetry.io/docs/specs/semconv/gen-ai/): one SERVER span per
request and one CLIENT span per upstream call (retries and fallbacks each
their own), named ``{gen_ai.operation.name} {gen_ai.request.model}`` with
``gen_ai.operation.name`` (``chat`` | ``text_completion``),
``gen_ai.provider.name`` (``tandem`` for the local engine, else the backend
name), ``gen_ai.request.model``, ``gen_ai.response.model``,
``gen_ai.request.max_tokens``, ``gen_ai.request.temperature``,
``gen_ai.usage.input_tokens``, ``gen_ai.usage.output_tokens``,
``gen_ai.response.finish_reasons``, ``error.type``, ``server.address``,
``tandem.route``, ``tandem.rule``, ``tandem.attempt`` (1-based call number;
``tandem.attempt.kind``: initial | retry | fallback). OTel metrics:
``gen_ai.client.token.usage`` (``gen_ai.token.type`` input | output),
``gen_ai.client.operation.duration`` (per upstream call, seconds),
``gen_ai.server.time_to_first_token`` (streams, seconds).

Exporters (``observability.tracing.exporter``): ``none`` (default: no SDK
spans at all; the client's ``traceparent`` is still forwarded upstream and its
trace id logged, or a fresh trace id is made), ``console``, ``otlp`` (HTTP,
``endpoint``). The W3C ``traceparent`` of the current CLIENT span (or the
request's) is sent to upstreams (``current_traceparent()``, read by
``gateway/backends/upstream.py``).

The request path calls, in order: ``begin`` (app, on arrival), ``admit``
(pipeline, once routed: budget check, returns the attempt hook),
the attempt hook around each upstream call (proxy), then ``finish`` /
``stream`` / ``reject`` / ``abandon`` (app) once the answer is known.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import re
import random as _random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from gateway.errors import ClientError
from gateway.observability.request_log import Redactor, RequestLog, config_secrets, install_redaction, remove_redaction
from gateway.observability.metrics import BREAKER_VALUES, GatewayMetrics
from gateway.sse import EventReader
from gateway.billing.usage import NANO, Budget, Price, UsageLedger, cost_nusd, tenant_label, usage_tokens

log = logging.getLogger("tandem.gateway.telemetry")

# The W3C traceparent to send upstream from the current task (the request's or its current CLIENT span's).
_TRACEPARENT: contextvars.ContextVar[str | None] = contextvars.ContextVar("tandem_traceparent", default=None)
_TP_RE = re.compile(r"^[0-9a-f]{2}-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")
_OPERATIONS = {"chat/completions": "chat", "completions": "text_completion"}


def current_traceparent() -> str | None:
    """The ``traceparent`` header value for an upstream call made now (None: none)."""
    return _TRACEPARENT.get()


class _Choice(msgspec.Struct):
    finish_reason: str | None = None
    text: str | None = None
    delta: dict | None = None
    message: dict | None = None


class _Answer(msgspec.Struct):
    """The fields of a completion / chunk that observability reads (others are skipped)."""

    model: str | None = None
    choices: list[_Choice] = []
    usage: dict | None = None


_decode_answer = msgspec.json.Decoder(_Answer).decode


# ------------------------------------------------------------------------------------------------ OpenTelemetry
class Tracing:
    """An OpenTelemetry ``TracerProvider`` and ``MeterProvider`` of this app
    (not the global ones).

    Args:
        exporter: "console" | "otlp" | "memory" (tests; or pass ``span_exporter``).
        endpoint: OTLP/HTTP base URL (``/v1/traces`` and ``/v1/metrics`` are appended
            unless the URL already names a path) or None for the SDK default.
        service_name: ``service.name`` resource attribute.
        sample_ratio: head sampling ratio (parent-based), 0..1.
        span_exporter / metric_reader: injected exporters (tests: the SDK's
            ``InMemorySpanExporter`` / ``InMemoryMetricReader``).
    """

    def __init__(self, exporter: str = "console", endpoint: str | None = None, service_name: str = "tandem-gateway",
                 sample_ratio: float = 1.0, span_exporter=None, metric_reader=None,
                 export_interval_s: float = 30.0):
        from opentelemetry.propagators.textmap import DefaultGetter
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        resource = Resource.create({"service.name": service_name})
        self.provider = TracerProvider(resource=resource, sampler=ParentBased(TraceIdRatioBased(sample_ratio)))
        readers = [metric_reader] if metric_reader is not None else []
        base = (endpoint or "").rstrip("/")
        if span_exporter is not None:
            self.provider.add_span_processor(SimpleSpanProcessor(span_exporter))
        elif exporter == "console":
            from opentelemetry.sdk.metrics.export import ConsoleMetricExporter
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            self.provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
            if metric_reader is None:
                readers.append(PeriodicExportingMetricReader(ConsoleMetricExporter(),
                                                             export_interval_millis=export_interval_s * 1000))
        elif exporter == "otlp":
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            named = base and re.search(r"//[^/]+/.+", base)
            self.provider.add_span_processor(BatchSpanProcessor(
                OTLPSpanExporter(endpoint=(base if named else f"{base}/v1/traces") if base else None)))
            if metric_reader is None:
                mep = (base.replace("/v1/traces", "/v1/metrics") if named else f"{base}/v1/metrics") if base else None
                readers.append(PeriodicExportingMetricReader(OTLPMetricExporter(endpoint=mep),
                                                             export_interval_millis=export_interval_s * 1000))
        self.meter_provider = MeterProvider(resource=resource, metric_readers=readers)
        self.tracer = self.provider.get_tracer("tandem.gateway")
        meter = self.meter_provider.get_meter("tandem.gateway")
        self.token_usage = meter.create_histogram(
            "gen_ai.client.token.usage", unit="{token}", description="Tokens per response, by gen_ai.token.type.",
            explicit_bucket_boundaries_advisory=[1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576])
        self.operation_duration = meter.create_histogram(
            "gen_ai.client.operation.duration", unit="s", description="Duration of one upstream GenAI call.",
            explicit_bucket_boundaries_advisory=[0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24,
                                                 20.48, 40.96, 81.92])
        self.ttft = meter.create_histogram(
            "gen_ai.server.time_to_first_token", unit="s", description="Time to the first streamed chunk.",
            explicit_bucket_boundaries_advisory=[0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                                                 1.0, 2.5, 5.0, 7.5, 10.0])
        self._propagator = TraceContextTextMapPropagator()
        self._getter = DefaultGetter()

    def extract(self, headers) -> Any:
        """The parent context from a request's ``traceparent`` (None without one)."""
        tp = headers.get("traceparent")
        if not tp:
            return None
        carrier = {"traceparent": tp}
        ts = headers.get("tracestate")
        if ts:
            carrier["tracestate"] = ts
        return self._propagator.extract(carrier)

    def shutdown(self) -> None:
        """Flush and stop exporters."""
        try:
            self.provider.shutdown()
            self.meter_provider.shutdown()
        except Exception as e:  # noqa: BLE001
            log.warning("tracing shutdown: %s", e)


def _traceparent(span) -> str:
    sc = span.get_span_context()
    return f"00-{sc.trace_id:032x}-{sc.span_id:016x}-{int(sc.trace_flags):02x}"


# -------------------------------------------------------------------------------------------------- per request
@dataclass
class AttemptRecord:
    """One upstream call: backend, target (breaker name), kind, outcome, HTTP status, seconds."""

    backend: str
    target: str
    kind: str
    outcome: str
    status: int | None
    duration_s: float


@dataclass
class RequestRecord:
    """What observability knows about one request while it runs."""

    request_id: str
    endpoint: str
    t0: float                              # time.perf_counter() at arrival
    trace_id: str = ""
    traceparent: str | None = None
    span: Any = None                       # the SERVER span (None: tracing off)
    client_token: str | None = None        # only to redact it
    tenant: str = ""
    model: str = ""                        # public model
    request_model: str = ""                # as the client wrote it
    route: str = ""
    rule: str = ""
    stream: bool = False
    max_tokens: int | None = None
    body: dict | None = None
    prompt_estimate: int | None = None
    reservation: Any = None
    budget: Budget | None = None
    attempts: list[AttemptRecord] = field(default_factory=list)
    backend: str = ""
    ttft_s: float | None = None
    usage: dict | None = None
    response_model: str | None = None
    finish_reasons: list[str] = field(default_factory=list)
    content_events: int = 0
    completion_text: list[str] | None = None
    error: str | None = None
    finished: bool = False
    events: EventReader = field(default_factory=EventReader)   # the committed stream's events, as read


def _provider(gw, backend: str) -> str:
    snap = gw.snapshot
    b = snap.backends.get(backend) if snap is not None else None
    return "tandem" if b is not None and b.kind == "local" else backend


def _server_address(gw, backend: str) -> str | None:
    snap = gw.snapshot
    b = snap.backends.get(backend) if snap is not None else None
    url = getattr(getattr(b, "cfg", None), "base_url", None)
    if not url:
        return None
    m = re.match(r"^[a-z]+://([^/:]+)", url)
    return m.group(1) if m else None


def _error_type(exc: BaseException) -> str:
    name = type(exc).__name__
    if isinstance(exc, asyncio.CancelledError):
        return "cancelled"
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError)) or "Timeout" in name:
        return "timeout"
    if isinstance(exc, ConnectionRefusedError) or "Connect" in name:
        return "connect_error"
    if isinstance(exc, (ConnectionError, OSError)):
        return "connection_error"
    return name


class Observability:
    """Metrics, traces, request logs and usage accounting of one gateway.

    Args:
        gw: the ``gateway.runtime.Gateway`` (its snapshot and resilience are read live).
        cfg: the initial ``GatewayConfig``; ``observability.tracing`` is fixed
            for the process lifetime (restart to change exporters), everything
            else (logs, budgets, prices) is read per request from the current
            config generation.
    """

    def __init__(self, gw, cfg):
        from prometheus_client import CollectorRegistry

        self.gw = gw
        self.registry = CollectorRegistry()
        self.metrics = GatewayMetrics(self.registry, gw)
        obs = getattr(cfg, "observability", None)
        tcfg = getattr(obs, "tracing", None)
        self.tracing: Tracing | None = None
        if tcfg is not None and tcfg.exporter != "none":
            self.tracing = Tracing(tcfg.exporter, tcfg.endpoint, tcfg.service_name, tcfg.sample_ratio)
        lcfg = getattr(obs, "logs", None)
        self.request_log = RequestLog(getattr(lcfg, "destination", "stderr"), getattr(lcfg, "requests", True))
        self.usage: UsageLedger | None = None
        self._own_state = None
        self._active: dict[str, RequestRecord] = {}
        self._redactor: tuple[int, Redactor] = (0, Redactor())
        self._filters: list = []
        self._tasks: set[asyncio.Task] = set()

    # -- lifecycle -----------------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Bind the usage ledger to the gateway's shared state (Redis or
        in-process) and redact secrets from the process's log handlers."""
        cfg = self.gw.snapshot.compiled.config if self.gw.snapshot else self.gw._initial.config
        state = getattr(getattr(self.gw, "resilience", None), "state", None)
        if state is None:
            from gateway.state import SharedState, StateConfig

            st = cfg.state
            state = self._own_state = SharedState(StateConfig(st.redis_url, st.socket_timeout_s, st.key_prefix))
        budgets = getattr(cfg, "budgets", None)
        self.usage = UsageLedger(state, getattr(budgets, "reservation_ttl_s", 600.0))
        self._filters = install_redaction(self.redactor)
        self.request_log.open()

    async def stop(self) -> None:
        for t in list(self._tasks):
            try:
                await asyncio.wait_for(t, 5)
            except BaseException:  # noqa: BLE001
                pass
        remove_redaction(self._filters)
        self._filters = []
        self.request_log.close()
        if self.tracing is not None:
            self.tracing.shutdown()
        if self._own_state is not None:
            await self._own_state.close()

    def redactor(self) -> Redactor:
        """The redactor of the current config (rebuilt when the config changes)."""
        snap = self.gw.snapshot
        key = id(snap.compiled) if snap is not None else 0
        if self._redactor[0] != key and snap is not None:
            self._redactor = (key, Redactor(config_secrets(snap.compiled.config)))
        return self._redactor[1]

    # -- the request path ----------------------------------------------------------------------------------------
    def begin(self, request_id: str, endpoint: str, headers) -> RequestRecord:
        """A request arrived: start its SERVER span (tracing on) and its trace context."""
        rec = RequestRecord(request_id, endpoint, time.perf_counter())
        auth = headers.get("authorization")
        if auth:
            rec.client_token = auth.partition(" ")[2].strip() or None
        snap = self.gw.snapshot
        if snap is not None and snap.local is not None:
            self.metrics.ensure_engine(snap.local)
        if self.tracing is not None:
            from opentelemetry.trace import SpanKind

            op = _OPERATIONS.get(endpoint, endpoint)
            rec.span = self.tracing.tracer.start_span(
                op, context=self.tracing.extract(headers), kind=SpanKind.SERVER,
                attributes={"gen_ai.operation.name": op, "http.request.method": "POST",
                            "url.path": f"/v1/{endpoint}"})
            rec.trace_id = f"{rec.span.get_span_context().trace_id:032x}"
            rec.traceparent = _traceparent(rec.span)
        else:
            tp = headers.get("traceparent")
            m = _TP_RE.match(tp) if tp else None
            if m and m.group(1) != "0" * 32:
                rec.trace_id, rec.traceparent = m.group(1), tp
            else:
                rec.trace_id = f"{_random.getrandbits(128):032x}"
                rec.traceparent = f"00-{rec.trace_id}-{_random.getrandbits(64):016x}-00"
        _TRACEPARENT.set(rec.traceparent)
        self._active[request_id] = rec
        return rec

    def note(self, request_id: str, tenant: str, public_model: str, parsed, decision,
             prompt_tokens: int | None = None) -> None:
        """The request is routed: note its facts (labels, span attributes),
        before any admission check can reject it."""
        rec = self._active.get(request_id)
        if rec is None:
            return
        body = parsed.body
        rec.tenant, rec.model, rec.request_model = tenant, public_model, parsed.model
        rec.route, rec.rule, rec.stream, rec.max_tokens, rec.body = (decision.route, decision.rule, parsed.stream,
                                                                     parsed.max_tokens, body)
        rec.prompt_estimate = prompt_tokens
        if rec.span is not None:
            op = _OPERATIONS.get(rec.endpoint, rec.endpoint)
            rec.span.update_name(f"{op} {parsed.model}")
            attrs = {"gen_ai.request.model": parsed.model, "tandem.route": decision.route,
                     "tandem.rule": decision.rule, "tandem.tenant": tenant_label(tenant)}
            if parsed.max_tokens is not None:
                attrs["gen_ai.request.max_tokens"] = parsed.max_tokens
            temp = body.get("temperature")
            if isinstance(temp, (int, float)) and not isinstance(temp, bool):
                attrs["gen_ai.request.temperature"] = float(temp)
            rec.span.set_attributes(attrs)

    async def admit(self, request_id: str, tenant: str, parsed, decision, prompt_tokens: int | None = None):
        """Reserve the request's estimated cost in its tenant's budget (after
        ``note`` and the rate limits). Returns the attempt hook for
        ``proxy.Call.attempt_hook`` (None when the request is unknown).

        Raises:
            ClientError: 429 ``budget_exceeded`` when the estimate does not fit
                in the tenant's remaining budget of the period.
        """
        rec = self._active.get(request_id)
        if rec is None:
            return None
        body = parsed.body
        cfg = self.gw.snapshot.compiled.config
        budgets = getattr(cfg, "budgets", None)
        bcfg = budgets.tenants.get(tenant_label(tenant)) if budgets is not None else None
        if bcfg is not None and self.usage is not None:
            budget = Budget(bcfg.usd, bcfg.period)
            est = self.estimate_nusd(cfg, decision.attempts, prompt_tokens, parsed.max_tokens, body)
            check = await self.usage.reserve(tenant, request_id, est, budget)
            if not check.admitted:
                spent = (check.spent_nusd + check.reserved_nusd) / NANO
                raise ClientError(
                    429, f"Budget exceeded: tenant '{tenant_label(tenant)}' has used ${spent:.6f} of its "
                         f"${budget.usd:g} {budget.period}ly budget (this request may cost up to ${est / NANO:.6f}).",
                    code="budget_exceeded", headers={"retry-after": str(int(check.resets_in_s) + 1)})
            rec.reservation, rec.budget = check.reservation, budget
        return self._attempt_hook(rec)

    def estimate_nusd(self, cfg, targets, prompt_tokens: int | None, max_tokens: int | None, body: dict) -> int:
        """Upper estimate of a request's cost, nano-USD: its prompt tokens
        (estimated) and ``max_tokens`` (else ``limits.default_completion_tokens``)
        at the highest input and output prices among ``targets``."""
        if prompt_tokens is None:
            from gateway.request.validate import estimate_prompt_tokens

            prompt_tokens = estimate_prompt_tokens(body)
        completion = max_tokens if max_tokens is not None else cfg.limits.default_completion_tokens
        best = Price()
        for t in targets:
            b = cfg.backends.get(t.backend)
            if b is None:
                continue
            p = Price.of(b.prices)
            best = Price(max(best.input, p.input), max(best.output, p.output))
        return cost_nusd(best, prompt_tokens, completion)

    def _attempt_hook(self, rec: RequestRecord):
        """Wraps the attempt loop's ``attempt(candidate)`` coroutine function:
        a CLIENT span, the traceparent, metrics and the attempt record per call."""
        m = self.metrics
        tracing = self.tracing
        gw = self.gw

        def hook(fn):
            async def attempt(c):
                target = getattr(c, "target", None)
                backend = getattr(target, "backend", None) or str(getattr(c, "name", "?")).split("/")[0]
                name = str(getattr(c, "name", backend))
                tried = {a.target for a in rec.attempts}
                kind = "initial" if not rec.attempts else "retry" if name in tried else "fallback"
                n = len(rec.attempts) + 1
                span = token = None
                if tracing is not None:
                    from opentelemetry.trace import SpanKind, set_span_in_context

                    op = _OPERATIONS.get(rec.endpoint, rec.endpoint)
                    attrs = {"gen_ai.operation.name": op, "gen_ai.provider.name": _provider(gw, backend),
                             "gen_ai.request.model": rec.request_model, "tandem.route": rec.route,
                             "tandem.rule": rec.rule, "tandem.attempt": n, "tandem.attempt.kind": kind,
                             "tandem.target": name}
                    addr = _server_address(gw, backend)
                    if addr:
                        attrs["server.address"] = addr
                    if rec.max_tokens is not None:
                        attrs["gen_ai.request.max_tokens"] = rec.max_tokens
                    span = tracing.tracer.start_span(f"{op} {rec.request_model}", kind=SpanKind.CLIENT,
                                                     context=set_span_in_context(rec.span), attributes=attrs)
                    token = _TRACEPARENT.set(_traceparent(span))
                t0 = time.perf_counter()
                outcome, status = "error", None
                try:
                    resp = await fn(c)
                    status = getattr(resp, "status", None)
                    outcome = "ok" if status is not None and status < 400 else "error_status"
                    if span is not None and status is not None and status < 400 and getattr(resp, "body", None):
                        try:
                            ans = _decode_answer(resp.body)
                            _span_answer(span, ans)
                        except (msgspec.DecodeError, msgspec.ValidationError):
                            pass
                    return resp
                except BaseException as e:
                    outcome = _error_type(e)
                    raise
                finally:
                    dt = time.perf_counter() - t0
                    if token is not None:
                        _TRACEPARENT.reset(token)
                    rec.attempts.append(AttemptRecord(backend, name, kind, outcome, status, dt))
                    m.child(m.upstream_latency, backend, outcome).observe(dt)
                    m.child(m.attempts, backend, kind, outcome).inc()
                    if kind == "retry":
                        m.child(m.retries, rec.route, backend).inc()
                    elif kind == "fallback":
                        m.child(m.fallbacks, rec.route, backend).inc()
                    if tracing is not None:
                        eattrs = {"gen_ai.operation.name": _OPERATIONS.get(rec.endpoint, rec.endpoint),
                                  "gen_ai.provider.name": _provider(gw, backend),
                                  "gen_ai.request.model": rec.request_model}
                        if outcome != "ok":
                            eattrs["error.type"] = str(status) if outcome == "error_status" else outcome
                        tracing.operation_duration.record(dt, eattrs)
                    if span is not None:
                        if status is not None:
                            span.set_attribute("http.response.status_code", status)
                        if outcome != "ok":
                            from opentelemetry.trace import Status, StatusCode

                            span.set_attribute("error.type", str(status) if outcome == "error_status" else outcome)
                            span.set_status(Status(StatusCode.ERROR))
                        span.end()

            return attempt

        return hook

    # -- the answer ------------------------------------------------------------------------------------------------
    async def finish(self, rec: RequestRecord, handled, status: int, content: bytes) -> bytes:
        """A whole (non-streamed) answer is ready: account, log, end the span.
        Returns ``content`` with any secret removed (error bodies may echo one)."""
        rec.backend = getattr(handled.outcome, "backend", "") or ""
        if status >= 400:
            content = self.redactor().bytes(content, [rec.client_token] if rec.client_token else [])
            rec.error = _error_code(content)
        elif content:
            try:
                ans = _decode_answer(content)
                rec.usage, rec.response_model = ans.usage, ans.model
                rec.finish_reasons = [c.finish_reason for c in ans.choices if c.finish_reason]
                if self._include_prompts():
                    rec.completion_text = [((c.message or {}).get("content") or c.text or "") for c in ans.choices]
            except (msgspec.DecodeError, msgspec.ValidationError):
                pass
        await self._complete(rec, status)
        return content

    def stream(self, rec: RequestRecord, handled, it):
        """Wrap a committed SSE stream: TTFT, usage and finish reasons from its
        events, redaction of error events; accounting when it ends."""
        rec.backend = getattr(handled.outcome, "backend", "") or ""
        if self._include_prompts():
            rec.completion_text = []
        return self._relay(rec, it)

    async def _relay(self, rec: RequestRecord, it):
        status = 200
        exhausted = False
        try:
            async for chunk in it:
                if rec.ttft_s is None:
                    rec.ttft_s = time.perf_counter() - rec.t0
                self._scan(rec, chunk)
                if b'"error"' in chunk:
                    chunk = self.redactor().bytes(chunk, [rec.client_token] if rec.client_token else [])
                yield chunk
            exhausted = True             # the inner iterator has finished (and cleaned up) on its own
        except (asyncio.CancelledError, GeneratorExit):
            status = 499
            raise
        finally:
            aclose = None if exhausted else getattr(it, "aclose", None)
            try:
                if aclose is not None:
                    await asyncio.shield(aclose())
            except BaseException:  # noqa: BLE001
                pass
            task = asyncio.ensure_future(self._complete(rec, status))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            try:
                await asyncio.shield(task)
            except BaseException:  # noqa: BLE001 -- cancelled: the task finishes on its own
                pass

    def _scan(self, rec: RequestRecord, chunk: bytes) -> None:
        reader = rec.events
        reader.feed(chunk)
        while (item := reader.pop()) is not None:
            data = item[1]
            if data == b"[DONE]":
                continue
            try:
                ans = _decode_answer(data)
            except (msgspec.DecodeError, msgspec.ValidationError):
                if b'"error"' in data:
                    rec.error = "stream_error"
                continue
            if ans.usage:
                rec.usage = ans.usage
            if ans.model and rec.response_model is None:
                rec.response_model = ans.model
            for c in ans.choices:
                piece = c.text if c.text is not None else (c.delta or {}).get("content")
                if piece:
                    rec.content_events += 1
                    if rec.completion_text is not None:
                        rec.completion_text.append(piece)
                if c.finish_reason:
                    rec.finish_reasons.append(c.finish_reason)
            if b'"error"' in data and not ans.choices:
                rec.error = "stream_error"

    async def reject(self, rec: RequestRecord, err: ClientError, headers=None) -> None:
        """The gateway refused the request (4xx/429/503 before any backend answered)."""
        rec.error = err.code or f"http_{err.status}"
        if err.status == 429:
            tenant = rec.tenant
            if not tenant and headers is not None and self.gw.snapshot is not None:
                from gateway.request.auth import authenticate

                try:
                    tenant = authenticate(headers.get("authorization"), self.gw.snapshot.compiled.key_hashes)
                except ClientError:
                    tenant = ""
                rec.tenant = tenant
            self.metrics.child(self.metrics.rejections, tenant_label(tenant), err.code or "rate_limited").inc()
        await self._complete(rec, err.status)

    def abandon(self, rec: RequestRecord) -> None:
        """Called by the app's ``finally``: a request that ended without
        ``finish``/``reject``/``stream`` (client gone: 499, unexpected error: 500)."""
        if rec.finished or rec.request_id not in self._active:
            return
        exc = sys.exc_info()[1]            # set when called from a ``finally`` an exception passes through
        failed = exc is not None and not isinstance(exc, (asyncio.CancelledError, GeneratorExit))
        if failed:
            rec.error = f"internal_error ({type(exc).__name__})"
        task = asyncio.ensure_future(self._complete(rec, 500 if failed else 499))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _include_prompts(self) -> bool:
        obs = getattr(self.gw.snapshot.compiled.config, "observability", None)
        return bool(getattr(getattr(obs, "logs", None), "include_prompts", False))

    async def _complete(self, rec: RequestRecord, status: int) -> None:
        if rec.finished:
            return
        rec.finished = True
        self._active.pop(rec.request_id, None)
        latency = time.perf_counter() - rec.t0
        m = self.metrics
        backend = rec.backend or "none"
        model = rec.model or "unknown"
        route = rec.route or "none"
        snap = self.gw.snapshot
        cfg = snap.compiled.config if snap is not None else None
        # usage and cost
        tokens = usage_tokens(rec.usage)
        estimated = False
        answered = rec.backend != "" and status < 400
        if tokens is None and answered and rec.body is not None:
            prompt = rec.prompt_estimate
            if prompt is None:
                from gateway.request.validate import estimate_prompt_tokens

                prompt = estimate_prompt_tokens(rec.body)
            tokens, estimated = (prompt, rec.content_events, 0), True
        nusd = 0
        if tokens is not None and cfg is not None:
            bcfg = cfg.backends.get(rec.backend)
            nusd = cost_nusd(Price.of(bcfg.prices if bcfg is not None else None), *tokens)
        try:
            if self.usage is not None and answered and tokens is not None:
                await self.usage.settle(rec.tenant, rec.backend, tokens[0], tokens[1], tokens[2], nusd,
                                        rec.reservation, rec.budget)
            elif self.usage is not None and rec.reservation is not None:
                await self.usage.release(rec.reservation)
        except Exception as e:  # noqa: BLE001 -- accounting must never break a response
            log.warning("usage accounting of %s failed: %s: %s", rec.request_id, type(e).__name__, e)
        # metrics
        kind = rec.attempts[-1].kind if rec.attempts else ("initial" if rec.backend else "none")
        m.child(m.requests, model, route, backend, str(status), kind).inc()
        m.child(m.duration, model, route, backend).observe(latency)
        if rec.ttft_s is not None:
            m.child(m.ttft, model, backend).observe(rec.ttft_s)
        tenant = tenant_label(rec.tenant)
        if tokens is not None and answered:
            m.child(m.input_tokens, backend, tenant).inc(tokens[0])
            m.child(m.output_tokens, backend, tenant).inc(tokens[1])
            m.child(m.cost, backend, tenant).inc(nusd / NANO)
        # traces
        tr = self.tracing
        if tr is not None:
            op = _OPERATIONS.get(rec.endpoint, rec.endpoint)
            mattrs = {"gen_ai.operation.name": op, "gen_ai.provider.name": _provider(self.gw, backend),
                      "gen_ai.request.model": rec.request_model or model}
            if rec.response_model:
                mattrs["gen_ai.response.model"] = rec.response_model
            if tokens is not None and answered:
                tr.token_usage.record(tokens[0], {**mattrs, "gen_ai.token.type": "input"})
                tr.token_usage.record(tokens[1], {**mattrs, "gen_ai.token.type": "output"})
            if rec.ttft_s is not None:
                tr.ttft.record(rec.ttft_s, mattrs)
        if rec.span is not None:
            span = rec.span
            attrs: dict[str, Any] = {"http.response.status_code": status, "tandem.attempts": len(rec.attempts)}
            if rec.backend:
                attrs["gen_ai.provider.name"] = _provider(self.gw, rec.backend)
                attrs["tandem.backend"] = rec.backend
            if rec.response_model:
                attrs["gen_ai.response.model"] = rec.response_model
            if tokens is not None and answered:
                attrs["gen_ai.usage.input_tokens"] = tokens[0]
                attrs["gen_ai.usage.output_tokens"] = tokens[1]
            if rec.finish_reasons:
                attrs["gen_ai.response.finish_reasons"] = list(dict.fromkeys(rec.finish_reasons))
            if status >= 400 or rec.error:
                from opentelemetry.trace import Status, StatusCode

                attrs["error.type"] = rec.error or str(status)
                if status >= 500 or status == 499 or rec.error:
                    span.set_status(Status(StatusCode.ERROR))
            if not rec.request_model:
                span.update_name(_OPERATIONS.get(rec.endpoint, rec.endpoint))
            span.set_attributes(attrs)
            span.end()
        # the log line
        if not self.request_log.active:
            return
        fields = {"event": "request", "request_id": rec.request_id, "trace_id": rec.trace_id, "tenant": tenant,
                  "model": rec.model or None, "route": rec.route or None, "rule": rec.rule or None,
                  "backend": rec.backend or None, "status": status, "attempts": len(rec.attempts),
                  "stream": rec.stream,
                  "prompt_tokens": tokens[0] if tokens else None,
                  "completion_tokens": tokens[1] if tokens else None,
                  "cached_tokens": tokens[2] if tokens else None, "usage_estimated": estimated,
                  "ttft_s": round(rec.ttft_s, 6) if rec.ttft_s is not None else None,
                  "latency_s": round(latency, 6), "cost_usd": nusd / NANO, "error": rec.error}
        if rec.finish_reasons:
            fields["finish_reasons"] = list(dict.fromkeys(rec.finish_reasons))
        if self._include_prompts() and rec.body is not None:
            fields["prompt"] = rec.body.get("messages", rec.body.get("prompt"))
            if rec.completion_text is not None:
                fields["completion"] = "".join(rec.completion_text)
        try:
            self.request_log.write(fields, self.redactor(), [rec.client_token] if rec.client_token else [])
        except Exception as e:  # noqa: BLE001
            log.warning("request log failed: %s", e)

    # -- scrape-time state -----------------------------------------------------------------------------------------
    async def refresh(self) -> None:
        """Read breaker states and budget usage into the scrape-time gauges."""
        snap = self.gw.snapshot
        if snap is None:
            return
        res = getattr(self.gw, "resilience", None)
        breakers = getattr(res, "breakers", None)
        if breakers is not None:
            states = {}
            names = set()
            for route in snap.compiled.policy.routes.values():
                for t in (*route.targets, *route.fallbacks):
                    names.add((t.backend, f"{t.backend}/{t.model}" if t.model else t.backend))
            for backend, name in sorted(names):
                try:
                    st = await breakers.get(name)
                    states[(backend, name)] = BREAKER_VALUES.get(str(st.state).lower(), 0)
                except Exception as e:  # noqa: BLE001
                    log.debug("breaker %s: %s", name, e)
            self.metrics.cache["breakers"] = states
        budgets = getattr(snap.compiled.config, "budgets", None)
        out = {}
        if budgets is not None and self.usage is not None:
            for tenant, b in budgets.tenants.items():
                try:
                    spent, reserved, limit = await self.usage.budget_state(tenant, Budget(b.usd, b.period))
                except Exception:  # noqa: BLE001
                    continue
                out[(tenant, b.period)] = ((spent + reserved) / NANO, limit / NANO)
        self.metrics.cache["budgets"] = out

    def routes(self) -> list:
        """Litestar handlers: ``GET /metrics`` (Prometheus text) and
        ``GET /admin/usage?tenant=&since=`` (admin token)."""
        import os

        from litestar import Request, Response, get
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        from gateway.request.auth import check_admin
        from gateway.errors import error_body

        ns = {"Request": Request, "Response": Response}

        @get("/metrics", include_in_schema=False, signature_namespace=ns)
        async def metrics_endpoint() -> Response:
            snap = self.gw.snapshot
            if snap is not None and snap.local is not None:
                self.metrics.ensure_engine(snap.local)
            await self.refresh()
            return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST.split(";")[0],
                            headers={"content-type": CONTENT_TYPE_LATEST})

        @get("/admin/usage", include_in_schema=False, signature_namespace=ns)
        async def admin_usage(request: Request) -> Response:
            env = self.gw.snapshot.compiled.config.admin.token_env
            try:
                check_admin(request.headers.get("authorization"), os.environ.get(env), env)
            except ClientError as e:
                return Response(e.body(), status_code=e.status, media_type="application/json")
            tenant = request.query_params.get("tenant")
            try:
                report = await self.usage.report(tenant, request.query_params.get("since"))
            except ValueError as e:
                return Response(error_body(400, str(e), param="since"), status_code=400,
                                media_type="application/json")
            budgets = getattr(self.gw.snapshot.compiled.config, "budgets", None)
            if budgets is not None:
                report["budgets"] = {}
                for t, b in budgets.tenants.items():
                    if tenant is not None and t != tenant_label(tenant):
                        continue
                    spent, reserved, limit = await self.usage.budget_state(t, Budget(b.usd, b.period))
                    report["budgets"][t] = {"period": b.period, "budget_usd": limit / NANO,
                                            "spent_usd": spent / NANO, "reserved_usd": reserved / NANO}
            return Response(msgspec.json.encode(report), media_type="application/json")

        return [metrics_endpoint, admin_usage]


def _span_answer(span, ans: _Answer) -> None:
    attrs: dict[str, Any] = {}
    if ans.model:
        attrs["gen_ai.response.model"] = ans.model
    tokens = usage_tokens(ans.usage)
    if tokens is not None:
        attrs["gen_ai.usage.input_tokens"] = tokens[0]
        attrs["gen_ai.usage.output_tokens"] = tokens[1]
    reasons = [c.finish_reason for c in ans.choices if c.finish_reason]
    if reasons:
        attrs["gen_ai.response.finish_reasons"] = reasons
    span.set_attributes(attrs)


def _error_code(content: bytes) -> str | None:
    try:
        err = msgspec.json.decode(content).get("error")
    except Exception:  # noqa: BLE001
        return "error"
    if isinstance(err, dict):
        return str(err.get("code") or err.get("type") or "error")
    return "error"
