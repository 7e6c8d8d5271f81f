"""OpenAI's Responses API on the one pipeline: ``POST /v1/responses``, ``GET`` / ``DELETE /v1/responses/{id}``,
``GET /v1/responses/{id}/input_items``.

A Responses request is translated onto chat completions (``gateway/translate/responses.py``) and served by
``gateway/request/pipeline.py`` like any chat request, from the decoded chat body: auth, validation into the one
``GatewayRequest``, policies, admission (RPM/TPM, budgets), the attempt loop, the ledger's one usage record and
the metrics all see a chat request (labelled ``responses`` in logs and traces). The chat answer comes back
translated: a whole answer into the Responses object, a stream into the typed events
(``gateway/translate/responses_events.py``), written with the SSE codec (``gateway/sse.py``). An upstream that
declares the Responses API (``apis: [responses]``) is sent a whole request natively instead
(``GatewayRequest.source``; ``gateway/backends/dispatch.py``) and its answer is kept as it is, under the
gateway's id. ``truncation: auto`` hands the pipeline the way to shorten the conversation
(``gateway/translate/responses_truncation.py``), which it applies when the prompt exceeds the targets' context.
Errors are OpenAI's error JSON, as on chat. Stored responses: ``gateway/stored_responses.py``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial

import msgspec
from litestar import Request, Response, delete, get, post

from gateway.errors import ClientError
from gateway.http.serving import serve_observed, streamed
from gateway.http.transport import EventStream, unless_disconnected
from gateway.request.pipeline import handle
from gateway.request.validate import parse_json
from gateway.sse import named_event
from gateway.stored_responses import ResponseStore, StoredResponse
from gateway.translate.responses import from_chat, native_body, new_context, to_chat
from gateway.translate.responses_checks import check_body, check_include
from gateway.translate.responses_errors import responses_error, responses_error_object
from gateway.translate.responses_events import ResponsesEvents
from gateway.translate.responses_items import input_items
from gateway.translate.responses_truncation import fit_conversation, history_within
from gateway.values import ChatEvent, ChatStream

_JSON = "application/json"
_encode, _decode = msgspec.json.encode, msgspec.json.decode


def _not_found(response_id: str, param: str = "response_id") -> ClientError:
    return ClientError(404, f"Response with id '{response_id}' not found.", param=param, code="response_not_found")


async def _prepare(store: ResponseStore, raw: bytes, tenant: str, rid: str, limit: int):
    """The client's body (nulls dropped) checked and translated for ``tenant`` (authenticated before the body was
    read): (body, this turn's items, the conversation before them, within ``limit`` bytes with them
    (``history_within``), the chat body, the body for an upstream speaking the Responses API).

    Raises:
        ClientError: 400 (``context_length_exceeded`` for a conversation over ``limit``), 404 for an unknown
            ``previous_response_id`` (as OpenAI answers)."""
    body = {k: v for k, v in parse_json(raw).items() if v is not None}
    check_body(body)
    history: list = []
    prev_id = body.get("previous_response_id")
    if prev_id is not None:
        prev = await store.get(str(prev_id), tenant)
        if prev is None:
            raise _not_found(str(prev_id), "previous_response_id")
        history = prev.conversation()
    items = input_items(body, rid)
    history = history_within(history, items, limit, body.get("truncation") == "auto")
    return body, items, history, to_chat(body, history, items), native_body(body, history, items)


@post("/v1/responses")
async def create_response(request: Request) -> Response:
    """``POST /v1/responses``: the Responses object, or its typed events with ``stream: true``."""
    store: ResponseStore = request.app.state.responses
    headers = request.headers

    async def answer_(gw, rec, rid: str, raw: bytes) -> Response:
        tenant = rec.tenant
        body, items, history, chat, native = await _prepare(store, raw, tenant, rid, gw.snapshot.max_body_size)
        ctx = new_context(body, rid, gw.snapshot.compiled.model_names.get(body["model"], body["model"]))

        async def keep(final: dict) -> None:
            if body.get("store", True):
                await store.put(StoredResponse(tenant, final, items, history))

        fit = partial(fit_conversation, body, history + items) if body.get("truncation") == "auto" else None
        try:
            answer = await unless_disconnected(request, handle(gw, "chat/completions", raw, headers, rid, tenant,
                                                               body=chat, source=("responses", native), fit=fit),
                                          streamed)
        except ClientError as e:
            raise responses_error(e) from None
        if answer is None:                  # the client left: its upstream call was cancelled
            return Response(b"", status_code=499)
        if answer.stream is not None:
            events = responses_sse(gw.obs.stream(rec, answer.backend, answer.stream), ResponsesEvents(ctx), keep)
            return EventStream(events, status_code=200, media_type="text/event-stream",
                               headers={**answer.headers, "cache-control": "no-cache"})
        content = await gw.obs.finish(rec, answer.backend, answer.status, answer.content)
        if answer.status == 200:
            final = _decode(content)
            if answer.api == "responses":     # the upstream's own Responses object, under the gateway's names
                final.update(id=ctx.id, previous_response_id=body.get("previous_response_id"))
            else:
                final = from_chat(final, ctx)
            await keep(final)
            content = _encode(final)
        elif answer.api != "responses":     # a backend refused the chat body: name what the client sent
            content = _renamed_error(content, body)
        return Response(content, status_code=answer.status, media_type=_JSON, headers=answer.headers)

    return await serve_observed(request, "responses", headers, answer_)


def _renamed_error(content: bytes, body: dict) -> bytes:
    """An OpenAI error body answered for the chat translation, naming the Responses parameters of the client's
    ``body`` (any other error body as it is)."""
    try:
        obj = _decode(content)
    except msgspec.DecodeError:
        return content
    if not isinstance(obj, dict) or not isinstance(obj.get("error"), dict):
        return content
    return _encode({**obj, "error": responses_error_object(obj["error"], body)})


def _translated(events: ResponsesEvents, ev: ChatEvent) -> list[dict]:
    if ev.done:
        return []
    if ev.error:
        error = ev.error
        return events.error(responses_error_object(error) if isinstance(error, dict) else {"message": str(error)})
    return events.feed(ev)


def _sse(events: list[dict]) -> bytes:
    return b"".join(named_event(e["type"], _encode(e)) for e in events)


async def responses_sse(chat: ChatStream, events: ResponsesEvents,
                        keep: Callable[[dict], Awaitable[None]]) -> AsyncIterator[bytes]:
    """The chat stream ``chat`` (already observed: billed, metered) as the Responses API's typed events; the
    final response is kept (``keep``) before its last event is sent, so a follow-up can name it at once. Closing
    this generator closes ``chat``."""
    exhausted = False
    try:
        yield _sse(events.start())
        async for batch in chat:
            out = []
            for ev in batch:
                out += _translated(events, ev)
            if out:
                yield _sse(out)
        exhausted = True
        out = events.finish()
        if events.final is not None:
            await keep(events.final)
        yield _sse(out)
    finally:
        if not exhausted:
            await chat.aclose()


async def _stored(request: Request) -> tuple[ResponseStore, str, str]:
    gw = request.app.state.gw
    tenant = gw.snapshot.authenticate(request.headers)
    return request.app.state.responses, tenant, request.path_params["response_id"]


def _check_include(request: Request) -> None:
    """The query's ``include`` values (``include`` or ``include[]``, repeated) are OpenAI's (no-ops here but
    logprobs, which a stored response has or has not).

    Raises:
        ClientError: 400 naming ``include[i]``."""
    q = request.query_params
    check_include(q.getall("include", []) + q.getall("include[]", []))


@get("/v1/responses/{response_id:str}")
async def retrieve_response(request: Request) -> Response:
    """``GET /v1/responses/{id}``: a stored response of the caller's tenant; 404 otherwise. ``stream=true``
    (OpenAI's replay of a background response's events) is a 400: ``background`` is refused, so no response
    has events to replay."""
    store, tenant, rid = await _stored(request)
    _check_include(request)
    if request.query_params.get("stream", "false").lower() not in ("false", "0"):
        raise ClientError(400, "Only background responses can be streamed when retrieved, and this gateway "
                          "creates none ('background' is refused): retrieve it without 'stream'.",
                          param="stream", code="invalid_value")
    record = await store.get(rid, tenant)
    if record is None:
        raise _not_found(rid)
    return Response(_encode(record.response), media_type=_JSON)


@delete("/v1/responses/{response_id:str}", status_code=200)
async def delete_response(request: Request) -> Response:
    """``DELETE /v1/responses/{id}``: ``{"id", "object": "response", "deleted": true}``; 404 when not stored."""
    store, tenant, rid = await _stored(request)
    if not await store.delete(rid, tenant):
        raise _not_found(rid)
    return Response(_encode({"id": rid, "object": "response", "deleted": True}), media_type=_JSON)


@post("/v1/responses/{response_id:str}/cancel")
async def cancel_response(request: Request) -> Response:
    """``POST /v1/responses/{id}/cancel``: OpenAI cancels background responses only, and this gateway creates none
    (``background`` is refused): a stored response is a 400 as OpenAI's for a synchronous one; 404 otherwise."""
    store, tenant, rid = await _stored(request)
    if await store.get(rid, tenant) is None:
        raise _not_found(rid)
    raise ClientError(400, "Cannot cancel a synchronous response.")


