"""The Litestar app: OpenAI endpoints, health, admin API. HTTP glue only:
the request path is ``gateway/request/pipeline.py``, config state is
``gateway/runtime.py``.

Endpoints: POST /v1/chat/completions, POST /v1/completions, GET /v1/models,
GET /health/live, GET /health/ready; admin (bearer token from the env var
named by ``admin.token_env``): POST /admin/reload, POST /admin/rollback,
POST /admin/weights, POST /admin/drain, GET /admin/config; from
``gateway/observability/telemetry.py``: GET /metrics (Prometheus), GET /admin/usage.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
from collections.abc import AsyncIterator

import msgspec
from litestar import Litestar, Request, Response, get, post
from litestar.exceptions import HTTPException
from litestar.response import Stream
from litestar.response.streaming import ASGIStreamingResponse

from gateway.request.auth import authenticate, check_admin
from gateway.config.schema import ConfigError
from gateway.errors import ClientError, error_body
from gateway.request.pipeline import handle
from gateway.runtime import Gateway

log = logging.getLogger("tandem.gateway.app")
_JSON = "application/json"
_encode = msgspec.json.encode


def _error(status: int, message: str, param: str | None = None, code: str | None = None,
           headers: dict | None = None) -> Response:
    return Response(error_body(status, message, param, code), status_code=status, media_type=_JSON, headers=headers)


def _client_error(e: ClientError) -> Response:
    return Response(e.body(), status_code=e.status, media_type=_JSON, headers=e.headers or None)


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refusing more than ``limit`` bytes (declared or sent).

    Raises:
        ClientError: 413 when too large."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ClientError(413, f"request body is {declared} bytes; the limit is {limit} bytes",
                          code="request_too_large")
    chunks: list[bytes] = []
    size = 0
    while True:
        event = await request.receive()
        if event["type"] == "http.disconnect":
            raise ClientError(400, "client disconnected while sending the body", code="client_disconnected")
        body = event.get("body", b"")
        if body:
            size += len(body)
            if size > limit:
                raise ClientError(413, f"request body exceeds the limit of {limit} bytes", code="request_too_large")
            chunks.append(body)
        if not event.get("more_body", False):
            break
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def _until_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class _DisconnectWatch:
    """Cancels the current task when the client disconnects (``receive`` ends), until ``stop``: one task
    awaiting ``receive``, the watched work runs on in the current task. ``gone``: the client left."""

    __slots__ = ("task", "active", "gone", "watcher")

    def __init__(self, receive):
        self.task = asyncio.current_task()
        self.active, self.gone = True, False
        self.watcher = asyncio.ensure_future(_until_disconnect(receive))
        self.watcher.add_done_callback(self._done)

    def _done(self, fut: asyncio.Future) -> None:
        if fut.cancelled():
            return
        fut.exception()                  # retrieved: a failing receive counts as a disconnect
        if self.active:
            self.gone = True
            self.task.cancel()

    def stop(self) -> None:
        self.active = False
        self.watcher.cancel()

    def consumed(self) -> bool:
        """While handling a CancelledError (or after a swallowed one): True when it was this watch's."""
        return self.gone and self.task.uncancel() == 0


async def _unless_disconnected(request: Request, coro):
    """Await ``coro`` (the body is already read) unless the client disconnects
    first: then cancel it -- which closes the upstream connection or aborts
    the local engine request -- and return None. (Once a stream is
    committed, ``_ASGIEventStream`` does the same.)"""
    watch = _DisconnectWatch(request.receive)
    try:
        result = await coro
    except asyncio.CancelledError:
        watch.stop()
        if watch.consumed():
            log.info("client disconnected; upstream request cancelled")
            return None
        raise
    except BaseException:
        watch.stop()
        raise
    watch.stop()
    if watch.gone:                       # cancelled on the client's behalf, but the work finished anyway
        watch.consumed()
        log.info("client disconnected; upstream request cancelled")
        return None
    return result


class _ASGIEventStream(ASGIStreamingResponse):
    """Litestar's streaming response with a lighter watch for the client's disconnect: one task awaiting
    ``receive`` whose completion cancels the streaming task (the iterator's ``finally`` then closes the upstream),
    instead of an anyio task group per response. Otherwise the same ASGI events."""

    __slots__ = ()

    async def send_body(self, send, receive) -> None:
        watch = _DisconnectWatch(receive)
        try:
            await self._stream(send)
        except asyncio.CancelledError:
            watch.stop()
            if watch.consumed():
                return               # the client left: the stream was cancelled on its behalf
            raise
        finally:
            watch.stop()


class _EventStream(Stream):
    """``Stream`` answered by ``_ASGIEventStream``."""

    __slots__ = ()

    def to_asgi_response(self, *args, **kwargs) -> ASGIStreamingResponse:
        resp = super().to_asgi_response(*args, **kwargs)
        resp.__class__ = _ASGIEventStream
        return resp


