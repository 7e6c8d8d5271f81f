"""Anthropic Messages <-> OpenAI chat completions, as pure functions: a ``/v1/messages`` body becomes the chat body
the rest of the gateway serves (``messages_to_chat``), and the chat answer (JSON, or the SSE stream) becomes the
Messages JSON (``chat_to_message``) or Anthropic's typed events (``MessageEvents``, ``message_events``), which
``gateway/translate/anthropic_render.py`` (``MessagesRender``, the refusals' paths) hands the HTTP layer.

Mapping (https://docs.anthropic.com/en/api/messages):
- ``system`` (string or text blocks) -> a leading system message; ``stop_sequences`` -> ``stop``;
  ``metadata.user_id`` / ``metadata.user`` -> ``user`` (the canary key); ``max_tokens``, ``temperature``, ``top_p``,
  ``top_k`` as they are; ``tools[].input_schema`` -> function ``parameters``; ``tool_choice`` auto/any/tool/none ->
  "auto"/"required"/{function}/"none"; ``disable_parallel_tool_use`` -> ``parallel_tool_calls: false``;
  ``output_config.format`` json_schema -> ``response_format`` json_schema; service hints (``cache_control``,
  ``service_tier``, ``thinking``, ``output_config.effort``, ...) dropped once checked.
- content blocks: ``text`` -> text parts; ``image`` -> ``image_url`` parts (a base64 source as a data URL): a
  target that cannot take images refuses them with its 400; ``tool_use`` (assistant) -> ``tool_calls``;
  ``tool_result`` (user; first in its message, as Anthropic requires) -> ``tool`` messages, in block order; a
  tool result's images -> ``image_url`` parts of the user message after them (chat's tool messages take text only).
- answer: ``finish_reason`` stop/length/tool_calls -> ``stop_reason`` end_turn (stop_sequence when the backend
  names the stop string it matched)/max_tokens/tool_use; a refusal (chat's ``refusal`` text, its
  ``content_filter`` finish) -> a text block of that text and ``stop_reason`` ``refusal``; tool call arguments ->
  ``input`` as far as they begin a JSON object (``anthropic_json.py``); usage prompt/completion -> input/output
  tokens, the cached prompt tokens as ``cache_read_input_tokens`` and out of ``input_tokens`` (Anthropic's
  convention). A stream's ``message_start`` carries the usage of the backend's first chunk when it has one (the
  local engine's, asked for ``continuous_usage_stats`` by ``gateway/backends/dispatch.py``: the split of the final
  usage), else the gateway's prompt count, all of it ``input_tokens``; its ``message_delta`` the backend's usage,
  which the SDKs' final message takes.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import msgspec

from gateway.errors import anthropic_error_body
from gateway.sse import named_event
from gateway.translate.anthropic_checks import (bad_request, check_block, check_hints, check_keys, check_message,
                                                check_metadata, check_output_config, check_sampling, check_thinking,
                                                check_text, check_tool, check_tool_choice, check_tool_results,
                                                check_thread, check_tools_defined, missing_or_wrong)
from gateway.translate.anthropic_answer import NATIVE, counted
from gateway.translate.anthropic_json import ObjectPrefix, tool_input
from gateway.translate.chat import reasoning_of
from gateway.translate.tool_calls import ToolCallOrder
from gateway.values import ChatEvent, ChatStream

_FINISH = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "function_call": "tool_use",
           "content_filter": "refusal"}
_SAMPLING = ("max_tokens", "temperature", "top_p", "top_k", "stream")
# Messages fields the translation reads (``priority``: the gateway's own), and those it drops because they
# are hints about Anthropic's service (caching, tiers, geography, reasoning effort, when to clear old tool
# results) that do not change what a chat backend must answer; any other field is refused, as Anthropic refuses
# extra inputs.
_KNOWN = frozenset({"model", "messages", "system", "max_tokens", "metadata", "stop_sequences", "stream",
                    "temperature", "top_p", "top_k", "tools", "tool_choice", "output_config", "priority"})
_DROPPED = frozenset({"service_tier", "cache_control", "diagnostics", "inference_geo", "speed", "thinking",
                      "user_profile_id", "workspace_id", "context_management"})
# Fields that give the model tools run on Anthropic's side, which no chat backend runs (as server tools in
# ``tools``): refused when they ask for any, since dropping them would answer as if the tools had been offered.
_SERVER_SIDE = {"mcp_servers": "MCP servers are not supported (the gateway runs no MCP client); define their tools "
                               "in `tools` and run them in the client",
                "container": "containers are not supported (no code execution or skills run here)"}


def _text_of(blocks: object, param: str) -> str:
    """The text of ``system`` or a ``tool_result``'s content: a string, or text blocks joined by newlines."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise bad_request(f"{param}: must be a string or an array of text blocks", param)
    out = []
    for i, b in enumerate(blocks):
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
            raise bad_request(f"{param}.{i}: only text blocks are supported here", f"{param}.{i}")
        check_keys(b, "text", f"{param}.{i}")
        out.append(b["text"])
    return "\n".join(out)


