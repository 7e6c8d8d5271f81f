"""The attempt loop (gateway/resilience/attempts.py) against real HTTP fault-injecting upstreams, over httpx."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import httpx
import pytest

from gateway.config.schema import BreakerSettings, RetrySettings, StateSettings
from gateway.resilience.attempts import Candidate, UpstreamResponse, call_with_fallback
from gateway.resilience.breaker import Breakers
from gateway.resilience.health import HealthTracker
from gateway.resilience.ratelimit import Limit, RateLimiter
from gateway.sse import EventReader
from gateway.state import SharedState
from gateway.translate.chat_events import ChatEncoder, decode_stream
from tests.conftest import free_port
from tests.gateway.fault_upstream import FaultUpstream

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def ups():
    a, b, c = FaultUpstream("primary").start(), FaultUpstream("fallback").start(), FaultUpstream("third").start()
    yield a, b, c
    for u in (a, b, c):
        u.stop()


@pytest.fixture
def primary(ups):
    ups[0].reset()
    return ups[0]


@pytest.fixture
def fallback(ups):
    ups[1].reset()
    return ups[1]


@pytest.fixture
def third(ups):
    ups[2].reset()
    return ups[2]


@pytest.fixture
async def client():
    async with httpx.AsyncClient(timeout=httpx.Timeout(30.0, connect=2.0)) as c:
        yield c


@pytest.fixture
async def state():
    st = SharedState(StateSettings())
    yield st
    await st.close()


def cand(up: FaultUpstream | str, **kw) -> Candidate:
    url = up if isinstance(up, str) else up.base_url
    name = kw.pop("name", None) or (url if isinstance(up, str) else up.name)
    return Candidate(name=name, target=url, **kw)


def attempt_fn(client: httpx.AsyncClient, stream: bool, body: dict = BODY):
    """One upstream call over httpx, the way a gateway backend does it."""

    async def attempt(c: Candidate) -> UpstreamResponse:
        req = client.build_request("POST", c.target + "/chat/completions", json={**body, "stream": stream})
        resp = await client.send(req, stream=True)
        if stream and resp.status_code < 300:
            return UpstreamResponse(resp.status_code, resp.headers, events=decode_stream(resp.aiter_raw()),
                                    aclose=resp.aclose)
        try:
            data = await resp.aread()
        finally:
            await resp.aclose()
        return UpstreamResponse(resp.status_code, resp.headers, body=data)

    return attempt


async def collect(stream) -> list[str]:
    """The client's SSE events of a relayed stream, one string each."""
    events, encoder = [], ChatEncoder("chatcmpl-x", "m")
    async for batch in stream:
        events += [encoder.encode([ev]).decode() for ev in batch]
    return events


def content_events(events: list[str]) -> list[dict]:
    out = []
    for e in events:
        data = e.removeprefix("data: ").strip()
        if data != "[DONE]":
            out.append(json.loads(data))
    return out


FAST = RetrySettings(backoff_initial_s=0.01, backoff_max_s=0.05, jitter_s=0.01)


async def test_503_falls_back_to_200(client, state, primary, fallback):
    primary.push({"status": 503})
    res = await call_with_fallback([cand(primary), cand(fallback)], attempt_fn(client, False),
                                   breakers=Breakers(state), policy=FAST)
    assert res.status == 200 and res.candidate.name == "fallback"
    assert json.loads(res.body)["choices"][0]["message"]["content"] == "hello from fallback"
    assert [a.outcome for a in res.attempts] == ["status 503", "ok"] and res.num_calls == 2  # the status said
    assert primary.calls == 1 and fallback.calls == 1
    assert res.usage["total_tokens"] == 8


@pytest.mark.parametrize("status", [400, 401, 403, 404, 422])
async def test_client_errors_pass_through_after_one_call(client, state, primary, fallback, status):
    primary.push({"status": status, "message": "bad thing"})
    res = await call_with_fallback([cand(primary), cand(fallback)], attempt_fn(client, False),
                                   breakers=Breakers(state), policy=FAST)
    assert res.status == status and json.loads(res.body)["error"]["message"] == "bad thing"
    assert res.candidate.name == "primary" and res.num_calls == 1
    assert primary.calls == 1 and fallback.calls == 0
    assert (await Breakers(state).get("primary")).state == "closed"


