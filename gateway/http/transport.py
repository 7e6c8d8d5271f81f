"""The HTTP transport of one request: its body in (``read_body``, size-limited; ``read_json_body``: declared as
JSON), its SSE answer out (``EventStream``), and client disconnects: a client that leaves cancels its upstream
work, before the answer (``unless_disconnected``) and while a stream is relayed, with one task awaiting
``receive`` per request (handed from the answer to its stream) instead of an anyio task group per response."""

from __future__ import annotations

import asyncio
import logging
import zlib
from collections.abc import Callable
from typing import Any

from litestar import Request
from litestar.response import Stream
from litestar.response.streaming import ASGIStreamingResponse

from gateway.errors import ClientError
from gateway.sse import Last

log = logging.getLogger("tandem.gateway.app")


async def read_body(request: Request, limit: int, timeout_s: float | None = None) -> bytes:
    """The request body, refusing more than ``limit`` bytes (declared or sent) or a body still incomplete
    ``timeout_s`` seconds after its headers (a slow client holds a connection and a task; None: no limit),
    decoded from its ``Content-Encoding`` (``decode_content``: at most ``limit`` bytes decoded too).

    Raises:
        ClientError: 413 when too large; 408 when too slow; 400 when the client disconnects while sending it;
            415 for a content coding other than gzip, deflate and identity."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ClientError(413, f"request body is {declared} bytes; the limit is {limit} bytes",
                          code="request_too_large")
    try:
        async with asyncio.timeout(timeout_s):
            raw = await _receive_body(request, limit)
    except TimeoutError:
        raise ClientError(408, f"request body not received within {timeout_s:g}s", code="request_timeout",
                          headers={"connection": "close"}) from None
    encoding = request.headers.get("content-encoding")
    return raw if encoding is None else decode_content(raw, encoding, limit)


def check_json_content_type(headers) -> None:
    """Refuse a body declared as anything but JSON: ``Content-Type`` ``application/json`` (with any parameters, e.g.
    ``charset=utf-8``) or a structured ``application/*+json`` type. No ``Content-Type`` at all is read as JSON
    (clients such as ``curl --data-binary`` without ``-H`` and hand-written scripts omit it).

    Raises:
        ClientError: 400 ``unsupported_content_type`` naming the type sent (as OpenAI's API answers it)."""
    value = headers.get("content-type")
    if not value or not value.strip():
        return
    media = value.partition(";")[0].strip().lower()
    if media == "application/json" or (media.startswith("application/") and media.endswith("+json")):
        return
    raise ClientError(400, f"Unsupported content type: '{value}'. This endpoint accepts JSON bodies only: send "
                      "'Content-Type: application/json'", param="content-type", code="unsupported_content_type")


async def read_json_body(request: Request, limit: int, timeout_s: float | None = None) -> bytes:
    """``read_body`` of a client API's request, after ``check_json_content_type`` (refused before it is read)."""
    check_json_content_type(request.headers)
    return await read_body(request, limit, timeout_s)


# content coding -> zlib's wbits (RFC 9110 8.4.1: gzip; deflate is the zlib format)
_CODINGS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
ACCEPT_ENCODING = "gzip, deflate, identity"


def decode_content(raw: bytes, encoding: str, limit: int) -> bytes:
    """``raw`` decoded from the content codings of a ``Content-Encoding`` header (listed in the order they were
    applied), each decoded size bounded by ``limit`` (a small gzip can expand a thousandfold).

    Raises:
        ClientError: 415 naming a coding other than gzip, deflate and identity (with ``Accept-Encoding``, RFC
            9110 15.5.16); 413 when the decoded body exceeds ``limit``; 400 when it is not valid in its coding."""
    codings = [c.strip().lower() for c in encoding.split(",") if c.strip()]
    for coding in reversed(codings):
        if coding == "identity":
            continue
        wbits = _CODINGS.get(coding)
        if wbits is None:
            raise ClientError(415, f"Content-Encoding '{coding}' is not supported; send the body as gzip, deflate or "
                              "identity", param="content-encoding", code="unsupported_content_encoding",
                              headers={"accept-encoding": ACCEPT_ENCODING})
        d = zlib.decompressobj(wbits)
        try:
            out = d.decompress(raw, limit + 1)
        except zlib.error as e:
            raise ClientError(400, f"request body is not valid {coding} data ({e})", param="content-encoding",
                              code="invalid_content_encoding") from None
        if len(out) > limit or d.unconsumed_tail:
            raise ClientError(413, f"request body exceeds the limit of {limit} bytes once {coding}-decoded",
                              code="request_too_large")
        if not d.eof:
            raise ClientError(400, f"request body is truncated {coding} data", param="content-encoding",
                              code="invalid_content_encoding")
        raw = out
    return raw


async def _receive_body(request: Request, limit: int) -> bytes:
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


# scope key: the watch ``unless_disconnected`` hands to the stream that relays its answer (``stream_body``)
HANDED_WATCH = "tandem.disconnect_watch"


class _DisconnectWatch:
    """Cancels the current task when the client disconnects (``receive`` ends), until ``stop``: one task
    awaiting ``receive``, the watched work runs on in the current task. ``gone``: the client left. ``pause``
    keeps the task awaiting ``receive`` without cancelling anything, so that the request's stream ``resume``s the
    same watch (one task per request, not one for the answer and one for its stream)."""

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

    def pause(self) -> None:
        self.active = False

    def resume(self) -> None:
        """Watch again, for the current task; a client that left while paused cancels it at its next await."""
        self.task, self.active = asyncio.current_task(), True
        if self.watcher.done() and not self.watcher.cancelled():
            self.gone = True
            self.task.cancel()

    def stop(self) -> None:
        self.active = False
        self.watcher.cancel()

    def consumed(self) -> bool:
        """While handling a CancelledError (or after a swallowed one): True when it was this watch's."""
        return self.gone and self.task.uncancel() == 0


async def unless_disconnected(request: Request, coro, hand_over: Callable[[Any], bool] | None = None):
    """Await ``coro`` (the body is already read) unless the client disconnects
    first: then cancel it -- which closes the upstream connection or aborts
    the local engine request -- and return None. (Once a stream is
    committed, ``stream_body`` does the same.) When ``hand_over(result)`` is true (the result is streamed), the
    watch is paused and left in the request's scope (``HANDED_WATCH``) for ``stream_body`` to resume."""
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
    if watch.gone:                       # cancelled on the client's behalf, but the work finished anyway
        watch.stop()
        watch.consumed()
        log.info("client disconnected; upstream request cancelled")
        return None
    if hand_over is not None and hand_over(result):
        watch.pause()
        request.scope[HANDED_WATCH] = watch
    else:
        watch.stop()
    return result


class _ASGIEventStream(ASGIStreamingResponse):
    """Litestar's streaming response with a lighter watch for the client's disconnect: one task awaiting
    ``receive`` whose completion cancels the streaming task (the iterator's ``finally`` then closes the upstream),
    instead of an anyio task group per response. Otherwise the same ASGI events."""

    __slots__ = ("watch",)

    async def __call__(self, scope, receive, send) -> None:
        self.watch = scope.pop(HANDED_WATCH, None)
        await super().__call__(scope, receive, send)

    async def send_body(self, send, receive) -> None:
        await stream_body(self.iterator, send, receive, self.encoding, self.watch)


def stop_handed_watch(scope) -> None:
    """Stop the watch ``unless_disconnected`` left in ``scope`` for a stream that is not going to be sent."""
    watch = scope.pop(HANDED_WATCH, None)
    if watch is not None:
        watch.stop()


async def stream_body(iterator, send, receive, encoding: str = "utf-8", watch: _DisconnectWatch | None = None) -> None:
    """Send ``iterator``'s chunks (bytes, or str in ``encoding``) as ASGI body events, then the final empty one
    (Litestar's ``ASGIStreamingResponse._stream``), cancelled when the client disconnects: ``watch`` (the paused
    watch of the answer, ``HANDED_WATCH``) resumed, or a new ``_DisconnectWatch``. A ``gateway.sse.Last`` chunk
    ends the body at once; the iterator is then run to its end (its layers close and account) with the watch
    stopped: a client that has its whole answer and leaves cancels nothing."""
    if watch is None:
        watch = _DisconnectWatch(receive)
    else:
        watch.resume()
    try:
        async for chunk in iterator:
            last = isinstance(chunk, Last)
            await send({"type": "http.response.body", "body": chunk if isinstance(chunk, bytes)
                        else chunk.encode(encoding), "more_body": not last})
            if last:
                watch.stop()
                await _finish(iterator)
                return
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    except asyncio.CancelledError:
        watch.stop()
        if watch.consumed():
            return                   # the client left: the stream was cancelled on its behalf
        raise
    finally:
        watch.stop()


async def _finish(iterator) -> None:
    """Run ``iterator`` to its end once its ``Last`` chunk is sent; anything after it is a codec's bug, dropped."""
    async for chunk in iterator:
        log.error("stream chunk after its last one dropped (%d bytes)", len(chunk))


class EventStream(Stream):
    """``Stream`` answered by ``_ASGIEventStream`` (Litestar's ``Stream.to_asgi_response``, another class)."""

    __slots__ = ()

    def to_asgi_response(self, app, request, *, background=None, cookies=None, encoded_headers=None, headers=None,
                         is_head_response=False, media_type=None, status_code=None, **_) -> ASGIStreamingResponse:
        return _ASGIEventStream(
            background=self.background or background, content_length=0,
            cookies=self.cookies if cookies is None else [*self.cookies, *cookies], encoded_headers=encoded_headers,
            encoding=self.encoding, headers={**headers, **self.headers} if headers is not None else self.headers,
            is_head_response=is_head_response, iterator=self.iterator, media_type=self.media_type or media_type,
            status_code=self.status_code or status_code)
