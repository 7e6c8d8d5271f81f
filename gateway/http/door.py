"""The door: what a connection may send before the app sees a request. uvicorn's httptools protocol accepts
headers of any size and count and waits forever for them (one 128 MiB header stalled the event loop for every
client); ``door_protocol`` is that protocol with limits, refused the way RFC 6585 and RFC 9110 say:

- more than ``max_header_bytes`` of request line and headers, or more than ``max_headers`` header fields:
  ``431 Request Header Fields Too Large``, connection closed, before the rest is buffered or parsed;
- request line and headers not complete within ``header_timeout_s`` of the connection (a later request on a
  kept-alive connection: of its first byte): ``408 Request Timeout`` (or a plain close when nothing was sent),
  connection closed.

A refusal half-closes the connection and drops what the client still sends for ``_LINGER_S`` before closing
it (nginx's lingering close): closing at once with unread bytes makes the kernel send a reset that can destroy
the 431 before the client reads it.

The body's own time limit is the app's (``gateway/http/transport.py`` ``read_body``), where the 408 is OpenAI's
error JSON.
"""

from __future__ import annotations

from dataclasses import dataclass

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.http.head_held import HeadHeld


@dataclass(frozen=True)
class DoorLimits:
    """Per-connection limits, from the ``server.*`` settings of the same names: bytes and fields of a request's
    head, seconds for it."""

    max_header_bytes: int
    max_headers: int
    header_timeout_s: float


_REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large"}
_LINGER_S = 1.0


class _Refused(Exception):
    """Raised from a parser callback to stop parsing a head over a limit (httptools wraps it in its own parser
    error, so the refusal itself rides on the protocol: ``DoorProtocol.refusal``)."""


class DoorProtocol(HttpToolsProtocol):
    """``HttpToolsProtocol`` that counts each request head's bytes and fields and times it. ``limits`` is set
    per server by ``door_protocol``'s subclass (uvicorn builds the protocol itself, so it cannot be passed in)."""

    limits: DoorLimits

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.head_open = True          # the next bytes are a request head
        self.body_open = False         # the parser is inside a request's body (it may outlive its answer)
        self.head_bytes = 0            # bytes received since the head began (it may be incomplete)
        self.head_parsed = 0           # bytes of request target and header fields the parser handed us
        self.head_fields = 0
        self.head_timer = None
        self.refusal: tuple[int, str] | None = None   # what a _Refused raised by a callback stands for
        self.refused = False           # answered and half-closed: what still arrives is dropped

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_head_timer()

    def connection_lost(self, exc) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return
        if self.head_open:
            # counted before parsing: an incomplete oversized head is refused without buffering it (a head
            # that completes within ``data`` is measured by the parser callbacks instead: ``data`` may also
            # hold its body)
            self.head_bytes += len(data)
        super().data_received(data)
        if self.head_open and self.head_bytes > self.limits.max_header_bytes and not self.transport.is_closing():
            self.refuse(431, f"request headers exceed {self.limits.max_header_bytes} bytes")

    def send_400_response(self, msg: str) -> None:
        # a parser error raised by our own callback (httptools wraps it) is the 431 it stands for
        if self.refusal is not None:
            self.refuse(*self.refusal)
            return
        super().send_400_response(msg)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.head_open = True
        self.head_fields = self.head_parsed = 0
        self._arm_head_timer()

    def on_url(self, url: bytes) -> None:
        self._count_head(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self.head_fields += 1
        if self.head_fields > self.limits.max_headers:
            self._stop(f"more than {self.limits.max_headers} request header fields")
        self._count_head(len(name) + len(value) + 4)    # "name: value\r\n"
        super().on_header(name, value)

    def _count_head(self, n: int) -> None:
        """Add ``n`` parsed bytes to the head; over ``max_header_bytes`` stops the parser before
        ``on_headers_complete``, so the app never sees the request (a complete head in one packet never
        reaches the byte check in ``data_received``)."""
        self.head_parsed += n
        if self.head_parsed > self.limits.max_header_bytes:
            self._stop(f"request headers exceed {self.limits.max_header_bytes} bytes")

    def _stop(self, message: str) -> None:
        """Stop parsing this head: ``send_400_response`` answers the 431 recorded here."""
        self.refusal = (431, message)
        raise _Refused(message)

    def on_headers_complete(self) -> None:
        self.head_open, self.body_open = False, True
        self.head_bytes = 0
        self._disarm_head_timer()
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and cycle.transport is self.transport:   # not a new cycle: an upgrade returned early
            cycle.transport = HeadHeld(self.transport, cycle)           # a whole answer's head and body: one write

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self.body_open = False
        if self.cycle is not None and self.cycle.response_complete:   # answered before its body ended
            self.head_open, self.head_bytes = True, 0

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # the next head is timed from its first byte (on_message_begin); idle keep-alive is uvicorn's. An answer
        # sent before its request's body ended (a 401 or 413 from the head) leaves the parser reading past that
        # body: its bytes are no head's (on_message_complete opens the next one then)
        if not self.body_open:
            self.head_open, self.head_bytes = True, 0

    def refuse(self, status: int, message: str) -> None:
        """Answer ``status`` with ``message`` as plain text and close the connection."""
        self._disarm_head_timer()
        self.head_open, self.refused = False, True
        body = message.encode()
        self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: %d"
                             b"\r\nconnection: close\r\n\r\n%s" % (status, _REASONS[status], len(body), body))
        if self.transport.can_write_eof():
            self.transport.write_eof()
            self.loop.call_later(_LINGER_S, self.transport.close)
        else:
            self.transport.close()

    def _arm_head_timer(self) -> None:
        if self.head_timer is None:
            self.head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_timeout)

    def _disarm_head_timer(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def _head_timeout(self) -> None:
        self.head_timer = None
        if not self.head_open or self.transport.is_closing():
            return
        if self.head_bytes or self.head_fields:
            self.refuse(408, f"request headers not received within {self.limits.header_timeout_s:g}s")
        else:
            self.transport.close()     # an idle connection: nothing to answer


def door_protocol(limits: DoorLimits) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol class with ``limits`` (pass it as ``uvicorn.Config(http=...)``)."""
    return type("DoorProtocol", (DoorProtocol,), {"limits": limits})
