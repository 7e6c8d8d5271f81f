"""Every registered architecture against transformers: a tiny random model
(2 layers, hidden 64) built from a ``transformers`` config, saved as a HF
directory, loaded through the registry and run by the engine in float32
greedy, 64 new tokens on 8 prompts, token-identical to transformers with
logprobs within 1e-4; each prompt alone and all eight batched, with prefix
caching and chunked prefill on (prompts share prefixes; a 32-token step
budget splits the longer ones). Sliding windows are 8 tokens so they bind.

transformers runs its eager attention over the whole sequences each step (no
cache), the definition the paged engine must reproduce.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine.llm import LLM
from engine.sampling_params import SamplingParams

transformers = pytest.importorskip("transformers")

VOCAB = 97
NEW_TOKENS = 64
NUM_PROMPTS = 8
LOGPROB_TOL = 1e-4
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
              bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.1)


def _hf_model(kind: str, **shape):
    """The transformers model of one case; ``shape`` overrides ``COMMON``'s widths and head counts."""
    t = transformers
    COMMON = {**globals()["COMMON"], **shape}
    if kind == "llama_llama3":
        cfg = t.LlamaConfig(**COMMON, rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                       "original_max_position_embeddings": 32})
        return t.LlamaForCausalLM(cfg)
    if kind == "llama_linear":
        cfg = t.LlamaConfig(**COMMON, tie_word_embeddings=True,
                            rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0})
        return t.LlamaForCausalLM(cfg)
    if kind == "mistral_window":
        return t.MistralForCausalLM(t.MistralConfig(**COMMON, sliding_window=8))
    if kind == "qwen2":
        return t.Qwen2ForCausalLM(t.Qwen2Config(**COMMON))
    if kind == "qwen3":
        return t.Qwen3ForCausalLM(t.Qwen3Config(**COMMON))
    if kind == "gemma2":
        cfg = t.Gemma2Config(**COMMON, query_pre_attn_scalar=32, sliding_window=8, attn_logit_softcapping=2.0,
                             final_logit_softcapping=5.0, layer_types=["sliding_attention", "full_attention"])
        return t.Gemma2ForCausalLM(cfg)
    if kind == "gemma3":
        cfg = t.Gemma3TextConfig(**COMMON, query_pre_attn_scalar=32, sliding_window=8,
                                 layer_types=["sliding_attention", "full_attention"],
                                 rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                  "full_attention": {"rope_type": "linear", "rope_theta": 1e6,
                                                                     "factor": 2.0}})
        return t.Gemma3ForCausalLM(cfg)
    if kind == "phi3":
        cfg = t.Phi3Config(**COMMON, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                      "partial_rotary_factor": 0.5})
        return t.Phi3ForCausalLM(cfg)
    raise AssertionError(kind)


KINDS = ["llama_llama3", "llama_linear", "mistral_window", "qwen3", "gemma2", "gemma3", "phi3"]


def _save(tmp_path, kind: str, **shape):
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(0)
    model = _hf_model(kind, **shape)
    model.config._attn_implementation = "eager"
    with torch.no_grad():  # random init leaves norms at their identity: make them matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    model = model.float().eval()
    model.save_pretrained(tmp_path)
    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    return model


def _prompts(kind: str) -> list[list[int]]:
    """8 prompts of 5-40 tokens; pairs share a prefix of up to 24 tokens (prefix-cache hits)."""
    rng = random.Random(kind)
    prompts = []
    for i in range(NUM_PROMPTS):
        tail = [rng.randrange(3, VOCAB) for _ in range(rng.randrange(5, 17))]
        prompts.append((prompts[-1][:rng.randrange(8, 25)] if i % 2 else []) + tail)
    return prompts


def _reference(model, prompts: list[list[int]], new_tokens: int = NEW_TOKENS) -> list[tuple[list[int], list[float]]]:
    """transformers' greedy continuations and each chosen token's logprob: every step runs the whole
    sequences, right-padded into one batch (causal: a row's logits never see the padding after it)."""
    seqs, logprobs = [list(p) for p in prompts], [[] for _ in prompts]
    with torch.no_grad():
        for _ in range(new_tokens):
            width = max(map(len, seqs))
            logits = model(torch.tensor([s + [0] * (width - len(s)) for s in seqs])).logits.float()
            for i, s in enumerate(seqs):
                row = logits[i, len(s) - 1]
                tok = int(row.argmax())
                logprobs[i].append(float(torch.log_softmax(row, -1)[tok]))
                s.append(tok)
    return [(s[len(p):], lp) for s, p, lp in zip(seqs, prompts, logprobs)]


