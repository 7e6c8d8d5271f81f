"""``x-request-id`` of an HTTP request, one rule for ``tandem engine serve`` and the gateway.

The client's own header when it is 1-128 characters of ``[A-Za-z0-9._:/+=-]``, else a generated
``<prefix><24 hex>`` (the gateway's prefix is ``gw-``, the engine's none). It is computed once per request
and kept in the ASGI scope, so the handler and the ``before_send`` hook that echoes it on every response
(errors and unknown paths included) see the same id.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Awaitable, Callable

_CLIENT_ID = re.compile(rb"[A-Za-z0-9._:/+=-]{1,128}")
_SCOPE_KEY = "tandem.request_id"


def request_id(scope, prefix: str = "") -> tuple[str, bool]:
    """The request's ``x-request-id`` and whether the client chose it."""
    if (known := scope.get(_SCOPE_KEY)) is None:
        given = next((v for k, v in scope["headers"] if k == b"x-request-id"), None)
        if given is not None and _CLIENT_ID.fullmatch(given):
            known = (given.decode(), True)
        else:
            known = (f"{prefix}{secrets.token_hex(12)}", False)
        scope[_SCOPE_KEY] = known
    return known


def unique_request_id(scope, prefix: str = "", body_id: object = None) -> str:
    """The id to give the request inside the server: its ``x-request-id``, with ``-<8 hex>`` appended when
    the client chose it (clients may reuse theirs; ids must be unique). ``body_id``: the body's ``request_id``
    (vLLM's field), the client's choice when the header made none (then also the answered ``x-request-id``)."""
    rid, chosen = request_id(scope, prefix)
    if not chosen and isinstance(body_id, str) and _CLIENT_ID.fullmatch(body_id.encode()):
        rid, chosen = scope[_SCOPE_KEY] = (body_id, True)
    return f"{rid}-{secrets.token_hex(4)}" if chosen else rid


def stamp_request_id(prefix: str = "") -> Callable[[dict, dict], Awaitable[None]]:
    """A Litestar ``before_send`` hook putting ``x-request-id`` on every HTTP response."""

    async def stamp(message, scope) -> None:
        if message["type"] == "http.response.start":
            rid = request_id(scope, prefix)[0].encode()
            message["headers"] = [*((k, v) for k, v in message.get("headers", ()) if k.lower() != b"x-request-id"),
                                  (b"x-request-id", rid)]

    return stamp
