"""Top-k / top-p masking (engine/worker/top_k_top_p.py): every ranking it may take (a few candidates, more,
all tokens) gives the mask of its rule, bit for bit, row by row, whatever the batch; the rule keeps the
smallest set of most likely tokens whose mass reaches top_p, within top-k."""

from __future__ import annotations

import pytest
import torch

from engine.worker import top_k_top_p
from engine.worker.top_k_top_p import apply_top_k_top_p


def _rule(x: torch.Tensor, k: int, p: float) -> torch.Tensor:
    """One row [vocab] masked by the module's rule, written plainly: canonical order from a stable sort of
    all tokens, float64 prefix sums of the float32 exp(x - max)."""
    vocab = x.shape[0]
    k = min(k, vocab) if k else vocab
    values, ids = x.sort(descending=True, stable=True)
    e = torch.exp(x - x.max())
    mass = torch.cumsum(e[ids], dim=0, dtype=torch.float64)
    total = torch.cumsum(e, dim=0, dtype=torch.float64)[-1] if k == vocab else mass[k - 1]
    out = torch.full_like(x, float("-inf"))
    for j in range(vocab):
        before = mass[j - 1] if j else torch.zeros((), dtype=torch.float64)
        if j == 0 or (j < k and (p >= 1.0 or before < p * total)):
            out[ids[j]] = values[j]
    return out


def _rows(vocab: int, seed: int) -> list[tuple[torch.Tensor, int, float]]:
    """Rows of every kind the sampler meets: peaked, flat, ties, -inf masks; with and without top-k."""
    g = torch.Generator().manual_seed(seed)
    peaked = torch.randn(vocab, generator=g) * 8
    flat = torch.randn(vocab, generator=g) * 0.5
    ties = torch.round(torch.randn(vocab, generator=g) * 2) / 2   # many equal logits
    masked = torch.randn(vocab, generator=g) * 3
    masked[torch.rand(vocab, generator=g) < 0.97] = float("-inf")   # a grammar's few allowed tokens
    return [(peaked, 0, 0.9), (flat, 0, 0.95), (ties, 0, 0.8), (masked, 0, 0.99), (ties, 7, 1.0),
            (ties, 40, 0.9), (masked, 200, 1.0), (masked, 200, 0.5), (peaked, 3, 0.99), (flat, 50, 0.3),
            (flat, 0, 0.999), (peaked, vocab + 5, 0.97)]


@pytest.mark.parametrize("candidates", [(16, 128), (16,), (), (4096,)])
def test_every_ranking_gives_the_rules_mask_alone_and_batched(monkeypatch, candidates):
    monkeypatch.setattr(top_k_top_p, "CANDIDATES", candidates)
    rows = _rows(1000, 0)
    x = torch.stack([r for r, _, _ in rows])
    ks, ps = [k for _, k, _ in rows], [p for _, _, p in rows]
    batched = apply_top_k_top_p(x, ks, ps)
    for i, (row, k, p) in enumerate(rows):
        assert torch.equal(batched[i], _rule(row, k, p)), (i, k, p)
        assert torch.equal(apply_top_k_top_p(row[None], [k], [p])[0], batched[i]), (i, k, p)


def test_rows_without_either_are_left_alone_and_the_batch_is_not_changed():
    x = torch.randn(3, 500)
    before = x.clone()
    out = apply_top_k_top_p(x, [0, 5, 0], [1.0, 1.0, 0.9])
    assert torch.equal(x, before) and torch.equal(out[0], x[0])
    assert int(torch.isfinite(out[1]).sum()) == 5
    assert apply_top_k_top_p(x, [0, 0, 0], [1.0, 1.0, 1.0]) is x
    assert apply_top_k_top_p(x, [500, 10**6, 0], [1.0, 1.0, 1.0]) is x   # a top-k of the vocabulary or more


def test_the_nucleus_is_the_smallest_set_reaching_p():
    """At the real vocabulary's size and the default rankings: the kept tokens are the most likely ones,
    their mass reaches p, and without the least likely of them it does not."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 49152, generator=g) * torch.tensor([[6.0], [4.0], [2.0], [1.0], [8.0], [3.0]])
    ps = [0.9, 0.95, 0.99, 0.5, 0.8, 0.97]
    out = apply_top_k_top_p(x, [0] * 6, ps)
    probs = torch.softmax(x.double(), dim=-1)
    for i, p in enumerate(ps):
        kept = torch.isfinite(out[i])
        assert probs[i][kept].min() >= probs[i][~kept].max()
        mass = probs[i][kept].sum().item()
        assert mass >= p - 1e-9 and mass - probs[i][kept].min().item() < p + 1e-9
        assert torch.equal(out[i], _rule(x[i], 0, p))
