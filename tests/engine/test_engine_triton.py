"""End to end, the Triton attention path (in Triton's interpreter on CPU) gives
the same greedy tokens as the PyTorch path and as HF transformers, on a tiny
random Llama with grouped-query attention, through the whole engine
(scheduler, chunked prefill mixed with decodes, paged KV cache)."""

from __future__ import annotations

import os

import pytest
import torch

from engine.llm import LLM
from kernels import triton_batch_invariant
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="needs CUDA or Triton's interpreter (set by tests/conftest.py before triton is imported)",
)

PROMPTS = [[5, 17, 33, 8, 91, 4, 60, 22, 71, 13, 40, 3, 77, 9, 50, 66, 31, 12, 88],  # 19 tokens: > 1 block
           [44, 19, 7],
           [3, 25, 81, 57, 14, 93, 28, 36, 11]]
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    path = tmp_path_factory.mktemp("tiny_llama")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg).float().eval()
    model.save_pretrained(path)
    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(97)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    reference = []
    for ids in PROMPTS:
        with torch.inference_mode():
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                                 pad_token_id=0)
        reference.append(out[0, len(ids):].tolist())
    return str(path), reference


def _generate(model_dir: str, backend: str) -> list[list[int]]:
    llm = LLM(model=model_dir, dtype="float32", device="cpu" if backend == "torch" or not torch.cuda.is_available()
              else "cuda", attention_backend=backend, block_size=16, max_num_batched_tokens=12,
              kv_cache_memory="4MiB")
    assert llm.engine.model_runner.model.layers[0].backend.name == backend
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


def test_triton_and_torch_paths_agree_with_transformers(tiny_model_dir):
    model_dir, reference = tiny_model_dir
    torch_tokens = _generate(model_dir, "torch")
    triton_tokens = _generate(model_dir, "triton")
    assert torch_tokens == reference
    assert triton_tokens == reference


def test_triton_batch_invariant_linears_give_a_prompt_the_same_tokens_and_logprobs_alone_and_batched(tiny_model_dir):
    """On the Triton path (CUDA, or its interpreter here) batch-invariant mode
    runs the linears and RMSNorms through kernels/triton_batch_invariant.py;
    a prompt's greedy tokens and logprobs are the same alone and batched."""
    model_dir, reference = tiny_model_dir
    llm = LLM(model=model_dir, dtype="float32", device="cuda" if torch.cuda.is_available() else "cpu",
              attention_backend="triton", block_size=16, max_num_batched_tokens=12, kv_cache_memory="4MiB")
    model = llm.engine.model_runner.model
    assert model.layers[0].packed.triton_linear is triton_batch_invariant.linear is model.packed.triton_linear
    assert model.norm.triton_rms_norm is triton_batch_invariant.rms_norm
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2)
    alone = llm.generate([PROMPTS[0]], params)[0].outputs[0]
    batched = llm.generate(PROMPTS, params)[0].outputs[0]
    assert alone.token_ids == batched.token_ids == reference[0]
    assert [{t: lp.logprob for t, lp in pos.items()} for pos in alone.logprobs] == \
        [{t: lp.logprob for t, lp in pos.items()} for pos in batched.logprobs]
