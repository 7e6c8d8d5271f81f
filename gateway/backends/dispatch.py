"""Calling backends: a decision's targets go through the attempt loop (``gateway/resilience/attempts.py``:
retries, fallback, circuit breakers, per-backend limits, streaming failures); this module adapts the backends
(local engine, OpenAI-compatible upstreams) to it and turns the loop's result into the ``Answer`` the HTTP layer
renders. This is the one place that calls backends.
"""

from __future__ import annotations

import logging

import msgspec

from gateway.backends.relabel import answer_id, relabel_json
from gateway.errors import BackendError
from gateway.resilience.attempts import Candidate, Result, UpstreamResponse
from gateway.resilience.layer import Resilience
from gateway.resilience.ratelimit import RateReservation
from gateway.translate.chat_to_anthropic import chat_to_messages
from gateway.values import GATEWAY_ONLY_FIELDS, Answer, ChatStream, GatewayRequest
from policies import Target

log = logging.getLogger("tandem.gateway.dispatch")


def native_api(backend, req: GatewayRequest) -> str:
    """The API of ``req.source`` when ``backend`` speaks it natively and the request is whole (a stream is
    always served on chat, whose events the attempt loop and the ledger read); "" otherwise."""
    if req.source is None or req.stream or req.source[0] not in getattr(backend.cfg, "apis", ()):
        return ""
    return req.source[0]


def passthrough_body(backend, target: Target, req: GatewayRequest, body: dict) -> bytes:
    """A client body sent on its own API (not translated to chat): the gateway's fields dropped, the model the
    target's upstream name. Also what the endpoint picker hands Envoy to send (``gateway/picker/``)."""
    out = {k: v for k, v in body.items() if k not in GATEWAY_ONLY_FIELDS}
    out["model"] = backend.upstream_model(req.public_model, target.model)
    return msgspec.json.encode(out)


def _payload(backend, target: Target, req: GatewayRequest):
    body = dict(req.body)
    body["model"] = backend.upstream_model(req.public_model, target.model)
    for k in GATEWAY_ONLY_FIELDS:       # the local engine gets the priority as an argument
        body.pop(k, None)
    # The ledger bills a stream from the backend's own count: ask for it (observability drops the usage chunk
    # when the client did not ask for it too). The local engine always can; an upstream unless told it cannot.
    if req.stream and getattr(backend.cfg, "stream_usage", True):
        options = {**(body.get("stream_options") or {}), "include_usage": True}
        if getattr(backend, "continuous_usage", False):
            # on every chunk (vLLM's): a stream its client cuts is billed the engine's count so far, not an
            # estimate (an SRE trial's cut streams billed a 42-token prompt as 16); a Messages stream's
            # message_start, made at the first, splits the prompt's cached tokens as the final usage does
            options["continuous_usage_stats"] = True
        body["stream_options"] = options
    elif req.anthropic_body is not None:     # the translation asked for usage; this upstream refuses the field
        body.pop("stream_options", None)
    return body if backend.kind == "local" else msgspec.json.encode(body)


def _client_headers(backend, req: GatewayRequest) -> dict[str, str]:
    """The client's headers ``backend`` is sent along (``UpstreamBackend.client_headers``)."""
    return {h: req.headers[h] for h in backend.client_headers if req.headers.get(h)}


async def _attempt(backend, target: Target, req: GatewayRequest, handover=None):
    if api := native_api(backend, req):          # the client's own request, on the API it was made on
        return await backend.send(api, passthrough_body(backend, target, req, req.source[1]), req.request_id)
    if backend.kind == "anthropic":    # Anthropic's API: the client's Messages body, or its chat body translated
        if req.anthropic_body is not None:
            api, payload = "messages", passthrough_body(backend, target, req, req.anthropic_body)
        else:
            model = backend.upstream_model(req.public_model, target.model)
            api, payload = "chat/completions", msgspec.json.encode(chat_to_messages(req.body, model))
        args = (api, payload, req.request_id, _client_headers(backend, req))
    elif backend.kind == "local":      # the request value (priority, routing's rendering, the answer's id and
        args = (req, _payload(backend, target, req), handover)   # model) and the hand-over's checkpoint
    else:
        args = (req.endpoint, _payload(backend, target, req), req.request_id, _client_headers(backend, req))
    return await (backend.open_stream if req.stream else backend.send)(*args)


async def _one_attempt(backends: dict, req: GatewayRequest, c: Candidate, handover=None) -> UpstreamResponse:
    """One call of ``c``'s backend in the attempt loop's terms (an HTTP answer, or a raised transport error);
    ``handover``: (``policies.slo.Handover``, admission time) for the target it names the checkpoint of."""
    backend = backends[c.target.backend]
    try:
        result = await _attempt(backend, c.target, req, handover)
    except BackendError as e:
        return backend_error_to_response(e)
    return stream_response(result) if req.stream else result


