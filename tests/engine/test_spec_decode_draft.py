"""Draft-model speculation changes no bit (issue 52, docs/engine/speculative-decoding.md): with a draft model of
another architecture (a tiny random Qwen3 beside a tiny random Llama of the same byte-level vocabulary) and with
SmolLM2 drafting for itself, the output tokens and their logprobs are those of the engine without speculation,
greedy and seeded, alone and batched, with prefix caching, chunked prefill, preemption and ``n > 1``; the draft's
KV lives under the target's block ids, and a draft of another tokenizer is refused."""

from __future__ import annotations

import pytest

from engine.config import default_model_path
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.engine.test_spec_decode import GREEDY, SEEDED, _key, _prompts, speculating
from tests.tiny_models import save_byte_level_llama, save_byte_level_qwen3_draft

pytestmark = pytest.mark.slow

TINY_PROMPTS = ["abcabcabcabcabcabc", "hello hello hello hello", "the cat sat on the mat; the cat sat on",
                "0123456789 0123456789 01234"]
# Seeded rows at low temperatures: the tiny target's draws then often take the draft's guesses (accepted drafts
# past depth 0 are what a draw keyed by the wrong position would change).
TINY_PARAMS = [SamplingParams(temperature=0.0, max_tokens=40, logprobs=1),
               SamplingParams(temperature=0.5, seed=9, max_tokens=40, logprobs=1),
               SamplingParams(n=3, temperature=0.3, seed=4, max_tokens=24, logprobs=1)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(target path, draft path, each prompt's outputs per params without speculation, alone)."""
    root = tmp_path_factory.mktemp("draft")
    (root / "llama").mkdir()
    (root / "qwen3").mkdir()
    target = save_byte_level_llama(root / "llama", printable_only=True)   # peaked: seeded draws take guesses
    draft = save_byte_level_qwen3_draft(root / "qwen3", target)
    plain = LLM(target, dtype="bfloat16", kv_cache_memory="64MiB")
    ref = [[_key(plain.generate(p, params)[0]) for p in TINY_PROMPTS] for params in TINY_PARAMS]
    return target, draft, ref


@pytest.mark.parametrize("name, kwargs", [
    ("plain", {}),
    ("chunked-8", dict(max_num_batched_tokens=8)),                 # prompts in chunks; proposals cut by the budget
    ("preempting", dict(num_gpu_blocks_override=10, max_num_batched_tokens=64)),
    ("k-1", dict(num_speculative_tokens=1)),
])
def test_tiny_draft_of_another_architecture_equal_without_speculation(tiny, one_thread, name, kwargs):
    target, draft, ref = tiny
    k = kwargs.pop("num_speculative_tokens", 4)
    llm = speculating(target, dtype="bfloat16", kv_cache_memory="64MiB", **kwargs,
                      speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": k})
    for expected, params in zip(ref, TINY_PARAMS):
        assert [_key(llm.generate(p, params)[0]) for p in TINY_PROMPTS] == expected, params
        assert [_key(o) for o in llm.generate(TINY_PROMPTS, params)] == expected, f"{params}, batched"
    stats = llm.engine.core.spec_decoder.stats
    assert stats.method == "draft_model"
    assert stats.accepted_per_draft[0] > 0 and sum(stats.accepted_per_draft[1:]) > 0   # rejected and accepted
    if name == "preempting":
        assert llm.engine.core.scheduler.num_preemptions > 0


def test_a_draft_of_a_shorter_context_proposes_only_within_it(tiny, tmp_path, one_thread, caplog):
    """A trial's draft of 128 positions failed the whole step (every request of it a 500) on a 321-token prompt:
    sequences past the draft's context get no proposal, their outputs still the target's, and the start says so."""
    import json
    import shutil

    target, draft, ref = tiny
    short = tmp_path / "short-draft"
    shutil.copytree(draft, short)
    cfg = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 30}))
    llm = speculating(target, dtype="bfloat16", kv_cache_memory="64MiB",
                      speculative_config={"method": "draft_model", "model": str(short), "num_speculative_tokens": 4})
    assert "has a context of 30 tokens" in caplog.text
    for expected, params in zip(ref, TINY_PARAMS):   # prompts of 18-38 tokens, 24-40 generated: past 30
        assert [_key(o) for o in llm.generate(TINY_PROMPTS, params)] == expected, params
    assert llm.engine.core.spec_decoder.stats.num_draft_tokens > 0     # proposed while they fit
    capped = speculating(target, dtype="bfloat16", kv_cache_memory="64MiB", speculative_config={
        "method": "draft_model", "model": draft, "num_speculative_tokens": 4, "max_model_len": 30})
    assert capped.engine.core.spec_decoder.proposer.max_len == 30     # vLLM's cap of the draft's context
    assert [_key(o) for o in capped.generate(TINY_PROMPTS, TINY_PARAMS[0])] == ref[0]


def test_draft_kv_shares_the_block_ids_and_is_counted_in_the_pool(tiny):
    target, draft, _ = tiny
    plain = LLM(target, dtype="bfloat16", kv_cache_memory="64MiB")
    spec = LLM(target, dtype="bfloat16", kv_cache_memory="64MiB",
               speculative_config={"method": "draft_model", "model": draft})
    runner = spec.engine.core.spec_decoder.proposer.runner
    assert runner.kv_pool.shape[2] == spec.engine.core.num_blocks      # one draft block per block id
    assert spec.engine.core.num_blocks < plain.engine.core.num_blocks  # the same bytes hold both models' KV


def test_a_draft_of_another_tokenizer_is_refused(tiny):
    target, _, _ = tiny
    with pytest.raises(ValueError, match="tokenizer"):
        LLM(target, dtype="bfloat16", kv_cache_memory="64MiB",
            speculative_config={"method": "draft_model", "model": default_model_path()})


def test_smollm2_drafting_for_itself_equal_without_speculation():
    base = dict(dtype="bfloat16", kv_cache_memory="192MiB")
    plain = LLM(**base)
    spec = speculating(**base, speculative_config={"method": "draft_model", "model": default_model_path(),
                                                   "num_speculative_tokens": 3})
    prompts = _prompts(plain)[:4]
    for params in (GREEDY, SEEDED):
        ref = [_key(plain.generate(p, params)[0]) for p in prompts]
        assert [_key(o) for o in spec.generate(prompts, params)] == ref
        assert [_key(spec.generate(p, params)[0]) for p in prompts] == ref
    stats = spec.engine.core.spec_decoder.stats
    assert stats.accepted_per_draft[0] > 0 and stats.accepted_per_draft[3] > 0
