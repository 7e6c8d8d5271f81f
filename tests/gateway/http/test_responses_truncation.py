"""The Responses API's ``truncation: "auto"`` against a real engine: a tiny random Llama in the gateway's process
(byte-level tokenizer: one character, one token) with a 1024-token context, the official ``openai`` SDK as the
client. A conversation longer than the context is a 400 ``context_length_exceeded`` with ``truncation``
``disabled`` (the default), and is answered with ``auto``, its oldest items dropped (which ones:
``tests/gateway/translate/test_responses_truncation.py``); an upstream whose context the gateway does not know
gets the conversation whole (``test_responses.py``'s fault upstream)."""

from __future__ import annotations

import openai
import pytest

from tests.gateway.backends.test_local_endpoints import until_ready
from tests.gateway.http.test_messages import gateway
from tests.gateway.http.test_responses import config as upstream_config
from tests.gateway.http.test_responses import gateway as upstream_gateway
from tests.tiny_models import save_byte_level_llama

CONTEXT = 1024


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return save_byte_level_llama(tmp_path_factory.mktemp("tiny-truncation"), printable_only=True)


def config(model: str) -> str:
    return ("reload: {watch: false}\nresilience:\n  health: {interval_s: 0}\nobservability:\n  logs: {requests: false}\n"
            "models:\n  - name: m1\n"
            "backends:\n  local:\n    type: local\n"
            f"    engine: {{model: '{model}', served_model_name: tiny, dtype: float32, kv_cache_memory: 16MiB,\n"
            f"             block_size: 16, max_model_len: {CONTEXT}, engine_core_process: false}}\n"
            "routes:\n  r1:\n    targets: [{backend: local}]\npolicy:\n  default_route: r1\n")


TURNS = [{"role": "user", "content": "a" * 150}, {"role": "assistant", "content": "b" * 150},
         {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
         {"type": "function_call_output", "call_id": "c1", "output": "sunny " * 15}]
WEATHER = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}


async def test_auto_drops_the_oldest_items_where_disabled_is_refused(tiny_model):
    async with gateway(config(tiny_model), start_engine=True) as (gw, _, url):
        await until_ready(gw)
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        ask = dict(model="m1", max_output_tokens=16, temperature=0, tools=[WEATHER], instructions="be brief")
        first = await client.responses.create(input=TURNS, truncation="auto", **ask)    # fits: nothing dropped
        again = [{"role": "user", "content": "c" * 200}, {"role": "user", "content": "and now?"}]
        with pytest.raises(openai.BadRequestError) as e:
            await client.responses.create(input=again, previous_response_id=first.id, **ask)
        r = await client.responses.create(input=again, previous_response_id=first.id, truncation="auto", **ask)
        events = [ev async for ev in await client.responses.create(
            input=again, previous_response_id=first.id, truncation="auto", stream=True, **ask)]
        await client.close()
    assert first.status in ("completed", "incomplete") and first.truncation == "auto"
    assert first.usage.input_tokens + 8 <= CONTEXT
    assert (e.value.body["code"], e.value.body["param"]) == ("context_length_exceeded", "input")
    assert r.status in ("completed", "incomplete") and r.truncation == "auto"
    assert r.usage.input_tokens + 8 <= CONTEXT < first.usage.input_tokens + 200 + 8
    streamed = events[-1].response
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert streamed.usage.input_tokens == r.usage.input_tokens


async def test_auto_leaves_a_conversation_whose_context_is_unknown_whole():
    from tests.gateway.fault_upstream import FaultUpstream

    with FaultUpstream("up") as up:
        async with upstream_gateway(upstream_config(up)) as (gw, client):
            await client.responses.create(model="m1", input=TURNS + [{"role": "user", "content": "x"}],
                                          tools=[WEATHER], truncation="auto")
        sent = up.requests[-1][2]["messages"]
    assert len(sent) == 4 and sent[0]["content"] == "a" * 150    # the tool call joined the assistant's message


async def test_a_chained_conversation_is_bounded_like_a_body_sent_whole():
    """Past ``server.max_body_size`` (4 KiB here) of JSON, a chained conversation is a 400 with ``disabled``,
    nothing sent upstream, and with ``auto`` continues with its oldest items dropped; what is stored for the
    next turn is the bounded conversation, so a long chain costs each turn the same."""
    from tests.gateway.fault_upstream import FaultUpstream

    turn = [{"role": "user", "content": "a" * 600}, {"role": "assistant", "content": "b" * 600}]
    with FaultUpstream("up") as up:
        text = upstream_config(up).replace("reload:", "server: {max_body_size: 4KiB}\nreload:", 1)
        async with upstream_gateway(text) as (gw, client):
            first = await client.responses.create(model="m1", input=turn + [{"role": "user", "content": "1"}])
            second = await client.responses.create(model="m1", input=turn + [{"role": "user", "content": "2"}],
                                                   previous_response_id=first.id, truncation="auto")
            sent = [len(up.requests[-1][2]["messages"])]
            with pytest.raises(openai.BadRequestError) as e:
                await client.responses.create(model="m1", input=turn + [{"role": "user", "content": "3"}],
                                              previous_response_id=second.id)
            refused_upstream = len(up.requests)
            for n in range(3, 6):
                second = await client.responses.create(
                    model="m1", input=turn + [{"role": "user", "content": str(n)}],
                    previous_response_id=second.id, truncation="auto")
                sent.append(len(up.requests[-1][2]["messages"]))
            assert len(up.requests) == refused_upstream + 3
    assert (e.value.status_code, e.value.body["code"], e.value.body["param"]) == (400, "context_length_exceeded",
                                                                                     "input")
    assert "server.max_body_size" in e.value.body["message"]
    # 3 items and an answer per turn: the whole chain would be 8, 12, .. 24 messages; bounded, it stays put
    assert sent[0] < 8 and len(set(sent[1:])) == 1 and sent[-1] < 12, sent
