"""``POST /v1/messages`` and ``/v1/messages/count_tokens`` (issue 28, item 2) with the official ``anthropic`` SDK as
the client, against a gateway (the Litestar app under uvicorn, in this process) whose only backend is the
fault-injecting upstream, which speaks chat completions alone: every Messages request is served through the
translation (``gateway/translate/anthropic.py``), limited and billed like chat, and refused in Anthropic's error JSON.
"""

from __future__ import annotations

import asyncio
import contextlib
import re

import anthropic
import httpx
import openai
import pytest

from gateway.config.compile import load_config_text
from gateway.http.app import create_app
from gateway.runtime import Gateway
from tests.gateway.anthropic_upstream import AnthropicUpstream
from tests.gateway.fault_upstream import FaultUpstream
from tests.gateway.support import serve_app, sha

KEY = "sk-tandem-messages-0123456789abcdef"
TOOLS = [{"name": "get_weather", "description": "The weather of a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]


def config(up: FaultUpstream, rpm: int | None = None) -> str:
    limit = f", rpm: {rpm}" if rpm else ""
    return (f"reload: {{watch: false}}\nauth:\n  keys:\n    - {{tenant: t1, sha256: {sha(KEY)}{limit}}}\n"
            "resilience:\n  retry: {max_attempts: 1}\n  health: {interval_s: 0}\n"
            "observability:\n  logs: {requests: false}\nmodels:\n  - name: m1\n"
            f"backends:\n  up:\n    type: openai\n    base_url: {up.base_url}\n    models: {{m1: up-model}}\n"
            "    prices: {input: 1, output: 2}\n    timeouts: {connect_s: 2, read_s: 10, first_token_s: 5}\n"
            "routes:\n  r1:\n    targets: [{backend: up}]\npolicy:\n  default_route: r1\n")


@contextlib.asynccontextmanager
async def gateway(cfg: str, start_engine: bool = False):
    """One gateway on ``cfg`` (``start_engine``: its local backend's too): yields (gateway, anthropic client, base
    url)."""
    gw = Gateway(None, load_config_text(cfg), start_engine=start_engine)
    server, task, url = await serve_app(create_app(gw))
    client = anthropic.AsyncAnthropic(base_url=url, api_key=KEY, max_retries=0, timeout=20)
    try:
        yield gw, client, url
    finally:
        await client.close()
        server.should_exit = True
        await task


async def records(gw, n: int) -> list:
    """The tenant's usage records once there are ``n`` (settled when a request ends)."""
    for _ in range(750):
        recs = await gw.usage.records("t1")
        assert len(recs) <= n, recs
        if len(recs) == n:
            return recs
        await asyncio.sleep(0.02)
    raise AssertionError("records not settled")


@pytest.fixture
def up():
    with FaultUpstream("up") as u:
        yield u


def sent(up: FaultUpstream) -> dict:
    """The chat body of the upstream's last call."""
    path, _, body = up.requests[-1]
    assert path == "/v1/chat/completions"
    return body


async def test_create_is_translated_onto_a_chat_upstream_and_billed_once(up):
    async with gateway(config(up)) as (gw, client, _):
        msg = await client.messages.create(
            model="m1", max_tokens=50, system=[{"type": "text", "text": "be brief"}], stop_sequences=["END"],
            metadata={"user_id": "canary-user"}, extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 20},
            messages=[{"role": "user", "content": [{"type": "text", "text": "hello"}]}])
        assert msg.type == "message" and msg.role == "assistant" and msg.model == "m1"
        assert msg.id.startswith("msg_gw-")
        assert msg._request_id and msg._request_id.startswith("gw-")   # Anthropic's request-id header (the SDK's)
        assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == "hello from up"
        assert msg.stop_reason == "end_turn" and msg.stop_sequence is None
        assert (msg.usage.input_tokens, msg.usage.output_tokens) == (5, 3)   # the upstream's own usage
        body = sent(up)
        assert body["messages"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
        assert (body["model"], body["max_tokens"], body["stop"], body["user"]) == ("up-model", 50, ["END"],
                                                                                  "canary-user")
        assert (body["temperature"], body["top_p"], body["top_k"]) == (0.5, 0.9, 20)
        (rec,) = (await records(gw, 1)).values()
        assert (rec.prompt_tokens, rec.completion_tokens, rec.estimated) == (5, 3, False)
        assert rec.nusd == 5 * 1000 + 3 * 2000        # USD 1 / 2 per million tokens, in nano-USD
        labels = {"model": "m1", "route": "r1", "backend": "up", "status": "200", "attempt": "initial",
                  "tenant": "t1"}
        assert gw.obs.registry.get_sample_value("tandem_requests_total", labels) == 1       # counted like chat
        assert gw.obs.registry.get_sample_value("tandem_input_tokens_total", {"backend": "up", "tenant": "t1"}) == 5


async def test_stream_speaks_anthropics_events(up):
    async with gateway(config(up)) as (gw, client, url):
        async with client.messages.stream(model="m1", max_tokens=20,
                                          messages=[{"role": "user", "content": "hi"}]) as stream:
            text = "".join([t async for t in stream.text_stream])
            final = await stream.get_final_message()
        assert text == "tok0 tok1 tok2 "
        assert final.content[0].text == text and final.stop_reason == "end_turn"
        assert (final.usage.input_tokens, final.usage.output_tokens) == (5, 3)
        assert sent(up)["stream_options"] == {"include_usage": True}
        async with httpx.AsyncClient() as h:     # the raw event names, in order
            r = await h.post(url + "/v1/messages", headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"},
                             json={"model": "m1", "max_tokens": 5, "stream": True,
                                   "messages": [{"role": "user", "content": "hi"}]})
        names = [line[7:] for line in r.text.splitlines() if line.startswith("event: ")]
        assert names == ["message_start", "ping", "content_block_start", "content_block_delta",
                         "content_block_delta", "content_block_delta", "content_block_stop", "message_delta",
                         "message_stop"]
        recs = await records(gw, 2)                # billed from the usage the gateway asked the stream for
        assert sorted((r.prompt_tokens, r.completion_tokens, r.estimated) for r in recs.values()) == \
            [(5, 3, False), (5, 3, False)]


async def test_cached_input_is_not_counted_twice_whole_or_streamed(up):
    # Anthropic's input_tokens excludes cache reads: 35 prompt tokens of which 32 cached are 3 + 32, not 35 + 32
    usage = {"prompt_tokens": 35, "completion_tokens": 3, "total_tokens": 38,
             "prompt_tokens_details": {"cached_tokens": 32}}
    up.set_default({"usage": usage})
    async with gateway(config(up)) as (gw, client, _):
        msg = await client.messages.create(model="m1", max_tokens=20, messages=[{"role": "user", "content": "hi"}])
        async with client.messages.stream(model="m1", max_tokens=20,
                                          messages=[{"role": "user", "content": "hi"}]) as stream:
            final = await stream.get_final_message()
    for u in (msg.usage, final.usage):
        assert (u.input_tokens, u.cache_read_input_tokens, u.output_tokens) == (3, 32, 3)


async def test_stream_to_an_upstream_that_refuses_stream_options(up):
    cfg = config(up).replace("    prices: {input: 1, output: 2}\n", "    prices: {input: 1, output: 2}\n"
                                                                       "    stream_usage: false\n")
    async with gateway(cfg) as (gw, client, _):
        async with client.messages.stream(model="m1", max_tokens=20,
                                          messages=[{"role": "user", "content": "hi"}]) as stream:
            final = await stream.get_final_message()
        assert final.content[0].text == "tok0 tok1 tok2 " and "stream_options" not in sent(up)
        (rec,) = (await records(gw, 1)).values()
        assert rec.estimated                     # no usage from the upstream: the ledger counted the text


async def test_tool_use_round_trip(up):
    async with gateway(config(up)) as (gw, client, _):
        up.push({"tool_call": True})
        first = await client.messages.create(model="m1", max_tokens=50, tools=TOOLS,
                                             tool_choice={"type": "any"},
                                             messages=[{"role": "user", "content": "weather in Paris?"}])
        assert first.stop_reason == "tool_use"
        (call,) = [b for b in first.content if b.type == "tool_use"]
        # Anthropic's id form (the upstream's call_1); it round-trips as it is, the pair still matching
        assert (call.id, call.name, call.input) == ("toolu_1", "get_weather", {"city": "Paris"})
        body = sent(up)
        assert body["tools"] == [{"type": "function", "function": {
            "name": "get_weather", "parameters": TOOLS[0]["input_schema"], "description": "The weather of a city"}}]
        assert body["tool_choice"] == "required"
        second = await client.messages.create(     # a strict tool: the function's strict (an agents trial's dropped)
            model="m1", max_tokens=50, tools=[{**TOOLS[0], "strict": True}],
            tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
            messages=[{"role": "user", "content": "weather in Paris?"},
                      {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                    "content": "sunny"}, {"type": "text", "text": "thanks"}]}])
        assert second.content[0].text == "hello from up"
        body = sent(up)
        assert body["messages"][1] == {"role": "assistant", "content": None, "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]}
        assert body["messages"][2:] == [{"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
                                        {"role": "user", "content": "thanks"}]
        assert body["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
        assert body["parallel_tool_calls"] is False and body["tools"][0]["function"]["strict"] is True
        up.push({"tool_call": True})             # streamed: a tool_use block of input_json_delta pieces
        async with client.messages.stream(model="m1", max_tokens=50, tools=TOOLS,
                                          messages=[{"role": "user", "content": "weather?"}]) as stream:
            final = await stream.get_final_message()
        (call,) = final.content
        assert call.type == "tool_use" and call.name == "get_weather" and final.stop_reason == "tool_use"
        assert call.input == {"city1": "Paris"}   # the upstream's argument pieces, joined by the SDK
        assert call.id.startswith("toolu_")       # as the whole answer's


async def test_count_tokens_and_image_blocks(up):
    async with gateway(config(up)) as (gw, client, _):
        n = await client.messages.count_tokens(model="m1", system="sys",
                                               messages=[{"role": "user", "content": "hello there"}])
        assert n.input_tokens == (3 + 11 + 3) // 4 + 4 * 2     # the estimate: no local engine
        raw = await client.messages.with_raw_response.count_tokens(
            model="m1", messages=[{"role": "user", "content": "hi"}])
        assert raw.status_code == 200                           # as Anthropic's (Litestar's POST default is 201)
        assert up.calls == 0                                    # counting calls no model
        await client.messages.create(model="m1", max_tokens=5, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}},
            {"type": "text", "text": "what is it?"}]}])
        assert sent(up)["messages"][0]["content"] == [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
            {"type": "text", "text": "what is it?"}]


