"""Pooling chunks sized by their cost beside generation work (``engine/core/step_cost.py``, issue 49): a long
embedding's late chunks attend over thousands of computed tokens, so a fixed token budget let one step beside a
running stream cost ~150x a decode step. The cost model, then the scheduler's use of it (no model: the scheduler's
choices alone; the vectors' bits are ``tests/engine/test_pooling_chunked.py``'s)."""

from __future__ import annotations

import pytest

from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler
from engine.core.step_cost import PoolingBudget, attention_pairs, pairs_per_token, pooling_budget
from engine.model_config import ModelConfig
from engine.pooling import PoolingParams
from engine.sampling_params import SamplingParams

SMOLLM2_135M = ModelConfig(architecture="LlamaForCausalLM", hidden_size=576, intermediate_size=1536,
                           num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                           vocab_size=49152, max_position_embeddings=8192)
BUDGET = PoolingBudget(pairs_per_token=600.0, step_cost=8.0)


def test_attention_pairs_count_each_rows_causal_keys():
    for tokens, context in ((1, 0), (1, 7999), (5, 0), (7, 100)):
        assert attention_pairs(tokens, context) == sum(context + j + 1 for j in range(tokens))


def test_a_pair_costs_its_share_of_the_multiply_adds():
    # per layer: q, k, v, o = 576 x 64 x (9 + 3 + 3 + 9); the gated MLP 3 x 576 x 1536; a pair 2 x 9 x 64
    assert pairs_per_token(SMOLLM2_135M, 1.0) == (576 * 64 * 24 + 3 * 576 * 1536) / (2 * 9 * 64) == 3072
    assert pairs_per_token(SMOLLM2_135M, 5.0) == pytest.approx(614.4)
    budget = pooling_budget(SMOLLM2_135M, "cpu", 512)
    assert budget.pairs_per_token == pytest.approx(614.4)
    assert budget.alone_cost == pytest.approx(512 + 512 * 513 / 2 / 614.4)   # a fresh prompt's 512-token chunk


@pytest.mark.parametrize("cost", [0.0, 0.5, 1.0, 1.0001, 3.7, 8.0, 13.0, 64.0, 512.0])
def test_max_tokens_is_the_most_rows_within_the_cost(cost):
    for context in (0, 1, 17, 599, 600, 2048, 4321, 8000):
        q = BUDGET.max_tokens(context, cost)
        assert q == 0 or BUDGET.chunk_cost(q, context) <= cost
        assert BUDGET.chunk_cost(q + 1, context) > cost, (context, cost, q)


def _pooling(rid: str, tokens: int, arrival: float) -> Request:
    base = 100 + 10_000 * sum(map(ord, rid))   # a prompt of its own: no prefix shared with another request
    return Request(rid, list(range(base, base + tokens)), SamplingParams(max_tokens=1), max_tokens=0,
                   arrival_time=arrival, pooling_params=PoolingParams())


def _generation(rid: str, prompt: int, max_tokens: int, arrival: float) -> Request:
    base = 10 + 10_000 * sum(map(ord, rid))
    return Request(rid, list(range(base, base + prompt)), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   max_tokens=max_tokens, arrival_time=arrival)


def _scheduler(**kw) -> Scheduler:
    args = dict(block_size=16, num_blocks=1200, max_num_seqs=8, max_num_batched_tokens=512, max_model_len=8192,
                pooling_budget=BUDGET)
    return Scheduler(**(args | kw))


def _step(s: Scheduler):
    out = s.schedule()
    s.update_from_output(out, {sr.request.request_id: 7 for sr in out.scheduled if sr.sample})
    s.check_invariants()
    return out


def _chunks(out, rid: str) -> list[tuple[int, int]]:
    return [(sr.num_computed_tokens, sr.num_new_tokens) for sr in out.scheduled if sr.request.request_id == rid]