def _check(out, ref) -> None:
    tokens, logprobs = ref
    got = out.outputs[0].token_ids
    assert got == tokens
    for step, (tok, lp) in enumerate(zip(got, logprobs)):
        assert abs(out.outputs[0].logprobs[step][tok].logprob - lp) < LOGPROB_TOL, step


def _engine_and_references(path, hf, kind: str):
    """The engine on the model at ``path`` as every case runs it (float32 on
    CPU, prefix caching and chunked prefill on, 32-token steps), checked to
    run ``hf``'s class or the Llama one; with ``kind``'s prompts,
    transformers' greedy continuations of them (``hf``) and the sampling
    parameters that compare the two: (llm, prompts, references, params)."""
    llm = LLM(model=str(path), dtype="float32", device="cpu", kv_cache_memory="16MiB",
              enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=32)
    model = llm.engine.model_runner.model
    assert type(model).__name__ == type(hf).__name__ or type(model).__name__ == "LlamaForCausalLM"
    prompts = _prompts(kind)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=0, ignore_eos=True)
    return llm, prompts, _reference(hf, prompts), params


@pytest.mark.parametrize("kind", KINDS)
def test_matches_transformers_alone_and_batched(tmp_path, kind, one_thread):
    llm, prompts, refs, params = _engine_and_references(tmp_path, _save(tmp_path, kind), kind)
    for prompt, ref in zip(prompts, refs):
        _check(llm.generate([prompt], params)[0], ref)
    for out, ref in zip(llm.generate(prompts, params), refs):
        _check(out, ref)


# The layer features each case uses that decoder_cpu.c lacks: the C stack refuses them (per-op path).
C_REFUSED = {"llama_llama3": set(), "llama_linear": set(), "mistral_window": {"sliding_window"},
             "qwen3": {"qk_norm"}, "phi3": {"partial_rotary"},
             "gemma2": {"gemma_norms", "sandwich_norms", "gelu_tanh", "sliding_window", "attn_softcap"},
             "gemma3": {"qk_norm", "gemma_norms", "sandwich_norms", "gelu_tanh", "sliding_window", "local_rope"}}


@pytest.mark.parametrize("kind", KINDS)
def test_bfloat16_c_stack_or_refusal_and_batch_invariance(tmp_path, kind, one_thread):
    """bfloat16 on CPU: the C decoder stack runs exactly the architectures whose layer features it
    implements (``kernels.cpu_decoder.IMPLEMENTED``) and the per-op path the rest; either way a prompt's
    tokens and logprobs are the same bits alone and batched."""
    from kernels import cpu_attention, cpu_norm_act

    if not cpu_norm_act.available() or cpu_attention.available() is not None:
        pytest.skip("the C kernels do not build here")
    _save(tmp_path, kind)
    llm = LLM(model=str(tmp_path), dtype="bfloat16", device="cpu", kv_cache_memory="16MiB",
              enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=32)
    model = llm.engine.model_runner.model
    assert model.c_stack_refusal == C_REFUSED[kind]
    prompts = _prompts(kind)
    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=0, ignore_eos=True)
    alone = llm.generate([prompts[3]], params)[0].outputs[0]
    assert (model._c_decoder is not None) == (not C_REFUSED[kind])
    batched = llm.generate(prompts, params)[3].outputs[0]
    assert batched.token_ids == alone.token_ids
    assert [lp[t].logprob for lp, t in zip(batched.logprobs, batched.token_ids)] == \
        [lp[t].logprob for lp, t in zip(alone.logprobs, alone.token_ids)]


