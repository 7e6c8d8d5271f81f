"""What every POST endpoint of the client APIs does around its answer (``gateway/http/app.py``'s OpenAI and
Anthropic endpoints, ``gateway/http/responses.py``'s Responses API): refuse while draining, name the request,
open its observability record, read the body, and close the record however the request ends."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from litestar import Request, Response

from engine.protocol.request_ids import unique_request_id
from gateway.errors import ClientError
from gateway.http.transport import EventStream, read_json_body, stop_handed_watch

GATEWAY_ID_PREFIX = "gw-"   # generated x-request-id: gw-<24 hex> (engine/protocol/request_ids.py)


async def serve_observed(request: Request, endpoint: str, headers,
                         answer: Callable[..., Awaitable[Response]]) -> Response:
    """``answer(gw, rec, rid, raw)``'s response to ``request``, observed as ``endpoint``.

    Before it: 503 while the gateway drains, the request id (forwarded upstream; echoed as ``x-request-id``),
    the record (``gw.obs.begin``: span, trace context), the key's tenant (401) and the size- and time-limited
    body, declared as JSON. After it: a
    ``ClientError`` is recorded (``gw.obs.reject``) and raised on; a request that ends without a stream (499, an
    unexpected error) is still metered and logged (``gw.obs.abandon``), while an ``EventStream``'s record is
    completed by observability's stream wrapper at its end. ``answer`` completes the record of a whole answer
    itself (``gw.obs.finish``)."""
    gw = request.app.state.gw
    rid = unique_request_id(request.scope, GATEWAY_ID_PREFIX)
    rec = gw.obs.begin(rid, endpoint, headers)
    response = None
    try:
        if gw.draining:   # logged and counted as any refusal (an SRE trial's rolling deploy showed none of them)
            raise ClientError(503, "the gateway is draining; retry on another replica", code="draining",
                              headers={"retry-after": "1", "connection": "close"})
        # the key first (a 401 reads no body); a later refusal (a bad body, an unknown model) is logged and
        # counted under the tenant that sent it
        rec.tenant = gw.snapshot.authenticate(headers,
                                              "anthropic" if endpoint == "messages" else "openai")
        raw = await read_json_body(request, gw.snapshot.max_body_size, gw.snapshot.compiled.config.server.body_timeout_s)
        response = await answer(gw, rec, rid, raw)
        return response
    except ClientError as e:
        await gw.obs.reject(rec, e)
        raise
    finally:
        if not isinstance(response, EventStream):
            gw.obs.abandon(rec)
            stop_handed_watch(request.scope)     # the answer's disconnect watch, when no stream takes it over


def streamed(answer) -> bool:
    """Whether a pipeline answer is relayed as a stream (``unless_disconnected``'s ``hand_over``: its disconnect
    watch goes on watching the stream)."""
    return answer.stream is not None
