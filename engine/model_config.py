"""The shape of a Llama-family model, read from a HF ``config.json`` or GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.models.registry import GGUF_ARCHITECTURES, HF_ARCHITECTURES

__all__ = ["GGUF_ARCHITECTURES", "HF_ARCHITECTURES", "ModelConfig"]
ROPE_SCALING_TYPES = ("linear", "llama3", "dynamic")
# HF ``hidden_act`` / ``hidden_activation`` names -> ours (``engine.layers.activation``)
HF_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


@dataclass
class ModelConfig:
    """Hyper-parameters of a Llama-family decoder (HF ``LlamaConfig`` names).

    Attributes:
        architecture: HF class name, one of ``HF_ARCHITECTURES``.
        hidden_size, intermediate_size: widths (elements).
        num_hidden_layers, num_attention_heads, num_key_value_heads: counts
            (GQA when ``num_key_value_heads < num_attention_heads``).
        head_dim: elements per attention head.
        vocab_size: rows of the embedding / lm_head.
        max_position_embeddings: the model's context length, tokens.
        rope_theta: RoPE base (Su et al. 2021, "RoFormer").
        rope_scaling: None, ``{"rope_type": "linear", "factor": f}`` or
            ``{"rope_type": "llama3", "factor", "low_freq_factor",
            "high_freq_factor", "original_max_position_embeddings"}``.
        rms_norm_eps: RMSNorm epsilon.
        tie_word_embeddings: lm_head shares the embedding matrix.
        attention_bias: q/k/v projections have a bias (Qwen2).
        hidden_act: the gated MLP's activation, ``engine.layers.activation.ACTIVATIONS``.
        sliding_window: keys a sliding-window layer's query sees (itself
            included), or None; dropped when it covers
            ``max_position_embeddings`` (it can never bind).
        layer_types: per layer "sliding_attention" or "full_attention"
            (None: every layer "sliding_attention" when ``sliding_window``
            is set, else "full_attention").
        attn_logit_softcapping, final_logit_softcapping: Gemma 2's caps
            (``cap * tanh(x / cap)``) on attention scores and on logits, or None.
        query_pre_attn_scalar: attention's softmax scale is its ``** -0.5``
            (Gemma); None: ``head_dim ** -0.5``.
        rope_local_theta: RoPE base of Gemma 3's sliding-window layers (None: ``rope_theta``).
        partial_rotary_factor: the part of each head RoPE turns (Phi-3/Phi-4-mini).
        name: a human name for the model (served model name default).
        bos_token_id, eos_token_id: from the config / GGUF metadata.
    """

    architecture: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    hidden_act: str = "silu"
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    query_pre_attn_scalar: float | None = None
    rope_local_theta: float | None = None
    partial_rotary_factor: float = 1.0
    name: str = ""
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if kind not in ROPE_SCALING_TYPES + ("default",):
                raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: {', '.join(ROPE_SCALING_TYPES)})")
        if self.hidden_act not in HF_ACTIVATIONS.values():
            raise ValueError(f"unsupported activation {self.hidden_act!r} (supported: {sorted(HF_ACTIVATIONS)})")
        if self.sliding_window is not None and self.sliding_window >= self.max_position_embeddings:
            self.sliding_window = None
        if self.layer_types is not None and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(f"partial_rotary_factor {self.partial_rotary_factor} gives no even rotary dimension")

    @property
    def rotary_dim(self) -> int:
        """Elements of each head that RoPE turns (``head_dim`` unless partial)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def is_sliding(self, layer: int) -> bool:
        """Whether layer ``layer`` is a "sliding_attention" layer (its window
        is ``sliding_window``, None when it cannot bind; Gemma 3 gives these
        layers their own RoPE base, ``rope_local_theta``, either way)."""
        if self.layer_types is not None:
            return self.layer_types[layer] == "sliding_attention"
        return self.sliding_window is not None

    @classmethod
    def from_hf_config(cls, cfg: dict, name: str = "") -> "ModelConfig":
        """Build from a parsed ``config.json``.

        Raises:
            ValueError: unknown architecture or a missing key.
        """
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in HF_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r} in config.json (supported: {sorted(HF_ARCHITECTURES)})"
            )
        # transformers' Llama, Qwen3 and Gemma read attention_bias as a bias on o_proj too, mlp_bias as biases
        # on the MLP; the layers here carry q/k/v biases only (Qwen2's, fixed by its architecture)
        for key, where in (("attention_bias", "q/k/v and o_proj"), ("mlp_bias", "gate/up/down_proj")):
            if cfg.get(key):
                raise ValueError(f"config.json {key} = true ({arch}: biases on {where}) is not supported; "
                                 "q/k/v biases are, as Qwen2ForCausalLM has them")
        try:
            heads = cfg["num_attention_heads"]
            hidden = cfg["hidden_size"]
            rope_scaling = cfg.get("rope_scaling")
            rope_theta = cfg.get("rope_theta")
            rope_local_theta = cfg.get("rope_local_base_freq")
            partial = cfg.get("partial_rotary_factor", 1.0)
            rope_params = cfg.get("rope_parameters")  # transformers >= 5 layout
            if isinstance(rope_params, dict) and "full_attention" in rope_params:  # per layer type (Gemma 3)
                local = rope_params.get("sliding_attention") or {}
                if local.get("rope_type", "default") != "default":
                    raise ValueError("RoPE scaling on the sliding-window layers is not supported")
                rope_local_theta = local.get("rope_theta", rope_local_theta)
                rope_params = rope_params["full_attention"]
            if isinstance(rope_params, dict):
                partial = rope_params.get("partial_rotary_factor", partial)
                rope_theta = rope_params.get("rope_theta", rope_theta)
                if rope_params.get("rope_type", "default") != "default":
                    rope_scaling = rope_params
            if rope_scaling is not None and rope_scaling.get("rope_type", rope_scaling.get("type")) == "default":
                rope_scaling = None
            eos = cfg.get("eos_token_id")
            entry = HF_ARCHITECTURES[arch]
            window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
            layer_types = cfg.get("layer_types")
            if window and layer_types is None and "max_window_layers" in cfg:
                raise ValueError("use_sliding_window without layer_types (Qwen's max_window_layers) is not supported")
            if layer_types is None and entry.full_every and window:
                every = cfg.get("sliding_window_pattern", entry.full_every)
                layer_types = ["full_attention" if (i + 1) % every == 0 else "sliding_attention"
                               for i in range(cfg["num_hidden_layers"])]
            act = cfg.get("hidden_activation") or cfg.get("hidden_act", "silu")
            return cls(
                architecture=arch,
                hidden_size=hidden,
                intermediate_size=cfg["intermediate_size"],
                num_hidden_layers=cfg["num_hidden_layers"],
                num_attention_heads=heads,
                num_key_value_heads=cfg.get("num_key_value_heads") or heads,
                head_dim=cfg.get("head_dim") or hidden // heads,
                vocab_size=cfg["vocab_size"],
                max_position_embeddings=cfg.get("max_position_embeddings", 2048),
                rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
                rope_scaling=rope_scaling,
                rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=entry.attention_bias,
                hidden_act=HF_ACTIVATIONS.get(act, act),
                sliding_window=window,
                layer_types=layer_types,
                attn_logit_softcapping=cfg.get("attn_logit_softcapping"),
                final_logit_softcapping=cfg.get("final_logit_softcapping"),
                query_pre_attn_scalar=cfg.get("query_pre_attn_scalar"),
                rope_local_theta=None if rope_local_theta is None else float(rope_local_theta),
                partial_rotary_factor=float(partial),
                name=name,
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_id=eos[0] if isinstance(eos, list) and eos else eos,
            )
        except KeyError as e:
            raise ValueError(f"config.json lacks the key {e.args[0]!r}") from None
