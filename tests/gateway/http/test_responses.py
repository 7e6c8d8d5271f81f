"""The Responses API (issue 28) against a real gateway (the Litestar app under uvicorn on 127.0.0.1, in this
process) with the official ``openai`` SDK as the client and, as the only backend, the fault-injecting upstream
(``tests/gateway/fault_upstream.py``), which speaks chat completions only: every answer here went through the
translation onto chat and back. Routing, limits and the ledger are the chat pipeline's; one test per concern.
"""

from __future__ import annotations

import contextlib
import json

import httpx
import openai
import pytest
from openai import AsyncOpenAI

from gateway.config.compile import load_config_text
from gateway.http.app import create_app
from gateway.runtime import Gateway
from tests.conftest import free_port
from tests.gateway.fault_upstream import FaultUpstream
from tests.gateway.support import sha

KEY = "sk-tandem-responses-0123456789abcdef"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture
def up():
    with FaultUpstream("up") as u:
        yield u


def config(up: FaultUpstream, key_limits: str = "", budget_usd: float | None = None, redis_url: str | None = None,
           apis: str = "") -> str:
    budgets = f"budgets:\n  tenants: {{t1: {{usd: {budget_usd}, period: day}}}}\n" if budget_usd else ""
    # socket_timeout_s bounds a hang only: at the default 0.5 s a loaded host's slow call sent a replica to its
    # in-process fallback, where the other replica's stored response is not seen
    state = f"state: {{redis_url: '{redis_url}', socket_timeout_s: 30}}\n" if redis_url else ""
    return (f"reload: {{watch: false}}\nauth:\n  keys:\n    - {{tenant: t1, sha256: {sha(KEY)}{key_limits}}}\n"
            + state + budgets
            + "resilience:\n  retry: {max_attempts: 1}\n  health: {interval_s: 0}\n"
            + "observability:\n  logs: {requests: false}\nmodels:\n  - name: m1\n"
            + f"backends:\n  up:\n    type: openai\n    base_url: {up.base_url}\n"
              "    prices: {input: 1, output: 2}\n    timeouts: {connect_s: 2, read_s: 10, first_token_s: 5}\n"
            + (f"    apis: [{apis}]\n" if apis else "")
            + "routes:\n  r1:\n    targets: [{backend: up}]\npolicy:\n  default_route: r1\n")


@contextlib.asynccontextmanager
async def gateway(cfg: str):
    """One gateway on ``cfg``: yields (the ``Gateway``, an ``AsyncOpenAI`` client for it)."""
    import asyncio

    import uvicorn

    gw = Gateway(None, load_config_text(cfg), start_engine=False)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(gw), host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="on"))
    task = asyncio.create_task(server.serve())
    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0, timeout=20)
    try:
        while not server.started:
            if task.done():
                task.result()
            await asyncio.sleep(0.02)
        yield gw, client
    finally:
        await client.close()
        server.should_exit = True
        await task


