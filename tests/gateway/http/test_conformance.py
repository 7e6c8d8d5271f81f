"""OpenAI conformance of the gateway over real HTTP (``tandem serve`` subprocess, official ``openai`` client):
JSON null = not given, message content and ``stream_options`` checks, ``x-request-id`` on every response,
``GET /v1/models/{model}``, CORS preflights, and answers that report the client's model and the request id.
The upstreams are ``FaultInjectorUpstream`` (they record what the gateway sent them)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.gateway.support import FaultInjectorUpstream, GatewayProcess, upstream_config

ENV = {"TEST_UPSTREAM_KEY": "upstream-secret-123"}
ROUTES = """  main:
    targets: [{backend: a}]
  none:
    targets: [{backend: b}]
"""
RULES = """    - {name: to-b, match: {header.x-route-b: "1"}, route: none}
"""
MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def upstreams():
    a, b = FaultInjectorUpstream("a").start(), FaultInjectorUpstream("b").start()
    yield a, b
    a.stop()
    b.stop()


@pytest.fixture(scope="module")
def gateway(upstreams, tmp_path_factory):
    a, b = upstreams
    path = tmp_path_factory.mktemp("gw") / "config.yaml"
    path.write_text(upstream_config({"a": a, "b": b}, ROUTES, rules_yaml=RULES,
                                    extra="server: {max_body_size: 64KiB}"))
    g = GatewayProcess(path, env=ENV).start()
    yield g
    g.stop()


@pytest.fixture(autouse=True)
def reset(upstreams):
    for u in upstreams:
        u.set_mode()
        u.calls.clear()


def client(g: GatewayProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=g.url + "/v1", api_key="k", max_retries=0)


def post(g: GatewayProcess, body: dict, endpoint: str = "chat/completions", **headers) -> httpx.Response:
    return httpx.post(f"{g.url}/v1/{endpoint}", json=body, headers=headers, timeout=30)


def sent_request_id(u: FaultInjectorUpstream) -> str | None:
    """The ``x-request-id`` of the upstream's last call (aiohttp spells it ``X-Request-ID``)."""
    return {k.lower(): v for k, v in u.calls[-1]["headers"].items()}.get("x-request-id")


# ----- 6: JSON null means "not given" ----------------------------------------------------------------------------
def test_null_fields_are_not_forwarded(gateway, upstreams):
    a, _ = upstreams
    r = post(gateway, {"model": "m1", "prompt": "Once", "max_tokens": None, "temperature": None, "stop": None,
                       "seed": None, "user": None, "metadata": None, "stream": None}, "completions")
    assert r.status_code == 200, r.text
    sent = a.calls[-1]["body"]
    assert None not in sent.values() and "max_tokens" not in sent    # the upstream applies its own default (16)
    r = post(gateway, {"model": "m1", "messages": MSG, "max_tokens": None, "max_completion_tokens": None,
                       "tools": None, "response_format": None, "stream_options": None, "logprobs": None})
    assert r.status_code == 200, r.text
    assert None not in a.calls[-1]["body"].values()