def create_app(gw: Gateway) -> Litestar:
    """The ASGI app for one ``Gateway`` (its start/stop run in the lifespan)."""

    async def _tracked(stream: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        try:
            async for chunk in stream:
                yield chunk
        finally:
            gw.in_flight -= 1
            await stream.aclose()

    async def _serve(request: Request, endpoint: str) -> Response:
        if gw.draining:
            return _error(503, "the gateway is draining; retry on another replica", code="draining",
                          headers={"retry-after": "1", "connection": "close"})
        headers = request.headers
        request_id = f"gw-{secrets.token_hex(12)}"    # ours: unique even when clients reuse theirs
        rec = gw.obs.begin(request_id, endpoint, headers)   # span, trace context (gateway/observability/telemetry.py)
        gw.in_flight += 1
        streaming = False
        try:
            raw = await read_body(request, gw.snapshot.max_body_size)
            h = await _unless_disconnected(request, handle(gw, endpoint, raw, headers, request_id))
            if h is None:                       # the client left: its upstream call was cancelled
                return Response(b"", status_code=499)
            out = h.outcome
            resp_headers = {"x-tandem-route": h.decision.route, "x-tandem-rule": h.decision.rule,
                            "x-tandem-backend": out.backend or "none", "x-tandem-attempts": str(out.attempts),
                            "x-request-id": request_id, **out.headers}
            if out.stream is not None:
                streaming = True
                resp_headers["cache-control"] = "no-cache"
                return _EventStream(gw.obs.stream(rec, h, _tracked(out.stream)), status_code=200,
                                    media_type="text/event-stream", headers=resp_headers)
            content = await gw.obs.finish(rec, h, out.status, out.content)   # metrics, cost, log; secrets redacted
            return Response(content, status_code=out.status, media_type=out.content_type, headers=resp_headers)
        except ClientError as e:
            await gw.obs.reject(rec, e, headers)
            return _client_error(e)
        finally:
            if not streaming:
                gw.in_flight -= 1
                gw.obs.abandon(rec)          # 499 / unexpected error: still metered and logged

    @post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _serve(request, "chat/completions")

    @post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _serve(request, "completions")

    @get("/v1/models")
    async def models(request: Request) -> Response:
        try:
            authenticate(request.headers.get("authorization"), gw.snapshot.compiled.key_hashes)
        except ClientError as e:
            return _client_error(e)
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "tandem"}
                for m in gw.snapshot.compiled.public_models]
        return Response(_encode({"object": "list", "data": data}), media_type=_JSON)

    @get("/health/live")
    async def live() -> Response:
        return Response(b'{"status":"ok"}', media_type=_JSON)

    @get("/health/ready")
    async def ready() -> Response:
        snap = gw.snapshot
        body = {"ready": gw.ready, "draining": gw.draining, "config_version": snap.version if snap else None,
                "redis_degraded": gw.redis_degraded or gw.resilience.degraded,
                "backends": {n: {"available": b.available, "reason": b.unavailable_reason}
                             for n, b in (snap.backends.items() if snap else ())}}
        return Response(_encode(body), status_code=200 if gw.ready else 503, media_type=_JSON)

    # ----- admin --------------------------------------------------------------------------------------------------
    def _admin(request: Request) -> None:
        env = gw.snapshot.compiled.config.admin.token_env
        check_admin(request.headers.get("authorization"), os.environ.get(env), env)

    async def _admin_call(request: Request, fn) -> Response:
        try:
            _admin(request)
            result = await fn()
        except ClientError as e:
            return _client_error(e)
        except ConfigError as e:
            param = e.errors[0][0] if e.errors else None
            return _error(400, str(e), param=param, code="invalid_config")
        except LookupError as e:
            return _error(409, str(e), code="no_previous_version")
        return Response(_encode(result), status_code=200, media_type=_JSON)

    @post("/admin/reload")
    async def admin_reload(request: Request) -> Response:
        return await _admin_call(request, lambda: gw.reload("admin"))

    @post("/admin/rollback")
    async def admin_rollback(request: Request) -> Response:
        return await _admin_call(request, gw.rollback)

    @post("/admin/weights")
    async def admin_weights(request: Request) -> Response:
        async def run() -> dict:
            raw = await read_body(request, 1 << 20)
            try:
                body = msgspec.json.decode(raw) if raw else None
            except msgspec.DecodeError:
                body = None
            if not isinstance(body, dict) or not isinstance(body.get("route"), str) \
                    or not isinstance(body.get("weights"), dict):
                raise ClientError(400, 'expected {"route": NAME, "weights": {TARGET: PERCENT, ...}}', param="weights")
            for k, v in body["weights"].items():
                if isinstance(v, bool) or not isinstance(v, (int, float)):
                    raise ClientError(400, f"weight of {k!r} must be a number", param=f"weights.{k}")
            return await gw.set_weights(body["route"], body["weights"])
        return await _admin_call(request, run)

    @post("/admin/drain")
    async def admin_drain(request: Request) -> Response:
        async def run() -> dict:
            asyncio.get_running_loop().create_task(gw.drain())
            return {"draining": True, "in_flight": gw.in_flight}
        return await _admin_call(request, run)

    @get("/admin/config")
    async def admin_config(request: Request) -> Response:
        return await _admin_call(request, gw.describe)

    def on_http_error(request: Request, exc: Exception) -> Response:
        if isinstance(exc, HTTPException):
            code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(exc.status_code)
            return _error(exc.status_code, str(exc.detail), code=code)
        log.exception("unhandled error on %s", request.url.path)
        return _error(500, "internal error", code="internal_error")

    return Litestar(
        route_handlers=[chat_completions, completions, models, live, ready, admin_reload, admin_rollback,
                        admin_weights, admin_drain, admin_config, *gw.obs.routes()],
        on_startup=[gw.start, gw.obs.start], on_shutdown=[gw.obs.stop, gw.stop],
        exception_handlers={HTTPException: on_http_error, Exception: on_http_error},
        openapi_config=None, request_max_body_size=None, logging_config=None,
    )
