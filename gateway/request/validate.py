"""Parse and check a request body before any routing: invalid JSON, missing
or wrongly typed parameters become 400 errors naming the parameter."""

from __future__ import annotations

import re
from dataclasses import replace

import msgspec

from engine.protocol.guided import guided_field_hint
from engine.protocol.chat_shapes import (ShapeError, check_response_format, check_tool_choice, check_tools,
                                         text_part_problem)
from engine.protocol.param_ranges import check_param, first_violation
from engine.protocol.tool_choice import PARALLEL_WITHOUT_TOOLS, parallel_without_tools
from gateway.errors import ClientError
from gateway.request.param_objects import check_objects, invalid_type
from gateway.request.estimate import CHARS_PER_TOKEN, estimate_text_tokens, text_weight
from gateway.request.embeddings import EMBEDDINGS_PARAMS, EMBEDDINGS_TYPES, check_embeddings, estimate_input_lengths
from gateway.values import GatewayRequest
from policies import parse_priority

_decode = msgspec.json.decode
_NUM = (int, float)

# Optional parameters and the JSON types they may have (None is always allowed).
_COMMON = {
    "stream": (bool,), "max_tokens": (int,), "temperature": _NUM, "top_p": _NUM, "n": (int,),
    "stop": (str, list), "presence_penalty": _NUM, "frequency_penalty": _NUM, "seed": (int,),
    "user": (str,), "metadata": (dict,), "stream_options": (dict,), "priority": (str, int),
    "top_k": (int,), "min_p": _NUM, "repetition_penalty": _NUM, "min_tokens": (int,),
    "ignore_eos": (bool,), "stop_token_ids": (list,), "logit_bias": (dict,), "cache_salt": (str,),
    "allowed_token_ids": (list,), "bad_words": (list,), "truncate_prompt_tokens": (int,),
    "return_tokens_as_token_ids": (bool,), "length_penalty": _NUM, "vllm_xargs": (dict,),
}
_CHAT = {**_COMMON, "max_completion_tokens": (int,), "logprobs": (bool,), "top_logprobs": (int,), "tools": (list,),
         "tool_choice": (str, dict), "response_format": (dict,), "parallel_tool_calls": (bool,),
         "mm_processor_kwargs": (dict,)}
# Value ranges are checked before routing, from the table the engine's own server reads
# (``engine/protocol/param_ranges.py``), so every backend's request gets OpenAI's error codes and no value
# out of range reaches an engine.
_COMPLETION = {**_COMMON, "logprobs": (int,), "echo": (bool,), "suffix": (str,), "best_of": (int,)}

# Every top-level parameter a chat or completion request may carry; any other is refused as OpenAI refuses it
# (400 naming it, ``unknown_parameter``), unless the route passes extra parameters on (``extra_params: pass``).
# OpenAI's own (its API reference: forwarded to upstreams as they are), the gateway's own (``priority``), and the
# vendor extensions that vLLM's OpenAI server takes and the engine's protocol reads
# (``engine/serving/protocol.py``: sampling extras, structured outputs, chat-template switches, token ids).
_OPENAI_CHAT = ("model", "messages", "audio", "frequency_penalty", "function_call", "functions", "logit_bias",
                "logprobs", "max_completion_tokens", "max_tokens", "metadata", "modalities", "n",
                "parallel_tool_calls", "prediction", "presence_penalty", "prompt_cache_key",
                "prompt_cache_retention", "reasoning_effort", "response_format", "safety_identifier", "seed",
                "service_tier", "stop", "store", "stream", "stream_options", "temperature", "tool_choice", "tools",
                "top_logprobs", "top_p", "user", "verbosity", "web_search_options")
_OPENAI_COMPLETION = ("model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs",
                      "max_tokens", "n", "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix",
                      "temperature", "top_p", "user")
VENDOR_EXTENSIONS = ("priority", "best_of", "top_k", "min_p", "repetition_penalty", "use_beam_search",
                     "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "min_tokens",
                     "skip_special_tokens", "spaces_between_special_tokens", "prompt_logprobs", "request_id",
                     "structured_outputs", "response_format", "add_special_tokens", "return_token_ids",
                     "cache_salt", "allowed_token_ids", "bad_words", "truncate_prompt_tokens",
                     "return_tokens_as_token_ids", "length_penalty", "vllm_xargs")
