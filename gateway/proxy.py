"""The attempt loop: try a decision's targets in order until one answers.

This is the one place that calls backends, so retries, circuit breakers and
per-attempt tracing plug in here (``forward`` is swapped as a whole by the
resilience layer). Current behaviour: ordered fallback on connection errors,
timeouts, 408/409/429/5xx and an empty stream; any other error status
(400, 401, 403, 404, 422, ...) is passed through after one call.

Streaming: a target counts as answering once its first chunk has arrived
(within the backend's first-token timeout), so failures before any content
move on to the next target and the client never gets a 200 followed by
nothing. A failure after content ends the stream with a
``data: {"error": ...}`` event and no ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec

from gateway.errors import BackendError, error_body
from policies import Target

log = logging.getLogger("tandem.gateway.proxy")

# Request fields that only the gateway understands: never sent upstream.
GATEWAY_ONLY_FIELDS = ("priority",)


@dataclass
class Call:
    """What to send. ``body`` is the client's parsed JSON (not mutated);
    ``local_unsupported`` names a field the local engine cannot serve
    (local targets are then skipped)."""

    endpoint: str                 # "chat/completions" | "completions"
    body: dict
    public_model: str
    request_id: str
    priority: int = 0
    stream: bool = False
    local_unsupported: str | None = None


@dataclass
class Outcome:
    """The answer to relay: ``content`` bytes or a ``stream`` of SSE bytes.

    ``attempts`` counts backend calls made; ``target``/``backend`` say who
    answered (None when every attempt failed)."""

    status: int
    content: bytes = b""
    stream: AsyncIterator[bytes] | None = None
    content_type: str = "application/json"
    target: Target | None = None
    backend: str = ""
    attempts: int = 0
    errors: list[str] = field(default_factory=list)
    headers: dict[str, str] = field(default_factory=dict)


def _payload(backend, target: Target, call: Call):
    body = dict(call.body)
    body["model"] = backend.upstream_model(call.public_model, target.model)
    for k in GATEWAY_ONLY_FIELDS:       # the local engine gets the priority as an argument
        body.pop(k, None)
    return body if backend.kind == "local" else msgspec.json.encode(body)


async def _attempt(backend, target: Target, call: Call):
    payload = _payload(backend, target, call)
    if backend.kind == "local":
        if call.stream:
            return await backend.open_stream(call.endpoint, payload, call.request_id, call.priority)
        return await backend.send(call.endpoint, payload, call.request_id, call.priority)
    if call.stream:
        return await backend.open_stream(call.endpoint, payload)
    return await backend.send(call.endpoint, payload)


async def _first_chunk(stream: AsyncIterator[bytes], timeout: float | None, name: str) -> bytes:
    try:
        return await asyncio.wait_for(stream.__anext__(), timeout)
    except asyncio.TimeoutError:
        await stream.aclose()
        raise BackendError("timeout", f"{name}: no first token within {timeout:g} s", 504) from None
    except StopAsyncIteration:
        raise BackendError("stream", f"{name}: empty stream", 502) from None


async def _chain(first: bytes, rest: AsyncIterator[bytes], name: str) -> AsyncIterator[bytes]:
    try:
        yield first
        async for chunk in rest:
            yield chunk
    except BackendError as e:
        log.warning("stream from %s failed after content: %s", name, e.message)
        yield b"data: " + error_body(502, f"upstream stream failed: {e.message}", code="stream_error") + b"\n\n"
    finally:
        await rest.aclose()


def _failure(errors: list[BackendError], messages: list[str], attempts: int) -> Outcome:
    text = "; ".join(messages) or "no target available"
    if not errors:
        return Outcome(503, error_body(503, f"no backend available for this request: {text}",
                                       code="no_backend_available"), attempts=attempts, errors=messages)
    if all(e.kind == "http" and e.status == 429 for e in errors):
        waits = [e.retry_after for e in errors if e.retry_after is not None]
        headers = {"retry-after": str(int(min(waits) + 0.999))} if waits else {}
        return Outcome(429, error_body(429, f"all targets are rate limited: {text}", code="upstream_rate_limited"),
                       attempts=attempts, errors=messages, headers=headers)
    status = 504 if errors[-1].kind == "timeout" else 503 if all(e.kind == "unavailable" for e in errors) else 502
    return Outcome(status, error_body(status, f"all targets failed: {text}", code="upstream_failed"),
                   attempts=attempts, errors=messages)


async def forward(attempts: list[Target], backends: dict, call: Call) -> Outcome:
    """Try ``attempts`` in order; the first success (or non-retryable
    error) is the outcome. Never raises for backend failures.

    Returns an Outcome with status 200 and content/stream, the passed-through
    error of a non-retryable failure, or 429/502/503/504 when every target
    failed (503 when none could even be tried)."""
    errors: list[BackendError] = []
    messages: list[str] = []
    calls = 0
    for target in attempts:
        backend = backends.get(target.backend)
        if backend is None or not backend.available:
            messages.append(f"{target.id}: {backend.unavailable_reason if backend else 'unknown backend'}")
            continue
        if backend.kind == "local" and call.local_unsupported:
            messages.append(f"{target.id}: local engine does not support {call.local_unsupported}")
            continue
        calls += 1
        try:
            result = await _attempt(backend, target, call)
            if call.stream:
                timeout = backend.cfg.timeouts.first_token_s if backend.kind == "openai" else None
                first = await _first_chunk(result, timeout, backend.name)
                return Outcome(200, stream=_chain(first, result, backend.name), content_type="text/event-stream",
                               target=target, backend=backend.name, attempts=calls, errors=messages)
            return Outcome(result.status, result.content, content_type=result.content_type, target=target,
                           backend=backend.name, attempts=calls, errors=messages)
        except BackendError as e:
            messages.append(f"{target.id}: {e.message}")
            if not e.retryable:
                body = e.body or error_body(e.status, e.message)
                return Outcome(e.status, body, content_type=e.content_type, target=target, backend=backend.name,
                               attempts=calls, errors=messages)
            errors.append(e)
            log.info("attempt %d at %s failed (%s); trying the next target", calls, target.id, e.message)
    return _failure(errors, messages, calls)
