"""The local engine behind the gateway's newer endpoints (issue 28): ``/v1/embeddings`` pooled by the engine (the
vectors of ``LLM.embed`` on the same model, float and base64, through the openai SDK) and ``/v1/messages`` through
the chat translation (the anthropic SDK, whole and streamed), with a tiny random Llama in float32; each request
billed once from the engine's own usage."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

from engine.llm import LLM
from tests.gateway.http.test_messages import KEY, gateway, records
from tests.gateway.support import sha
from tests.tiny_models import save_byte_level_llama


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return save_byte_level_llama(tmp_path_factory.mktemp("tiny-local"), printable_only=True)


def config(model: str) -> str:
    return (f"reload: {{watch: false}}\nauth:\n  keys:\n    - {{tenant: t1, sha256: {sha(KEY)}}}\n"
            "resilience:\n  health: {interval_s: 0}\nobservability:\n  logs: {requests: false}\n"
            "models:\n  - name: m1\n"
            f"backends:\n  local:\n    type: local\n    prices: {{input: 1, output: 2}}\n"
            f"    engine: {{model: '{model}', served_model_name: tiny, dtype: float32, kv_cache_memory: 32MiB,\n"
            "             engine_core_process: false}\n"
            "routes:\n  r1:\n    targets: [{backend: local}]\npolicy:\n  default_route: r1\n")


async def until_ready(gw) -> None:
    import asyncio

    for _ in range(3000):
        if gw.snapshot.local is not None and not gw.snapshot.local.loading:
            assert gw.snapshot.local.available, gw.snapshot.local.unavailable_reason
            return
        await asyncio.sleep(0.02)
    raise AssertionError("engine not loaded")


async def test_local_embeddings_and_messages(tiny_model):
    outs = LLM(tiny_model, dtype="float32", kv_cache_memory="16MiB").embed(["hello", "two words"])
    want = [o.outputs.embedding for o in outs]
    async with gateway(config(tiny_model), start_engine=True) as (gw, claude, url):
        await until_ready(gw)
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        r = await client.embeddings.create(model="m1", input=["hello", "two words"], encoding_format="float")
        assert [d.embedding for d in r.data] == want and r.model == "m1"
        r64 = await client.embeddings.create(model="m1", input="hello")          # base64, decoded by the SDK
        assert r64.data[0].embedding == want[0]             # float32 values: base64 carries them exactly
        assert r.usage.prompt_tokens == len("hello") + len("two words")         # one token a byte
        with pytest.raises(openai.BadRequestError) as e:                         # the engine pools full size
            await client.embeddings.create(model="m1", input="x", dimensions=8)
        assert e.value.body["param"] == "dimensions"
        await client.close()
        msg = await claude.messages.create(model="m1", max_tokens=6, extra_body={"temperature": 0},
                                           messages=[{"role": "user", "content": "hi"}])
        assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 6 and msg.content[0].text
        async with claude.messages.stream(model="m1", max_tokens=6, extra_body={"temperature": 0},
                                          messages=[{"role": "user", "content": "hi"}]) as stream:
            text = "".join([t async for t in stream.text_stream])
            final = await stream.get_final_message()
        assert text == final.content[0].text == msg.content[0].text     # greedy: the same text, streamed or not
        assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 6
        with pytest.raises(anthropic.BadRequestError) as e:   # the local engine takes no images
            await claude.messages.create(model="m1", max_tokens=5, messages=[{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
        assert "messages.0.content.0: content block type 'image' is not supported" in e.value.body["error"]["message"]
        recs = await records(gw, 5)      # and the engine's own 400, passed on: a failed record on it
        assert all(not x.estimated for x in recs.values())
        assert sorted((x.completion_tokens, x.failed) for x in recs.values()) == [
            (0, False), (0, False), (0, True), (6, False), (6, False)]
        # an assistant last turn is a prefill Anthropic continues (a trial got a new turn): the chat request
        # with vLLM's continue_final_message, the same prompt and text
        turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": '{"a": "'}]
        msg = await claude.messages.create(model="m1", max_tokens=6, extra_body={"temperature": 0}, messages=turns)
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        chat = await client.chat.completions.create(model="m1", max_tokens=6, temperature=0, messages=turns,
                                                    extra_body={"continue_final_message": True,
                                                                "add_generation_prompt": False})
        new_turn = await client.chat.completions.create(model="m1", max_tokens=6, temperature=0, messages=turns)
        await client.close()
        assert msg.content[0].text == chat.choices[0].message.content
        assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == chat.usage.prompt_tokens
        assert chat.usage.prompt_tokens < new_turn.usage.prompt_tokens    # no end of turn, no generation prompt


async def test_a_messages_stream_starts_with_the_usage_it_ends_with(tiny_model):
    """A new user's stream of a cached prompt said ``input_tokens: 31, cache_read_input_tokens: 0`` in
    ``message_start`` (the gateway's count) and ``15`` / ``16`` in ``message_delta``: the engine is asked for usage
    on every chunk, and ``message_start`` takes the first's."""
    import httpx

    body = {"model": "m1", "max_tokens": 4, "messages": [
        {"role": "user", "content": "Hi there, a prompt long enough that a block of sixteen tokens is cached."}]}
    async with gateway(config(tiny_model), start_engine=True) as (gw, claude, url):
        await until_ready(gw)
        whole = await claude.messages.create(**body)              # the prompt's blocks are cached now
        assert whole.usage.cache_read_input_tokens == 0
        async with httpx.AsyncClient(timeout=60) as h:
            r = await h.post(url + "/v1/messages", headers={"x-api-key": KEY}, json={**body, "stream": True})
    usages = {}
    for block in r.text.strip().split("\n\n"):
        name, data = (line.split(": ", 1)[1] for line in block.split("\n"))
        if name in ("message_start", "message_delta"):
            obj = json.loads(data)
            usages[name] = (obj.get("message") or obj)["usage"]
    start, end = usages["message_start"], usages["message_delta"]
    assert end["cache_read_input_tokens"] > 0, end
    assert {k: start[k] for k in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")} == \
        {k: end[k] for k in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")}
    assert start["input_tokens"] + start["cache_read_input_tokens"] == \
        whole.usage.input_tokens + whole.usage.cache_read_input_tokens


