"""The offline ``LLM`` as a script ported from vLLM (``from vllm import LLM, SamplingParams``) meets it: a trial
(2026-12) found engine settings ignored offline that the OpenAI server enforces, and arguments refused or read
otherwise than vLLM reads them. On the real SmolLM2 (``LLM()``: the embedded default)."""

from __future__ import annotations

import pytest

from engine.llm import LLM
from engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=4)
MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def llm():
    return LLM(max_logprobs=2, max_model_len=MAX_MODEL_LEN, kv_cache_memory="64MiB")


@pytest.mark.parametrize("field, kind", [("logprobs", "sample"), ("prompt_logprobs", "prompt")])
def test_max_logprobs_caps_offline_requests_as_the_server_does(llm, field, kind):
    """``LLM(max_logprobs=2)`` was ignored offline: ``logprobs=5`` returned 5 per token (vLLM: ValueError)."""
    with pytest.raises(ValueError, match=f"Requested {kind} logprobs of 5, which is greater than max allowed: 2"):
        llm.generate("Hello", SamplingParams(max_tokens=2, **{field: 5}))
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate("Hello there, world", SamplingParams(max_tokens=2, **{field: 2}))[0]
    lps = out.outputs[0].logprobs if field == "logprobs" else out.prompt_logprobs[1:]
    assert lps and all(len(pos) >= 2 for pos in lps)


def test_logprobs_of_minus_one_are_the_whole_vocabulary_where_max_logprobs_allows(llm):
    """vLLM's ``logprobs=-1`` (every token) with ``max_logprobs=-1``: SamplingParams refused it (0-20), and the
    engine refused any ``max_logprobs`` past 20. Under a cap, -1 counts as the vocabulary (vLLM's words)."""
    vocab = llm.get_tokenizer().vocab_size
    with pytest.raises(ValueError, match=f"Requested sample logprobs of {vocab}, which is greater than max allowed: 2"):
        llm.generate("Hello", SamplingParams(max_tokens=2, logprobs=-1))
    whole = LLM(max_logprobs=-1, max_model_len=MAX_MODEL_LEN, kv_cache_memory="64MiB")
    out = whole.generate("Hello there", SamplingParams(temperature=0, max_tokens=2, logprobs=-1,
                                                       prompt_logprobs=-1))[0]
    greedy = llm.generate("Hello there", SamplingParams(temperature=0, max_tokens=2, logprobs=1))[0]
    positions = out.outputs[0].logprobs
    assert [len(p) for p in positions] == [vocab, vocab] and len(out.prompt_logprobs[1]) == vocab
    assert out.outputs[0].token_ids == greedy.outputs[0].token_ids
    for step, (p, g) in enumerate(zip(positions, greedy.outputs[0].logprobs)):
        token = out.outputs[0].token_ids[step]
        assert p[token].logprob == g[token].logprob and p[token].rank == 1
        assert sorted(q.rank for q in p.values()) == list(range(1, vocab + 1))
    with pytest.raises(ValueError, match="logprobs must be an integer >= 0, or -1"):
        SamplingParams(logprobs=-2)


def test_priority_needs_priority_scheduling_and_one_per_prompt(llm):
    """A non-zero priority under fcfs was silently ignored offline (vLLM and the server refuse it), and
    ``priority=[1]`` for two prompts was a bare IndexError."""
    with pytest.raises(ValueError, match="priority: got 1, but Priority scheduling is not enabled"):
        llm.generate(["Hello"], GREEDY, priority=[1])
    with pytest.raises(ValueError, match=r"The lengths of prompts \(2\) and priority \(1\) must be the same"):
        llm.generate(["Hello", "Hi"], GREEDY, priority=[0])
    assert not llm.engine.has_unfinished_requests()
    assert len(llm.generate(["Hello", "Hi"], GREEDY, priority=[0, 0])) == 2


def test_logit_bias_past_the_vocabulary_is_refused_offline(llm):
    """``logit_bias={10**6: 5}`` was accepted offline (the server answers 400; vLLM V1 raises ValueError)."""
    vocab = llm.get_tokenizer().vocab_size
    with pytest.raises(ValueError, match=rf"logit_bias: 1000000 is not a token id of this model .*\[0, {vocab}\)"):
        llm.generate("Hello", SamplingParams(max_tokens=2, logit_bias={10**6: 5}))
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate("Hello", SamplingParams(max_tokens=2, logit_bias={vocab - 1: 5}))[0].outputs[0].token_ids


def test_a_completion_past_max_model_len_stops_there_for_length(llm):
    """``prompt + max_tokens > max_model_len`` failed the whole offline batch ("This model's maximum context
    length is ..."); vLLM's engine only needs the prompt to fit and stops the completion at ``max_model_len``
    (its OpenAI server, as ours, still refuses such a request). The batch's other prompt is served as asked."""
    long_ask = SamplingParams(temperature=0, max_tokens=MAX_MODEL_LEN, ignore_eos=True)
    capped, short = llm.generate(["Hello there, world", "Hi"], [long_ask, GREEDY])
    assert len(capped.prompt_token_ids) + len(capped.outputs[0].token_ids) == MAX_MODEL_LEN
    assert capped.outputs[0].finish_reason == "length" and capped.finished
    assert len(short.outputs[0].token_ids) == 4
    with pytest.raises(ValueError, match="maximum context length"):     # the prompt itself must leave room
        llm.generate([0] * MAX_MODEL_LEN, GREEDY)