_VENDOR_CHAT = ("echo", "add_generation_prompt", "continue_final_message", "chat_template_kwargs",
                "resume_token_ids", "mm_processor_kwargs")
KNOWN_PARAMS = {"chat/completions": frozenset(_OPENAI_CHAT + VENDOR_EXTENSIONS + _VENDOR_CHAT),
                "completions": frozenset(_OPENAI_COMPLETION + VENDOR_EXTENSIONS), "embeddings": EMBEDDINGS_PARAMS}

# Fields the local engine cannot serve: a request carrying one must be routed
# upstream by a rule, or it gets a 400 naming the field. The structured
# features a local backend is configured to serve (``structured_outputs``:
# response_format, tools) are taken out of this list per request.
LOCAL_UNSUPPORTED = ("tools", "tool_choice", "functions", "function_call", "response_format",
                     "parallel_tool_calls", "audio", "modalities", "prediction",
                     "web_search_options")
_TOOL_FIELDS = ("tools", "functions", "tool_choice", "function_call")
_SERVED_BY = {"tools": "tools", "tool_choice": "tools", "parallel_tool_calls": "tools",
              "response_format": "response_format"}


_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
# OpenAI's default ``max_tokens`` of the legacy completions endpoint (chat: up to the context).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


def check_type(name: str, value: object, types: tuple) -> None:
    """A 400 (``invalid_type``) naming ``name`` unless ``value`` is null or one of the JSON ``types`` (a boolean
    is not a number)."""
    if value is None:
        return
    ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in types)
    if not ok:
        raise invalid_type(name, types, value)


def check_range(name: str, value: object) -> None:
    """OpenAI's out-of-range error (code ``integer_below_min_value``, ``decimal_above_max_value``...) naming the
    field, from the shared table ``engine.protocol.param_ranges``."""
    bad = check_param(name, value)
    if bad is not None:
        raise ClientError(400, bad.message, param=bad.param, code=bad.code)


# Deepest nesting of arrays and objects a body may have: far beyond any OpenAI request (a tool's JSON schema
# nests a few levels), far below what recursive code after decoding (templates, encoders) can take.
MAX_JSON_DEPTH = 64


def _deeper_than(obj: object, limit: int) -> bool:
    """Whether ``obj`` nests arrays/objects more than ``limit`` levels (iterative: no recursion to exhaust)."""
    if not isinstance(obj, (dict, list)):
        return False
    stack = [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


# A \\uD800-\\uDBFF escape not followed by a \\uDC00-\\uDFFF one, or the latter not after the former: JSON text whose
# string would not be Unicode (RFC 8259 8.2), which msgspec reports as "Input data was truncated"
_LONE_SURROGATE = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F][0-9a-fA-F]{2})"
                             rb"|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F][0-9a-fA-F]{2}")


def _json_error(raw: bytes, e: msgspec.DecodeError) -> str:
    """The 400's message for a body msgspec refused: its own, but for a lone surrogate escape in a body that is not
    truncated, named as such."""
    if "truncated" in str(e) and raw.rstrip()[-1:] in (b"}", b"]") and (m := _LONE_SURROGATE.search(raw)):
        return (f"request body is not valid JSON: a lone UTF-16 surrogate escape {m.group().decode()} at byte "
                f"{m.start()} (a \\ud800-\\udbff escape must be followed by a \\udc00-\\udfff one)")
    return f"request body is not valid JSON: {e}"


def parse_json(raw: bytes) -> dict:
    """Decode a JSON object nested at most ``MAX_JSON_DEPTH`` levels. Raises ClientError(400) otherwise."""
    if not raw:
        raise ClientError(400, "request body is empty; expected a JSON object", code="invalid_json")
    try:
        body = _decode(raw)
    except msgspec.DecodeError as e:
        raise ClientError(400, _json_error(raw, e), code="invalid_json") from None
    except RecursionError:       # msgspec's own nesting limit, above ours
        raise _too_deep() from None
    # the bracket count bounds the depth from above: ordinary bodies skip the walk
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH and _deeper_than(body, MAX_JSON_DEPTH):
        raise _too_deep()
    if not isinstance(body, dict):
        raise ClientError(400, "request body must be a JSON object", code="invalid_json")
    return body


