"""Model parity: our loader + ModelRunner over a paged KV cache vs transformers (float32).

Tiny random models saved to a temporary HF directory, driven by hand-built
SchedulerOutputs: a prompt prefilled in two chunks next to another request,
then decodes, over shuffled non-contiguous block ids.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine.config import EngineArgs
from engine.model_loader import load_model
from engine.worker.model_runner import ModelRunner
from engine.core.request import Request
from engine.sampling_params import SamplingParams
from engine.core.scheduler_output import ScheduledRequest, SchedulerOutput

transformers = pytest.importorskip("transformers")

BLOCK = 4


def _save_tiny(tmp_path, kind: str):
    torch.manual_seed(0)
    common = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=128, rms_norm_eps=1e-5,
                  bos_token_id=1, eos_token_id=2)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**common, num_key_value_heads=4, rope_theta=10000.0, tie_word_embeddings=False)
        model = transformers.LlamaForCausalLM(cfg)
    elif kind == "llama_gqa_tied_llama3":
        cfg = transformers.LlamaConfig(**common, num_key_value_heads=2, tie_word_embeddings=True,
                                       rope_theta=500000.0,
                                       rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
        model = transformers.LlamaForCausalLM(cfg)
    elif kind == "qwen2":
        cfg = transformers.Qwen2Config(**common, num_key_value_heads=2, tie_word_embeddings=False)
        model = transformers.Qwen2ForCausalLM(cfg)
        with torch.no_grad():  # random init leaves biases at 0: make them matter
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    elif kind == "mistral":
        cfg = transformers.MistralConfig(**common, num_key_value_heads=2, sliding_window=None)
        model = transformers.MistralForCausalLM(cfg)
    else:
        raise AssertionError(kind)
    model = model.float().eval()
    model.save_pretrained(tmp_path)
    _write_tokenizer(tmp_path)
    return model


def _write_tokenizer(path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(97)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))


def _ref_logits(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("kind", ["llama", "llama_gqa_tied_llama3", "qwen2", "mistral"])
def test_runner_matches_transformers(tmp_path, kind):
    hf_model = _save_tiny(tmp_path, kind)
    args = EngineArgs(model=str(tmp_path), dtype="float32", device="cpu", block_size=BLOCK)
    model, tokenizer, config = load_model(args)
    assert config.architecture == type(hf_model).__name__
    runner = ModelRunner(args, model, config, torch.device("cpu"), torch.float32, num_blocks=40)

    rng = random.Random(kind)
    free = list(range(1, 40))
    rng.shuffle(free)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    a = Request("a", [rng.randrange(3, 97) for _ in range(11)], params)
    b = Request("b", [rng.randrange(3, 97) for _ in range(6)], SamplingParams(temperature=0.0, prompt_logprobs=1))
    tables = {"a": [free.pop() for _ in range(6)], "b": [free.pop() for _ in range(6)]}

    def step(entries):
        out = SchedulerOutput(scheduled=[ScheduledRequest(r, nc, nn, tables[r.request_id], s) for r, nc, nn, s in entries],
                              num_batched_tokens=sum(e[2] for e in entries))
        return runner.execute_model(out)

    # Step 1: a's first chunk (7 tokens, no sample) + b's whole prompt (sample, prompt logits).
    o = step([(a, 0, 7, False), (b, 0, 6, True)])
    assert o.sample_indices == [1] and o.logits.shape == (1, 97) and o.logits.dtype == torch.float32
    ref_b = _ref_logits(hf_model, b.prompt_token_ids)
    torch.testing.assert_close(o.logits[0], ref_b[-1], atol=1e-4, rtol=0)
    torch.testing.assert_close(o.prompt_logits["b"], ref_b, atol=1e-4, rtol=0)
    b.append_output_token_ids(int(o.logits[0].argmax()))
    # Step 2: a's second chunk (4 tokens, sample) + b's decode.
    o = step([(b, 6, 1, True), (a, 7, 4, True)])
    assert o.sample_indices == [0, 1] and o.prompt_logits == {}
    torch.testing.assert_close(o.logits[1], _ref_logits(hf_model, a.all_token_ids)[-1], atol=1e-4, rtol=0)
    torch.testing.assert_close(o.logits[0], _ref_logits(hf_model, b.all_token_ids)[-1], atol=1e-4, rtol=0)
    a.append_output_token_ids(int(o.logits[1].argmax()))
    b.append_output_token_ids(int(o.logits[0].argmax()))
    # Decodes: each feeds exactly one new token.
    for _ in range(8):
        o = step([(a, a.num_tokens - 1, 1, True), (b, b.num_tokens - 1, 1, True)])
        for row, r in enumerate((a, b)):
            torch.testing.assert_close(o.logits[row], _ref_logits(hf_model, r.all_token_ids)[-1], atol=1e-4, rtol=0)
            r.append_output_token_ids(int(o.logits[row].argmax()))


def test_swap_and_copy_on_write(tmp_path):
    """Swapping blocks out and back in, and copy-on-write, keep the cache valid."""
    hf_model = _save_tiny(tmp_path, "llama")
    args = EngineArgs(model=str(tmp_path), dtype="float32", device="cpu", block_size=BLOCK)
    model, _, config = load_model(args)
    runner = ModelRunner(args, model, config, torch.device("cpu"), torch.float32, num_blocks=12, num_cpu_blocks=8)
    r = Request("r", list(range(5, 15)), SamplingParams(temperature=0.0))
    table = [7, 3, 9]
    runner.execute_model(SchedulerOutput([ScheduledRequest(r, 0, 10, table, False)], 10))
    before = runner.kv_pool[:, :, table].clone()
    # Swap out to CPU blocks 5, 0, 2; clobber the device blocks; swap back into 1, 2, 4.
    runner.execute_model(SchedulerOutput(blocks_to_swap_out=[(7, 5), (3, 0), (9, 2)]))
    runner.kv_pool[:, :, table] = 0
    runner.execute_model(SchedulerOutput(blocks_to_swap_in=[(5, 1), (0, 2), (2, 4)]))
    table = [1, 2, 4]
    torch.testing.assert_close(runner.kv_pool[:, :, table], before, atol=0, rtol=0)
    # Fork: a sibling shares the first two blocks, and copy-on-writes the partly-filled third into block 6.
    sib = Request("s", list(r.prompt_token_ids), SamplingParams(temperature=0.0))
    o = runner.execute_model(SchedulerOutput(
        [ScheduledRequest(r, 9, 1, table, True), ScheduledRequest(sib, 9, 1, [1, 2, 6], True)], 2,
        blocks_to_copy=[(4, 6)]))
    ref = _ref_logits(hf_model, r.prompt_token_ids)[-1]
    torch.testing.assert_close(o.logits[0], ref, atol=1e-4, rtol=0)
    torch.testing.assert_close(o.logits[1], ref, atol=1e-4, rtol=0)


def test_determine_num_blocks(tmp_path):
    _save_tiny(tmp_path, "llama")
    args = EngineArgs(model=str(tmp_path), dtype="float32", device="cpu", block_size=16, kv_cache_memory="1MiB",
                      swap_space=0.001)
    _, _, config = load_model(args)
    per_block = 2 * 2 * 16 * 4 * 16 * 4
    n, n_cpu = ModelRunner.determine_num_blocks(args, config, torch.device("cpu"), torch.float32)
    assert n == 2**20 // per_block
    assert n_cpu == int(0.001 * 2**30) // per_block
    args.kv_cache_memory = 2**60
    with pytest.raises(MemoryError, match="kv_cache_memory"):
        ModelRunner.determine_num_blocks(args, config, torch.device("cpu"), torch.float32)
    args.kv_cache_memory = 100
    with pytest.raises(ValueError, match="at least 2"):
        ModelRunner.determine_num_blocks(args, config, torch.device("cpu"), torch.float32)
    args.kv_cache_memory, args.swap_space = 2**20, 2**30
    with pytest.raises(MemoryError, match="swap_space"):
        ModelRunner.determine_num_blocks(args, config, torch.device("cpu"), torch.float32)


def test_bfloat16_close_to_transformers(tmp_path):
    """The bf16 path runs and stays close to transformers in bf16 (rounding differs, so loosely)."""
    hf_model = _save_tiny(tmp_path, "llama_gqa_tied_llama3").to(torch.bfloat16)
    args = EngineArgs(model=str(tmp_path), dtype="bfloat16", device="cpu", block_size=BLOCK)
    model, _, config = load_model(args)
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    runner = ModelRunner(args, model, config, torch.device("cpu"), torch.bfloat16, num_blocks=8)
    assert runner.kv_pool.dtype == torch.bfloat16
    ids = [5, 9, 33, 71, 2, 40, 11, 8, 90]
    r = Request("r", ids, SamplingParams(temperature=0.0))
    o = runner.execute_model(SchedulerOutput([ScheduledRequest(r, 0, len(ids), [6, 2, 4], True)], len(ids)))
    assert o.logits.dtype == torch.float32
    ref = _ref_logits(hf_model, ids)[-1]
    torch.testing.assert_close(o.logits[0], ref, atol=0.1, rtol=0.05)


def test_rope_scaling_linear():
    from engine.model_config import ModelConfig
    from engine.models.rope import rope_inv_freq

    base = dict(architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                num_attention_heads=4, vocab_size=10)
    plain = rope_inv_freq(ModelConfig.from_hf_config(base))
    linear = rope_inv_freq(ModelConfig.from_hf_config({**base, "rope_scaling": {"type": "linear", "factor": 4.0}}))
    torch.testing.assert_close(linear, plain / 4)
    with pytest.raises(ValueError, match="yarn"):
        ModelConfig.from_hf_config({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