def _tool_result(content: object, param: str) -> tuple[str, list[dict]]:
    """A ``tool_result``'s content -> (its text, its images as chat ``image_url`` parts). Chat's tool messages
    carry text only (OpenAI's API refuses other parts there), so the images go to the user message that follows
    the tool messages, which every OpenAI-compatible backend that takes images reads."""
    if isinstance(content, str):
        return content, []
    if not isinstance(content, list):
        raise bad_request(f"{param}: must be a string or an array of text and image blocks", param)
    texts, images = [], []
    for i, b in enumerate(content):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind not in ("text", "image") or kind == "text" and not isinstance(b.get("text"), str):
            raise bad_request(f"{param}.{i}: only text and image blocks are supported here", f"{param}.{i}")
        check_keys(b, kind, f"{param}.{i}")
        if kind == "image":
            images.append(_image_part(b, f"{param}.{i}"))
        else:
            texts.append(b["text"])
    return "\n".join(texts), images


def _image_part(block: dict, param: str) -> dict:
    src = block.get("source")
    if not isinstance(src, dict):
        raise bad_request(f"{param}.source: Field required", f"{param}.source")
    if src.get("type") == "base64":
        return {"type": "image_url", "image_url": {"url": f"data:{src.get('media_type')};base64,{src.get('data')}"}}
    if src.get("type") == "url":
        return {"type": "image_url", "image_url": {"url": src.get("url")}}
    raise bad_request(f"{param}.source.type: must be 'base64' or 'url'", f"{param}.source.type")


def turn_to_chat(m: object, i: int, last: bool = False) -> list[dict]:
    """Messages turn ``i`` (``m``; ``last``: the final turn) -> its chat messages (a user turn with tool results
    becomes tool messages + a user one). Raises ClientError(400) naming the block (``messages.i.content.j``) chat
    cannot take or of another shape than Anthropic's, or an empty turn or text (Anthropic's rule: every turn but a
    final assistant one, a prefill to continue, has content, and text is not empty or whitespace alone)."""
    p = f"messages.{i}"
    check_message(m, i)
    role, content = m["role"], m.get("content")
    if content in ("", []) and not (last and role == "assistant"):
        raise bad_request(f"{p}: all messages must have non-empty content except for the optional final assistant "
                          "message", f"{p}.content")
    if isinstance(content, str):
        if content:                        # "" only as the final assistant turn's (checked above)
            check_text(content, f"{p}.content")
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise bad_request(f"{p}.content: must be a string or an array of content blocks", f"{p}.content")
    parts: list[dict] = []
    calls: list[dict] = []
    results: list[dict] = []
    result_images: list[dict] = []        # images of tool results: the user message after the tool messages
    for j, b in enumerate(content):
        bp = f"{p}.content.{j}"
        kind = check_block(b, bp, role)     # a type this role's message takes, of Anthropic's shape
        if kind == "text":
            parts.append({"type": "text", "text": b["text"]})
        elif kind == "image":
            parts.append(_image_part(b, bp))
        elif kind == "tool_use":
            calls.append({"id": b["id"], "type": "function", "function": {
                "name": b["name"], "arguments": json.dumps(b["input"], separators=(",", ":"))}})
        elif kind == "tool_result":
            text, images = _tool_result(b.get("content") or "", f"{bp}.content")
            results.append({"role": "tool", "tool_call_id": b.get("tool_use_id"),
                            "content": f"Error: {text}" if b.get("is_error") else text})
            result_images += images
        # thinking, redacted_thinking: the previous turn's reasoning, no chat counterpart: dropped
    out = list(results)
    parts = result_images + parts
    if role == "assistant":
        text = "".join(x["text"] for x in parts)
        msg: dict = {"role": "assistant", "content": text or None}
        if calls:
            msg["tool_calls"] = calls
        if text or calls:
            out.append(msg)
    elif parts:
        simple = all(x["type"] == "text" for x in parts)
        out.append({"role": "user", "content": "\n".join(x["text"] for x in parts) if simple else parts})
    return out


