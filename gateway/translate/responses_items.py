"""A ``POST /v1/responses`` body's ``input`` items as pure functions: checked and listed with their ids (what
``input_items`` lists and a follow-up continues from) and translated into chat messages (``to_messages``), each
refusal OpenAI's 400 naming the item's own path (``input[i].content[j].text``).

An item's or a content part's key OpenAI does not know is refused (``unknown_parameter``), never dropped, as a
tool's is (``responses_checks.check_tools``); so is a content part in a message whose role does not hold it
(OpenAI's: what the model said is ``output_text`` or ``refusal``, the rest ``input_*``; chat's ``text`` is
neither).
"""

from __future__ import annotations

from engine.protocol.chat_shapes import string_field_problem
from gateway.request.param_objects import one_of
from gateway.translate.responses_checks import bad_request, check_keys

# The id prefix of an input item the client sent without an id, by type (OpenAI's prefixes).
_ITEM_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}
_S = (str,)
# The keys of each input item type and of each content part type, with their JSON types (the openai SDK's param
# types, pinned by tests/gateway/translate/test_responses.py). ``phase`` (an assistant message's),
# ``prompt_cache_breakpoint`` and a function call's (or its output's) ``caller``, ``namespace`` and ``async`` are
# hints chat has no place for, taken as no-ops.
_CALL_HINTS = {"caller": (dict,), "namespace": _S}
ITEM_KEYS = {
    "message": {"type": _S, "id": _S, "role": _S, "content": (str, list), "status": _S, "phase": _S},
    "function_call": {"type": _S, "id": _S, "call_id": _S, "name": _S, "arguments": _S, "status": _S,
                      "async": (bool,), **_CALL_HINTS},
    "function_call_output": {"type": _S, "id": _S, "call_id": _S, "output": (str, list), "status": _S, "name": _S,
                             **_CALL_HINTS},
    "reasoning": {"type": _S, "id": _S, "summary": (list,), "content": (list,), "encrypted_content": _S,
                  "status": _S},
}
PART_KEYS = {
    "input_text": {"type": _S, "text": _S, "prompt_cache_breakpoint": (dict,)},
    "input_image": {"type": _S, "image_url": _S, "file_id": _S, "detail": _S, "prompt_cache_breakpoint": (dict,)},
    "output_text": {"type": _S, "text": _S, "annotations": (list,), "logprobs": (list,)},
    "refusal": {"type": _S, "refusal": _S},
}
# The content part types of a message by its role, and of a function call's output (``input_file`` is OpenAI's,
# refused by the translation as not supported).
_INPUT_PARTS = ("input_text", "input_image", "input_file")
PART_TYPES = {"user": _INPUT_PARTS, "system": _INPUT_PARTS, "developer": _INPUT_PARTS,
              "assistant": ("output_text", "refusal")}


def check_item(item: dict, i: int) -> None:
    """The client's input item ``i``: its keys (``ITEM_KEYS``) and, in a message or a function call's output, each
    content part's type (``PART_TYPES``) and keys (``PART_KEYS``). An item type, role or content ``to_messages``
    cannot translate is left for it to name.

    Raises:
        ClientError: 400 naming ``input[i].<key>`` or ``input[i].content[j]...``."""
    kind = item.get("type", "message")
    if kind not in ITEM_KEYS:
        return
    check_keys(item, ITEM_KEYS[kind], f"input[{i}]")
    if kind == "message":
        parts, allowed, where = item.get("content"), PART_TYPES.get(item.get("role")), f"input[{i}].content"
    elif kind == "function_call_output":
        parts, allowed, where = item.get("output"), _INPUT_PARTS, f"input[{i}].output"
    else:
        return
    if not isinstance(parts, list) or allowed is None:
        return
    for j, part in enumerate(parts):
        if isinstance(part, dict):
            one_of(part.get("type"), allowed, f"{where}[{j}].type")
            if part["type"] in PART_KEYS:
                check_keys(part, PART_KEYS[part["type"]], f"{where}[{j}]")


def input_items(body: dict, request_id: str) -> list[dict]:
    """``body['input']`` as a list of items, each checked (``check_item``) and with a ``type``, an ``id`` (the
    client's, else one made from the request id and the item's position; a string input: one user message) and
    a ``status`` (the client's, else ``completed``, as OpenAI lists input items), as
    ``GET /v1/responses/{id}/input_items`` lists and pages them."""
    inp = body["input"]
    raw = [{"role": "user", "content": inp}] if isinstance(inp, str) else inp
    items = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise bad_request(f"'input[{i}]' must be an object", f"input[{i}]", "invalid_type")
        check_item(item, i)
        item = dict(item)
        item.setdefault("type", "message")
        if item["type"] == "message":
            content = item.get("content")
            if isinstance(content, str):
                part = "output_text" if item.get("role") == "assistant" else "input_text"
                item["content"] = [{"type": part, "text": content}]
        item.setdefault("id", f"{_ITEM_PREFIX.get(item['type'], 'item')}_{request_id}_{i}")
        item.setdefault("status", "completed")
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
        # chat's "text" part: check_item refuses it in a request, but a conversation stored before may hold one
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