async def test_a_grammar_compile_timeout_is_the_requests_408(client, state, primary, fallback):
    """The engine's 408 for a schema whose compile timed out names the schema, not the backend: passed
    through after one call (another try would wait again), and the breaker stays closed."""
    primary.push({"status": 408, "message": "grammar compile over 10 s", "error_code": "grammar_compile_timeout"})
    res = await call_with_fallback([cand(primary), cand(fallback)], attempt_fn(client, False),
                                   breakers=Breakers(state), policy=FAST)
    assert res.status == 408 and json.loads(res.body)["error"]["code"] == "grammar_compile_timeout"
    assert primary.calls == 1 and fallback.calls == 0
    assert (await Breakers(state).get("primary")).state == "closed"


async def test_same_target_retried_with_backoff_when_alone(client, state, primary):
    primary.push({"status": 503}, {"status": 500})
    res = await call_with_fallback([cand(primary)], attempt_fn(client, False), breakers=Breakers(state), policy=FAST)
    assert res.status == 200 and primary.calls == 3


async def test_all_fail_gives_503_json(client, state, primary, fallback):
    primary.set_default({"status": 503})
    fallback.set_default({"status": 503})
    res = await call_with_fallback([cand(primary), cand(fallback)], attempt_fn(client, True), stream=True,
                                   breakers=Breakers(state), policy=FAST)
    assert res.status == 503 and res.stream is None
    assert res.headers["content-type"] == "application/json" and "retry-after" in res.headers
    assert json.loads(res.body)["error"]["code"] == "upstream_failed"
    assert primary.calls + fallback.calls == FAST.max_attempts


async def test_the_last_failures_own_message_is_passed_on(client, state, primary):
    """Found by a user trial: the engine's 503 "the grammar is still compiling, send the request again" reached
    the client as "The upstream is overloaded or rate limited" only."""
    primary.set_default({"status": 503, "message": "structured_outputs: still compiling after 60 s; send it again"})
    res = await call_with_fallback([cand(primary)], attempt_fn(client, False), breakers=Breakers(state), policy=FAST)
    message = json.loads(res.body)["error"]["message"]
    assert res.status == 503 and message.startswith("The upstream is overloaded or rate limited after ")
    assert message.endswith("The last one said: structured_outputs: still compiling after 60 s; send it again")


async def test_stream_cut_after_content_ends_with_error_event(client, state, primary, fallback):
    primary.push({"chunks": 60, "cut_after": 40})
    res = await call_with_fallback([cand(primary), cand(fallback)], attempt_fn(client, True), stream=True,
                                   breakers=Breakers(state), policy=FAST)
    assert res.status == 200
    events = await collect(res.stream)
    assert "data: [DONE]\n\n" not in events
    objs = content_events(events)
    assert sum(1 for o in objs if o.get("choices") and o["choices"][0]["delta"].get("content")) == 40
    assert "error" in objs[-1] and objs[-1]["error"]["code"] == "stream_interrupted"
    assert res.error and fallback.calls == 0


async def test_clean_end_without_done_is_an_error_too(client, state, primary):
    primary.push({"chunks": 10, "end_after": 5})
    res = await call_with_fallback([cand(primary)], attempt_fn(client, True), stream=True, policy=FAST)
    events = await collect(res.stream)
    assert "data: [DONE]\n\n" not in events and "error" in content_events(events)[-1]


async def test_upstream_error_event_after_content_ends_as_a_cut(client, primary):
    primary.push({"chunks": 10, "error_after": 3})
    res = await call_with_fallback([cand(primary)], attempt_fn(client, True), stream=True, policy=FAST)
    events = await collect(res.stream)
    objs = content_events(events)
    assert "data: [DONE]\n\n" not in events and len(objs) == 5     # as before: the chunks, then the end
    assert objs[-1]["error"]["code"] == "stream_interrupted" and objs[-1]["error"]["type"] == "upstream_error"
    assert objs[-1]["error"]["message"] == "stream interrupted: upstream sent an error event: injected mid-stream error"
    assert res.error == objs[-1]["error"]["message"].removeprefix("stream interrupted: ")


