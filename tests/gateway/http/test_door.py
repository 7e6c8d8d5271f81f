"""The door (gateway/http/door.py, transport.read_body, validate.parse_json, admin /metrics) over raw sockets:
nothing a client sends before its request is parsed is unbounded, and /metrics is not a client's to read."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from tests.gateway.script_upstream import upstream  # noqa: F401 -- the module-scoped fixture
from tests.gateway.support import GatewayProcess, gateway_on, one_upstream_config, sha

KEY, ADMIN = "sk-door-client", "door-admin-token"
HEAD = """
server: {{max_header_bytes: 8KiB, max_headers: 20, header_timeout_s: 0.5, body_timeout_s: 0.5}}
auth:
  keys:
    - {{tenant: t1, sha256: {sha}}}
"""


@pytest.fixture(scope="module")
def gateway(upstream, tmp_path_factory):
    yield from gateway_on(tmp_path_factory, "door", one_upstream_config(upstream.base_url, HEAD.format(sha=sha(KEY))),
                          env={"TANDEM_ADMIN_TOKEN": ADMIN})


def exchange(g: GatewayProcess, parts: list, wait_s: float = 0.0) -> bytes:
    """Send ``parts`` (bytes, or a float: pause that long) on a fresh connection; everything the gateway answers
    until it closes (a bounded read: a hang fails the test instead of blocking it)."""
    with socket.create_connection(("127.0.0.1", g.port), timeout=10) as s:
        for p in parts:
            if isinstance(p, float):
                time.sleep(p)
            else:
                try:
                    s.sendall(p)
                except (BrokenPipeError, ConnectionResetError):
                    break          # refused mid-send: read what it answered
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except ConnectionResetError:
            pass
        return out


def head(extra: bytes = b"", length: int = 0) -> bytes:
    return (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer " + KEY.encode()
            + b"\r\ncontent-type: application/json\r\ncontent-length: " + str(length).encode() + b"\r\n" + extra)


def status_of(answer: bytes) -> int:
    assert answer.startswith(b"HTTP/1.1 "), answer[:200]
    return int(answer[9:12])


def test_oversized_header_is_431_before_it_is_buffered(gateway):
    # 4 MiB in one header value: refused once 8 KiB are in, the connection closed (the rest is never read)
    answer = exchange(gateway, [head(b"x-big: "), *[b"a" * 65536] * 64, b"\r\n\r\n"])
    assert status_of(answer) == 431
    assert httpx.get(gateway.url + "/health/live", timeout=5).status_code == 200


def test_complete_oversized_head_in_one_send_is_431(gateway, upstream):
    # the whole head, terminator included, in one send: the parser completes it before any byte check could
    before = upstream.calls
    answer = exchange(gateway, [head(b"connection: close\r\nx-big: " + b"a" * 9000 + b"\r\n") + b"\r\n"])
    assert status_of(answer) == 431
    assert upstream.calls == before


def test_medium_headers_summing_past_the_limit_are_431(gateway, upstream):
    # 12 fields of 1,000 bytes: each under the byte limit, the count under max_headers, the head over 8 KiB
    before = upstream.calls
    fields = b"".join(b"x-f%d: %s\r\n" % (i, b"a" * 1000) for i in range(12))
    assert status_of(exchange(gateway, [head(b"connection: close\r\n" + fields) + b"\r\n"])) == 431
    assert upstream.calls == before


def test_a_body_sent_with_its_head_is_not_counted_as_head(gateway):
    # head and a 12 KB body in one send: only the head is measured against max_header_bytes
    body = json.dumps({"model": "m1", "messages": [{"role": "user", "content": "a" * 12000}]}).encode()
    answer = exchange(gateway, [head(b"connection: close\r\n", len(body)) + b"\r\n" + body])
    assert status_of(answer) == 200


def test_too_many_header_fields_is_431(gateway):
    fields = b"".join(b"x-f%d: 1\r\n" % i for i in range(40))
    assert status_of(exchange(gateway, [head(b"connection: close\r\n" + fields) + b"\r\n"])) == 431
    fine = b"".join(b"x-f%d: 1\r\n" % i for i in range(5))
    body = json.dumps({"model": "m1", "messages": [{"role": "user", "content": "hi"}]}).encode()
    assert status_of(exchange(gateway, [head(fine + b"connection: close\r\n", len(body)) + b"\r\n" + body])) == 200


def test_slow_headers_are_408(gateway):
    # the head never completes: answered 408 after header_timeout_s, not held open
    answer = exchange(gateway, [head(b"x-slow: 1\r\n")])
    assert status_of(answer) == 408


def test_slow_body_is_408(gateway):
    answer = exchange(gateway, [head(length=100) + b"\r\n" + b'{"model": "m1"'])
    assert status_of(answer) == 408
    error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
    assert (error["code"], error["type"]) == ("request_timeout", "invalid_request_error")   # the client's, a 4xx


@pytest.mark.parametrize("depth", [65, 50_000])
def test_deep_json_is_400(gateway, depth):
    body = b'{"model": "m1", "messages": [{"role": "user", "content": "hi"}], "metadata": ' + b"[" * depth \
        + b"]" * depth + b"}"
    r = httpx.post(gateway.url + "/v1/chat/completions", content=body, timeout=10,
                   headers={"authorization": f"Bearer {KEY}", "content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


def test_metrics_need_the_admin_token_where_keys_exist(gateway):
    assert httpx.get(gateway.url + "/metrics", timeout=5).status_code == 401
    assert httpx.get(gateway.url + "/metrics", timeout=5, headers={"authorization": f"Bearer {KEY}"}).status_code == 401
    r = httpx.get(gateway.url + "/metrics", timeout=5, headers={"authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 200 and "tandem_requests_total" in r.text


def post_encoded(g: GatewayProcess, body: bytes, encoding: str) -> httpx.Response:
    return httpx.post(g.url + "/v1/chat/completions", content=body, timeout=10, headers={
        "authorization": f"Bearer {KEY}", "content-type": "application/json", "content-encoding": encoding})


def test_compressed_bodies_are_decoded_within_the_body_limit(gateway, upstream):
    import gzip
    import zlib

    body = json.dumps({"model": "m1", "messages": [{"role": "user", "content": "hi"}]}).encode()
    assert post_encoded(gateway, gzip.compress(body), "gzip").status_code == 200
    assert post_encoded(gateway, zlib.compress(body), "deflate").status_code == 200
    assert upstream.bodies[-1]["messages"][0]["content"] == "hi"
    # 16 MiB of JSON whitespace in 16 KiB of gzip: refused once the 4 MiB limit is decoded, not inflated whole
    bomb = gzip.compress(body[:-1] + b" " * (16 * 2 ** 20) + b"}")
    r = post_encoded(gateway, bomb, "gzip")
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_unknown_content_encoding_is_415_naming_it(gateway, upstream):
    before = upstream.calls
    r = post_encoded(gateway, b"\x1b\x00\x00", "br")
    assert r.status_code == 415 and "'br'" in r.json()["error"]["message"]
    assert r.json()["error"]["type"] == "invalid_request_error"       # a trial saw server_error on this 4xx
    assert r.headers["accept-encoding"] == "gzip, deflate, identity"
    assert upstream.calls == before


def test_an_error_echoing_a_huge_value_is_bounded(gateway, upstream):
    # a 1 MB model name was answered (and logged) in full in its 404 (a security trial): the message is clipped
    r = httpx.post(gateway.url + "/v1/chat/completions", timeout=10, headers={"authorization": f"Bearer {KEY}"},
                   json={"model": "m" * 1_000_000, "messages": [{"role": "user", "content": "hi"}]})
    error = r.json()["error"]
    assert r.status_code == 404 and error["code"] == "model_not_found"
    assert len(r.content) < 5000 and error["message"].endswith("more characters)")
    # Anthropic's type for a 4xx it has no own type for (415): invalid_request_error, not api_error
    r = httpx.post(gateway.url + "/v1/messages", timeout=10, content=b"\x1b\x00\x00", headers={
        "x-api-key": KEY, "content-type": "application/json", "content-encoding": "br"})
    assert r.status_code == 415 and r.json()["error"]["type"] == "invalid_request_error"


def read_answer(s: socket.socket) -> bytes:
    """One whole answer (head and ``content-length`` body) from ``s``, the connection kept open."""
    out = b""
    while b"\r\n\r\n" not in out:
        out += s.recv(65536) or pytest.fail(f"closed after {out[:200]!r}")
    head_part, rest = out.split(b"\r\n\r\n", 1)
    length = int(next(line.split(b":", 1)[1] for line in head_part.split(b"\r\n")
                      if line.lower().startswith(b"content-length:")))
    while len(rest) < length:
        rest += s.recv(65536) or pytest.fail("closed mid-body")
    return head_part + b"\r\n\r\n" + rest


@pytest.mark.parametrize("key, size, status", [(b"sk-not-a-key", 65536, 401), (KEY.encode(), 5 << 20, 413)])
def test_a_body_left_unread_by_an_early_answer_is_not_the_next_heads(gateway, key, size, status):
    """A 401 answered from the head alone, or a 413 once ``max_body_size`` (4 MiB) is in, the rest of the body
    arriving after the answer: those bytes are the body's, read past by the parser, not the next head's (a
    security trial's follow-up request on the kept-alive connection got 431 "request headers exceed ..." as
    text: one tenant's refused request broke the next)."""
    body = json.dumps({"model": "m1", "messages": [{"role": "user", "content": "a" * size}]}).encode()
    fine = json.dumps({"model": "m1", "messages": [{"role": "user", "content": "hi"}]}).encode()
    first = head(length=len(body)).replace(KEY.encode(), key) + b"\r\n"
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=10) as s:
        s.sendall(first)
        sent = 0
        if status == 413:      # the body up to the limit and a little past it, before the answer
            sent = (4 << 20) + 65536
            s.sendall(body[:sent])
        assert status_of(read_answer(s)) == status
        for i in range(sent, len(body), 65536):     # the rest after the answer, in pieces
            s.sendall(body[i:i + 65536])
        s.sendall(head(length=len(fine)) + b"\r\n" + fine)
        answer = read_answer(s)
    assert status_of(answer) == 200, answer[:300]
