"""``POST /v1/ttft``: the engine's TTFT prediction for a request it has not been sent (``engine/core/ttft.py``), so
a router in another process asks the engine itself instead of guessing from scraped metrics.

The body is a chat or completion request as ``/v1/chat/completions`` / ``/v1/completions`` take it (rendered
and tokenized the same way, and checked by the same function, ``prepare_chat`` / ``prepare_completion``: a body
the endpoint refuses gets the same 400/404 here; nothing is queued). The answer: ``ttft_s`` (seconds), ``prompt_tokens``,
``uncached_tokens`` (what the prefix cache does not hold), ``tpot_s`` (predicted seconds per output token once it
decodes), ``explanation`` (one line with the numbers).
"""

from __future__ import annotations

from litestar import Request, Response, post

from engine.entrypoints.request_state import json_body, serving_of
from engine.protocol.errors import ServingError


@post("/v1/ttft", status_code=200)
async def ttft(request: Request) -> Response:
    """The predicted TTFT of the request in the body if it were sent now (the endpoint's own 400/404 for a body
    it refuses, 503 while the engine loads)."""
    engine = request.app.state.engine
    body = await json_body(request)
    if "messages" in body:   # the endpoint's own checks (one function), nothing queued
        rendered, _ = await serving_of(request, "chat").prepare_chat(body)
    else:
        rendered, _ = await serving_of(request, "completion").prepare_completion(body)
    token_ids = rendered.prompts[0][1]
    priority = getattr(rendered.request, "priority", None) or 0
    p = engine.predict_ttft(token_ids, priority, getattr(rendered.request, "cache_salt", None))
    if p is None:
        raise ServingError(503, "the engine has not published its state yet; retry", type="server_error",
                           code="engine_loading")
    return Response(content={"ttft_s": p.seconds, "prompt_tokens": p.parts["prompt"],
                             "uncached_tokens": p.parts["uncached"], "tpot_s": p.parts["tpot_s"],
                             "explanation": p.describe()},
                    media_type="application/json")
