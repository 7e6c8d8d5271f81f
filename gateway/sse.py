"""Server-sent events (https://html.spec.whatwg.org/multipage/server-sent-events.html): the gateway's one SSE
codec (the framing; an event's data is decoded by the codec of its wire format: ``gateway/translate/chat_events.py``
for OpenAI's chunks, ``anthropic_answer.py`` for Anthropic's events). ``EventReader`` splits raw bytes (any split,
CRLF or LF) into events; ``event`` / ``named_event`` / ``DONE`` write events; ``Last`` marks the bytes that end a
stream.
"""

from __future__ import annotations

from typing import AsyncIterator

DONE = b"data: [DONE]\n\n"


class Last(bytes):
    """The bytes that end a stream (its ``[DONE]``, with the events of the same read before it), as the client's
    codec writes them: the transport ends the response body with them (HTTP/1.1's final chunk goes out in the
    same write) and then lets the layers below finish (close the upstream, account) while the client, who has
    its whole answer, moves on. Nothing may follow them."""

    __slots__ = ()


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
