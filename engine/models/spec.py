"""A decoder architecture's variant flags, and the features a model's layer
stack uses (what an executor such as the C decoder stack must implement to
run it: ``kernels.cpu_decoder.IMPLEMENTED``)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.model_config import ModelConfig


@dataclass(frozen=True)
class ModelSpec:
    """Flags fixed by the architecture (the config's values ride ``ModelConfig``).

    Attributes:
        qk_norm: an RMSNorm over each q and k head before RoPE (Qwen3, Gemma 3).
        gemma_norms: every RMSNorm scales by ``1 + weight`` in float32 (Gemma).
        sandwich_norms: norms after attention and around the MLP too (Gemma 2/3:
            ``post_attention_layernorm`` then ``pre_/post_feedforward_layernorm``).
        embed_scale: embeddings times ``sqrt(hidden_size)`` in the model's dtype (Gemma).
    """

    qk_norm: bool = False
    gemma_norms: bool = False
    sandwich_norms: bool = False
    embed_scale: bool = False


def stack_features(config: ModelConfig, spec: ModelSpec) -> frozenset[str]:
    """Names of the features the decoder layers and final norm use beyond a
    plain Llama layer (RMSNorm pre-norm, SwiGLU, full causal attention,
    one full-width RoPE table). Embedding scaling and final-logit capping
    run outside the layers and are not listed."""
    flags = {
        "qkv_bias": config.attention_bias,
        "qk_norm": spec.qk_norm,
        "gemma_norms": spec.gemma_norms,
        "sandwich_norms": spec.sandwich_norms,
        "gelu_tanh": config.hidden_act == "gelu_tanh",
        "sliding_window": config.sliding_window is not None
        and any(config.is_sliding(i) for i in range(config.num_hidden_layers)),
        "attn_softcap": config.attn_logit_softcapping is not None,
        "partial_rotary": config.rotary_dim != config.head_dim,
        "local_rope": config.rope_local_theta is not None
        and any(config.is_sliding(i) for i in range(config.num_hidden_layers)),
    }
    return frozenset(name for name, used in flags.items() if used)
