"""Greedy parity with HF transformers on the embedded SmolLM2 GGUF (float32).

The first 8 MT-Bench turn-1 prompts, through the chat template, in one
batch, 64 new tokens (bitwise equality in bfloat16 across batching, caching,
chunking and preemption is ``test_batch_invariance.py``'s). HF runs each
prompt alone (no padding). Batch composition changes float rounding, so a divergence is accepted only at a
near-tie: the reference's top-2 logit gap < 1e-3 at that step, and only after
every earlier step agreed (the sampled token's logprob within 1e-3 of HF's).
HF's side is a pure function of the model file, the prompts and the library versions: it is read from
tests/data/ when made for exactly these (``tests/engine/hf_reference.py``), else computed live.
"""

from __future__ import annotations

import pytest

from engine.config import default_model_path
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.engine.hf_reference import Reference, conversations, reference

pytestmark = pytest.mark.slow

NUM_PROMPTS = 8
NEW_TOKENS = 64
TIE_GAP = 1e-3
LOGPROB_TOL = 1e-3


@pytest.fixture(scope="module")
def hf_reference(request, smollm2_tokenizer) -> list[Reference]:
    """Per prompt: transformers' greedy tokens with their log-probabilities and top-2 logit gaps
    (tests/data/ holds them for this model, these prompts and these versions; else computed live)."""
    return reference(smollm2_tokenizer, default_model_path(), NUM_PROMPTS, NEW_TOKENS,
                     lambda: request.getfixturevalue("hf_smollm2"))


def _check_parity(refs: list[Reference], outputs) -> int:
    """Assert parity; return how many prompts diverged at an accepted near-tie."""
    near_ties = 0
    for ref, out in zip(refs, outputs):
        assert out.prompt_token_ids == ref.prompt_token_ids
        got, ref_gen = out.outputs[0].token_ids, ref.token_ids
        for step, ref_tok in enumerate(ref_gen):
            if step >= len(got):
                pytest.fail(f"stopped early at step {step}: {got} vs {ref_gen}")
            if got[step] != ref_tok:
                gap = ref.top2_gaps[step]
                assert gap < TIE_GAP, (
                    f"diverged at step {step} (got {got[step]}, reference {ref_tok}) with top-2 gap {gap:.2e}"
                )
                near_ties += 1
                break
            ours = out.outputs[0].logprobs[step][got[step]].logprob
            theirs = ref.logprobs[step]
            assert abs(ours - theirs) < LOGPROB_TOL, f"step {step}: logprob {ours} vs reference {theirs}"
        else:
            assert len(got) == len(ref_gen), "generated past the reference's EOS"
    return near_ties


def _run(num_prompts: int = NUM_PROMPTS, new_tokens: int = NEW_TOKENS, **engine_args):
    llm = LLM(dtype="float32", kv_cache_memory="256MiB", **engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, logprobs=0)
    return llm, llm.chat(conversations(num_prompts), params)


def test_greedy_parity_default(hf_reference):
    _, outputs = _run()
    _check_parity(hf_reference, outputs)


def test_greedy_parity_chunked_prefill(hf_reference):
    _, outputs = _run(enable_chunked_prefill=True, max_num_batched_tokens=32)
    _check_parity(hf_reference, outputs)


def test_greedy_parity_with_preemption_without_prefix_caching(hf_reference):
    # 32 blocks of 16 tokens cannot hold 8 prompts of ~40-120 tokens plus 64 new tokens each.
    llm, outputs = _run(num_gpu_blocks_override=32, enable_prefix_caching=False)
    assert llm.engine.scheduler.num_preemptions > 0
    _check_parity(hf_reference, outputs)


def test_greedy_parity_native_gguf_weights(hf_reference):
    """quantization="gguf": the Q4_1 projections run in 4 bits (float32 scales
    and offsets: kernels/csrc/linear_f32_cpu.c, or PyTorch's int4 matmul
    where it does not build), transformers runs the same file dequantized."""
    llm, outputs = _run(quantization="gguf")
    assert sorted(llm.engine.model_runner.model.layers[0].int4) == ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"]
    _check_parity(hf_reference, outputs)
