"""The architectures llama.cpp defines a GGUF architecture for, from GGUF:
a tiny random transformers model (tests/engine/test_architectures.py's
shapes) written the way ``convert_hf_to_gguf.py`` writes it (its tensor
names from the ``gguf`` package's ``TensorNameMap``, Gemma's norms stored as
``1 + weight``, Phi-3's fused q/k/v and gate/up as ``attn_qkv`` and
``ffn_up``, float32 and float16 tensors), loaded by the engine through the
registry, token-identical to transformers in float32 greedy over 64 tokens
on 8 prompts (logprobs within 1e-4), batched with prefix caching and
chunked prefill on."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.engine.test_architectures import COMMON, _check, _engine_and_references
from tests.tiny_models import tiny_gguf_writer

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")


def _hf_model(kind: str):
    """(transformers model in float32, its GGUF architecture name); Gemma's query scale is head_dim's
    (GGUF has no key for it: llama.cpp takes head_dim but for the 27B models)."""
    t = transformers
    torch.manual_seed(3)
    if kind == "qwen3":
        model = t.Qwen3ForCausalLM(t.Qwen3Config(**COMMON))
    elif kind == "gemma2":
        model = t.Gemma2ForCausalLM(t.Gemma2Config(
            **COMMON, query_pre_attn_scalar=16, sliding_window=8, attn_logit_softcapping=2.0,
            final_logit_softcapping=5.0, layer_types=["sliding_attention", "full_attention"]))
    elif kind == "gemma3":
        model = t.Gemma3ForCausalLM(t.Gemma3TextConfig(
            **COMMON, query_pre_attn_scalar=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 2.0}}))
    else:
        model = t.Phi3ForCausalLM(t.Phi3Config(**COMMON, rope_parameters={
            "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}))
    model.config._attn_implementation = "eager"
    with torch.no_grad():  # random init leaves norms at their identity: make them matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    return model.float().eval()


def _write(path, model, arch: str) -> None:
    """``model`` as convert_hf_to_gguf.py writes it for ``arch`` (metadata, tokenizer, tensors)."""
    c = model.config
    w = tiny_gguf_writer(path, arch, c, ["ab", "cd"])
    rope = c.rope_parameters.get("full_attention", c.rope_parameters)
    w.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    if arch == "phi3":
        w.add_rope_dimension_count(int(c.head_dim * rope["partial_rotary_factor"]))
    if arch.startswith("gemma"):
        w.add_sliding_window(c.sliding_window)
        if arch == "gemma2":  # no pattern key: llama.cpp's period of 2
            w.add_attn_logit_softcapping(c.attn_logit_softcapping)
            w.add_final_logit_softcapping(c.final_logit_softcapping)
        else:
            w.add_sliding_window_pattern([t == "sliding_attention" for t in c.layer_types])
            w.add_rope_freq_base_swa(c.rope_parameters["sliding_attention"]["rope_theta"])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], c.num_hidden_layers)
    for i, (name, t) in enumerate(model.state_dict().items()):
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        a = t.float().numpy()
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            a = a + np.float32(1.0)  # convert_hf_to_gguf.py's Gemma classes: llama.cpp multiplies by the weight
        gname = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gname is not None, name
        # 2-D weights alternately float16 and float32 (the model below sees the float16 rounding)
        w.add_tensor(gname, a.astype(np.float16) if a.ndim == 2 and i % 2 else a)
        if a.ndim == 2 and i % 2:
            t.copy_(torch.from_numpy(a.astype(np.float16).astype(np.float32)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", ["qwen3", "gemma2", "gemma3", "phi3"])
def test_gguf_matches_transformers(tmp_path, arch, one_thread):
    model = _hf_model(arch)
    path = tmp_path / f"{arch}.gguf"
    with torch.no_grad():
        _write(path, model, arch)
    llm, prompts, refs, params = _engine_and_references(path, model, arch)
    for out, ref in zip(llm.generate(prompts, params), refs):
        _check(out, ref)