def test_beside_a_decoding_stream_an_embeddings_chunks_cost_at_most_the_allowance():
    """Every step decodes the stream, and the embedding's chunk costs at most ``step_cost`` or is one token (past
    ~4,200 tokens of context one row costs more than 8: the input still progresses, a token a step)."""
    s = _scheduler()
    s.add_request(_generation("stream", 4, 6000, 0.0))
    _step(s)
    emb = _pooling("emb", 5000, 1.0)
    s.add_request(emb)
    sizes = []
    while not emb.is_finished:
        out = _step(s)
        assert _chunks(out, "stream") and _chunks(out, "stream")[0][1] == 1
        ((start, n),) = _chunks(out, "emb")
        assert n == 1 or BUDGET.chunk_cost(n, start) <= BUDGET.step_cost
        assert BUDGET.chunk_cost(n + 1, start) > BUDGET.step_cost or start + n == 5000   # no less than fits
        sizes.append(n)
    assert sum(sizes) == 5000 and sizes[0] == 7 and sizes[-1] == 1


def test_alone_an_embedding_gets_the_whole_token_budget():
    s = _scheduler()
    emb = _pooling("emb", 2000, 0.0)
    s.add_request(emb)
    sizes = []
    while not emb.is_finished:
        sizes += [n for _, n in _chunks(_step(s), "emb")]
    assert sizes == [512, 512, 512, 464]


def test_alone_a_long_embeddings_chunks_cost_at_most_a_fresh_prompts_chunk():
    """With nothing to generate, a chunk deep in a long input costs no more than a token-budget chunk at the start of
    a prompt: a request arriving meanwhile waits at most such a step (unbounded, a 512-token chunk 7,500 tokens in
    costs ~10x the first)."""
    alone = BUDGET.chunk_cost(512, 0)
    s = _scheduler(pooling_budget=PoolingBudget(600.0, 8.0, alone))
    emb = _pooling("emb", 8000, 0.0)
    s.add_request(emb)
    sizes = []
    while not emb.is_finished:
        ((start, n),) = _chunks(_step(s), "emb")
        assert BUDGET.chunk_cost(n, start) <= alone * (1 + 1e-9) and BUDGET.chunk_cost(n + 1, start) > alone or \
            start + n == 8000
        sizes.append(n)
    assert sizes[0] == 512 and sizes[-2] < 512 / 6 and sum(sizes) == 8000


def test_a_prompt_arriving_during_a_long_embedding_is_admitted_at_the_next_step():
    """The short prompt's TTFT: it is admitted beside the running embedding at once and prefilled whole, and from
    then on the embedding's chunks are capped (before it arrived: the whole budget)."""
    s = _scheduler()
    emb = _pooling("emb", 8000, 0.0)
    s.add_request(emb)
    assert _chunks(_step(s), "emb") == [(0, 512)]
    s.add_request(_generation("short", 20, 1, 1.0))
    out = _step(s)
    assert _chunks(out, "short") == [(0, 20)] and _chunks(out, "emb") == [(512, 4)]   # 4 rows: 7.4 of 8
    assert "short" not in s.requests                                   # its one token: sampled in that step
    assert _chunks(_step(s), "emb") == [(516, 512)]                    # alone again: the budget


def test_a_waiting_embedding_past_the_allowance_lets_the_requests_behind_it_in():
    s = _scheduler()
    s.add_request(_generation("stream", 4, 100, 0.0))
    _step(s)
    for rid, arrival in (("emb1", 1.0), ("emb2", 2.0)):
        s.add_request(_pooling(rid, 3000, arrival))
    s.add_request(_generation("late", 30, 5, 3.0))
    out = _step(s)
    assert _chunks(out, "emb1") == [(0, 7)] and _chunks(out, "emb2") == []   # the allowance went to the first
    assert _chunks(out, "late") == [(0, 30)]


def test_without_chunked_prefill_the_budget_is_not_applied():
    s = _scheduler(enable_chunked_prefill=False, max_num_batched_tokens=8192)
    s.add_request(_generation("stream", 4, 100, 0.0))
    _step(s)
    s.add_request(_pooling("emb", 3000, 1.0))
    assert _chunks(_step(s), "emb") == [(0, 3000)]


# Carried through part of the layers per step: SmolLM2-135M's 30 layers.
SPLIT = PoolingBudget(pairs_per_token=600.0, step_cost=8.0, num_layers=30)


def _entry(out, req: Request):
    (sr,) = [sr for sr in out.scheduled if sr.request is req]
    return sr


