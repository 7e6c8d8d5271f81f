"""A lean HTTP/1.1 client for the upstream hot path (``UpstreamBackend.send`` / ``open_sse``): one pool of kept-alive
connections per upstream, a request written in one ``write``, the response parsed by httptools (uvicorn's parser)
as it arrives, and its body handed on in the pieces the socket gave. aiohttp's ``ClientSession`` did the same
through its request, response, header, URL, timer and tracing objects: a fifth of the gateway's CPU per request
and two fifths per stream at 32 clients (issue 48's profile).

What it does not do, because the upstreams it is for never need it: redirects, cookies, proxies, compression (it
sends no ``accept-encoding``), ``Expect: 100-continue``, HTTP/2. ``https`` URLs use the ``ssl_context`` given
(``UpstreamBackend``: httpx's, the certifi trust store its cold calls use), else the ``ssl`` module's default.

Errors: a failed connect is ``UpstreamConnectorError`` (``gateway.errors.transport_error_kind``: ``connect_error``);
a connection that closes or sends what is not HTTP before the response ends, ``UpstreamDisconnected``
(``connection_error``); no byte within the read timeout, or no connection within the connect timeout, ``TimeoutError``.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from collections.abc import Mapping
from urllib.parse import urlsplit

import httptools

_PAUSE_AT = 1 << 18        # buffered body bytes at which reading pauses until the reader catches up
_USER_AGENT = "tandem-gateway"


class UpstreamConnectorError(ConnectionError):
    """The connection to the upstream could not be made (refused, unreachable, name not resolved, TLS)."""


class UpstreamDisconnected(ConnectionError):
    """The connection closed, or carried something that is not HTTP/1.1, before the response ended."""


class _Connection(asyncio.Protocol):
    """One kept-alive connection and the response being read on it (at most one at a time)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.in_use = False             # a request was sent on it and its response is not yet released
        self.counted = True             # one of the pool's ``open`` connections (until discarded)
        self.idle_since = 0.0
        self._reset()

    def _reset(self) -> None:
        self.headers: dict[str, str] = {}
        self.status = 0
        self.head_done = self.done = self.until_eof = self.keep_alive = False
        self.error: BaseException | None = None
        self.chunks: list[bytes] = []
        self.buffered = 0
        self.paused = False
        self.waiter: asyncio.Future | None = None

    # -- asyncio.Protocol ----------------------------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if not self.in_use:             # bytes on an idle connection: nothing to read them into; not reusable
            self.closed = True
            self.transport.close()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(UpstreamDisconnected(f"invalid HTTP response: {e}"))
            self.transport.close()
            return
        if self.buffered > _PAUSE_AT and not self.paused:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def connection_lost(self, exc) -> None:
        self.closed = True
        if self.head_done and self.until_eof and not self.done:
            self.done = True                 # a body without a length ends with the connection
        elif not self.done:
            self._fail(UpstreamDisconnected("the upstream closed the connection" + (f" ({exc})" if exc else "")))
        self._wake()

    # -- httptools callbacks -------------------------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.setdefault(name.decode("latin-1").lower(), value.decode("latin-1"))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()    # (only valid inside the parser's callbacks)
        self.head_done = True
        h = self.headers
        self.until_eof = ("content-length" not in h and "chunked" not in h.get("transfer-encoding", "").lower()
                          and self.status >= 200 and self.status not in (204, 304))

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)

    def on_message_complete(self) -> None:
        if self.status < 200:           # an informational response (100, 103): the real one follows
            self.headers, self.status, self.head_done = {}, 0, False
            return
        self.done = True

    # -- the reader's side ---------------------------------------------------------------------------------------
    def _fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc

    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def wait(self, timeout_s: float | None) -> None:
        """Until more arrives (data, the end, an error), at most ``timeout_s`` seconds.

        Raises:
            TimeoutError: nothing arrived in time."""
        self.waiter = w = self.loop.create_future()
        handle = self.loop.call_later(timeout_s, _expire, w, timeout_s) if timeout_s else None
        try:
            await w
        finally:
            self.waiter = None
            if handle is not None:
                handle.cancel()

    def take(self) -> bytes:
        """The body bytes buffered so far (b"" when none), reading resumed if it was paused."""
        chunks = self.chunks
        if not chunks:
            return b""
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self.chunks, self.buffered = [], 0
        if self.paused and not self.closed:
            self.paused = False
            self.transport.resume_reading()
        return data

    @property
    def reusable(self) -> bool:
        return self.done and self.keep_alive and not self.closed and self.error is None and not self.until_eof


def _expire(w: asyncio.Future, timeout_s: float) -> None:
    if not w.done():
        w.set_exception(TimeoutError(f"no data from the upstream within {timeout_s:g}s"))


class Response:
    """An upstream's response once its head arrived: ``status``, ``headers`` (lower-case names; a repeated header:
    its first value); the body with ``read`` or ``readany``; ``release`` hands the connection back to the pool (a
    response not read to its end closes it instead)."""

    __slots__ = ("status", "headers", "_conn", "_pool", "_read_s")

    def __init__(self, conn: _Connection, pool: "Pool", read_s: float | None) -> None:
        self.status, self.headers = conn.status, conn.headers
        self._conn, self._pool, self._read_s = conn, pool, read_s

    async def read(self) -> bytes:
        """The whole body.

        Raises:
            TimeoutError, UpstreamDisconnected: as ``readany``."""
        chunks = []
        while chunk := await self.readany():
            chunks.append(chunk)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def readany(self) -> bytes:
        """The body bytes that have arrived (waiting for some when none have); b"" once it has ended.

        Raises:
            TimeoutError: nothing arrived within the read timeout.
            UpstreamDisconnected: the connection ended before the body did."""
        conn = self._conn
        while True:
            data = conn.take()
            if data:
                return data
            if conn.done:
                return b""
            if conn.error is not None:
                raise conn.error
            await conn.wait(self._read_s)

    def release(self) -> None:
        if self._conn is not None:
            self._pool.release(self._conn)
            self._conn = None


