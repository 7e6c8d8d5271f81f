"""The checks of a ``POST /v1/responses`` body that OpenAI makes and the chat translation would not (or would name
in chat's paths), before translation (``check_body``): every top-level parameter known (``PARAMS``), of its type
and in its range, and the nested objects: ``text`` (``format``, ``verbosity``), function ``tools``,
``tool_choice`` and ``parallel_tool_calls``. Each refusal is OpenAI's 400 naming the parameter by the dotted path
the client wrote (``text.format.json_schema``, ``tool_choice.name``).

An unknown key of ``text`` or ``text.format`` is refused, never dropped: a schema sent in another API's shape
(chat's ``json_schema`` object, a ``schema`` beside ``json_object``) would go unenforced. The chat side has the
same rule for ``response_format`` (``engine/serving/chat_structured.py``); Responses' json_schema keys are flat
in ``text.format``.
"""

from __future__ import annotations

from engine.protocol.tool_choice import PARALLEL_WITHOUT_TOOLS, parallel_without_tools
from gateway.errors import ClientError
from gateway.request.param_objects import CHAT_VALUES, check_stream_options, one_of
from gateway.request.validate import check_range, check_type
from gateway.translate.responses_errors import responses_error

# Fields the gateway cannot serve on any backend: refused with a 400 naming them.
REFUSED_FIELDS = ("background", "conversation", "prompt")
_NUM = (int, float)
# Every top-level parameter of OpenAI's Responses API (``responses.create``) and its JSON types; any other is
# refused as OpenAI refuses it (400 ``unknown_parameter``). ``priority`` and ``seed`` are the gateway's own, as on
# chat. Value ranges are chat's (``engine/protocol/param_ranges.py``), read under the chat name (``CHAT_NAMES``).
PARAMS = {
    "model": (str,), "input": (str, list), "instructions": (str,), "max_output_tokens": (int,),
    "max_tool_calls": (int,), "metadata": (dict,), "parallel_tool_calls": (bool,), "previous_response_id": (str,),
    "reasoning": (dict,), "store": (bool,), "stream": (bool,), "stream_options": (dict,), "temperature": _NUM,
    "text": (dict,), "tool_choice": (str, dict), "tools": (list,), "top_p": _NUM, "top_logprobs": (int,),
    "truncation": (str,), "user": (str,), "include": (list,), "background": (bool,), "conversation": (str, dict),
    "prompt": (dict,), "prompt_cache_key": (str,), "prompt_cache_retention": (str,), "prompt_cache_options": (dict,),
    "safety_identifier": (str,), "service_tier": (str,), "background_options": (dict,),
    "context_management": (list,), "image": (dict,), "moderation": (dict,), "access_programs": (dict,),
    "priority": (str, int), "seed": (int,),
}
# Parameters whose chat name differs: their ranges are chat's under that name, and ``to_chat`` copies them under it.
CHAT_NAMES = {"max_output_tokens": "max_tokens"}
# The values OpenAI's SDK types (``openai.types.responses``) give a string parameter; any other is a 400
# ``invalid_value`` naming it.
VALUES = {
    "truncation": ("auto", "disabled"),
    "service_tier": (*CHAT_VALUES["service_tier"], "ultrafast"),   # chat's, and the Responses types' own
    "prompt_cache_retention": CHAT_VALUES["prompt_cache_retention"],   # the same values as chat's
}
# ``include``'s values (the SDK's ``ResponseIncludable``). ``message.output_text.logprobs`` asks for logprobs; the
# others are taken as no-ops: they ask for parts of items this gateway never makes (built-in tools' calls and
# results, encrypted reasoning) or always gives (an input image's URL).
INCLUDABLE = ("file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
              "message.input_image.image_url", "computer_call_output.output.image_url",
              "code_interpreter_call.outputs", "reasoning.encrypted_content", "message.output_text.logprobs")
_SUMMARY = ("auto", "concise", "detailed")
# ``reasoning``'s keys (the SDK's ``Reasoning``) and the values of each (None: any string).
REASONING = {"effort": CHAT_VALUES["reasoning_effort"], "summary": _SUMMARY,
             "generate_summary": _SUMMARY, "context": ("auto", "current_turn", "all_turns"), "mode": None}
# ``stream_options``' fields on the Responses API (the SDK's ``StreamOptions``).
STREAM_OPTIONS = ("include_obfuscation",)
# The least value of an integer parameter where the Responses API's is not chat's (OpenAI's: ``max_tool_calls`` 0
# is a 400, and so is ``max_output_tokens`` below 16, where chat's ``max_tokens`` takes 1).
MINIMUMS = {"max_tool_calls": 1, "max_output_tokens": 16}