# ----- 11: content null, stream_options without stream ------------------------------------------------------------
@pytest.mark.parametrize("body,param", [
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    ({"messages": [{"role": "system", "content": "x"}, {"role": "user"}]}, "messages[1].content"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "assistant", "content": None}]}, "messages[0].content"),
    # a text part without its string (a trial: the local engine blamed the part's type, an upstream got it as sent)
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text"),
    ({"messages": [{"role": "user", "content": []}]}, "messages[0].content"),     # OpenAI's 400 (a trial's 200)
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages[0].content[0].text"),
    ({"messages": MSG, "stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": MSG, "stream": False, "stream_options": {"include_usage": True}}, "stream_options"),
    # a field stream_options does not have, or not a boolean (a trial's "maybe" and "foo" were ignored)
    ({"messages": MSG, "stream": True, "stream_options": {"include_usage": True, "foo": 1}}, "stream_options.foo"),
    ({"messages": MSG, "stream": True, "stream_options": {"include_usage": "maybe"}}, "stream_options.include_usage"),
])
def test_invalid_messages_and_stream_options_are_400(gateway, upstreams, body, param):
    r = post(gateway, {"model": "m1", **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert param.split("[")[0] in err["message"]
    assert upstreams[0].calls == []


CALL = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
    {"id": "c2", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}


@pytest.mark.parametrize("messages, param, says", [
    # a tool message answering no call (an app trial's got a 200)
    ([*MSG, {"role": "tool", "tool_call_id": "zzz", "content": "x"}], "messages[1].role", "'zzz' answers none"),
    ([*MSG, CALL, {"role": "tool", "tool_call_id": "c1", "content": "1"},
      {"role": "tool", "tool_call_id": "c3", "content": "3"}], "messages[3].role", "'c3' answers none"),
    # a call no tool message answers before the next message, or by the end
    ([*MSG, CALL, {"role": "tool", "tool_call_id": "c1", "content": "1"}, *MSG], "messages[1].role",
     "did not have response messages: c2"),
    ([*MSG, CALL], "messages[1].role", "did not have response messages: c1, c2"),
    # a tool message without its tool_call_id (a new user's read "None answers none")
    ([*MSG, {"role": "tool", "content": "x"}], "messages[1].tool_call_id", "missing required parameter"),
    # two calls under one id (a user trial: taken)
    ([*MSG, {**CALL, "tool_calls": [CALL["tool_calls"][0], CALL["tool_calls"][0]]},
      {"role": "tool", "tool_call_id": "c1", "content": "1"}], "messages[1].tool_calls[1].id",
     "'c1' is the id of an earlier call"),
])
def test_tool_calls_and_results_pair_as_openai_requires(gateway, upstreams, messages, param, says):
    r = post(gateway, {"model": "m1", "messages": messages})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert says in r.json()["error"]["message"]
    assert upstreams[0].calls == []


def test_parallel_tool_calls_without_tools_is_400(gateway, upstreams):
    r = post(gateway, {"model": "m1", "messages": MSG, "parallel_tool_calls": False})
    assert r.status_code == 400 and r.json()["error"]["param"] == "parallel_tool_calls", r.text
    assert "only allowed when 'tools' are specified" in r.json()["error"]["message"]
    assert upstreams[0].calls == []


def test_assistant_tool_call_without_content_is_accepted(gateway):
    msgs = [*MSG, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    assert post(gateway, {"model": "m1", "messages": msgs}).status_code == 200
    r = post(gateway, {"model": "m1", "messages": MSG, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200


# ----- 7: x-request-id --------------------------------------------------------------------------------------------
def test_request_id_is_echoed_on_every_response(gateway, upstreams):
    a, _ = upstreams
    rid = {"x-request-id": "client-req-42"}
    cases = [
        post(gateway, {"model": "m1", "messages": MSG}, **rid),                                   # 200
        post(gateway, {"model": "m1", "messages": "nope"}, **rid),                                # 400
        post(gateway, {"model": "gpt-9", "messages": MSG}, **rid),                                # 404 model
        httpx.get(gateway.url + "/v1/nope", headers=rid),                                         # 404 path
        post(gateway, {"model": "m1", "messages": [{"role": "user", "content": "x" * 70_000}]}, **rid),  # 413
        httpx.get(gateway.url + "/health/live", headers=rid),
    ]
    assert [r.status_code for r in cases] == [200, 400, 404, 404, 413, 200]
    assert all(r.headers.get("x-request-id") == "client-req-42" for r in cases)
    forwarded = sent_request_id(a)
    assert forwarded.startswith("client-req-42")          # forwarded upstream, made unique per request
    assert cases[0].json()["id"] == f"chatcmpl-{forwarded}"
    a.set_mode(status=503)
    r = post(gateway, {"model": "m1", "messages": MSG}, **rid)
    assert r.status_code == 503 and r.headers["x-request-id"] == "client-req-42"
    assert httpx.get(gateway.url + "/v1/models", headers=rid).headers["x-request-id"] == "client-req-42"


def test_request_id_is_generated_when_absent_and_logged(gateway, upstreams):
    a, _ = upstreams
    r = post(gateway, {"model": "m1", "messages": MSG})
    rid = r.headers["x-request-id"]
    assert rid.startswith("gw-") and sent_request_id(a) == rid
    assert r.json()["id"] == f"chatcmpl-{rid}"
    bad = post(gateway, {"model": "m1", "messages": MSG}, **{"x-request-id": "no spaces allowed"})
    assert bad.headers["x-request-id"].startswith("gw-")     # an unusable id is replaced, not echoed
    lines = [json.loads(ln) for ln in gateway.log().splitlines() if ln.startswith("{")]
    assert any(ln.get("request_id") == rid for ln in lines)


# ----- 8: GET /v1/models/{model} ----------------------------------------------------------------------------------
def test_models_retrieve(gateway):
    c = client(gateway)
    assert c.models.retrieve("m1").id == "m1"
    assert c.models.retrieve("alias1").id == "alias1"
    with pytest.raises(openai.NotFoundError) as e:
        c.models.retrieve("gpt-9")
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"


# ----- 10: the client's model and the request id in every answer -------------------------------------------------
def test_relayed_answers_report_the_public_model_and_request_id(gateway, upstreams):
    c = client(gateway)
    raw = c.chat.completions.with_raw_response.create(model="alias1", messages=MSG)
    reply, rid = raw.parse(), raw.headers["x-request-id"]
    assert reply.model == "m1" and reply.id == f"chatcmpl-{rid}"     # upstream said a-model / cmpl-fault
    assert upstreams[0].calls[-1]["body"]["model"] == "a-model"
    with c.chat.completions.with_streaming_response.create(model="m1", messages=MSG, stream=True,
                                                           extra_body={"metadata": {"chunks": "4"}}) as resp:
        rid = resp.headers["x-request-id"]
        chunks = list(resp.parse())
    assert len(chunks) == 4
    assert {(ch.model, ch.id) for ch in chunks} == {("m1", f"chatcmpl-{rid}")}
    comp = c.completions.with_raw_response.create(model="m1", prompt="x")
    assert comp.parse().id == f"cmpl-{comp.headers['x-request-id']}" and comp.parse().model == "m1"


# ----- 9: CORS ----------------------------------------------------------------------------------------------------
PREFLIGHT = {"origin": "https://app.example.com", "access-control-request-method": "POST",
             "access-control-request-headers": "authorization, content-type"}


def test_cors_is_off_by_default(gateway):
    r = httpx.options(gateway.url + "/v1/chat/completions", headers=PREFLIGHT)
    assert "access-control-allow-origin" not in r.headers


def test_cors_preflight_answered_when_configured(upstreams, tmp_path):
    a, b = upstreams
    path = tmp_path / "config.yaml"
    path.write_text(upstream_config({"a": a, "b": b}, ROUTES, extra=(
        "server: {cors: {allow_origins: [https://app.example.com], max_age: 120}}")))
    g = GatewayProcess(path, env=ENV).start()
    try:
        r = httpx.options(g.url + "/v1/chat/completions", headers=PREFLIGHT)
        assert r.status_code in (200, 204), r.text
        assert r.headers["access-control-allow-origin"] == "https://app.example.com"
        assert "POST" in r.headers["access-control-allow-methods"]
        assert "authorization" in r.headers["access-control-allow-headers"].lower()
        assert r.headers["access-control-max-age"] == "120"
        ok = post(g, {"model": "m1", "messages": MSG}, origin="https://app.example.com")
        assert ok.headers["access-control-allow-origin"] == "https://app.example.com"
        assert "x-request-id" in ok.headers["access-control-expose-headers"]
        other = httpx.options(g.url + "/v1/chat/completions", headers={**PREFLIGHT, "origin": "https://evil.test"})
        assert other.headers.get("access-control-allow-origin") != "https://evil.test"
    finally:
        g.stop()
