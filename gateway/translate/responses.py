"""OpenAI's Responses API onto chat completions, as pure functions (no I/O).

A ``POST /v1/responses`` body becomes one chat body (``to_chat``) that the one pipeline serves like any chat
request; the chat answer becomes the Responses object (``from_chat``); a chat stream becomes the typed events of
``gateway/translate/responses_events.py``. Names follow OpenAI's Responses API exactly
(https://platform.openai.com/docs/api-reference/responses).

What is translated: ``input`` (a string, or items: messages with text and image parts, ``function_call``,
``function_call_output``; ``reasoning`` items are dropped, chat has no place for them), ``instructions`` (a
system message first), function ``tools``, ``tool_choice``, ``parallel_tool_calls``, ``text.format``
(``json_schema`` / ``json_object`` -> ``response_format``), ``text.verbosity`` -> ``verbosity``,
``max_output_tokens`` -> ``max_tokens``, ``temperature``, ``top_p``, ``user``, ``metadata``, ``stream`` (and the
gateway's own ``priority``, ``seed``), ``include: ["message.output_text.logprobs"]`` and ``top_logprobs`` ->
chat's ``logprobs`` and ``top_logprobs`` (the message's ``output_text`` then carries them, as chat's
``logprobs.content``). ``max_tool_calls`` is echoed: it bounds built-in tools' calls (OpenAI's), and only function
tools are served. Every parameter is checked first, as OpenAI checks it (``PARAMS``: unknown, type, range; the
keys of ``text``, ``tools`` and ``tool_choice`` in ``gateway/translate/responses_checks.py``). Refused with a 400
naming the field: built-in OpenAI tools (``web_search``, ``file_search``, ``computer_use_preview``...),
``background``, ``conversation``, ``prompt`` (stored prompts) and input items chat cannot express.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

from engine.protocol.chat_shapes import string_field_problem
from gateway.errors import ClientError
from gateway.request.validate import check_range, check_type
from gateway.translate.chat import reasoning_of
from gateway.translate.responses_checks import (bad_request, check_parallel_tool_calls, check_text, check_tool_choice,
                                                check_tools)

# Fields the gateway cannot serve on any backend: refused with a 400 naming them.
REFUSED_FIELDS = ("background", "conversation", "prompt")
_NUM = (int, float)
# Every top-level parameter of OpenAI's Responses API (``responses.create``) and its JSON types; any other is
# refused as OpenAI refuses it (400 ``unknown_parameter``). ``priority`` and ``seed`` are the gateway's own, as on
# chat. Value ranges are chat's (``engine/protocol/param_ranges.py``), read under the chat name (``_RENAMED``).
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
# Parameters copied into the chat body as they are (same name, same meaning).
_SAME = ("temperature", "top_p", "user", "metadata", "priority", "seed")
# Parameters copied into the chat body under another name.
_RENAMED = {"max_output_tokens": "max_tokens"}
FINISH_TO_INCOMPLETE = {"length": "max_output_tokens", "content_filter": "content_filter"}
# The ``include`` value asking for the output text's token logprobs (OpenAI's).
LOGPROBS_INCLUDE = "message.output_text.logprobs"


@dataclass(frozen=True, slots=True)
class ResponseContext:
    """What the Responses object echoes of its request, fixed when the request arrives: ``id``
    (``resp_<request id>``), ``created_at`` (epoch seconds), the client's ``body`` and the public ``model``."""

    id: str
    created_at: int
    body: dict
    model: str
    request_id: str = ""


def new_context(body: dict, request_id: str, model: str) -> ResponseContext:
    """The context of a response to ``body`` answered under ``request_id`` (the gateway's id; a ``/`` a client's
    own id may hold becomes ``_``: the response id is one path segment of ``/v1/responses/{id}``)."""
    rid = request_id.replace("/", "_")
    return ResponseContext(f"resp_{rid}", int(time.time()), body, model, rid)


