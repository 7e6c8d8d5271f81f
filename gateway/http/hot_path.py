"""The hot path: the client APIs' POST endpoints (``/v1/chat/completions``, ``/v1/completions``,
``/v1/embeddings``, ``/v1/messages``) served straight from the ASGI call, past Litestar's per-request machinery
(routing, the handler's signature model, its ``Request``, the middleware and exception layers). The handler
functions, the app's middleware, its ``before_send`` hooks, the exception tables and the responses are the same
objects Litestar uses, so the bytes on the wire are the same (``tests/gateway/http/test_hot_path.py`` compares the
two paths); every other request goes to Litestar.

Litestar's route-handler path was 15 % of the gateway's CPU per request at 32 clients (issue 48's profile). The
hot path is off when CORS is configured (Litestar's CORS middleware then answers preflights and adds its headers).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from inspect import getmro

from litestar import Litestar, Request, Response
from litestar.enums import MediaType
from litestar.response import Stream
from litestar.utils.helpers import get_enum_string_value

from gateway.http.transport import HANDED_WATCH, stream_body

Answer = Callable[["RawRequest"], Awaitable[Response]]


@dataclass(frozen=True)
class HotRoute:
    """One hot endpoint: ``answer(request)`` is its handler's body (the Litestar handler calls the same function);
    ``exception_handlers`` its exception -> response table (the app's, or the route's overriding it)."""

    answer: Answer
    exception_handlers: Mapping[type[Exception], Callable[[Request, Exception], Response]]


class RawRequest:
    """What a hot handler reads of a request, as Litestar's ``Request`` names it: ``app`` (its ``state.gw``), the
    ASGI ``scope`` and ``receive``, and ``headers`` (lower-case names -> values; a repeated header: its first value,
    as Litestar's ``Headers.get``)."""

    __slots__ = ("app", "scope", "receive", "headers")

    def __init__(self, app: Litestar, scope: dict, receive) -> None:
        self.app, self.scope, self.receive = app, scope, receive
        self.headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in reversed(scope["headers"])}


def _handler_for(table: Mapping, exc: Exception):
    """The handler of ``exc`` in ``table``: the first class of its MRO that has one (Litestar's rule for tables
    keyed by exception types; ours have no status-code keys)."""
    return next((table[cls] for cls in getmro(type(exc)) if cls in table), None)


class HotPathApp(Litestar):
    """Litestar with ``hot_routes`` (exact path -> ``HotRoute``) served for POST before Litestar's router."""

    def __init__(self, *, hot_routes: Mapping[str, HotRoute], **kwargs) -> None:
        super().__init__(**kwargs)
        self.hot_routes = dict(hot_routes)
        self._hot = self._serve_hot
        for factory in reversed(kwargs.get("middleware") or ()):   # the app's middleware, as Litestar nests it
            self._hot = factory(self._hot)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in self.hot_routes:
            scope["app"] = scope["litestar_app"] = self
            scope.setdefault("state", {})
            await self._hot(scope, receive, self._wrap_send(send=send, scope=scope))
            return
        await super().__call__(scope, receive, send)

    async def _serve_hot(self, scope, receive, send) -> None:
        """Answer one hot request: the route's answer, or its exception's response when it raised (before
        anything was sent: an answer raises before it returns its response); an exception while the response is
        sent propagates to the server, as Litestar's does once a response has started."""
        route = self.hot_routes[scope["path"]]
        request = RawRequest(self, scope, receive)
        try:
            response = await route.answer(request)
        except Exception as e:   # noqa: BLE001 -- the exception table decides, as Litestar's middleware does
            handler = _handler_for(route.exception_handlers, e)
            if handler is None:
                raise
            response = handler(Request(scope, receive, send), e)
        await send_response(response, scope, receive, send)


_NO_BODY = (204, 304)


async def send_response(response: Response, scope, receive, send) -> None:
    """Send ``response`` as Litestar would (``Response.to_asgi_response``: its headers in order, then
    ``content-type`` and, for a whole body, ``content-length`` unless given), without its intermediate
    objects: a ``Stream`` of bytes or str, or bytes content; anything else (cookies, background tasks, content
    to serialise) goes through Litestar's own conversion."""
    stream = isinstance(response, Stream)
    content = None if stream else response.content
    status = response.status_code or 200
    if response.cookies or response.background is not None or not (stream or isinstance(content, bytes)) \
            or status in _NO_BODY or status < 200:
        await response.to_asgi_response(None, None)(scope, receive, send)
        return
    headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in response.headers.items()]
    if not any(k == b"content-type" for k, _ in headers):
        media = get_enum_string_value(response.media_type or MediaType.JSON)
        headers.append((b"content-type", (f"{media}; charset={response.encoding}" if media.startswith("text/")
                                          else media).encode("latin-1")))
    if not stream and not any(k == b"content-length" for k, _ in headers):
        headers.append((b"content-length", b"%d" % len(content)))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    if stream:
        await stream_body(response.iterator, send, receive, response.encoding, scope.pop(HANDED_WATCH, None))
    else:
        await send({"type": "http.response.body", "body": content, "more_body": False})

