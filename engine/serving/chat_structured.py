"""Structured outputs and tool calls of ``/v1/chat/completions``, independent of HTTP.

``plan_chat(req, tokenizer)`` reads ``response_format``, ``tools``,
``tool_choice``, ``parallel_tool_calls`` and vLLM's ``structured_outputs``
extra, checks their shapes and types (``RequestValidationError`` naming the
field at fault) and returns a ``ChatPlan``: the grammar for the engine, the
messages and template arguments to render, and whether the output holds tool
calls. The schemas themselves are checked against the supported subset with
the compile, in the engine's grammar pool (``engine/worker/grammar_compiler.py``),
never here: this runs on the server's event loop, and a large schema's check
would stall every stream.

Tool calls use one wire format, Hermes-style (Qwen2.5, Hermes 2/3)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

- ``tool_choice: "required"``: the grammar admits only such calls (one or
  more, separated by newlines; one when ``parallel_tool_calls`` is false);
- ``{"type": "function", "function": {"name": X}}``: exactly one call of X;
- ``"auto"``: free text, and once the model writes ``<tool_call>`` the grammar
  forces a well-formed call of a known tool with arguments valid under its
  ``parameters`` schema (xgrammar's triggered structural tags);
- ``"none"``: nothing is constrained and no call is parsed.

Templates that know tools (their source mentions ``tools``) get
``tools=[...]`` (under ``"none"`` too, as vLLM's default: the model knows the
tools of earlier calls but is not asked for one) and the messages as they are
(tool-call arguments as objects, as transformers passes them). Other templates (SmolLM2's) get the generic
tool prompt: ``GENERIC_TOOL_PROMPT`` appended to the system message, an
assistant's ``tool_calls`` rendered as the ``<tool_call>`` blocks above, and a
``role: tool`` message rendered as a user message
``<tool_response>\\n...\\n</tool_response>``.

``engine/serving/tool_call_parser.py`` (``ToolCallParser``) owns the wire
format and turns the generated text into OpenAI's ``tool_calls``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import msgspec

from engine.serving.protocol import RequestValidationError
from engine.protocol.chat_shapes import ShapeError, check_response_format, check_tool_choice, check_tools
from engine.protocol.tool_choice import PARALLEL_WITHOUT_TOOLS, parallel_without_tools
from engine.sampling_params import StructuredOutputsParams
from engine.serving.tool_call_parser import ARGS_PREFIX, CALL_BEGIN, CALL_END, NAME_PREFIX, ToolCallFormat


GENERIC_TOOL_PROMPT = (
    "You can call functions. The available functions, as JSON schemas:\n<tools>\n{tools}\n</tools>\n"
    "To call a function, answer with one block per call:\n"
    '<tool_call>\n{{"name": <function name>, "arguments": <arguments as a JSON object>}}\n</tool_call>'
)


@dataclass
class ChatPlan:
    """What a chat request needs beyond plain generation.

    Attributes:
        structured_outputs: the grammar, or None (unconstrained).
        messages: the messages to render (rewritten for the generic tool
            prompt when the template does not know tools).
        template_kwargs: extra chat-template variables (``tools``).
        tool_calls: parse ``<tool_call>`` blocks out of the output, as
            this grammar admits them (``tool_call_parser.ToolCallFormat``);
            None: no tools.
        param: the request field the grammar comes from (for errors).
        answer_format: the response format a text answer must follow when
            it is combined with tools (tool_choice "auto": the output is
            calls, or one JSON value under this spec); None otherwise.
        unused_tools: the tools' grammar where tool_choice "none" leaves
            them out of this turn: compiled for its checks alone, so that a
            schema refused under another tool_choice is refused under "none"
            too (an agent trial's turns got a 400 or a 200 by tool_choice).
    """

    structured_outputs: StructuredOutputsParams | None = None
    messages: list[dict] = field(default_factory=list)
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    tool_calls: ToolCallFormat | None = None
    param: str = "response_format"
    answer_format: StructuredOutputsParams | None = None
    unused_tools: StructuredOutputsParams | None = None


def _fail(param: str, message: str, code: str = "invalid_value") -> RequestValidationError:
    """The request's 400 naming ``param``, with OpenAI's ``code`` (a trial found one with none)."""
    return RequestValidationError(message, param, code)


def plan_chat(req, messages: list[dict], template: str | None) -> ChatPlan:
    """Check the structured-output fields of a chat request and plan it.

    Args:
        req: the parsed ``ChatCompletionRequest``.
        messages: its normalized messages (string contents).
        template: the model's chat template source (None: none).

    Returns:
        The ``ChatPlan``.

    Raises:
        RequestValidationError: a field is malformed, a schema is invalid or
            uses an unsupported feature; the message starts with the path at
            fault and ``param`` is its top-level field.
    """
    try:
        tools = check_tools(req.tools or None)
        choice = check_tool_choice(req.tool_choice, tools)
    except ShapeError as e:   # OpenAI's code, as the gateway's edge names it
        raise RequestValidationError(str(e), e.param, e.code) from None
    if parallel_without_tools(req.parallel_tool_calls, tools):
        raise RequestValidationError(PARALLEL_WITHOUT_TOOLS, "parallel_tool_calls", "invalid_value")
    spec, param = structured_spec(req)
    answer = _answer_schema(spec, param) if spec is not None and choice == "auto" else None
    if req.continue_final_message and (spec is not None or choice not in ("none", "auto")):
        field_ = param if spec is not None else "tool_choice"   # the constraint would restart after the prefill
        raise _fail(field_, f"{field_}: cannot be combined with continue_final_message (an assistant prefill): the "
                            f"constraint would hold for the continuation alone, not for the prefill and it together")
    plan = ChatPlan(structured_outputs=spec, messages=messages, param=param)
    knows_tools = bool(template) and "tools" in template
    if choice != "none":
        named = [i for i, t in enumerate(tools) if choice in ("auto", "required") or t["function"]["name"] == choice]
        # required or named: this turn's output is calls only, a response format is for a later answer
        plan.structured_outputs = StructuredOutputsParams(
            structural_tag=_tool_grammar(tools, choice, req.parallel_tool_calls is not False, answer),
            where=((spec.where[0] if spec.where else param,) if answer is not None else ()) + tuple(
                f"tools[{i}].function.parameters" for i in named))
        plan.answer_format = spec if answer is not None else None
        plan.tool_calls = ToolCallFormat(choice != "auto", tuple(tools[i]["function"]["name"] for i in named))
        plan.param = "tools"
    elif tools:
        plan.unused_tools = StructuredOutputsParams(structural_tag=_tool_grammar(tools, "auto", True),
                                                    where=tuple(f"tools[{i}].function.parameters"
                                                                for i in range(len(tools))))
    if knows_tools:
        plan.messages = [_arguments_as_objects(m) for m in messages]
        if tools:   # under "none" too, as vLLM (unless --exclude-tools-when-tool-choice-none) and OpenAI do
            plan.template_kwargs["tools"] = tools
    elif choice != "none" or any(m.get("role") == "tool" or m.get("tool_calls") for m in messages):
        plan.messages = _generic_tool_messages(messages, tools if choice != "none" else [])
    return plan


def structured_spec(req) -> tuple[StructuredOutputsParams | None, str]:
    """The output constraint of a chat or completion request (``req``: a parsed request with
    ``response_format`` and ``structured_outputs``): its spec (None: none) and the field to name in errors.

    Raises:
        RequestValidationError: a field is malformed, or both are given.
    """
    fmt = _response_format(req.response_format)
    extra = structured_outputs_extra(req.structured_outputs)
    if fmt is not None and extra is not None:
        raise _fail("response_format", "response_format: cannot be combined with structured_outputs")
    return (extra, "structured_outputs") if extra is not None else (fmt, "response_format")


def _response_format(fmt: dict | None) -> StructuredOutputsParams | None:
    """The output constraint of a ``response_format`` (``chat_shapes.check_response_format``'s shape): None for
    text, any JSON object for json_object, the schema's grammar for json_schema."""
    try:
        kind, spec = check_response_format(fmt)
    except ShapeError as e:   # OpenAI's code, as the gateway's edge names it
        raise RequestValidationError(str(e), e.param, e.code) from None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    # the subset is checked with the compile, off the event loop; no schema (absent or null, as OpenAI takes
    # it): any JSON object
    schema = spec.get("schema")
    if schema is None or (isinstance(schema, msgspec.Raw) and bytes(schema).strip() == b"null"):
        schema = {"type": "object"}
    schema = schema_value(schema, "response_format", "response_format.json_schema.schema")
    return StructuredOutputsParams(json=schema, where=("response_format.json_schema.schema",))


def schema_value(value: Any, param: str, where: str) -> dict | bool | str:
    """A schema field's value as ``StructuredOutputsParams.json`` takes it: a dict or a bool as decoded, or
    for a ``msgspec.Raw`` (``protocol.decode_body``: the serving process keeps schemas unparsed) the JSON
    text of an object, compacted by ``msgspec.json.format`` (C, no Python object per schema node: 1.3 ms
    for 400 KB, against ~10 ms and ~8,600 containers to decode it); a raw value that is not an object is
    decoded (a boolean, or the error below). A key given twice in the text: the last one counts in the
    subset check (Python's decoders) and in xgrammar's compile alike, as it did decoded.

    Raises:
        RequestValidationError: not a schema (an object or a boolean); ``param`` names the field,
            the message ``where``.
    """
    if isinstance(value, msgspec.Raw):
        text = msgspec.json.format(value, indent=-1)
        if text[:1] == b"{":
            return text.decode()
        value = msgspec.json.decode(text)
    if not isinstance(value, (dict, bool)):
        raise _fail(param, f"{where}: must be a JSON schema (an object), got {type(value).__name__}", "invalid_type")
    return value


def structured_outputs_extra(extra: dict | None) -> StructuredOutputsParams | None:
    """vLLM's ``structured_outputs`` body field (chat and completions):
    ``{"json" | "regex" | "choice" | "grammar": ...}``, or None when absent.
    Types are checked here (``choice`` a list of strings, ``regex`` and
    ``grammar`` strings, ``json`` an object); the schema's subset with the compile.

    Raises:
        RequestValidationError: malformed (``param`` = "structured_outputs").
    """
    if extra is None:
        return None
    if not isinstance(extra, dict):
        raise _fail("structured_outputs", "structured_outputs: must be an object", "invalid_type")
    unknown = sorted(k for k in extra if k not in ("json", "regex", "choice", "grammar"))
    if unknown:
        raise _fail("structured_outputs", f"structured_outputs.{unknown[0]}: unknown parameter (one of json, "
                                          f"regex, choice, grammar is supported)", "unknown_parameter")
    known = {k: v for k, v in extra.items() if v is not None}
    if len(known) != 1:
        raise _fail("structured_outputs", "structured_outputs: exactly one of json, regex, choice, grammar is "
                                          "supported")
    if "json" in known:
        known["json"] = schema_value(known["json"], "structured_outputs", "structured_outputs.json")
    if isinstance(known.get("choice"), str):  # vLLM would split it into characters
        raise _fail("structured_outputs", "structured_outputs.choice: must be a non-empty list of strings, got str",
                    "invalid_type")
    try:
        return StructuredOutputsParams(**known, where=("structured_outputs.json",) if "json" in known else ())
    except ValueError as exc:
        raise _fail("structured_outputs", str(exc)) from None


def _tool_tag(tool: dict) -> dict:
    fn = tool["function"]
    return {"type": "tag", "begin": f'{NAME_PREFIX}{fn["name"]}{ARGS_PREFIX}',
            "content": {"type": "json_schema", "json_schema": fn["parameters"], "max_whitespace_cnt": 1},
            "end": CALL_END}


def _answer_schema(spec: StructuredOutputsParams, param: str) -> dict | bool:
    """The JSON schema a text answer must follow beside tools: a ``json`` spec's schema, ``json_object``'s any
    object.

    Raises:
        RequestValidationError: a regex, choice or grammar spec (only a JSON schema combines with tools)."""
    if spec.json_object:
        return {"type": "object"}
    if spec.json is None:
        raise _fail(param, f"{param}: only a JSON schema (response_format json_schema or json_object, "
                           f"structured_outputs.json) can be combined with tools (unless tool_choice is \"none\")")
    return json.loads(spec.json) if isinstance(spec.json, str) else spec.json


def _tool_grammar(tools: list[dict], choice: str, parallel: bool, answer: dict | bool | None = None) -> str:
    """xgrammar structural-tag JSON for the tool choice. ``answer``: the schema of a text answer beside tools
    (tool_choice auto with a response format): the output is then one or more calls, or one JSON value under it
    (xgrammar's ``or`` format), never free text."""
    tags = [_tool_tag(t) for t in tools]
    if choice == "auto" and answer is not None:
        fmt = {"type": "or", "elements": [
            {"type": "json_schema", "json_schema": answer, "max_whitespace_cnt": 1},
            {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True,
             "stop_after_first": not parallel}]}
    elif choice == "auto":
        fmt = {"type": "triggered_tags", "triggers": [CALL_BEGIN], "tags": tags, "at_least_one": False,
               "stop_after_first": not parallel}
    elif choice == "required":
        fmt = {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True,
               "stop_after_first": not parallel}
    else:
        fmt = next(tag for tag, t in zip(tags, tools) if t["function"]["name"] == choice)
    return json.dumps({"type": "structural_tag", "format": fmt})


def _arguments_as_objects(message: dict) -> dict:
    """Tool-call arguments as objects (what tool-aware templates expect)."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    out = []
    for call in calls:
        fn = dict(call.get("function") or {})
        if isinstance(fn.get("arguments"), str):
            try:
                fn["arguments"] = json.loads(fn["arguments"])
            except json.JSONDecodeError:
                pass
        out.append({**call, "function": fn})
    return {**message, "tool_calls": out}


def render_tool_call(name: str, arguments: Any) -> str:
    """One call in the wire format (``arguments``: object or JSON text)."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return f"{NAME_PREFIX}{name}{ARGS_PREFIX}{args}{CALL_END}"


def _generic_tool_messages(messages: list[dict], tools: list[dict]) -> list[dict]:
    """Messages for a template without tool support (see the module doc)."""
    out = []
    for i, m in enumerate(messages):
        role = m.get("role")
        if role == "tool":
            if not isinstance(m.get("tool_call_id"), str):
                raise RequestValidationError(f"Missing required parameter: 'messages[{i}].tool_call_id'.",
                                             f"messages[{i}].tool_call_id", "missing_required_parameter")
            out.append({"role": "user", "content": f"<tool_response>\n{m.get('content', '')}\n</tool_response>"})
        elif role == "assistant" and m.get("tool_calls"):
            blocks = [render_tool_call((c.get("function") or {}).get("name", ""),
                                       (c.get("function") or {}).get("arguments", "{}")) for c in m["tool_calls"]]
            text = "\n".join(([m["content"]] if m.get("content") else []) + blocks)
            out.append({"role": "assistant", "content": text})
        else:
            out.append({"role": role, "content": m.get("content", "")})
    if tools:
        prompt = GENERIC_TOOL_PROMPT.format(tools="\n".join(json.dumps(t["function"]) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{prompt}".strip()}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out
