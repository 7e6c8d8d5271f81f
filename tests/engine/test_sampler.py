"""Sampler: greedy, seeded reproducibility, penalties, min_tokens, top-k/top-p/min-p, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from engine.core.request import Request
from engine.worker.sampler import Sampler, argmax_rows, prompt_logprobs
from engine.sampling_params import SamplingParams

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
V = 64


def req(rid: str, prompt=(1, 2, 3), output=(), eos: int | None = None, index: int = 0, **params) -> Request:
    r = Request(rid, list(prompt), SamplingParams(**params), eos_token_id=eos, index=index)
    if output:
        r.append_output_token_ids(list(output))
    return r


def randn(rows: int, vocab: int = V, seed: int = 0, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g).to(device)


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_is_argmax_and_top_k_1_is_greedy(device):
    logits = randn(6, device=device)
    s = Sampler(V, torch.device(device), seed=0)
    greedy = s.sample(logits, [req(f"g{i}", temperature=0.0) for i in range(6)])
    assert greedy.token_ids == logits.argmax(-1).tolist()
    assert greedy.logprobs == [None] * 6
    topk1 = s.sample(logits, [req(f"k{i}", temperature=1.3, top_k=1) for i in range(6)])
    assert topk1.token_ids == greedy.token_ids
    # top_p 0, which OpenAI takes (vLLM refuses it; a trial): the smallest nucleus, the likeliest token alone
    top_p0 = s.sample(logits, [req(f"p{i}", temperature=1.3, top_p=0.0, seed=i) for i in range(6)])
    assert top_p0.token_ids == greedy.token_ids
    mixed = s.sample(logits, [req("a", temperature=0.0), req("b", top_k=1), req("c", temperature=0.0),
                              req("d", top_k=1, seed=3), req("e", temperature=0.0), req("f", top_k=1)])
    assert mixed.token_ids == greedy.token_ids
    assert logits.equal(randn(6, device=device))  # input not modified


def test_argmax_rows_is_torchs_argmax():
    """The first maximum, a NaN before any number (the first NaN), -0.0 equal to 0.0, -inf rows: torch's
    index on every row, also from a strided view."""
    nan, inf = float("nan"), float("inf")
    rows = [[1.0, nan, 3.0, nan], [nan, 1.0, nan, 2.0], [-inf, -inf, -inf, -inf], [0.0, -0.0, 0.0, -1.0],
            [-0.0, 0.0, -1.0, -2.0], [3.0, 3.0, 1.0, 3.0], [1.0, inf, inf, 0.0], [-inf, nan, 1.0, 1.0]]
    x = torch.tensor(rows)
    assert argmax_rows(x).tolist() == x.argmax(-1).tolist() == [1, 0, 0, 0, 0, 0, 1, 1]
    big = randn(5, 49152)
    big[2, 50] = big[2, 100] = big[2].max() + 1
    for t in (big, big[:, ::3], big.t()):
        got = argmax_rows(t)
        assert got.dtype == torch.int64 and torch.equal(got, t.argmax(-1))


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_rows_do_not_depend_on_batch(device):
    steps = 8
    dev = torch.device(device)

    def run(batch_with_unseeded: bool, position: int) -> list[int]:
        s = Sampler(V, dev)  # unseeded rows use torch's default generator
        seeded = [req("s0", seed=42, temperature=0.9), req("s1", seed=42, index=1, temperature=0.9, top_p=0.95)]
        tokens = []
        for step in range(steps):
            logits = randn(2, seed=100 + step, device=device)
            if batch_with_unseeded:
                others = [req(f"u{step}-{j}", temperature=1.0) for j in range(3)]
                noise_rows = randn(3, seed=999 + step, device=device)
                rows = others[:position] + seeded + others[position:]
                all_logits = torch.cat([noise_rows[:position], logits, noise_rows[position:]])
                out = s.sample(all_logits, rows).token_ids[position:position + 2]
            else:
                out = s.sample(logits, seeded).token_ids
            for r, t in zip(seeded, out):
                r.append_output_token_ids(t)
            tokens.extend(out)
        return tokens

    alone = run(False, 0)
    assert run(True, 0) == alone
    assert run(True, 2) == alone
    assert run(True, 3) == alone
    # index differentiates n>1 siblings: the two seeded rows see the same logits
    # in a step but draw from different generators.
    assert alone[0::2] != alone[1::2]


def test_seeded_draw_depends_on_position_only():
    """The draw for output position k depends only on (seed + index, k): the same position draws the same token
    (after ``free`` too), positions differ, and a request resumed at position k (its first k tokens already
    there) draws what the uninterrupted one drew there."""
    s = Sampler(V, torch.device("cpu"))
    logits = randn(1)
    r = req("x", seed=7, temperature=5.0)
    first = []
    for _ in range(10):
        first.append(s.sample(logits, [r]).token_ids[0])
        r.append_output_token_ids(first[-1])
    assert len(set(first)) > 1               # positions draw differently
    s.free("x")
    resumed = req("y", seed=7, temperature=5.0)
    resumed.append_output_token_ids(first[:6])
    assert s.sample(logits, [resumed]).token_ids[0] == first[6]
    assert s.sample(logits, [resumed]).token_ids[0] == first[6]   # the same position draws the same again
    s.free("never-seen")  # no error


@pytest.mark.parametrize("device", DEVICES)
def test_penalties_exact(device):
    from engine.worker.sampler import _apply_penalties

    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]], device=device)
    # prompt has token 0 and 1; output has token 3 twice and token 4 once.
    r = req("p", prompt=(0, 1), output=(3, 4, 3), repetition_penalty=2.0, frequency_penalty=0.5,
            presence_penalty=0.25)
    got = _apply_penalties(logits, [r])
    expected = torch.tensor([[
        2.0 / 2.0,                    # prompt token, positive: divided
        -1.0 * 2.0,                   # prompt token, negative: multiplied
        0.5,                          # unseen
        3.0 / 2.0 - 2 * 0.5 - 0.25,   # output x2: repetition, frequency x2, presence
        -2.0 * 2.0 - 1 * 0.5 - 0.25,  # output x1
        1.0,                          # unseen
    ]], device=device)
    torch.testing.assert_close(got, expected)
    # rows without penalties are untouched, the input is not modified
    two = torch.cat([logits, logits])
    got2 = _apply_penalties(two, [req("q"), r])
    torch.testing.assert_close(got2[0], logits[0])
    torch.testing.assert_close(got2[1], expected[0])
    assert two[1].equal(logits[0])


@pytest.mark.parametrize("penalty", [1e-300, 1e-40, 1e300])
def test_an_extreme_repetition_penalty_still_samples_a_real_token(penalty):
    """A trial: ``repetition_penalty=1e-300`` passes the check (vLLM's rule: > 0) but was 0 in float32, the seen
    tokens' logits +inf and a sampled row's softmax NaN: ``<|endoftext|>`` (token 0) every step. The penalty now
    stays in float32's range and the logits finite: a tiny one makes the seen token of largest positive logit
    certain, a huge one brings the seen ones to ~0 (positive) or float32's lowest (negative)."""
    logits = torch.tensor([[1.0, 2.0, -1.0, 3.0, 0.5, 0.0]] * 2)
    s = Sampler(6, torch.device("cpu"), seed=0)
    seen = (1, 2, 4)   # token 0 unseen: a NaN row would pick it
    drawn = set()
    for draw in range(20):
        rows = [req(f"t{draw}", prompt=seen, repetition_penalty=penalty, temperature=t, seed=draw)
                for t in (0.5, 1.0)]
        drawn.update(s.sample(logits, rows).token_ids)
    assert drawn == {1} if penalty < 1 else 2 not in drawn and len(drawn) > 1
    greedy = s.sample(logits[:1], [req("g", prompt=seen, repetition_penalty=penalty, temperature=0.0)]).token_ids
    assert greedy == ([1] if penalty < 1 else [3])


def test_penalties_change_greedy_choice():
    logits = torch.tensor([[5.0, 4.9, 0.0, 0.0]])
    s = Sampler(4, torch.device("cpu"))
    assert s.sample(logits, [req("a", prompt=(0,), temperature=0.0)]).token_ids == [0]
    assert s.sample(logits, [req("b", prompt=(0,), temperature=0.0, repetition_penalty=1.1)]).token_ids == [1]
    assert s.sample(logits, [req("c", prompt=(0,), output=(0,), temperature=0.0,
                                 presence_penalty=0.2)]).token_ids == [1]


@pytest.mark.parametrize("device", DEVICES)
def test_logit_bias_adds_to_its_tokens_and_leaves_the_raw_logprobs(device):
    """OpenAI's ``logit_bias`` (vLLM serves it; the engine had refused it): +100 makes a token the greedy pick,
    -100 bans the argmax; each row only its own bias (a batch of mixed rows, and a row alone, give the same
    tokens and logprobs); the logprobs stay the raw ones; a biased greedy request is not a raw-argmax one
    (the multi-step decode path computes raw argmaxes)."""
    from engine.worker.sampler import picks_raw_argmax

    logits = randn(3, device=device)
    top = int(logits[0].argmax())
    s = Sampler(V, torch.device(device))
    rows = [req("plain", temperature=0.0, logprobs=2), req("up", temperature=0.0, logit_bias={7: 100}, logprobs=2),
            req("ban", temperature=0.0, logit_bias={top: -100.0})]
    out = s.sample(logits, rows)
    assert out.token_ids[0] == top and out.token_ids[1] == 7 and out.token_ids[2] != top
    second = logits[2].clone()
    second[top] = float("-inf")
    assert out.token_ids[2] == int(second.argmax())
    assert out.logprobs[1] == s.sample(logits[1:2], [rows[1]]).logprobs[0]                 # batch invariant
    raw = torch.log_softmax(logits[1].float(), -1)
    assert out.logprobs[1][7].logprob == pytest.approx(float(raw[7]))      # the model's, not the biased one
    for i, r in enumerate(rows):
        assert s.sample(logits[i:i + 1], [r]).token_ids == [out.token_ids[i]]
    assert picks_raw_argmax(req("g", temperature=0.0)) and not picks_raw_argmax(rows[2])
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={3: 101})