def _require_strings(item: dict, where: str, names: tuple[str, ...]) -> None:
    """Refuse the input item at ``where`` (``input[i]``) when one of ``names`` is absent or not a non-empty
    string, naming ``input[i].<name>`` (the chat translation would name ``messages[k].tool_calls[0]...`` of its
    own body)."""
    for name in names:
        _require_string(item, name, f"{where}.{name}")
        if not item[name]:
            raise bad_request(f"'{where}.{name}' must be a non-empty string", f"{where}.{name}", "invalid_value")


def to_messages(items: list[dict], first: int = 0) -> list[dict]:
    """Responses items -> chat messages. Consecutive ``function_call`` items join the assistant message before
    them (one turn, parallel calls); ``function_call_output`` is a ``tool`` message (its images in a user message
    after the turn's tool messages); ``reasoning`` is dropped.
    ``items[first:]`` are the client's ``input`` (a refusal names ``input[i - first]``), the items before them
    a stored conversation (named ``previous_response_id``).

    Raises:
        ClientError: 400 naming an item chat cannot express, a ``function_call_output`` whose ``call_id`` no
        ``function_call`` of ``items`` has, or a ``function_call`` no output answers (OpenAI's 400s, param
        ``input``)."""
    messages: list[dict] = []
    calls = dict.fromkeys(item.get("call_id") for item in items if item.get("type") == "function_call")   # in order
    images: list[dict] = []       # of the function_call_outputs of the turn so far
    for i, item in enumerate(items):
        kind, where = item.get("type"), f"input[{i - first}]" if i >= first else "previous_response_id"
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad_request(f"'{where}.role' must be one of user, assistant, system, developer",
                                  f"{where}.role")
            content = item.get("content")
            if content is None:     # chat's check would name messages[k].content, a field the client never sent
                raise bad_request(f"missing required parameter '{where}.content'", f"{where}.content",
                                  "missing_required_parameter")
            if not isinstance(content, (str, list)):
                raise bad_request(f"'{where}.content' must be a string or an array of content parts, got "
                                  f"{type(content).__name__}", f"{where}.content", "invalid_type")
            if isinstance(content, list) and not content and role != "assistant":
                raise bad_request(f"Invalid '{where}.content': empty array. Expected an array with minimum length "
                                  "1, but got an empty array instead.", f"{where}.content", "empty_array")
            content = _text_of(content, f"{where}.content") if isinstance(content, list) else content
            messages.append({"role": role, "content": content})
        elif kind == "function_call":
            _require_strings(item, where, ("call_id", "name"))
            _require_string(item, "arguments", f"{where}.arguments")     # the call's JSON text, as OpenAI's
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item.get("arguments") or "{}"}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            _require_strings(item, where, ("call_id",))
            if "output" not in item:
                raise bad_request(f"missing required parameter '{where}.output'", f"{where}.output",
                                  "missing_required_parameter")
            out = item.get("output")
            if not isinstance(out, (str, list)):   # chat's check would name the whole input
                raise bad_request(f"'{where}.output' must be a string or an array of content parts, got "
                                  f"{type(out).__name__}", f"{where}.output", "invalid_type")
            if item["call_id"] not in calls:
                raise bad_request(f"No tool call found for function call output with call_id {item['call_id']}.",
                                  "input")
            if isinstance(out, list) and not isinstance(out := _text_of(out, f"{where}.output"), str):
                # chat's tool messages carry text only (OpenAI's API refuses other parts there): the images go to
                # a user message after this turn's tool messages, as a Messages tool_result's do
                images += [p for p in out if p["type"] != "text"]
                out = "".join(p["text"] for p in out if p["type"] == "text")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": out})
            if images and (i + 1 == len(items) or items[i + 1].get("type") != "function_call_output"):
                messages.append({"role": "user", "content": images})
                images = []
        elif kind == "reasoning":
            continue       # chat has no place for a model's reasoning; the model reasons afresh
        else:
            raise bad_request(f"input item type '{kind}' is not supported", f"{where}.type")
    answered = {item.get("call_id") for item in items if item.get("type") == "function_call_output"}
    if unanswered := [c for c in calls if c not in answered]:   # OpenAI's: a call the conversation never answers
        raise bad_request(f"No tool output found for function call {unanswered[0]}.", "input")
    return messages

