"""What a vLLM user's setup expects of a served model (a trial's findings): a model's ``generation_config.json``
fills what a request leaves unset, as under ``vllm serve`` (its ``--generation-config auto`` default:
``engine/generation_config.py``); ``--chat-template`` replaces the model's template; an unnamed model answers to
its path; the offline ``LLM`` takes vLLM's keyword arguments that change nothing here. The trial found a checkpoint
recommending near-greedy sampling and 7 new tokens sampled at temperature 1 for 16 tokens (481 on chat), a model
without a template that could not be chatted with, and 404 for the model's path."""

from __future__ import annotations

import asyncio
import json
import shutil
from contextlib import asynccontextmanager

import openai
import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineArgs
from engine.generation_config import default_sampling_params
from tests.tiny_models import save_byte_level_llama

GENERATION = {"temperature": 0.01, "top_k": 3, "top_p": 0.5, "repetition_penalty": 1.3, "max_new_tokens": 7,
              "do_sample": True, "bos_token_id": 0, "eos_token_id": 1}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny model directory with a generation config, and its copy without one."""
    plain = save_byte_level_llama(tmp_path_factory.mktemp("tiny-plain"), printable_only=True)
    recommending = tmp_path_factory.mktemp("tiny-gen") / "m"
    shutil.copytree(plain, recommending)
    (recommending / "generation_config.json").write_text(json.dumps(GENERATION))
    return plain, str(recommending)


def test_the_diff_of_a_generation_config_is_read_as_vllm_reads_it(tiny, tmp_path):
    plain, recommending = tiny
    assert default_sampling_params(recommending) == {"temperature": 0.01, "top_k": 3, "top_p": 0.5,
                                                     "repetition_penalty": 1.3, "max_tokens": 7}
    assert default_sampling_params(recommending, "vllm") == {}
    assert default_sampling_params(plain) == {}
    assert default_sampling_params(plain, recommending) == default_sampling_params(recommending)
    assert default_sampling_params(recommending, override={"temperature": 0.5})["temperature"] == 0.5
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 1.0, "top_k": 50, "top_p": 0.9}))
    assert default_sampling_params(str(tmp_path), str(tmp_path)) == {"top_p": 0.9}   # transformers' defaults: none
    with pytest.raises(FileNotFoundError):
        EngineArgs(model=plain, generation_config=str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="override_generation_config"):
        EngineArgs(model=plain, override_generation_config='{"beam_width": 3}')
    # a default every request would be refused for (blaming its client: a trial) is refused at start, by the
    # ranges a request's own value must be in
    for bad, said in (({"temperature": -1}, "'temperature': decimal below minimum"),
                      ({"temperature": 5}, "'temperature': decimal above"),
                      ({"top_p": -0.5}, "'top_p'"), ({"top_k": -7}, "'top_k'"),
                      ({"max_new_tokens": 0}, "'max_new_tokens': integer below minimum")):
        with pytest.raises(ValueError, match=f"override_generation_config: Invalid {said}"):
            EngineArgs(model=plain, override_generation_config=json.dumps(bad))
    (tmp_path / "generation_config.json").write_text(json.dumps({"repetition_penalty": 0}))
    with pytest.raises(ValueError, match="generation config: Invalid 'repetition_penalty'"):
        EngineArgs(model=plain, generation_config=str(tmp_path))
    with pytest.raises(ValueError, match="looks like a file path"):
        EngineArgs(model=plain, chat_template="/no/such/template.jinja")
    with pytest.raises(ValueError, match="not a valid template"):   # before the weights load (a trial: after)
        EngineArgs(model=plain, chat_template="{{bad")


@asynccontextmanager
async def served(model: str, **args):
    import uvicorn

    from engine.entrypoints.server import KEEP_ALIVE_S, build_app
    from tests.conftest import free_port

    engine = AsyncEngine(EngineArgs(model=model, dtype="float32", kv_cache_memory="16MiB", engine_core_process=False,
                                    **{"served_model_name": "tiny", **args}))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(engine), host="127.0.0.1", port=port, log_level="warning",
                                           timeout_keep_alive=KEEP_ALIVE_S))
    task = asyncio.create_task(server.serve())
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
    try:
        while not (server.started and engine.ready):
            assert not task.done()
            await asyncio.sleep(0.02)
        yield client
    finally:
        await client.close()
        server.should_exit = True
        await task
        await engine.shutdown(drain=False)


async def test_a_models_generation_config_fills_what_a_request_leaves_unset(tiny):
    plain, recommending = tiny
    async with served(recommending) as client:
        outs = [await client.completions.create(model="tiny", prompt="Hello there", seed=s) for s in range(3)]
        assert {o.usage.completion_tokens for o in outs} == {7}   # max_new_tokens, under the default 16
        chat = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
        assert chat.usage.completion_tokens <= 7
        capped = await client.completions.create(model="tiny", prompt="Hello there", max_tokens=12, temperature=0,
                                                 extra_body={"ignore_eos": True})  # vLLM: the smaller of both
        assert capped.usage.completion_tokens == 7
        defaulted = [o.choices[0].text for o in outs]
        overruled = [(await client.completions.create(
            model="tiny", prompt="Hello there", seed=s, temperature=1.0, top_p=1.0,
            extra_body={"top_k": 0, "repetition_penalty": 1.0})).choices[0].text for s in range(3)]
    async with served(recommending, generation_config="vllm") as client:
        ignored = [(await client.completions.create(model="tiny", prompt="Hello there", seed=s, max_tokens=7)
                    ).choices[0].text for s in range(3)]
        assert (await client.completions.create(model="tiny", prompt="Hello there")).usage.completion_tokens == 16
    assert ignored == overruled        # a request's own values win; "vllm" reads none
    assert defaulted != overruled      # near-greedy (temperature 0.01, top_k 3) is not temperature 1
    assert len(set(defaulted)) == 1    # whatever the seed


async def tokenized(client: openai.AsyncOpenAI, text: str) -> str:
    """The chat prompt ``/tokenize`` renders for one user message ``text`` (one character a token)."""
    import httpx

    async with httpx.AsyncClient() as http:
        r = await http.post(str(client.base_url).removesuffix("/v1/") + "/tokenize", json={
            "model": "tiny", "messages": [{"role": "user", "content": text}], "return_token_strs": True})
    return "".join(r.json()["token_strs"]).replace("Ġ", " ")   # byte-level: a space is Ġ


async def test_chat_template_flag_replaces_the_models(tiny, tmp_path):
    plain, _ = tiny
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %}> ")
    async with served(plain, chat_template=str(template)) as client:
        assert await tokenized(client, "hi") == "[user] hi> "
    async with served(plain, chat_template="{{ messages[0]['content'] }}!") as client:   # inline
        assert await tokenized(client, "yo") == "yo!"


def test_the_offline_llm_samples_with_them_too(tiny):
    """vLLM's ``LLM.get_default_sampling_params``, what ``generate`` uses when given none."""
    from engine.llm import LLM

    _, recommending = tiny
    llm = LLM(recommending, dtype="float32", kv_cache_memory="16MiB")
    try:
        params = llm.get_default_sampling_params()
        assert (params.temperature, params.top_k, params.max_tokens) == (0.01, 3, 7)
        out = llm.generate(["Hello there"])[0].outputs[0]   # printable-only greedy: no EOS near-greedily either
        assert len(out.token_ids) == 7 and out.finish_reason == "length"   # 16 without the defaults
    finally:
        llm.shutdown()