def _tools(tools: object) -> list[dict]:
    if not isinstance(tools, list):
        raise bad_request("tools: must be an array", "tools")
    out = []
    for i, t in enumerate(tools):
        check_tool(t, i)
        fn = {"name": t["name"], "parameters": t["input_schema"]}
        if t.get("description"):
            fn["description"] = t["description"]
        if isinstance(t.get("strict"), bool):     # both APIs' strict tool use: the arguments follow the schema
            fn["strict"] = t["strict"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(tc: object) -> tuple[object, bool]:
    """``tool_choice`` -> (chat tool_choice, parallel tool calls allowed)."""
    check_tool_choice(tc)
    kind = tc["type"]
    choice = ({"type": "function", "function": {"name": tc.get("name")}} if kind == "tool"
              else {"auto": "auto", "any": "required", "none": "none"}[kind])
    return choice, not tc.get("disable_parallel_tool_use")


def messages_to_chat(body: dict, count_only: bool = False) -> dict:
    """A ``/v1/messages`` body (parsed JSON object) -> the equivalent chat completions body. ``count_only``: the
    ``/v1/messages/count_tokens`` body (no ``max_tokens``). Sampling values keep their names, so the shared range
    checks of chat validation name the same fields.

    Raises:
        ClientError: 400 naming the field (Anthropic's dotted path) for a missing or malformed one.
    """
    check_thread(body)
    for name in body:
        if name in _SERVER_SIDE:
            if body[name]:
                raise bad_request(f"{name}: {_SERVER_SIDE[name]}", name)
        elif name not in _KNOWN and name not in _DROPPED:
            raise bad_request(f"{name}: Extra inputs are not permitted", name)
    check_hints(body)
    if not isinstance(body.get("model"), str):
        raise bad_request(missing_or_wrong(body, "model", "a string"), "model")
    mt = body.get("max_tokens")
    if not count_only and (not isinstance(mt, int) or isinstance(mt, bool)):
        raise bad_request(missing_or_wrong(body, "max_tokens", "an integer"), "max_tokens")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad_request(missing_or_wrong(body, "messages", "a non-empty array"), "messages")
    chat: list[dict] = []
    if body.get("system"):
        chat.append({"role": "system", "content": _text_of(body["system"], "system")})
    for i, m in enumerate(msgs):
        chat.extend(turn_to_chat(m, i, last=i == len(msgs) - 1))
    check_tool_results(msgs)
    check_tools_defined(body)
    check_sampling(body)
    check_thinking(body)
    check_metadata(body)
    out: dict = {"model": body["model"], "messages": chat}
    if chat[-1]["role"] == "assistant" and not chat[-1].get("tool_calls"):
        # a prefill: Anthropic continues the last assistant turn; vLLM's chat fields for the same
        if isinstance(chat[-1].get("content"), str) and chat[-1]["content"] != chat[-1]["content"].rstrip():
            raise bad_request("messages: final assistant content cannot end with trailing whitespace", "messages")
        out["continue_final_message"], out["add_generation_prompt"] = True, False
    for k in _SAMPLING:
        if body.get(k) is not None:
            out[k] = body[k]
    if count_only:
        out.pop("max_tokens", None)
    if body.get("stop_sequences"):
        if not isinstance(body["stop_sequences"], list):
            raise bad_request("stop_sequences: must be an array of strings", "stop_sequences")
        for k, s in enumerate(body["stop_sequences"]):   # named here: chat's check would name its "stop"
            if not isinstance(s, str) or not s:
                raise bad_request(f"stop_sequences.{k}: must be a non-empty string, got {s!r}", f"stop_sequences.{k}")
        out["stop"] = body["stop_sequences"]
    meta = body.get("metadata")
    if isinstance(meta, dict) and isinstance(meta.get("user_id") or meta.get("user"), str):
        out["user"] = meta.get("user_id") or meta.get("user")
    if body.get("priority") is not None:
        out["priority"] = body["priority"]
    if body.get("tools"):
        out["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        out["tool_choice"], parallel = _tool_choice(body["tool_choice"])
        if not parallel and body.get("tools"):   # without tools there is nothing to run in parallel
            out["parallel_tool_calls"] = False
    if (schema := check_output_config(body)) is not None:
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "strict": True,
                                                                          "schema": schema}}
    if body.get("stream"):
        out["stream_options"] = {"include_usage": True}   # message_delta reports the usage
    return out


