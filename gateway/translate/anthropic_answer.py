"""An Anthropic backend's answer as chat completions, so that the attempt loop, the ledger and observability read one
format whoever answered (``gateway/backends/anthropic.py``); the HTTP layer renders it back as Anthropic's
(``gateway/translate/anthropic.py``). Text, tool calls, stop reasons, the stop sequence matched and usage survive
the round trip; a streamed ``thinking`` block becomes the chat deltas' reasoning (its signature and a
``redacted_thinking`` block: ``ChoiceDelta``'s own fields for them). A whole answer also keeps the
upstream's own content blocks and usage (``NATIVE``), which a ``/v1/messages`` client gets as they were: thinking
blocks with their signatures (Anthropic refuses a tool-use turn without them), redacted thinking, the blocks'
order, the cache-write count.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import msgspec

from gateway.errors import ANTHROPIC_TYPE_STATUS
from gateway.sse import EventReader
from gateway.values import DONE, MALFORMED, ChatEvent, ChatStream, ChoiceDelta, ToolCallDelta

_FINISH = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length", "tool_use": "tool_calls",
           "pause_turn": "stop", "refusal": "content_filter"}


def counted(u: dict | None) -> bool:
    """Whether Anthropic's ``usage`` ``u`` holds a count (``input_tokens`` or ``output_tokens``; a proxy may drop
    them, and 0 tokens would bill nothing)."""
    return bool(u) and (u.get("input_tokens") is not None or u.get("output_tokens") is not None)


def _usage(u: dict | None) -> dict | None:
    """Anthropic's ``usage`` -> chat's: ``prompt_tokens`` the whole input (``input_tokens`` plus the cache reads and
    writes), the reads as ``prompt_tokens_details.cached_tokens``, the writes as ``cache_creation_input_tokens``
    (LiteLLM's name for them in a chat usage; ``anthropic._usage`` gives them back). None when the upstream counted
    nothing (no ``input_tokens`` or ``output_tokens``): the gateway then counts the answer and marks its record
    estimated, as for any backend that gives no usage (0 tokens would bill nothing)."""
    if not counted(u):
        return None
    written = int(u.get("cache_creation_input_tokens") or 0)
    prompt = int(u.get("input_tokens") or 0) + int(u.get("cache_read_input_tokens") or 0) + written
    out = {"prompt_tokens": prompt, "completion_tokens": int(u.get("output_tokens") or 0)}
    out["total_tokens"] = out["prompt_tokens"] + out["completion_tokens"]
    if u.get("cache_read_input_tokens"):
        out["prompt_tokens_details"] = {"cached_tokens": int(u["cache_read_input_tokens"])}
    if written:
        out["cache_creation_input_tokens"] = written
    return out


# The key of a chat answer that holds its Anthropic upstream's own Message (``content``, ``usage``, ``stop_reason``,
# ``stop_sequence``): rendered back as they were for a ``/v1/messages`` client (``anthropic.chat_to_message``).
NATIVE = "anthropic_message"


def message_to_chat(msg: dict) -> dict:
    """Anthropic's Message object (parsed JSON) -> a chat completion with one choice (and the Message's own blocks
    and usage under ``NATIVE``)."""
    text = "".join(b.get("text", "") for b in msg.get("content") or () if b.get("type") == "text")
    # the arguments keep their characters, as a stream's partial_json gives them (not \u escapes)
    calls = [{"id": b.get("id"), "type": "function", "function": {
        "name": b.get("name"), "arguments": json.dumps(b.get("input") or {}, separators=(",", ":"),
                                                       ensure_ascii=False)}}
        for b in msg.get("content") or () if b.get("type") == "tool_use"]
    message: dict = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    choice = {"index": 0, "message": message, "finish_reason": _FINISH.get(msg.get("stop_reason"), "stop"),
              "stop_reason": msg.get("stop_sequence")}
    native = {k: msg.get(k) for k in ("content", "usage", "stop_reason", "stop_sequence")}
    return {"id": msg.get("id"), "object": "chat.completion", "created": 0, "model": msg.get("model"),
            "choices": [choice], "usage": _usage(msg.get("usage")), NATIVE: native}


class ChatChunks:
    """Anthropic's stream events (parsed data, in order) -> ``ChatEvent`` values, as a chat stream says them."""

    def __init__(self):
        self.id, self.model = "", ""
        self.usage: dict = {}
        self.tools: dict[int, int] = {}      # content block index -> tool call index
        self.argued: set[int] = set()        # tool blocks whose arguments have had a character

    def _event(self, choice: ChoiceDelta) -> ChatEvent:
        return ChatEvent((choice,), id=self.id, model=self.model, created=0, object="chat.completion.chunk")

    def event(self, ev: dict) -> list[ChatEvent]:
        """The events one Anthropic event makes (none for ``ping``, ``message_stop`` and block ends, but that of a
        tool call which streamed no input: its ``"{}"``)."""
        kind = ev.get("type")
        if kind == "message_start":
            msg = ev.get("message") or {}
            self.id, self.model = msg.get("id") or "", msg.get("model") or ""
            self.usage = dict(msg.get("usage") or {})
            return [self._event(ChoiceDelta(0, role="assistant", content=""))]
        if kind == "content_block_start":
            block = ev.get("content_block") or {}
            if block.get("type") == "tool_use":
                k = self.tools[ev.get("index", 0)] = len(self.tools)
                call = ToolCallDelta(k, block.get("id"), "function", block.get("name"), "")
                return [self._event(ChoiceDelta(0, tool_calls=(call,)))]
            if block.get("type") == "text" and block.get("text"):
                return [self._event(ChoiceDelta(0, content=block["text"]))]
            if block.get("type") == "redacted_thinking":
                return [self._event(ChoiceDelta(0, redacted_reasoning=block.get("data") or ""))]
            return []
        if kind == "content_block_delta":
            d = ev.get("delta") or {}
            if d.get("type") == "text_delta":
                return [self._event(ChoiceDelta(0, content=d.get("text", "")))]
            if d.get("type") == "thinking_delta" and d.get("thinking"):
                return [self._event(ChoiceDelta(0, reasoning=d["thinking"]))]
            if d.get("type") == "signature_delta" and d.get("signature"):
                return [self._event(ChoiceDelta(0, reasoning_signature=d["signature"]))]
            if d.get("type") == "input_json_delta" and ev.get("index") in self.tools:
                if d.get("partial_json"):
                    self.argued.add(ev["index"])
                call = ToolCallDelta(self.tools[ev["index"]], arguments=d.get("partial_json", ""))
                return [self._event(ChoiceDelta(0, tool_calls=(call,)))]
            return []
        if kind == "content_block_stop" and ev.get("index") in self.tools and ev["index"] not in self.argued:
            # a call without input streams no JSON: its arguments are "{}", as OpenAI's and the whole answer's
            self.argued.add(ev["index"])
            call = ToolCallDelta(self.tools[ev["index"]], arguments="{}")
            return [self._event(ChoiceDelta(0, tool_calls=(call,)))]
        if kind == "message_delta":
            d = ev.get("delta") or {}
            self.usage.update({k: v for k, v in (ev.get("usage") or {}).items() if v is not None})
            finish = self._event(ChoiceDelta(0, finish_reason=_FINISH.get(d.get("stop_reason"), "stop"),
                                             stop_reason=d.get("stop_sequence")))
            if (usage := _usage(self.usage)) is None:     # counted by the gateway at the stream's end
                return [finish]
            return [finish, ChatEvent((), usage, id=self.id, model=self.model, created=0,
                                      object="chat.completion.chunk")]
        return []


