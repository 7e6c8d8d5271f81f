"""OpenAI's shapes of a chat request's ``tools``, ``tool_choice``, ``response_format`` and text parts: read by the
gateway's edge validation (before routing: a malformed tool list never costs an upstream call) and by the engine's
own chat server (``engine/serving/chat_structured.py``, which then compiles what they describe;
``engine/serving/chat.py`` its messages), so the request gets the same 400
wherever it enters. The JSON schemas they carry are checked where they are compiled (the engine), not here.
"""

from __future__ import annotations

import json
import re
from typing import Any

from engine.protocol.tool_choice import TOOL_CHOICE_WITHOUT_TOOLS, tool_choice_without_tools

NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")   # OpenAI's function and schema names
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}
_FUNCTION_KEYS = {"name", "description", "parameters", "strict"}   # OpenAI's function tool
# The keys OpenAI's response_format takes (each kind its own); another key is refused as OpenAI refuses it, not
# ignored (a schema put beside json_schema, as some other APIs take it, would go unenforced).
_FORMAT_KEYS = {"text": {"type"}, "json_object": {"type"}, "json_schema": {"type", "json_schema"}}
_JSON_SCHEMA_KEYS = {"name", "description", "schema", "strict"}


class ShapeError(ValueError):
    """A malformed ``tools``, ``tool_choice`` or ``response_format``: the message starts with the path at fault
    (``tools[0].function.name: ...``); ``param`` is the top-level field, ``path`` the path, ``code`` OpenAI's
    (``unknown_parameter`` for a key it does not take, as at the top level; else ``invalid_value``)."""

    def __init__(self, param: str, message: str, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param, self.code = param, code
        self.path = message.split(":", 1)[0]


def check_tools(tools: Any) -> list[dict]:
    """``tools`` (a request's, None: none) checked as OpenAI's function tools: each ``{"type": "function",
    "function": {"name", "description"?, "parameters"?, "strict"?}}`` with a unique name of 1-64 letters, digits,
    ``_`` or ``-`` and ``parameters`` a JSON schema of an object (a call's arguments are an object).

    Returns:
        The tools, each function's ``parameters`` given ``"type": "object"`` where it has no type (``{}``: no
        parameters), so that a grammar of it makes an object.

    Raises:
        ShapeError: naming the first path at fault (param ``tools``)."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ShapeError("tools", f"tools: must be an array of tools, got {type(tools).__name__}")
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ShapeError("tools", f"{where}.type: must be \"function\"")
        if unknown := sorted(set(tool) - {"type", "function"}):   # a schema put beside the function, unenforced
            raise ShapeError("tools", f"{where}.{unknown[0]}: unknown parameter", "unknown_parameter")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ShapeError("tools", f"{where}.function: must be an object")
        _check_named(fn, _FUNCTION_KEYS, f"{where}.function", "tools")
        params = _object_parameters(fn.get("parameters", _EMPTY_PARAMETERS), f"{where}.function")
        out.append({"type": "function", "function": {**fn, "parameters": params}})
    names = [t["function"]["name"] for t in out]
    if len(set(names)) != len(names):
        raise ShapeError("tools", "tools: function names must be unique")
    return out


def _object_parameters(params: Any, where: str) -> dict:
    """A function's ``parameters``: a JSON schema of an object, as OpenAI requires; one without ``type``
    gets ``"type": "object"``. Raises ShapeError: not a JSON schema object, or of another type."""
    if not isinstance(params, dict):
        raise ShapeError("tools", f"{where}.parameters: must be a JSON schema (an object), got "
                                  f"{type(params).__name__}")
    if "type" not in params:
        return {"type": "object", **params}
    if params["type"] != "object":
        raise ShapeError("tools", f"{where}.parameters: schema must be a JSON Schema of 'type: \"object\"', got "
                                  f"'type: {json.dumps(params['type'])}' (a call's arguments are a JSON object)")
    return params


def check_tool_choice(choice: Any, tools: list[dict]) -> str:
    """A request's ``tool_choice`` (None: not given) against its checked ``tools``: "none", "auto", "required"
    or the forced function's name.

    Raises:
        ShapeError: not one of OpenAI's forms, a function that is not one of the tools, or a choice other than
            "none" without tools (param ``tool_choice``)."""
    if choice is None:
        return "auto" if tools else "none"
    if tool_choice_without_tools(choice, tools):
        raise ShapeError("tool_choice", TOOL_CHOICE_WITHOUT_TOOLS)
    if choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        for obj, keys, where in ((choice, {"type", "function"}, "tool_choice"),
                                 (choice["function"], {"name"}, "tool_choice.function")):
            if unknown := sorted(set(obj) - keys):
                raise ShapeError("tool_choice", f"{where}.{unknown[0]}: unknown parameter", "unknown_parameter")
        name = choice["function"].get("name")
        if name in {t["function"]["name"] for t in tools}:
            return name
        raise ShapeError("tool_choice", f"tool_choice.function.name: {name!r} is not one of the tools")
    raise ShapeError("tool_choice", 'tool_choice: must be "none", "auto", "required" or '
                                    '{"type": "function", "function": {"name": ...}}')


def check_response_format(fmt: Any) -> tuple[str, dict | None]:
    """A request's ``response_format`` (None: none) checked as OpenAI's: ``{"type": "text"}``,
    ``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema": {"name", "description"?,
    "schema"?, "strict"?}}``.

    Returns:
        (its type, "text" when None; the ``json_schema`` object of a json_schema format, else None).

    Raises:
        ShapeError: naming the first path at fault (param ``response_format``)."""
    if fmt is None:
        return "text", None
    if not isinstance(fmt, dict):
        raise ShapeError("response_format", f"response_format: must be an object, got {type(fmt).__name__}")
    kind = fmt.get("type")
    unknown = sorted(set(fmt) - _FORMAT_KEYS.get(kind, set(fmt)))
    if unknown:
        raise ShapeError("response_format", f"response_format.{unknown[0]}: unknown parameter for type {kind!r}",
                         "unknown_parameter")
    if kind in ("text", "json_object"):
        return kind, None
    if kind != "json_schema":
        raise ShapeError("response_format", f"response_format.type: must be text, json_object or json_schema, "
                                            f"got {kind!r}")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise ShapeError("response_format", "response_format.json_schema: must be an object with name and schema")
    name = spec.get("name")
    if name is None:   # OpenAI's message for a schema without its name
        raise ShapeError("response_format", "response_format.json_schema.name: missing required parameter (1-64 "
                                            "letters, digits, '_' or '-')")
    _check_named(spec, _JSON_SCHEMA_KEYS, "response_format.json_schema", "response_format")
    return kind, spec


def _check_named(obj: dict, keys: set[str], where: str, param: str) -> None:
    """A function's or a schema's object at ``where``: its ``name`` 1-64 letters, digits, ``_`` or ``-``, no key
    outside ``keys``, ``strict`` a boolean and ``description`` a string where given. Raises ShapeError."""
    name = obj.get("name")
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise ShapeError(param, f"{where}.name: must be 1-64 letters, digits, '_' or '-', got {name!r}")
    unknown = sorted(set(obj) - keys)
    if unknown:
        raise ShapeError(param, f"{where}.{unknown[0]}: unknown parameter", "unknown_parameter")
    for key, kind, word in (("strict", bool, "a boolean"), ("description", str, "a string")):
        if obj.get(key) is not None and not isinstance(obj[key], kind):
            raise ShapeError(param, f"{where}.{key}: must be {word}, got {type(obj[key]).__name__}")


def string_field_problem(obj: dict, name: str, path: str) -> tuple[str, str] | None:
    """OpenAI's 400 for ``obj`` (the object at ``path`` less its last key) without the string ``name``: (message,
    code); None when it has one. The gateway's chat and Responses checks and the engine's chat server say it in
    these words (a text part's ``text`` of 5 was a 500 on Responses, blamed on the part's type on chat)."""
    if name not in obj:
        return f"missing required parameter '{path}'", "missing_required_parameter"
    if isinstance(obj[name], str):
        return None
    got = "null" if obj[name] is None else type(obj[name]).__name__
    return f"Invalid type for '{path}': expected a string, but got {got} instead.", "invalid_type"


def text_part_problem(part: object, path: str) -> tuple[str, str, str] | None:
    """A chat ``text`` (or ``refusal``) content part at ``path`` without its string: (the field's path, message,
    code); None for any other part or one that has it."""
    field = part.get("type") if isinstance(part, dict) else None
    if field not in ("text", "refusal"):
        return None
    problem = string_field_problem(part, field, f"{path}.{field}")
    return None if problem is None else (f"{path}.{field}", *problem)
