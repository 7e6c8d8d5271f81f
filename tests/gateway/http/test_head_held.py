"""A whole answer's head and body leave in one write (``gateway/http/head_held.py``, installed by the door's
protocol); a stream's head still leaves before its first event, and a HEAD answer's head is written at all.
uvicorn with the door's protocol on a raw socket, each write to the connection's transport recorded."""

from __future__ import annotations

import asyncio

import pytest
import uvicorn

import gateway.http.door as door
from gateway.http.door import DoorLimits, door_protocol
from tests.conftest import free_port

release = asyncio.Event()


async def app(scope, receive, send) -> None:
    """``/whole``: 5 bytes with a content-length; ``/stream``: a chunked answer whose first chunk waits for
    ``release``."""
    if scope["type"] != "http":
        return
    if scope["path"] == "/whole":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"5")]})
        await send({"type": "http.response.body", "body": b"hello"})
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    await release.wait()
    await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
    await send({"type": "http.response.body", "body": b""})


@pytest.fixture
def writes(monkeypatch) -> list[bytes]:
    """Every write that reaches a connection's transport through ``HeadHeld``."""
    seen: list[bytes] = []

    class Recorded(door.HeadHeld):
        def __init__(self, transport, cycle) -> None:
            class Spy:
                def write(self, data: bytes) -> None:
                    seen.append(data)
                    transport.write(data)

                def __getattr__(self, name):
                    return getattr(transport, name)

            super().__init__(Spy(), cycle)

    monkeypatch.setattr(door, "HeadHeld", Recorded)
    return seen


async def _exchange(port: int, request: bytes, until: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    out = b""
    while until not in out:
        chunk = await asyncio.wait_for(reader.read(65536), 10)
        assert chunk, out
        out += chunk
    writer.close()
    return out


async def test_a_whole_answer_is_one_write_and_a_streams_head_is_not_held(writes):
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off",
                                           http=door_protocol(DoorLimits(8192, 50, 5.0))))
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            await asyncio.sleep(0.02)
        out = await _exchange(port, b"GET /whole HTTP/1.1\r\nhost: x\r\n\r\n", b"hello")
        assert len(writes) == 1 and writes[0].startswith(b"HTTP/1.1 200") and writes[0].endswith(b"\r\n\r\nhello")
        assert out == writes[0]

        writes.clear()
        out = await _exchange(port, b"HEAD /whole HTTP/1.1\r\nhost: x\r\n\r\n", b"\r\n\r\n")
        assert writes == [out] and b"content-length: 5" in out

        writes.clear()
        release.clear()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /stream HTTP/1.1\r\nhost: x\r\n\r\n")
        head = b""
        while b"\r\n\r\n" not in head:          # the head arrives while the first event is still held back
            head += await asyncio.wait_for(reader.read(65536), 10)
        assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in head
        release.set()
        rest = b""
        while not rest.endswith(b"0\r\n\r\n"):
            rest += await asyncio.wait_for(reader.read(65536), 10)
        writer.close()
        assert writes[0] == head and b"".join(writes[1:]) == rest and b"data: 1" in rest
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 30)


def test_the_head_is_held_only_once_the_response_has_started():
    """A 100 Continue (written before the app's start) goes out at once; so does everything after the head."""
    sent = []

    class Transport:
        def write(self, data):
            sent.append(data)

    class Cycle:
        response_started, chunked_encoding, scope = False, None, {"method": "POST"}

    cycle = Cycle()
    held = door.HeadHeld(Transport(), cycle)
    held.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    assert sent == [b"HTTP/1.1 100 Continue\r\n\r\n"]
    cycle.response_started, cycle.chunked_encoding = True, False
    held.write(b"HEAD\r\n\r\n")
    assert len(sent) == 1
    held.write(b"body")
    held.write(b"more")
    assert sent[1:] == [b"HEAD\r\n\r\nbody", b"more"]