# The keys of ``text`` and of each ``text.format`` type, with their JSON types (OpenAI's Responses API).
TEXT_KEYS = {"format": (dict,), "verbosity": (str,)}
FORMAT_KEYS = {
    "text": {"type": (str,)},
    "json_object": {"type": (str,)},
    "json_schema": {"type": (str,), "name": (str,), "schema": (dict,), "strict": (bool,), "description": (str,)},
}
FORMAT_REQUIRED = {"json_schema": ("name", "schema")}
VERBOSITY = CHAT_VALUES["verbosity"]
TOOL_CHOICE_MODES = ("none", "auto", "required")
# The keys of a function ``tool_choice`` (``{"type": "function", "name": ...}``: no ``function`` level as on chat).
_FUNCTION_CHOICE_KEYS = {"type": (str,), "name": (str,)}
# A function tool's fields the translation carries onto chat, with their JSON types.
_TOOL_TYPES = {"type": (str,), "name": (str,), "description": (str,), "parameters": (dict,), "strict": (bool,)}


def bad_request(message: str, param: str, code: str = "invalid_value") -> ClientError:
    """OpenAI's 400 (``invalid_request_error``) with ``message``; ``param``: the parameter's dotted path."""
    return ClientError(400, message, param=param, code=code)


def check_body(body: dict) -> None:
    """The Responses checks, before translation: ``model``, every parameter known (``PARAMS``), of its type and in
    its range, ``input``, refused fields, and the nested objects (``tools``, function tools only,
    ``tool_choice``, ``parallel_tool_calls``, ``text``). The input items are checked as they are listed and
    translated (``gateway/translate/responses_items.py``); chat's own checks run later, on the chat body, in
    ``validate.py``.

    Raises:
        ClientError: 400 naming the parameter (a built-in tool by its type)."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("missing required parameter 'model'" if model is None
                          else "'model' must be a non-empty string",
                          "model", "missing_required_parameter" if model is None else "invalid_type")
    _check_params(body)
    _check_values(body)
    for name in REFUSED_FIELDS:
        if body.get(name) not in (None, False):
            raise bad_request(f"'{name}' is not supported by this gateway", name, "unsupported_parameter")
    inp = body.get("input")
    if inp is None:
        raise bad_request("missing required parameter 'input'", "input", "missing_required_parameter")
    if not isinstance(inp, (str, list)):
        raise bad_request(f"'input' must be a string or an array of input items, got {type(inp).__name__}",
                          "input", "invalid_type")
    tools = body.get("tools") or []
    check_tools(tools)
    check_tool_choice(body.get("tool_choice"), tools)
    check_parallel_tool_calls(body)
    if body.get("text") is not None:
        check_text(body["text"])


def _check_params(body: dict) -> None:
    """Each parameter of ``body`` is a Responses parameter, of its type, at least its ``MINIMUMS`` and in the range
    chat's table gives its chat name; a 400 names the parameter as the client wrote it."""
    for name, value in body.items():
        types = PARAMS.get(name)
        if types is None:
            raise bad_request(f"Unknown parameter: '{name}'.", name, "unknown_parameter")
        check_type(name, value, types)
        least = MINIMUMS.get(name)
        if least is not None and value is not None and value < least:
            raise bad_request(f"Invalid '{name}': integer below minimum value. Expected a value >= {least}, but "
                              f"got {value} instead.", name, "integer_below_min_value")
        try:
            check_range(CHAT_NAMES.get(name, name), value)
        except ClientError as e:
            raise responses_error(e) from None


def _check_values(body: dict) -> None:
    """The values of the parameters chat has no check for: ``VALUES``, ``include``, ``reasoning`` and
    ``stream_options`` (only with ``stream: true``, as chat's)."""
    for name, allowed in VALUES.items():
        if body.get(name) is not None:
            one_of(body[name], allowed, name)
    if body.get("include") is not None:
        check_include(body["include"])
    if body.get("reasoning") is not None:
        check_keys(body["reasoning"], dict.fromkeys(REASONING, (str,)), "reasoning")
        for key, allowed in REASONING.items():
            if allowed is not None and body["reasoning"].get(key) is not None:
                one_of(body["reasoning"][key], allowed, f"reasoning.{key}")
    if body.get("stream_options") is not None:
        check_stream_options(body, STREAM_OPTIONS)