@pytest.mark.parametrize("device", DEVICES)
def test_allowed_token_ids_and_bad_words_restrict_each_row_alone(device):
    """vLLM's ``allowed_token_ids`` (sampling among them only) and ``bad_words`` (a word's last token banned where
    the output ends with its other tokens; a one-token word always): each row only its own restriction, the
    same tokens and logprobs alone as batched, the logprobs the raw ones, and not a raw-argmax request."""
    from engine.worker.sampler import picks_raw_argmax

    logits = randn(5, device=device)
    s = Sampler(V, torch.device(device), seed=0)
    top = logits.argmax(-1).tolist()
    allowed = [3, 9, 40]
    rows = [req("plain", temperature=0.0, logprobs=2),
            req("allowed", temperature=0.0, allowed_token_ids=allowed, logprobs=2),
            req("allowed-random", temperature=1.5, seed=4, allowed_token_ids=allowed),
            req("one-token-word", temperature=0.0, bad_words=["x"], bad_words_token_ids=[[top[3]]]),
            req("two-token-word", temperature=0.0, output=(5, 11), bad_words=["xy"],
                bad_words_token_ids=[[11, top[4]], [12, 13]])]
    out = s.sample(logits, rows)
    assert out.token_ids[0] == top[0]
    assert out.token_ids[1] == allowed[int(logits[1, allowed].argmax())]
    assert all(s.sample(logits[2:3], [rows[2]]).token_ids[0] in allowed for _ in range(20))
    banned = logits[3].clone()
    banned[top[3]] = float("-inf")
    assert out.token_ids[3] == int(banned.argmax()) != top[3]
    assert out.token_ids[4] != top[4]                               # the output ends with 11: its last token banned
    elsewhere = req("two-token-word", temperature=0.0, output=(5, 12), bad_words=["xy"],
                    bad_words_token_ids=[[11, top[4]], [12, 13]])
    assert s.sample(logits[4:5], [elsewhere]).token_ids == [top[4]]  # not after another token
    for i, r in enumerate(rows):
        if r.sampling_params.seed is not None or r.sampling_params.temperature == 0.0:
            alone = s.sample(logits[i:i + 1], [r])
            assert alone.token_ids == [out.token_ids[i]] and alone.logprobs[0] == out.logprobs[i]   # batch invariant
    raw = torch.log_softmax(logits[1].float(), -1)
    assert out.logprobs[1][top[1]].logprob == pytest.approx(float(raw[top[1]]))   # the model's own distribution
    assert not any(picks_raw_argmax(r) for r in rows[1:])
    for bad in ({"allowed_token_ids": []}, {"allowed_token_ids": [-1]}, {"bad_words": [" "]},
                {"bad_words": [3]}, {"bad_words_token_ids": [[]]}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)


