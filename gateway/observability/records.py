"""What observability knows about one request while it runs (``RequestRecord``, one ``AttemptRecord`` per
upstream call), and the fields of an OpenAI answer it reads (``read_answer``)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import msgspec

from gateway.billing.usage import Budget
from policies import tenant_label


class _Choice(msgspec.Struct):
    index: int = 0
    finish_reason: str | None = None
    text: str | None = None
    delta: dict | None = None
    message: dict | None = None


class AnswerFields(msgspec.Struct):
    """The fields of a completion / chunk that observability reads (others are skipped)."""

    model: str | None = None
    choices: list[_Choice] = []
    usage: dict | None = None


_decode_answer = msgspec.json.Decoder(AnswerFields).decode


def read_answer(body: bytes) -> AnswerFields | None:
    """The fields of a whole OpenAI answer ``body`` (None: not one, e.g. an upstream's malformed JSON)."""
    try:
        return _decode_answer(body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


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
    snap: Any = None                       # the config generation current at arrival (gateway.snapshot.Snapshot)
    trace_id: str = ""
    traceparent: str | None = None
    span: Any = None                       # the SERVER span (None: tracing off)
    stream_span: Any = None                # the CLIENT span of the call streaming the answer: ended with the stream
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
    admitted: bool = False                 # past admission: it ends in one usage record (``failed`` if unanswered)
    attempts: list[AttemptRecord] = field(default_factory=list)
    backend: str = ""
    ttft_s: float | None = None
    usage: dict | None = None
    response_model: str | None = None
    finish_reasons: list[str] = field(default_factory=list)
    texts: dict[int, list[str]] = field(default_factory=dict)   # choice index -> generated text pieces, in order
    strip_usage: bool = False              # a stream whose client did not ask for usage: its usage chunk is dropped
    strip_chunk_usage: bool = False        # an OpenAI stream whose client did not ask for usage on every chunk
    usage_sent: bool = False               # the stream's usage-only event (``choices: []``) went to the client
    disconnected: bool = False             # the client left while a backend worked on its answer (or streamed it)
    shut_down: bool = False                # a drain ended its stream (``stream_interrupted``, service_unavailable)
    stream_failed: bool = False            # an error event ended its stream (``error``: the event's code)
    answer_body: bytes | None = None       # a whole answer's body as its backend returned it (until ``finish``)
    error: str | None = None
    finished: bool = False


def provider(snap, backend: str) -> str:
    b = snap.backends.get(backend) if snap is not None else None
    return b.provider() if b is not None else backend


def server_address(snap, backend: str) -> str | None:
    b = snap.backends.get(backend) if snap is not None else None
    url = getattr(getattr(b, "cfg", None), "base_url", None)
    m = re.match(r"^[a-z]+://([^/:]+)", url) if url else None
    return m.group(1) if m else None


def client_left(rec: RequestRecord, status: int) -> bool:
    """Whether the client of ``rec`` (ended with ``status``) left before its answer: while a backend worked on it
    (``rec.disconnected``) or while none did (499: waiting for a retry, a Retry-After, a queue). The log line's and
    the usage record's ``disconnected`` (an observability trial saw the record say so and the log line not)."""
    return rec.disconnected or status == 499


def log_fields(rec: RequestRecord, status: int, latency: float, tokens, cost_usd: float, estimated: bool) -> dict:
    """The request log line of ``rec`` (docs/operators/metrics.md lists its fields): ended with ``status`` after
    ``latency`` seconds, billed ``tokens`` (prompt, completion, cached; None: nothing) at ``cost_usd``
    (``estimated``: counted by the gateway); the prompt and completion only with ``logs.include_prompts``."""
    fields = {"event": "request", "request_id": rec.request_id, "trace_id": rec.trace_id,
              "endpoint": rec.endpoint, "tenant": tenant_label(rec.tenant), "model": rec.model or None,
              "route": rec.route or None, "rule": rec.rule or None, "backend": rec.backend or None, "status": status,
              "attempts": len(rec.attempts), "stream": rec.stream,
              "prompt_tokens": tokens[0] if tokens else None,
              "completion_tokens": tokens[1] if tokens else None,
              "cached_tokens": tokens[2] if tokens else None, "usage_estimated": estimated,
              "disconnected": client_left(rec, status),
              "ttft_s": round(rec.ttft_s, 6) if rec.ttft_s is not None else None,
              "latency_s": round(latency, 6), "cost_usd": cost_usd, "error": rec.error}
    if rec.finish_reasons:
        fields["finish_reasons"] = list(dict.fromkeys(rec.finish_reasons))
    if failed := [{"backend": a.backend, "outcome": a.outcome, "status": a.status}
                  for a in rec.attempts if a.outcome != "ok"]:   # what a fallback or retry went past
        fields["failed_attempts"] = failed
    if include_prompts(rec.snap) and rec.body is not None:
        fields["prompt"] = rec.body.get("messages", rec.body.get("prompt"))
        texts = ["".join(rec.texts[i]) for i in sorted(rec.texts)]
        fields["completion"] = texts if len(texts) > 1 else (texts[0] if texts else "")   # n > 1: one per choice
    return fields


def include_prompts(snap) -> bool:
    return snap is not None and snap.compiled.config.observability.logs.include_prompts


def answer_error_code(content: bytes) -> str:
    """The ``error`` of a request's log line for an error answer's body: its ``code``, else its ``type``, else
    "error"."""
    try:
        err = msgspec.json.decode(content).get("error")
    except Exception:  # noqa: BLE001
        return "error"
    if isinstance(err, dict):
        return str(err.get("code") or err.get("type") or "error")
    return "error"


def event_error_code(error: object) -> str:
    """The ``error`` of a request's log line for a stream an error event ended: the code the client's event
    carries (``stream_interrupted``, or an upstream event's own; an ops trial read "stream_error" in the log
    beside the client's ``stream_interrupted``), "stream_error" when it has none."""
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, str) and code else "stream_error"