def test_token_ids_are_integers_of_any_kind_and_never_a_text(llm):
    """``{"prompt_token_ids": "Hello"}`` was silently run as a text, and a numpy array of ids was refused with a
    misleading "must be integers in [0, V)"; the template's ids (``tokenize=True``) go in as vLLM's do."""
    import numpy as np

    ids = llm.get_tokenizer().apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=True)
    want = llm.generate({"prompt_token_ids": ids}, GREEDY)[0]
    for given in (np.array(ids), np.array(ids, dtype=np.int32), tuple(ids)):
        out = llm.generate({"prompt_token_ids": given}, GREEDY)[0]
        assert out.prompt_token_ids == ids and out.outputs[0].token_ids == want.outputs[0].token_ids
        assert all(type(t) is int for t in out.prompt_token_ids)
    assert llm.generate(np.array(ids), GREEDY)[0].outputs[0].token_ids == want.outputs[0].token_ids
    with pytest.raises(TypeError, match="prompt_token_ids: must be a list of token ids .* got str"):
        llm.generate({"prompt_token_ids": "Hello"}, GREEDY)
    with pytest.raises(TypeError, match=r"prompt_token_ids\[1\]: must be an integer token id, got bool"):
        llm.generate({"prompt_token_ids": [1, True]}, GREEDY)
    assert not llm.engine.has_unfinished_requests()


def test_vllm_arguments_that_change_nothing_are_said_where_the_script_sees_them():
    """``gpu_memory_utilization``, ``enforce_eager``, ``trust_remote_code`` were noted at INFO, unseen by a script
    that configures no logging (the docs say "logged, never ignored"): said as warnings, as "max_model_len capped"
    is, on stderr through logging's last-resort handler; importing the engine configures no logging."""
    import subprocess
    import sys

    script = ("import logging; from engine.llm import LLM; assert not logging.getLogger().handlers; "
              "LLM(gpu_memory_utilization=0.5, enforce_eager=True, trust_remote_code=True, kv_cache_memory='64MiB')")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    for said in ("gpu_memory_utilization=0.5 changes nothing on CPU", "--enforce-eager: accepted",
                 "--trust-remote-code: accepted"):
        assert said in run.stderr, run.stderr


def test_constructor_values_vllm_takes():
    """vLLM's ``dtype="half"``/``"float"``/``torch.bfloat16``, ``quantization=None``, ``tokenizer_revision``,
    ``task``/``runner`` naming what this engine serves were refused (ValueError, TypeError); what it cannot serve
    (``task="classify"``, ``skip_tokenizer_init=True``, ``enable_lora=True``) is a one-line ValueError saying so."""
    import torch

    from engine.config import EngineArgs
    from engine.entrypoints.vllm_flags import split_vllm_kwargs

    for given, want in (("half", "float16"), ("float", "float32"), (torch.bfloat16, "bfloat16"),
                        (torch.float16, "float16"), (torch.float32, "float32"), ("auto", "auto")):
        assert EngineArgs(dtype=given).dtype == want
    assert EngineArgs(quantization=None).quantization == "none"
    kept, notes = split_vllm_kwargs({"tokenizer_revision": "main", "code_revision": "v1", "task": "embed",
                                     "runner": "pooling", "enable_lora": False, "skip_tokenizer_init": False,
                                     "dtype": "half"})
    assert kept == {"dtype": "half"} and len(notes) == 3 and all("changes nothing" in n for n in notes)
    for bad, named in (({"task": "classify"}, "--task classify: not supported"),
                       ({"runner": "draft"}, "--runner draft: not supported"),
                       ({"skip_tokenizer_init": True}, "--skip-tokenizer-init: not supported"),
                       ({"enable_lora": True}, "--enable-lora: not supported")):
        with pytest.raises(ValueError, match=named):
            split_vllm_kwargs(bad)
    llm = LLM(dtype=torch.float32, quantization=None, task="generate", runner="auto", tokenizer_revision="main",
              kv_cache_memory="64MiB")
    assert llm.engine.dtype == torch.float32
    assert llm.generate("Hi", GREEDY)[0].outputs[0].token_ids