async def test_an_unnamed_model_is_served_under_its_path_as_vllm_and_its_directory_name(tiny):
    """vLLM's default served name is the ``--model`` string: a vLLM client sending it got 404 "Available: tiny"."""
    plain, _ = tiny
    async with served(plain, served_model_name=None) as client:
        assert [m.id for m in (await client.models.list()).data] == [plain, plain.rstrip("/").rsplit("/", 1)[1]]
        for name in (plain, plain.rstrip("/").rsplit("/", 1)[1]):
            r = await client.completions.create(model=name, prompt="Hi", max_tokens=2)
            assert r.model == name


def test_the_offline_llm_takes_vllms_arguments_that_change_nothing_here(tiny):
    """``LLM(model, trust_remote_code=True, enforce_eager=True, tokenizer=model)`` (a TypeError before); one it
    cannot honour is a ValueError naming it; a misspelt one stays a TypeError."""
    from engine.llm import LLM

    plain, _ = tiny
    llm = LLM(plain, dtype="float32", kv_cache_memory="16MiB", trust_remote_code=True, enforce_eager=True,
              tokenizer=plain, disable_log_stats=True)
    llm.shutdown()
    with pytest.raises(ValueError, match="reasoning is not split out"):
        LLM(plain, reasoning_parser="deepseek_r1")
    with pytest.raises(TypeError):
        LLM(plain, enforce_eagre=True)
