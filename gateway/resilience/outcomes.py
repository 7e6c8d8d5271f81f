"""What one upstream attempt can end in, as values: the upstream's ``UpstreamResponse``, the loop's ``Result`` and
``Attempt`` records, and the three ways an attempt does not answer the client (``Failure``: retry or fall back;
``NoCandidate``: nothing may be called now; ``PassThrough``: a final upstream error, relayed as is; values
returned, never raised), with the
rules that classify them (transient statuses, context-length errors, ``Retry-After``, transport errors).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from contextvars import ContextVar
from dataclasses import dataclass, field
from email.utils import parsedate_to_datetime
from typing import Any, AsyncIterator, Awaitable, Callable, Mapping

import msgspec

from gateway.errors import error_body, transport_error_kind
from gateway.resilience.ratelimit import RateReservation

TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})
# Error codes that make a transient-looking status the request's own fault: the engine's 408 for a grammar
# whose compile timed out refuses that schema from then on, so another try (or target) would only wait again.
REQUEST_ERROR_CODES = frozenset({"grammar_compile_timeout"})
_CONTEXT_RE = re.compile(r"context[ _-]?length|maximum context|context window|max_model_len|too many tokens|"
                         r"prompt is too long|reduce the length", re.I)


class Withdrawn(Exception):
    """An engine took a request back before computing any of it, at a hand-over's checkpoint
    (``policies.slo.Handover``, ``gateway/backends/local.py``): the attempt loop goes on to the next target at once,
    and the engine's breaker and health do not count it as a failure."""


@dataclass
class UpstreamResponse:
    """What one attempt returns: any HTTP status.

    body: the whole body (non-streaming responses and every error). events: the ``ChatStream`` of a streaming
    2xx (the backend's events, decoded once). aclose: releases the upstream response/connection (called when the
    loop abandons it). on_outcome: set by an observer of the call (telemetry) on a streaming 2xx, whose outcome
    is known only once the loop has read to its first content: called once with it (``"ok"``, or the failure's
    kind: ``stream_cut``, ``timeout``, ``connection_error``, ...) and its status (``settle_outcome``).
    """

    status: int
    headers: Mapping[str, str] = field(default_factory=dict)
    body: bytes = b""
    events: AsyncIterator[list] | None = None
    aclose: Callable[[], Awaitable[None]] | None = None
    on_outcome: Callable[[str, int | None], None] | None = None


# The first-token timeout of the attempt this task runs (``attempts._Run._call`` sets it): the attempt's observer
# tells a call that timeout cancelled (a stream whose upstream sent no headers in time: "timeout") from one the
# client's leaving cancelled ("cancelled"); both reach it as a CancelledError.
ATTEMPT_TIMEOUT: ContextVar[asyncio.Timeout | None] = ContextVar("tandem_attempt_timeout", default=None)


def cancelled_by_timeout() -> bool:
    """Whether the attempt running in this task was cancelled by its first-token timeout (``ATTEMPT_TIMEOUT``)."""
    timeout = ATTEMPT_TIMEOUT.get()
    return timeout is not None and timeout.expired()


def settle_outcome(resp: UpstreamResponse | None, outcome: str, status: int | None = None) -> None:
    """Tell ``resp``'s observer (``UpstreamResponse.on_outcome``) the attempt's outcome, once."""
    if resp is not None and resp.on_outcome is not None:
        hook, resp.on_outcome = resp.on_outcome, None
        hook(outcome, status if status is not None else resp.status)


@dataclass
class Attempt:
    """One step of the loop: an upstream call (``called``) or a skipped candidate, and its outcome."""

    target: str
    outcome: str
    status: int | None = None
    called: bool = True
    duration_s: float = 0.0


@dataclass
class Result:
    """The loop's answer.

    status/headers: what the client gets (headers: content-type, Retry-After when relevant).
    body: the response body when not streaming (or an error). stream: the events (``ChatStream``) when committed
    to a stream.
    candidate: the target that answered. usage: the upstream's ``usage`` (filled when known; for a stream at
    its end). error: the failure that ended a stream after content (None when it finished cleanly).
    backend_reservation: the backend-limit reservation of the answering target, to reconcile.
    """

    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes | None = None
    stream: AsyncIterator[list] | None = None
    candidate: Any = None                  # the attempts.Candidate that answered
    attempts: list[Attempt] = field(default_factory=list)
    usage: dict | None = None
    ttft_s: float | None = None
    error: str | None = None
    backend_reservation: RateReservation | None = None

    @property
    def num_calls(self) -> int:
        """Upstream calls made (the ``x-tandem-attempts`` header)."""
        return sum(1 for a in self.attempts if a.called)


