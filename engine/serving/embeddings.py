"""``POST /v1/embeddings`` over an ``AsyncEngine`` (vLLM's ``entrypoints/openai/serving_embedding.py``): ``input``
as a string, strings, token ids or token-id arrays; each embedded by pooling the model's final hidden states
(``engine/pooling.py``: the model's own pooling config, else last token, normalized); ``encoding_format`` float or
base64 (little-endian float32, as OpenAI encodes it). ``dimensions`` is refused: the vector has the model's hidden
size (no Matryoshka truncation is trained into a decoder run as an embedder). vLLM's extras: ``normalize`` (None:
the model's pooling config), ``add_special_tokens`` (default true) and ``truncate_prompt_tokens`` (each input's last
N tokens; -1: what fits ``max_model_len``).
"""

from __future__ import annotations

import base64
import sys
import time

import numpy as np

from engine.input_checks import dimensions_problem
from engine.serving.serving import OpenAIServing, RenderedPrompt, error_from_engine, truncate_prompt, truncation
from engine.protocol.errors import ServingError


def _inputs(value: object) -> list[str | list[int]]:
    """``input`` as one item per embedding. Raises ServingError(400) naming ``input``."""
    is_token = lambda x: isinstance(x, int) and not isinstance(x, bool) and x >= 0   # noqa: E731
    if isinstance(value, str) and value:
        return [value]
    if isinstance(value, list) and value:
        if all(isinstance(x, str) and x for x in value):
            return list(value)
        if all(is_token(x) for x in value):
            return [list(value)]
        if all(isinstance(x, list) and x and all(is_token(t) for t in x) for x in value):
            return [list(x) for x in value]
    raise ServingError(400, "input: must be a non-empty string, an array of non-empty strings, an array of token "
                            "ids, or an array of non-empty token-id arrays", param="input", code="invalid_value")


def _extras(body: dict, limit: int) -> tuple[bool | None, bool, int | None]:
    """vLLM's ``normalize``, ``add_special_tokens`` and ``truncate_prompt_tokens`` of an embeddings body (-1 as
    ``limit``). Raises ServingError(400) naming a value of the wrong type or out of range."""
    for name in ("normalize", "add_special_tokens"):
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise ServingError(400, f"{name}: must be a boolean, got {type(body[name]).__name__}", param=name,
                               code="invalid_type")
    keep = body.get("truncate_prompt_tokens")
    if keep is not None:
        if not isinstance(keep, int) or isinstance(keep, bool):
            raise ServingError(400, f"truncate_prompt_tokens: must be an integer, got {type(keep).__name__}",
                               param="truncate_prompt_tokens", code="invalid_type")
    return body.get("normalize"), body.get("add_special_tokens") is not False, truncation(keep, limit)


def _tokenized(tokenizer, body: dict, limit: int) -> tuple[bool | None, list[tuple[str | None, list[int]]]]:
    """An embeddings body's ``normalize`` and its inputs, each (its text or None, its token ids): tokenized with
    ``add_special_tokens``, cut to ``truncate_prompt_tokens`` (-1: ``limit``). Raises ServingError(400) naming
    a malformed ``input`` or extra."""
    normalize, special, keep = _extras(body, limit)
    return normalize, [(x if isinstance(x, str) else None,
                        truncate_prompt(tokenizer.encode(x, add_special_tokens=special) if isinstance(x, str) else x,
                                        keep))
                       for x in _inputs(body.get("input"))]


def render_embeddings(tokenizer, body: dict) -> RenderedPrompt:
    """An embeddings body's inputs tokenized as ``create_embedding`` tokenizes them, for the gateway's routing:
    ``prompt_tokens`` and the longest input (a policy trial's 600 Chinese characters, 1,350 tokens, were routed on
    the ~4-characters estimate, 150); ``create_embedding`` takes the token ids from it. ``request`` is None: the
    serving call reads the rest of the body.

    Raises:
        ServingError: 400 for a malformed ``input`` or extra, naming it."""
    return RenderedPrompt(None, tuple(_tokenized(tokenizer, body, sys.maxsize)[1]))   # -1: the serving call's