def check_body(body: dict) -> None:
    """The Responses checks, before translation: ``model``, every parameter known (``PARAMS``), of its type and in
    its range, ``input``, refused fields, and the nested objects (``gateway/translate/responses_checks.py``:
    ``tools``, function tools only, ``tool_choice``, ``parallel_tool_calls``, ``text``). Chat's own checks run
    later, on the chat body, in ``validate.py``.

    Raises:
        ClientError: 400 naming the parameter (a built-in tool by its type)."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("missing required parameter 'model'" if model is None
                          else "'model' must be a non-empty string",
                          "model", "missing_required_parameter" if model is None else "invalid_type")
    _check_params(body)
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
    """Each parameter of ``body`` is a Responses parameter, of its type, in the range chat's table gives its chat
    name; a 400 names the parameter as the client wrote it."""
    for name, value in body.items():
        types = PARAMS.get(name)
        if types is None:
            raise bad_request(f"Unknown parameter: '{name}'.", name, "unknown_parameter")
        check_type(name, value, types)
        try:
            check_range(_RENAMED.get(name, name), value)
        except ClientError as e:
            raise responses_error(e) from None


# The id prefix of an input item the client sent without an id, by type (OpenAI's prefixes).
_ITEM_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def input_items(body: dict, request_id: str) -> list[dict]:
    """``body['input']`` as a list of items, each with a ``type`` and an ``id`` (the client's, else one made from
    the request id and the item's position; a string input: one user message), as
    ``GET /v1/responses/{id}/input_items`` lists and pages them."""
    inp = body["input"]
    raw = [{"role": "user", "content": inp}] if isinstance(inp, str) else inp
    items = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise bad_request(f"'input[{i}]' must be an object", f"input[{i}]", "invalid_type")
        item = dict(item)
        item.setdefault("type", "message")
        if item["type"] == "message":
            content = item.get("content")
            if isinstance(content, str):
                part = "output_text" if item.get("role") == "assistant" else "input_text"
                item["content"] = [{"type": part, "text": content}]
        item.setdefault("id", f"{_ITEM_PREFIX.get(item['type'], 'item')}_{request_id}_{i}")
        items.append(item)
    return items


def _text_of(parts: list, where: str) -> str | list:
    """Message content parts -> chat content: one string when every part is text (what chat templates read
    best), else chat's parts (images as ``image_url``)."""
    out = []
    for j, p in enumerate(parts):
        if not isinstance(p, dict):    # it said "part type 'None'" (a trial)
            raise bad_request(f"'{where}[{j}]' must be a content part object, got {type(p).__name__}", f"{where}[{j}]",
                              "invalid_type")
        kind = p.get("type")
        if kind in ("input_text", "output_text", "text", "refusal"):
            field = "refusal" if kind == "refusal" else "text"
            _require_string(p, field, f"{where}[{j}].{field}")     # a non-string was a 500 (a trial)
            out.append({"type": "text", "text": p[field]})
        elif kind == "input_image" and p.get("image_url"):
            out.append({"type": "image_url", "image_url": {"url": p["image_url"], "detail": p.get("detail", "auto")}})
        else:
            raise bad_request(f"content part type '{kind}' is not supported", f"{where}[{j}].type")
    if all(p["type"] == "text" for p in out):
        return "".join(p["text"] for p in out)
    return out


def _require_string(obj: dict, name: str, path: str) -> None:
    """Refuse ``obj`` (at ``path`` less its last key) without the string ``name``, naming ``path``
    (``string_field_problem``'s words)."""
    if (problem := string_field_problem(obj, name, path)) is not None:
        raise bad_request(problem[0], path, problem[1])


def _require_strings(item: dict, i: int, names: tuple[str, ...]) -> None:
    """Refuse input item ``i`` when one of ``names`` is absent or not a non-empty string, naming
    ``input[i].<name>`` (the chat translation would name ``messages[k].tool_calls[0]...`` of its own body)."""
    for name in names:
        _require_string(item, name, f"input[{i}].{name}")
        if not item[name]:
            raise bad_request(f"'input[{i}].{name}' must be a non-empty string", f"input[{i}].{name}",
                              "invalid_value")


def to_messages(items: list[dict]) -> list[dict]:
    """Responses items -> chat messages. Consecutive ``function_call`` items join the assistant message before
    them (one turn, parallel calls); ``function_call_output`` is a ``tool`` message; ``reasoning`` is dropped.

    Raises:
        ClientError: 400 naming an item chat cannot express, a ``function_call_output`` whose ``call_id`` no
        ``function_call`` of ``items`` has, or a ``function_call`` no output answers (OpenAI's 400s, param
        ``input``)."""
    messages: list[dict] = []
    calls = dict.fromkeys(item.get("call_id") for item in items if item.get("type") == "function_call")   # in order
    for i, item in enumerate(items):
        kind = item.get("type")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad_request(f"'input[{i}].role' must be one of user, assistant, system, developer",
                                  f"input[{i}].role")
            content = item.get("content")
            if content is None:     # chat's check would name messages[k].content, a field the client never sent
                raise bad_request(f"missing required parameter 'input[{i}].content'", f"input[{i}].content",
                                  "missing_required_parameter")
            if not isinstance(content, (str, list)):
                raise bad_request(f"'input[{i}].content' must be a string or an array of content parts, got "
                                  f"{type(content).__name__}", f"input[{i}].content", "invalid_type")
            if isinstance(content, list) and not content and role != "assistant":
                raise bad_request(f"Invalid 'input[{i}].content': empty array. Expected an array with minimum length "
                                  "1, but got an empty array instead.", f"input[{i}].content", "empty_array")
            content = _text_of(content, f"input[{i}].content") if isinstance(content, list) else content
            messages.append({"role": role, "content": content})
        elif kind == "function_call":
            _require_strings(item, i, ("call_id", "name"))
            _require_string(item, "arguments", f"input[{i}].arguments")     # the call's JSON text, as OpenAI's
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item.get("arguments") or "{}"}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            _require_strings(item, i, ("call_id",))
            if "output" not in item:
                raise bad_request(f"missing required parameter 'input[{i}].output'", f"input[{i}].output",
                                  "missing_required_parameter")
            out = item.get("output")
            if not isinstance(out, (str, list)):   # chat's check would name the whole input
                raise bad_request(f"'input[{i}].output' must be a string or an array of content parts, got "
                                  f"{type(out).__name__}", f"input[{i}].output", "invalid_type")
            if item["call_id"] not in calls:
                raise bad_request(f"No tool call found for function call output with call_id {item['call_id']}.",
                                  "input")
            if isinstance(out, list):
                out = _text_of(out, f"input[{i}].output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": out})
        elif kind == "reasoning":
            continue       # chat has no place for a model's reasoning; the model reasons afresh
        else:
            raise bad_request(f"input item type '{kind}' is not supported", f"input[{i}].type")
    answered = {item.get("call_id") for item in items if item.get("type") == "function_call_output"}
    if unanswered := [c for c in calls if c not in answered]:   # OpenAI's: a call the conversation never answers
        raise bad_request(f"No tool output found for function call {unanswered[0]}.", "input")
    return messages


