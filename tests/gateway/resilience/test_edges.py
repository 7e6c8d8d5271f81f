"""The gateway's edges against a scripted upstream (tests/gateway/script_upstream.py), read by the official
``openai`` client: SSE as the WHATWG spec writes it (multi-line data, comments, no ``[DONE]`` after every choice
finished), and failures a request causes (an error event naming a 4xx, a value out of range) answered as that
request's 4xx once, never counted against the backend's breaker."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from gateway.resilience.outcomes import answer_head
from tests.gateway.script_upstream import chunk, data, upstream  # noqa: F401 -- upstream: the module-scoped fixture
from tests.gateway.support import GatewayProcess, gateway_on, wait_until

CONFIG = """
models:
  - name: m1
backends:
  up:
    type: openai
    base_url: {url}
    timeouts: {{connect_s: 1, read_s: 5, first_token_s: 3, inter_chunk_s: 0.5}}
routes:
  main:
    targets: [{{backend: up}}]
policy:
  default_route: main
resilience:
  retry: {{max_attempts: 3, deadline_s: 10, backoff_initial_s: 0.01, backoff_max_s: 0.02, jitter_s: 0}}
  breaker: {{consecutive_failures: 4, open_s: 60}}
  health: {{interval_s: 0}}
"""
MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def gateway(upstream, tmp_path_factory):
    yield from gateway_on(tmp_path_factory, "edges", CONFIG.format(url=upstream.base_url))


@pytest.fixture(autouse=True)
def fresh(upstream, gateway):
    upstream.reset()
    yield
    upstream.reset()
    # one success after each test: the breaker (4 consecutive failures) counts one test's failures only
    assert breaker_closed(gateway)


def sdk(g: GatewayProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=g.url + "/v1", api_key="k", max_retries=0, timeout=20)


def stream_text(g: GatewayProcess) -> tuple[str, list]:
    """A streamed chat request read by the SDK: (the content, each chunk's finish_reason)."""
    text, finishes = [], []
    for ev in sdk(g).chat.completions.create(model="m1", messages=MSG, stream=True):
        for ch in ev.choices:
            text.append(ch.delta.content or "")
            finishes.append(ch.finish_reason)
    return "".join(text), finishes


def breaker_closed(g: GatewayProcess) -> bool:
    """The route still serves: a healthy non-streamed call is answered by the upstream after one attempt."""
    r = httpx.post(g.url + "/v1/chat/completions", json={"model": "m1", "messages": MSG}, timeout=20)
    return r.status_code == 200 and r.headers["x-tandem-attempts"] == "1"


def test_multiline_data_reaches_the_sdk_whole(gateway, upstream):
    # One event's JSON spread over three data lines (the spec joins them with newlines), and a "data:" line
    # without the space; the SDK must get every chunk whole.
    first = json.dumps(chunk("Hel"), indent=1).encode().split(b"\n")
    multi = b"".join(b"data: " + line + b"\n" for line in first) + b"\n"
    upstream.push({"parts": [multi, b"data:" + json.dumps(chunk("lo")).encode() + b"\n\n",
                             data(chunk(finish="stop")), b"data: [DONE]\n\n"]})
    text, finishes = stream_text(gateway)
    assert text == "Hello" and finishes[-1] == "stop"


def test_comments_keep_a_stream_alive(gateway, upstream):
    # inter_chunk_s is 0.5: a keep-alive comment every 0.2 s for 1.2 s is traffic, not silence.
    upstream.push({"parts": [data(chunk("a")), *[0.2, b": keep-alive\n\n"] * 6, data(chunk("b")),
                             data(chunk(finish="stop")), b"data: [DONE]\n\n"]})
    text, finishes = stream_text(gateway)
    assert text == "ab" and finishes[-1] == "stop"


def test_silence_still_ends_a_stream(gateway, upstream):
    # the control: the same gap without comments is cut after inter_chunk_s, with the stream_interrupted event
    upstream.push({"parts": [data(chunk("a")), 1.5, data(chunk("b")), b"data: [DONE]\n\n"]})
    with pytest.raises(openai.APIError, match="stream interrupted"):
        stream_text(gateway)


def test_complete_stream_without_done_is_complete(gateway, upstream):
    # every choice has a finish_reason, then the body ends without [DONE]: a success, five times over a
    # breaker that opens after four failures
    for _ in range(5):
        upstream.push({"parts": [data(chunk("x")), data(chunk(finish="stop"))]})
        text, finishes = stream_text(gateway)
        assert text == "x" and finishes[-1] == "stop"
    assert breaker_closed(gateway)


def test_incomplete_stream_without_done_is_interrupted(gateway, upstream):
    upstream.push({"parts": [data(chunk("x"))]})           # no finish_reason, no [DONE]
    with pytest.raises(openai.APIError, match="stream interrupted"):
        stream_text(gateway)


def test_an_error_event_after_content_ends_the_stream_as_a_cut_does(gateway, upstream):
    # after content, an upstream's own error event is a failure like a cut: the same stream_interrupted event
    # (its message quoted), no [DONE], and the same count of streams cut after their 200
    event = {"error": {"message": "engine crashed", "type": "server_error"}}
    ends, counted = {}, [stream_errors(gateway)]
    for name, tail in (("cut", []), ("error", [data(event)])):
        upstream.push({"parts": [data(chunk("a")), *tail]})
        with pytest.raises(openai.APIError) as exc:
            stream_text(gateway)
        ends[name] = exc.value
        counted.append(wait_until(lambda: (n := stream_errors(gateway)) > counted[-1] and n))
    assert [(e.code, e.type) for e in ends.values()] == [("stream_interrupted", "upstream_error")] * 2
    assert ends["error"].message == "stream interrupted: upstream sent an error event: engine crashed"
    assert counted[2] == counted[1] + 1 == counted[0] + 2


def stream_errors(g: GatewayProcess) -> float:
    """``tandem_stream_errors_total`` of the gateway's backend."""
    text = httpx.get(g.url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("tandem_stream_errors_total{"))


@pytest.mark.parametrize("code", [400, "403"])
def test_error_event_naming_a_4xx_passes_through_once(gateway, upstream, code):
    event = {"error": {"message": "flagged by the content filter", "type": "invalid_request_error", "code": code}}
    for _ in range(3):
        upstream.reset()
        upstream.push({"parts": [data(event)]})
        with pytest.raises(openai.APIStatusError) as exc:
            stream_text(gateway)
        assert exc.value.status_code == int(code) and "content filter" in exc.value.message
        assert upstream.calls == 1                       # not retried, not another target
    assert breaker_closed(gateway)


def test_error_event_naming_a_5xx_is_retried(gateway, upstream):
    event = {"error": {"message": "overloaded", "code": 502}}
    upstream.push({"parts": [data(event)]}, {"parts": [data(chunk("ok")), data(chunk(finish="stop"))]})
    text, _ = stream_text(gateway)
    assert text == "ok" and upstream.calls == 2


@pytest.mark.parametrize("field,value", [("seed", 2 ** 70), ("seed", -(2 ** 64)), ("max_tokens", 2 ** 64),
                                         ("n", 10 ** 6), ("temperature", 2 ** 70), ("stop_token_ids", [1, 2 ** 64]),
                                         ("top_k", -2)])
def test_values_out_of_range_are_400s_naming_the_field(gateway, upstream, field, value):
    with pytest.raises(openai.BadRequestError) as exc:
        sdk(gateway).chat.completions.create(model="m1", messages=MSG, extra_body={field: value})
    assert exc.value.body["param"].split("[")[0] == field
    assert upstream.calls == 0


@pytest.mark.parametrize("status,final", [(500, 502), (503, 503)], ids=["failed", "overloaded"])
def test_the_sdk_does_not_retry_what_the_gateway_already_retried(gateway, upstream, status, final):
    # the official client with its default retries (2): one call, at most max_attempts (3) upstream calls; when
    # upstreams are overloaded (503, no Retry-After) too, where the gateway's 503 keeps a Retry-After for the
    # application
    failing = {"status": status, "body": b'{"error": {"message": "boom", "type": "server_error"}}'}
    upstream.push(*[failing] * 12)
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="k", timeout=20)
    with pytest.raises(openai.InternalServerError) as exc:
        client.chat.completions.create(model="m1", messages=MSG)
    headers = exc.value.response.headers
    assert exc.value.status_code == final and headers["x-should-retry"] == "false"
    assert ("retry-after" in headers) == (final == 503)
    assert upstream.calls == 3


@pytest.mark.parametrize("body", [
    b'{"id":"a","usage":{"prompt_tokens":3,"completion_tokens":2},"choices":[]}',
    b'{"error":{"message":"overloaded","code":503}}', b'{"error":null,"usage":null}', b'{"error":"",  "x":1}',
    b'{"error":1,"error":0}', b'{"usage":{"n":123456789012345678901234567890}}', b'{"usage":{"t":NaN}}',
    '{"usage":{"t":1}}'.encode("utf-16"), b'{"usage":"\xed\xa0\x80"}', b'[1]', b'"s"', b'{"a":', b'',
    b'{"a":1} x', b'\xef\xbb\xbf{"a":1}',
])
def test_answer_head_reads_what_json_loads_reads(body):
    """The attempt loop's fast read of a 2xx answer (msgspec, ``json.loads`` for what msgspec refuses) accepts
    exactly what ``json.loads`` does and finds the same ``error`` and ``usage``."""
    try:
        obj = json.loads(body)
        want = (obj.get("error"), obj.get("usage")) if isinstance(obj, dict) else ValueError
    except ValueError:
        want = ValueError
    try:
        head = answer_head(body)
        got = (head.error, head.usage)
    except ValueError:
        got = ValueError
    assert repr(got) == repr(want)
