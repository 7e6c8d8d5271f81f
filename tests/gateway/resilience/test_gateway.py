"""Failure scenarios through real gateway processes (``tandem serve``), the official ``openai`` client, a real
Redis, and fault-injecting upstreams (tests/gateway/fault_upstream.py)."""

from __future__ import annotations

import json
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import redis

from tests.conftest import free_port
from tests.gateway.fault_upstream import FaultUpstream
from tests.gateway.support import GatewayProcess, sha, wait_until

KEY, LIMITED_KEY = "sk-tandem-main", "sk-tandem-limited"
ENV = {"TEST_UPSTREAM_KEY": "upstream-secret", "TANDEM_ADMIN_TOKEN": "admin-tok"}
ADMIN_AUTH = {"authorization": "Bearer admin-tok"}
SCENARIOS = ["s503", "s400", "scut", "sboth", "serrfirst", "sstall", "s429", "shung", "shealthy", "sshared",
             "sdisc", "soutage", "shead", "s429one"]


def gateway_config(ups: dict[str, FaultUpstream], redis_url: str | None, prefix: str, dead_port: int) -> str:
    backends = "".join(
        f"  {name}:\n    type: openai\n    base_url: {u.base_url}\n    api_key_env: TEST_UPSTREAM_KEY\n"
        f"    timeouts: {{connect_s: 1, read_s: 1.5, first_token_s: 2, inter_chunk_s: 5}}\n"
        for name, u in ups.items())
    backends += (f"  dead:\n    type: openai\n    base_url: http://127.0.0.1:{dead_port}/v1\n"
                 f"    timeouts: {{connect_s: 1, read_s: 1.5, first_token_s: 2}}\n"
                 # the primary again, its headers awaited past the first-token timeout (the loop's, not httpx's)
                 f"  slowhead:\n    type: openai\n    base_url: {ups['primary'].base_url}\n"
                 f"    api_key_env: TEST_UPSTREAM_KEY\n    timeouts: {{connect_s: 1, read_s: 10, first_token_s: 1}}\n")
    routes, rules, models = "", "", ""
    for s in SCENARIOS:
        models += f"  - name: {s}\n"
        rules += f"    - {{name: r-{s}, match: {{model: {s}}}, route: {s}}}\n"
        if s == "shung":
            first, then = "dead", ["hung", "fallback"]
        elif s in ("shealthy", "s429one"):
            first, then = "fallback", []
        elif s == "shead":
            first, then = "slowhead", ["fallback"]
        else:
            first, then = "primary", ["fallback"]
        fallbacks = ", ".join(f"{{backend: {b}, model: {s}}}" for b in then)
        routes += f"  {s}:\n    targets: [{{backend: {first}, model: {s}}}]\n    fallbacks: [{fallbacks}]\n"
    state = f"state: {{redis_url: '{redis_url}', key_prefix: {prefix}, socket_timeout_s: 0.25}}\n" if redis_url else ""
    return (f"{state}"
            f"auth:\n  keys:\n    - {{tenant: main, sha256: {sha(KEY)}, tpm: 100000000}}\n"
            f"    - {{tenant: limited, sha256: {sha(LIMITED_KEY)}}}\n"
            f"limits:\n  tenants: {{limited: {{rpm: 10}}}}\n"
            f"resilience:\n  retry: {{max_attempts: 4, deadline_s: 20, backoff_initial_s: 0.05, backoff_max_s: 0.2,"
            f" max_retry_after_s: 2}}\n"
            f"  breaker: {{consecutive_failures: 5, open_s: 30, rate_limit_cooldown_s: 60}}\n"
            f"  health: {{interval_s: 0}}\n"
            f"models:\n{models}backends:\n{backends}routes:\n{routes}"
            f"policy:\n  default_route: s503\n  rules:\n{rules}")


@pytest.fixture(scope="module")
def ups():
    us = {n: FaultUpstream(n).start() for n in ("primary", "fallback", "hung")}
    yield us
    for u in us.values():
        u.stop()


