"""An Anthropic backend's answer as chat completions, so that the attempt loop, the ledger and observability read one
format whoever answered (``gateway/backends/anthropic.py``); the HTTP layer renders it back as Anthropic's
(``gateway/translate/anthropic.py``). Text, tool calls, stop reasons, the stop sequence matched and usage survive
the round trip; blocks chat has no field for (``thinking``) are dropped.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import msgspec

from gateway.sse import DONE, EventReader, event

_FINISH = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length", "tool_use": "tool_calls",
           "pause_turn": "stop", "refusal": "content_filter"}


def _usage(u: dict | None) -> dict:
    u = u or {}
    prompt = int(u.get("input_tokens") or 0) + int(u.get("cache_read_input_tokens") or 0) \
        + int(u.get("cache_creation_input_tokens") or 0)
    out = {"prompt_tokens": prompt, "completion_tokens": int(u.get("output_tokens") or 0)}
    out["total_tokens"] = out["prompt_tokens"] + out["completion_tokens"]
    if u.get("cache_read_input_tokens"):
        out["prompt_tokens_details"] = {"cached_tokens": int(u["cache_read_input_tokens"])}
    return out


def message_to_chat(msg: dict) -> dict:
    """Anthropic's Message object (parsed JSON) -> a chat completion with one choice."""
    text = "".join(b.get("text", "") for b in msg.get("content") or () if b.get("type") == "text")
    calls = [{"id": b.get("id"), "type": "function", "function": {
        "name": b.get("name"), "arguments": json.dumps(b.get("input") or {}, separators=(",", ":"))}}
        for b in msg.get("content") or () if b.get("type") == "tool_use"]
    message: dict = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    choice = {"index": 0, "message": message, "finish_reason": _FINISH.get(msg.get("stop_reason"), "stop"),
              "stop_reason": msg.get("stop_sequence")}
    return {"id": msg.get("id"), "object": "chat.completion", "created": 0, "model": msg.get("model"),
            "choices": [choice], "usage": _usage(msg.get("usage"))}


class ChatChunks:
    """Anthropic's stream events (parsed data, in order) -> chat completion chunks (dicts)."""

    def __init__(self):
        self.id, self.model = "", ""
        self.usage: dict = {}
        self.tools: dict[int, int] = {}      # content block index -> tool call index

    def _chunk(self, delta: dict, finish: str | None = None, **extra) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk", "created": 0, "model": self.model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish, **extra}]}

    def event(self, ev: dict) -> list[dict]:
        """The chunks one event makes (none for ``ping``, block ends and ``message_stop``)."""
        kind = ev.get("type")
        if kind == "message_start":
            msg = ev.get("message") or {}
            self.id, self.model = msg.get("id") or "", msg.get("model") or ""
            self.usage = dict(msg.get("usage") or {})
            return [self._chunk({"role": "assistant", "content": ""})]
        if kind == "content_block_start":
            block = ev.get("content_block") or {}
            if block.get("type") == "tool_use":
                k = self.tools[ev.get("index", 0)] = len(self.tools)
                return [self._chunk({"tool_calls": [{"index": k, "id": block.get("id"), "type": "function",
                                                     "function": {"name": block.get("name"), "arguments": ""}}]})]
            if block.get("type") == "text" and block.get("text"):
                return [self._chunk({"content": block["text"]})]
            return []
        if kind == "content_block_delta":
            d = ev.get("delta") or {}
            if d.get("type") == "text_delta":
                return [self._chunk({"content": d.get("text", "")})]
            if d.get("type") == "input_json_delta" and ev.get("index") in self.tools:
                return [self._chunk({"tool_calls": [{"index": self.tools[ev["index"]],
                                                     "function": {"arguments": d.get("partial_json", "")}}]})]
            return []
        if kind == "message_delta":
            d = ev.get("delta") or {}
            self.usage.update({k: v for k, v in (ev.get("usage") or {}).items() if v is not None})
            finish = self._chunk({}, _FINISH.get(d.get("stop_reason"), "stop"), stop_reason=d.get("stop_sequence"))
            usage = {"id": self.id, "object": "chat.completion.chunk", "created": 0, "model": self.model,
                     "choices": [], "usage": _usage(self.usage)}
            return [finish, usage]
        return []


async def chat_chunks(events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """An Anthropic SSE byte stream -> a chat completions SSE byte stream ending in ``[DONE]`` at
    ``message_stop``; an ``error`` event becomes OpenAI's error event. Closing it closes ``events``."""
    reader, state = EventReader(), ChatChunks()
    try:
        async for chunk in events:
            reader.feed(chunk)
            out = []
            while (item := reader.pop()) is not None:
                try:
                    ev = msgspec.json.decode(item[1])
                except msgspec.DecodeError:
                    continue
                if not isinstance(ev, dict):
                    continue
                if ev.get("type") == "error":
                    err = ev.get("error") or {}
                    out.append(event(msgspec.json.encode({"error": {
                        "message": err.get("message", "upstream error"), "type": err.get("type", "api_error"),
                        "param": None, "code": None}})))
                    continue
                out += [event(msgspec.json.encode(c)) for c in state.event(ev)]
                if ev.get("type") == "message_stop":
                    out.append(DONE)
            if out:
                yield b"".join(out)
    finally:
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()