def test_bad_words_are_tokenized_as_a_word_and_after_a_space():
    """vLLM's tokenization of ``bad_words``: the word as it is, and after a space when that is another first
    token of the same length (SmolLM2's byte-level BPE: "Paris" and " Paris" differ); leading spaces stripped."""
    from engine.tokenizer import Tokenizer
    from engine.worker.token_restrictions import bad_words_token_ids, banned_next_tokens
    from engine.config import default_model_path

    tok = Tokenizer.from_gguf(default_model_path())
    seqs = bad_words_token_ids(tok, ["  Paris", "New York"])
    assert seqs[0] == tok.encode("Paris") and seqs[1] == tok.encode(" Paris") and seqs[0] != seqs[1]
    assert tok.encode(" New York") in seqs and tok.encode("New York") in seqs
    ny = tok.encode(" New York")
    assert set(banned_next_tokens(seqs, [1, 2] + ny[:-1])) == {ny[-1]} | {s[0] for s in seqs if len(s) == 1}
    assert banned_next_tokens([[4, 5, 6]], [4]) == [] and banned_next_tokens([[4, 5, 6]], [4, 5]) == [6]


@pytest.mark.parametrize("device", DEVICES)
def test_min_tokens_masks_eos_and_stop_token_ids(device):
    logits = torch.full((3, 8), -5.0, device=device)
    logits[:, 7] = 10.0  # EOS
    logits[:, 6] = 9.0  # a stop token id
    logits[:, 2] = 1.0
    s = Sampler(8, torch.device(device), seed=0)
    rows = [
        req("a", eos=7, temperature=0.0, min_tokens=2, stop_token_ids=[6]),                # 0 < 2: masked
        req("b", eos=7, temperature=0.0, min_tokens=2, stop_token_ids=[6], output=(1, 1)),  # reached
        req("c", eos=7, temperature=0.7, min_tokens=3, output=(1,)),                         # EOS masked only
    ]
    for _ in range(20):
        out = s.sample(logits, rows).token_ids
        assert out[0] == 2
        assert out[1] == 7
        assert out[2] != 7
    # ignore_eos: EOS is not a stop, so min_tokens does not mask it.
    assert s.sample(logits[:1], [req("d", eos=7, temperature=0.0, min_tokens=2, ignore_eos=True)]).token_ids == [7]