def _too_deep() -> ClientError:
    return ClientError(400, f"request body nests arrays and objects more than {MAX_JSON_DEPTH} levels deep",
                       code="invalid_json")


# OpenAI's newer tool kinds (custom tools, a tool_choice of allowed tools): an upstream that takes them decides
_NEWER_TOOL_KINDS = ("custom", "allowed_tools")


def _check_shapes(body: dict) -> None:
    """A chat body's ``tools``, ``tool_choice`` and ``response_format`` in OpenAI's shapes
    (``engine.protocol.chat_shapes``, the engine's own check), before routing: a malformed one never costs an
    upstream call, whichever backend would get it. ``tools: []`` is no tools (vLLM's reading)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    newer = isinstance(choice, dict) and choice.get("type") in _NEWER_TOOL_KINDS
    if isinstance(tools, list):
        functions = [t for t in tools if not (isinstance(t, dict) and t.get("type") in _NEWER_TOOL_KINDS)]
        newer, tools = newer or len(functions) < len(tools), functions or None
    try:
        checked = check_tools(tools)
        if not newer:
            check_tool_choice(choice, checked)
        check_response_format(body.get("response_format"))
    except ShapeError as e:
        raise ClientError(400, str(e), param=e.path, code=e.code) from None


def _unsupported(body: dict, local_serves: frozenset[str]) -> str | None:
    for name in LOCAL_UNSUPPORTED:
        v = body.get(name)
        if v is None or v is False or v == [] or v == {} or _SERVED_BY.get(name) in local_serves:
            continue
        if (name == "response_format" and isinstance(v, dict) and v.get("type") == "text") \
                or (name == "modalities" and v == ["text"]):   # the defaults: plain text, what every backend gives
            continue
        return name
    return None


def _check_messages(messages: object) -> None:
    """``messages`` as OpenAI checks it: a non-empty array of objects with a known string ``role``; ``content`` a
    string or an array of parts, required (not null) except on an assistant message with ``tool_calls`` /
    ``function_call`` (or a ``refusal``)."""
    if messages is None:
        raise ClientError(400, "missing required parameter 'messages'", param="messages",
                          code="missing_required_parameter")
    if not isinstance(messages, list):
        raise ClientError(400, f"'messages' must be an array, got {type(messages).__name__}", param="messages",
                          code="invalid_type")
    if not messages:
        raise ClientError(400, "Invalid 'messages': empty array. Expected an array with minimum length 1, but got "
                          "an empty array instead.", param="messages", code="empty_array")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ClientError(400, f"'messages[{i}]' must be an object with a string 'role'",
                              param=f"messages[{i}].role", code="invalid_type")
        if m["role"] not in _ROLES:
            raise ClientError(400, f"'messages[{i}].role' must be one of {', '.join(sorted(_ROLES))}, "
                              f"got {m['role']!r}", param=f"messages[{i}].role", code="invalid_value")
        content = m.get("content")
        if content is None:
            if m["role"] == "assistant" and (m.get("tool_calls") or m.get("function_call") or m.get("refusal")):
                continue
            got = "null" if "content" in m else "nothing"
            raise ClientError(400, f"Invalid value for 'messages[{i}].content': expected a string or an array of "
                              f"content parts, got {got}", param=f"messages[{i}].content", code="invalid_type")
        if not isinstance(content, (str, list)):
            raise ClientError(400, f"'messages[{i}].content' must be a string or an array of content parts, got "
                              f"{type(content).__name__}", param=f"messages[{i}].content", code="invalid_type")
        if isinstance(content, list):
            if not content and m["role"] in ("user", "system", "developer"):    # OpenAI's 400 (a trial's got a 200)
                raise ClientError(400, f"Invalid 'messages[{i}].content': empty array. Expected an array with "
                                  "minimum length 1, but got an empty array instead.", param=f"messages[{i}].content",
                                  code="empty_array")
            _check_text_parts(content, f"messages[{i}].content")
    _check_tool_messages(messages)


def _check_text_parts(parts: list, where: str) -> None:
    """A ``text`` (or ``refusal``) content part carries its string, as OpenAI requires (``text_part_problem``)."""
    for j, part in enumerate(parts):
        if (problem := text_part_problem(part, f"{where}[{j}]")) is not None:
            path, message, code = problem
            raise ClientError(400, message, param=path, code=code)


def _check_tool_messages(messages: list[dict]) -> None:
    """OpenAI's pairing of calls and results: a ``tool`` message answers a call (its ``tool_call_id``) of the
    assistant message the run of tool messages it is in follows, and every call of an assistant message is
    answered before the next other message (a model shown a result without its call, or a call without its
    result, answers as if the conversation were another)."""
    calls: set = set()       # the ids of the calls being answered
    pending: dict = {}       # those not answered yet -> the index of the assistant message that made them
    for i, m in enumerate(messages):
        if m["role"] == "tool":
            if m.get("tool_call_id") is None:
                raise ClientError(400, f"missing required parameter 'messages[{i}].tool_call_id'",
                                  param=f"messages[{i}].tool_call_id", code="missing_required_parameter")
            if m.get("tool_call_id") not in calls:
                raise ClientError(400, f"Invalid parameter: messages with role 'tool' must be a response to a "
                                  f"preceding message with 'tool_calls' (messages[{i}].tool_call_id "
                                  f"{m.get('tool_call_id')!r} answers none).", param=f"messages[{i}].role",
                                  code="invalid_value")
            pending.pop(m["tool_call_id"], None)
            continue
        _no_call_unanswered(pending)
        made = m.get("tool_calls") if m["role"] == "assistant" and isinstance(m.get("tool_calls"), list) else []
        ids = [c.get("id") if isinstance(c, dict) else None for c in made]
        pending = dict.fromkeys((x for x in ids if x is not None), i)   # in the calls' order
        if len(pending) < sum(x is not None for x in ids):   # two calls under one id: which would a result answer?
            j = next(j for j, x in enumerate(ids) if x is not None and x in ids[:j])
            raise ClientError(400, f"Invalid parameter: messages[{i}].tool_calls[{j}].id {ids[j]!r} is the id of an "
                              f"earlier call of the message; each call needs its own id.",
                              param=f"messages[{i}].tool_calls[{j}].id", code="invalid_value")
        calls = set(pending)
    _no_call_unanswered(pending)


def _no_call_unanswered(pending: dict) -> None:
    if pending:
        at = min(pending.values())
        raise ClientError(400, "An assistant message with 'tool_calls' must be followed by tool messages responding "
                          "to each 'tool_call_id'. The following tool_call_ids did not have response messages: "
                          f"{', '.join(map(str, pending))}", param=f"messages[{at}].role", code="invalid_value")


def check_request(body: dict, endpoint: str, x_priority: str | None,
                  local_serves: frozenset[str] = frozenset(), **identity) -> GatewayRequest:
    """Check a chat (``endpoint == "chat/completions"``) or completion body; the request value with
    ``identity`` (``public_model``, ``tenant``, ``request_id``, ``prompt_tokens``, ``headers``).

    A top-level JSON null means "not given" (OpenAI's reading): such fields are dropped from the request's
    ``body``, so every backend applies its own default (completions: ``max_tokens`` 16; chat: up to the context).
    ``local_serves``: the structured features (``response_format``,
    ``tools``) the local engine serves; the others make ``local_unsupported``.

    Raises:
        ClientError: 400 naming the missing or wrongly typed parameter."""
    if any(v is None for v in body.values()):
        body = {k: v for k, v in body.items() if v is not None}
    model = body.get("model")
    if model is None:
        raise ClientError(400, "missing required parameter 'model'", param="model", code="missing_required_parameter")
    if not isinstance(model, str) or not model:
        raise ClientError(400, "'model' must be a non-empty string", param="model", code="invalid_type")
    if endpoint == "chat/completions":
        _check_messages(body.get("messages"))
        types = _CHAT
    elif endpoint == "embeddings":
        check_embeddings(body)
        types = EMBEDDINGS_TYPES
    else:
        prompt = body.get("prompt")
        if prompt is None:
            raise ClientError(400, "missing required parameter 'prompt'", param="prompt",
                              code="missing_required_parameter")
        if not isinstance(prompt, (str, list)) or (isinstance(prompt, list) and not prompt):
            raise ClientError(400, "'prompt' must be a string or a non-empty array", param="prompt",
                              code="invalid_type")
        types = _COMPLETION
    known = KNOWN_PARAMS.get(endpoint, body)   # an endpoint without a list: every parameter counts as known
    for name, value in body.items():
        t = types.get(name)
        if t is not None:
            check_type(name, value, t)
    # a parameter this endpoint does not know is unknown_parameter (or passed), not ranged
    bad = first_violation(body, completions=endpoint == "completions", known=known)
    if bad is not None:
        raise ClientError(400, bad.message, param=bad.param, code=bad.code)
    if endpoint == "chat/completions":
        _check_shapes(body)
    if endpoint == "chat/completions" and parallel_without_tools(body.get("parallel_tool_calls"), body.get("tools")):
        raise ClientError(400, PARALLEL_WITHOUT_TOOLS, param="parallel_tool_calls", code="invalid_value")
    check_objects(body)
    raw_priority = body.get("priority")
    if raw_priority is None:
        raw_priority = x_priority
    try:
        priority = 0 if raw_priority is None else parse_priority(raw_priority)
    except ValueError as e:
        raise ClientError(400, str(e), param="priority", code="invalid_value") from None
    check_range("priority", priority)     # also when it came as a string or in x-priority
    max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    if max_tokens is None and endpoint == "completions":
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
    if endpoint == "embeddings":
        max_tokens = 0          # nothing is generated: reservations and budgets count the input alone
    unsupported = _unsupported(body, local_serves)
    if endpoint == "embeddings" and body.get("dimensions") is not None:
        unsupported = "dimensions"   # the local engine pools the model's full hidden size
    rf = body.get("response_format")
    return GatewayRequest(
        endpoint=endpoint, body=body, model=model, stream=bool(body.get("stream")), priority=priority,
        user=body.get("user") or "", metadata=body.get("metadata") or {}, max_tokens=max_tokens,
        has_tools=any(body.get(k) for k in _TOOL_FIELDS),
        has_response_format=rf is not None and not (isinstance(rf, dict) and rf.get("type") == "text"),
        local_unsupported=unsupported,
        unknown_params=tuple(k for k in body if k not in known), **identity)


def with_default_max_tokens(req: GatewayRequest, route, model) -> GatewayRequest:
    """A chat request that sets no ``max_tokens`` (nor ``max_completion_tokens``) with its route's
    ``default_max_tokens``, else its model's (``RouteConfig`` / ``ModelConfig`` or None); unchanged when neither
    sets one (it may then generate up to the context, as OpenAI's)."""
    if req.max_tokens is not None or req.endpoint != "chat/completions":
        return req
    n = (route.default_max_tokens if route is not None else None) or (
        model.default_max_tokens if model is not None else None)
    return req if n is None else replace(req, max_tokens=n, body={**req.body, "max_tokens": n})


def unknown_parameter_error(req: GatewayRequest, route) -> ClientError | None:
    """OpenAI's 400 for the first parameter of ``req`` it does not know (``unknown_parameter``, naming it), unless
    the route (``RouteConfig`` or None) says ``extra_params: pass``: its upstreams then receive them as they are."""
    if not req.unknown_params or (route is not None and route.extra_params == "pass"):
        return None
    name = req.unknown_params[0]
    hint = guided_field_hint(name)   # vLLM's older constraint fields: say what constrains the output here
    message = f"Unrecognized request argument supplied: {name}" + (f"; {hint}" if hint else "")
    return ClientError(400, message, param=name, code="unknown_parameter")


# An image's estimated prompt tokens: Anthropic's count for an image at its largest unresized size (~1.15
# megapixels); OpenAI's high-detail 1024x1024 is 765. An estimate sizes reservations, so it errs high.
IMAGE_TOKENS_ESTIMATE = 1600


def _content_chars(content: object) -> tuple[int, int]:
    """(``text_weight`` of its text, images) of a chat message's ``content``."""
    if isinstance(content, str):
        return text_weight(content), 0
    chars = images = 0
    for p in content if isinstance(content, list) else ():
        if isinstance(p, dict):
            chars += text_weight(p["text"]) if isinstance(p.get("text"), str) else 0
            images += p.get("type") in ("image_url", "input_image", "image")
    return chars, images


def counted_exactly(body: dict) -> bool:
    """Whether :func:`estimate_prompt_tokens` of ``body`` is exact rather than a guess: every prompt (or
    embeddings input) given as token ids."""
    value = body["input"] if "input" in body and "messages" not in body and "prompt" not in body \
        else body.get("prompt")
    if value is None or isinstance(value, str):
        return False
    items = value if value and not all(isinstance(x, int) for x in value) else [value]
    return all(isinstance(item, list) for item in items)


def estimate_prompt_tokens(body: dict) -> int:
    """Rough prompt length when no tokenizer is at hand, all prompts together (``estimate_prompt_lengths``). It is
    what ``count_tokens`` answers and what rate limits reserve when the local engine does not render the
    prompt."""
    return sum(estimate_prompt_lengths(body))


def prompt_counts(body: dict, rendered=None, context: int | None = None) -> tuple[int, int]:
    """(every prompt's tokens together, the longest prompt's) of ``body``: the local engine's ``rendered`` counts
    (``RenderedPrompt``) when given, else the estimates (``estimate_prompt_lengths``); each cut as vLLM's
    ``truncate_prompt_tokens`` cuts it: to N, or with -1 to ``context`` (the local engine's ``max_model_len``;
    None: unknown, not cut: a RAG trial's -1 inputs were routed on their whole length, to a route that refused
    them)."""
    if rendered is not None:
        lengths = [len(ids) for _, ids in rendered.prompts]
    else:
        lengths = estimate_prompt_lengths(body)
    keep = body.get("truncate_prompt_tokens")   # vLLM's: each prompt's last N tokens run
    keep = context if keep == -1 else keep
    if type(keep) is int and keep > 0:
        lengths = [min(n, keep) for n in lengths]
    return sum(lengths), max(lengths, default=0)


def estimate_prompt_lengths(body: dict) -> list[int]:
    """Rough length of each prompt of ``body`` when no tokenizer is at hand (one for chat; one per prompt of a
    completions batch or input of an embeddings list): ``gateway/request/estimate.py``'s (~4 characters a
    token, a non-ASCII character one) of the messages' text, their tool calls and the tool definitions (as JSON,
    as chat templates render them), + 4 tokens of chat framing per message, + ``IMAGE_TOKENS_ESTIMATE`` per
    image. Token-id prompts (and embeddings inputs) are counted exactly."""
    if "input" in body and "messages" not in body and "prompt" not in body:
        return estimate_input_lengths(body["input"])
    if "messages" in body:
        chars, n, images = 0, 0, 0
        for m in body.get("messages") or ():
            n += 1
            if not isinstance(m, dict):
                continue
            c, i = _content_chars(m.get("content"))
            chars, images = chars + c, images + i
            if m.get("tool_calls"):
                chars += len(msgspec.json.encode(m["tool_calls"]))
        if body.get("tools"):
            chars += len(msgspec.json.encode(body["tools"]))
        return [-(-chars // CHARS_PER_TOKEN) + 4 * n + IMAGE_TOKENS_ESTIMATE * images]
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [estimate_text_tokens(prompt)]
    if isinstance(prompt, list):
        if prompt and all(isinstance(x, int) for x in prompt):
            return [len(prompt)]
        return [estimate_text_tokens(p) if isinstance(p, str) else len(p) if isinstance(p, list) else 0
                for p in prompt]
    return []