def test_embed_takes_vllms_pooling_params(llm):
    """``llm.embed(prompts, PoolingParams(normalize=False))`` failed: the second positional argument was this
    engine's ``pooling_type``. vLLM's signature now: one ``PoolingParams`` or one per prompt (None fields: the
    model's own), ``truncate_prompt_tokens``; ``dimensions`` is vLLM's ValueError for a non-matryoshka model."""
    import math

    from engine.pooling import PoolingParams

    prompts = ["Hello there, world", "Hi"]
    unit = [o.outputs.embedding for o in llm.embed(prompts)]
    raw = [o.outputs.embedding for o in llm.embed(prompts, PoolingParams(normalize=False))]
    for u, r in zip(unit, raw):
        norm = math.sqrt(sum(x * x for x in r))
        assert norm != pytest.approx(1.0) and [x / norm for x in r] == pytest.approx(u, abs=1e-6)
    mixed = llm.embed(prompts, [PoolingParams(normalize=False), PoolingParams()], use_tqdm=False)
    assert [o.outputs.embedding for o in mixed] == [raw[0], unit[1]]
    assert llm.embed(prompts, pooling_type="LAST", normalize=False)[0].outputs.embedding == raw[0]
    cut = llm.embed(prompts[:1], truncate_prompt_tokens=2)[0]
    assert cut.prompt_token_ids == llm.get_tokenizer().encode(prompts[0], add_special_tokens=True)[-2:]
    with pytest.raises(ValueError, match=r'dimensions: Model "SmolLM2-135M-Instruct" does not support matryoshka'):
        llm.embed(prompts, PoolingParams(dimensions=64))
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        llm.embed(prompts, truncate_prompt_tokens=MAX_MODEL_LEN + 1)
    with pytest.raises(ValueError, match=r"pooling_params: give one for all prompts or one per prompt \(2\), got 1"):
        llm.embed(prompts, [PoolingParams()])


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                                   "repetition_penalty"])
def test_a_number_given_as_text_is_said_to_be_no_number(field):
    """``SamplingParams(temperature="0.5")`` said "must be >= 0", as if the value were out of range."""
    with pytest.raises(ValueError, match=f"^{field} must be a number, got str '0.5'$"):
        SamplingParams(**{field: "0.5"})


@pytest.mark.parametrize("field,value,said", [("tensor_parallel_size", "2", "an integer"),
                                              ("max_num_seqs", True, "an integer"),
                                              ("gpu_memory_utilization", "0.5", "a number")])
def test_an_engine_argument_of_another_type_is_named(field, value, said):
    """``LLM(tensor_parallel_size="2")`` (an engine trial) met ``'>=' not supported between 'str' and 'int'``."""
    from engine.config import EngineArgs

    with pytest.raises(ValueError, match=f"^{field} must be {said}, got {value!r}$"):
        EngineArgs(**{field: value})


def test_outputs_and_names_as_vllm_has_them(llm):
    """vLLM's ``CompletionOutput.finished()`` is a method (a property here made a script's call a TypeError),
    ``llm.chat(...)[0].prompt`` the rendered conversation (None here), ``llm.llm_engine`` the engine."""
    conv = [{"role": "user", "content": "What is the capital of France?"}]
    out = llm.chat(conv, GREEDY)[0]
    assert out.outputs[0].finished() is True
    assert out.prompt == llm.get_tokenizer().apply_chat_template(conv, tokenize=False)
    assert out.prompt.endswith("<|im_start|>assistant\n")
    assert llm.llm_engine is llm.engine


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(llm):
    """vLLM's ``SamplingParams(truncate_prompt_tokens=N)`` (a trial's ported script: a TypeError here): the
    prompt's last N tokens, bitwise the answer to those tokens alone; -1 keeps what fits; 0, -2 or a string refused
    by ``SamplingParams`` itself, as vLLM's refuses them (an engine trial: taken until ``generate``), more than
    ``max_model_len`` as the OpenAI server refuses it."""
    text = "The quick brown fox jumps over the lazy dog near the river bank"
    ids = llm.get_tokenizer().encode(text, add_special_tokens=True)
    cut = llm.generate(text, SamplingParams(temperature=0, max_tokens=6, truncate_prompt_tokens=5, logprobs=1))[0]
    alone = llm.generate({"prompt_token_ids": ids[-5:]}, SamplingParams(temperature=0, max_tokens=6, logprobs=1))[0]
    assert cut.prompt_token_ids == ids[-5:] and cut.outputs[0].token_ids == alone.outputs[0].token_ids
    assert cut.outputs[0].logprobs == alone.outputs[0].logprobs
    long = llm.generate({"prompt_token_ids": [ids[0]] * (MAX_MODEL_LEN + 40)},
                        SamplingParams(temperature=0, max_tokens=1, truncate_prompt_tokens=MAX_MODEL_LEN - 1))[0]
    assert len(long.prompt_token_ids) == MAX_MODEL_LEN - 1
    with pytest.raises(ValueError, match="is greater than max_model_len"):
        llm.generate(text, SamplingParams(max_tokens=1, truncate_prompt_tokens=MAX_MODEL_LEN + 1))
    for keep in (0, -2, "5"):
        with pytest.raises(ValueError, match=r"truncate_prompt_tokens must be an integer >= 1, or -1 .*got"):
            SamplingParams(max_tokens=1, truncate_prompt_tokens=keep)
    with pytest.raises(ValueError, match=r"seed must be an integer in \[-2\*\*63, 2\*\*64 - 1\]"):
        SamplingParams(seed=2 ** 64)           # the server's range (an engine trial: taken offline)
    assert not llm.engine.has_unfinished_requests()