async def test_a_field_of_the_wrong_type_is_not_called_missing(up):
    async with gateway(config(up)) as (gw, client, url):
        async with httpx.AsyncClient() as h:
            r = await h.post(url + "/v1/messages", headers={"x-api-key": KEY},
                             json={"model": "m1", "max_tokens": "x", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 400 and r.json()["error"] == {"type": "invalid_request_error",
                                                          "message": "max_tokens: Input should be an integer, got str"}
    assert up.calls == 0


async def test_max_tokens_below_one_is_refused_in_anthropics_words(up):
    async with gateway(config(up)) as (gw, client, url):
        async with httpx.AsyncClient() as h:
            for value in (0, -3):
                body = {"model": "m1", "max_tokens": value, "messages": [{"role": "user", "content": "x"}]}
                r = await h.post(url + "/v1/messages", headers={"x-api-key": KEY}, json=body)
                assert r.status_code == 400 and r.json() == {"type": "error", "error": {
                    "type": "invalid_request_error",
                    "message": f"max_tokens: Input should be greater than or equal to 1, got {value}"}}
    assert up.calls == 0


async def test_empty_messages_are_called_empty(up):
    async with gateway(config(up)) as (gw, client, url):
        async with httpx.AsyncClient() as h:
            r = await h.post(url + "/v1/messages", headers={"x-api-key": KEY},
                             json={"model": "m1", "max_tokens": 5, "messages": []})
    assert r.status_code == 400 and r.json()["error"] == {
        "type": "invalid_request_error", "message": "messages: Input should be a non-empty array, got an empty list"}
    assert up.calls == 0


async def test_errors_are_anthropics(up):
    async with gateway(config(up, rpm=3)) as (gw, client, url):
        async with httpx.AsyncClient() as h:                   # max_tokens is required
            r = await h.post(url + "/v1/messages", headers={"x-api-key": KEY},
                             json={"model": "m1", "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 400 and r.json() == {"type": "error", "error": {"type": "invalid_request_error",
                                                           "message": "max_tokens: Field required (an integer)"}}
        with pytest.raises(anthropic.AuthenticationError) as e:
            await client.with_options(api_key="sk-wrong").messages.create(
                model="m1", max_tokens=5, messages=[{"role": "user", "content": "x"}])
        assert e.value.body["error"]["type"] == "authentication_error"
        async with httpx.AsyncClient() as h:                   # no key: Anthropic's header is the one named
            r = await h.post(url + "/v1/messages", json={"model": "m1", "max_tokens": 5, "messages": [
                {"role": "user", "content": "x"}]})
        assert r.status_code == 401 and "send x-api-key: <key>" in r.json()["error"]["message"], r.text
        with pytest.raises(anthropic.NotFoundError) as e:
            await client.messages.create(model="nope", max_tokens=5, messages=[{"role": "user", "content": "x"}])
        assert e.value.body["error"]["type"] == "not_found_error"
        assert e.value.request_id == e.value.response.headers["x-request-id"]   # on refusals too
        up.push({"status": 500})
        with pytest.raises(anthropic.APIStatusError) as e:       # the upstream's failure, after the attempts
            await client.messages.create(model="m1", max_tokens=5, messages=[{"role": "user", "content": "x"}])
        assert e.value.status_code == 502 and e.value.body["type"] == "error"
        up.push({"status": 503})
        with pytest.raises(anthropic.OverloadedError) as e:      # overloaded: Anthropic's 529, not a 503
            await client.messages.create(model="m1", max_tokens=5, messages=[{"role": "user", "content": "x"}])
        assert e.value.body["error"]["type"] == "overloaded_error"
        from prometheus_client import generate_latest           # counted as the client got it (a trial's log said 503)
        for _ in range(500):                                   # accounted once the request ended (a task)
            if 'status="529"' in generate_latest(gw.obs.registry).decode():
                break
            await asyncio.sleep(0.02)
        assert 'status="529"' in generate_latest(gw.obs.registry).decode(), [
            x for x in generate_latest(gw.obs.registry).decode().splitlines() if x.startswith("tandem_requests_total")]
        raw = await client.messages.with_raw_response.create(model="m1", max_tokens=5,
                                                             messages=[{"role": "user", "content": "x"}])
        # Anthropic's rate-limit headers beside OpenAI's (an ops trial's clients read Anthropic's names)
        assert raw.headers["anthropic-ratelimit-requests-limit"] == raw.headers["x-ratelimit-limit-requests"] == "3"
        assert raw.headers["anthropic-ratelimit-requests-remaining"] == raw.headers["x-ratelimit-remaining-requests"]
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", raw.headers["anthropic-ratelimit-requests-reset"])
        with pytest.raises(anthropic.RateLimitError) as e:       # rpm 3: the fourth admitted request is refused
            await client.messages.create(model="m1", max_tokens=5, messages=[{"role": "user", "content": "x"}])
        assert e.value.body["error"]["type"] == "rate_limit_error"
        assert e.value.response.headers.get("retry-after")
        assert e.value.response.headers["anthropic-ratelimit-requests-remaining"] == "0"
        gw.draining = True                                     # refused before routing: the same 529
        with pytest.raises(anthropic.OverloadedError) as e:
            await client.messages.create(model="m1", max_tokens=5, messages=[{"role": "user", "content": "x"}])
        assert e.value.body["error"]["type"] == "overloaded_error" and "draining" in e.value.message
        gw.draining = False
        recs = sorted((await records(gw, 3)).values(), key=lambda r: r.failed)   # the admitted ones: 1 answered
        assert [(r.completion_tokens, r.nusd, r.failed) for r in recs] == [(3, recs[0].nusd, False), (0, 0, True),
                                                                          (0, 0, True)]


# ----- type: anthropic -- native pass-through ----------------------------------------------------------------------
def anthropic_config(claude: AnthropicUpstream, fallback: FaultUpstream) -> str:
    return (f"reload: {{watch: false}}\nauth:\n  keys:\n    - {{tenant: t1, sha256: {sha(KEY)}}}\n"
            "resilience:\n  retry: {max_attempts: 2}\n  health: {interval_s: 0}\n"
            "observability:\n  logs: {requests: false}\nmodels:\n  - name: m1\n"
            f"backends:\n  claude:\n    type: anthropic\n    base_url: {claude.base_url}\n"
            "    api_key_env: TEST_ANTHROPIC_KEY\n    models: {m1: claude-model}\n    prices: {input: 3, output: 15}\n"
            f"  up:\n    type: openai\n    base_url: {fallback.base_url}\n"
            "routes:\n  r1:\n    targets: [{backend: claude}]\n    fallbacks: [{backend: up}]\n"
            "policy:\n  default_route: r1\n")


async def test_anthropic_backend_gets_the_messages_body_natively(up, monkeypatch):
    monkeypatch.setenv("TEST_ANTHROPIC_KEY", "sk-ant-upstream")
    with AnthropicUpstream() as claude:
        async with gateway(anthropic_config(claude, up)) as (gw, client, _):
            req = {"model": "m1", "max_tokens": 30, "system": "sys", "metadata": {"user_id": "u1"},
                   "messages": [{"role": "user", "content": [{"type": "text", "text": "hi",
                                                              "cache_control": {"type": "ephemeral"}}]}]}
            msg = await client.messages.create(**req)
            assert msg.content[0].text == "hello from claude" and msg.model == "m1"
            assert (msg.usage.input_tokens, msg.usage.output_tokens) == (7, 2)
            path, headers, body = claude.requests[-1]
            assert body == {**req, "model": "claude-model"}          # as the client sent it
            assert headers["x-api-key"] == "sk-ant-upstream" and headers["anthropic-version"] == "2023-06-01"
            assert "authorization" not in {k.lower() for k in headers}
            async with client.messages.stream(**req, tools=TOOLS) as stream:
                final = await stream.get_final_message()
            assert [b.type for b in final.content] == ["text", "tool_use"] and final.stop_reason == "tool_use"
            assert final.content[1].input == {"city": "Paris"} and final.content[1].id == "toolu_1"
            recs = await records(gw, 2)
            assert {(r.backend, r.prompt_tokens, r.completion_tokens, r.estimated) for r in recs.values()} == \
                {("claude", 7, 2, False)}
            claude.status = 529                    # overloaded: falls back to the chat upstream, translated
            msg = await client.messages.create(**req)
            assert msg.content[0].text == "hello from up"
            assert up.calls == 1
        # a chat request is translated for it (tests/gateway/http/test_chat_on_anthropic.py), one it cannot take
        # (n > 1) goes to the fallback
        claude.status = 200
        async with gateway(anthropic_config(claude, up)) as (gw, _, url):
            async with httpx.AsyncClient() as h:
                r = await h.post(url + "/v1/chat/completions", headers={"authorization": f"Bearer {KEY}"},
                                 json={"model": "m1", "messages": [{"role": "user", "content": "x"}]})
                two = await h.post(url + "/v1/chat/completions", headers={"authorization": f"Bearer {KEY}"},
                                   json={"model": "m1", "n": 2, "messages": [{"role": "user", "content": "x"}]})
            assert r.status_code == 200 and r.headers["x-tandem-backend"] == "claude"
            assert two.status_code == 200 and two.headers["x-tandem-backend"] == "up"
            assert len(claude.requests) == 4


async def test_an_anthropic_upstreams_whole_answer_reaches_the_client_as_it_was(up, monkeypatch):
    """A trial's ``type: anthropic`` answers lost their thinking blocks (Anthropic refuses a tool-use turn sent
    back without them, signatures intact), merged text blocks around a tool_use, and folded the cache-write
    tokens into ``input_tokens``: a whole answer's blocks, stop and usage reach a /v1/messages client as the
    upstream sent them, under the gateway's id and model; the ledger counts every input token."""
    monkeypatch.setenv("TEST_ANTHROPIC_KEY", "sk-ant-upstream")
    blocks = [{"type": "thinking", "thinking": "let me see", "signature": "sig_abc123"},
              {"type": "redacted_thinking", "data": "opaque"},
              {"type": "text", "text": "first"},
              {"type": "tool_use", "id": "toolu_9", "name": "get_weather", "input": {"city": "Paris"}},
              {"type": "text", "text": "second"}]
    usage = {"input_tokens": 11, "output_tokens": 4, "cache_read_input_tokens": 100, "cache_creation_input_tokens": 20}
    with AnthropicUpstream() as claude:
        claude.content, claude.usage = blocks, usage
        async with gateway(anthropic_config(claude, up)) as (gw, client, _):
            raw = await client.messages.with_raw_response.create(
                model="m1", max_tokens=2000, tools=TOOLS, thinking={"type": "enabled", "budget_tokens": 1024},
                messages=[{"role": "user", "content": "weather?"}])
            msg = await raw.parse()
            (rec,) = (await records(gw, 1)).values()
            async with client.messages.stream(model="m1", max_tokens=2000, tools=TOOLS,
                                              thinking={"type": "enabled", "budget_tokens": 1024},
                                              messages=[{"role": "user", "content": "weather?"}]) as stream:
                streamed = await stream.get_final_message()
    assert [b.model_dump(exclude_none=True) for b in msg.content] == blocks
    assert [b.model_dump(exclude_none=True) for b in streamed.content] == blocks   # streamed: the same blocks
    # and the same usage (a trial's stream folded the cache writes into input_tokens, and said 0 of them)
    assert streamed.usage.model_dump(exclude_none=True) == usage
    assert msg.usage.model_dump(exclude_none=True) == usage and msg.stop_reason == "tool_use"
    assert msg.id.startswith("msg_gw-") and msg.model == "m1"
    assert (rec.prompt_tokens, rec.cached_tokens, rec.completion_tokens) == (131, 100, 4)


async def test_an_anthropic_upstream_that_counts_nothing_is_billed_the_gateways_count(up, monkeypatch):
    """A migration trial: an Anthropic upstream answering without ``usage`` (a proxy that drops it) was billed 0
    tokens, $0, not marked estimated, so a tenant's budget never moved; as for an OpenAI upstream that gives no
    usage, the gateway counts the prompt and the answer, the record says estimated, and the client gets the count."""
    monkeypatch.setenv("TEST_ANTHROPIC_KEY", "sk-ant-upstream")
    with AnthropicUpstream() as claude:
        claude.usage = {}
        async with gateway(anthropic_config(claude, up)) as (gw, client, _):
            req = {"model": "m1", "max_tokens": 30, "messages": [{"role": "user", "content": "say hello to claude"}]}
            msg = await client.messages.create(**req)
            async with client.messages.stream(**req) as stream:
                streamed = await stream.get_final_message()
            recs = await records(gw, 2)
    assert {(r.backend, r.estimated) for r in recs.values()} == {("claude", True)}
    assert all(r.prompt_tokens > 0 and r.completion_tokens > 0 and r.nusd > 0 for r in recs.values()), recs
    counts = {(r.prompt_tokens, r.completion_tokens) for r in recs.values()}
    assert counts == {(msg.usage.input_tokens, msg.usage.output_tokens)}, (counts, msg.usage)
    assert streamed.usage.output_tokens == msg.usage.output_tokens > 0


async def test_a_completions_request_for_a_model_only_anthropic_backends_serve_is_a_404_saying_why(up, monkeypatch):
    """A trial's requests for such a model got 503 "No backend of this route is available" (the reason only in the
    log): OpenAI's 404 for a model its endpoint cannot reach, naming what the backend takes (chat completions and
    /v1/messages, not /v1/completions)."""
    monkeypatch.setenv("TEST_ANTHROPIC_KEY", "sk-ant-upstream")
    with AnthropicUpstream() as claude:
        cfg = anthropic_config(claude, up).replace("    fallbacks: [{backend: up}]\n", "")
        async with gateway(cfg) as (gw, client, url):
            oai = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
            with pytest.raises(openai.NotFoundError) as e:
                await oai.completions.create(model="m1", prompt="x")
            assert e.value.body["param"] == "model" and "serves chat completions and /v1/messages, not " \
                "/v1/completions" in e.value.body["message"], e.value.body
            msg = await client.messages.create(model="m1", max_tokens=5, messages=[{"role": "user", "content": "x"}])
            await oai.close()
    assert msg.content[0].text == "hello from claude" and up.calls == 0


async def test_an_overloaded_anthropic_upstream_is_the_clients_529(up, monkeypatch):
    """A trial's upstream 529 ``overloaded_error`` reached the client as 502 ``api_error`` after the retries:
    Anthropic's overloaded status is an overloaded answer here too, 529 on /v1/messages."""
    monkeypatch.setenv("TEST_ANTHROPIC_KEY", "sk-ant-upstream")
    with AnthropicUpstream() as claude:
        claude.status = 529
        cfg = anthropic_config(claude, up).replace("    fallbacks: [{backend: up}]\n", "")
        async with gateway(cfg) as (gw, client, _):
            with pytest.raises(anthropic.OverloadedError) as e:
                await client.with_options(max_retries=0).messages.create(
                    model="m1", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert e.value.status_code == 529 and e.value.body["error"]["type"] == "overloaded_error"


async def test_x_api_key_and_a_bearer_key_that_differ_are_a_401(up):
    """A security trial: a bad ``x-api-key`` beside a good bearer key was served (billed to the bearer's tenant),
    and two tenants' keys were resolved silently. Both the same key, or either alone, is served."""
    async with gateway(config(up)) as (gw, client, url):
        body = {"model": "m1", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
        async with httpx.AsyncClient() as h:
            both = [await h.post(url + path, json=body, headers={"x-api-key": key, "authorization": f"Bearer {KEY}"})
                    for key in ("sk-not-a-key", KEY) for path in ("/v1/messages", "/v1/messages/count_tokens")]
            alone = await h.post(url + "/v1/messages", json=body, headers={"authorization": f"Bearer {KEY}"})
    assert [r.status_code for r in both] == [401, 401, 200, 200] and alone.status_code == 200
    assert both[0].json() == {"type": "error", "error": {
        "type": "authentication_error",
        "message": "x-api-key and Authorization: Bearer name different keys: send one of them"}}


async def test_too_many_stop_sequences_are_named_as_anthropic_names_them(up):
    async with gateway(config(up)) as (gw, client, url):
        async with httpx.AsyncClient() as h:
            r = await h.post(url + "/v1/messages", headers={"x-api-key": KEY}, json={
                "model": "m1", "max_tokens": 5, "stop_sequences": ["a"] * 300,
                "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and up.calls == 0
    assert r.json()["error"]["message"] == ("Invalid 'stop_sequences': array too long. Expected an array with maximum "
                                            "length 256, but got an array with length 300 instead.")


async def test_the_anthropic_sdk_lists_and_retrieves_anthropics_model_objects(up):
    """``GET /v1/models`` with Anthropic's headers (``x-api-key``, ``anthropic-version``) answers Anthropic's model
    objects and pages (an SDK trial's ``created_at`` and ``display_name`` were None in OpenAI's list); OpenAI's
    clients still get OpenAI's list."""
    cfg = config(up).replace("models:\n  - name: m1\n", "models:\n  - name: m1\n  - name: m2\n  - name: m3\n")
    cfg = cfg.replace("models: {m1: up-model}", "models: {m1: up-model, m2: up-model, m3: up-model}")
    async with gateway(cfg) as (gw, client, url):
        listed = [m async for m in client.models.list(limit=2)]      # the SDK pages on has_more and last_id
        first = await client.models.list(limit=2)
        before = await client.models.list(before_id="m3", limit=1)
        one = await client.models.retrieve("m2")
        async with httpx.AsyncClient() as h:
            openai_list = (await h.get(url + "/v1/models", headers={"authorization": f"Bearer {KEY}"})).json()
            bad = await h.get(url + "/v1/models?limit=0", headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"})
    assert [m.id for m in listed] == ["m1", "m2", "m3"]
    assert (first.has_more, first.first_id, first.last_id) == (True, "m1", "m2")
    assert [m.id for m in before.data] == ["m2"] and before.has_more
    assert (one.type, one.id, one.display_name) == ("model", "m2", "m2") and one.created_at.tzinfo is not None
    assert openai_list["object"] == "list" and [m["id"] for m in openai_list["data"]] == ["m1", "m2", "m3"]
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "limit"
