"""Speculative decoding changes no bit (issue 52, docs/speculative-decoding.md): with prompt lookup on, every
logits row the sampler sees at an output position is bitwise the row the engine without it sees there, and the
output tokens and their logprobs are identical, greedy and seeded, alone and batched, with prefix caching, chunked
prefill, preemption, ``n > 1`` and stop strings; on SmolLM2 and on a tiny random Llama."""

from __future__ import annotations

import json

import pytest

from engine.llm import LLM
from engine.metrics import EngineMetrics
from engine.sampling_params import SamplingParams
from tests.tiny_models import save_byte_level_llama
from loadtests.workloads import MT_BENCH_PATH

pytestmark = pytest.mark.slow

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
BASE = dict(dtype="bfloat16", kv_cache_memory="192MiB")
GREEDY = SamplingParams(temperature=0.0, max_tokens=48, logprobs=2)
SEEDED = SamplingParams(temperature=0.8, top_p=0.95, seed=1234, max_tokens=48, logprobs=2)
PASSAGE = ("Alice was beginning to get very tired of sitting by her sister on the bank, and of having nothing to do: "
           "once or twice she had peeped into the book her sister was reading, but it had no pictures or "
           "conversations in it, 'and what is the use of a book,' thought Alice 'without pictures or conversations?'")


def _prompts(llm: LLM) -> list[list[int]]:
    """Prompts that invite copying (the speculation's case) and MT-Bench questions (little to copy)."""
    lines = MT_BENCH_PATH.read_text().splitlines()
    asks = [f"Repeat this text exactly:\n{PASSAGE}", f"Rewrite this text in the present tense:\n{PASSAGE}",
            "Count from 1 to 40, separated by commas."] + [json.loads(line)["turns"][0] for line in lines[:2]]
    tok = llm.tokenizer
    return [tok.apply_chat_template([{"role": "user", "content": a}], add_generation_prompt=True) for a in asks]


def _key(out) -> list[tuple]:
    """Every choice's token ids and their top logprobs, exactly."""
    return [(tuple(c.token_ids), tuple(tuple(sorted((k, v.logprob) for k, v in lp.items())) for lp in c.logprobs),
             c.text, c.finish_reason) for c in out.outputs]


def speculating(*args, **kwargs) -> LLM:
    """An engine with speculation that proposes the most tokens it can at every step (its cost model pinned:
    the proposals then do not depend on the box's timing, and every verify path is taken)."""
    llm = LLM(*args, **kwargs)
    llm.engine.core.spec_decoder.cost.threshold = lambda rows: 0.0
    return llm


@pytest.fixture(scope="module")
def plain():
    return LLM(**BASE)


@pytest.fixture(scope="module")
def spec():
    return speculating(**BASE, speculative_config=SPEC)


@pytest.fixture(scope="module")
def reference(plain):
    """Each prompt alone on the engine without speculation, greedy and seeded."""
    prompts = _prompts(plain)
    return prompts, {name: [_key(plain.generate(p, params)[0]) for p in prompts]
                     for name, params in (("greedy", GREEDY), ("seeded", SEEDED))}


def _record_rows(llm: LLM) -> dict:
    """Wrap the engine's sampler: (sequence id, output position) -> the logits row sampled there."""
    sampler = llm.engine.core.sampler
    seen: dict = {}
    original = sampler.sample

    def sample(logits, requests, grammar_bitmask=None):
        for row, r in zip(logits, requests):
            seen.setdefault((r.request_id, r.num_output_tokens), row.clone())
        return original(logits, requests, grammar_bitmask=grammar_bitmask)

    sampler.sample = sample
    return seen


def test_prompt_lookup_takes_the_earliest_match_of_the_longest_suffix_as_vllm():
    """vLLM's rule: the longest n first, then its earliest occurrence (a trial's repeating output got one token a
    step at k = 4 from the latest match, one period back)."""
    from engine.spec_decode.ngram_proposer import NgramProposer

    p = NgramProposer(2, 4)
    assert p.lookup([5, 7] + [9] * 10, 4) == [9, 9, 9, 9]
    assert p.lookup([1, 2, 3] * 5, 4) == [1, 2, 3, 1]
    # the 3-gram (4, 5, 6) matches at 0 and the 2-gram (5, 6) later: the longest wins
    assert p.lookup([4, 5, 6, 7, 8, 5, 6, 1, 4, 5, 6], 2) == [7, 8]
    assert p.lookup([1, 2, 3, 4], 3) == [] and p.lookup([1, 2, 1, 2], 0) == []


