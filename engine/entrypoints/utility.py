"""vLLM's utility endpoints of ``tandem engine serve``: ``POST /tokenize``, ``POST /detokenize``
(``engine/serving/tokenization.py``: the chat form is rendered as ``/v1/chat/completions`` renders it) and
``GET /version`` (the ``tandem`` package's version); ``/ping`` is ``server.py``'s, beside ``/health``. Outside
``/v1``, as vLLM's: ``--api-key`` does not guard them.
"""

from __future__ import annotations

from litestar import Request, Response, get, post

from engine.entrypoints.request_state import json_body, serving_of
from engine.protocol.version import tandem_version


@post("/tokenize", status_code=200)
async def tokenize(request: Request) -> Response:
    """A prompt (``{"model", "prompt", "add_special_tokens"}``) or a conversation (``{"model", "messages",
    "add_generation_prompt", ...}``) as ``{"count", "max_model_len", "tokens", "token_strs"}``."""
    body = await json_body(request)
    return Response(content=serving_of(request, "tokenization").create_tokenize(body), media_type="application/json")


@post("/detokenize", status_code=200)
async def detokenize(request: Request) -> Response:
    """``{"model", "tokens"}`` as ``{"prompt"}``."""
    body = await json_body(request)
    return Response(content=serving_of(request, "tokenization").create_detokenize(body),
                    media_type="application/json")


@get("/version")
async def server_version() -> Response:
    """``{"version": ...}``: the ``tandem`` package's version (vLLM answers its own)."""
    return Response(content={"version": tandem_version()}, media_type="application/json")
