"""The checks of a ``POST /v1/embeddings`` body (OpenAI's): ``input`` a string, an array of strings, an array of
token ids, or an array of token-id arrays, never empty; ``encoding_format`` float or base64; ``dimensions`` a
positive integer. Read by ``gateway/request/validate.py`` ``check_request``."""

from __future__ import annotations

from gateway.errors import ClientError
from gateway.request.estimate import estimate_text_tokens

# Optional parameters and the JSON types they may have (None is always allowed).
EMBEDDINGS_TYPES = {"encoding_format": (str,), "dimensions": (int,), "user": (str,), "priority": (str, int),
                    "metadata": (dict,), "normalize": (bool,), "add_special_tokens": (bool,),
                    "truncate_prompt_tokens": (int,)}
# Every top-level parameter an embeddings request may carry: OpenAI's (its API reference), the gateway's own
# (``priority``, ``metadata``) and vLLM's that the engine reads (``normalize``, ``add_special_tokens``,
# ``truncate_prompt_tokens``); any other is refused as on chat (``validate.KNOWN_PARAMS``).
EMBEDDINGS_PARAMS = frozenset(("model", "input", *EMBEDDINGS_TYPES))
ENCODING_FORMATS = ("float", "base64")
# OpenAI's bound on the number of inputs of one request.
MAX_INPUTS = 2048


def _bad(message: str, code: str = "invalid_value", param: str = "input") -> ClientError:
    return ClientError(400, message, param=param, code=code)


def check_embeddings(body: dict) -> None:
    """Raises ClientError(400) naming the parameter unless ``input``, ``encoding_format`` and ``dimensions`` are
    what OpenAI accepts."""
    value = body.get("input")
    if value is None:
        raise _bad("missing required parameter 'input'", "missing_required_parameter")
    if isinstance(value, str):
        if not value:
            raise _bad("'input' cannot be an empty string")
    elif not isinstance(value, list) or not value:
        raise _bad("'input' must be a non-empty string or a non-empty array", "invalid_type")
    elif len(value) > MAX_INPUTS and not all(_is_token(x) for x in value):   # token ids: one input, its length
        raise _bad(f"'input' has {len(value)} items; at most {MAX_INPUTS}")    # the backend's context bounds
    elif not (all(isinstance(x, str) and x for x in value) or all(_is_token(x) for x in value)
              or all(isinstance(x, list) and x and all(_is_token(t) for t in x) for x in value)):
        raise _bad_item(value)
    fmt = body.get("encoding_format")
    if fmt is not None and fmt not in ENCODING_FORMATS:
        raise _bad(f"'encoding_format' must be one of {', '.join(ENCODING_FORMATS)}, got {fmt!r}",
                   param="encoding_format")
    dims = body.get("dimensions")
    if isinstance(dims, int) and not isinstance(dims, bool) and dims < 1:
        raise _bad(f"'dimensions' must be at least 1, got {dims}", "integer_below_min_value", "dimensions")


def _bad_item(value: list) -> ClientError:
    """The 400 for an ``input`` array whose items are not all of one accepted kind, naming the first item that
    differs from the kind of ``input[0]`` (strings, token ids or token-id arrays)."""
    first = value[0]
    kind = ("a non-empty string" if isinstance(first, str) else "a token id (an integer >= 0)" if _is_token(first)
            else "a non-empty array of token ids (integers >= 0)")
    ok = {"a non-empty string": lambda x: isinstance(x, str) and bool(x),
          "a token id (an integer >= 0)": _is_token}.get(
        kind, lambda x: isinstance(x, list) and bool(x) and all(_is_token(t) for t in x))
    i = next(i for i, x in enumerate(value) if not ok(x))
    got = "an empty string" if value[i] == "" else "an empty array" if value[i] == [] else f"{value[i]!r:.40}"
    expected = f"{kind} like input[0]" if i else "a non-empty string, a token id or a non-empty token-id array"
    return ClientError(400, f"Invalid 'input[{i}]': expected {expected}, got {got}. 'input' must be a "
                       "string, an array of non-empty strings, an array of token ids, or an array of non-empty "
                       "token-id arrays", param=f"input[{i}]", code="invalid_type")


def _is_token(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def inputs_of(value: object) -> list[str | list[int]]:
    """The checked ``input`` as one item per embedding: strings or token-id lists."""
    if isinstance(value, str):
        return [value]
    if all(_is_token(x) for x in value):
        return [list(value)]
    return list(value)


def estimate_input_lengths(value: object) -> list[int]:
    """Rough length of each input of ``input`` in tokens: text by ``estimate_text_tokens``, token ids counted
    exactly."""
    return [estimate_text_tokens(x) if isinstance(x, str) else len(x) for x in inputs_of(value)]
