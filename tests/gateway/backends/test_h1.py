"""The upstream hot path's HTTP/1.1 client (``gateway/backends/h1.py``) against raw servers on 127.0.0.1 that
write scripted bytes: keep-alive reuse, the request as written, bodies by length, chunked and until the close,
informational responses, broken and stalled answers, refused connects, the pool's limit, and header injection."""

from __future__ import annotations

import asyncio

import pytest

from gateway.backends.h1 import Pool, UpstreamConnectorError, UpstreamDisconnected
from gateway.errors import transport_error_kind
from tests.gateway.support import free_port

OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"


class Scripted:
    """A server answering each request (read up to its body, by content-length) with ``answer(n)``'s pieces
    (bytes written in turn; a float sleeps; None closes the connection); records ``requests`` and
    ``connections``; ``open`` is the connections open now (``most``: the most at once)."""

    def __init__(self, answer):
        self.answer, self.requests, self.connections, self.open, self.most = answer, [], 0, 0, 0

    async def __aenter__(self) -> "Scripted":
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/v1"
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.open += 1
        self.most = max(self.most, self.open)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length")))
                self.requests.append(head + await reader.readexactly(length))
                for piece in self.answer(len(self.requests)):
                    if piece is None:
                        writer.close()
                        return
                    if isinstance(piece, float):
                        await asyncio.sleep(piece)
                    else:
                        writer.write(piece)
                        await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.open -= 1
            writer.close()


async def _post(pool: Pool, body: bytes = b"{}", extra: dict | None = None):
    return await pool.post(pool.head("chat/completions", {"content-type": "application/json"}),
                           extra or {"x-request-id": "r1"}, body)


async def test_a_kept_alive_connection_is_reused_and_the_request_is_written_as_http_1_1():
    async with Scripted(lambda n: [OK]) as up:
        pool = Pool(up.url, 4, 2, 5)
        for _ in range(3):
            r = await _post(pool, b'{"a":1}')
            assert (r.status, r.headers["content-type"], await r.read()) == (200, "application/json", b"{}")
            r.release()
        assert up.connections == 1 and len(up.requests) == 3
        port = up.url.split(":")[2].split("/")[0]
        assert up.requests[0] == (f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n"
                                  "user-agent: tandem-gateway\r\ncontent-type: application/json\r\n"
                                  'x-request-id: r1\r\ncontent-length: 7\r\n\r\n{"a":1}').encode()
        await pool.aclose()


async def test_chunked_and_until_close_bodies_arrive_in_pieces_and_an_informational_response_is_skipped():
    chunked = [b"HTTP/1.1 100 Continue\r\n\r\n", b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n",
               b"5\r\nhello\r\n", 0.05, b"6\r\n world\r\n0\r\n\r\n"]
    async with Scripted(lambda n: chunked) as up:
        pool = Pool(up.url, 4, 2, 5)
        r = await _post(pool)
        assert r.status == 200
        assert [await r.readany(), await r.readany(), await r.readany()] == [b"hello", b" world", b""]
        r.release()
        r = await _post(pool)                                  # the same connection, kept alive
        assert await r.read() == b"hello world" and up.connections == 1
        r.release()
    async with Scripted(lambda n: [b"HTTP/1.1 200 OK\r\n\r\npart one, ", 0.05, b"part two", None]) as up:
        pool = Pool(up.url, 4, 2, 5)
        r = await _post(pool)
        assert await r.read() == b"part one, part two"        # no length: the body ends with the connection
        r.release()
        assert pool.open == 0 and not pool.idle