def _response_format(text: dict | None) -> dict | None:
    fmt = (text or {}).get("format") if isinstance(text, dict) else None
    if not fmt or fmt.get("type") == "text":
        return None
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": schema}


def _tool_choice(choice):
    if isinstance(choice, dict):
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def to_chat(body: dict, history: list[dict], items: list[dict]) -> dict:
    """The chat completions body serving ``body``: ``instructions`` as the system message, then the earlier
    turns' items (``history``: a ``previous_response_id``'s conversation) and this request's ``items``."""
    messages = []
    if body.get("instructions"):
        messages.append({"role": "system", "content": body["instructions"]})
    messages += to_messages(history + items)
    chat: dict = {"model": body["model"], "messages": messages}
    for name in _SAME:
        if body.get(name) is not None:
            chat[name] = body[name]
    for name, chat_name in _RENAMED.items():
        if body.get(name) is not None:
            chat[chat_name] = body[name]
    if body.get("tools"):
        chat["tools"] = [{"type": "function", "function": {
            k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None}}
            for t in body["tools"]]
        if body.get("parallel_tool_calls") is not None:
            chat["parallel_tool_calls"] = body["parallel_tool_calls"]
    choice = body.get("tool_choice")
    if choice is not None and (body.get("tools") or choice != "none"):
        # without tools, a choice other than "none" goes on for chat's validation to refuse (one rule)
        chat["tool_choice"] = _tool_choice(choice)
    if (rf := _response_format(body.get("text"))) is not None:
        chat["response_format"] = rf
    if (verbosity := (body.get("text") or {}).get("verbosity")) is not None:
        chat["verbosity"] = verbosity
    if LOGPROBS_INCLUDE in (body.get("include") or ()) or body.get("top_logprobs") is not None:
        chat["logprobs"], chat["top_logprobs"] = True, body.get("top_logprobs") or 0
    if body.get("stream"):
        # the Responses stream ends with its usage: ask the backend for it whatever the client said
        chat["stream"], chat["stream_options"] = True, {"include_usage": True}
    return chat


# Paths of the chat body a 400 of the chat pipeline names (validation, ranges, the engine's schema check) -> the
# Responses paths they came from, most specific first. A path is renamed only where it starts (after a quote,
# a space or the message's start; not in a URL path such as ``/v1/messages``): a schema property called
# ``messages`` is the client's own name. A message
# index of the chat body is not the client's (instructions and history come first): ``input`` alone.
_CHAT_PATHS = (
    (re.compile(r"(?<![\w.\]/])response_format\.json_schema\.schema\b"), "text.format.schema"),
    (re.compile(r"(?<![\w.\]/])response_format(\.json_schema)?\b"), "text.format"),
    (re.compile(r"(?<![\w.\]/])max_tokens\b"), "max_output_tokens"),
    (re.compile(r"(?<![\w.\]/])tools\[(\d+)\]\.function\b"), r"tools[\1]"),
    (re.compile(r"(?<![\w.\]/])tool_choice\.function\b"), "tool_choice"),
    (re.compile(r"(?<![\w.\]/])messages(\[\d+\](\.\w+)*)?"), "input"),
)