@get("/v1/responses/{response_id:str}/input_items")
async def list_input_items(request: Request) -> Response:
    """``GET /v1/responses/{id}/input_items``: the response's input items as OpenAI lists them (``order``
    ``desc`` by default, ``limit`` 1..100, default 20, ``after`` an item id, ``include`` OpenAI's values)."""
    store, tenant, rid = await _stored(request)
    _check_include(request)
    record = await store.get(rid, tenant)
    if record is None:
        raise _not_found(rid)
    q = request.query_params
    order = q.get("order", "desc")
    if order not in ("asc", "desc"):
        raise ClientError(400, "'order' must be asc or desc", param="order", code="invalid_value")
    try:
        limit = int(q.get("limit", 20))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise ClientError(400, "'limit' must be an integer from 1 to 100", param="limit", code="invalid_value")
    items = list(record.input if order == "asc" else reversed(record.input))
    after = q.get("after")
    if after is not None:
        ids = [i.get("id") for i in items]
        items = items[ids.index(after) + 1:] if after in ids else []
    page = items[:limit]
    body = {"object": "list", "data": page, "first_id": page[0].get("id") if page else None,
            "last_id": page[-1].get("id") if page else None, "has_more": len(items) > limit}
    return Response(_encode(body), media_type=_JSON)


RESPONSES_HANDLERS = [create_response, retrieve_response, delete_response, cancel_response, list_input_items]
