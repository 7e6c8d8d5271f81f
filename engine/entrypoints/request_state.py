"""What the engine server's handlers read of a request and of the app's state: the JSON body, and the serving
object of an endpoint kind (503 while the model loads). Used by ``server.py``'s endpoints and ``ttft.py``."""

from __future__ import annotations

import msgspec
from litestar import Request

from engine.protocol.errors import ENGINE_LOADING_RETRY_AFTER_S, ServingError
from engine.serving.protocol import decode_body


async def json_body(request: Request) -> dict:
    """The request's body as a JSON object (``engine.serving.protocol.decode_body``: structured outputs' schemas
    stay unparsed).

    Raises:
        ServingError: 400 ``invalid_json`` for a malformed body, one nested too deep, or one that is not an object.
    """
    raw = await request.body()
    try:
        body = decode_body(raw)   # structured outputs' schemas stay unparsed (issue #34)
    except msgspec.DecodeError as exc:
        raise ServingError(400, f"malformed JSON body: {exc}", param=None, code="invalid_json") from None
    except RecursionError:       # msgspec's own nesting limit (about 1,000 levels here)
        raise ServingError(400, "the request body nests arrays and objects too deep", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ServingError(400, "the request body must be a JSON object", code="invalid_json")
    return body


def serving_of(request: Request, kind: str):
    """The app's serving object of ``kind`` ("chat", "completion", "embedding" or "tokenization": ``engine.serving``'s).

    Raises:
        ServingError: 503 ``engine_loading`` (with ``Retry-After``) while the
            model loads, 503 ``engine_unavailable`` when loading failed.
    """
    serving = request.app.state.get(kind)
    if serving is not None:
        return serving
    error = request.app.state.get("load_error")
    if error is not None:
        raise ServingError(503, f"the engine failed to load: {error}", type="server_error",
                           code="engine_unavailable")
    raise ServingError(503, "the engine is loading the model; retry later", type="server_error",
                       code="engine_loading", headers={"Retry-After": str(ENGINE_LOADING_RETRY_AFTER_S)})