@dataclass
class Failure:
    """A failed attempt: ``kind`` (timeout, connect_error, status, error_event, ...), whether it may be retried,
    and the candidate that failed."""

    kind: str
    message: str
    status: int | None = None
    retry_after: float | None = None
    transient: bool = True
    response: UpstreamResponse | None = None
    candidate: Any = None


@dataclass
class NoCandidate:
    """No candidate may be called now; ``retry_after`` seconds until one may (None: never).

    round_over: every candidate was tried or skipped in this round and no backoff preceded: back off, then
    start the next round.
    """

    retry_after: float | None
    round_over: bool = False


@dataclass
class PassThrough:
    """A final upstream answer that is not retried (4xx): returned to the client as is."""

    response: UpstreamResponse
    candidate: Any = None


def parse_retry_after(headers: Mapping[str, str]) -> float | None:
    """Seconds from a ``Retry-After`` (delta-seconds or HTTP date) or ``retry-after-ms`` header; None if absent."""
    lower = {k.lower(): v for k, v in headers.items()}
    ms = lower.get("retry-after-ms")
    if ms:
        try:
            return max(0.0, float(ms) / 1000)
        except ValueError:
            pass
    v = lower.get("retry-after")
    if not v:
        return None
    try:
        return max(0.0, float(v))
    except ValueError:
        try:
            return max(0.0, parsedate_to_datetime(v).timestamp() - time.time())
        except (TypeError, ValueError):
            return None


def is_context_length_error(status: int, body: bytes) -> bool:
    if status not in (400, 413, 422):
        return False
    try:
        err = json.loads(body).get("error") or {}
    except (ValueError, AttributeError):
        return bool(_CONTEXT_RE.search(body[:2000].decode("utf-8", "replace")))
    if not isinstance(err, dict):
        err = {"message": str(err)}
    return err.get("code") == "context_length_exceeded" or bool(_CONTEXT_RE.search(str(err.get("message", ""))))


def error_object(body: bytes | None) -> dict | None:
    """The ``error`` object of an error ``body`` (OpenAI's error JSON), or None when it has none."""
    try:
        err = json.loads(body).get("error") if body else None
    except (ValueError, AttributeError):
        return None
    return err if isinstance(err, dict) else None


def is_request_error(body: bytes) -> bool:
    """Does an error ``body`` (OpenAI's error JSON) name a code the request itself caused (``REQUEST_ERROR_CODES``)?"""
    err = error_object(body)
    return err is not None and err.get("code") in REQUEST_ERROR_CODES


def error_status(error: Any) -> int | None:
    """The HTTP status an error object names (its ``code``, else its ``status``, an integer or a string of
    digits, 400-599), as aggregators put one in a stream's error event (``{"code": 400, ...}``); None if none."""
    if not isinstance(error, dict):
        return None
    for key in ("code", "status"):
        v = error.get(key)
        if isinstance(v, str) and v.isdigit():
            v = int(v)
        if isinstance(v, int) and not isinstance(v, bool) and 400 <= v <= 599:
            return v
    return None


def classify_error_object(error: Any, body: bytes, where: str) -> "Failure | PassThrough":
    """An error object inside a 2xx answer (a stream's error event before any content, or a JSON body's
    ``error``) classified by the status it names, exactly like a non-streamed status: a request-specific 4xx
    (a content filter, a bad parameter) is passed through once as that status with ``body``, a context-length
    4xx moves on to a larger target, and anything else (5xx, 408/429, no status) is a transient failure.
    ``where``: what carried it, for the failure's message."""
    status = error_status(error)
    if status is None or (status in TRANSIENT_STATUS and not is_request_error(body)) or status >= 500:
        return Failure("error_event", f"upstream sent an error {where}", status=status or 502)
    resp = UpstreamResponse(status, {"content-type": "application/json"}, body)
    if is_context_length_error(status, body):
        return Failure("context_length", "prompt too long for this target", status=status, response=resp)
    return PassThrough(resp)


_FAILURE_MESSAGES = {"timeout": "upstream timed out", "connect_error": "cannot connect to upstream",
                     "connection_error": "upstream connection failed", "error": "upstream call failed"}


def classify_exception(exc: BaseException) -> Failure:
    """A transport exception as a transient failure (``gateway.errors.transport_error_kind``)."""
    kind = transport_error_kind(exc)
    return Failure(kind, f"{_FAILURE_MESSAGES[kind]} ({type(exc).__name__})")


