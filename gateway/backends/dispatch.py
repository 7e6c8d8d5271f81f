"""Calling backends: a decision's targets go through the resilience layer's
attempt loop (``gateway/resilience/attempts.py``: retries, fallback, circuit breakers,
per-backend limits, streaming failures); this module adapts the backends
(local engine, OpenAI-compatible upstreams) to it. This is the one place
that calls backends.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec

from gateway.errors import BackendError
from gateway.resilience.ratelimit import RateReservation
from gateway.resilience.layer import Resilience, backend_error_to_response, stream_response
from gateway.resilience.attempts import Candidate, Result, UpstreamResponse
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
    prompt_tokens: int | None = None  # estimated; targets with a smaller max_model_len are skipped
    reserved_tokens: int = 0          # prompt + max_tokens estimate, for per-backend TPM limits
    attempt_hook: Any = None          # wraps the attempt function (per-call spans/metrics, gateway/observability/telemetry.py)


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


async def _one_attempt(backends: dict, call: Call, c: Candidate) -> UpstreamResponse:
    """One call of ``c``'s backend in the attempt loop's terms (an HTTP answer, or a raised transport error)."""
    backend = backends[c.target.backend]
    try:
        result = await _attempt(backend, c.target, call)
    except BackendError as e:
        return backend_error_to_response(e)
    if call.stream:
        return stream_response(result, BackendError)
    return UpstreamResponse(result.status, {"content-type": result.content_type}, body=result.content)


async def forward(attempts: list[Target], backends: dict, call: Call, resilience: Resilience,
                  reservation: RateReservation | None = None) -> Outcome:
    """Serve ``call`` from ``attempts`` (route order) through the resilience
    layer; never raises for backend failures.

    Returns an Outcome with status 200 and content/stream, the passed-through
    error of a non-retryable failure, or 400/429/502/503/504 when no target
    could answer (see ``gateway/resilience/attempts.py``). ``reservation`` (the request's
    key/tenant token reservation) is settled with the real usage when known.
    """
    skipped: list[str] = []
    candidates = []
    for target in attempts:
        backend = backends.get(target.backend)
        if backend is None or not backend.available:
            skipped.append(f"{target.id}: {backend.unavailable_reason if backend else 'unknown backend'}")
        elif backend.kind == "local" and call.local_unsupported:
            skipped.append(f"{target.id}: local engine does not support {call.local_unsupported}")
        else:
            candidates.append(resilience.candidate(target, backend))

    async def settle(res: Result) -> None:
        await resilience.settle(reservation, res.usage)
        await resilience.settle(res.backend_reservation, res.usage)

    attempt = lambda c: _one_attempt(backends, call, c)  # noqa: E731
    if call.attempt_hook is not None:
        attempt = call.attempt_hook(attempt)
    res = await resilience.forward(candidates, attempt, stream=call.stream,
                                   required_len=call.prompt_tokens, request_id=call.request_id,
                                   tokens=call.reserved_tokens, on_finish=settle)
    if res.stream is None:
        await settle(res)
    target = res.candidate.target if res.candidate is not None else None
    errors = skipped + [f"{a.target}: {a.outcome}" for a in res.attempts if a.outcome != "ok"]
    if errors:
        log.info("request %s: %s", call.request_id, "; ".join(errors))
    headers = {k: v for k, v in res.headers.items() if k != "content-type"}
    return Outcome(res.status, res.body or b"", res.stream, res.headers.get("content-type", "application/json"),
                   target=target, backend=target.backend if target is not None else "", attempts=res.num_calls,
                   errors=errors, headers=headers)
