"""SmolLM2 (the embedded GGUF) against transformers reading the same file, float32.

transformers' side is a pure function of the model file, the prompt and the library versions: it is read
from the test-reference cache when made for exactly these (``tests/engine/hf_reference.py``), else computed
live (and stored).
"""

from __future__ import annotations

import re

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
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                         tokenize=False)
    prompt = tokenizer.encode(text)
    ours, our_logits = _greedy(runner, prompt, 20, 16)

    ref_ids, ref_logits = logits_reference(path, prompt, 20, tokenizer.eos_token_id,
                                           lambda: request.getfixturevalue("hf_smollm2"))
    assert ours == ref_ids, (tokenizer.decode(ours), tokenizer.decode(ref_ids))
    assert tokenizer.decode(ours).startswith("The capital of France is Paris.")
    assert len(our_logits) == len(ref_logits) == 20
    for mine, theirs in zip(our_logits, ref_logits):
        torch.testing.assert_close(mine, theirs, atol=1e-3, rtol=0)


def test_smollm2_bfloat16_reads_its_quantized_copies_at_every_step(linear_build):
    """bfloat16 with the C linears (the default on AVX512-BF16 and AVX2 CPUs;
    each build's body, tests/test_cpu_kernels.py's ``linear_build``): every
    step reads the 4-bit copies of the Q4_1 projections and the 8-bit copy of
    the Q8_0 output head, which run integer dots on 8-bit-rounded inputs
    (csrc/quant_int.h, the same bits on both ISAs): the first step's logits
    are their own, within 8 % of the largest logit of the bfloat16 weights'
    ones (30 layers of inputs rounded to 8 bits per block of 32, as llama.cpp
    rounds them: 5.7 % measured), and the README's answer holds ("Paris" or
    "L'Étoile": fp32's first two candidates are 0.08 apart, and each ISA's
    attention rounds its own way)."""
    from kernels import cpu_linear

    assert cpu_linear.integer_copies()  # every build linear_build runs (x86 with AVX2 or AVX-512)
    args = EngineArgs(model=default_model_path(), dtype="bfloat16", device="cpu", block_size=16)
    model, tokenizer, config = load_model(args)
    runner = ModelRunner(args, model, config, torch.device("cpu"), torch.bfloat16, num_blocks=16)
    assert all(len(layer.q4_copy) == 4 for layer in model.layers) and model.lm_head_q8 is not None
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    with_copies, logits = _greedy(runner, prompt, 8, 16)
    assert re.search("Paris|Étoile", tokenizer.decode(with_copies)), tokenizer.decode(with_copies)
    model.lm_head_q8 = None
    for layer in model.layers:
        layer.q4_copy.clear()
    model.choose_kernels()  # the methods and the stack's view, without the copies
    without, logits_without = _greedy(runner, prompt, 1, 16)
    first, first_without = logits[0].float(), logits_without[0].float()
    assert not torch.equal(first, first_without)
    assert (first - first_without).abs().max() <= 0.08 * first_without.abs().max()


def test_smollm2_bfloat16_answers_alike_on_avx2_and_avx512(monkeypatch):
    """The AVX-512 build and the AVX2 one (``-march=x86-64-v3``, run here too) read the GGUF's
    quantized copies with one arithmetic, bit for bit (tests/test_quant_int512.py): greedy decoding
    gives the same tokens. Their logits are not bitwise equal, as each build's attention and RMSNorm
    keep their own bodies (VDPBF16PS dot products on AVX-512): within 8 % of the largest logit."""
    from kernels import cpu_linear
    from kernels.cpu_build import MARCH_ENV

    if cpu_linear.quant_body("native") != "int8-avx512vnni" or cpu_linear.quant_body("x86-64-v3") != "int8-avx2":
        pytest.skip("needs an AVX512-VNNI CPU (it runs both builds)")
    runs = {}
    for march in ("native", "x86-64-v3"):
        monkeypatch.setenv(MARCH_ENV, march)
        args = EngineArgs(model=default_model_path(), dtype="bfloat16", device="cpu", block_size=16)
        model, tokenizer, config = load_model(args)
        runner = ModelRunner(args, model, config, torch.device("cpu"), torch.bfloat16, num_blocks=16)
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
        runs[march] = _greedy(runner, prompt, 12, 16)
    (ids, logits), (ids_v3, logits_v3) = runs["native"], runs["x86-64-v3"]
    assert ids == ids_v3
    for a, b in zip(logits, logits_v3):
        assert (a.float() - b.float()).abs().max() <= 0.08 * b.float().abs().max()