def encode_embedding(vector: list[float], encoding_format: str) -> list[float] | str:
    """One embedding as OpenAI sends it: floats, or base64 of its little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
    return vector


class OpenAIServingEmbedding(OpenAIServing):
    """Embeddings (constructor: ``OpenAIServing``'s)."""

    async def create_embedding(self, body: dict, request_id: str, priority: int = 0, rendered=None,
                               response_model: str | None = None) -> dict:
        """``POST /v1/embeddings``.

        Args:
            body: the decoded JSON body. request_id: the answer's ``id`` is ``embd-<request_id>`` (vLLM's).
            priority: accepted for the gateway's uniform call; embeddings are pooled between two engine steps,
                not scheduled.
            rendered: the gateway's ``render_embeddings`` of this body, when its routing made one: its token ids
                are used (tokenized once).
            response_model: the ``model`` the answer reports; default the served name.

        Returns:
            OpenAI's ``list`` of ``embedding`` objects with ``usage`` (prompt tokens = total tokens), and vLLM's
            ``id`` and ``created`` (Unix seconds).

        Raises:
            ServingError: 400 bad input (names the parameter), 404 unknown model, 503 engine draining/dead.
        """
        if not self.engine.ready:
            raise ServingError(503, "the engine is not ready", type="server_error", code="engine_not_ready")
        model = body.get("model")
        self.check_model(model)
        fmt = body.get("encoding_format") or "float"
        if fmt not in ("float", "base64"):
            raise ServingError(400, f"encoding_format: must be 'float' or 'base64', got {fmt!r}",
                               param="encoding_format", code="invalid_value")
        if (problem := dimensions_problem(body.get("dimensions"), self.served_model_name)) is not None:
            raise ServingError(400, problem, param="dimensions", code="invalid_value")
        tok = self.engine.tokenizer
        limit, vocab = self.engine.max_model_len, tok.vocab_size
        if rendered is None:
            normalize, inputs = _tokenized(tok, body, limit)
            prompts = [ids for _, ids in inputs]
        else:   # a positive truncate_prompt_tokens is applied already; -1 (the context) is this call's
            normalize, _, keep = _extras(body, limit)
            prompts = [truncate_prompt(ids, keep) for _, ids in rendered.prompts]
        for i, ids in enumerate(prompts):
            bad = next((t for t in ids if t >= vocab), None)   # _inputs took only ids >= 0
            if bad is not None:   # past int64 the core's msgpack cannot even carry it
                where = "input" if len(prompts) == 1 else f"input[{i}]"
                raise ServingError(400, f"{where}: {bad} is not a token id of this model (ids are in [0, {vocab}))",
                                   param=where, code="invalid_value")
            if len(ids) > limit:   # the core refuses it too, with no parameter named
                where = "input" if len(prompts) == 1 else f"input[{i}]"
                raise ServingError(400, f"This model's maximum context length is {limit} tokens. However, your "
                                        f"{where} resulted in {len(ids)} tokens. Please reduce the length of the "
                                        f"input.", param=where, code="context_length_exceeded")
        try:
            vectors = await self.engine.embed(prompts, normalize=normalize)
        except Exception as exc:  # noqa: BLE001 -- mapped onto the client's error
            raise error_from_engine(exc) from None
        n = sum(len(p) for p in prompts)
        return {"id": f"embd-{request_id}", "object": "list", "created": int(time.time()),
                "model": response_model or self.reported_model(model),
                "data": [{"object": "embedding", "index": i, "embedding": encode_embedding(v, fmt)}
                         for i, v in enumerate(vectors)],
                "usage": {"prompt_tokens": n, "total_tokens": n}}