def test_verify_rows_equal_decode_rows_bitwise(reference):
    """The logits of depth j of a (k+1)-token verify pass are bitwise those of a one-token decode step at that
    output position (the precondition of everything else)."""
    prompts = reference[0]
    rows = {}
    for name, kwargs in (("plain", {}), ("spec", {"speculative_config": SPEC})):
        llm = (speculating if kwargs else LLM)(**BASE, **kwargs)
        seen = _record_rows(llm)
        for p in prompts[:3]:
            llm.generate(p, GREEDY)
        rows[name] = seen
    plain_rows = {pos: row for (_, pos), row in rows["plain"].items()}
    assert llm.engine.core.spec_decoder.stats.num_accepted_tokens > 0
    compared = 0
    for (rid, pos), row in rows["spec"].items():
        ref = rows["plain"].get((rid, pos))
        if ref is not None:
            assert row.shape == ref.shape and bool((row == ref).all()), f"{rid} position {pos}"
            compared += 1
    assert compared >= len(plain_rows) // 2


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_alone_and_batched_equal_without_speculation(reference, spec, kind):
    prompts, ref = reference
    params = GREEDY if kind == "greedy" else SEEDED
    before = spec.engine.core.spec_decoder.stats.num_accepted_tokens
    assert [_key(spec.generate(p, params)[0]) for p in prompts] == ref[kind]
    assert [_key(o) for o in spec.generate(prompts, params)] == ref[kind]
    stats = spec.engine.core.get_stats()
    assert stats.spec_num_accepted_tokens > before   # proposals were accepted, and counted (vllm:spec_decode_*)
    assert stats.spec_num_draft_tokens >= stats.spec_num_accepted_tokens == sum(stats.spec_num_accepted_tokens_per_pos)


def test_calls_without_proposals_run_several_decode_steps(plain, spec, reference, monkeypatch):
    """Greedy without logprobs: a call where no sequence got a proposal runs several decode steps
    (``engine/core/multi_step.py``; a trial: with speculation on, every call ran one, and the engine was slower
    than without it), one with proposals runs one; the outputs are the engine's without speculation."""
    prompts = reference[0]
    params = SamplingParams(temperature=0.0, max_tokens=48)
    core, calls = spec.engine.core, []
    schedule = core._schedule
    monkeypatch.setattr(core, "_schedule", lambda: calls.append(schedule()) or calls[-1])
    key = [[(tuple(c.token_ids), c.text, c.finish_reason) for c in o.outputs] for o in plain.generate(prompts, params)]
    for batch in (prompts, *([p] for p in prompts)):
        assert [[(tuple(c.token_ids), c.text, c.finish_reason) for c in o.outputs]
                for o in spec.generate(batch, params)] == (key if len(batch) > 1 else [key[prompts.index(batch[0])]])
    several = [s for s in calls if s.num_steps > 1]
    assert several and not any(e.spec_token_ids for s in several for e in s.scheduled)
    assert any(e.spec_token_ids for s in calls for e in s.scheduled)


@pytest.mark.parametrize("name, kwargs", [
    ("chunked-24", dict(max_num_batched_tokens=24)),                  # budgets cut proposals too
    ("no-prefix-cache", dict(enable_prefix_caching=False)),
    ("preempting", dict(num_gpu_blocks_override=22, max_num_batched_tokens=64)),
    ("k-1", dict(speculative_config={**SPEC, "num_speculative_tokens": 1})),
])
def test_chunked_cached_preempted_equal_without_speculation(reference, name, kwargs):
    prompts, ref = reference
    llm = speculating(**{**BASE, "speculative_config": SPEC, **kwargs})
    for kind, params in (("greedy", GREEDY), ("seeded", SEEDED)):
        assert [_key(o) for o in llm.generate(prompts, params)] == ref[kind], kind
        assert [_key(o) for o in llm.generate(prompts, params)] == ref[kind], f"{kind}, prefix cached"
    if name == "preempting":
        assert llm.engine.core.scheduler.num_preemptions > 0


