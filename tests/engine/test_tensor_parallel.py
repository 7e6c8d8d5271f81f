"""Tensor parallelism (``--tensor-parallel-size``): every registered
architecture split over 2 and 4 ranks (real processes over gloo) is
token-identical to transformers in float32 greedy, with logprobs within
1e-4, each prompt alone and all batched, with prefix caching, chunked
prefill and preemption on (a KV pool too small for the batch); transformers
is the reference ``test_architectures.py`` pins the one-rank engine to, and
the one-rank engine runs the same cases beside the split ones (its tokens
are theirs). The batched run preempts and hits the prefix cache (asserted
from the engine's counters).

Half the cases split heads unevenly (6 heads, 3 KV heads: 2 ranks hold 2 and
1 KV heads; 4 ranks share 3 KV heads, two of them replicating one) and the
MLP unevenly (96 rows: 64 and 32); the others use 4 heads and 2 KV heads
(4 ranks: each KV head replicated twice, vLLM's case).
"""

from __future__ import annotations

import pytest
import torch

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.engine.test_architectures import _check, _prompts, _reference, _save

pytestmark = pytest.mark.slow   # a large workload: tests/conftest.py runs these files first

transformers = pytest.importorskip("transformers")

UNEVEN = dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=3, head_dim=16, intermediate_size=96)
CASES = {"llama_llama3": {}, "llama_linear": UNEVEN, "mistral_window": {}, "qwen2": UNEVEN, "qwen3": {},
         "gemma2": UNEVEN, "gemma3": {}, "phi3": UNEVEN}
NEW_TOKENS = 24
PROMPTS = 4


def _llm(path, tp: int, **extra) -> LLM:
    """The engine on ``path`` over ``tp`` ranks, float32 on CPU, 32-token steps, a 9-block KV pool (the
    four prompts of up to 40 tokens plus 24 new ones need 16: the batch preempts)."""
    return LLM(model=str(path), dtype="float32", device="cpu", tensor_parallel_size=tp, num_gpu_blocks_override=9,
               enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=32, **extra)


@pytest.mark.parametrize("kind", list(CASES))
def test_tensor_parallel_matches_transformers(tmp_path, kind, one_thread):
    hf = _save(tmp_path, kind, **CASES[kind])
    prompts = _prompts(kind)[:PROMPTS]
    refs = _reference(hf, prompts, NEW_TOKENS)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=0, ignore_eos=True)
    for tp in (1, 2, 4):   # each checked against transformers' tokens: so TP = 2 and 4 against TP = 1's too
        llm = _llm(tmp_path, tp)
        try:
            model = llm.engine.model_runner.model
            if tp > 1:
                assert model.shard.world_size == tp and model.c_stack_refusal >= {"tensor_parallel"}
            for prompt, ref in zip(prompts, refs):
                _check(llm.generate([prompt], params)[0], ref)
            before = llm.engine.get_stats()
            for out, ref in zip(llm.generate(prompts, params), refs):
                _check(out, ref)
            after = llm.engine.get_stats()
            assert after.num_preemptions > before.num_preemptions
            assert after.prefix_cache_hits > before.prefix_cache_hits
        finally:
            llm.shutdown()


def test_bfloat16_two_ranks_batch_invariant_and_reproducible(tmp_path):
    """bfloat16 over 2 ranks: a prompt's tokens and logprobs are the same bits alone, batched, and batched
    again with its prefix cached (the all-reduce of two ranks adds two values, which commutes); a second
    engine (fresh ranks, fresh process group) gives every prompt of the batch the same bits as the first."""
    _save(tmp_path, "qwen3", **UNEVEN)
    prompts = _prompts("qwen3")
    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=0, ignore_eos=True)

    def bits(out):
        o = out.outputs[0]
        return o.token_ids, [lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids)]
    runs = []
    for _ in range(2):
        llm = LLM(model=str(tmp_path), dtype="bfloat16", device="cpu", tensor_parallel_size=2,
                  enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=32,
                  kv_cache_memory="8MiB")
        try:
            alone = bits(llm.generate([prompts[3]], params)[0])
            batched = [bits(out) for out in llm.generate(prompts, params)]
            assert batched[3] == alone
            assert bits(llm.generate(prompts[::-1], params)[4]) == alone
            runs.append(batched)
        finally:
            llm.shutdown()
    assert runs[1] == runs[0]