# A backend's refusal of an image part of the chat translation (the local engine takes text only)
_IMAGE_PART = re.compile(r"messages\[\d+\]\.content\[\d+\]: part type 'image_url' is not supported")


def _image_part(body: dict | None) -> str | None:
    """The path of the first ``input_image`` part of the client's Responses ``body`` (``input[i].content[j]``),
    or None."""
    items = body.get("input") if isinstance(body, dict) else None
    for i, item in enumerate(items if isinstance(items, list) else ()):
        content = item.get("content") if isinstance(item, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else ()):
            if isinstance(part, dict) and part.get("type") == "input_image":
                return f"input[{i}].content[{j}]"
    return None


def responses_path(text: str) -> str:
    """``text`` (a ``param`` or an error message) with each chat path named as the Responses parameter it came
    from (``max_tokens`` -> ``max_output_tokens``, ``response_format.json_schema.schema.x`` ->
    ``text.format.schema.x``, ``tools[0].function.parameters`` -> ``tools[0].parameters``)."""
    for pattern, new in _CHAT_PATHS:
        text = pattern.sub(new, text)
    return text


def responses_error_object(error: dict, body: dict | None = None) -> dict:
    """An OpenAI error object answered for the translated chat body (a backend's 400, a stream's error event),
    its ``message`` and ``param`` naming the Responses parameters the client wrote; with the client's Responses
    ``body`` at hand, a refused ``image_url`` part is named as the ``input_image`` part it came from (a chat
    message index is not the client's: only the body says which item held it)."""
    out = {k: responses_path(v) if k in ("message", "param") and isinstance(v, str) else v
           for k, v in error.items()}
    message = error.get("message")
    m = _IMAGE_PART.search(message) if body is not None and isinstance(message, str) else None
    if m is not None and (path := _image_part(body)) is not None:
        out["message"] = (message[:m.start()] + f"{path}: content part type 'input_image' is not supported"
                          + responses_path(message[m.end():]))
        out["param"] = f"{path}.type"
    return out


def responses_error(e: ClientError) -> ClientError:
    """A refusal of the translated chat body, naming (in ``param`` and the message) the Responses parameter the
    client wrote."""
    param = responses_path(e.param) if e.param else e.param
    return ClientError(e.status, responses_path(e.message), param, e.code, e.headers)


def native_body(body: dict, history: list[dict], items: list[dict]) -> dict:
    """``body`` as an upstream that speaks the Responses API natively is sent it: the conversation the gateway
    stored (``history``, without the gateway's item ids and statuses) and this turn's ``items`` as its
    ``input`` (without the ids the gateway gave them), no ``previous_response_id`` (the upstream never saw the
    gateway's ids)."""
    past = [{k: v for k, v in item.items() if k not in ("id", "status")} for item in history]
    raw = body["input"] if isinstance(body["input"], list) else [{}]
    own = [{k: v for k, v in item.items() if k != "id" or "id" in sent} for item, sent in zip(items, raw)]
    native = {k: v for k, v in body.items() if k != "previous_response_id"}
    native["input"] = past + own
    return native


