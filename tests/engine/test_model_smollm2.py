"""SmolLM2 (the embedded GGUF) against transformers reading the same file, float32.

transformers' side is a pure function of the model file, the prompt and the library versions: it is read
from the test-reference cache when made for exactly these (``tests/engine/hf_reference.py``), else computed
live (and stored).
"""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineArgs, default_model_path
from engine.model_loader import load_model
from engine.worker.model_runner import ModelRunner
from engine.core.request import Request
from engine.sampling_params import SamplingParams
from engine.core.scheduler_output import ScheduledRequest, SchedulerOutput
from tests.engine.hf_reference import logits_reference
from tests.test_cpu_kernels import linear_build  # noqa: F401 (a fixture: the bf16 test runs on each build)


def _greedy(runner: ModelRunner, prompt: list[int], steps: int, block_size: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy decoding through the runner: one prefill, then one token per step."""
    blocks = list(range(runner.num_blocks - 1, 0, -1))  # descending, non-contiguous order of use
    r = Request("r", prompt, SamplingParams(temperature=0.0, max_tokens=steps))
    table: list[int] = []
    logits = []
    nc = 0
    for _ in range(steps):
        while len(table) * block_size < r.num_tokens:
            table.append(blocks.pop(len(blocks) // 2))
        o = runner.execute_model(SchedulerOutput([ScheduledRequest(r, nc, r.num_tokens - nc, list(table), True)]))
        logits.append(o.logits[0])
        nc = r.num_tokens
        r.append_output_token_ids(int(o.logits[0].argmax()))
    return r.output_token_ids, logits


@pytest.mark.slow
def test_smollm2_greedy_matches_transformers(request):
    path = default_model_path()
    args = EngineArgs(model=path, dtype="float32", device="cpu", block_size=16)
    model, tokenizer, config = load_model(args)
    assert (config.num_hidden_layers, config.num_key_value_heads, config.tie_word_embeddings) == (30, 3, True)
    runner = ModelRunner(args, model, config, torch.device("cpu"), torch.float32, num_blocks=16)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    prompt = tokenizer.encode(text)
    ours, our_logits = _greedy(runner, prompt, 20, 16)

    ref_ids, ref_logits = logits_reference(path, prompt, 20, tokenizer.eos_token_id,
                                           lambda: request.getfixturevalue("hf_smollm2"))
    assert ours == ref_ids, (tokenizer.decode(ours), tokenizer.decode(ref_ids))
    assert tokenizer.decode(ours).startswith("The capital of France is Paris.")
    assert len(our_logits) == len(ref_logits) == 20
    for mine, theirs in zip(our_logits, ref_logits):
        torch.testing.assert_close(mine, theirs, atol=1e-3, rtol=0)


def test_smollm2_bfloat16_reads_its_quantized_copies_with_the_same_bits(linear_build):
    """bfloat16 with the C linears (the default on AVX512-BF16 and AVX2 CPUs;
    each build's body, tests/test_cpu_kernels.py's ``linear_build``): decode
    steps read the 4-bit copies of the Q4_1 projections and the 8-bit copy of
    the Q8_0 output head; the greedy tokens and every logit equal those of
    the bfloat16 weights alone, bit for bit, and the README's answer holds
    (its first word stays a top-two candidate on the AVX2 body). On the AVX2
    body the copies run integer dots on 8-bit-rounded inputs (every step,
    csrc/quant_int.h): the first step's logits then are their own, within
    8 % of the largest logit of the bfloat16 weights' ones (30 layers of
    inputs rounded to 8 bits per block of 32, as llama.cpp's AVX2 kernels
    round them: 5.7 % measured)."""
    args = EngineArgs(model=default_model_path(), dtype="bfloat16", device="cpu", block_size=16)
    model, tokenizer, config = load_model(args)
    runner = ModelRunner(args, model, config, torch.device("cpu"), torch.bfloat16, num_blocks=16)
    assert all(len(layer.q4_copy) == 4 for layer in model.layers) and model.lm_head_q8 is not None
    prompt = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]))
    steps = 12 if linear_build == "avx512bf16" else 4  # the README's answer, or a few decode steps (suite time)
    with_copies, logits = _greedy(runner, prompt, steps, 16)
    model.lm_head_q8 = None
    for layer in model.layers:
        layer.q4_copy.clear()
    model.choose_kernels()  # the methods and the stack's view, without the copies
    without, logits_without = _greedy(runner, prompt, steps, 16)
    if linear_build == "avx512bf16":
        assert with_copies == without
        assert all(torch.equal(a, b) for a, b in zip(logits, logits_without))
    else:
        first, first_without = logits[0].float(), logits_without[0].float()
        assert not torch.equal(first, first_without)
        assert (first - first_without).abs().max() <= 0.08 * first_without.abs().max()
    if linear_build == "avx512bf16":
        assert tokenizer.decode(with_copies).startswith("The capital of France is Paris.")
    else:  # fp32's first two candidates are 0.08 apart; other bodies' roundings may swap them (the README's is AVX-512)
        assert tokenizer.encode("The")[0] in logits[0].float().topk(2).indices.tolist()