@pytest.mark.parametrize("fault", [{"error_first": True}, {"malformed": True}, {"chunks": 5, "cut_after": 0},
                                   {"reset": True}, {"status": 429, "retry_after": "30"}])
async def test_stream_failure_before_content_falls_back(client, state, primary, fallback, fault):
    primary.push(fault)
    res = await call_with_fallback([cand(primary), cand(fallback)], attempt_fn(client, True), stream=True,
                                   breakers=Breakers(state), policy=FAST)
    assert res.status == 200 and res.candidate.name == "fallback"
    events = await collect(res.stream)
    assert events[-1] == "data: [DONE]\n\n"
    assert all("error" not in o for o in content_events(events))


async def test_first_token_timeout_falls_back(client, state, primary, fallback):
    primary.push({"stall_first": 10, "chunks": 3})
    res = await call_with_fallback([cand(primary, first_token_timeout_s=0.5), cand(fallback)],
                                   attempt_fn(client, True), stream=True, breakers=Breakers(state), policy=FAST)
    assert res.status == 200 and res.candidate.name == "fallback"
    assert res.attempts[0].outcome == "timeout"
    await collect(res.stream)
    # the stalled upstream saw us hang up
    for _ in range(100):
        if primary.disconnects:
            break
        await asyncio.sleep(0.02)
    assert primary.disconnects == 1


async def test_inter_chunk_timeout_after_content(client, primary):
    primary.push({"chunks": 10, "stall_after": 4, "stall_s": 10})
    res = await call_with_fallback([cand(primary, inter_chunk_timeout_s=0.3)], attempt_fn(client, True),
                                   stream=True, policy=FAST)
    objs = content_events(await collect(res.stream))
    assert "error" in objs[-1] and "sent nothing" in objs[-1]["error"]["message"]


async def test_429_retry_after_then_429_keeps_backend_out_60s(client, state, primary):
    """429 Retry-After: 1 (honoured: wait, then probe), then 429 without the header: out for the default 60 s."""
    br = Breakers(state, BreakerSettings(rate_limit_cooldown_s=60))
    primary.push({"status": 429, "retry_after": "1"}, {"status": 429})
    res = await call_with_fallback([cand(primary)], attempt_fn(client, False), breakers=br, policy=FAST)
    # every call a 429: the client's 429 (LiteLLM passes the provider's RateLimitError), not a 503 "down"
    err = json.loads(res.body)["error"]
    assert res.status == 429 and primary.calls == 2
    assert (err["code"], err["type"]) == ("rate_limit_exceeded", "rate_limit_error")
    assert err["message"].startswith("The upstream is rate limited after 2 attempt(s)")
    st = await br.get("primary")
    assert st.state == "open" and 58 < st.retry_after_s <= 60
    assert 58 <= int(res.headers["retry-after"]) <= 60


async def test_a_429_then_a_503_is_the_clients_503(client, state, primary, fallback):
    primary.set_default({"status": 429})
    fallback.set_default({"status": 503})
    res = await call_with_fallback([cand(primary), cand(fallback)], attempt_fn(client, False),
                                   breakers=Breakers(state), policy=FAST)
    assert res.status == 503 and json.loads(res.body)["error"]["code"] == "upstream_failed"


async def test_all_breakers_open_gives_503_with_soonest_half_open(client, state, primary, fallback):
    br = Breakers(state)
    await br.record("primary", False, status=429, retry_after_s=300)
    await br.record("fallback", False, status=429, retry_after_s=120)
    res = await call_with_fallback([cand(primary), cand(fallback)], attempt_fn(client, False), breakers=br,
                                   policy=FAST)
    assert res.status == 503 and primary.calls == 0 and fallback.calls == 0
    assert 118 <= int(res.headers["retry-after"]) <= 120
    err = json.loads(res.body)["error"]
    assert err["code"] == "backends_unavailable"   # and it names why each target was not called
    assert "primary: skipped: breaker open" in err["message"] and "fallback: skipped: breaker open" in err["message"]