def test_beside_a_stream_a_deep_embeddings_chunks_run_through_part_of_the_layers():
    """Past the depth where one token through every layer costs more than the allowance, each chunk is the most
    tokens of which one layer fits, carried through as many layers as fit per step, the same tokens from layer 0
    to the last; its tokens count as computed only then. Every step decodes the stream and costs at most the
    allowance beside it (before: one token through every layer, 14 token-equivalents at 8,000 tokens)."""
    s = _scheduler(pooling_budget=SPLIT, max_model_len=20_000, num_blocks=1700)
    s.add_request(_generation("stream", 4, 19_000, 0.0))
    _step(s)
    emb = _pooling("emb", 8000, 1.0)
    s.add_request(emb)
    flight, split_chunks, tokens = None, 0, 0
    while not emb.is_finished:
        computed = emb.num_computed_tokens
        out = _step(s)
        assert _chunks(out, "stream")[0][1] == 1
        sr = _entry(out, emb)
        start, n = sr.num_computed_tokens, sr.num_new_tokens
        if sr.layers is None:
            assert flight is None and BUDGET.chunk_cost(n, start) <= SPLIT.step_cost
            assert BUDGET.chunk_cost(1, start) <= SPLIT.step_cost
            tokens += n
            continue
        first, end = sr.layers
        assert 0 <= first < end <= 30 and (end - first) * SPLIT.layer_cost(n, start) <= SPLIT.step_cost
        assert end == 30 or (end - first + 1) * SPLIT.layer_cost(n, start) > SPLIT.step_cost   # no fewer than fit
        if first == 0:
            assert flight is None and BUDGET.chunk_cost(1, start) > SPLIT.step_cost
            assert SPLIT.layer_cost(n + 1, start) > SPLIT.step_cost or start + n == 8000   # no fewer tokens
            split_chunks += 1
        else:
            assert flight == (start, n, first)
        flight = (start, n, end) if end < 30 else None
        assert emb.num_computed_tokens == (computed if end < 30 else start + n)
        assert emb.num_computed_layers == (end if end < 30 else 0) or emb.is_finished
        tokens += n if end == 30 else 0
    assert tokens == 8000 and split_chunks > 100


def _deep_beside_a_stream(s: Scheduler, tokens: int) -> Request:
    """An embedding of ``tokens`` run alone (chunks through every layer) to 4,608 tokens on ``s`` (the priority
    policy), then a stream more important than it (so it is the preemption victim): its next chunk is split."""
    emb = _pooling("emb", tokens, 0.0)
    s.add_request(emb)
    while emb.num_computed_tokens < 4608:
        assert _entry(_step(s), emb).layers is None
    stream = _generation("stream", 15, 100, 1.0)
    stream.priority = -1
    s.add_request(stream)
    return emb


def test_a_chunk_preempted_or_aborted_mid_way_starts_over_and_the_runner_drops_its_hidden_state():
    """Preempted by recompute between two of its layers, a chunk starts over from layer 0 when readmitted; its id
    is in the next step's ``finished_req_ids`` (the runner's kept hidden state is dropped), as is an aborted one's."""
    s = _scheduler(pooling_budget=SPLIT, num_blocks=292,   # the embedding's 290 blocks and the stream's first
                   scheduling_policy="priority")
    emb = _deep_beside_a_stream(s, 4640)
    midway = []
    while emb.status != RequestStatus.PREEMPTED:   # the stream's second block: the embedding's last free one
        assert len(midway) < 10 and not emb.is_finished
        _step(s)
        midway.append(emb.num_computed_layers)
    assert midway[:2] == [1, 2] and emb.num_computed_layers == 0 and emb.num_computed_tokens == 0
    out = _step(s)
    assert out.finished_req_ids == {"emb"} and (_entry(out, emb).layers or (0,))[0] == 0   # readmitted: layer 0
    s = _scheduler(pooling_budget=SPLIT, scheduling_policy="priority")
    emb = _deep_beside_a_stream(s, 5000)
    _step(s)
    assert emb.num_computed_layers == 1
    s.finish_requests("emb", RequestStatus.FINISHED_ABORTED)
    assert s.schedule().finished_req_ids == {"emb"} and s.schedule().finished_req_ids == set()
