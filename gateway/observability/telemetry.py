"""Observability of the request path, tied together per request by ``Observability``: Prometheus metrics
(``metrics.py``), OpenTelemetry spans and GenAI metrics (``tracing.py``), the JSON request log
(``request_log.py``) and the settlement of a request's cost in the usage ledger (``gateway/billing/usage.py``).

Observability only observes: it receives events and the config snapshot current at a request's arrival, never
the ``Gateway``, and decides nothing (budgets and rate limits are admission: ``gateway/request/admission.py``).
The request path sends, in order: ``begin`` (HTTP layer, on arrival), ``note`` (pipeline, once routed),
``admitted`` (pipeline, with the budget reservation), the attempt hook around each upstream call (``on_attempt``:
dispatch), then ``finish`` / ``stream`` / ``reject`` / ``abandon`` (HTTP layer) once the answer is known.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from typing import Callable

import msgspec
from prometheus_client import CollectorRegistry

from gateway.billing.counting import (choice_pieces, client_wants_usage, counter_for, delta_pieces,
                                      estimated_usage, lacks_usage, partial_usage, with_usage)
from gateway.billing.prices import NANO, Price, cost_nusd, usage_tokens
from gateway.cache.key import cache_config
from gateway.billing.usage import Budget, UsageLedger, UsageRecord
from gateway.cache.response_cache import CACHE_BACKEND
from gateway.errors import ClientError, anthropic_status, transport_error_kind
from gateway.resilience.outcomes import Withdrawn, cancelled_by_timeout
from gateway.resilience.streaming import SHUTDOWN_TYPE, ended_by_shutdown
from gateway.observability.metrics import GatewayMetrics, LiveGauges
from gateway.observability.records import (AttemptRecord, RequestRecord, answer_error_code, client_left,
                                           event_error_code, include_prompts, log_fields, provider, read_answer)
from gateway.observability.request_log import (Redactor, RequestLog, config_secrets, install_redaction,
                                               remove_redaction)
from gateway.observability.tracing import (OPERATIONS, Tracing, attempt_span, end_attempt_span, end_request_trace,
                                           reset_traceparent, set_traceparent, span_answer, traceparent,
                                           untraced_context)
from gateway.values import ChatEvent, ChatStream
from policies import tenant_label

log = logging.getLogger("tandem.gateway.telemetry")


def _error_type(exc: BaseException) -> str:
    if isinstance(exc, asyncio.CancelledError):   # the stream's first-token timeout, or the client left
        return "timeout" if cancelled_by_timeout() else "cancelled"
    if isinstance(exc, Withdrawn):   # an engine's hand-over: the next target answers
        return "withdrawn"
    kind = transport_error_kind(exc)
    return type(exc).__name__ if kind == "error" else kind


class Observability:
    """Metrics, traces, request logs and usage settlement of one gateway.

    Args:
        cfg: the initial ``GatewayConfig``; ``observability.tracing`` is fixed for the process lifetime (restart
            to change exporters), everything else (logs, prices) is read per request from the config generation
            current at its arrival (``configure`` hands each new one over).
        usage: the usage ledger (cost of answered requests; budget reservations settled or released).
        live: the gateway's scrape-time gauges (``metrics.LiveGauges``).

    ``local_price``: backend name -> the price its answers are billed at instead of its configured ``prices``,
    or None (the gateway sets it: the local engine's price from ``local.cost``, ``gateway/billing/local_cost.py``).
    """

    def __init__(self, cfg, usage: UsageLedger, live: Callable[[], LiveGauges] = LiveGauges):
        self.local_price: Callable[[str], Price | None] = lambda backend: None
        self.registry = CollectorRegistry()
        self.metrics = GatewayMetrics(self.registry, live)
        tcfg = cfg.observability.tracing
        self.tracing: Tracing | None = None
        if tcfg.exporter != "none":
            self.tracing = Tracing(tcfg.exporter, tcfg.endpoint, tcfg.service_name, tcfg.sample_ratio)
        lcfg = cfg.observability.logs
        self.request_log = RequestLog(lcfg.destination, lcfg.requests)
        self.usage = usage
        self.snap = None
        self._active: dict[str, RequestRecord] = {}
        self._redactor: tuple[int, Redactor] = (0, Redactor())
        self._filters: list = []
        self._tasks: set[asyncio.Task] = set()

    # -- lifecycle -----------------------------------------------------------------------------------------------
    def configure(self, snap) -> None:
        """A config generation was applied (``gateway.snapshot.Snapshot``): requests arriving from now see it."""
        self.snap = snap

    async def start(self) -> None:
        """Redact secrets from the process's log handlers; open the request log."""
        self._filters = install_redaction(self.redactor)
        self.request_log.open()

    async def stop(self) -> None:
        if self._tasks:                  # the last requests' accounting, at most 5 s
            await asyncio.wait(set(self._tasks), timeout=5)
        remove_redaction(self._filters)
        self._filters = []
        self.request_log.close()
        if self.tracing is not None:
            self.tracing.shutdown()

    def redactor(self) -> Redactor:
        """The redactor of the current config (rebuilt when the config changes)."""
        snap = self.snap
        key = id(snap.compiled) if snap is not None else 0
        if self._redactor[0] != key and snap is not None:
            self._redactor = (key, Redactor(config_secrets(snap.compiled.config)))
        return self._redactor[1]

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- the request path ----------------------------------------------------------------------------------------
    def begin(self, request_id: str, endpoint: str, headers) -> RequestRecord:
        """A request arrived on ``endpoint`` (the client API's path after ``/v1/``: ``chat/completions``,
        ``completions``, ``embeddings``, ``responses``, ``messages``; its log line's ``endpoint`` and its span's
        ``tandem.endpoint``): start its SERVER span (tracing on) and its trace context."""
        snap = self.snap
        rec = RequestRecord(request_id, endpoint, time.perf_counter(), snap)
        auth = headers.get("authorization")
        if auth:
            rec.client_token = auth.partition(" ")[2].strip() or None
        if snap is not None and snap.local is not None:
            self.metrics.ensure_engine(snap.local)
        if self.tracing is not None:
            rec.span = self.tracing.server_span(OPERATIONS.get(endpoint, endpoint), endpoint, headers)
            rec.trace_id = f"{rec.span.get_span_context().trace_id:032x}"
            rec.traceparent = traceparent(rec.span)
        else:
            rec.trace_id, rec.traceparent = untraced_context(headers)
        set_traceparent(rec.traceparent)
        self._active[request_id] = rec
        return rec

    def note(self, req, decision) -> None:
        """The request (``gateway.request.value.GatewayRequest``) is routed: note its facts (labels, span
        attributes), before any admission check can reject it."""
        rec = self._active.get(req.request_id)
        if rec is None:
            return
        body = req.body
        rec.tenant, rec.model, rec.request_model = req.tenant, req.public_model, req.model
        max_tokens = None if rec.endpoint == "embeddings" else req.max_tokens   # embeddings generate nothing
        rec.route, rec.rule, rec.stream, rec.max_tokens, rec.body = (decision.route, decision.rule, req.stream,
                                                                     max_tokens, body)
        rec.prompt_estimate = req.prompt_tokens
        rec.strip_usage = req.stream and not client_wants_usage(body)   # the gateway asked for it, not the client
        rec.strip_chunk_usage = (req.stream and rec.endpoint in ("chat/completions", "completions")
                                 and not client_wants_usage(body, "continuous_usage_stats"))
        if rec.span is not None:
            rec.span.update_name(f"{OPERATIONS.get(rec.endpoint, rec.endpoint)} {req.model}")
            attrs = {"gen_ai.request.model": req.model, "tandem.route": decision.route,
                     "tandem.rule": decision.rule, "tandem.tenant": tenant_label(req.tenant)}
            if max_tokens is not None:
                attrs["gen_ai.request.max_tokens"] = max_tokens
            temp = body.get("temperature")
            if isinstance(temp, (int, float)) and not isinstance(temp, bool):
                attrs["gen_ai.request.temperature"] = float(temp)
            rec.span.set_attributes(attrs)

    def admitted(self, request_id: str, reservation=None, budget: Budget | None = None):
        """Admission let the request through with this budget ``reservation`` (settled when it ends). Returns the
        attempt hook for the dispatch (None when the request is unknown)."""
        rec = self._active.get(request_id)
        if rec is None:
            return None
        rec.reservation, rec.budget, rec.admitted = reservation, budget, True
        return lambda fn: self._observed(rec, fn)

    def _observed(self, rec: RequestRecord, fn):
        """Wraps the attempt loop's ``attempt(candidate)``: one ``on_attempt`` event per upstream call."""

        async def attempt(c):
            backend = getattr(c.target, "backend", None) or str(c.name).split("/")[0]
            tried = {a.target for a in rec.attempts}
            kind = "initial" if not rec.attempts else "retry" if c.name in tried else "fallback"
            span = token = None
            if self.tracing is not None:
                span = attempt_span(self.tracing, rec, backend, c.name, kind)
                token = set_traceparent(traceparent(span))
            t0 = time.perf_counter()
            outcome, status, deferred = "error", None, False

            def record(outcome: str, status: int | None) -> None:
                self.on_attempt(rec, AttemptRecord(backend, c.name, kind, outcome, status, time.perf_counter() - t0),
                                span)

            try:
                resp = await fn(c)
                status = resp.status
                outcome = "ok" if status < 400 else "error_status"
                if status < 300 and (resp.events is not None or not rec.stream):   # the loop reads it, then says
                    resp.on_outcome, deferred = record, True
                if status < 400 and not rec.stream:
                    rec.answer_body = resp.body  # billed from it if the client leaves before ``finish`` reads it
                if span is not None and status < 400 and resp.body and (ans := read_answer(resp.body)) is not None:
                    span_answer(span, ans)
                return resp
            except BaseException as e:
                outcome = _error_type(e)
                if outcome == "cancelled" and (usage := partial_usage(e)) is not None:
                    rec.usage = usage        # the local engine's count up to the abort: billed if the client left
                raise
            finally:
                if token is not None:
                    reset_traceparent(token)
                if not deferred:
                    record(outcome, status)

        return attempt

    def resumed(self, request_id: str, failed: str, backend: str) -> None:
        """Request ``request_id``'s stream, cut on backend ``failed``, goes on from ``backend``
        (``gateway/resilience/resume.py``): that call's attempt is a ``stream_interrupted`` one in the log line's
        ``failed_attempts``, the cut counts in ``tandem_stream_errors_total`` of ``failed``, and the request is
        ``backend``'s (which finished it) in its record and metrics. A scale-out trial's replica died mid-stream with
        every count saying ``ok`` and the request credited to it."""
        rec = self._active.get(request_id)
        if rec is None:
            return
        for i in range(len(rec.attempts) - 1, -1, -1):
            if rec.attempts[i].backend == failed and rec.attempts[i].outcome == "ok":
                rec.attempts[i].outcome = "stream_interrupted"
                break
        self.metrics.child(self.metrics.stream_errors, rec.model or "unknown", failed).inc()
        rec.backend = backend          # the cut call's span ended when the resuming call's began (end_attempt_span)

    def on_attempt(self, rec: RequestRecord, a: AttemptRecord, span=None) -> None:
        """One upstream call ended: record it, meter it, end its CLIENT span."""
        rec.attempts.append(a)
        m = self.metrics
        m.child(m.upstream_latency, a.backend, a.outcome).observe(a.duration_s)
        m.child(m.attempts, a.backend, a.kind, a.outcome).inc()
        if a.kind == "retry":
            m.child(m.retries, rec.route, a.backend).inc()
        elif a.kind == "fallback":
            m.child(m.fallbacks, rec.route, a.backend).inc()
        error = None if a.outcome == "ok" else str(a.status) if a.outcome == "error_status" else a.outcome
        if self.tracing is not None:
            eattrs = {"gen_ai.operation.name": OPERATIONS.get(rec.endpoint, rec.endpoint),
                      "gen_ai.provider.name": provider(rec.snap, a.backend), "gen_ai.request.model": rec.request_model}
            if error is not None:
                eattrs["error.type"] = error
            self.tracing.operation_duration.record(a.duration_s, eattrs)
        if span is not None:
            end_attempt_span(rec, span, a.status, error)

    # -- the answer ------------------------------------------------------------------------------------------------
    async def finish(self, rec: RequestRecord, backend: str, status: int, content: bytes) -> bytes:
        """A whole (non-streamed) answer is ready: read it (``_read_answer``), account, log, end the span.
        Without a budget the accounting runs in a task, once the caller has sent the answer (nothing the client
        sees next depends on it; ``stop`` waits for it); a budget's settle releases a reservation that the
        tenant's next request is admitted against, so it is done before the answer is sent. The record is ended
        here either way, so the HTTP layer's ``abandon`` leaves it alone.
        Returns ``content`` with any secret removed (error bodies may echo one)."""
        rec.backend = backend
        if status >= 400:
            content = self.redactor().bytes(content, [rec.client_token] if rec.client_token else [], fragments=True)
            rec.error = answer_error_code(content)
        if status < 400 and content and rec.endpoint != "embeddings" and lacks_usage(content):
            self._read_answer(rec, content)      # the backend counted nothing: the client gets the ledger's count
            content, read = with_usage(content, self._estimate(rec)), b""
        else:
            read = content
        if self._end(rec):
            account = self._account_answer(rec, status, time.perf_counter() - rec.t0, read)
            if rec.reservation is None and rec.budget is None:
                self._spawn(account)
            else:
                await account
        return content

    async def _account_answer(self, rec: RequestRecord, status: int, latency: float, content: bytes) -> None:
        if status < 400 and content:
            self._read_answer(rec, content)
        await self._account(rec, status, latency)

    @staticmethod
    def _read_answer(rec: RequestRecord, content: bytes) -> None:
        """Usage, model and finish reasons of a whole answer into ``rec``; its text too when the accounting
        counts it (no usable usage) or the log line carries it (``include_prompts``)."""
        if (ans := read_answer(content)) is None:
            return
        rec.usage, rec.response_model = ans.usage, ans.model
        rec.finish_reasons = [c.finish_reason for c in ans.choices if c.finish_reason]
        if usage_tokens(ans.usage) is None or include_prompts(rec.snap):
            for c in ans.choices:
                rec.texts.setdefault(c.index, []).extend(choice_pieces(c))

    def stream(self, rec: RequestRecord, backend: str, it: ChatStream) -> ChatStream:
        """Wrap a committed stream: TTFT, usage and finish reasons from its events, redaction of error events;
        accounting when it ends. The client's codec ends the response with ``[DONE]`` (``gateway.sse.Last``), so
        the accounting of a stream that ends there runs after the client has its whole answer; with a budget, it
        runs before ``[DONE]`` is passed on (the tenant's next request is admitted against its settle, as for a
        whole answer in ``finish``)."""
        rec.backend = backend
        return self._relay(rec, it)

    async def _relay(self, rec: RequestRecord, it: ChatStream) -> ChatStream:
        status = 200
        exhausted = False
        try:
            async for batch in it:
                if rec.ttft_s is None:
                    rec.ttft_s = time.perf_counter() - rec.t0
                batch = self._scan(rec, batch)
                if batch and batch[-1].done and not rec.usage_sent and not rec.strip_usage and rec.error is None:
                    # the usage chunk asked for: the backend's from a content chunk (Mistral's, DeepSeek's), or ours
                    batch = [*batch[:-1], ChatEvent(usage=rec.usage or self._estimate(rec)), batch[-1]]
                if batch:
                    if batch[-1].done and (rec.reservation is not None or rec.budget is not None) \
                            and self._end(rec):
                        await asyncio.shield(self._spawn(self._account(rec, 200, time.perf_counter() - rec.t0)))
                    yield batch
            exhausted = True             # the inner iterator has finished (and cleaned up) on its own
        except (asyncio.CancelledError, GeneratorExit):
            # Billed for what it was sent. Not a client that left: an ended record, a drain's end (the
            # shutdown's), or a stream whose error event it had (the SDKs close at once on it).
            if not rec.finished and not rec.shut_down and not rec.stream_failed:
                status, rec.disconnected = 499, True
            raise
        finally:
            aclose = None if exhausted else getattr(it, "aclose", None)
            try:
                if aclose is not None:
                    await asyncio.shield(aclose())
            except BaseException:  # noqa: BLE001
                pass
            try:                         # a stream a drain ended: the 503 of the shutdown (``SHUTDOWN_TYPE``)
                await asyncio.shield(self._spawn(self._complete(rec, 503 if rec.shut_down else status)))
            except BaseException:  # noqa: BLE001 -- cancelled: the task finishes on its own
                pass

    def _scan(self, rec: RequestRecord, batch: list[ChatEvent]) -> list[ChatEvent]:
        """Read the events of one read: usage, text per choice, finish reasons, errors. Returns them as the
        client gets them: an error event with secrets redacted; with ``rec.strip_usage``, without the usage-only
        event (``usage`` and no choices) the gateway asked for; with ``rec.strip_chunk_usage``, content events
        without the usage the gateway asked the local engine to put on each."""
        kept: list[ChatEvent] | None = None        # a new list once an event is changed or dropped
        for i, ev in enumerate(batch):
            out: ChatEvent | None = ev
            if ev.error:
                rec.shut_down = ended_by_shutdown(ev.error)
                rec.stream_failed = not rec.shut_down
                rec.error = SHUTDOWN_TYPE if rec.shut_down else event_error_code(ev.error)
                out = self._redacted(rec, ev)
            if ev.usage:
                rec.usage = ev.usage
                if not ev.choices:           # the usage-only event: the client's when it asked, else dropped
                    rec.usage_sent = not rec.strip_usage
                    out = None if rec.strip_usage else out
                elif rec.strip_chunk_usage:
                    out = msgspec.structs.replace(ev, usage=None)   # the local engine's count on every chunk
            if ev.model and rec.response_model is None:
                rec.response_model = rec.model or ev.model   # the name the client sees (the codec writes it)
            for c in ev.choices:            # each choice of an n > 1 stream apart; tool calls count too
                pieces = delta_pieces(c)
                if pieces:
                    rec.texts.setdefault(c.index, []).extend(pieces)
                if c.finish_reason:
                    rec.finish_reasons.append(c.finish_reason)
            if out is not ev and kept is None:
                kept = batch[:i]
            if kept is not None and out is not None:
                kept.append(out)
        return batch if kept is None else kept

    def _redacted(self, rec: RequestRecord, ev: ChatEvent) -> ChatEvent:
        """``ev`` (an error event) with its error's message free of secrets (the same event when it had none)."""
        err = ev.error
        if not isinstance(err, dict) or not isinstance(err.get("message"), str):
            return ev
        message = self.redactor().text(err["message"], [rec.client_token] if rec.client_token else [],
                                       fragments=True)
        if message == err["message"]:
            return ev
        return msgspec.structs.replace(ev, error={**err, "message": message})

    async def reject(self, rec: RequestRecord, err: ClientError) -> None:
        """The gateway refused the request (4xx/429/503 before any backend answered)."""
        rec.error = err.code or f"http_{err.status}"
        if err.status == 429:            # admission: the pipeline noted the tenant before it
            self.metrics.child(self.metrics.rejections, tenant_label(rec.tenant), err.code or "rate_limited").inc()
        await self._complete(rec, err.status)

    def abandon(self, rec: RequestRecord) -> None:
        """Called by the HTTP layer's ``finally``: a request that ended without
        ``finish``/``reject``/``stream`` (client gone: 499, unexpected error: 500)."""
        if rec.finished or rec.request_id not in self._active:
            return
        exc = sys.exc_info()[1]            # set when called from a ``finally`` an exception passes through
        failed = exc is not None and not isinstance(exc, (asyncio.CancelledError, GeneratorExit))
        if failed:
            rec.error = f"internal_error ({type(exc).__name__})"
        else:
            self._left(rec)
        self._spawn(self._complete(rec, 500 if failed else 499))

    def _left(self, rec: RequestRecord) -> None:
        """The client left before its whole answer was sent: when a backend was working on it (its call was
        cancelled) or had answered (the cancel raced the answer), the request is billed to that backend, marked
        ``disconnected``: with the engine's count up to the abort (``rec.usage``, set by the attempt hook), the
        answer's usage, or else (an upstream's partial output is unknown) the prompt, estimated."""
        last = rec.attempts[-1] if rec.attempts else None
        if last is None or last.outcome not in ("ok", "cancelled"):
            return                       # no backend call in flight: nothing was generated, nothing is billed
        rec.backend, rec.disconnected = last.backend, True
        if rec.usage is None and last.outcome == "ok" and rec.answer_body \
                and (ans := read_answer(rec.answer_body)) is not None:
            rec.usage = ans.usage

    def _end(self, rec: RequestRecord) -> bool:
        """Mark ``rec`` ended; False when it already was (it is accounted once)."""
        if rec.finished:
            return False
        rec.finished = True
        self._active.pop(rec.request_id, None)
        return True

    async def _complete(self, rec: RequestRecord, status: int) -> None:
        """The request ended with ``status``: account it (``_account``) unless it already was."""
        if self._end(rec):
            await self._account(rec, status, time.perf_counter() - rec.t0)

    async def _account(self, rec: RequestRecord, status: int, latency: float) -> None:
        """Settle the cost of the request that ended with ``status`` after ``latency`` seconds, meter it, end its
        span, write its log line."""
        if rec.endpoint == "messages":   # the status the client got: Anthropic's 529 for the gateway's 503
            status = anthropic_status(status)
        # Billed: every answer a backend gave, and a request its client left (or a drain ended) while a backend
        # worked on it.
        answered = rec.backend != "" and (status < 400 or rec.disconnected or rec.shut_down)
        tokens, estimated = usage_tokens(rec.usage), False
        if tokens is None and answered and rec.body is not None:
            tokens, estimated = usage_tokens(self._estimate(rec)), True
        cfg = rec.snap.compiled.config if rec.snap is not None else None
        nusd = 0
        if answered and tokens is not None and cfg is not None:
            bcfg = cfg.backends.get(rec.backend)
            if bcfg is None and rec.backend == CACHE_BACKEND:   # a cache hit: the cache's price (gateway/cache/)
                bcfg = cache_config(cfg, rec.route, rec.model)
            price = self.local_price(rec.backend) or Price.of(bcfg.prices if bcfg is not None else None)
            nusd = cost_nusd(price, *tokens)
        counted = tokens if answered else None
        await self._settle(rec, counted, nusd, estimated, rec.admitted and not answered, status)
        self._meter(rec, status, latency, counted, nusd)
        if estimated and counted is not None:
            self.metrics.child(self.metrics.usage_estimated, rec.backend, tenant_label(rec.tenant)).inc()
        if self.tracing is not None:
            end_request_trace(self.tracing, rec, status, counted)
        if self.request_log.active:
            self._log_line(rec, status, latency, counted, nusd, estimated)

    @staticmethod
    def _estimate(rec: RequestRecord) -> dict:
        """The usage of an answer its backend did not count: the prompt as counted at validation, the answer's
        text as delivered (``estimated_usage``)."""
        backend = rec.snap.backends.get(rec.backend) if rec.snap is not None else None
        return estimated_usage(rec.prompt_estimate or 0, rec.texts, counter_for(backend))

    async def _settle(self, rec: RequestRecord, tokens: tuple[int, int, int] | None, nusd: int,
                      estimated: bool, failed: bool, status: int) -> None:
        """Write the request's usage record: its tokens and cost, or (``failed``: admitted, no backend answered)
        one of none, on its backend as the metrics label it; a refused request's reservation is only released."""
        try:
            if tokens is not None or failed:
                await self.usage.settle(UsageRecord(rec.request_id, rec.tenant, rec.backend or "none",
                                                    *(tokens or (0, 0, 0)),
                                                    nusd, estimated, client_left(rec, status), failed),
                                        rec.reservation, rec.budget)
            elif rec.reservation is not None:
                await self.usage.release(rec.reservation)
        except Exception as e:  # noqa: BLE001 -- accounting must never break a response
            log.warning("usage accounting of %s failed: %s: %s", rec.request_id, type(e).__name__, e)

    def _meter(self, rec: RequestRecord, status: int, latency: float, tokens, nusd: int) -> None:
        m, backend, model, route = self.metrics, rec.backend or "none", rec.model or "unknown", rec.route or "none"
        kind = rec.attempts[-1].kind if rec.attempts else ("none" if rec.backend in ("", CACHE_BACKEND) else "initial")
        m.child(m.requests, model, route, backend, str(status), kind, tenant_label(rec.tenant)).inc()
        if rec.stream_failed and status < 400:     # answered 200, then cut: not a success either
            m.child(m.stream_errors, model, backend).inc()
        m.child(m.duration, model, route, backend).observe(latency)
        if rec.ttft_s is not None:
            m.child(m.ttft, model, backend).observe(rec.ttft_s)
        if tokens is not None:
            m.spent(backend, tenant_label(rec.tenant), tokens, nusd)

    def _log_line(self, rec: RequestRecord, status: int, latency: float, tokens, nusd: int, estimated: bool) -> None:
        fields = log_fields(rec, status, latency, tokens, nusd / NANO, estimated)
        try:
            self.request_log.write(fields, self.redactor(), [rec.client_token] if rec.client_token else [])
        except Exception as e:  # noqa: BLE001
            log.warning("request log failed: %s", e)