@pytest.fixture(autouse=True)
def reset(ups):
    for u in ups.values():
        u.reset()


@pytest.fixture(scope="module")
def prefix():
    return f"gw{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def gateways(ups, redis_url, prefix, tmp_path_factory):
    """Two gateway processes sharing one Redis."""
    path = tmp_path_factory.mktemp("resil") / "config.yaml"
    path.write_text(gateway_config(ups, redis_url, prefix, free_port()))
    procs = [GatewayProcess(path, env=ENV), GatewayProcess(path, env=ENV)]
    with ThreadPoolExecutor(2) as ex:
        list(ex.map(lambda g: g.start(), procs))
    yield procs
    for g in procs:
        g.stop()


@pytest.fixture
def gw(gateways):
    return gateways[0]


@pytest.fixture(scope="module")
def rds(redis_url):
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    yield r
    r.close()


def client(g: GatewayProcess, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=g.url + "/v1", api_key=key, max_retries=0, timeout=30)


MSG = [{"role": "user", "content": "hi"}]


def test_503_falls_back_and_headers(gw, ups):
    ups["primary"].push({"status": 503})
    raw = client(gw).chat.completions.with_raw_response.create(model="s503", messages=MSG)
    assert raw.parse().choices[0].message.content == "hello from fallback"
    assert raw.headers["x-tandem-backend"] == "fallback" and raw.headers["x-tandem-attempts"] == "2"
    assert ups["primary"].calls == 1 and ups["fallback"].calls == 1
    # the key's TPM limit: tokens reserved at admission (prompt estimate + max_tokens, default 512) show in
    # OpenAI's headers, and the reservation is replaced by the real usage (the upstream reports 8 tokens)
    assert raw.headers["x-ratelimit-limit-tokens"] == "100000000"
    prompt_estimate = 100_000_000 - int(raw.headers["x-ratelimit-remaining-tokens"]) - 512
    assert 0 < prompt_estimate < 50
    raw2 = client(gw).chat.completions.with_raw_response.create(model="s503", messages=MSG, max_tokens=1000)
    assert int(raw2.headers["x-ratelimit-remaining-tokens"]) == 100_000_000 - 8 - (prompt_estimate + 1000)
    assert raw2.headers["x-ratelimit-reset-tokens"].endswith("s")
    # n completions of max_tokens each are reserved (a trial's n=32 reserved one: its budget overspent 4x)
    raw3 = client(gw).chat.completions.with_raw_response.create(model="s503", messages=MSG, max_tokens=100, n=3)
    assert int(raw3.headers["x-ratelimit-remaining-tokens"]) == 100_000_000 - 16 - (prompt_estimate + 300)


@pytest.mark.parametrize("status,exc", [(400, openai.BadRequestError), (404, openai.NotFoundError)])
def test_400_404_pass_through_after_one_call(gw, ups, status, exc):
    ups["primary"].push({"status": status, "message": f"upstream says {status}"})
    with pytest.raises(exc) as e:
        client(gw).chat.completions.create(model="s400", messages=MSG)
    assert e.value.status_code == status and f"upstream says {status}" in str(e.value)
    assert ups["primary"].calls == 1 and ups["fallback"].calls == 0


