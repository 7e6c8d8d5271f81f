"""The shape of a Llama-family model, read from a HF ``config.json`` or GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass, field

# HF ``architectures[0]`` -> whether q/k/v projections carry a bias.
HF_ARCHITECTURES = {
    "LlamaForCausalLM": False,
    "MistralForCausalLM": False,
    "Qwen2ForCausalLM": True,
}
# GGUF ``general.architecture`` -> the HF architecture it corresponds to.
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


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
            if kind not in ("linear", "llama3", "default"):
                raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: linear, llama3)")

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
        try:
            heads = cfg["num_attention_heads"]
            hidden = cfg["hidden_size"]
            rope_scaling = cfg.get("rope_scaling")
            rope_theta = cfg.get("rope_theta")
            rope_params = cfg.get("rope_parameters")  # transformers >= 5 layout
            if isinstance(rope_params, dict):
                rope_theta = rope_params.get("rope_theta", rope_theta)
                if rope_params.get("rope_type", "default") != "default":
                    rope_scaling = rope_params
            if rope_scaling is not None and rope_scaling.get("rope_type", rope_scaling.get("type")) == "default":
                rope_scaling = None
            eos = cfg.get("eos_token_id")
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
                attention_bias=bool(cfg.get("attention_bias", HF_ARCHITECTURES[arch])),
                name=name,
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_id=eos[0] if isinstance(eos, list) and eos else eos,
            )
        except KeyError as e:
            raise ValueError(f"config.json lacks the key {e.args[0]!r}") from None
