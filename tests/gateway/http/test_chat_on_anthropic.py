"""Chat completions and the Responses API served by a ``type: anthropic`` backend (a migration trial: a LiteLLM
user's chat traffic for a Claude model quietly went to the route's OpenAI fallback; LiteLLM translates it). The
official ``openai`` SDK as the client, a gateway in this process, the fake Anthropic upstream
(``tests/gateway/anthropic_upstream.py``), which records the Messages bodies it is sent."""

from __future__ import annotations

import json

import openai
import pytest

from tests.gateway.anthropic_upstream import AnthropicUpstream
from tests.gateway.fault_upstream import FaultUpstream
from tests.gateway.http.test_messages import KEY, anthropic_config, gateway, records

PNG = "iVBORw0KGgo="
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather of a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TWO_CALLS = [{"type": "text", "text": "checking both"},
             {"type": "tool_use", "id": "toolu_a", "name": "get_weather", "input": {"city": "Paris"}},
             {"type": "tool_use", "id": "toolu_b", "name": "get_weather", "input": {"city": "Rome"}}]


@pytest.fixture
def up():
    with FaultUpstream("up") as u:
        yield u


@pytest.fixture
def claude(monkeypatch):
    monkeypatch.setenv("TEST_ANTHROPIC_KEY", "sk-ant-upstream")
    with AnthropicUpstream() as c:
        yield c


def only_claude(claude, up) -> str:
    return anthropic_config(claude, up).replace("    fallbacks: [{backend: up}]\n", "")


def oai(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=20)