async def test_a_cooldown_waited_for_then_failed_probes_are_the_upstreams_failure(client, state, primary, fallback):
    """A new user's trial: both targets answer 500 and their breakers opened; a request waited for the cooldown
    (within max_retry_after_s), its half-open probes got 500 again, and it was told 503 backends_unavailable
    ("unavailable ... status 500"). The calls failed: 502 upstream_failed as when every target fails, its
    Retry-After when a target is tried again."""
    br = Breakers(state, BreakerSettings(consecutive_failures=1, open_s=1))
    primary.set_default({"status": 500})
    fallback.set_default({"status": 500})
    cands = [cand(primary), cand(fallback)]
    first = await call_with_fallback(cands, attempt_fn(client, False), breakers=br,
                                     policy=RetrySettings(max_retry_after_s=0, backoff_initial_s=0.01))
    assert first.status == 502 and primary.calls == fallback.calls == 1
    # deadline 1.4 s: the 1 s cooldown is waited for, the one its failed probes start is not, unless this call began
    # 0.6 s after the first failed (at 1.8 s, 0.2 s: a loaded suite's 3rd probe of the primary)
    res = await call_with_fallback(cands, attempt_fn(client, False), breakers=br,
                                   policy=RetrySettings(max_retry_after_s=2, deadline_s=1.4, backoff_initial_s=0.01))
    assert primary.calls == fallback.calls == 2                # each probed once after the cooldown
    err = json.loads(res.body)["error"]
    assert res.status == 502 and err["code"] == "upstream_failed", (res.status, err)
    assert "primary: status 500" in err["message"] and "fallback: status 500" in err["message"]
    assert 1 <= int(res.headers["retry-after"]) <= 2


async def test_a_request_waits_for_one_cooldown_only(client, state, primary, fallback):
    """An ops trial (``open_s`` 8 within ``max_retry_after_s`` 10, both upstreams failing): a request waited for a
    cooldown, its probes failed, and it waited for the next cooldown too, and the next (16 s, then a 502 with no
    Retry-After). Once is enough: the probes' failure is the answer, with the next half-open time."""
    br = Breakers(state, BreakerSettings(consecutive_failures=1, open_s=0.5))
    primary.set_default({"status": 500})
    fallback.set_default({"status": 500})
    cands = [cand(primary), cand(fallback)]
    slow = RetrySettings(max_retry_after_s=10, deadline_s=60, max_attempts=10, backoff_initial_s=0.01)
    first = await call_with_fallback(cands, attempt_fn(client, False), breakers=br, policy=slow)
    assert first.status == 502
    calls = primary.calls, fallback.calls
    res = await call_with_fallback(cands, attempt_fn(client, False), breakers=br, policy=slow)
    # one cooldown waited for (the soonest): a probe of the primary, and of the fallback if its own cooldown (begun
    # a call later) ended by then; never a second wait and more probes
    assert primary.calls - calls[0] == 1 and fallback.calls - calls[1] in (0, 1)
    err = json.loads(res.body)["error"]
    assert res.status == 502 and err["code"] == "upstream_failed", (res.status, err)
    assert int(res.headers["retry-after"]) >= 1


async def test_dead_and_hung_upstreams_are_skipped(state, primary, third):
    dead = f"http://127.0.0.1:{free_port()}/v1"
    primary.set_default({"hang": True})
    health = HealthTracker(state)
    cands = [cand(dead, name="dead"), cand(primary), cand(third)]
    async with httpx.AsyncClient(timeout=httpx.Timeout(0.5, connect=2.0)) as client:   # the backend's read_s
        res = await call_with_fallback(cands, attempt_fn(client, False), breakers=Breakers(state), health=health,
                                       policy=FAST)
    assert res.status == 200 and res.candidate.name == "third"
    assert [a.outcome for a in res.attempts] == ["connect_error", "timeout", "ok"]
    assert (await health.stats("dead")).errors == 1 and (await health.stats("third")).errors == 0
    for _ in range(100):
        if primary.disconnects:
            break
        await asyncio.sleep(0.02)
    assert primary.disconnects == 1  # the hung call was cancelled, not left running