async def chat_events(events: AsyncIterator[bytes]) -> ChatStream:
    """An Anthropic SSE byte stream -> a ``ChatStream`` (each Anthropic event decoded once) ending in ``DONE`` at
    ``message_stop``; an ``error`` event becomes an error event with OpenAI's error object. Closing it closes
    ``events``."""
    reader, state = EventReader(), ChatChunks()
    try:
        async for chunk in events:
            reader.feed(chunk)
            out: list[ChatEvent] = []
            while (item := reader.pop()) is not None:
                try:
                    ev = msgspec.json.decode(item[1])
                except msgspec.DecodeError:
                    ev = None
                if not isinstance(ev, dict):     # judged as an OpenAI upstream's is (a trial's was dropped silently)
                    out.append(MALFORMED)
                    continue
                if ev.get("type") == "error":   # its status by its type: judged as that status's answer would be
                    err = ev.get("error") or {}
                    kind = err.get("type", "api_error")
                    out.append(ChatEvent(error={"message": err.get("message", "upstream error"), "type": kind,
                                                "param": None, "code": ANTHROPIC_TYPE_STATUS.get(kind)}))
                    continue
                out += state.event(ev)
                if ev.get("type") == "message_stop":
                    out.append(DONE)
            yield out
    finally:
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()