async def test_a_chat_request_is_translated_into_a_messages_body_and_its_answer_back(claude, up):
    async with gateway(only_claude(claude, up)) as (gw, _, url):
        client = oai(url)
        raw = await client.chat.completions.with_raw_response.create(
            model="m1", max_tokens=50, temperature=0.5, top_p=0.9, stop="END", user="u-7",
            extra_body={"top_k": 5, "metadata": {"ticket": "42"}, "store": False},
            messages=[{"role": "system", "content": "be brief"}, {"role": "developer", "content": "no lists"},
                      {"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                                   {"type": "image_url",
                                                    "image_url": {"url": f"data:image/png;base64,{PNG}"}},
                                                   {"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}])
        reply = raw.parse()
        body = json.loads(raw.http_response.content)
        (rec,) = (await records(gw, 1)).values()
        await client.close()
    path, headers, sent = claude.requests[-1]
    assert path == "/v1/messages" and headers["x-api-key"] == "sk-ant-upstream"
    assert sent == {"model": "claude-model", "max_tokens": 50, "temperature": 0.5, "top_p": 0.9, "top_k": 5,
                    "stop_sequences": ["END"], "metadata": {"user_id": "u-7"}, "system": "be brief\n\nno lists",
                    "messages": [{"role": "user", "content": [
                        {"type": "text", "text": "what is this?"},
                        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}},
                        {"type": "image", "source": {"type": "url", "url": "https://x/y.png"}}]}]}
    assert reply.choices[0].message.content == "hello from claude" and reply.choices[0].finish_reason == "stop"
    assert reply.id.startswith("chatcmpl-") and reply.model == "m1" and reply.created > 0
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (7, 2)
    assert "anthropic_message" not in body                   # the upstream's own Message stays the gateway's
    assert (rec.backend, rec.prompt_tokens, rec.completion_tokens, rec.estimated) == ("claude", 7, 2, False)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_parallel_tool_calls_and_their_results_round_trip(claude, up, stream):
    claude.content = TWO_CALLS
    async with gateway(only_claude(claude, up)) as (gw, _, url):
        client = oai(url)
        ask = {"model": "m1", "max_tokens": 100, "tools": [WEATHER], "tool_choice": "required",
               "messages": [{"role": "user", "content": "weather in Paris and Rome?"}]}
        if stream:
            async with client.chat.completions.stream(**ask) as s:
                message = (await s.get_final_completion()).choices[0]
        else:
            message = (await client.chat.completions.create(**ask)).choices[0]
        calls = message.message.tool_calls
        turn = message.message.model_dump(exclude_none=True)
        claude.content = None
        strict = {**WEATHER, "function": {**WEATHER["function"], "strict": True}}   # passed on (it was dropped)
        again = await client.chat.completions.create(**{**ask, "tools": [strict], "tool_choice": {
            "type": "function", "function": {"name": "get_weather"}}, "parallel_tool_calls": False, "messages": [
            *ask["messages"], turn, *({"role": "tool", "tool_call_id": c.id, "content": f"sunny {i}"}
                                      for i, c in enumerate(calls))]})
        await client.close()
    assert message.finish_reason == "tool_calls" and message.message.content == "checking both"
    assert [(c.id, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("toolu_a", "get_weather", {"city": "Paris"}), ("toolu_b", "get_weather", {"city": "Rome"})]
    first, second = claude.requests[-2][2], claude.requests[-1][2]
    assert first["tools"] == [{"name": "get_weather", "description": "The weather of a city",
                               "input_schema": WEATHER["function"]["parameters"]}]
    assert first["tool_choice"] == {"type": "any"} and first.get("stream", False) is stream
    assert second["tool_choice"] == {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}
    assert second["tools"][0]["strict"] is True and "strict" not in first["tools"][0]
    assert second["messages"][1:] == [
        {"role": "assistant", "content": [{"type": "text", "text": "checking both"}, *TWO_CALLS[1:]]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_a", "content": "sunny 0"},
                                     {"type": "tool_result", "tool_use_id": "toolu_b", "content": "sunny 1"}]}]
    assert again.choices[0].message.tool_calls[0].function.name == "get_weather"


async def test_a_streamed_chat_answer_counts_as_the_upstream_did(claude, up):
    async with gateway(only_claude(claude, up)) as (gw, _, url):
        client = oai(url)
        chunks = [c async for c in await client.chat.completions.create(
            model="m1", stream=True, stream_options={"include_usage": True},
            messages=[{"role": "user", "content": "hi"}])]
        (rec,) = (await records(gw, 1)).values()
        await client.close()
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "hello from claude"
    assert chunks[-1].usage.prompt_tokens == 7 and chunks[-1].usage.completion_tokens == 2
    assert claude.requests[-1][2]["max_tokens"] == 4096       # Anthropic requires one: LiteLLM's default
    assert (rec.prompt_tokens, rec.completion_tokens, rec.estimated) == (7, 2, False)


async def test_a_json_schema_format_and_the_responses_api(claude, up):
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    async with gateway(only_claude(claude, up)) as (gw, _, url):
        client = oai(url)
        await client.chat.completions.create(model="m1", max_tokens=20, messages=[{"role": "user", "content": "x"}],
                                             response_format={"type": "json_schema", "json_schema": {
                                                 "name": "out", "schema": schema}})
        formatted = claude.requests[-1][2]
        resp = await client.responses.create(model="m1", input="hi", instructions="be kind", max_output_tokens=30)
        await client.close()
    assert formatted["output_config"] == {"format": {"type": "json_schema", "schema": schema}}
    assert resp.output_text == "hello from claude" and resp.status == "completed"
    assert claude.requests[-1][2]["system"] == "be kind" and claude.requests[-1][2]["max_tokens"] == 30


async def test_what_anthropic_cannot_give_goes_to_a_fallback_or_is_a_400_naming_it(claude, up):
    msgs = [{"role": "user", "content": "x"}]
    async with gateway(only_claude(claude, up)) as (gw, _, url):
        client = oai(url)
        refused = {}
        for name, extra in {"n": {"n": 2}, "logprobs": {"logprobs": True}, "seed": {"seed": 1},
                            "response_format": {"response_format": {"type": "json_object"}},
                            "messages[0].content[0].type": {"messages": [{"role": "user", "content": [
                                {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}]}
                            }.items():
            with pytest.raises(openai.BadRequestError) as e:
                await client.chat.completions.create(**{"model": "m1", "messages": msgs, **extra})
            refused[name] = e.value.body
        taken = await client.chat.completions.create(model="m1", messages=msgs, n=1, logprobs=False,
                                                     presence_penalty=0)   # "not asked": taken
        await client.close()
    async with gateway(anthropic_config(claude, up)) as (gw, _, url):     # with the chat fallback
        client = oai(url)
        fell = await client.chat.completions.with_raw_response.create(model="m1", messages=msgs, n=2)
        await client.close()
    for name, body in refused.items():
        assert body["param"] == name and body["code"] == "unsupported_parameter", body
        assert "only by claude" in body["message"], body
    assert taken.choices[0].message.content == "hello from claude"
    assert len(claude.requests) == 1 and fell.headers["x-tandem-backend"] == "up" and up.calls == 1


async def test_an_anthropic_error_reaches_a_chat_client_in_openais_format(claude, up):
    claude.status = 400
    async with gateway(only_claude(claude, up)) as (gw, _, url):
        client = oai(url)
        with pytest.raises(openai.BadRequestError) as e:
            await client.chat.completions.create(model="m1", messages=[{"role": "user", "content": "x"}])
        await client.close()
    assert e.value.body["message"] == "injected" and e.value.body["type"] == "invalid_request_error", e.value.body


async def test_conversations_openai_takes_become_bodies_claude_takes(claude, up):
    # a second trial against a strict fake Messages API: stop=["\n"] (common with OpenAI's) and a greeting before
    # the user spoke reached Claude as they were and were refused; a prefill's trailing space too; a tool without
    # "type" in its parameters; a data:image/jpg URL
    tool = {"type": "function", "function": {"name": "f", "parameters": {"properties": {"a": {"type": "string"}}}}}
    async with gateway(only_claude(claude, up)) as (gw, _, url):
        client = oai(url)
        await client.chat.completions.create(
            model="m1", max_tokens=10, stop=["\n", " ", "END"], tools=[tool], messages=[
                {"role": "system", "content": [{"type": "text", "text": "s1"}, {"type": "text", "text": "s2"}]},
                {"role": "assistant", "content": "Hi, how can I help?"},
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"data:image/jpg;base64,{PNG}"}}]},
                {"role": "assistant", "content": "Sure: "}])
        sent = claude.requests[-1][2]
        await client.chat.completions.create(model="m1", max_tokens=10, stop="\n",
                                             messages=[{"role": "user", "content": "x"}])
        no_stops = claude.requests[-1][2]
        calls = len(claude.requests)
        refused = {}
        def called(arguments: str) -> dict:          # a past tool call whose arguments are not a JSON object
            return {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "done"}], "tools": [tool]}

        for name, extra in {"temperature": {"temperature": 1.5, "messages": [{"role": "user", "content": "x"}]},
                            "messages": {"messages": [{"role": "system", "content": "only a system prompt"}]},
                            "bad json": called("{bad json"), "not an object": called("[1]")}.items():
            with pytest.raises(openai.BadRequestError) as e:
                await client.chat.completions.create(model="m1", **extra)
            refused[name] = e.value.body
        taken = await client.chat.completions.create(model="m1", messages=[{"role": "user", "content": "x"}],
                                                     top_logprobs=0, logit_bias={})
        await client.chat.completions.create(model="m1", **called(""))       # no arguments: {}
        no_args = claude.requests[-1][2]["messages"][1]["content"][0]
        await client.close()
    assert sent["stop_sequences"] == ["END"] and "stop_sequences" not in no_stops
    assert sent["system"] == "s1\ns2"                # parts joined as the engine's rendering joins them
    assert [t["role"] for t in sent["messages"]] == ["user", "assistant", "user", "assistant"]
    assert sent["messages"][0] == {"role": "user", "content": [{"type": "text", "text": "."}]}
    assert sent["messages"][2]["content"][0]["source"]["media_type"] == "image/jpeg"
    assert sent["messages"][3]["content"] == [{"type": "text", "text": "Sure:"}]
    assert sent["tools"][0]["input_schema"] == {"type": "object", "properties": {"a": {"type": "string"}}}
    assert len(claude.requests) == calls + 2 and taken.choices[0].message.content == "hello from claude"
    # malformed arguments of a past call were sent as input {} (an agents trial): refused naming them
    args = ("messages[1].tool_calls[0].function.arguments", "unsupported_parameter")
    assert {k: (b["param"], b["code"]) for k, b in refused.items()} == {
        "temperature": ("temperature", "unsupported_parameter"), "messages": ("messages", "unsupported_parameter"),
        "bad json": args, "not an object": args}
    assert no_args["type"] == "tool_use" and no_args["input"] == {}


async def test_a_streamed_call_without_input_has_empty_object_arguments(claude, up):
    # the trial's streamed call of a tool without parameters ended with arguments "" (json.loads fails on it);
    # the whole answer and OpenAI's say "{}"
    claude.content = [{"type": "tool_use", "id": "toolu_p", "name": "ping", "input": {}}]
    ping = {"type": "function", "function": {"name": "ping"}}
    async with gateway(only_claude(claude, up)) as (gw, _, url):
        client = oai(url)
        async with client.chat.completions.stream(model="m1", tools=[ping],
                                                  messages=[{"role": "user", "content": "ping"}]) as s:
            streamed = (await s.get_final_completion()).choices[0].message.tool_calls
        whole = (await client.chat.completions.create(model="m1", tools=[ping], messages=[
            {"role": "user", "content": "ping"}])).choices[0].message.tool_calls
        await client.close()
    assert [c.function.arguments for c in streamed] == [c.function.arguments for c in whole] == ["{}"]
