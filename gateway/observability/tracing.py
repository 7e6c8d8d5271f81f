"""OpenTelemetry of the gateway: an app-owned ``TracerProvider`` / ``MeterProvider`` (``Tracing``) and the W3C
trace context sent upstream (``current_traceparent``).
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
``tandem.endpoint`` (SERVER span: the client API's path after ``/v1/``,
``chat/completions`` | ``completions`` | ``embeddings`` | ``responses`` |
``messages``), ``tandem.route``, ``tandem.rule``, ``tandem.attempt`` (1-based call number;
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
"""

from __future__ import annotations

import contextvars
import logging
import random
import re
from typing import Any

from opentelemetry.propagators.textmap import DefaultGetter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from gateway.billing.prices import usage_tokens
from gateway.observability.records import AnswerFields, provider, server_address

log = logging.getLogger("tandem.gateway.tracing")

# The W3C traceparent to send upstream from the current task (the request's or its current CLIENT span's).
_TRACEPARENT: contextvars.ContextVar[str | None] = contextvars.ContextVar("tandem_traceparent", default=None)
_TP_RE = re.compile(r"^[0-9a-f]{2}-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")
OPERATIONS = {"chat/completions": "chat", "completions": "text_completion", "messages": "chat",
              "embeddings": "embeddings"}


def current_traceparent() -> str | None:
    """The ``traceparent`` header value for an upstream call made now (None: none)."""
    return _TRACEPARENT.get()


def set_traceparent(value: str | None) -> contextvars.Token:
    """Make ``value`` the traceparent of upstream calls from this task; returns the token to ``reset_traceparent``."""
    return _TRACEPARENT.set(value)


def reset_traceparent(token: contextvars.Token) -> None:
    """Undo ``set_traceparent``."""
    _TRACEPARENT.reset(token)


def traceparent(span) -> str:
    """The W3C ``traceparent`` header value naming ``span``."""
    sc = span.get_span_context()
    return f"00-{sc.trace_id:032x}-{sc.span_id:016x}-{int(sc.trace_flags):02x}"


def untraced_context(headers) -> tuple[str, str]:
    """(trace id, traceparent) with tracing off: the client's ``traceparent`` when valid, else a fresh one."""
    tp = headers.get("traceparent")
    m = _TP_RE.match(tp) if tp else None
    if m and m.group(1) != "0" * 32:
        return m.group(1), tp
    trace_id = f"{random.getrandbits(128):032x}"
    return trace_id, f"00-{trace_id}-{random.getrandbits(64):016x}-00"


def mark_error(span, error_type: str) -> None:
    """Set ``error.type`` and the ERROR status on ``span``."""
    span.set_attribute("error.type", error_type)
    span.set_status(Status(StatusCode.ERROR))


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
        resource = Resource.create({"service.name": service_name})
        self.provider = TracerProvider(resource=resource, sampler=ParentBased(TraceIdRatioBased(sample_ratio)))
        readers = [metric_reader] if metric_reader is not None else []
        base = (endpoint or "").rstrip("/")
        if span_exporter is not None:
            self.provider.add_span_processor(SimpleSpanProcessor(span_exporter))
        elif exporter == "console":
            self.provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
            if metric_reader is None:
                readers.append(PeriodicExportingMetricReader(ConsoleMetricExporter(),
                                                             export_interval_millis=export_interval_s * 1000))
        elif exporter == "otlp":
            # lazy: the OTLP exporters (protobuf, requests) load only when configured
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

    def server_span(self, op: str, endpoint: str, headers):
        """Start the SERVER span of one request on ``endpoint`` (``chat/completions``, ``responses``, ...: the path
        after ``/v1/``, attribute ``tandem.endpoint``) whose GenAI operation is ``op`` (parent: the client's
        ``traceparent``)."""
        return self.tracer.start_span(op, context=self.extract(headers), kind=SpanKind.SERVER,
                                      attributes={"gen_ai.operation.name": op, "http.request.method": "POST",
                                                  "url.path": f"/v1/{endpoint}", "tandem.endpoint": endpoint})

    def client_span(self, name: str, parent, attributes: dict[str, Any]):
        """Start the CLIENT span of one upstream call under ``parent`` (the SERVER span)."""
        return self.tracer.start_span(name, kind=SpanKind.CLIENT, context=set_span_in_context(parent),
                                      attributes=attributes)


