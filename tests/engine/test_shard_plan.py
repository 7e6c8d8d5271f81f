"""What each tensor-parallel rank holds (``engine/distributed/shard_plan.py``), and the step inputs the
driver sends the ranks (``engine/worker/step_inputs.py``)."""

from __future__ import annotations

import numpy as np
import pytest

from engine.distributed.shard_plan import Span, plan_shard
from engine.model_config import ModelConfig
from engine.worker.step_inputs import StepInputs


def _config(heads: int, kv: int, inter: int = 1536, vocab: int = 97) -> ModelConfig:
    return ModelConfig(architecture="LlamaForCausalLM", hidden_size=64, intermediate_size=inter, num_hidden_layers=1,
                       num_attention_heads=heads, num_key_value_heads=kv, head_dim=16, vocab_size=vocab,
                       max_position_embeddings=64)


def _plans(config, n):
    return [plan_shard(config, r, n) for r in range(n)]


@pytest.mark.parametrize("heads,kv,n", [(9, 3, 2), (9, 3, 4), (6, 3, 4), (4, 2, 4), (8, 8, 3), (32, 8, 8),
                                        (4, 1, 4), (4, 4, 1)])
def test_every_query_head_once_with_its_own_kv_head(heads, kv, n):
    """The ranks' query heads cover every head exactly once, each rank caches the KV heads its query heads
    read (GQA groups stay on their KV head), and a KV head is held by several ranks only when there are
    fewer KV heads than ranks."""
    plans = _plans(_config(heads, kv), n)
    group = heads // kv
    assert sorted(h for p in plans for h in range(p.q_heads.start, p.q_heads.stop)) == list(range(heads))
    for p in plans:
        assert p.num_heads >= 1 and p.num_kv_heads >= 1
        assert {h // group for h in range(p.q_heads.start, p.q_heads.stop)} == \
            set(range(p.kv_heads.start, p.kv_heads.stop))
    held = [k for p in plans for k in range(p.kv_heads.start, p.kv_heads.stop)]
    assert sorted(set(held)) == list(range(kv))
    assert (len(held) == kv) == (kv >= n)


def test_splits_vllm_refuses_are_taken_or_refused_by_name():
    """9 heads over 2 ranks (SmolLM2): 6 and 3 (2 and 1 KV heads); 3 KV heads over 4 ranks: two ranks share
    one; more ranks than heads is refused, naming the counts."""
    a, b = _plans(_config(9, 3), 2)
    assert (a.q_heads, a.kv_heads, b.q_heads, b.kv_heads) == (Span(0, 6), Span(0, 2), Span(6, 3), Span(2, 1))
    assert [(p.q_heads, p.kv_heads.start) for p in _plans(_config(6, 3), 4)] == \
        [(Span(0, 1), 0), (Span(1, 1), 0), (Span(2, 2), 1), (Span(4, 2), 2)]
    with pytest.raises(ValueError, match="exceeds the model's 4 attention heads"):
        plan_shard(_config(4, 2), 0, 5)


def test_mlp_in_whole_quantization_blocks_and_vocabulary_in_equal_rows():
    plans = _plans(_config(8, 8, inter=1536, vocab=49152), 4)
    assert [p.intermediate for p in plans] == [Span(384 * r, 384) for r in range(4)]
    assert [p.intermediate.size for p in _plans(_config(8, 8, inter=96), 2)] == [64, 32]   # 3 blocks of 32
    assert [p.intermediate.size for p in _plans(_config(8, 8, inter=100), 3)] == [34, 33, 33]
    vocab = _plans(_config(4, 4, vocab=97), 4)
    assert [(p.vocab, p.vocab_per_rank) for p in vocab] == [(Span(0, 25), 25), (Span(25, 25), 25),
                                                            (Span(50, 25), 25), (Span(75, 22), 25)]


def test_step_inputs_cross_the_wire_unchanged():
    rng = np.random.default_rng(0)
    inputs = StepInputs(np.array([[3, 1]]), np.zeros((0, 2), dtype=np.int64), np.array([[4, 5], [6, 7]]),
                        rng.integers(0, 97, 9), np.arange(9), rng.integers(0, 80, 9), np.array([0, 4, 9]),
                        np.array([4, 20]), rng.integers(0, 9, (2, 3)), np.array([3, 8]))
    sizes, payload = inputs.to_wire()
    got = StepInputs.from_wire(sizes + [0] * 4, payload)
    for name in inputs.__dataclass_fields__:
        assert np.array_equal(getattr(got, name), getattr(inputs, name)), name
        assert getattr(got, name).shape == np.asarray(getattr(inputs, name)).shape, name


def test_more_ranks_than_heads_are_refused_before_any_rank_starts(monkeypatch):
    """A trial: ``--tensor-parallel-size 10`` on SmolLM2 (9 heads) started 10 ranks, each loaded and failed with its
    own error line (~18 s); the driver now refuses the split from the model's config first."""
    from engine.core import core_setup
    from engine.llm import LLM

    monkeypatch.setattr(core_setup, "start_driver", lambda *a: pytest.fail("a rank was started"))
    with pytest.raises(ValueError, match="tensor_parallel_size 10 exceeds the model's 9 attention heads"):
        LLM(tensor_parallel_size=10)
