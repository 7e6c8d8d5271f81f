"""The offline ``LLM`` as a vLLM user calls it (a trial at 90392f4): ``embed`` answers vLLM's
``EmbeddingRequestOutput``s with the core's vectors bit for bit; ``encode`` is vLLM's pooling entry point for the
"embed" task. A tiny random Llama in float32 (byte-level tokenizer)."""

from __future__ import annotations

import pytest
import torch

from engine.llm import LLM
from engine.outputs import EmbeddingRequestOutput, PoolingRequestOutput
from engine.pooling import PoolingParams
from tests.tiny_models import save_byte_level_llama

PROMPTS = ["hello world", "a", "the quick brown fox"]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return LLM(save_byte_level_llama(tmp_path_factory.mktemp("tiny-llm")), dtype="float32", kv_cache_memory="16MiB")


def test_embed_answers_vllms_embedding_request_outputs(llm):
    ids = [llm.tokenizer.encode(p, add_special_tokens=True) for p in PROMPTS]
    want = llm.engine.core.embed(ids)                                    # the core's vectors, as embed returned
    outs = llm.embed(PROMPTS, use_tqdm=False)
    assert all(isinstance(o, EmbeddingRequestOutput) and o.finished for o in outs)
    assert [o.outputs.embedding for o in outs] == want                    # bit for bit
    assert [o.prompt_token_ids for o in outs] == ids and [o.outputs.hidden_size for o in outs] == [64] * 3
    assert len({o.request_id for o in outs}) == 3
    assert llm.embed({"prompt_token_ids": ids[0]})[0].outputs.embedding == want[0]   # vLLM's prompt dict
    with pytest.raises(ValueError, match="lora_request"):
        llm.embed(PROMPTS, lora_request=object())


def test_encode_pools_the_embed_task(llm):
    outs = llm.encode(PROMPTS, pooling_task="embed")
    assert all(isinstance(o, PoolingRequestOutput) for o in outs)
    assert all(o.outputs.data.dtype == torch.float32 and o.outputs.data.shape == (64,) for o in outs)
    assert [o.outputs.data.tolist() for o in outs] == [o.outputs.embedding for o in llm.embed(PROMPTS)]
    mean = llm.encode(PROMPTS[:1], PoolingParams("MEAN", False), pooling_task="embed")[0].outputs.data.tolist()
    assert mean == llm.embed(PROMPTS[:1], "MEAN", False)[0].outputs.embedding
    for task in (None, "classify"):
        with pytest.raises(ValueError, match="pooling_task"):
            llm.encode(PROMPTS, pooling_task=task)