def attempt_span(tracing: Tracing, rec, backend: str, name: str, kind: str):
    """The CLIENT span of one upstream call of ``rec`` (a ``records.RequestRecord``)."""
    op = OPERATIONS.get(rec.endpoint, rec.endpoint)
    attrs = {"gen_ai.operation.name": op, "gen_ai.provider.name": provider(rec.snap, backend),
             "gen_ai.request.model": rec.request_model, "tandem.route": rec.route, "tandem.rule": rec.rule,
             "tandem.attempt": len(rec.attempts) + 1, "tandem.attempt.kind": kind, "tandem.target": name}
    addr = server_address(rec.snap, backend)
    if addr:
        attrs["server.address"] = addr
    if rec.max_tokens is not None:
        attrs["gen_ai.request.max_tokens"] = rec.max_tokens
    return tracing.client_span(f"{op} {rec.request_model}", rec.span, attrs)


def end_attempt_span(rec, span, status: int | None, error: str | None) -> None:
    """End the CLIENT span of one upstream call of ``rec`` (``status``: its HTTP status; ``error``: its outcome
    when not ok), unless it streams ``rec``'s answer: that one ends with the stream (``end_stream_span``), and a
    span still open from an earlier call is a resumed stream's cut one."""
    if status is not None:
        span.set_attribute("http.response.status_code", status)
    if error is not None:
        mark_error(span, error)
        span.end()
    elif rec.stream:
        end_stream_span(rec, None, "stream_interrupted")
        rec.stream_span = span
    else:
        span.end()


def end_request_trace(tr: Tracing, rec, status: int, tokens) -> None:
    """Record ``rec``'s GenAI metrics, end its open stream's CLIENT span and its SERVER span; ``tokens``: (input,
    output, cached) when answered."""
    end_stream_span(rec, tokens, rec.error if rec.stream_failed or rec.shut_down
                    else "cancelled" if status == 499 else None)
    backend = rec.backend or "none"
    mattrs = {"gen_ai.operation.name": OPERATIONS.get(rec.endpoint, rec.endpoint),
              "gen_ai.provider.name": provider(rec.snap, backend),
              "gen_ai.request.model": rec.request_model or rec.model or "unknown"}
    if rec.response_model:
        mattrs["gen_ai.response.model"] = rec.response_model
    if tokens is not None:
        tr.token_usage.record(tokens[0], {**mattrs, "gen_ai.token.type": "input"})
        tr.token_usage.record(tokens[1], {**mattrs, "gen_ai.token.type": "output"})
    if rec.ttft_s is not None:
        tr.ttft.record(rec.ttft_s, mattrs)
    span = rec.span
    if span is None:
        return
    attrs: dict[str, Any] = {"http.response.status_code": status, "tandem.attempts": len(rec.attempts)}
    if rec.backend:
        attrs["gen_ai.provider.name"] = provider(rec.snap, rec.backend)
        attrs["tandem.backend"] = rec.backend
    if rec.response_model:
        attrs["gen_ai.response.model"] = rec.response_model
    if tokens is not None:
        attrs["gen_ai.usage.input_tokens"], attrs["gen_ai.usage.output_tokens"] = tokens[0], tokens[1]
    if rec.finish_reasons:
        attrs["gen_ai.response.finish_reasons"] = list(dict.fromkeys(rec.finish_reasons))
    if status >= 400 or rec.error:
        attrs["error.type"] = rec.error or str(status)
        # ERROR for the server's failures: a 5xx, a stream that failed after its 200; a 4xx (499: the client
        # left) stays UNSET, as OTel's HTTP conventions have server spans (an SRE trial's error rates counted them)
        if status >= 500 or (status < 400 and rec.error):
            mark_error(span, attrs["error.type"])
    if not rec.request_model:
        span.update_name(OPERATIONS.get(rec.endpoint, rec.endpoint))
    span.set_attributes(attrs)
    span.end()


def end_stream_span(rec, tokens: tuple[int, int, int] | None, error: str | None) -> None:
    """End the CLIENT span of the call that streamed the answer of ``rec`` (a ``records.RequestRecord``), if one
    is open: with the stream's ``tokens`` (input, output, cached) and finish reasons, marked ``error`` when it did
    not end well (an observability trial's span of a stream cut after 3 chunks ended at the first, OK, with no
    usage)."""
    span, rec.stream_span = rec.stream_span, None
    if span is None:
        return
    if tokens is not None:
        span.set_attributes({"gen_ai.usage.input_tokens": tokens[0], "gen_ai.usage.output_tokens": tokens[1]})
    if rec.finish_reasons:
        span.set_attribute("gen_ai.response.finish_reasons", list(dict.fromkeys(rec.finish_reasons)))
    if error is not None:
        mark_error(span, error)
    span.end()


def span_answer(span, ans: AnswerFields) -> None:
    """Set the answer's model, token usage and finish reasons on ``span``."""
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