def usage_of(chat_usage: dict | None) -> dict | None:
    """Chat ``usage`` -> the Responses ``usage`` (``input_tokens``, ``output_tokens``,
    ``input_tokens_details.cached_tokens``, ``output_tokens_details.reasoning_tokens``, ``total_tokens``)."""
    if not chat_usage:
        return None
    inp, out = int(chat_usage.get("prompt_tokens") or 0), int(chat_usage.get("completion_tokens") or 0)
    cached = int(((chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0)
    reasoning = int(((chat_usage.get("completion_tokens_details") or {}).get("reasoning_tokens")) or 0)
    return {"input_tokens": inp, "input_tokens_details": {"cached_tokens": cached}, "output_tokens": out,
            "output_tokens_details": {"reasoning_tokens": reasoning}, "total_tokens": inp + out}


def content_part(kind: str, text: str, logprobs: list | None = None) -> dict:
    """A message's content part: ``output_text`` (``logprobs``: its text's tokens, chat's ``logprobs.content``
    items, empty when not asked for) or ``refusal``."""
    if kind == "refusal":
        return {"type": "refusal", "refusal": text}
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def message_item(ctx: ResponseContext, text: str, status: str = "completed", refusal: str | None = None,
                 logprobs: list | None = None) -> dict:
    """The assistant message output item of ``ctx``'s response: its text's part (``content_part``), then its
    refusal's."""
    content = [content_part("output_text", text, logprobs)] if text or not refusal else []
    if refusal:
        content.append(content_part("refusal", refusal))
    return {"type": "message", "id": f"msg_{ctx.request_id}", "status": status, "role": "assistant",
            "content": content}


def reasoning_item(ctx: ResponseContext, text: str, n: int = 0, status: str = "completed") -> dict:
    """The ``n``-th reasoning output item of ``ctx``'s response: the backend's reasoning as ``reasoning_text``
    content (no summary: the backend gave none)."""
    suffix = f"_{n}" if n else ""
    return {"type": "reasoning", "id": f"rs_{ctx.request_id}{suffix}", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def function_call_item(ctx: ResponseContext, k: int, call_id: str | None, name: str, arguments: str,
                       status: str = "completed") -> dict:
    """The ``k``-th function call output item of ``ctx``'s response (its ``call_id`` the backend's tool call id)."""
    rid = ctx.request_id
    return {"type": "function_call", "id": f"fc_{rid}_{k}", "call_id": call_id or f"call_{rid}_{k}",
            "name": name, "arguments": arguments, "status": status}


def response_object(ctx: ResponseContext, status: str, output: list[dict], usage: dict | None = None,
                    error: dict | None = None, incomplete: str | None = None) -> dict:
    """The Responses object (``object: "response"``) of ``ctx`` in ``status`` (in_progress, completed,
    incomplete, failed), echoing the request's parameters as OpenAI does."""
    b = ctx.body
    text = b.get("text") if isinstance(b.get("text"), dict) else {}
    return {
        "id": ctx.id, "object": "response", "created_at": ctx.created_at, "status": status,
        "background": False, "error": error,
        "incomplete_details": {"reason": incomplete} if incomplete else None,
        "instructions": b.get("instructions"), "max_output_tokens": b.get("max_output_tokens"),
        "model": ctx.model, "output": output, "parallel_tool_calls": b.get("parallel_tool_calls", True),
        "previous_response_id": b.get("previous_response_id"), "reasoning": {"effort": None, "summary": None},
        "store": b.get("store", True), "temperature": b.get("temperature", 1.0),
        "text": {"format": (text or {}).get("format") or {"type": "text"},
                 "verbosity": (text or {}).get("verbosity") or "medium"},
        "top_logprobs": b.get("top_logprobs"), "max_tool_calls": b.get("max_tool_calls"),
        "tool_choice": b.get("tool_choice", "auto"), "tools": b.get("tools") or [], "top_p": b.get("top_p", 1.0),
        "truncation": "disabled", "usage": usage, "user": b.get("user"), "metadata": b.get("metadata") or {},
    }


def from_chat(chat: dict, ctx: ResponseContext) -> dict:
    """A chat completion (the first choice) -> the Responses object: its reasoning as a reasoning item, its text
    as one message item, each tool
    call as a ``function_call`` item; ``finish_reason`` ``length`` -> status ``incomplete``
    (``max_output_tokens``), and so the items the cut ended (OpenAI's item ``status``)."""
    choice = (chat.get("choices") or [{}])[0]
    msg = choice.get("message") or {}
    output = []
    if reasoning := reasoning_of(msg):
        output.append(reasoning_item(ctx, reasoning))
    if msg.get("content") or msg.get("refusal") or not msg.get("tool_calls"):
        output.append(message_item(ctx, msg.get("content") or "", refusal=msg.get("refusal"),
                                   logprobs=(choice.get("logprobs") or {}).get("content")))
    for k, call in enumerate(msg.get("tool_calls") or []):
        fn = call.get("function") or {}
        output.append(function_call_item(ctx, k, call.get("id"), fn.get("name", ""), fn.get("arguments") or ""))
    incomplete = FINISH_TO_INCOMPLETE.get(choice.get("finish_reason"))
    if incomplete:    # the cut ended the last item, and the reasoning when it left no text nor call after it
        output[-1]["status"] = "incomplete"
        if output[0]["type"] == "reasoning" and output[-1]["type"] == "message" and not msg.get("content"):
            output[0]["status"] = "incomplete"
    return response_object(ctx, "incomplete" if incomplete else "completed", output, usage_of(chat.get("usage")),
                           incomplete=incomplete)
