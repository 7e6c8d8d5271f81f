"""A deep pooling chunk carried through part of the layers per step (``engine/core/step_cost.py``, issue 49: past
~4,300 tokens of an input one token through SmolLM2's 30 layers cost 2-30x a decode step beside a stream): its
hidden state kept by the model runner between steps, its keys and values written layer by layer. The vector is
bit for bit the one computed in one pass, and a stream decoding beside it gets the tokens and logprobs it gets alone;
per-operation path (float32) and C decoder stack (bfloat16)."""

from __future__ import annotations

import random

import pytest

from engine.core.step_cost import PoolingBudget
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.engine.test_pooling import vectors as embeddings
from tests.tiny_models import save_byte_level_llama

LAYERS = 4
STREAM = SamplingParams(temperature=0.0, max_tokens=400, logprobs=2, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return save_byte_level_llama(tmp_path_factory.mktemp("tiny-layer-split"), num_hidden_layers=LAYERS)


def _prompts() -> list[list[int]]:
    rng = random.Random(49)
    return [[rng.randrange(3, 250) for _ in range(length)] for length in (300, 17, 64)]


def _llm(model: str, dtype: str, budget: int) -> LLM:
    return LLM(model, dtype=dtype, kv_cache_memory="16MiB", block_size=16, max_num_batched_tokens=budget)


def _split_llm(model: str, dtype: str) -> tuple[LLM, list]:
    """An engine whose pooling chunks are split over the layers from the first token: beside a stream a step's
    allowance (0.9 token-equivalents) is under one token's cost, alone (2.5) under a token's past 86 tokens of
    context; and the layers each pooling chunk ran through, step by step."""
    llm = _llm(model, dtype, 32)
    core = llm.engine.core
    b = core.scheduler.pooling_budget
    core.scheduler.pooling_budget = PoolingBudget(b.pairs_per_token, 0.9, 2.5, LAYERS)
    runner, seen = core.model_runner, []
    execute = runner.execute_model

    def recorded(out):
        seen.extend((s.num_computed_tokens, s.num_new_tokens, s.layers) for s in out.scheduled
                    if s.request.pooling_params is not None)
        return execute(out)

    runner.execute_model = recorded
    return llm, seen


def _stream(core, rid: str) -> None:
    core.add_request(rid, [5, 6, 7], STREAM)


def _step(core, outputs: list) -> None:
    outputs += [(o.new_token_ids, o.new_logprobs) for o in core.step() if o.request_id == "stream"]


def _run(core, outputs: list) -> None:
    while core.has_unfinished_requests():
        _step(core, outputs)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_split_embedding_beside_a_stream_has_the_bits_of_one_pass(tiny_model, dtype):
    whole = _llm(tiny_model, dtype, 1024)
    prompts = _prompts()
    want = embeddings(whole.embed(prompts, pooling_type="MEAN"))
    alone: list = []
    _stream(whole.engine.core, "stream")
    _run(whole.engine.core, alone)
    split, seen = _split_llm(tiny_model, dtype)
    core = split.engine.core
    assert embeddings(split.embed(prompts, pooling_type="MEAN")) == want   # alone: split past 86 tokens
    beside: list = []
    _stream(core, "stream")
    _step(core, beside)
    core.add_embed(1, prompts, "MEAN", True)
    _run(core, beside)
    ((call, vectors, error),) = core.take_embeds()
    assert (call, error) == (1, None) and vectors == want
    assert beside == alone                                                     # tokens and logprobs, exactly
    split_passes = [(n, layers) for _, n, layers in seen if layers is not None]
    assert any(first > 0 for _, (first, _) in split_passes)                    # carried over from a step before
    assert any(end - first > 1 for _, (first, end) in split_passes)            # several layers in one step
    assert any(n > 1 for n, _ in split_passes)                                 # several tokens through a layer
    assert not core.model_runner.layer_hidden                                  # nothing kept past the last layer
    assert core.get_stats().prompt_tokens_total == 2 * sum(map(len, prompts)) + 3   # each token counted once
    assert (core.model_runner.model._c_decoder is not None) == (dtype == "bfloat16")


def test_an_aborted_split_chunk_leaves_nothing_in_the_runner(tiny_model):
    split, seen = _split_llm(tiny_model, "float32")
    core = split.engine.core
    _stream(core, "stream")
    core.step()
    core.add_embed(2, [_prompts()[0]], "LAST", True)
    while not core.model_runner.layer_hidden:
        core.step()
    assert seen[-1][2][1] < LAYERS
    core.abort_requests(list(core.model_runner.layer_hidden))
    core.step()
    assert not core.model_runner.layer_hidden
    ((call, vectors, error),) = core.take_embeds()
    assert call == 2 and vectors is None and "aborted" in error
    core.abort_all()