def test_c_stack_refuses_a_feature_it_does_not_implement(monkeypatch):
    """A layer feature missing from ``IMPLEMENTED`` keeps the model off the C stack (here: q/k/v biases,
    as if the stack had not implemented them), so a new flag never runs through C silently ignored."""
    from engine.model_config import ModelConfig
    from engine.models.llama import LlamaForCausalLM
    from kernels import cpu_decoder, get_attention_backend

    config = ModelConfig(architecture="Qwen2ForCausalLM", hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=VOCAB,
                         max_position_embeddings=64, attention_bias=True)
    backend = get_attention_backend("auto", "cpu", dtype=torch.bfloat16, heads=(4, 2, 16))
    assert LlamaForCausalLM(config, backend).c_stack_refusal == set()
    monkeypatch.setattr(cpu_decoder, "IMPLEMENTED", frozenset())
    model = LlamaForCausalLM(config, backend).to(torch.bfloat16)
    assert model.c_stack_refusal == {"qkv_bias"}
    caches = [(torch.zeros(4, 16, 2, 16, dtype=torch.bfloat16), torch.zeros(4, 16, 2, 16, dtype=torch.bfloat16))]
    assert model._c_decoder_weights(caches) is None


def test_hub_style_configs():
    """config.json as released on the Hub (before transformers 5 wrote ``layer_types`` and
    ``rope_parameters``): Gemma 2's alternating layers, Gemma 3's 5:1 pattern with a local RoPE base and
    global-only scaling, Qwen2's disabled window; unsupported scaling is refused, not ignored."""
    from engine.model_config import ModelConfig
    from engine.models.rope import rope_inv_freq

    shape = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, max_position_embeddings=8192)
    g2 = ModelConfig.from_hf_config({**shape, "architectures": ["Gemma2ForCausalLM"], "sliding_window": 4096,
                                     "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 144})
    assert [g2.is_sliding(i) for i in range(6)] == [True, False] * 3 and g2.hidden_act == "gelu_tanh"
    g3 = ModelConfig.from_hf_config({**shape, "architectures": ["Gemma3ForCausalLM"], "sliding_window": 512,
                                     "sliding_window_pattern": 6, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
                                     "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    assert [g3.is_sliding(i) for i in range(6)] == [True] * 5 + [False]
    torch.testing.assert_close(rope_inv_freq(g3, local=True), 1.0 / 1e4 ** (torch.arange(0, 16, 2) / 16))
    torch.testing.assert_close(rope_inv_freq(g3), 1.0 / 1e6 ** (torch.arange(0, 16, 2) / 16) / 8.0)
    qwen = ModelConfig.from_hf_config({**shape, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 4096,
                                       "use_sliding_window": False})
    assert qwen.sliding_window is None and qwen.attention_bias
    with pytest.raises(ValueError, match="longrope"):
        ModelConfig.from_hf_config({**shape, "architectures": ["Phi3ForCausalLM"],
                                    "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8}})
    with pytest.raises(ValueError, match="unsupported architecture"):
        ModelConfig.from_hf_config({**shape, "architectures": ["Gemma3ForConditionalGeneration"]})
    # transformers reads these as biases on o_proj / the MLP too: refused naming the key (a trial's Llama with
    # attention_bias failed on "unexpected weight ...o_proj.bias"), false or absent taken
    for arch in ("LlamaForCausalLM", "Qwen3ForCausalLM", "Gemma2ForCausalLM"):
        for key in ("attention_bias", "mlp_bias"):
            with pytest.raises(ValueError, match=rf"config.json {key} = true \({arch}: biases on"):
                ModelConfig.from_hf_config({**shape, "architectures": [arch], key: True})
            assert not ModelConfig.from_hf_config({**shape, "architectures": [arch], key: False}).attention_bias


def test_dynamic_rope_scaling_raises_the_base_once():
    """``dynamic`` NTK scaling: one base for the scaled length ``factor * max_position_embeddings``
    (vLLM's ``DynamicNTKScalingRotaryEmbedding``), the same table for every position."""
    from engine.model_config import ModelConfig
    from engine.models.rope import rope_inv_freq

    cfg = ModelConfig.from_hf_config({"architectures": ["LlamaForCausalLM"], "hidden_size": 64,
                                      "intermediate_size": 96, "num_hidden_layers": 1, "num_attention_heads": 4,
                                      "vocab_size": VOCAB, "max_position_embeddings": 64,
                                      "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})
    base = 10000.0 * (2.0 * 2.0 - 1.0) ** (16 / 14)
    torch.testing.assert_close(rope_inv_freq(cfg), 1.0 / base ** (torch.arange(0, 16, 2) / 16))
