"""vLLM's ``POST /tokenize`` and ``POST /detokenize`` on the gateway's ``base_url``: the local engine's tokenizer
(``engine/serving/tokenization.py``, the engine server's own handlers), so a client counts tokens against the
``base_url`` it was given, as against ``vllm serve``. Authenticated like the client APIs; not routed, limited or
billed (no model is called). ``model``, when given, is any public model or alias (the answer is the local
engine's tokenizer's, as ``/v1/messages/count_tokens`` counts with it)."""

from __future__ import annotations

import msgspec
from litestar import Request, Response, post

from gateway.errors import ClientError, model_not_found
from gateway.http.transport import read_json_body
from gateway.offload import off_loop
from gateway.request.pipeline import engine_loading
from gateway.request.validate import parse_json

_JSON = "application/json"


async def _tokenization(request: Request, path: str) -> Response:
    snap = request.app.state.gw.snapshot
    compiled = snap.compiled
    snap.authenticate(request.headers)
    raw = await read_json_body(request, snap.max_body_size, compiled.config.server.body_timeout_s)
    answer = await off_loop(len(raw), _answer, snap, path, raw)   # a 4 MB prompt: seconds, off the loop (one hop)
    return Response(msgspec.json.encode(answer), status_code=200, media_type=_JSON)


def _answer(snap, path: str, raw: bytes) -> dict:
    """The answer of ``path`` (``/tokenize`` or ``/detokenize``) to the JSON body ``raw``, by the local engine's
    tokenizer. Raises ClientError as the handlers say."""
    compiled = snap.compiled
    body = parse_json(raw)
    model = body.pop("model", None)
    if model is not None and (not isinstance(model, str) or model not in compiled.model_names):
        raise model_not_found(str(model), compiled.public_models)
    local = snap.local
    if local is None:
        raise ClientError(404, f"{path} needs the local engine's tokenizer, and this gateway has no local backend",
                          code="not_found")
    if local.loading:
        raise engine_loading()
    return local.tokenization(path, body)


@post("/tokenize")
async def tokenize(request: Request) -> Response:
    """vLLM's ``POST /tokenize``: ``{"count", "max_model_len", "tokens", "token_strs"}`` of a ``prompt`` or of
    ``messages`` rendered as ``/v1/chat/completions`` renders them. Raises ClientError (400 naming the field, 404
    unknown model or no local backend, 503 engine loading or down)."""
    return await _tokenization(request, "/tokenize")


@post("/detokenize")
async def detokenize(request: Request) -> Response:
    """vLLM's ``POST /detokenize``: ``{"prompt"}``, the text of ``tokens``. Raises ClientError as ``tokenize``."""
    return await _tokenization(request, "/detokenize")


TOKENIZATION_HANDLERS = [tokenize, detokenize]