async def close_response(resp: UpstreamResponse | None) -> None:
    """Release an upstream response (its connection); errors while closing are ignored."""
    if resp is not None and resp.aclose is not None:
        try:
            await resp.aclose()
        except Exception:
            pass


class AnswerHead(msgspec.Struct):
    """What the attempt loop reads of a whole 2xx answer: its ``error`` and ``usage`` members (the rest is
    skipped unbuilt)."""

    error: Any = None
    usage: Any = None


_decode_head = msgspec.json.Decoder(AnswerHead).decode


def answer_head(body: bytes) -> AnswerHead:
    """``body``'s ``error`` and ``usage`` as ``json.loads(body)`` reads them. msgspec decodes what strict UTF-8
    JSON objects are (an upstream's answers: ~8x faster than ``json``); anything it refuses (NaN, other
    encodings, lone surrogates, a non-object) goes to ``json.loads``, so what is accepted stays the same.

    Raises:
        ValueError: not JSON, or not a JSON object."""
    try:
        return _decode_head(body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        obj = json.loads(body)
        if not isinstance(obj, dict):
            raise ValueError("not an object") from None
        return AnswerHead(obj.get("error"), obj.get("usage"))


def quoted_message(error, limit: int = 300) -> str | None:
    """An error object's ``message`` (OpenAI's error format; or the error itself when it is a bare string), stripped
    and cut to ``limit`` characters; None when it has none."""
    message = error.get("message") if isinstance(error, dict) else error
    if not isinstance(message, str) or not message.strip():
        return None
    message = message.strip()
    return message if len(message) <= limit else message[:limit - 3] + "..."


def upstream_message(f: Failure, limit: int = 300) -> str | None:
    """The ``error.message`` of a failed attempt's answer (``quoted_message``); None when it has none: why the
    engine or provider refused (e.g. a grammar still compiling, send again) is worth more to the caller than the
    status alone."""
    return quoted_message(error_object(f.response.body if f.response is not None else None), limit)


def breaker_reason(f: Failure) -> str:
    """A failure as a breaker's reason: ``connect_error``, ``timeout``, ``malformed``, ``status 429 (Retry-After
    30s)``... (a malformed answer's 502 is the gateway's, not the upstream's status)."""
    if f.status is None or f.kind == "malformed":
        return f.kind
    return f"status {f.status}" + (f" (Retry-After {f.retry_after:g}s)" if f.retry_after is not None else "")


def not_larger(c, than) -> bool:
    """Whether ``c`` is known to take no longer context than ``than`` (``Candidate``s, both limits declared): a
    request too long for ``than`` is too long for ``c``, whatever else ``c``'s attempt failed on."""
    return (c is not None and than is not None and c.max_model_len is not None and than.max_model_len is not None
            and c.max_model_len <= than.max_model_len)


def no_client_retry(res: Result) -> Result:
    """An error answer once the loop's retries and fallbacks are spent tells the SDKs not to retry it
    (``x-should-retry: false``; the official SDKs retry 408/409/429/5xx twice by default, each retry a whole new
    loop: up to 3 x ``max_attempts`` upstream calls, and most when upstreams are overloaded). A ``Retry-After``
    stays on it, for the application to schedule a later try; the SDKs obey the header over it."""
    if res.status >= 400:
        res.headers["x-should-retry"] = "false"
    return res


def too_long_body(largest: int | None, required_len: int, answer_len: int | None, param: str | None) -> bytes:
    """OpenAI's 400 ``context_length_exceeded`` when no target of the route takes ``required_len`` tokens (of which
    ``answer_len`` are the completion's ``max_tokens``; 0: the prompt alone, as an embedding's; None: unset, the
    answer's one token counted); ``largest``: the route's largest ``max_model_len`` (None: unknown); ``param``: the
    prompt's field ("messages", "prompt", "input")."""
    limit = f"This model's maximum context length is {largest} tokens. However, " if largest else ""
    field = param or "prompt"
    if answer_len:   # OpenAI's words when the completion's tokens count too
        asked = (f"you requested {required_len} tokens ({required_len - answer_len} in the {field}, {answer_len} in "
                 f"the completion)")
        fix = f"the length of the {field} or completion"
    elif answer_len is None:   # no max_tokens: the prompt, with room for one token of answer
        asked = f"your {field} resulted in {required_len - 1} tokens, with no room left for the answer"
        fix = f"the length of the {field}"
    else:
        asked, fix = f"your {field} resulted in {required_len} tokens", f"the length of the {field}"
    return error_body(400, f"{limit}{asked}, and no available backend of this route takes that many. Please reduce "
                      f"{fix}.", param=param, code="context_length_exceeded")
