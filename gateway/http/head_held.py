"""One write per whole response: uvicorn's httptools protocol writes a response's head (status line and headers)
as soon as the app sends ``http.response.start`` and its body at ``http.response.body``: two ``send`` calls, two
TCP segments, and a client that wakes up for the head and again for the body. ``HeadHeld`` is the transport of one
request's cycle (``gateway/http/door.py`` installs it) that holds a head announcing a ``content-length`` and writes
it with the body's first bytes. Heads of chunked answers (streams) are written at once, as before: a stream's
headers never wait for its first event. A response to HEAD (no body is written) is not held either."""

from __future__ import annotations


class HeadHeld:
    """``transport`` for ``cycle`` (uvicorn's ``RequestResponseCycle``): every call is the transport's, except that
    the head of a response with a ``content-length`` is joined to the write that follows it."""

    __slots__ = ("transport", "cycle", "head", "passed")

    def __init__(self, transport, cycle) -> None:
        self.transport, self.cycle = transport, cycle
        self.head: bytes | None = None
        self.passed = False              # the head was written (or is being held): later writes go straight

    def write(self, data: bytes) -> None:
        if self.passed:
            if self.head is not None:
                data, self.head = self.head + data, None
            self.transport.write(data)
            return
        cycle = self.cycle
        if cycle.response_started:       # this is the head (a 100 Continue comes before the start)
            self.passed = True
            if cycle.chunked_encoding is False and cycle.scope["method"] != "HEAD":
                self.head = data         # written with the body's first bytes, next
                return
        self.transport.write(data)

    def __getattr__(self, name: str):
        return getattr(self.transport, name)
