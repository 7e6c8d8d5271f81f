"""Embeddings by pooling a decoder's final hidden states (``engine/pooling.py``), checked against transformers'
hidden states of the same tiny random Llama in float32: the same vector within 1e-5, for last-token and mean
pooling, with and without normalization; the model's own pooling config; batch invariance; and the async engine
(core process) giving the offline API's vectors."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from engine.async_engine import AsyncEngine
from engine.config import EngineArgs
from engine.llm import LLM
from engine.pooling import PoolingParams, model_pooling_params
from tests.tiny_models import save_byte_level_llama


def vectors(outputs) -> list[list[float]]:
    """The embeddings of ``LLM.embed``'s ``EmbeddingRequestOutput``s, in order."""
    return [o.outputs.embedding for o in outputs]


PROMPTS = ["hello world", "a", "the quick brown fox jumps over the lazy dog, twice: the quick brown fox"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return save_byte_level_llama(tmp_path_factory.mktemp("tiny-embed"))


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(tiny_model, dtype="float32", kv_cache_memory="16MiB", block_size=16)


@pytest.fixture(scope="module")
def reference(tiny_model, llm):
    """transformers' final hidden states (post-norm) of each prompt, float32: [num_tokens, hidden]."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in PROMPTS:
            ids = torch.tensor([llm.tokenizer.encode(p, add_special_tokens=True)])
            out.append(model(ids, output_hidden_states=True).hidden_states[-1][0])
    return out


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN"])
@pytest.mark.parametrize("normalize", [True, False])
def test_embeddings_match_transformers_hidden_states(llm, reference, pooling_type, normalize):
    got = torch.tensor(vectors(llm.embed(PROMPTS, pooling_type=pooling_type, normalize=normalize)))
    for i, h in enumerate(reference):
        want = h[-1] if pooling_type == "LAST" else h.mean(0)
        if normalize:
            want = torch.nn.functional.normalize(want, dim=0)
        assert got[i].shape == (64,)
        torch.testing.assert_close(got[i], want, atol=1e-5, rtol=0)
    if normalize:
        torch.testing.assert_close(got.norm(dim=1), torch.ones(len(PROMPTS)), atol=1e-5, rtol=0)


def test_embeddings_are_batch_invariant_and_leave_generation_alone(llm):
    from engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    before = llm.generate(["hello"], params)[0].outputs[0].token_ids
    alone = llm.embed([PROMPTS[2]])[0].outputs.embedding
    batched = llm.embed([PROMPTS[0], PROMPTS[2], PROMPTS[1]])[1].outputs.embedding
    assert alone == batched                         # bit for bit, whatever it is pooled with
    assert llm.embed(llm.tokenizer.encode(PROMPTS[2], add_special_tokens=True))[0].outputs.embedding == alone  # ids
    assert llm.generate(["hello"], params)[0].outputs[0].token_ids == before
    with pytest.raises(ValueError, match="empty"):
        llm.embed([[]])


def test_model_pooling_config(tmp_path):
    assert model_pooling_params(None) == PoolingParams("LAST", True)
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    assert model_pooling_params(str(tmp_path)) == PoolingParams("MEAN", False)   # no Normalize module
    modules = json.loads((tmp_path / "modules.json").read_text())
    modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    assert model_pooling_params(str(tmp_path)) == PoolingParams("MEAN", True)


async def test_async_engine_embeds_in_its_core_process(tiny_model, llm):
    eng = AsyncEngine(EngineArgs(model=tiny_model, dtype="float32", kv_cache_memory="16MiB",
                                 engine_core_process=True))
    await eng.start()
    try:
        ids = [llm.tokenizer.encode(p, add_special_tokens=True) for p in PROMPTS]
        assert await eng.embed(ids) == vectors(llm.embed(PROMPTS))
        with pytest.raises(ValueError, match="max_model_len"):
            await eng.embed([[5] * (eng.max_model_len + 1)])
    finally:
        await eng.shutdown(drain=False)


async def test_engine_server_serves_embeddings(tiny_model, llm):
    """``tandem engine serve``'s ``POST /v1/embeddings`` (build_app under uvicorn) with the openai SDK."""
    import openai
    import uvicorn

    from engine.entrypoints.server import KEEP_ALIVE_S, build_app
    from tests.conftest import free_port

    engine = AsyncEngine(EngineArgs(model=tiny_model, dtype="float32", kv_cache_memory="16MiB",
                                    engine_core_process=False, served_model_name="tiny"))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(engine), host="127.0.0.1", port=port, log_level="warning",
                                           timeout_keep_alive=KEEP_ALIVE_S))
    task = asyncio.create_task(server.serve())
    try:
        while not (server.started and engine.ready):
            assert not task.done()
            await asyncio.sleep(0.02)
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        r = await client.embeddings.create(model="tiny", input=PROMPTS[:2])          # base64 on the wire
        assert [d.embedding for d in r.data] == vectors(llm.embed(PROMPTS[:2]))   # float32 values: base64 is exact
        assert r.usage.prompt_tokens == len(PROMPTS[0]) + len(PROMPTS[1])
        with pytest.raises(openai.NotFoundError):
            await client.embeddings.create(model="other", input="x")
        with pytest.raises(openai.BadRequestError):
            await client.embeddings.create(model="tiny", input=[])
        vocab = engine.tokenizer.vocab_size
        for ids, where in (([1, 99999999999999999999], "input"), ([[1], [2, vocab]], "input[1]")):
            with pytest.raises(openai.BadRequestError) as e:   # past int64, past the vocabulary
                await client.embeddings.create(model="tiny", input=ids)
            assert e.value.body["param"] == where, e.value.body        # the item, as the message names it
            assert e.value.body["message"].startswith(f"{where}: {ids[-1] if where == 'input' else vocab} is not "
                                                      f"a token id of this model"), e.value.body
        await client.close()
    finally:
        server.should_exit = True
        await task