def test_stream_cut_after_40_of_60_ends_with_error_event(gw, ups):
    ups["primary"].push({"chunks": 60, "cut_after": 40})
    with httpx.stream("POST", gw.url + "/v1/chat/completions", headers={"authorization": f"Bearer {KEY}"},
                      json={"model": "scut", "messages": MSG, "stream": True}, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [ln for ln in r.iter_lines() if ln.startswith("data:")]
    assert "data: [DONE]" not in events
    objs = [json.loads(e[5:]) for e in events]
    content = [o["choices"][0]["delta"]["content"] for o in objs if o.get("choices") and o["choices"][0]["delta"].get("content")]
    # the content relayed is an in-order prefix of what was sent. (The upstream client's aiohttp transport drops
    # bytes it had buffered but not yet handed over when the connection breaks, so fewer than 40 may arrive.)
    assert 0 < len(content) <= 40 and content == [f"tok{i} " for i in range(len(content))]
    assert objs[-1]["error"]["code"] == "stream_interrupted"
    assert ups["fallback"].calls == 0
    # the openai SDK raises on that final event instead of ending silently
    ups["primary"].push({"chunks": 60, "cut_after": 40})
    got = []
    with pytest.raises(openai.APIError):
        for chunk in client(gw).chat.completions.create(model="scut", messages=MSG, stream=True):
            if chunk.choices and chunk.choices[0].delta.content:
                got.append(chunk.choices[0].delta.content)
    assert 0 < len(got) <= 40


def test_both_503_before_content_is_a_real_503(gw, ups):
    ups["primary"].set_default({"status": 503})
    ups["fallback"].set_default({"status": 503})
    r = httpx.post(gw.url + "/v1/chat/completions", headers={"authorization": f"Bearer {KEY}"},
                   json={"model": "sboth", "messages": MSG, "stream": True}, timeout=30)
    assert r.status_code == 503 and r.headers["content-type"].startswith("application/json")
    assert r.json()["error"]["message"] and "retry-after" in r.headers
    with pytest.raises(openai.InternalServerError) as e:
        client(gw).chat.completions.create(model="sboth", messages=MSG, stream=True)
    assert e.value.status_code == 503


def attempts_counted(gw, backend: str) -> dict[str, float]:
    """``tandem_upstream_attempts_total`` of ``backend`` by outcome (summed over attempt kinds)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(gw.url + "/metrics", headers=ADMIN_AUTH, timeout=10).text):
        for sample in fam.samples:
            if sample.name == "tandem_upstream_attempts_total" and sample.labels["backend"] == backend:
                out[sample.labels["outcome"]] = out.get(sample.labels["outcome"], 0) + sample.value
    return out


def counted_since(gw, backend: str, before: dict[str, float]) -> dict[str, float]:
    after = attempts_counted(gw, backend)
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def test_error_event_first_falls_back(gw, ups):
    """... and the primary's attempt is metered as the failure it was (a trial saw streams that failed before
    their first token counted ``ok``: 200 headers)."""
    before = attempts_counted(gw, "primary")
    ups["primary"].push({"error_first": True})
    text = "".join(c.choices[0].delta.content or "" for c in
                   client(gw).chat.completions.create(model="serrfirst", messages=MSG, stream=True) if c.choices)
    assert text == "tok0 tok1 tok2 " and ups["fallback"].calls == 1
    assert counted_since(gw, "primary", before) == {"error_event": 1}


def test_a_malformed_whole_answer_is_metered_malformed_not_ok(gw, ups):
    """An observability trial: a 200 with invalid JSON (not streamed) was served by the fallback while the
    primary's attempt counted ``ok`` and its breaker's reason said ``status 502``, a status it never sent."""
    before = {b: attempts_counted(gw, b) for b in ("primary", "fallback")}
    ups["primary"].push({"malformed": True})
    raw = client(gw).chat.completions.with_raw_response.create(model="s503", messages=MSG)
    assert raw.parse().choices[0].message.content == "hello from fallback"
    assert counted_since(gw, "primary", before["primary"]) == {"malformed": 1}
    assert counted_since(gw, "fallback", before["fallback"]) == {"ok": 1}


def test_first_token_timeout_falls_back(gw, ups):
    """Headers at once, first token after 10 s, first-token timeout 2 s: served by the fallback; the primary's
    attempt is metered ``timeout``, a stream cut before content ``stream_cut``."""
    before = attempts_counted(gw, "primary")
    ups["primary"].push({"stall_first": 10})
    raw = client(gw).chat.completions.with_raw_response.create(model="sstall", messages=MSG, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
    assert text == "tok0 tok1 tok2 " and raw.headers["x-tandem-backend"] == "fallback"
    assert ups["primary"].calls == 1
    assert wait_until(lambda: ups["primary"].disconnects == 1)  # the stalled call was closed
    ups["primary"].push({"end_after": 0})
    raw = client(gw).chat.completions.with_raw_response.create(model="sstall", messages=MSG, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices) == "tok0 tok1 tok2 "
    assert counted_since(gw, "primary", before) == {"timeout": 1, "stream_cut": 1}
    # no headers within the first-token timeout either: a timeout too (an SRE's trial saw "cancelled", the label
    # of a client that left, so alerts on timeouts missed hung streaming upstreams)
    before = attempts_counted(gw, "slowhead")
    ups["primary"].push({"hang": True})
    raw = client(gw).chat.completions.with_raw_response.create(model="shead", messages=MSG, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices) == "tok0 tok1 tok2 "
    assert raw.headers["x-tandem-backend"] == "fallback" and counted_since(gw, "slowhead", before) == {"timeout": 1}


def test_one_retry_after_wait_per_request(gw, ups):
    """A single-target route whose upstream answers 429 with ``Retry-After: 1`` every time: the request waits out
    one Retry-After, and the next 429 is its answer (an SRE trial's waited 7 s twice, 3 calls in 14 s; the
    docs say one cooldown per request)."""
    ups["fallback"].set_default({"status": 429, "retry_after": "1"})
    with pytest.raises(openai.RateLimitError) as e:
        client(gw).chat.completions.create(model="s429one", messages=MSG)
    assert ups["fallback"].calls == 2 and e.value.response.headers["retry-after"] == "1"


def test_429_retry_after_then_429_keeps_backend_out_60s(gw, ups, rds, prefix):
    ups["primary"].push({"status": 429, "retry_after": "1"}, {"status": 429})
    c = client(gw)
    assert c.chat.completions.create(model="s429", messages=MSG).choices[0].message.content == "hello from fallback"
    key = f"{prefix}:cb:primary/s429"
    assert 0 < int(rds.hget(key, "ou")) - time.time() * 1000 <= 1000
    time.sleep(1.1)  # the 1 s cooldown passes: the next request probes the primary and gets a 429 without header
    assert c.chat.completions.create(model="s429", messages=MSG).choices[0].message.content == "hello from fallback"
    assert ups["primary"].calls == 2
    left_ms = int(rds.hget(key, "ou")) - time.time() * 1000
    assert 55_000 < left_ms <= 60_000 and rds.pttl(key) > left_ms
    c.chat.completions.create(model="s429", messages=MSG)
    assert ups["primary"].calls == 2  # still out


def test_dead_is_skipped_at_once_hung_after_timeout_healthy_not_slowed(gw, ups):
    ups["hung"].set_default({"hang": True})
    done: dict[str, float] = {}

    def slow():
        r = client(gw).chat.completions.with_raw_response.create(model="shung", messages=MSG)
        done["shung"] = time.monotonic()
        done["backend"] = r.headers["x-tandem-backend"]
        done["attempts"] = r.headers["x-tandem-attempts"]

    t = threading.Thread(target=slow)
    t.start()
    for _ in range(100):  # wait until the hung upstream holds the request
        if ups["hung"].calls:
            break
        time.sleep(0.02)
    assert client(gw).chat.completions.create(model="shealthy", messages=MSG).choices[0].message.content
    healthy_done = time.monotonic()
    t.join(30)
    assert done["backend"] == "fallback" and done["attempts"] == "3"
    assert healthy_done < done["shung"]  # the healthy route answered while the hung upstream was still held
    assert wait_until(lambda: ups["hung"].disconnects == 1)  # the timed-out call was closed


def test_breaker_opened_on_one_replica_is_honoured_by_the_other(gateways, ups):
    a, b = gateways
    ups["primary"].push({"status": 429})  # no Retry-After: 60 s cooldown
    assert client(a).chat.completions.with_raw_response.create(
        model="sshared", messages=MSG).headers["x-tandem-backend"] == "fallback"
    raw = client(b).chat.completions.with_raw_response.create(model="sshared", messages=MSG)
    assert raw.headers["x-tandem-backend"] == "fallback" and raw.headers["x-tandem-attempts"] == "1"
    assert ups["primary"].calls == 1


def test_rpm_limit_holds_across_two_replicas(gateways):
    a, b = gateways
    ca, cb = client(a, LIMITED_KEY), client(b, LIMITED_KEY)

    def one(i):
        c = ca if i % 2 else cb
        try:
            raw = c.chat.completions.with_raw_response.create(model="shealthy", messages=MSG)
            return 200, dict(raw.headers)
        except openai.RateLimitError as e:
            return 429, dict(e.response.headers)

    with ThreadPoolExecutor(8) as ex:
        res = list(ex.map(one, range(16)))
    ok = [h for s, h in res if s == 200]
    limited = [h for s, h in res if s == 429]
    assert len(ok) == 10 and len(limited) == 6
    assert all(int(h["retry-after"]) >= 1 and h["x-ratelimit-remaining-requests"] == "0" for h in limited)
    assert all(h["x-ratelimit-limit-requests"] == "10" for h in ok + limited)
    assert sorted(int(h["x-ratelimit-remaining-requests"]) for h in ok) == list(range(10))


def test_client_disconnect_cancels_upstream_within_a_second(gw, ups):
    ups["primary"].push({"chunks": 1000, "chunk_delay": 0.02})
    with httpx.stream("POST", gw.url + "/v1/chat/completions", headers={"authorization": f"Bearer {KEY}"},
                      json={"model": "sdisc", "messages": MSG, "stream": True}, timeout=30) as r:
        it = r.iter_lines()
        got = [ln for ln in (next(it) for _ in range(10)) if ln.startswith("data:")]
        assert got
        t_close = time.monotonic()
    assert wait_until(lambda: ups["primary"].disconnects == 1)
    assert ups["primary"].disconnect_times[0] - t_close < 1.0


def test_redis_outage_keeps_serving_then_resumes(ups, redis_server, tmp_path):
    prefix = f"out{uuid.uuid4().hex[:6]}"
    path = tmp_path / "config.yaml"
    path.write_text(gateway_config(ups, redis_server.url, prefix, free_port()))
    g = GatewayProcess(path, env=ENV).start()
    try:
        c = client(g, LIMITED_KEY)
        assert c.chat.completions.create(model="soutage", messages=MSG).choices
        redis_server.stop()
        for _ in range(5):  # requests keep succeeding, on in-process state
            assert c.chat.completions.create(model="soutage", messages=MSG).choices
        # the details are the operators' on a gateway with keys: the admin token shows them, a probe gets the status
        assert set(httpx.get(g.url + "/health/ready").json()) == {"status", "ready", "draining"}
        ready = httpx.get(g.url + "/health/ready", headers=ADMIN_AUTH).json()
        assert ready["redis_degraded"] is True
        redis_server.start()
        for _ in range(200):
            if not httpx.get(g.url + "/health/ready", headers=ADMIN_AUTH).json()["redis_degraded"]:
                break
            time.sleep(0.05)
        assert httpx.get(g.url + "/health/ready", headers=ADMIN_AUTH).json()["redis_degraded"] is False
        # shared state resumes: a breaker opened now is in Redis, and the limiter counts there again
        ups["primary"].push({"status": 429})
        assert client(g).chat.completions.create(model="soutage", messages=MSG).choices
        r = redis.Redis.from_url(redis_server.url, decode_responses=True)
        assert int(r.hget(f"{prefix}:cb:primary/soutage", "ou")) > time.time() * 1000
        assert r.zcard(f"{prefix}:rl:tenant:limited:log") >= 1
        r.close()
    finally:
        g.stop()
