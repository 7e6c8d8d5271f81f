"""Several greedy decode steps in one C call (kernels/cpu_decoder.py's ``decode_greedy``, csrc/decode_steps_cpu.c)
against one step at a time through the model's path (its forward pass, ``compute_logits`` and the sampler's
``argmax_rows``): the same tokens and the same keys and values in the caches, for a batch of sequences of
different lengths, on bfloat16 and 4-bit projections, with the head's bfloat16 panels and with an 8-bit head
copy; each on this CPU's build and the AVX2 one (tests/test_cpu_kernels.py's ``linear_build``)."""

from __future__ import annotations

import pytest
import torch

from engine.models.llama import AttentionMetadata
from engine.worker.sampler import argmax_rows
from kernels import cpu_linear
from tests.test_cpu_decoder import BLOCK, _caches, _config, _copy, _gguf_model, _model
from tests.test_cpu_kernels import linear_build  # noqa: F401 (a fixture: each test runs on each build)

# (prompt length, block ids): blocks out of order and shared by none, each table long enough for STEPS more
SEQS = [(5, [3, 7]), (17, [2, 9, 12]), (30, [11, 4, 5])]
STEPS = 6


def _with_q8_head(model, same_rows: bool = False, nan_rows: tuple[int, ...] = ()):
    """Give ``model`` an 8-bit head copy (random codes and scales, as a Q8_0 head's; ``same_rows``: one row
    repeated, so every logit ties; ``nan_rows``: rows whose scales are NaN, so their logits are) that both
    paths read."""
    head = model.embed_tokens if model.lm_head is None else model.lm_head
    vocab, hidden = head.weight.shape
    g = torch.Generator().manual_seed(5)
    rows = 1 if same_rows else vocab
    codes = torch.randint(-127, 128, (rows, hidden), generator=g, dtype=torch.int8).expand(vocab, hidden)
    scales = (torch.rand(rows, hidden // 32, generator=g) * 0.002).expand(vocab, hidden // 32).clone()
    scales[list(nan_rows)] = float("nan")
    model.lm_head_q8 = cpu_linear.pack_q8(codes, scales)
    model._lm_head_q8_of = (head.weight, head.weight._version)
    model.choose_kernels()
    return model


def _prefill(model, caches, vocab: int) -> torch.Tensor:
    """Write every prompt but its last token into ``caches``; returns the prompts' last tokens [rows]."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, vocab, (n,), generator=g) for n, _ in SEQS]
    ids = torch.cat([p[:-1] for p in prompts])
    pos = torch.cat([torch.arange(n - 1) for n, _ in SEQS])
    slots = torch.cat([torch.tensor([b[p // BLOCK] * BLOCK + p % BLOCK for p in range(n - 1)]) for n, b in SEQS])
    qsl = torch.tensor([0] + [sum(n - 1 for n, _ in SEQS[:i + 1]) for i in range(len(SEQS))], dtype=torch.int32)
    with torch.inference_mode():
        model(ids, pos, AttentionMetadata(slots, qsl, torch.tensor([n - 1 for n, _ in SEQS], dtype=torch.int32),
                                          _tables()), caches)
    return torch.tensor([int(p[-1]) for p in prompts])


def _tables() -> torch.Tensor:
    width = max(len(b) for _, b in SEQS)
    return torch.tensor([b + [0] * (width - len(b)) for _, b in SEQS], dtype=torch.int32)


def _one_at_a_time(model, caches, tokens: torch.Tensor) -> list[list[int]]:
    """STEPS decode steps through the model's per-step path: [steps][rows] tokens."""
    out = []
    for k in range(STEPS):
        pos = torch.tensor([n - 1 + k for n, _ in SEQS])
        slots = torch.tensor([b[p // BLOCK] * BLOCK + p % BLOCK for (_, b), p in zip(SEQS, pos.tolist())])
        md = AttentionMetadata(slots, torch.arange(len(SEQS) + 1, dtype=torch.int32),
                               (pos + 1).to(torch.int32), _tables())
        with torch.inference_mode():
            tokens = argmax_rows(model.compute_logits(model(tokens, pos, md, caches)))
        out.append(tokens.tolist())
    return out


@pytest.mark.parametrize("weights", ["bf16", "4bit"])
@pytest.mark.parametrize("q8_head", [False, True])
def test_several_steps_in_one_call_give_the_one_step_tokens_and_caches(linear_build, weights, q8_head):
    config = _config(layers=2)
    if weights == "4bit" and not cpu_linear.q4_available():
        pytest.skip("no 4-bit C kernel")
    model = _model(config) if weights == "bf16" else _gguf_model(config, "int4")
    if q8_head:
        model = _with_q8_head(model)
    caches = _caches(config)
    last = _prefill(model, caches, config.vocab_size)
    mine = _copy(caches)
    assert model.can_decode_greedy(mine)
    got = model.decode_greedy(last, torch.tensor([n - 1 for n, _ in SEQS]), _tables(), mine, STEPS)
    want = _one_at_a_time(model, caches, last)
    assert got.tolist() == want
    assert len({tuple(row) for row in want}) > 1   # the tokens change from step to step
    for (k0, v0), (k1, v1) in zip(caches, mine):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)


def test_ties_go_to_the_first_maximum(linear_build):
    """Every logit equal: each step picks token 0, as numpy's argmax (the sampler's) does."""
    config = _config(layers=1)
    model = _with_q8_head(_model(config), same_rows=True)
    caches = _caches(config)
    last = _prefill(model, caches, config.vocab_size)
    got = model.decode_greedy(last, torch.tensor([n - 1 for n, _ in SEQS]), _tables(), _copy(caches), STEPS)
    assert got.tolist() == _one_at_a_time(model, caches, last) == [[0] * len(SEQS)] * STEPS


@pytest.mark.parametrize("nan_rows", [(7, 200), (299,)])
def test_a_nan_logit_wins_as_numpys_argmax_has_it(linear_build, nan_rows):
    config = _config(layers=1)
    model = _with_q8_head(_model(config), nan_rows=nan_rows)
    caches = _caches(config)
    last = _prefill(model, caches, config.vocab_size)
    got = model.decode_greedy(last, torch.tensor([n - 1 for n, _ in SEQS]), _tables(), _copy(caches), STEPS)
    assert got.tolist() == _one_at_a_time(model, caches, last) == [[nan_rows[0]] * len(SEQS)] * STEPS


def test_a_bad_token_or_position_is_refused(linear_build):
    config = _config(layers=1)
    model = _model(config)
    caches = _caches(config)
    starts = torch.tensor([n - 1 for n, _ in SEQS])
    with pytest.raises(ValueError, match="vocabulary"):
        model.decode_greedy(torch.tensor([1, config.vocab_size, 2]), starts, _tables(), caches, 2)
    far = torch.full((3,), config.max_position_embeddings - 1)
    wide = torch.tensor([[1] * 20] * 3, dtype=torch.int32)
    with pytest.raises(ValueError, match="RoPE"):
        model.decode_greedy(torch.tensor([1, 2, 3]), far, wide, caches, 2)


def test_it_steps_aside_where_the_model_cannot(linear_build):
    model = _model(_config(layers=1))
    caches = _caches(_config(layers=1))
    model.use_c_decoder = False
    assert not model.can_decode_greedy(caches)
    assert model.decode_greedy(torch.tensor([1, 2, 3]), torch.tensor([4, 16, 29]), _tables(), caches, 2) is None