async def test_count_tokens_refuses_what_the_engine_serving_it_refuses(tiny_model):
    """A new user's ``count_tokens`` of a base64 image on the local engine (text only) was a 200 of 1605 tokens, its
    ``create`` a 400: the count is refused as the create is. A model the policy sends elsewhere (an upstream, which
    may take images) is still counted."""
    from tests.gateway.fault_upstream import FaultUpstream

    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    messages = [{"role": "user", "content": [image, {"type": "text", "text": "what is it?"}]}]
    with FaultUpstream("up") as up:
        cfg = config(tiny_model).replace("models:\n  - name: m1\n", "models:\n  - name: m1\n  - name: m2\n")
        cfg = cfg.replace("routes:\n", f"  up:\n    type: openai\n    base_url: {up.base_url}\n"
                                       "    models: {m2: up-model}\nroutes:\n  r2:\n    targets: [{backend: up}]\n")
        cfg = cfg.replace("default_route: r1\n", "default_route: r1\n  rules: [{name: m2, match: {model: m2}, "
                                                 "route: r2}]\n")
        async with gateway(cfg, start_engine=True) as (gw, claude, url):
            await until_ready(gw)
            with pytest.raises(anthropic.BadRequestError) as created:
                await claude.messages.create(model="m1", max_tokens=5, messages=messages)
            with pytest.raises(anthropic.BadRequestError) as counted:
                await claude.messages.count_tokens(model="m1", messages=messages)
            other = await claude.messages.count_tokens(model="m2", messages=messages)
            text = await claude.messages.count_tokens(model="m1", messages=[{"role": "user", "content": "hi"}])
    assert counted.value.body == created.value.body == {"type": "error", "error": {
        "type": "invalid_request_error",
        "message": "messages.0.content.0: content block type 'image' is not supported (text only)"}}
    assert other.input_tokens > 1600 and text.input_tokens > 0     # counted: the image by the gateway's estimate
    assert up.calls == 0