async def test_context_length_moves_to_larger_target(client, state, primary, fallback, third):
    primary.push({"status": 400, "error_code": "context_length_exceeded",
                  "message": "This model's maximum context length is 2048 tokens"})
    cands = [cand(primary, max_model_len=2048), cand(fallback, max_model_len=2048), cand(third, max_model_len=8192)]
    res = await call_with_fallback(cands, attempt_fn(client, False), breakers=Breakers(state), policy=FAST)
    assert res.status == 200 and res.candidate.name == "third"
    assert primary.calls == 1 and fallback.calls == 0
    assert (await Breakers(state).get("primary")).state == "closed"


async def test_context_length_stays_the_clients_400_when_a_no_larger_target_failed_first(client, state, primary):
    """A new user's too-long request drew the canary whose engine was down (connect_error), then the local engine
    said context_length: a 502 ``upstream_failed`` the SDKs retry. The request is the client's error: the engine's
    400, whether the down target declares no larger context or a larger one (a capacity trial: the 502 after a
    retry of the larger one; vLLM and OpenAI answer the 400, which the client can act on)."""
    body = {"status": 400, "error_code": "context_length_exceeded",
            "message": "This model's maximum context length is 2048 tokens"}
    dead = f"http://127.0.0.1:{free_port()}/v1"
    for limit in (2048, 8192):
        primary.push(body)
        cands = [cand(dead, name="canary", max_model_len=limit), cand(primary, max_model_len=2048)]
        res = await call_with_fallback(cands, attempt_fn(client, False), breakers=Breakers(state), policy=FAST)
        assert [a.outcome for a in res.attempts] == ["connect_error", "context_length"]
        assert res.status == 400, res.body
        assert json.loads(res.body)["error"]["code"] == "context_length_exceeded"


async def test_after_a_context_length_refusal_a_larger_target_is_tried_once_and_never_waited_for(
        client, state, primary, fallback):
    """A capacity trial: the local engine refused a prompt as too long, the larger canary's breaker was open, and
    the request waited ~9 s for its cooldown to probe it (or retried it after a connect error, four calls), then
    answered a retryable 502/503. Each larger target is now tried once, at once, and the refusal is the answer
    when none answers; a larger one that answers serves it."""
    body = {"status": 400, "error_code": "context_length_exceeded",
            "message": "This model's maximum context length is 256 tokens"}
    dead = f"http://127.0.0.1:{free_port()}/v1"
    patient = RetrySettings(max_retry_after_s=30, deadline_s=60, max_attempts=10, backoff_initial_s=0.01)
    br = Breakers(state, BreakerSettings(consecutive_failures=1, open_s=5))
    await br.record("canary", False)   # cooling down 5 s: a wait for it is within max_retry_after_s
    primary.push(body)
    cands = [cand(primary, max_model_len=256), cand(dead, name="canary", max_model_len=2048)]
    res = await call_with_fallback(cands, attempt_fn(client, False), breakers=br, policy=patient)
    assert res.status == 400 and json.loads(res.body)["error"]["code"] == "context_length_exceeded"
    assert [a.outcome for a in res.attempts] == ["context_length", "skipped: breaker open"]
    primary.push(body)   # the larger one callable but down: called once, not again after a backoff
    res = await call_with_fallback(cands, attempt_fn(client, False), policy=patient)
    assert res.status == 400 and [a.outcome for a in res.attempts] == ["context_length", "connect_error"]
    primary.push(body)   # the larger one up: it answers
    res = await call_with_fallback([cand(primary, max_model_len=256), cand(fallback, max_model_len=2048)],
                                   attempt_fn(client, False), policy=patient)
    assert res.status == 200 and res.candidate.name == "fallback"


