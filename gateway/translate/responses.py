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
tools are served. Every parameter is checked first, as OpenAI checks it (``gateway/translate/responses_checks.py``:
unknown, type, range; the keys of ``text``, ``tools`` and ``tool_choice``). Refused with a 400 naming the field:
built-in OpenAI tools (``web_search``, ``file_search``, ``computer_use_preview``...), ``background``,
``conversation``, ``prompt`` (stored prompts) and input items chat cannot express. The input items' translation
is ``gateway/translate/responses_items.py``; a refusal of the chat translation is named back as the Responses
parameter (``gateway/translate/responses_errors.py``); ``truncation: "auto"`` shortens the conversation
(``gateway/translate/responses_truncation.py``). Other parameters OpenAI takes (``reasoning``,
``service_tier``, ``prompt_cache_key``, ``safety_identifier``...) are checked and echoed, not sent on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from gateway.translate.chat import reasoning_of
from gateway.translate.responses_checks import CHAT_NAMES
from gateway.translate.responses_items import to_messages

# Parameters copied into the chat body as they are (same name, same meaning).
_SAME = ("temperature", "top_p", "user", "metadata", "priority", "seed")
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
    messages += to_messages(history + items, len(history))
    chat: dict = {"model": body["model"], "messages": messages}
    for name in _SAME:
        if body.get(name) is not None:
            chat[name] = body[name]
    for name, chat_name in CHAT_NAMES.items():
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



def native_body(body: dict, history: list[dict], items: list[dict]) -> dict:
    """``body`` as an upstream that speaks the Responses API natively is sent it: the conversation the gateway
    stored (``history``, without the gateway's item ids and statuses) and this turn's ``items`` as its
    ``input`` (without the ids and statuses the gateway gave them), no ``previous_response_id`` (the upstream
    never saw the gateway's ids)."""
    past = [{k: v for k, v in item.items() if k not in ("id", "status")} for item in history]
    raw = body["input"] if isinstance(body["input"], list) else [{}]
    own = [{k: v for k, v in item.items() if k not in ("id", "status") or k in sent} for item, sent in zip(items, raw)]
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
    incomplete, failed), echoing the request's parameters as OpenAI does (``service_tier`` ``auto`` or not given:
    ``default``, the tier OpenAI reports serving it on); ``completed_at`` (epoch seconds, now) only when
    completed."""
    b = ctx.body
    text = b.get("text") if isinstance(b.get("text"), dict) else {}
    return {
        "id": ctx.id, "object": "response", "created_at": ctx.created_at, "status": status,
        "completed_at": int(time.time()) if status == "completed" else None, "background": False, "error": error,
        "incomplete_details": {"reason": incomplete} if incomplete else None,
        "instructions": b.get("instructions"), "max_output_tokens": b.get("max_output_tokens"),
        "model": ctx.model, "output": output, "parallel_tool_calls": b.get("parallel_tool_calls", True),
        "previous_response_id": b.get("previous_response_id"),
        "reasoning": {"effort": None, "summary": None, **(b.get("reasoning") or {})},
        "service_tier": "default" if b.get("service_tier") in (None, "auto") else b["service_tier"],
        "prompt_cache_key": b.get("prompt_cache_key"), "prompt_cache_retention": b.get("prompt_cache_retention"),
        "safety_identifier": b.get("safety_identifier"),
        "store": b.get("store", True), "temperature": b.get("temperature", 1.0),
        "text": {"format": (text or {}).get("format") or {"type": "text"},
                 "verbosity": (text or {}).get("verbosity") or "medium"},
        "top_logprobs": b.get("top_logprobs"), "max_tool_calls": b.get("max_tool_calls"),
        "tool_choice": b.get("tool_choice", "auto"), "tools": b.get("tools") or [], "top_p": b.get("top_p", 1.0),
        "truncation": b.get("truncation") or "disabled", "usage": usage, "user": b.get("user"),
        "metadata": b.get("metadata") or {},
    }


def from_chat(chat: dict, ctx: ResponseContext) -> dict:
    """A chat completion (the first choice) -> the Responses object: its reasoning as a reasoning item, its text
    as one message item, each tool call as a ``function_call`` item; ``finish_reason`` ``length`` -> status
    ``incomplete`` (``max_output_tokens``), and so the last item, which the cut ended (OpenAI's item
    ``status``). A whole answer with nothing said is one empty message; a cut one is no message (OpenAI's
    ``output: []``, or the reasoning alone), not an invented empty one."""
    choice = (chat.get("choices") or [{}])[0]
    msg = choice.get("message") or {}
    incomplete = FINISH_TO_INCOMPLETE.get(choice.get("finish_reason"))
    output = []
    if reasoning := reasoning_of(msg):
        output.append(reasoning_item(ctx, reasoning))
    if msg.get("content") or msg.get("refusal") or not (msg.get("tool_calls") or incomplete):
        output.append(message_item(ctx, msg.get("content") or "", refusal=msg.get("refusal"),
                                   logprobs=(choice.get("logprobs") or {}).get("content")))
    for k, call in enumerate(msg.get("tool_calls") or []):
        fn = call.get("function") or {}
        output.append(function_call_item(ctx, k, call.get("id"), fn.get("name", ""), fn.get("arguments") or ""))
    if incomplete and output:
        output[-1]["status"] = "incomplete"
    return response_object(ctx, "incomplete" if incomplete else "completed", output, usage_of(chat.get("usage")),
                           incomplete=incomplete)
