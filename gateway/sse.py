"""Server-sent events (https://html.spec.whatwg.org/multipage/server-sent-events.html): the gateway's one SSE
codec. ``EventReader`` splits raw bytes (any split, CRLF or LF) into events, ``classify`` says what an OpenAI
stream event carries, ``event`` / ``error_event`` / ``DONE`` write events. Used by the attempt loop
(``gateway/resilience/attempts.py``), observability (``gateway/observability/telemetry.py``) and tests.
"""

from __future__ import annotations

import json
from typing import Any, AsyncIterator

import msgspec

DONE = b"data: [DONE]\n\n"


def event(payload: bytes) -> bytes:
    """One SSE event carrying ``payload`` (a single data line)."""
    return b"data: " + payload + b"\n\n"


def error_event(message: str, type_: str = "upstream_error", code: str | None = None) -> bytes:
    """An SSE event carrying OpenAI's error object (how a stream that already sent content reports a failure)."""
    return event(json.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}}).encode())


class EventReader:
    """Raw SSE bytes (any split) -> events, each with the bytes to relay for it.

    An event's relay bytes are ``data: <payload>\\n\\n`` with its data lines joined by newlines (comments and
    other fields dropped, CRLF read as LF); for the usual single-line ``data: {...}`` event they are the
    upstream's own bytes. The buffer is split once per read, not once per event.
    Spec: https://html.spec.whatwg.org/multipage/server-sent-events.html
    """

    __slots__ = ("chunks", "buf", "eof", "ready")

    def __init__(self, chunks: AsyncIterator[bytes] | None = None):
        self.chunks = chunks
        self.buf = b""
        self.eof = False
        self.ready: list[tuple[bytes, bytes]] = []   # complete events not yet popped, last first

    async def fill(self) -> bool:
        """Read the next chunk of bytes into the buffer; False at the end of the stream (transport errors raise)."""
        if self.eof:
            return False
        try:
            chunk = await self.chunks.__anext__()
        except StopAsyncIteration:
            self.eof = True
            return False
        self.feed(chunk)
        return True

    def feed(self, chunk: bytes) -> None:
        """Append bytes pushed by the caller (instead of ``fill`` pulling them from ``chunks``)."""
        buf = self.buf + chunk if self.buf else chunk
        if b"\r" in buf:  # on the joined buffer: a CRLF may be split
            buf = buf.replace(b"\r\n", b"\n")
        self.buf = buf

    def pop(self) -> tuple[bytes, bytes] | None:
        """The next complete event as (relay bytes, data payload); None: none complete yet."""
        ready = self.ready
        if ready:
            return ready.pop()
        blocks = self.buf.split(b"\n\n")
        if len(blocks) == 1:
            return None
        self.buf = blocks.pop()
        for block in reversed(blocks):
            if block.startswith(b"data: ") and block[6:7] != b" " and b"\n" not in block:
                ready.append((block + b"\n\n", block[6:]))    # one canonical data line: relayed as is
                continue
            data = [ln[5:].lstrip(b" ") for ln in block.split(b"\n") if ln.startswith(b"data:")]
            if data:
                payload = b"\n".join(data)
                ready.append((b"data: " + payload + b"\n\n", payload))
        return ready.pop() if ready else None

    def tail(self) -> tuple[bytes, bytes] | None:
        """At the end of the stream: a final event without its blank line (the stream was cut mid-event), once."""
        rest, self.buf = self.buf.strip(), b""
        if not rest.startswith(b"data:"):
            return None
        payload = rest[5:].lstrip()
        return b"data: " + payload + b"\n\n", payload



class _EvDelta(msgspec.Struct):
    content: Any = None
    tool_calls: Any = None
    function_call: Any = None
    reasoning_content: Any = None
    refusal: Any = None


class _EvChoice(msgspec.Struct):
    text: Any = None
    finish_reason: Any = None
    delta: _EvDelta | None = None


class _Ev(msgspec.Struct):
    """The fields of a streamed event that the loop reads (others are skipped by the decoder)."""

    error: Any = None
    usage: Any = None
    choices: list[_EvChoice] | None = None


_decode_event = msgspec.json.Decoder(_Ev).decode


def _kind_of(obj: Any) -> str:
    if not isinstance(obj, dict):
        return "malformed"
    if obj.get("error"):
        return "error"
    for ch in obj.get("choices") or []:
        if not isinstance(ch, dict):
            continue
        d = ch.get("delta") or {}
        if ch.get("text") or ch.get("finish_reason") or (isinstance(d, dict) and (
                d.get("content") or d.get("tool_calls") or d.get("function_call") or d.get("reasoning_content")
                or d.get("refusal"))):
            return "content"
    return "meta"


def classify(data: bytes) -> tuple[str, Any, Any, bytes | None]:
    """An event's data payload: (kind, its ``usage``, its ``error``, replacement payload).

    kind: ``done`` | ``error`` | ``content`` (a delta with content, or a finish) | ``meta`` | ``malformed``.
    The replacement payload is None unless the payload is JSON only once invalid UTF-8 is replaced (U+FFFD):
    then it is relayed in that form. Typed decoding (C, unknown fields skipped) for the usual shapes; any other
    JSON goes the generic way with the same rules."""
    if data[:1] != b"{":
        if data.strip() == b"[DONE]":
            return "done", None, None, None
    else:
        try:
            ev = _decode_event(data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            pass
        else:
            if ev.error:
                return "error", ev.usage, ev.error, None
            for ch in ev.choices or ():
                d = ch.delta
                if ch.text or ch.finish_reason or (d is not None and (
                        d.content or d.tool_calls or d.function_call or d.reasoning_content or d.refusal)):
                    return "content", ev.usage, None, None
            return "meta", ev.usage, None, None
    fixed = None
    try:
        obj = msgspec.json.decode(data)
    except msgspec.DecodeError:
        text = data.decode("utf-8", "replace")
        try:
            obj = json.loads(text)
        except ValueError:
            return "malformed", None, None, None
        fixed = text.encode()
        if fixed == data:
            fixed = None
    kind = _kind_of(obj)
    if kind == "malformed":
        return kind, None, None, None
    return kind, obj.get("usage"), obj.get("error"), fixed