def check_include(values: list) -> None:
    """``include`` (of ``POST /v1/responses`` or ``GET /v1/responses/{id}/input_items``): each value one of
    ``INCLUDABLE``.

    Raises:
        ClientError: 400 naming ``include[i]``."""
    for i, value in enumerate(values):
        check_type(f"include[{i}]", value, (str,))
        one_of(value, INCLUDABLE, f"include[{i}]")


def _missing(param: str) -> ClientError:
    return bad_request(f"missing required parameter '{param}'", param, "missing_required_parameter")


def check_keys(obj: dict, keys: dict[str, tuple], where: str) -> None:
    """Each key of ``obj`` (found at ``where``) is one of ``keys`` and of its JSON type (null: not given).

    Raises:
        ClientError: 400 ``unknown_parameter`` or ``invalid_type`` naming ``<where>.<key>``."""
    for key, value in obj.items():
        types = keys.get(key)
        if types is None:
            raise bad_request(f"Unknown parameter: '{where}.{key}'.", f"{where}.{key}", "unknown_parameter")
        check_type(f"{where}.{key}", value, types)


def check_text(text: dict) -> None:
    """``text``: known keys only (``format``, ``verbosity`` low/medium/high); ``format.type`` one of text,
    json_object, json_schema, each with its own keys; a json_schema format's ``name`` and ``schema`` given.

    Raises:
        ClientError: 400 naming the key (``text.fromat``, ``text.format.json_schema``...)."""
    check_keys(text, TEXT_KEYS, "text")
    if text.get("verbosity") is not None:
        one_of(text["verbosity"], VERBOSITY, "text.verbosity")
    fmt = text.get("format")
    if fmt is None:
        return
    kind = fmt.get("type")
    if kind is None:
        raise _missing("text.format.type")
    one_of(kind, tuple(FORMAT_KEYS), "text.format.type")
    check_keys(fmt, FORMAT_KEYS[kind], "text.format")
    for name in FORMAT_REQUIRED.get(kind, ()):
        if fmt.get(name) is None:
            raise _missing(f"text.format.{name}")


def check_tools(tools: list) -> None:
    """Function tools only (a built-in OpenAI tool is refused by its type), each with a ``name`` and its other
    fields of their JSON types (``description`` a string, ``parameters`` an object, ``strict`` a boolean); any
    other key is refused (``unknown_parameter``), as OpenAI refuses it.

    Raises:
        ClientError: 400 naming ``tools[i].<field>``."""
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise bad_request(f"Tool type '{kind}' is not supported: only function tools are served (built-in "
                              f"OpenAI tools such as web_search, file_search and computer_use are not)",
                              f"tools[{i}].type", "unsupported_tool")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise _missing(f"tools[{i}].name")
        check_keys(tool, _TOOL_TYPES, f"tools[{i}]")   # another key is OpenAI's 400, not dropped


def check_tool_choice(choice: str | dict | None, tools: list) -> None:
    """``tool_choice``: none, auto, required, or ``{"type": "function", "name": ...}`` naming one of ``tools``
    (without tools, chat's rule refuses any choice but none, naming ``tool_choice``).

    Raises:
        ClientError: 400 naming ``tool_choice`` or its key (``tool_choice.name``, ``tool_choice.type``)."""
    if isinstance(choice, str):
        one_of(choice, TOOL_CHOICE_MODES, "tool_choice")
    if not isinstance(choice, dict):
        return
    if choice.get("type") != "function":
        raise bad_request(f"tool_choice type '{choice.get('type')}' is not supported: only function tools are "
                          "served", "tool_choice.type", "unsupported_tool")
    check_keys(choice, _FUNCTION_CHOICE_KEYS, "tool_choice")
    name = choice.get("name")
    if name is None:
        raise _missing("tool_choice.name")
    if tools and name not in {t["name"] for t in tools}:
        raise bad_request(f"Invalid value for 'tool_choice.name': {name!r} is not one of the function tools.",
                          "tool_choice.name")


def check_parallel_tool_calls(body: dict) -> None:
    """``parallel_tool_calls`` only with ``tools`` (OpenAI's rule).

    Raises:
        ClientError: 400 naming ``parallel_tool_calls``."""
    if parallel_without_tools(body.get("parallel_tool_calls"), body.get("tools")):
        raise bad_request(PARALLEL_WITHOUT_TOOLS, "parallel_tool_calls")
