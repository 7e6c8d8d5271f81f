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
    """One SSE event carrying ``payload``: one ``data:`` line per line of it (a reader joins them with newlines,
    so a payload that spans lines arrives whole)."""
    if b"\n" in payload:
        return b"".join(b"data: " + line + b"\n" for line in payload.split(b"\n")) + b"\n"
    return b"data: " + payload + b"\n\n"


def named_event(name: str, payload: bytes) -> bytes:
    """One SSE event with an ``event:`` field (Anthropic's streams and the Responses API's typed events name each
    event there) and ``payload`` as its data."""
    return b"event: " + name.encode() + b"\n" + event(payload)


def error_event(message: str, type_: str = "upstream_error", code: str | None = None) -> bytes:
    """An SSE event carrying OpenAI's error object (how a stream that already sent content reports a failure)."""
    return event(json.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}}).encode())


class EventReader:
    """Raw SSE bytes (any split) -> events, each with the bytes to relay for it.

    As the spec reads a stream: an event's data is its ``data`` lines joined with newlines (one space after the
    colon removed, a line ``data`` without a colon is an empty data line); comment lines (``: keep-alive``) and
    other fields (``event``, ``id``, ``retry``) are dropped, as are blocks without data; CRLF is read as LF (a
    lone CR line end, which no LLM upstream sends, is not). An event's relay bytes are ``event(data)``: for the
    usual single-line ``data: {...}`` event the upstream's own bytes, for a multi-line one a data line per line.
    The buffer is split once per read, not once per event. Any bytes read (a comment too) are traffic: the
    caller's idle timer counts reads, not events.
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
            item = _data_event(block)
            if item is not None:
                ready.append(item)
        return ready.pop() if ready else None

    def tail(self) -> tuple[bytes, bytes] | None:
        """At the end of the stream: a final event without its blank line (the stream was cut mid-event), once."""
        rest, self.buf = self.buf.strip(b"\n"), b""
        return _data_event(rest) if rest else None


def _data_event(block: bytes) -> tuple[bytes, bytes] | None:
    """One event block's (relay bytes, data), its data lines joined with newlines; None: no data line."""
    data = []
    for line in block.split(b"\n"):
        if line.startswith(b"data:"):
            value = line[5:]
            data.append(value[1:] if value[:1] == b" " else value)
        elif line == b"data":
            data.append(b"")
    if not data:
        return None
    payload = b"\n".join(data)
    return event(payload), payload



class _EvDelta(msgspec.Struct):
    content: Any = None
    tool_calls: Any = None
    function_call: Any = None
    reasoning_content: Any = None
    refusal: Any = None


class _EvChoice(msgspec.Struct):
    index: Any = 0
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


def _index(index: Any) -> Any:
    return index if isinstance(index, int) else repr(index)


def classify(data: bytes) -> tuple[str, Any, Any, bytes | None, list[tuple[Any, bool]]]:
    """An event's data payload: (kind, its ``usage``, its ``error``, replacement payload, its choices' finishes).

    kind: ``done`` | ``error`` | ``content`` (a delta with content, or a finish) | ``meta`` | ``malformed``.
    The replacement payload is None unless the payload is JSON only once invalid UTF-8 is replaced (U+FFFD):
    then it is relayed in that form. Typed decoding (C, unknown fields skipped) for the usual shapes; any other
    JSON goes the generic way with the same rules. The finishes are ``choice_finishes``' answer, taken from the
    same decode on the usual path (a relay reads both for every event)."""
    if data[:1] != b"{":
        if data.strip() == b"[DONE]":
            return "done", None, None, None, []
    else:
        try:
            ev = _decode_event(data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            pass
        else:
            finishes = [(_index(ch.index), bool(ch.finish_reason)) for ch in ev.choices or ()]
            if ev.error:
                return "error", ev.usage, ev.error, None, finishes
            for ch in ev.choices or ():
                d = ch.delta
                if ch.text or ch.finish_reason or (d is not None and (
                        d.content or d.tool_calls or d.function_call or d.reasoning_content or d.refusal)):
                    return "content", ev.usage, None, None, finishes
            return "meta", ev.usage, None, None, finishes
    fixed = None
    try:
        obj = msgspec.json.decode(data)
    except msgspec.DecodeError:
        text = data.decode("utf-8", "replace")
        try:
            obj = json.loads(text)
        except ValueError:
            return "malformed", None, None, None, []
        fixed = text.encode()
        if fixed == data:
            fixed = None
    kind = _kind_of(obj)
    if kind == "malformed":
        return kind, None, None, None, []
    return kind, obj.get("usage"), obj.get("error"), fixed, choice_finishes(data)   # a rare shape: decoded again


class _FinChoice(msgspec.Struct):
    index: Any = 0
    finish_reason: Any = None


class _Fin(msgspec.Struct):
    choices: list[_FinChoice] | None = None


_decode_fin = msgspec.json.Decoder(_Fin).decode


def choice_finishes(data: bytes) -> list[tuple[Any, bool]]:
    """An event's choices as (index, has a ``finish_reason``): how a relay tells that a stream is complete
    (every choice finished) when the upstream omits ``[DONE]``. Empty for any payload without choices."""
    try:
        ev = _decode_fin(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return []
    return [(_index(ch.index), bool(ch.finish_reason)) for ch in ev.choices or ()]