async def test_candidates_too_small_are_skipped(client, primary, fallback):
    cands = [cand(primary, max_model_len=1024), cand(fallback, max_model_len=32768)]
    res = await call_with_fallback(cands, attempt_fn(client, False), required_len=4000, policy=FAST)
    assert res.status == 200 and res.candidate.name == "fallback" and primary.calls == 0
    res = await call_with_fallback(cands, attempt_fn(client, False), required_len=40000, policy=FAST,
                                   prompt_param="messages")
    error = json.loads(res.body)["error"]
    assert res.status == 400 and error["code"] == "context_length_exceeded" and error["param"] == "messages"
    assert "maximum context length is 32768 tokens" in error["message"]
    assert "messages resulted in 40000 tokens" in error["message"]
    res = await call_with_fallback(cands, attempt_fn(client, False), required_len=40000, answer_len=1000,
                                   policy=FAST, prompt_param="messages")   # OpenAI's words with max_tokens
    assert "you requested 40000 tokens (39000 in the messages, 1000 in the completion)" in \
        json.loads(res.body)["error"]["message"]
    res = await call_with_fallback(cands, attempt_fn(client, False), required_len=40000, answer_len=None,
                                   policy=FAST, prompt_param="messages")   # no max_tokens: one answer token counted
    assert "your messages resulted in 39999 tokens, with no room left for the answer" in \
        json.loads(res.body)["error"]["message"]   # a new-user trial: "(..., 1 in the completion)" was never asked


async def test_malformed_json_falls_back(client, primary, fallback):
    primary.push({"malformed": True})
    res = await call_with_fallback([cand(primary), cand(fallback)], attempt_fn(client, False), policy=FAST)
    assert res.status == 200 and res.candidate.name == "fallback"


async def test_backend_rate_limit_skips_target(client, state, primary, fallback):
    limiter = RateLimiter(state)
    lim = [Limit("backend", "primary", rpm=1)]
    cands = [cand(primary, limits=lim), cand(fallback)]
    r1 = await call_with_fallback(cands, attempt_fn(client, False), limiter=limiter, tokens=10, request_id="a")
    r2 = await call_with_fallback(cands, attempt_fn(client, False), limiter=limiter, tokens=10, request_id="b")
    assert r1.candidate.name == "primary" and r1.backend_reservation is not None
    assert r2.candidate.name == "fallback" and r2.attempts[0].outcome == "skipped: backend rate limit"
    r3 = await call_with_fallback(cands[:1], attempt_fn(client, False), limiter=limiter, request_id="c",
                                  policy=RetrySettings(max_retry_after_s=1))
    assert r3.status == 429 and int(r3.headers["retry-after"]) > 50


async def test_client_disconnect_closes_upstream_within_a_second(client, primary):
    primary.push({"chunks": 1000, "chunk_delay": 0.01})
    finished = []
    res = await call_with_fallback([cand(primary)], attempt_fn(client, True), stream=True, policy=FAST,
                                   on_finish=finished.append)
    it = res.stream.__aiter__()
    for _ in range(5):
        await it.__anext__()
    t_close = time.monotonic()
    await it.aclose()  # what the server does when the client goes away
    for _ in range(250):
        if primary.disconnects:
            break
        await asyncio.sleep(0.02)
    assert primary.disconnects == 1
    assert primary.disconnect_times[0] - t_close < 1.0
    assert finished and finished[0].error is None


async def test_half_open_probe_success_closes(client, state, primary):
    br = Breakers(state, BreakerSettings(consecutive_failures=2, open_s=0.2))
    primary.push({"status": 500}, {"status": 500})
    res = await call_with_fallback([cand(primary)], attempt_fn(client, False), breakers=br,
                                   policy=RetrySettings(max_attempts=2, backoff_initial_s=0.01, jitter_s=0))
    assert res.status == 502 and (await br.get("primary")).state == "open"
    await asyncio.sleep(0.25)
    res = await call_with_fallback([cand(primary)], attempt_fn(client, False), breakers=br, policy=FAST)
    assert res.status == 200 and (await br.get("primary")).state == "closed"


async def test_shared_breaker_in_redis_steers_another_replica(client, redis_url, primary, fallback):
    prefix = f"t{uuid.uuid4().hex[:8]}"
    a = SharedState(StateSettings(redis_url=redis_url, key_prefix=prefix))
    b = SharedState(StateSettings(redis_url=redis_url, key_prefix=prefix))
    try:
        primary.push({"status": 429})
        r1 = await call_with_fallback([cand(primary), cand(fallback)], attempt_fn(client, False),
                                      breakers=Breakers(a), policy=FAST)
        r2 = await call_with_fallback([cand(primary), cand(fallback)], attempt_fn(client, False),
                                      breakers=Breakers(b), policy=FAST)
        assert r1.candidate.name == r2.candidate.name == "fallback"
        assert primary.calls == 1 and r2.attempts[0].outcome == "skipped: breaker open"
    finally:
        await a.close()
        await b.close()