def _stop(choice: dict, stop_sequences: list | None) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) of a chat choice's finish."""
    return _stop_of(choice.get("finish_reason"), choice.get("stop_reason"), stop_sequences)


def _stop_of(finish, matched, stop_sequences: list | None) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) of a finish reason and the stop vLLM (and the local engine) name as matched."""
    if finish == "stop" and isinstance(matched, str) and matched in (stop_sequences or ()):
        return "stop_sequence", matched
    return (_FINISH.get(finish, "end_turn") if finish else None), None


def _final_stop(stop_reason: str | None, has_calls: bool, refused: bool) -> str | None:
    """The stop reason of a reply that ended on its own (chat's ``stop``, ``tool_calls``, or no reason yet):
    ``refusal`` when the backend refused (chat's ``refusal`` text; its ``content_filter`` finish is ``refusal``
    already), else ``tool_use`` with tool calls (``has_calls``). Any other reason stays as it is: a reply cut by
    ``max_tokens`` inside a call stays ``max_tokens`` (its last call is partial: a client must not run it)."""
    if stop_reason not in (None, "end_turn"):
        return stop_reason
    return "refusal" if refused else "tool_use" if has_calls else stop_reason


def _usage(u: dict | None) -> dict:
    """Chat ``usage`` -> Anthropic's. Chat's ``prompt_tokens`` counts the cached prefix too; Anthropic's
    ``input_tokens`` does not (the whole input is ``input_tokens + cache_read_input_tokens +
    cache_creation_input_tokens``), so the cached tokens move from one to the other, never counted twice. Both
    cache fields are always present, 0 when nothing was cached or written, as Anthropic's own answers carry them
    (clients add them up: ``None`` would break that); the writes are an Anthropic upstream's
    (``anthropic_answer._usage``: ``cache_creation_input_tokens``, LiteLLM's name in a chat usage)."""
    u = u or {}
    cached = int((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    written = int(u.get("cache_creation_input_tokens") or 0)
    return {"input_tokens": max(int(u.get("prompt_tokens") or 0) - cached - written, 0),
            "output_tokens": int(u.get("completion_tokens") or 0),
            "cache_creation_input_tokens": written, "cache_read_input_tokens": cached}


def tool_use_id(call_id: str | None) -> str | None:
    """Anthropic's ``tool_use`` id for a chat tool call's: ``toolu_`` in place of OpenAI's ``call_`` (as Anthropic
    writes them; a client may check). The id round-trips as it is: a ``tool_result`` naming it goes back as the
    chat ``tool_call_id``, and the assistant turn's ``tool_use`` as its call's id, so the pair still matches."""
    return "toolu_" + call_id[len("call_"):] if call_id and call_id.startswith("call_") else call_id


def _native_message(native: dict, chat: dict, message_id: str, model: str) -> dict:
    """The Message of a ``type: anthropic`` upstream's answer (``anthropic_answer.NATIVE``) under this request's id
    and model: its blocks, stop and usage as it sent them, its ``tool_use`` ids those of the chat answer's calls in
    order (a cache hit's are its own: ``gateway/cache/response_cache.py``); the usage the chat answer's (the gateway's
    count, estimated) where the upstream's counted nothing."""
    calls = iter(((chat.get("choices") or [{}])[0].get("message") or {}).get("tool_calls") or ())
    content = [{**b, "id": tool_use_id(next(calls, {}).get("id") or b.get("id"))} if b.get("type") == "tool_use"
               else b for b in native.get("content") or () if isinstance(b, dict)]
    usage = native.get("usage") if counted(native.get("usage")) else _usage(chat.get("usage"))
    usage = {"cache_creation_input_tokens": 0, "cache_read_input_tokens": 0, **usage}
    return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": native.get("stop_reason"), "stop_sequence": native.get("stop_sequence"), "usage": usage}


def chat_to_message(chat: dict, message_id: str, model: str, stop_sequences: list | None = None) -> dict:
    """A chat completion (parsed JSON, first choice) -> Anthropic's Message object; an Anthropic upstream's own
    Message, when the answer carries it (``NATIVE``), as it was (``_native_message``)."""
    if isinstance(native := chat.get(NATIVE), dict):
        return _native_message(native, chat, message_id, model)
    choice = (chat.get("choices") or [{}])[0]
    msg = choice.get("message") or {}
    content: list[dict] = []
    if thinking := reasoning_of(msg):
        content.append({"type": "thinking", "thinking": thinking, "signature": ""})
    if msg.get("content"):
        content.append({"type": "text", "text": msg["content"]})
    if refusal := msg.get("refusal"):     # its own text block, as the stream has it (MessageEvents)
        content.append({"type": "text", "text": str(refusal)})
    for call in msg.get("tool_calls") or ():
        fn = call.get("function") or {}
        content.append({"type": "tool_use", "id": tool_use_id(call.get("id")), "name": fn.get("name"),
                        "input": tool_input(fn.get("arguments"))})
    stop_reason, stop_sequence = _stop(choice, stop_sequences)
    stop_reason = _final_stop(stop_reason, bool(msg.get("tool_calls")), bool(refusal))
    return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": _usage(chat.get("usage"))}


class MessageEvents:
    """Chat completion chunks (parsed JSON, in order) -> Anthropic's stream events as (event name, data) pairs:
    ``message_start`` and a ``ping`` first, then per content block ``content_block_start``, its
    ``content_block_delta`` events (``thinking_delta`` for the chat deltas' ``reasoning_content``, ``text_delta``
    for ``content`` and, in a text block of its own, ``refusal``, ``input_json_delta``) and ``content_block_stop``,
    one block after another (tool calls whose argument pieces interleave are put in order by
    ``gateway/translate/tool_calls.py``; their arguments as far as they can begin a JSON object:
    ``gateway/translate/anthropic_json.py``); ``finish()``
    gives the final ``message_delta`` (stop reason, usage) and ``message_stop``."""

    def __init__(self, message_id: str, model: str, input_tokens: int, stop_sequences: list | None = None):
        self.message_id, self.model, self.stop_sequences = message_id, model, stop_sequences
        self.input_tokens = input_tokens
        self.started = False
        self.block = -1                  # index of the open block (-1: none yet)
        self.open_kind: str | None = None      # the open block's kind: "text", "refusal" (a text block), "thinking"
        self.tools = ToolCallOrder()           # the tool_use blocks, one open at a time, in order
        self.arguments = ObjectPrefix()        # the open tool_use block's arguments, kept while valid
        self.refused = False
        self.tool_calls = 0
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None
        self.usage: dict | None = None

    def _start(self) -> list[tuple[str, dict]]:
        """``message_start`` (and a ``ping``): its usage the first chunk's when it carries one (a backend asked for
        usage on every chunk: the prompt's cached tokens as the final usage splits them), else the gateway's count."""
        self.started = True
        usage = _usage(self.usage) if self.usage else {           # Anthropic's fields, all
            "input_tokens": self.input_tokens, "output_tokens": 0, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0}
        message = {"id": self.message_id, "type": "message", "role": "assistant", "model": self.model,
                   "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage}
        return [("message_start", {"type": "message_start", "message": message}), ("ping", {"type": "ping"})]

    def _close(self) -> list[tuple[str, dict]]:
        """Close the open text or thinking block."""
        if self.open_kind is None:
            return []
        self.open_kind = None
        return [("content_block_stop", {"type": "content_block_stop", "index": self.block})]

    def _open(self, block: dict) -> list[tuple[str, dict]]:
        out = self._close() + self._calls(self.tools.flush())
        self.block += 1
        self.open_kind = block["type"]
        return out + [("content_block_start", {"type": "content_block_start", "index": self.block,
                                               "content_block": block})]

    def _calls(self, actions: list[tuple]) -> list[tuple[str, dict]]:
        """The events of ``ToolCallOrder``'s actions: one ``tool_use`` block opened, streamed, closed."""
        out: list[tuple[str, dict]] = []
        for action, call, *piece in actions:
            if action == "open":
                self.block += 1
                self.tool_calls += 1
                self.arguments = ObjectPrefix()
                out.append(("content_block_start", {"type": "content_block_start", "index": self.block,
                                                     "content_block": {"type": "tool_use",
                                                                       "id": tool_use_id(call.id),
                                                                       "name": call.name, "input": {}}}))
            elif action == "args":
                if kept := self.arguments.feed(piece[0]):
                    out.append(("content_block_delta", {"type": "content_block_delta", "index": self.block,
                                                         "delta": {"type": "input_json_delta",
                                                                   "partial_json": kept}}))
            else:
                out.append(("content_block_stop", {"type": "content_block_stop", "index": self.block}))
        return out

    def _delta(self, kind: str, delta: dict) -> list[tuple[str, dict]]:
        """A text, refusal or thinking delta, in a block of its kind (opened when another kind is open)."""
        out: list[tuple[str, dict]] = []
        if self.open_kind != kind:
            empty = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" \
                else {"type": "text", "text": ""}
            out += self._open(empty)
            self.open_kind = kind
        return out + [("content_block_delta", {"type": "content_block_delta", "index": self.block, "delta": delta})]

    def chunk(self, ev: ChatEvent) -> list[tuple[str, dict]]:
        """The events one chat stream event makes (its first choice)."""
        if ev.usage:
            self.usage = ev.usage
        out = [] if self.started else self._start()
        for choice in ev.choices[:1]:
            if choice.reasoning:
                out += self._delta("thinking", {"type": "thinking_delta", "thinking": choice.reasoning})
            if choice.reasoning_signature:   # an Anthropic upstream's: closes its thinking block
                out += self._delta("thinking", {"type": "signature_delta", "signature": choice.reasoning_signature})
            if choice.redacted_reasoning is not None:
                out += self._open({"type": "redacted_thinking", "data": choice.redacted_reasoning}) + self._close()
            if choice.content:
                out += self._delta("text", {"type": "text_delta", "text": choice.content})
            if choice.refusal:
                self.refused = True
                out += self._delta("refusal", {"type": "text_delta", "text": choice.refusal})
            for call in choice.tool_calls:
                out += self._close() + self._calls(self.tools.feed(call))
            if choice.finish_reason:
                self.stop_reason, self.stop_sequence = _stop_of(choice.finish_reason, choice.stop_reason,
                                                                self.stop_sequences)
        return out

    def finish(self) -> list[tuple[str, dict]]:
        """The closing events (after the last chunk)."""
        out = ([] if self.started else self._start()) + self._close() + self._calls(self.tools.flush())
        usage = _usage(self.usage) if self.usage else {"input_tokens": self.input_tokens, "output_tokens": 0}
        self.stop_reason = _final_stop(self.stop_reason, self.tool_calls > 0, self.refused)
        out.append(("message_delta", {"type": "message_delta",
                                      "delta": {"stop_reason": self.stop_reason or "end_turn",
                                                "stop_sequence": self.stop_sequence}, "usage": usage}))
        out.append(("message_stop", {"type": "message_stop"}))
        return out


def _encode(events: list[tuple[str, dict]]) -> bytes:
    return b"".join(named_event(name, msgspec.json.encode(data)) for name, data in events)


async def message_events(chunks: ChatStream, events: MessageEvents) -> AsyncIterator[bytes]:
    """A chat stream's events -> Anthropic's SSE byte stream (events named). An error event of the chat stream
    becomes Anthropic's ``error`` event and ends the stream. Closing this generator closes ``chunks``."""
    try:
        async for batch in chunks:
            out: list[tuple[str, dict]] = []
            for ev in batch:
                if ev.done:
                    continue
                if ev.error:
                    err = ev.error if isinstance(ev.error, dict) else {"message": str(ev.error)}
                    yield _encode(out) + named_event("error", anthropic_error_body(
                        502, str(err.get("message") or "upstream error"), "api_error"))
                    return
                out += events.chunk(ev)
            if out:
                yield _encode(out)
        yield _encode(events.finish())
    finally:
        aclose = getattr(chunks, "aclose", None)
        if aclose is not None:
            await aclose()

