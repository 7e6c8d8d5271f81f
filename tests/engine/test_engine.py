"""The offline engine on the real SmolLM2: prefix caching, bad input, CLI."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.tiny_models import save_byte_level_llama

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0, max_tokens=16)


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", kv_cache_memory="128MiB")


def test_prefix_cache_reports_shared_prefix(llm):
    tok = llm.tokenizer
    prefix = tok.encode("The quick brown fox jumps over the lazy dog. " * 20)[:48]
    first = prefix + tok.encode(" Once upon a time")
    second = prefix + tok.encode(" In a galaxy far away")
    out1 = llm.generate(first, GREEDY)[0]
    out2 = llm.generate(second, GREEDY)[0]
    assert out1.num_cached_tokens == 0
    assert out2.num_cached_tokens == 48
    # The cached run equals a run without the cache.
    fresh = LLM(dtype="float32", kv_cache_memory="128MiB", enable_prefix_caching=False)
    assert fresh.generate(second, GREEDY)[0].outputs[0].token_ids == out2.outputs[0].token_ids


def test_prompt_of_exactly_three_full_blocks(llm):
    tok = llm.tokenizer
    ids = tok.encode("Count with me: one, two, three, four, five, six, seven, eight, nine, ten, " * 6)[:48]
    assert len(ids) == 48
    cold = llm.generate(ids, GREEDY)[0]
    warm = llm.generate(ids, GREEDY)[0]
    assert warm.num_cached_tokens == 32  # the last token is always recomputed, so only 2 of 3 blocks
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    assert len(warm.outputs[0].token_ids) > 0


@pytest.mark.parametrize(
    "prompt, params, match",
    [
        ("", GREEDY, "prompt"),
        ("hello " * 9000, GREEDY, "max_model_len"),
        ([10**9], GREEDY, "token ids"),
    ],
)
def test_bad_input_is_rejected_and_engine_keeps_serving(llm, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(prompt, params)
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate("Hello", GREEDY)[0].outputs[0].token_ids


def test_max_tokens_below_one_is_a_value_error():
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)


def test_generate_cli_answers_capital_of_france():
    out = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "generate", "--dtype", "float32", "--max-tokens", "16",
         "--prompt", "What is the capital of France?"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "The capital of France is Paris." in out.stdout


@pytest.mark.parametrize("bad, says", [(["--max-tokens", "0"], "max_tokens must be at least 1"),
                                       (["--model", "/nonexistent.gguf"], "no such file")])
def test_generate_cli_bad_input_is_one_error_line(bad, says):
    out = subprocess.run([sys.executable, "-m", "gateway.cli", "generate", "--prompt", "hi", *bad],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert out.stderr.strip().startswith("error:") and says in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("batch_invariant", [True, False])
def test_a_follow_up_reads_the_cached_answer(tmp_path, batch_invariant):
    """A follow-up prompt that repeats a conversation's answer reads the
    answer's full blocks from the prefix cache, in either mode."""
    llm = LLM(model=save_byte_level_llama(tmp_path), dtype="float32", kv_cache_memory="4MiB", block_size=16,
              batch_invariant=batch_invariant)
    prompt = list(range(40, 60))  # 20 tokens
    answer = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))[0]
    follow_up = prompt + list(answer.outputs[0].token_ids) + [70, 71, 72]
    cached = llm.generate(follow_up, SamplingParams(temperature=0.0, max_tokens=1))[0].num_cached_tokens
    assert cached == 48  # 59 of the 60 tokens were computed: 3 full blocks


def test_default_step_budget_by_device(tmp_path, caplog):
    """Unset, the step's token budget is 512 on CPU (a step's length bounds
    TTFT there), never below max_num_seqs, and at least max_model_len
    without chunked prefill. Set below max_num_seqs, it is logged (it caps how many sequences run at once)."""
    model = save_byte_level_llama(tmp_path)
    budget = lambda **kw: LLM(model=model, dtype="float32", kv_cache_memory="4MiB", **kw).engine.max_num_batched_tokens  # noqa: E731
    assert budget() == 512
    assert budget(max_num_seqs=600) == 600
    caplog.set_level(logging.WARNING, logger="tandem.engine")
    assert budget(max_num_batched_tokens=64, max_num_seqs=64) == 64
    assert "below max_num_seqs" not in caplog.text
    assert budget(max_num_batched_tokens=64) == 64
    assert "max_num_batched_tokens (64) is below max_num_seqs (256): " in caplog.text
    assert "at most 64 sequences run at once" in caplog.text
    assert budget(enable_chunked_prefill=False, max_model_len=256) == 2048
    assert budget(enable_chunked_prefill=False, max_model_len=256, max_num_batched_tokens=256) == 256
    # set below max_model_len with chunked prefill off: refused at start, as vLLM does (a trial's 64-token budget
    # advertised 8192 and refused every longer prompt)
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(64\) is smaller than max_model_len \(256\)"):
        budget(enable_chunked_prefill=False, max_model_len=256, max_num_batched_tokens=64)


def test_vllms_offline_spellings(tmp_path):
    """A vLLM user's offline code runs as written (a trial: use_tqdm, get_tokenizer, prompt dicts and
    cumulative_logprob were missing): the prompt dicts give what the plain prompts give, and cumulative_logprob
    is the sum of the sampled tokens' logprobs."""
    llm = LLM(model=save_byte_level_llama(tmp_path), dtype="float32", kv_cache_memory="4MiB")
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=1)
    ids = llm.get_tokenizer().encode("hello", add_special_tokens=True)
    plain = llm.generate(["hello", ids], params)
    dicts = llm.generate([{"prompt": "hello"}, {"prompt_token_ids": ids, "cache_salt": "t1"}], params,
                         use_tqdm=False)
    assert [o.outputs[0].token_ids for o in dicts] == [o.outputs[0].token_ids for o in plain]
    out = plain[0].outputs[0]
    assert out.cumulative_logprob == sum(pos[t].logprob for t, pos in zip(out.token_ids, out.logprobs))
    assert llm.generate("hello", SamplingParams(max_tokens=2))[0].outputs[0].cumulative_logprob is None
    for bad in ({"prompt": "a", "prompt_token_ids": [1]}, {"text": "a"}, {"prompt": "a", "multi_modal_data": {}}):
        with pytest.raises(ValueError, match="prompt dict"):
            llm.generate(bad, params)