async def test_a_replicas_own_engine_keeps_its_breaker_and_probe_to_itself(client, redis_url, primary, fallback):
    """A backend each replica runs for itself (its co-located engine: ``SharedState.replica_scoped``) keeps its
    breaker, probe and health counters per replica: an operator trial saw a replica without an engine fail the
    other's readiness every ten seconds with its own probe ("engine not started"), and one replica's engine
    crash would have opened every replica's breaker. An upstream's stay shared."""
    prefix = f"t{uuid.uuid4().hex[:8]}"
    a = SharedState(StateSettings(redis_url=redis_url, key_prefix=prefix))
    b = SharedState(StateSettings(redis_url=redis_url, key_prefix=prefix))
    for s in (a, b):
        s.replica_scoped = frozenset({"primary"})
    try:
        assert a.key("cb", "primary/m") != b.key("cb", "primary/m") and a.key("cb", "fallback") == b.key("cb", "fallback")
        assert a.key("health", "primary:7").startswith(f"{prefix}:health:{a.replica_id}@")
        assert a.key("budget", "primary:2026-12") == b.key("budget", "primary:2026-12")   # a tenant of that name
        primary.push({"status": 429})
        r1 = await call_with_fallback([cand(primary), cand(fallback)], attempt_fn(client, False),
                                      breakers=Breakers(a), policy=FAST)
        r2 = await call_with_fallback([cand(primary), cand(fallback)], attempt_fn(client, False),
                                      breakers=Breakers(b), policy=FAST)
        assert r1.candidate.name == "fallback" and r2.candidate.name == "primary" and primary.calls == 2
        assert (await Breakers(a).get("primary")).state == "open" and (await Breakers(b).get("primary")).state == "closed"
        await HealthTracker(b).record_probe("primary", False, 0.01, "engine not started")
        await HealthTracker(b).record_probe("fallback", False, 0.01, "connect error")
        assert await HealthTracker(a).last_probe("primary") is None
        assert (await HealthTracker(a).last_probe("fallback"))["ok"] is False
        assert (await HealthTracker(b).last_probe("primary"))["error"] == "engine not started"
    finally:
        await a.close()
        await b.close()


async def test_sse_parser_handles_any_split_and_crlf():
    raw = b'data: {"a": 1}\r\n\r\n: keep-alive\n\nevent: x\ndata: {"b":\ndata: 2}\n\ndata: [DONE]'

    for n in (1, 3, 7, len(raw)):
        reader, payloads = EventReader(), []
        for i in range(0, len(raw), n):
            reader.feed(raw[i:i + n])
            while (item := reader.pop()) is not None:
                payloads.append(item[1])
        payloads.append(reader.tail()[1])       # the last event, cut before its blank line
        assert payloads == [b'{"a": 1}', b'{"b":\n2}', b"[DONE]"]


def test_parse_retry_after_forms():
    from email.utils import formatdate

    from gateway.resilience.attempts import parse_retry_after

    assert parse_retry_after({"Retry-After": "7"}) == 7.0
    assert parse_retry_after({"retry-after-ms": "1500"}) == 1.5
    assert parse_retry_after({}) is None and parse_retry_after({"retry-after": "soon"}) is None
    assert 25 < parse_retry_after({"retry-after": formatdate(time.time() + 30, usegmt=True)}) <= 30


async def test_deadline_bounds_retries_not_a_whole_answer_in_progress(client, primary, fallback):
    primary.push({"delay": 0.6})
    res = await call_with_fallback([cand(primary), cand(fallback)], attempt_fn(client, False),
                                   policy=RetrySettings(deadline_s=0.3))
    assert res.status == 200 and res.candidate.name == "primary"
    # a stream's first token is bounded by the deadline, though
    primary.push({"stall_first": 5})
    res = await call_with_fallback([cand(primary)], attempt_fn(client, True), stream=True,
                                   policy=RetrySettings(deadline_s=0.3))
    assert res.status == 504 and res.attempts[0].outcome == "timeout"