def _frequencies(logits_row: torch.Tensor, draws: int, **params) -> torch.Tensor:
    s = Sampler(logits_row.shape[-1], torch.device("cpu"), seed=1234)
    rows = [req(f"r{i}", **params) for i in range(draws)]
    tokens = s.sample(logits_row.expand(draws, -1).contiguous(), rows).token_ids
    return torch.bincount(torch.tensor(tokens), minlength=logits_row.shape[-1]).float() / draws


def test_plain_sampling_matches_softmax_distribution():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03])
    freq = _frequencies(probs.log(), 20000)
    assert torch.allclose(freq, probs, atol=0.015), freq
    # temperature 0.5 squares and renormalises
    sharp = probs**2 / (probs**2).sum()
    freq = _frequencies(probs.log(), 20000, temperature=0.5)
    assert torch.allclose(freq, sharp, atol=0.015), freq


@pytest.mark.parametrize("params, kept, token, expected", [
    # top_p 0.7: {0.5, 0.25} reaches 0.75 >= 0.7 -> keep two tokens
    (dict(top_p=0.7), 2, 0, 0.5 / 0.75),
    # top_p 0.8: three tokens (0.9)
    (dict(top_p=0.8), 3, 2, 0.15 / 0.9),
    (dict(top_k=3), 3, 2, 0.15 / 0.9),
    # min_p 0.2: threshold 0.1 -> keep 0.5, 0.25, 0.15
    (dict(min_p=0.2), 3, 0, 0.5 / 0.9),
    # min_p 0.4: threshold 0.2 -> keep two
    (dict(min_p=0.4), 2, 0, 0.5 / 0.75),
])
def test_filters_mask_tail_and_renormalise(params, kept, token, expected):
    probs = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03])
    freq = _frequencies(probs.log(), 20000, **params)
    assert freq[kept:].sum() == 0 and freq[kept - 1] > 0, freq
    assert abs(freq[token] - expected) < 0.02, freq