def test_gguf_4bit_blocks_split_by_rank(tmp_path, one_thread):
    """A llama GGUF (q/k rows permuted as llama.cpp writes them) whose 2-D weights are Q4_0, its projections
    kept in 4 bits (``quantization: gguf``, float32) over 2 ranks: each rank reads its rows of the blocks
    (q/k/v un-permuted by head, gate/up) and its block-aligned columns (o_proj, down_proj), and greedy tokens
    equal one rank's."""
    gguf = pytest.importorskip("gguf")
    from tests.tiny_models import write_llama_gguf

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=96, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=6, num_key_value_heads=3, head_dim=16,
                                   max_position_embeddings=256, tie_word_embeddings=True, initializer_range=0.1)
    path = tmp_path / "tiny.gguf"
    write_llama_gguf(path, transformers.LlamaForCausalLM(cfg).float().eval(), qtype=gguf.GGMLQuantizationType.Q4_0)
    prompts = [[5, 17, 33, 60, 2 + i, 71, 9] for i in range(2)]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    one = LLM(model=str(path), dtype="float32", device="cpu", quantization="gguf", kv_cache_memory="4MiB")
    assert set(one.engine.model_runner.model.layers[0].int4) == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    want = [o.outputs[0].token_ids for o in one.generate(prompts, params)]
    two = LLM(model=str(path), dtype="float32", device="cpu", quantization="gguf", kv_cache_memory="4MiB",
              tensor_parallel_size=2)
    try:
        layer = two.engine.model_runner.model.layers[0]
        assert set(layer.int4) == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
        assert (layer.int4["down_proj"].in_features, layer.int4["o_proj"].in_features) == (64, 64)
        assert [o.outputs[0].token_ids for o in two.generate(prompts, params)] == want
    finally:
        two.shutdown()


def test_memory_per_rank(tmp_path):
    """Each of 2 ranks holds at most 0.55x the weights of one (the loader's count) on an evenly split model."""
    _save(tmp_path, "llama_llama3", hidden_size=256, intermediate_size=512, num_attention_heads=8,
          num_key_value_heads=4, head_dim=32, vocab_size=97)
    one = LLM(model=str(tmp_path), dtype="bfloat16", device="cpu", kv_cache_memory="4MiB")
    whole = one.engine.core.rank_memory[0]
    two = LLM(model=str(tmp_path), dtype="bfloat16", device="cpu", kv_cache_memory="4MiB", tensor_parallel_size=2)
    try:
        ranks = two.engine.core.rank_memory
        assert [m["rank"] for m in ranks] == [0, 1]
        for m in ranks:   # the KV pool's budget is per rank: half the heads, twice the blocks
            assert m["weight_bytes"] <= 0.55 * whole["weight_bytes"], (m, whole)
            assert m["kv_bytes"] <= whole["kv_bytes"]
        assert two.engine.num_blocks >= 2 * one.engine.num_blocks - 1
    finally:
        two.shutdown()


def test_a_ranks_end_is_logged_for_what_it_is(caplog):
    # a trial: a refused checkpoint printed rank 1's whole traceback, and a script that exited without
    # llm.shutdown() printed "rank 1 failed" with gloo's; now one line each (the exit status stays 1: the
    # two-host test checks a host whose driver died exits non-zero)
    import logging

    from engine.executor.worker_main import log_rank_failure

    with caplog.at_level(logging.INFO, logger="tandem.worker"):
        log_rank_failure(1, RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer"))
        log_rank_failure(1, ValueError("a 4-bit weight with act-order cannot be split"))
        log_rank_failure(1, KeyError("x"))
    lines = [(r.levelname, r.getMessage(), r.exc_info is not None) for r in caplog.records]
    assert lines == [("WARNING", "tensor-parallel rank 1: its driver is gone (it ended without stopping the "
                                 "ranks); stopping", False),
                     ("ERROR", "tensor-parallel rank 1 failed: a 4-bit weight with act-order cannot be split", False),
                     ("ERROR", "tensor-parallel rank 1 failed", True)]


def test_an_interrupted_step_frees_its_ranks_and_a_dropped_engine_its_group(tmp_path):
    """An engine trial: Ctrl-C in a script's tensor-parallel ``generate`` hung its exit 300 s (the stop waited for
    rank 1, which waited in the interrupted step's all-reduce until gloo's timeout), ``del llm`` kept the ranks
    and the process group (a second tensor-parallel LLM: "initialize the default process group twice"), and
    ``generate`` after ``shutdown()`` met torch's "Group ... is not registered"."""
    from engine.distributed.parallel_state import RankFailure

    _save(tmp_path, "llama_llama3")
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm = _llm(tmp_path, 2)
    expected = llm.generate(["hello there"], params)[0].outputs[0].token_ids
    runner = llm.engine.model_runner
    real_run = runner.run

    def interrupted(inputs):      # the ranks entered the step (its inputs broadcast); the driver leaves it
        raise KeyboardInterrupt

    runner.run = interrupted
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["hello there"], params)
    runner.run = real_run
    with pytest.raises(RankFailure, match="interrupted"):      # said at once, never a wait in a collective
        llm.generate(["again"], params)
    procs = list(llm.engine.core.executor.procs.values())
    del llm, runner, real_run                                 # the finalizer leaves the group
    two = _llm(tmp_path, 2)                                   # so a new engine forms its own
    try:
        again = two.generate(["hello there"], params)[0].outputs[0].token_ids
        two.shutdown()
        with pytest.raises(RuntimeError, match="was shut down"):
            two.generate(["hello there"], params)
    finally:
        two.shutdown()
    assert again == expected
    assert all(p.poll() is not None for p in procs)          # the interrupted engine's ranks were killed
