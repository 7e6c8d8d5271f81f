"""Pooling requests are scheduled as prompts (``engine/pooling.py``, ``Request.pooling_params``): a long input is
prefilled in chunks under the step's token budget, in steps shared with decoding rows, so that a running stream
gets tokens between its chunks (issue 49: one 4,000-token embedding froze every stream for 8 s), and its vector
is bit for bit the unchunked one (the engine's kernels are chunk- and batch-invariant)."""

from __future__ import annotations

import random

import pytest

from engine.core.core_loop import run_core_loop
from engine.core.core_messages import (AddRequest, CoreReply, CoreStep, EmbedPrompts, Shutdown, embed_request_ids,
                                       params_to_wire)
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.engine.test_pooling import vectors
from tests.tiny_models import save_byte_level_llama

BUDGET = 32
LONG = 300   # tokens of the long input: ceil(300 / 32) = 10 chunks at least


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return save_byte_level_llama(tmp_path_factory.mktemp("tiny-embed-chunked"))


def _llm(tiny_model, budget: int) -> LLM:
    return LLM(tiny_model, dtype="float32", kv_cache_memory="16MiB", block_size=16, max_num_batched_tokens=budget)


@pytest.fixture(scope="module")
def chunked(tiny_model):
    return _llm(tiny_model, BUDGET)


@pytest.fixture(scope="module")
def whole(tiny_model):
    return _llm(tiny_model, 1024)


def _prompts(n: int = 3) -> list[list[int]]:
    rng = random.Random(49)
    return [[rng.randrange(3, 250) for _ in range(length)] for length in (LONG, 17, 64)][:n]


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN", "CLS"])
def test_chunked_embedding_is_bitwise_the_unchunked_one(chunked, whole, pooling_type):
    prompts = _prompts()
    want = vectors(whole.embed(prompts, pooling_type=pooling_type))
    assert vectors(chunked.embed(prompts, pooling_type=pooling_type)) == want   # chunked under a 32-token budget
    assert vectors(chunked.embed([prompts[0]], pooling_type=pooling_type)) == want[:1]   # alone
    assert vectors(whole.embed(prompts[::-1], pooling_type=pooling_type)) == want[::-1]   # batched otherwise


def test_a_stream_gets_tokens_between_the_chunks_of_a_long_embedding(chunked):
    """The core loop with a running stream, then a long embedding: each step until the embedding's reply carries a
    token of the stream, and the embedding spans as many steps as its chunks (on the old engine the reply came
    before any step: the embedding ran whole, between two steps, while the stream waited)."""
    core = chunked.engine.core
    stream = AddRequest("stream", [5, 6, 7], params_to_wire(SamplingParams(temperature=0, max_tokens=200,
                                                                           ignore_eos=True)), 0, 0.0)
    script = [[stream], [], [EmbedPrompts(7, [_prompts(1)[0]], "MEAN", True)]]
    log: list = []

    def take(block: bool) -> list:
        if script:
            return script.pop(0)
        return [Shutdown()] if any(isinstance(m, CoreReply) for m in log) else []

    run_core_loop(core, take, log.append)
    reply = next(i for i, m in enumerate(log) if isinstance(m, CoreReply))
    assert log[reply].error is None and len(log[reply].value) == 1
    between = log[2:reply]      # the steps from the one that took the embedding (the third) to its reply
    assert all(isinstance(m, CoreStep) for m in between)
    assert len(between) >= -(-LONG // (BUDGET - 1))       # one chunk a step, beside the stream's decode row
    assert all(any(o.request_id == "stream" and o.new_token_ids for o in m.outputs) for m in between)
    assert log[reply].value == vectors(chunked.embed([_prompts(1)[0]], pooling_type="MEAN"))   # and the same vector


def test_a_queued_embedding_counts_in_the_ttft_state(chunked):
    """Issue 49: ``/v1/ttft`` did not see embeddings (predicted 0.02 s, real 6.1 s): they ran outside the
    scheduler. Now an embedding is queued prefill like any prompt, in the state predictions are made from."""
    core = chunked.engine.core
    before = core.get_stats().ttft.queued()
    core.add_embed(11, [_prompts(1)[0]], "LAST", True)
    assert core.get_stats().ttft.queued() == (before[0] + LONG, before[1] + 1)
    core.step()
    running = core.get_stats().ttft
    assert running.running_prefill == LONG - BUDGET and running.running_prefill_reqs == 1
    while core.has_unfinished_requests():
        core.step()
    assert [cid for cid, vectors, error in core.take_embeds() if vectors and error is None] == [11]


def test_a_short_embedding_call_is_seated_before_a_long_calls_later_inputs(chunked):
    """A call of eight 300-token inputs, then a call of one 17-token input a step later: the short call's input is
    seated before every input of the long call still waiting (the calls' inputs take turns:
    ``Scheduler.seat_order``; in arrival order it waited for all of them) and is answered first; both calls' vectors
    are the ones each gets alone."""
    core = chunked.engine.core
    rng = random.Random(50)
    long_inputs, short = [[rng.randrange(3, 250) for _ in range(LONG)] for _ in range(8)], _prompts(2)[1]
    core.add_embed(21, long_inputs, "LAST", True)
    core.step()
    core.add_embed(22, [short], "LAST", True)
    short_id = embed_request_ids(22, 1)[0]
    order = ["short" if r.request_id == short_id else r.input_index for r in core.scheduler.seat_order()]
    assert order[0] == "short" and len(order) > 1, order   # some of the long call's inputs wait behind it
    answered: dict[int, list] = {}
    while core.has_unfinished_requests():
        core.step()
        answered.update((cid, vecs) for cid, vecs, error in core.take_embeds() if error is None)
    assert list(answered) == [22, 21]
    assert answered[22] == vectors(chunked.embed([short], pooling_type="LAST"))
    assert answered[21] == vectors(chunked.embed(long_inputs, pooling_type="LAST"))