async def test_plain_create_translated_onto_chat(up):
    async with gateway(config(up)) as (gw, client):
        raw = await client.responses.with_raw_response.create(model="m1", input="hi", instructions="be brief",
                                                              max_output_tokens=20, temperature=0.5)
    r = raw.parse()
    assert (raw.headers["x-tandem-route"], raw.headers["x-tandem-backend"]) == ("r1", "up")   # routed as chat
    assert r.status == "completed" and r.output_text == "hello from up"
    assert r.id.startswith("resp_gw-") and r.model == "m1"
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.input_tokens_details.cached_tokens) == (5, 3, 0)
    path, _, sent = up.requests[-1]
    assert path == "/v1/chat/completions"           # the upstream speaks chat only
    assert sent["messages"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert sent["max_tokens"] == 20 and sent["temperature"] == 0.5


async def test_function_call_round_trip(up):
    up.push({"tool_call": True}, {"content": "It is sunny in Paris."})
    async with gateway(config(up)) as (gw, client):
        first = await client.responses.create(model="m1", input="weather in Paris?", tools=[WEATHER],
                                              tool_choice="auto", parallel_tool_calls=False)
        call = first.output[0]
        assert (call.type, call.name, json.loads(call.arguments)) == ("function_call", "get_weather",
                                                                       {"city": "Paris"})
        second = await client.responses.create(
            model="m1", tools=[WEATHER],
            input=[{"role": "user", "content": "weather in Paris?"},
                   {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
                   {"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "sunny"}'}])
        # the call stored with the first response is answered by a later request's output alone
        up.push({"content": "Sunny."})
        third = await client.responses.create(model="m1", tools=[WEATHER], previous_response_id=first.id, input=[
            {"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "sunny"}'}])
        assert third.output_text == "Sunny." and up.requests[-1][2]["messages"][-1]["tool_call_id"] == call.call_id
    assert second.output_text == "It is sunny in Paris."
    sent_first, sent_second = up.requests[-3][2], up.requests[-2][2]
    assert sent_first["tools"] == [{"type": "function", "function": {k: WEATHER[k] for k in
                                                                      ("name", "description", "parameters")}}]
    assert sent_first["tool_choice"] == "auto" and sent_first["parallel_tool_calls"] is False
    assert sent_second["messages"][1:] == [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function",
             "function": {"name": "get_weather", "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": '{"sky": "sunny"}'}]


async def test_text_format_json_schema_becomes_response_format(up):
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
              "additionalProperties": False}
    up.push({"content": '{"answer": 4}'})
    async with gateway(config(up)) as (gw, client):
        r = await client.responses.create(model="m1", input="2+2?", text={
            "format": {"type": "json_schema", "name": "sum", "schema": schema, "strict": True}})
    assert json.loads(r.output_text) == {"answer": 4}
    assert r.text.format.type == "json_schema"
    assert up.requests[-1][2]["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "sum", "schema": schema, "strict": True}}


async def test_previous_response_id_over_three_turns_then_retrieve_list_delete(up):
    up.push({"content": "A"}, {"content": "B"}, {"content": "C"})
    async with gateway(config(up)) as (gw, client):
        r1 = await client.responses.create(model="m1", input="one")
        r2 = await client.responses.create(model="m1", input="two", previous_response_id=r1.id)
        r3 = await client.responses.create(model="m1", input="three", previous_response_id=r2.id,
                                           instructions="sys")
        assert r3.previous_response_id == r2.id and r3.output_text == "C"
        got = await client.responses.retrieve(r2.id)
        assert got.id == r2.id and got.output_text == "B"
        items = await client.responses.input_items.list(r3.id, order="asc")
        assert [i.content[0].text for i in items.data] == ["three"]
        assert (await client.responses.delete(r1.id)) is None    # the SDK returns nothing on success
        with pytest.raises(openai.NotFoundError) as e:
            await client.responses.create(model="m1", input="four", previous_response_id=r1.id)
        assert e.value.body["param"] == "previous_response_id"
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(r1.id)
        unstored = await client.responses.create(model="m1", input="x", store=False)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(unstored.id)
        with pytest.raises(openai.BadRequestError) as e:   # OpenAI cancels background responses only
            await client.responses.cancel(r2.id)
        assert e.value.body["message"] == "Cannot cancel a synchronous response."
        with pytest.raises(openai.NotFoundError):
            await client.responses.cancel(unstored.id)
    # instructions do not carry over (OpenAI's rule); each turn's input and output do
    assert up.requests[2][2]["messages"] == [
        {"role": "system", "content": "sys"}, {"role": "user", "content": "one"},
        {"role": "assistant", "content": "A"}, {"role": "user", "content": "two"},
        {"role": "assistant", "content": "B"}, {"role": "user", "content": "three"}]


async def test_stored_fields_a_trial_missed_and_the_queries_it_got_200_for(up):
    """A new user's trial: no ``completed_at``, input items without ``status``, ``GET ...?stream=true`` answered
    JSON, and ``include=bogus`` on ``input_items`` answered 200."""
    async with gateway(config(up)) as (gw, client):
        r = await client.responses.create(model="m1", input=[
            {"role": "user", "content": "hi"}, {"role": "user", "content": "again", "status": "completed"}])
        got = await client.responses.retrieve(r.id)
        items = await client.responses.input_items.list(r.id, order="asc")
        with pytest.raises(openai.BadRequestError) as streamed:
            await client.responses.retrieve(r.id, stream=True)
        with pytest.raises(openai.BadRequestError) as listed:
            await client.responses.input_items.list(r.id, include=["bogus.thing"])
        with pytest.raises(openai.BadRequestError) as retrieved:
            await client.responses.retrieve(r.id, include=["message.output_text.logprobs", "bogus.thing"])
        ok = await client.responses.input_items.list(r.id, include=["message.input_image.image_url"])
    assert r.status == "completed" and r.completed_at is not None and r.completed_at >= r.created_at
    assert got.completed_at == r.completed_at
    assert [(i.type, i.status) for i in items.data] == [("message", "completed"), ("message", "completed")]
    assert (streamed.value.body["param"], streamed.value.body["code"]) == ("stream", "invalid_value")
    assert listed.value.body["param"] == "include[0]" and retrieved.value.body["param"] == "include[1]"
    assert len(ok.data) == 2


async def test_previous_response_id_in_redis_is_seen_by_another_replica(up, redis_url):
    up.push({"content": "A"}, {"content": "B"})
    cfg = config(up, redis_url=redis_url)
    async with gateway(cfg) as (_, one), gateway(cfg) as (_, two):
        r1 = await one.responses.create(model="m1", input="one")
        r2 = await two.responses.create(model="m1", input="two", previous_response_id=r1.id)
    assert r2.output_text == "B"
    assert [m["content"] for m in up.requests[-1][2]["messages"]] == ["one", "A", "two"]


async def test_stream_events_in_order_parsed_by_the_sdk(up):
    async with gateway(config(up)) as (gw, client):
        async with client.responses.stream(model="m1", input="hi") as stream:
            types = [e.type async for e in stream]
            final = await stream.get_final_response()
        stored = await client.responses.retrieve(final.id)
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[4:7] == ["response.output_text.delta"] * 3
    assert types[7:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                         "response.completed"]
    assert final.output_text == "tok0 tok1 tok2 " == stored.output_text
    assert (final.usage.input_tokens, final.usage.output_tokens) == (5, 3)


async def test_stream_function_call_arguments(up):
    up.push({"tool_call": True, "chunks": 3})
    async with gateway(config(up)) as (gw, client):
        events = [e async for e in await client.responses.create(model="m1", input="w", tools=[WEATHER],
                                                                  stream=True)]
    types = [e.type for e in events]
    assert types[2] == "response.output_item.added" and events[2].item.type == "function_call"
    assert types.count("response.function_call_arguments.delta") == 2
    assert types[-3:] == ["response.function_call_arguments.done", "response.output_item.done",
                          "response.completed"]
    assert events[-1].response.output[0].arguments == '{"city1": "Paris"}{"city2": "Paris"}'
    assert [e.sequence_number for e in events] == list(range(len(events)))


async def test_stream_failure_after_content_is_response_failed(up):
    up.push({"error_after": 2})
    async with gateway(config(up)) as (gw, client):
        events = [e async for e in await client.responses.create(model="m1", input="hi", stream=True)]
    assert events[-1].type == "response.failed" and events[-1].response.status == "failed"
    assert events[-1].response.error.message


async def test_builtin_tool_and_out_of_range_refused_naming_the_responses_parameter(up):
    async with gateway(config(up)) as (gw, client):
        with pytest.raises(openai.BadRequestError) as e:
            await client.responses.create(model="m1", input="hi", tools=[{"type": "web_search"}])
        with pytest.raises(openai.BadRequestError) as r:
            await client.responses.create(model="m1", input="hi", max_output_tokens=-1)
    assert e.value.body["param"] == "tools[0].type" and "web_search" in e.value.body["message"]
    assert r.value.body["param"] == "max_output_tokens" and "max_output_tokens" in r.value.body["message"]
    assert up.calls == 0


async def assert_refused(client, cases: list) -> None:
    """Each (extra body, param, code) of ``cases`` is OpenAI's 400 naming ``param`` (in its message too, never
    chat's ``.function`` path)."""
    for extra, param, code in cases:
        with pytest.raises(openai.BadRequestError) as e:
            await client.responses.create(model="m1", input="hi", extra_body=extra)
        assert (e.value.body["param"], e.value.body["code"]) == (param, code), extra
        assert param in e.value.body["message"] and ".function" not in e.value.body["message"]


async def test_parameters_checked_as_openai_does_unknown_type_and_range(up):
    # (extra body, param, code): every refusal names what the client sent, before any upstream call
    cases = [({"seed": 2 ** 70}, "seed", "integer_above_max_value"), ({"seed": "abc"}, "seed", "invalid_type"),
             ({"bogus_field": 1}, "bogus_field", "unknown_parameter"),
             ({"top_logprobs": 21}, "top_logprobs", "integer_above_max_value"),
             ({"max_output_tokens": "4"}, "max_output_tokens", "invalid_type"),
             ({"temperature": True}, "temperature", "invalid_type")]
    async with gateway(config(up)) as (gw, client):
        await assert_refused(client, cases)
        assert up.calls == 0
        await client.responses.create(model="m1", input="hi", extra_body={"seed": 7})    # in range: it reaches chat
    assert up.requests[-1][2]["seed"] == 7


async def test_text_keys_are_checked_not_dropped_and_verbosity_reaches_chat(up):
    # a user trial: chat's json_schema level inside text.format was dropped, the answer a 200 unconstrained
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    cases = [({"format": {"type": "json_schema", "name": "x", "json_schema": schema}}, "text.format.json_schema"),
             ({"format": {"type": "json_object", "schema": schema}}, "text.format.schema"),
             ({"fromat": {"type": "json_object"}}, "text.fromat")]
    async with gateway(config(up)) as (gw, client):
        for text, param in cases:
            with pytest.raises(openai.BadRequestError) as e:
                await client.responses.create(model="m1", input="Say hello.", max_output_tokens=30, temperature=0,
                                              text=text)
            assert (e.value.body["param"], e.value.body["code"]) == (param, "unknown_parameter"), text
            assert param in e.value.body["message"]
        with pytest.raises(openai.BadRequestError) as e:
            await client.responses.create(model="m1", input="hi", text={"format": {"type": "json_schema",
                                                                                   "schema": schema}})
        assert (e.value.body["param"], e.value.body["code"]) == ("text.format.name", "missing_required_parameter")
        assert up.calls == 0
        r = await client.responses.create(model="m1", input="hi", text={"verbosity": "low"})
    assert up.requests[-1][2]["verbosity"] == "low" and r.text.verbosity == "low"


async def test_tool_refusals_name_the_responses_paths(up):
    # (extra, param, code): a trial saw chat's tool_choice.function.name and "None is not one of the tools"
    cases = [({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "g"}}, "tool_choice.name",
              "invalid_value"),
             ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice.name",
              "missing_required_parameter"),
             ({"tools": [{**WEATHER, "description": 3}]}, "tools[0].description", "invalid_type"),
             # a key a Responses function tool does not have was dropped (a misspelling, another API's key)
             ({"tools": [{**WEATHER, "paramters": {}}]}, "tools[0].paramters", "unknown_parameter"),
             ({"tools": [{**WEATHER, "input_schema": {}}]}, "tools[0].input_schema", "unknown_parameter"),
             ({"parallel_tool_calls": True}, "parallel_tool_calls", "invalid_value")]
    async with gateway(config(up)) as (gw, client):
        await assert_refused(client, cases)
    assert up.calls == 0


async def test_a_backends_schema_refusal_names_text_format_whole_and_streamed(up):
    # the local engine's refusal of an unsupported schema keyword, as it names the translated chat body
    refusal = {"status": 400, "param": "response_format",
               "message": "response_format.json_schema.schema.properties.tags: unsupported schema feature 'contains'"}
    fmt = {"type": "json_schema", "name": "t", "schema": {"type": "object", "properties": {
        "tags": {"type": "array", "contains": {"type": "string"}}}}}
    async with gateway(config(up)) as (gw, client):
        for stream in (False, True):
            up.push(refusal)
            with pytest.raises(openai.BadRequestError) as e:
                await client.responses.create(model="m1", input="hi", text={"format": fmt}, stream=stream)
            assert e.value.body["param"] == "text.format", stream
            assert e.value.body["message"] == "text.format.schema.properties.tags: unsupported schema feature " \
                                              "'contains'", stream


async def test_a_backends_image_refusal_names_the_input_image_part(up):
    """The local engine takes text only: its refusal names the chat translation's ``image_url`` part of
    ``messages[k]`` (a trial read "input[0]: part type 'image_url' is not supported", naming neither the part nor
    the type it sent); it is named as the client's ``input_image`` part, whole and streamed."""
    refusal = {"status": 400, "param": "messages[1].content[1].type",
               "message": "messages[1].content[1]: part type 'image_url' is not supported (text only)"}
    ask = [{"role": "user", "content": [{"type": "input_text", "text": "what is it?"},
                                        {"type": "input_image", "image_url": "http://x/y.png"}]}]
    async with gateway(config(up)) as (gw, client):
        for stream in (False, True):
            up.push(refusal)
            with pytest.raises(openai.BadRequestError) as e:
                await client.responses.create(model="m1", input=ask, instructions="be brief", stream=stream)
            assert e.value.body["param"] == "input[0].content[1].type", stream
            assert e.value.body["message"] == "input[0].content[1]: content part type 'input_image' is not " \
                                              "supported (text only)", stream


async def test_rpm_refusal_is_openai_429_and_ledger_has_one_record(up):
    async with gateway(config(up, key_limits=", rpm: 1")) as (gw, client):
        r = await client.responses.create(model="m1", input="hi")
        with pytest.raises(openai.RateLimitError) as e:
            await client.responses.create(model="m1", input="again")
        records = await gw.usage.records("t1")
        samples = [s for m in gw.obs.registry.collect() for s in m.samples]
    assert e.value.status_code == 429 and e.value.body["code"] and e.value.response.headers.get("retry-after")
    served = [s.value for s in samples if s.name == "tandem_requests_total" and s.labels["route"] == "r1"
              and s.labels["status"] == "200"]
    refused = [s.value for s in samples if s.name == "tandem_rate_limit_rejections_total"]
    assert served == [1.0] and refused == [1.0]        # metered as chat is
    assert len(records) == 1 and up.calls == 1
    rec = next(iter(records.values()))
    assert (rec.prompt_tokens, rec.completion_tokens) == (r.usage.input_tokens, r.usage.output_tokens)


async def test_native_pass_through_to_an_upstream_that_declares_responses(up):
    up.push({"content": "A"})
    async with gateway(config(up, apis="responses")) as (gw, client):
        streamed = [e async for e in await client.responses.create(model="m1", input="one", stream=True)]
        r1 = streamed[-1].response                      # a stream is served on chat, translated
        r2 = await client.responses.create(model="m1", input="two", previous_response_id=r1.id, instructions="s")
        records = await gw.usage.records("t1")
    assert r1.output_text == "tok0 tok1 tok2 " and up.calls_by_path == {"/v1/chat/completions": 1,
                                                                        "/v1/responses": 1}
    assert r2.output_text == "native from up" and r2.id.startswith("resp_gw-")   # the gateway's id, stored
    assert r2.previous_response_id == r1.id and r2.model == "m1"
    path, _, sent = up.requests[-1]
    assert path == "/v1/responses" and "previous_response_id" not in sent and sent["model"] == "m1"
    assert not any("status" in i or "id" in i for i in sent["input"])   # the gateway's own, not the client's
    assert sent["instructions"] == "s" and [i["content"][0]["text"] for i in sent["input"]] == [
        "one", "tok0 tok1 tok2 ", "two"]
    assert (r2.usage.input_tokens, r2.usage.output_tokens) == (11, 7)
    billed = {r.request_id: r for r in records.values()}
    assert len(billed) == 2
    native = [r for r in billed.values() if (r.prompt_tokens, r.completion_tokens) == (11, 7)]
    assert len(native) == 1 and not native[0].estimated and native[0].cached_tokens == 2


async def test_models_list_the_responses_endpoint(up):
    async with gateway(config(up)) as (gw, client):
        async with httpx.AsyncClient(base_url=str(client.base_url)) as h:
            body = (await h.get("models", headers={"authorization": f"Bearer {KEY}"})).json()
    assert "/v1/responses" in body["data"][0]["endpoints"]


async def test_agents_sdk_runs_an_agent_with_one_function_tool(up):
    agents = pytest.importorskip("agents")
    up.push({"tool_call": True}, {"content": "Sunny in Paris."})
    seen = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        seen.append(city)
        return "sunny"

    async with gateway(config(up)) as (gw, client):
        agent = agents.Agent(name="weather", instructions="answer", tools=[get_weather],
                             model=agents.OpenAIResponsesModel(model="m1", openai_client=client))
        result = await agents.Runner.run(agent, "weather in Paris?",
                                         run_config=agents.RunConfig(tracing_disabled=True))
    assert seen == ["Paris"] and result.final_output == "Sunny in Paris."
    assert up.requests[-1][2]["messages"][-1] == {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}
