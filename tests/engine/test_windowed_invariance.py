"""Sliding-window and soft-capped attention keep the engine's promise (engine/layers/attention.py): a prompt's
tokens, logprobs and prompt logprobs are the same bits alone, batched with others, chunked at another step
budget and served from the prefix cache. A trial found Mistral (window), Gemma 2 (soft-capping) and Gemma 3
(local layers) logprobs moved by up to 0.02 with the batch and the chunk size: a whole chunk went to a
per-sequence einsum once its context passed the window. Tiny random models from transformers configs, windows
of 8 tokens under prompts of 70 (the window binds in every chunk), on the CPU kernels."""

from __future__ import annotations

import random

import pytest

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.engine.test_architectures import _save

pytest.importorskip("transformers")


def _bits(out) -> tuple:
    """Everything a client reads of one request, as exact floats: output tokens, their logprobs, and the
    prompt's logprobs of its own tokens."""
    o = out.outputs[0]
    prompt = [None if lp is None else lp[t].logprob for lp, t in zip(out.prompt_logprobs, out.prompt_token_ids)]
    return tuple(o.token_ids), tuple(lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids)), tuple(prompt)


@pytest.mark.parametrize("kind, dtype", [("mistral_window", "bfloat16"), ("gemma2", "bfloat16"),
                                         ("gemma3", "bfloat16"), ("gemma3", "float32")])
def test_a_windowed_models_bits_are_the_requests_own(tmp_path, kind, dtype):
    _save(tmp_path, kind)
    rng = random.Random(kind)
    prompt = [rng.randrange(3, 97) for _ in range(70)]
    others = [[rng.randrange(3, 97) for _ in range(n)] for n in (5, 23, 41, 66, 90)]
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=1, prompt_logprobs=1, ignore_eos=True)

    def engine(budget: int, **kw) -> LLM:
        return LLM(model=str(tmp_path), dtype=dtype, device="cpu", kv_cache_memory="16MiB",
                   enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=budget, **kw)

    llm = engine(32)
    alone = _bits(llm.generate([prompt], params)[0])
    assert len(alone[0]) == 12
    assert _bits(llm.generate(others[:2] + [prompt] + others[2:], params)[2]) == alone, "batched"
    assert _bits(llm.generate([prompt], params)[0]) == alone, "from the prefix cache"
    del llm
    assert _bits(engine(20).generate([prompt], params)[0]) == alone, "chunked at another budget"
    small = engine(32, num_gpu_blocks_override=12)      # 6 of these requests need 30 blocks: some are preempted
    assert _bits(small.generate(others[:2] + [prompt] + others[2:], params)[2]) == alone, "after preemption"
    assert small.engine.scheduler.num_preemptions > 0