async def test_a_broken_answer_is_a_disconnect_and_a_stalled_one_a_timeout():
    async with Scripted(lambda n: [b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc", None]) as up:
        r = await _post(Pool(up.url, 4, 2, 5))
        with pytest.raises(UpstreamDisconnected) as e:
            await r.read()
        assert transport_error_kind(e.value) == "connection_error"
    async with Scripted(lambda n: [b"not http at all\r\n\r\n"]) as up:
        with pytest.raises(UpstreamDisconnected):
            await _post(Pool(up.url, 4, 2, 5))
    async with Scripted(lambda n: [b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc", 30.0]) as up:
        pool = Pool(up.url, 4, 2, 0.2)
        r = await _post(pool)
        assert await r.readany() == b"abc"
        with pytest.raises(TimeoutError) as e:
            await r.readany()
        assert transport_error_kind(e.value) == "timeout"
        r.release()
        assert pool.open == 0                                  # not read to its end: closed, not pooled


async def test_a_refused_connect_is_a_connector_error():
    with pytest.raises(UpstreamConnectorError) as e:
        await _post(Pool(f"http://127.0.0.1:{free_port()}/v1", 4, 2, 5))
    assert transport_error_kind(e.value) == "connect_error"


async def test_the_pool_holds_at_most_max_connections_and_replaces_one_the_upstream_closed():
    async with Scripted(lambda n: [0.05, OK]) as up:
        pool = Pool(up.url, 2, 5, 5)

        async def one() -> bytes:
            r = await _post(pool)
            try:
                return await r.read()
            finally:
                r.release()

        assert await asyncio.gather(*[one() for _ in range(7)]) == [b"{}"] * 7
        assert up.most == 2 and up.connections == 2 and pool.open == 2
    async with Scripted(lambda n: [OK, None] if n == 1 else [OK]) as up:   # closes after its first answer
        pool = Pool(up.url, 2, 5, 5)
        assert await one() == b"{}"
        await asyncio.sleep(0.1)                               # the close arrives while the connection idles
        assert await one() == b"{}" and up.connections == 2


async def test_a_line_break_in_a_header_is_refused():
    pool = Pool("http://127.0.0.1:9/v1", 2, 1, 1)
    with pytest.raises(ValueError):
        await _post(pool, extra={"x-request-id": "a\r\nx-injected: 1"})
    with pytest.raises(ValueError):
        pool.head("chat/completions", {"x-api": "k\nx-injected: 1"})


async def test_waiting_for_a_free_connection_is_bounded_by_the_connect_timeout():
    async with Scripted(lambda n: [0.5, OK] if n == 1 else [OK]) as up:
        pool = Pool(up.url, 1, 0.1, 5)
        first = asyncio.ensure_future(_post(pool))             # holds the only connection for 0.5 s
        await asyncio.sleep(0.05)
        with pytest.raises(TimeoutError):
            await _post(pool)
        r = await first
        assert await r.read() == b"{}"
        r.release()
        r = await _post(pool)                                  # the slot the waiter gave up is not lost
        assert await r.read() == b"{}" and pool.open == 1 and up.connections == 1
        r.release()


def _self_signed(tmp_path) -> tuple[str, str]:
    """A certificate for ``localhost`` and its key (PEM files), made with ``cryptography``."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_path), str(key_path)


async def test_https_verifies_the_upstreams_certificate_and_keeps_the_connection_alive(tmp_path):
    import ssl

    cert, key = _self_signed(tmp_path)
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(cert, key)
    up = Scripted(lambda n: [OK])
    server = await asyncio.start_server(up._serve, "localhost", 0, ssl=server_ctx)
    url = f"https://localhost:{server.sockets[0].getsockname()[1]}/v1"
    try:
        pool = Pool(url, 2, 5, 5, ssl_context=ssl.create_default_context(cafile=cert))
        for _ in range(2):
            r = await _post(pool)
            assert (r.status, await r.read()) == (200, b"{}")
            r.release()
        assert up.connections == 1
        with pytest.raises(UpstreamConnectorError) as e:              # not a certificate the client trusts
            await _post(Pool(url, 2, 5, 5))
        assert "CERTIFICATE_VERIFY_FAILED" in str(e.value) and transport_error_kind(e.value) == "connect_error"
    finally:
        server.close()