def test_n_stop_strings_penalties_restrictions_equal_without_speculation(plain, spec, reference):
    prompts = reference[0]
    cases = [SamplingParams(n=3, temperature=0.9, seed=5, max_tokens=40, logprobs=1),
             SamplingParams(temperature=0.0, max_tokens=60, stop=["pictures or"], logprobs=0),
             SamplingParams(temperature=0.7, seed=3, max_tokens=40, repetition_penalty=1.1,
                            frequency_penalty=0.2, min_tokens=20, logprobs=0)]
    # vLLM's token restrictions: the bad words are two of the greedy answer's own (so they bite), the allowed ids
    # a range; each depth's restriction sees the drafts before it as output
    words = plain.generate(prompts[0], GREEDY)[0].outputs[0].text.split()[2:4]
    banned = SamplingParams(temperature=0.0, max_tokens=GREEDY.max_tokens, bad_words=words, logprobs=0)
    assert _key(plain.generate(prompts[0], banned)[0]) != _key(plain.generate(prompts[0], GREEDY)[0])
    cases += [banned, SamplingParams(temperature=0.8, seed=9, max_tokens=30, allowed_token_ids=list(range(100, 3000)),
                                        logprobs=0)]
    for params in cases:
        assert [_key(o) for o in spec.generate(prompts, params)] == [_key(o) for o in plain.generate(prompts, params)]


def test_tiny_random_model_equal_without_speculation(tmp_path, one_thread, caplog):
    path = save_byte_level_llama(tmp_path)
    plain = LLM(path, dtype="bfloat16", kv_cache_memory="64MiB")
    with caplog.at_level("INFO", logger="tandem.engine"):
        spec = speculating(path, dtype="bfloat16", kv_cache_memory="64MiB", speculative_config=SPEC)
    ready = [r.getMessage() for r in caplog.records if r.getMessage().startswith("engine ready")]
    assert len(ready) == 1 and f"speculative=ngram k={SPEC['num_speculative_tokens']}" in ready[0]  # said at start
    prompts = ["abcabcabcabcabcabc", "hello hello hello hello", "the cat sat on the mat; the cat sat on"]
    for params in (SamplingParams(temperature=0.0, max_tokens=40, logprobs=1),
                   SamplingParams(temperature=1.0, seed=9, max_tokens=40, logprobs=1)):
        assert [_key(o) for o in spec.generate(prompts, params)] == [_key(o) for o in plain.generate(prompts, params)]
    assert spec.engine.core.spec_decoder.stats.num_draft_tokens > 0


def test_metrics_name_the_method_and_give_the_acceptance_histogram(spec, reference):
    """/metrics: vLLM's spec_decode counters with the proposer as label ``method``, and the histogram of
    verified drafts by accepted tokens (``le`` 0..k, cumulative)."""
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry, generate_latest

    spec.generate(reference[0][:2], GREEDY)
    registry = CollectorRegistry()
    EngineMetrics(registry, SimpleNamespace(get_stats=spec.engine.core.get_stats, args=spec.engine.args), "m")
    text = generate_latest(registry).decode()
    stats = spec.engine.core.get_stats()
    assert f'vllm:spec_decode_num_drafts_total{{method="ngram",model_name="m"}} {float(stats.spec_num_drafts)}' in text
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{method="ngram",model_name="m",position="3"}' in text
    hist = stats.spec_accepted_per_draft
    assert len(hist) == SPEC["num_speculative_tokens"] + 1 and sum(hist) == stats.spec_num_drafts
    assert (f'tandem_spec_decode_accepted_tokens_per_draft_bucket{{le="1",method="ngram",model_name="m"}} '
            f'{float(hist[0] + hist[1])}') in text
    assert (f'tandem_spec_decode_accepted_tokens_per_draft_count{{method="ngram",model_name="m"}} '
            f'{float(sum(hist))}') in text