def test_mixed_batch_each_row_gets_its_own_filter():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03])
    s = Sampler(5, torch.device("cpu"), seed=5)
    kinds = [dict(top_k=1), dict(top_p=0.7), dict(), dict(min_p=0.4), dict(temperature=0.0)]
    seen = [set() for _ in kinds]
    for step in range(400):
        rows = [req(f"{step}-{i}", **k) for i, k in enumerate(kinds)]
        for i, t in enumerate(s.sample(probs.log().expand(5, -1).contiguous(), rows).token_ids):
            seen[i].add(t)
    assert seen[0] == {0}
    assert seen[1] == {0, 1}
    assert seen[2] == {0, 1, 2, 3, 4}
    assert seen[3] == {0, 1}
    assert seen[4] == {0}


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_are_raw_log_softmax(device):
    logits = randn(3, device=device) * 3
    raw = torch.log_softmax(logits.float().cpu(), -1)
    s = Sampler(V, torch.device(device), seed=0)
    rows = [req("a", logprobs=5, temperature=0.0, repetition_penalty=1.5),
            req("b", logprobs=0, temperature=0.3, top_k=3, seed=1),
            req("c", temperature=1.0)]
    out = s.sample(logits, rows)
    assert out.logprobs[2] is None
    for i in (0, 1):
        tok = out.token_ids[i]
        lp = out.logprobs[i]
        assert next(iter(lp)) == tok  # sampled token first
        assert math.isclose(lp[tok].logprob, raw[i, tok].item(), abs_tol=1e-5)
        assert lp[tok].rank == int((raw[i] > raw[i, tok]).sum()) + 1
    # top-5 of row 0: ids and values of the raw distribution, ranks 1..5
    top = raw[0].topk(5)
    entries = out.logprobs[0]
    assert set(top.indices.tolist()) <= set(entries)
    for rank, (v, t) in enumerate(zip(top.values.tolist(), top.indices.tolist()), 1):
        assert math.isclose(entries[t].logprob, v, abs_tol=1e-5)
        assert entries[t].rank == rank
    assert len(out.logprobs[1]) == 1


def test_sampled_logprob_does_not_depend_on_k():
    logits = randn(4) * 2
    results = {}
    for k in (0, 5, 20):
        s = Sampler(V, torch.device("cpu"))
        rows = [req(f"r{i}", seed=11, index=i, logprobs=k, temperature=0.8) for i in range(4)]
        out = s.sample(logits, rows)
        results[k] = [(t, out.logprobs[i][t].logprob, out.logprobs[i][t].rank) for i, t in enumerate(out.token_ids)]
        assert all(len(lp) in (k, k + 1) or k == 0 and len(lp) == 1 for lp in out.logprobs)
    assert results[0] == results[5] == results[20]


def test_prompt_logprobs():
    logits = randn(5) * 2
    raw = torch.log_softmax(logits, -1)
    targets = [3, 9, 0, 63, 17]
    out = prompt_logprobs(logits, targets, 2)
    assert len(out) == 5
    for i, (t, pos) in enumerate(zip(targets, out)):
        assert next(iter(pos)) == t
        assert math.isclose(pos[t].logprob, raw[i, t].item(), abs_tol=1e-5)
        assert pos[t].rank == int((raw[i] > raw[i, t]).sum()) + 1
        top2 = raw[i].topk(2).indices.tolist()
        assert set(top2) <= set(pos) and len(pos) <= 3
    assert [len(p) for p in prompt_logprobs(logits, targets, 0)] == [1] * 5
    assert prompt_logprobs(logits[:0], [], 3) == []
    with pytest.raises(ValueError):
        prompt_logprobs(logits, targets[:2], 1)


def test_shape_errors_and_empty_batch():
    s = Sampler(V, torch.device("cpu"))
    with pytest.raises(ValueError):
        s.sample(randn(2), [req("a")])
    assert s.sample(torch.empty(0, V), []).token_ids == []


def test_top_p_applies_after_top_k():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03])
    # top_k 3 renormalises to [.556, .278, .167]: mass before the third is .833 >= .8 -> two tokens
    # (top_p 0.8 alone keeps three, see test_top_p_masks_tail)
    freq = _frequencies(probs.log(), 20000, top_k=3, top_p=0.8)
    assert freq[2:].sum() == 0
    assert abs(freq[0] - 0.5 / 0.75) < 0.02, freq