async def forward(req: GatewayRequest, targets: list[Target], backends: dict, resilience: Resilience,
                  reservation: RateReservation | None = None, hook=None, reserved_tokens: int = 0,
                  handover=None) -> Answer:
    """Serve ``req`` from ``targets`` (route order) through the resilience layer; never raises for backend
    failures.

    Returns an Answer with status 200 and content/stream, the passed-through error of a non-retryable failure,
    or 400/429/502/503/504 when no target could answer (see ``gateway/resilience/attempts.py``).
    ``reservation`` (the request's key/tenant token reservation) is settled with the real usage when known;
    ``hook`` wraps each attempt (observability's ``on_attempt`` events); ``reserved_tokens`` sizes the
    per-backend TPM reservations. ``handover``: (``policies.slo.Handover``, admission in monotonic seconds) of
    the first target (the co-located engine), which may withdraw the request at its checkpoint.
    """
    skipped: list[str] = []
    candidates = []
    for target in targets:
        backend = backends.get(target.backend)
        if backend is None or not backend.available:
            skipped.append(f"{target.id}: {backend.unavailable_reason if backend else 'unknown backend'}")
        elif backend.kind == "local" and req.local_unsupported:
            skipped.append(f"{target.id}: local engine does not support {req.local_unsupported}")
        elif (refusal := backend.refusal(req)) is not None:     # e.g. what Anthropic's API cannot give
            skipped.append(f"{target.id}: {refusal[1]}")
        else:
            candidates.append(resilience.candidate(target, backend))

    async def settle(res: Result) -> None:
        await resilience.settle(reservation, res.usage)
        await resilience.settle(res.backend_reservation, res.usage)

    first = targets[0] if targets and handover is not None else None
    attempt = lambda c: _one_attempt(backends, req, c, handover if c.target is first else None)  # noqa: E731
    if hook is not None:
        attempt = hook(attempt)
    # a candidate is skipped as too small on a count only: an estimate (~4 characters a token) can be far over
    # (it refused 1,400-token embeddings inputs as 2,100 tokens); the engine itself refuses what does not fit
    # and each prompt of a batch must fit alone (a batch of three 900-token prompts fits a 2,048 context)
    # and with room for the answer: max_tokens, one token where it is unset (chat then fills the context), none for
    # embeddings and a completions prompt scored alone (0); a capacity trial's prompt of exactly the window, or
    # 246 tokens + 100 in 256, went to an engine that refuses them, never to the larger target
    room = 1 if req.max_tokens is None else req.max_tokens
    required_len = req.longest_prompt_tokens + room if req.prompt_tokens_exact else None
    res = await resilience.forward(candidates, attempt, stream=req.stream, required_len=required_len,
                                   answer_len=req.max_tokens,
                                   request_id=req.request_id, tokens=reserved_tokens, on_finish=settle,
                                   prompt_param={"chat/completions": "messages", "embeddings": "input"}.get(
                                       req.endpoint, "prompt"))
    if res.stream is None:
        await settle(res)
    # an open breaker is logged once per transition (gateway/resilience/breaker.py), not once per request
    errors = skipped + [f"{a.target}: {a.outcome}" for a in res.attempts
                        if a.outcome != "ok" and not a.outcome.startswith("skipped: breaker")]
    if errors:
        log.info("request %s: %s", req.request_id, "; ".join(errors))
    headers = {k: v for k, v in res.headers.items() if k != "content-type"}
    backend = res.candidate.target.backend if res.candidate is not None else ""
    body = res.body or b""
    # a whole answer under the public model name and the gateway's id, whoever answered (the local engine writes
    # them itself; a stream's events get them from the client API's codec at the edge)
    if res.status == 200 and res.stream is None and backends[backend].kind != "local":
        body = relabel_json(body, answer_id(req.endpoint, req.request_id), req.public_model)
    return Answer(res.status, body, res.stream, res.headers.get("content-type", "application/json"),
                  backend, res.num_calls, headers, native_api(backends[backend], req) if backend else "")


def backend_error_to_response(e: BackendError) -> UpstreamResponse:
    """``gateway.errors.BackendError`` -> the loop's terms: an HTTP answer, or a raised transport error."""
    if e.kind == "http":
        headers = {"content-type": e.content_type}
        if e.retry_after is not None:
            headers["retry-after"] = str(e.retry_after)
        return UpstreamResponse(e.status, headers, body=e.body or b"")
    if e.kind == "timeout":
        raise TimeoutError(e.message)
    if e.kind == "connect":
        raise ConnectionRefusedError(e.message)
    raise ConnectionError(e.message)


def stream_response(it: ChatStream) -> UpstreamResponse:
    """A backend's event stream as a streaming 200 for the loop, its stream errors re-raised as transport errors
    the loop classifies; closing it closes the backend's iterator even when it was never started."""

    async def events():
        try:
            async for batch in it:
                yield batch
        except BackendError as e:
            raise (TimeoutError if e.kind == "timeout" else ConnectionError)(e.message) from None

    relayed = events()

    async def aclose() -> None:
        await relayed.aclose()
        await it.aclose()

    return UpstreamResponse(200, {"content-type": "text/event-stream"}, events=relayed, aclose=aclose)