async def test_serving_error_of_local_engine_is_an_http_answer():
    class ServingError(Exception):  # the shape of engine.protocol.errors.ServingError
        status_code = 400

        def to_dict(self):
            return {"error": {"message": "max_tokens too large", "type": "invalid_request_error",
                              "param": "max_tokens", "code": None}}

    calls = []

    async def attempt(c):
        calls.append(c.name)
        raise ServingError()

    res = await call_with_fallback([Candidate("local"), Candidate("up")], attempt, policy=FAST)
    assert res.status == 400 and calls == ["local"]
    assert json.loads(res.body)["error"]["param"] == "max_tokens"


async def test_a_shutdown_answers_a_stream_still_waiting_for_its_first_token_with_503():
    """A load trial's drain: requests queued in the engine under preemption had no first token when the server
    exited, and uvicorn cancelled them (499, the client's connection dropped). A shutdown ends their wait: the
    503 ``draining`` a new request gets then, and no other target is tried."""
    from gateway.resilience.streaming import GATEWAY_SHUTDOWN, OpenStreams

    streams, calls, waiting = OpenStreams(), [], asyncio.Event()

    async def never():                       # an engine that queues the request past the shutdown
        waiting.set()
        await asyncio.Event().wait()
        yield []

    async def attempt(c):
        calls.append(c.name)
        return UpstreamResponse(200, {"content-type": "text/event-stream"}, events=never())

    task = asyncio.create_task(call_with_fallback([Candidate("local"), Candidate("up")], attempt, stream=True,
                                                  policy=FAST, streams=streams))
    await waiting.wait()
    assert streams.interrupt(GATEWAY_SHUTDOWN) == 0              # no stream committed yet
    res = await task
    err = json.loads(res.body)["error"]
    assert res.status == 503 and err["code"] == "draining" and err["type"] == "service_unavailable", res.body
    assert res.headers["retry-after"] == "1" and calls == ["local"]


async def test_a_shutdown_passes_over_a_first_token_wait_that_just_ended():
    """An attempt leaves its first-token timeout, then awaits its response's close before dropping it from the
    waits: a shutdown in between must not fail the drain (asyncio refuses to reschedule a finished Timeout)."""
    from gateway.resilience.streaming import GATEWAY_SHUTDOWN, OpenStreams

    streams = OpenStreams()
    async with asyncio.timeout(5) as timeout:
        streams.waiting(timeout)
    assert streams.interrupt(GATEWAY_SHUTDOWN) == 0
    streams.wait_over(timeout)


async def test_no_callable_backend_says_where_operators_read_why():
    """A new user's route over a keyless backend answered "No backend of this route is available." and nothing
    more; why (an unset key's name) is the operators', so the answer says where they read it."""
    async def attempt(c):
        raise AssertionError("nothing is called")

    res = await call_with_fallback([], attempt, policy=FAST)
    err = json.loads(res.body)["error"]
    assert res.status == 503 and err["code"] == "no_backend_available", err
    assert "unconfigured (an API key unset)" in err["message"] and "/health/ready" in err["message"], err


async def test_an_upstreams_own_4xx_during_a_shutdown_is_its_answer_not_the_shutdowns():
    """A request-specific 4xx an upstream answered (an error event naming it) is passed through as it is, a
    shutdown meanwhile or not: only a stream the shutdown ended is answered its 503."""
    from gateway.resilience.streaming import GATEWAY_SHUTDOWN, OpenStreams
    from gateway.values import ChatEvent

    streams = OpenStreams()

    async def refused():
        yield [ChatEvent(error={"message": "max_tokens too large", "type": "invalid_request_error",
                                "param": "max_tokens", "code": 400})]

    async def attempt(c):
        streams.interrupt(GATEWAY_SHUTDOWN)          # the drain's deadline comes during the call
        return UpstreamResponse(200, {"content-type": "text/event-stream"}, events=refused())

    res = await call_with_fallback([Candidate("local"), Candidate("up")], attempt, stream=True, policy=FAST,
                                   streams=streams)
    assert res.status == 400 and json.loads(res.body)["error"]["param"] == "max_tokens", res.body