class Pool:
    """Kept-alive connections to the origin of ``base_url``: at most ``max_connections`` open, idle ones reused
    newest first and closed after ``keepalive_s``; ``connect_s`` bounds the wait for a connection (a free one or
    a new one, TLS included), ``read_s`` every wait for bytes of a response."""

    def __init__(self, base_url: str, max_connections: int, connect_s: float, read_s: float,
                 keepalive_s: float = 60.0, ssl_context: ssl.SSLContext | None = None) -> None:
        u = urlsplit(base_url)
        self.https = u.scheme == "https"
        self.host = u.hostname or "localhost"
        self.port = u.port or (443 if self.https else 80)
        default = (443 if self.https else 80)
        self.authority = self.host if self.port == default else f"{self.host}:{self.port}"
        if ":" in self.host:                                    # an IPv6 literal
            self.authority = f"[{self.host}]" + ("" if self.port == default else f":{self.port}")
        self.base_path = u.path.rstrip("/")
        self.max_connections, self.connect_s, self.read_s, self.keepalive_s = (
            max_connections, connect_s, read_s, keepalive_s)
        self.ssl = (ssl_context or ssl.create_default_context()) if self.https else None
        self.idle: list[_Connection] = []
        self.open = 0
        self.waiters: deque[asyncio.Future] = deque()
        self.closed = False

    def head(self, path: str, headers: Mapping[str, str]) -> bytes:
        """The request line and the fixed headers of ``POST base_url/path`` (without ``content-length``)."""
        return (f"POST {self.base_path}/{path} HTTP/1.1\r\nhost: {self.authority}\r\n"
                f"user-agent: {_USER_AGENT}\r\n").encode("latin-1") + _lines(headers)

    async def post(self, head: bytes, extra: Mapping[str, str], body: bytes) -> Response:
        """Send ``head`` (``Pool.head``), the ``extra`` headers and ``body``; the response once its head arrived.

        Raises:
            UpstreamConnectorError, UpstreamDisconnected, TimeoutError."""
        request = b"%s%scontent-length: %d\r\n\r\n%s" % (head, _lines(extra), len(body), body)
        conn = await self._acquire()
        try:
            conn._reset()
            conn.in_use = True
            conn.transport.write(request)
            while not conn.head_done:
                if conn.error is not None:
                    raise conn.error
                await conn.wait(self.read_s)
        except BaseException:
            self._discard(conn)
            raise
        return Response(conn, self, self.read_s)

    async def _acquire(self) -> _Connection:
        now = time.monotonic()
        while self.idle:
            conn = self.idle.pop()
            if not conn.closed and now - conn.idle_since < self.keepalive_s:
                return conn
            self._discard(conn)
        if self.open >= self.max_connections:
            w = asyncio.get_running_loop().create_future()
            self.waiters.append(w)
            try:
                async with asyncio.timeout(self.connect_s):
                    conn = await w
            except BaseException:
                if w.done() and not w.cancelled():   # handed over just as the wait ended: hand it on
                    if (handed := w.result()) is not None:
                        self.release(handed)
                    else:
                        self.open -= 1
                        self._wake_one(None)
                elif w in self.waiters:
                    self.waiters.remove(w)
                raise
            if conn is not None:
                return conn
            # else a slot was handed over: ``open`` already counts it
        else:
            self.open += 1
        try:
            return await self._connect()
        except BaseException:
            self.open -= 1
            self._wake_one(None)
            raise

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_s):
                _, conn = await loop.create_connection(
                    lambda: _Connection(loop), self.host, self.port, ssl=self.ssl,
                    server_hostname=self.host if self.ssl is not None else None)
        except (OSError, ssl.SSLError) as e:
            raise UpstreamConnectorError(f"cannot connect to {self.authority}: {e}") from e
        return conn

    def release(self, conn: _Connection) -> None:
        """Hand ``conn`` back: to a waiting request, else to the idle list; closed when its response was not read
        to its end (or the pool is closed)."""
        conn.in_use = False
        if not conn.reusable or self.closed:
            self._discard(conn)
            return
        conn.idle_since = time.monotonic()
        if not self._wake_one(conn):
            self.idle.append(conn)

    def _discard(self, conn: _Connection) -> None:
        if conn.transport is not None and not conn.transport.is_closing():
            conn.transport.close()
        conn.closed = True
        if conn.counted:
            conn.counted = False
            self.open -= 1
            self._wake_one(None)

    def _wake_one(self, conn: _Connection | None) -> bool:
        """Give ``conn`` (None: the right to open one) to the oldest waiter; False when none waits."""
        while self.waiters:
            w = self.waiters.popleft()
            if not w.done():
                if conn is None:
                    self.open += 1         # the slot is the waiter's: it connects on it (``_acquire``)
                w.set_result(conn)
                return True
        return False

    async def aclose(self) -> None:
        self.closed = True
        for conn in self.idle:
            self._discard(conn)
        self.idle = []


def _lines(headers: Mapping[str, str]) -> bytes:
    """``headers`` as header lines, refusing a line break inside a name or a value (header injection)."""
    for k, v in headers.items():
        if "\r" in k or "\n" in k or "\r" in v or "\n" in v:
            raise ValueError(f"the header {k!r} holds a line break")
    return "".join([f"{k}: {v}\r\n" for k, v in headers.items()]).encode("latin-1")
