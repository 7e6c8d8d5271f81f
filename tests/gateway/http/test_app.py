"""The gateway over real HTTP: ``tandem serve`` as a subprocess, the official
``openai`` client (sync, async, streaming), bad input, auth, fallback,
admin API, CLI. Upstreams here are ``FaultInjectorUpstream`` (fault
injection / latency only); answers from a real model are tested in
``test_gateway_engine.py``."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import time

import httpx
import openai
import pytest

from tests.gateway.support import ROOT, FaultInjectorUpstream, GatewayProcess, free_port, upstream_config

KEY_ENV = {"TEST_UPSTREAM_KEY": "upstream-secret-123", "TANDEM_ADMIN_TOKEN": "admin-tok"}
ROUTES = """  main:
    targets: [{backend: a, weight: 100}, {backend: b, weight: 0}]
    fallbacks: [{backend: b}]
  only-b:
    targets: [{backend: b}]
"""
RULES = """    - {name: to-b, match: {header.x-route-b: "1"}, route: only-b}
    - {name: low, match: {priority: low}, route: only-b}
"""


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
    g = GatewayProcess(path, env=KEY_ENV).start()
    yield g
    g.stop()


@pytest.fixture(autouse=True)
def reset_upstreams(upstreams):
    for u in upstreams:
        u.set_mode()
        u.calls.clear()
        u.abandoned = 0


def client(g: GatewayProcess, key: str = "client-key-xyz", **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=g.url + "/v1", api_key=key, max_retries=0, **kw)


def test_sync_chat_maps_model_and_never_forwards_client_key(gateway, upstreams):
    a, _ = upstreams
    raw = client(gateway).chat.completions.with_raw_response.create(
        model="alias1", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
        extra_body={"priority": "normal"})
    resp = raw.parse()
    assert resp.choices[0].message.content == "hello from a"
    assert raw.headers["x-tandem-backend"] == "a"
    assert raw.headers["x-tandem-route"] == "main"
    assert raw.headers["x-tandem-attempts"] == "1"
    call = a.calls[-1]
    assert call["headers"]["Authorization"] == "Bearer upstream-secret-123"
    assert "client-key-xyz" not in json.dumps(call)
    assert call["body"]["model"] == "a-model"          # public alias -> upstream model
    assert "priority" not in call["body"]               # gateway-only field
    assert call["headers"]["x-extra"] == "from-a"


async def test_async_chat_and_stream(gateway):
    c = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="k", max_retries=0)
    r = await c.chat.completions.create(model="m1", messages=[{"role": "user", "content": "hi"}])
    assert r.choices[0].message.content == "hello from a"
    stream = await c.chat.completions.create(model="m1", messages=[{"role": "user", "content": "hi"}], stream=True,
                                             extra_body={"metadata": {"chunks": "5"}})
    pieces = [ch.choices[0].delta.content async for ch in stream]
    assert pieces == [f"tok{i} " for i in range(5)]
    await c.close()


def test_stream_is_relayed_chunk_by_chunk(gateway):
    # 4 chunks 0.3 s apart: the first must arrive long before the last is sent.
    body = {"model": "m1", "messages": [{"role": "user", "content": "x"}], "stream": True,
            "metadata": {"chunks": "4", "chunk_delay": "0.3"}}
    times = []
    with httpx.stream("POST", gateway.url + "/v1/chat/completions", json=body, timeout=30) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-tandem-backend"] == "a"
        for line in r.iter_lines():
            if line.startswith("data: "):
                times.append((time.monotonic(), line))
    assert times[-1][1] == "data: [DONE]"
    assert len(times) == 5
    assert times[-1][0] - times[0][0] > 0.6      # spread over time, not buffered whole


def test_completions_sync_and_stream(gateway):
    c = client(gateway)
    assert c.completions.create(model="m1", prompt="Once").choices[0].text == "hello from a"
    texts = [ch.choices[0].text for ch in c.completions.create(model="m1", prompt="Once", stream=True)]
    assert texts == ["tok0 ", "tok1 ", "tok2 "]


def test_models_lists_public_names(gateway):
    assert [m.id for m in client(gateway).models.list()] == ["m1"]
    # HEAD wherever GET is (RFC 9110; a trial's uptime check got 405 here and 200 on /health/ready)
    for path in ("/v1/models", "/v1/models/m1"):
        r = httpx.head(gateway.url + path)
        assert r.status_code == 200 and r.content == b"" and r.headers["content-type"] == "application/json", path
    assert httpx.head(gateway.url + "/v1/models/nope").status_code == 404
    card = httpx.get(gateway.url + "/v1/models").json()["data"][0]   # vLLM's ModelCard fields: a real time
    assert card["root"] == "m1" and abs(card["created"] - time.time()) < 600


def test_tokenize_without_a_local_engine_says_why(gateway):
    """vLLM's /tokenize and /detokenize need the local engine's tokenizer: a gateway of upstreams only answers a
    404 saying so, in OpenAI's format (an unknown model: model_not_found first)."""
    r = httpx.post(gateway.url + "/tokenize", json={"model": "m1", "prompt": "hi"})
    assert r.status_code == 404 and "no local backend" in r.json()["error"]["message"], r.text
    r = httpx.post(gateway.url + "/detokenize", json={"model": "nope", "tokens": [1]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text


@pytest.mark.parametrize("body,status,param", [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    (b"", 400, None),
    (json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode(), 400, "model"),
    (json.dumps({"model": "m1"}).encode(), 400, "messages"),
    (json.dumps({"model": "m1", "messages": "hi"}).encode(), 400, "messages"),
    (json.dumps({"model": "m1", "messages": [{"content": "x"}]}).encode(), 400, "messages[0].role"),
    (json.dumps({"model": "m1", "messages": [{"role": "wizard", "content": "x"}]}).encode(), 400,
     "messages[0].role"),
    (json.dumps({"model": "m1", "messages": [{"role": "user", "content": "x"}], "max_tokens": "9"}).encode(),
     400, "max_tokens"),
    (json.dumps({"model": "m1", "messages": [{"role": "user", "content": "x"}], "stream": "yes"}).encode(),
     400, "stream"),
    (json.dumps({"model": "m1", "messages": [{"role": "user", "content": "x"}], "temperature": True}).encode(),
     400, "temperature"),
    (json.dumps({"model": "m1", "messages": [{"role": "user", "content": "x"}], "priority": "urgent"}).encode(),
     400, "priority"),
    (json.dumps({"model": 5, "messages": [{"role": "user", "content": "x"}]}).encode(), 400, "model"),
    (json.dumps({"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}).encode(), 404, "model"),
    # OpenAI's metadata: string values (an API trial's {"a": 1} was forwarded), at most 16 pairs
    (json.dumps({"model": "m1", "messages": [{"role": "user", "content": "x"}], "metadata": {"a": 1}}).encode(),
     400, "metadata.a"),
    (json.dumps({"model": "m1", "messages": [{"role": "user", "content": "x"}],
                 "metadata": {f"k{i}": "v" for i in range(17)}}).encode(), 400, "metadata"),
    (json.dumps({"model": "m1", "messages": [{"role": "user", "content": "x"}],
                 "metadata": {"a": "v" * 513}}).encode(), 400, "metadata.a"),
])
def test_bad_input_gets_openai_errors(gateway, upstreams, body, status, param):
    r = httpx.post(gateway.url + "/v1/chat/completions", content=body,
                   headers={"content-type": "application/json"})
    assert r.status_code == status
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param
    if param:
        assert param.split("[")[0] in err["message"]
    assert upstreams[0].calls == []


def test_completion_prompt_required(gateway):
    r = httpx.post(gateway.url + "/v1/completions", json={"model": "m1"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_body_over_limit_is_413_and_gateway_keeps_serving(gateway):
    big = {"model": "m1", "messages": [{"role": "user", "content": "x" * 70_000}]}
    r = httpx.post(gateway.url + "/v1/chat/completions", json=big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():   # no content-length: counted while streaming in
        yield b'{"model": "m1", "messages": [{"role": "user", "content": "'
        for _ in range(20):
            yield b"y" * 8192
        yield b'"}]}'
    r = httpx.post(gateway.url + "/v1/chat/completions", content=chunks())
    assert r.status_code == 413
    assert client(gateway).chat.completions.create(
        model="m1", messages=[{"role": "user", "content": "still there?"}]).choices[0].message.content


def test_unknown_path_is_openai_404(gateway):
    r = httpx.get(gateway.url + "/v1/nope")
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"  # as OpenAI answers


def test_fallback_on_503_and_passthrough_of_400(gateway, upstreams):
    a, b = upstreams
    a.set_mode(status=503)
    raw = client(gateway).chat.completions.with_raw_response.create(
        model="m1", messages=[{"role": "user", "content": "hi"}])
    assert raw.parse().choices[0].message.content == "hello from b"
    assert raw.headers["x-tandem-backend"] == "b" and raw.headers["x-tandem-attempts"] == "2"
    a.set_mode(status=400)
    with pytest.raises(openai.BadRequestError):
        client(gateway).chat.completions.create(model="m1", messages=[{"role": "user", "content": "hi"}])
    assert len(b.calls) == 1 and len(a.calls) == 2     # the 400 was not retried elsewhere
    a.set_mode(status=500)
    b.set_mode(status=502)
    r = httpx.post(gateway.url + "/v1/chat/completions", json={"model": "m1", "messages": [{"role": "user",
                                                                                              "content": "x"}]})
    assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_failed"
    assert "upstream-secret-123" not in r.text


def test_rules_route_by_header_and_priority(gateway):
    c = client(gateway)
    raw = c.chat.completions.with_raw_response.create(model="m1", messages=[{"role": "user", "content": "x"}],
                                                      extra_headers={"x-route-b": "1"})
    assert raw.headers["x-tandem-backend"] == "b" and raw.headers["x-tandem-rule"] == "to-b"
    raw = c.chat.completions.with_raw_response.create(model="m1", messages=[{"role": "user", "content": "x"}],
                                                      extra_headers={"x-priority": "low"})
    assert raw.headers["x-tandem-route"] == "only-b"
    raw = c.chat.completions.with_raw_response.create(model="m1", messages=[{"role": "user", "content": "x"}],
                                                      extra_body={"priority": 1})
    assert raw.headers["x-tandem-route"] == "only-b"


def test_health(gateway):
    assert httpx.get(gateway.url + "/health/live").status_code == 200
    r = httpx.get(gateway.url + "/health/ready")
    assert r.status_code == 200 and r.json()["backends"]["a"]["available"]
    # the names LiteLLM's and vLLM's probes use (an SRE's trial got 404 on each), and vLLM's /version
    assert httpx.get(gateway.url + "/health/liveliness").json() == {"status": "ok"}
    for path in ("/health/readiness", "/health", "/ping"):
        assert httpx.get(gateway.url + path).json()["status"] == "ready"
    assert httpx.post(gateway.url + "/ping").json()["status"] == "ready"   # vLLM's (SageMaker's) POST too
    from engine.protocol.version import tandem_version

    assert httpx.get(gateway.url + "/version").json() == {"version": tandem_version()} != {"version": "unknown"}


def ctl(g: GatewayProcess, *args: str, token: str | None = "admin-tok") -> subprocess.CompletedProcess:
    env = {**os.environ, "TANDEM_ADMIN_TOKEN": token or ""}
    return subprocess.run([sys.executable, "-m", "gateway.commands", "ctl", "--url", g.url, *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=60)


def test_admin_requires_token(gateway):
    for path in ("/admin/reload", "/admin/rollback", "/admin/weights", "/admin/drain"):
        r = httpx.post(gateway.url + path, headers={"authorization": "Bearer wrong"})
        assert r.status_code == 401, path
    r = httpx.get(gateway.url + "/admin/config")
    assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")   # RFC 6750's challenge
    assert ctl(gateway, "config", token="nope").returncode == 1
    admin = {"authorization": "Bearer admin-tok"}
    # the config's text and the fleet's state are never kept by a browser or proxy (a console trial found them
    # cacheable)
    assert httpx.get(gateway.url + "/admin/config", headers=admin).headers["cache-control"] == "no-store"
    r = httpx.post(gateway.url + "/admin/weights", headers=admin, json={"route": "main", "weights": {"a": 50},
                                                                       "bogus": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "bogus"      # an unknown field is not ignored
    r = httpx.post(gateway.url + "/admin/weights", headers=admin, json={"route": "main", "weights": {"nope": 5}})
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and message.startswith("route 'main' has no target 'nope'"), message   # said once


def test_ctl_weights_and_rollback(gateway):
    c = client(gateway)

    def backends(n=30):
        return {c.chat.completions.with_raw_response.create(
            model="m1", messages=[{"role": "user", "content": "x"}], user=f"user{i}").headers["x-tandem-backend"]
            for i in range(n)}

    assert backends() == {"a"}
    r = ctl(gateway, "weights", "main", "a=0", "b=100")
    assert r.returncode == 0, r.stderr
    assert backends() == {"b"}
    r = ctl(gateway, "weights", "main", "zzz=5")
    assert r.returncode == 1 and "zzz" in r.stderr
    r = ctl(gateway, "rollback")
    assert r.returncode == 0, r.stderr
    assert backends() == {"a"}
    cfg = json.loads(ctl(gateway, "config").stdout)
    assert cfg["routes"]["main"]["targets"][0]["weight"] == 100
    assert [h["source"] for h in cfg["history"]][:1] == ["rollback"]


def test_route_explain_cli(gateway, tmp_path):
    req = tmp_path / "req.json"
    req.write_text(json.dumps({"model": "alias1", "messages": [{"role": "user", "content": "x"}], "user": "u1",
                               "priority": "low"}))
    r = subprocess.run([sys.executable, "-m", "gateway.commands", "route", "explain", "--config",
                        gateway.config_path, "--request", str(req)], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "TEST_UPSTREAM_KEY": "x"}, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "matched rule: low -> route only-b" in r.stdout and "attempts: b" in r.stdout


# ----- separate gateways ------------------------------------------------------------------------------------------

def test_virtual_keys_and_tenant_rules(upstreams, tmp_path):
    a, b = upstreams
    good = "sk-tenant-alpha"
    keys = (f"auth:\n  keys:\n    - {{tenant: alpha, sha256: {hashlib.sha256(good.encode()).hexdigest()}}}\n"
            "    - {tenant: beta, env: BETA_KEY}\n    - {tenant: gamma, env: GAMMA_KEY_UNSET}\n")
    rules = "    - {name: beta-to-b, match: {tenant: beta}, route: only-b}\n"
    path = tmp_path / "keys.yaml"
    path.write_text(upstream_config({"a": a, "b": b}, ROUTES, extra=keys, rules_yaml=rules))
    g = GatewayProcess(path, env={**KEY_ENV, "BETA_KEY": "sk-beta"}).start()
    try:
        for key in ("wrong", ""):
            with pytest.raises(openai.AuthenticationError):
                openai.OpenAI(base_url=g.url + "/v1", api_key=key or "x", max_retries=0,
                              default_headers={} if key else {"authorization": ""}).chat.completions.create(
                    model="m1", messages=[{"role": "user", "content": "x"}])
        r = httpx.get(g.url + "/v1/models")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        raw = client(g, good).chat.completions.with_raw_response.create(
            model="m1", messages=[{"role": "user", "content": "x"}])
        assert raw.headers["x-tandem-backend"] == "a"
        raw = client(g, "sk-beta").chat.completions.with_raw_response.create(
            model="m1", messages=[{"role": "user", "content": "x"}])
        assert raw.headers["x-tandem-backend"] == "b" and raw.headers["x-tandem-rule"] == "beta-to-b"
        assert "GAMMA_KEY_UNSET" in g.log()     # reported at start-up
    finally:
        g.stop()


def test_unset_upstream_key_marks_backend_unavailable(upstreams, tmp_path):
    a, b = upstreams
    text = upstream_config({"a": a, "b": b}, ROUTES).replace(
        "api_key_env: TEST_UPSTREAM_KEY\n    models: {m1: a-model}",
        "api_key_env: A_KEY_UNSET\n    models: {m1: a-model}")
    path = tmp_path / "unset.yaml"
    path.write_text(text)
    g = GatewayProcess(path, env=KEY_ENV).start()
    try:
        ready = httpx.get(g.url + "/health/ready").json()
        assert ready["backends"]["a"] == {"available": False,
                                          "reason": "environment variable A_KEY_UNSET is unset"}
        raw = client(g).chat.completions.with_raw_response.create(model="m1",
                                                                  messages=[{"role": "user", "content": "x"}])
        assert raw.headers["x-tandem-backend"] == "b" and raw.headers["x-tandem-attempts"] == "1"
        assert a.calls == []
        assert "backend a unavailable: environment variable A_KEY_UNSET is unset" in g.log()
    finally:
        g.stop()


def test_public_bind_without_keys_is_refused(upstreams, tmp_path):
    a, b = upstreams
    path = tmp_path / "open.yaml"
    path.write_text(upstream_config({"a": a, "b": b}, ROUTES))
    r = subprocess.run([sys.executable, "-m", "gateway.commands", "serve", "--config", str(path), "--host", "0.0.0.0",
                        "--port", str(free_port())], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "refusing to bind 0.0.0.0" in r.stderr


def test_a_change_that_removes_every_key_closes_an_exposed_gateway(upstreams, tmp_path):
    # Started on 0.0.0.0 with one key, then a reload to no key (a trial: every request was then served to
    # anyone, /metrics too): the gateway fails closed, 401 for every request, until a key is configured again.
    a, b = upstreams
    key = "sk-team-a-0123456789"
    keyed = f"auth:\n  keys:\n    - {{tenant: team-a, sha256: {hashlib.sha256(key.encode()).hexdigest()}}}\n"
    path = tmp_path / "exposed.yaml"
    path.write_text(upstream_config({"a": a, "b": b}, ROUTES, extra=keyed))
    g = GatewayProcess(path, env=KEY_ENV, extra_args=["--host", "0.0.0.0"]).start()
    try:
        msgs = [{"role": "user", "content": "x"}]
        assert client(g, key).chat.completions.create(model="m1", messages=msgs).choices[0].message.content
        path.write_text(upstream_config({"a": a, "b": b}, ROUTES, extra="auth: {keys: []}\n"))
        _wait_for(lambda: "no virtual API key" in httpx.get(g.url + "/v1/models").text)   # the watcher applied it
        calls = len(a.calls) + len(b.calls)
        for k in (key, "anything"):
            with pytest.raises(openai.AuthenticationError) as e:
                client(g, k).chat.completions.create(model="m1", messages=msgs)
            assert "no virtual API key is configured" in e.value.body["message"]
        assert len(a.calls) + len(b.calls) == calls                          # nothing reached an upstream
        assert httpx.get(g.url + "/metrics").status_code == 401               # the admin token, as with keys
        assert httpx.get(g.url + "/metrics", headers={"authorization": "Bearer admin-tok"}).status_code == 200
        assert "no virtual API key is configured" in g.log()                  # the operator is told
        path.write_text(upstream_config({"a": a, "b": b}, ROUTES, extra=keyed))
        _wait_for(lambda: httpx.get(g.url + "/v1/models", headers={"authorization": f"Bearer {key}"}).status_code
                  == 200)
        assert httpx.get(g.url + "/v1/models").status_code == 401
    finally:
        g.stop()


def _wait_for(condition, guard_s: float = 60.0) -> None:
    """Poll ``condition()`` until true (``guard_s``: a liveness bound, not a timing claim)."""
    deadline = time.monotonic() + guard_s
    while not condition():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.02)


def test_drain_on_sigterm_finishes_in_flight(upstreams, tmp_path):
    import concurrent.futures

    a, b = upstreams
    path = tmp_path / "drain.yaml"
    path.write_text(upstream_config({"a": a, "b": b}, ROUTES))
    g = GatewayProcess(path, env=KEY_ENV).start()
    try:
        body = {"model": "m1", "messages": [{"role": "user", "content": "x"}], "metadata": {"delay": "1.5"}}
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            slow = [pool.submit(httpx.post, g.url + "/v1/chat/completions", json=body, timeout=30) for _ in range(3)]
            # SIGTERM once all three are in flight (a fixed sleep sent it before they connected on a loaded host)
            _wait_for(lambda: "tandem_requests_in_flight 3.0" in httpx.get(g.url + "/metrics").text)
            g.proc.terminate()                       # SIGTERM
            _wait_for(lambda: httpx.get(g.url + "/health/ready").json()["draining"])
            r = httpx.get(g.url + "/health/ready")
            assert r.status_code == 503 and r.json()["draining"] is True
            r = httpx.post(g.url + "/v1/chat/completions", json={**body, "metadata": {}})
            assert r.status_code == 503 and r.json()["error"]["code"] == "draining"
            # counted and logged as any refusal (an SRE trial: a rolling deploy's 503s left no trace)
            assert 'status="503"' in httpx.get(g.url + "/metrics").text
            assert [f.result().status_code for f in slow] == [200, 200, 200]
        g.proc.wait(20)
        assert "drained: 0 stream(s) cut with stream_interrupted, 0 request(s) still in flight" in g.log()
        assert '"status":503' in g.log() and '"error":"draining"' in g.log()
    finally:
        g.stop()


async def test_a_second_drain_while_one_runs_starts_none():
    """Two SIGTERMs (a process group's, then make's) or ``ctl drain`` twice: one drain, one ``on_drained``."""
    import asyncio

    from gateway.config.compile import load_config_text
    from gateway.runtime import Gateway

    gw = Gateway(None, load_config_text(
        "reload: {watch: false}\nresilience: {health: {interval_s: 0}}\nmodels: [{name: m}]\n"
        "backends: {a: {type: openai, base_url: 'http://127.0.0.1:9/v1'}}\n"
        "routes: {r: {targets: [{backend: a}]}}\npolicy: {default_route: r}\n"), start_engine=False)
    drained = []
    gw.on_drained = lambda: drained.append(gw.in_flight)
    gw.in_flight = 1
    first = asyncio.ensure_future(gw.drain(timeout=30))
    second = asyncio.ensure_future(gw.drain(timeout=30))
    await asyncio.sleep(0.2)
    assert second.done() and second.result() == 1 and not first.done()   # the second returned at once
    gw.in_flight = 0
    assert await first == 0 and drained == [0]
    await gw.stop()


def test_client_disconnect_cancels_the_upstream_call(gateway, upstreams):
    a, _ = upstreams
    body = {"model": "m1", "messages": [{"role": "user", "content": "x"}], "metadata": {"delay": "1.5"}}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(gateway.url + "/v1/chat/completions", json=body, timeout=0.4)   # the client gives up
    deadline = time.monotonic() + 10
    while not a.abandoned and time.monotonic() < deadline:
        time.sleep(0.1)
    assert a.abandoned == 1            # the gateway closed its upstream connection too


def test_the_docs_list_the_model_endpoints_that_models_returns():
    from gateway.http.app import MODEL_ENDPOINTS

    text = (ROOT / "docs" / "app-teams" / "embeddings.md").read_text()
    listed = re.search(r"the endpoints it is served on \(`endpoints`: (.*?)\)\.", text, re.S)
    assert listed is not None and re.findall(r"`([^`]+)`", listed.group(1)) == list(MODEL_ENDPOINTS)


def test_a_serve_that_finds_its_port_taken_changes_nothing_shared(upstreams, tmp_path, redis_url):
    """An SRE's trial: a second ``tandem serve`` on a busy port published its config file to the replicas'
    shared state (the app's startup ran before uvicorn bound the port), so the running replica took it, then the
    second process exited 3. The port is bound first now: exit 3, the reason said, nothing published."""
    a, b = upstreams
    state = f"state: {{redis_url: '{redis_url}', key_prefix: busy{os.getpid()}, sync_interval_s: 0.2}}\n"
    path = tmp_path / "running.yaml"
    path.write_text(upstream_config({"a": a, "b": b}, ROUTES, extra=state))
    g = GatewayProcess(path, env=KEY_ENV).start()
    try:
        version, applied = httpx.get(g.url + "/health/ready").json()["config_version"], g.log().count("applied")
        other = tmp_path / "other.yaml"
        other.write_text(path.read_text().replace("weight: 100}, {backend: b, weight: 0}",
                                                  "weight: 0}, {backend: b, weight: 100}"))
        r = subprocess.run([sys.executable, "-m", "gateway.commands", "serve", "--config", str(other),
                            "--port", str(g.port)], cwd=ROOT, capture_output=True, text=True, timeout=60,
                           env={**os.environ, **KEY_ENV})
        assert r.returncode == 3 and f"cannot listen on 127.0.0.1:{g.port}: " in r.stderr, r.stderr
        assert "applied" not in r.stderr, r.stderr
        time.sleep(1.0)   # five of the running replica's syncs: a published change would have been taken
        assert httpx.get(g.url + "/health/ready").json()["config_version"] == version
        assert g.log().count("applied") == applied, g.log()
    finally:
        g.stop()


def test_a_tenants_min_priority_raises_what_its_requests_ask_for(upstreams, tmp_path):
    """A security trial's tenant sent ``x-priority: -9223372036854775808`` and jumped every other tenant's queue on
    the engine's priority scheduling. ``limits.tenants.<t>.min_priority`` raises a more urgent ask to it, for
    routing and the engine alike, on the live path and ``tandem route explain --config``; others keep theirs."""
    a, b = upstreams
    keys = ("auth:\n  keys:\n    - {tenant: alpha, env: ALPHA_KEY}\n    - {tenant: beta, env: BETA_KEY}\n"
            "limits:\n  tenants:\n    beta: {min_priority: 0}\n")
    path = tmp_path / "floor.yaml"
    path.write_text(upstream_config({"a": a, "b": b}, ROUTES, extra=keys))
    g = GatewayProcess(path, env={**KEY_ENV, "ALPHA_KEY": "sk-alpha", "BETA_KEY": "sk-beta"}).start()
    try:
        body = {"model": "m1", "messages": [{"role": "user", "content": "x"}]}
        admin = {"authorization": "Bearer admin-tok"}
        asked = {"alpha": -9223372036854775808, "beta": 0}
        for tenant, priority in asked.items():
            r = httpx.post(g.url + "/admin/explain", headers=admin, json={
                "request": body, "headers": {"x-priority": "-9223372036854775808"}, "tenant": tenant})
            assert r.status_code == 200 and r.json()["priority"] == priority, r.text
        for bad, param in (({"request": "x"}, "request"), ({"request": body, "tenant": 5}, "tenant")):
            r = httpx.post(g.url + "/admin/explain", headers=admin, json=bad)   # a trial's had code null
            assert (r.status_code, r.json()["error"]["param"], r.json()["error"]["code"]) == (400, param,
                                                                                          "invalid_type")
        # each endpoint's body as the gateway routes it (a policy trial: embeddings and Responses bodies were
        # refused, a Messages body explained as chat with its metadata.user_id canary key unread)
        messages = {"model": "m1", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}],
                    "metadata": {"user_id": "u-12"}}
        for spec in ({"request": messages, "endpoint": "messages"}, {"request": {"model": "m1", "input": "x"}},
                     {"request": {"model": "m1", "input": "x"}, "endpoint": "responses"}):
            r = httpx.post(g.url + "/admin/explain", headers=admin, json={**spec, "tenant": "alpha"})
            assert r.status_code == 200 and r.json()["public_model"] == "m1", r.text
        assert "u-12" in httpx.post(g.url + "/admin/explain", headers=admin, json={
            "request": messages, "endpoint": "messages", "tenant": "alpha"}).json()["decision"]["canary_key"]
        r = httpx.post(g.url + "/admin/explain", headers=admin, json={"request": body, "endpoint": "audio"})
        assert (r.status_code, r.json()["error"]["param"]) == (400, "endpoint"), r.text
        req = tmp_path / "req.json"
        req.write_text(json.dumps({**body, "priority": "high"}))
        r = subprocess.run([sys.executable, "-m", "gateway.commands", "route", "explain", "--config", str(path),
                            "--request", str(req), "--tenant", "beta"], cwd=ROOT, capture_output=True, text=True,
                           env={**os.environ, **KEY_ENV}, timeout=60)
        assert r.returncode == 0 and "priority 0;" in r.stdout, r.stdout + r.stderr
    finally:
        g.stop()
