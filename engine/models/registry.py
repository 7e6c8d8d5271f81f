"""Which model class runs each architecture: HF ``config.json``
``architectures`` names and GGUF ``general.architecture`` values.

Adding an architecture: its model file (the spec of its variant flags over
``engine/models/llama.py``'s decoder and ``engine/layers``), one line here
(two where llama.cpp defines its GGUF architecture), and its test case in
``tests/engine/test_architectures.py`` (and ``test_architectures_gguf.py``). Imports nothing
heavy: the class is imported when a model is built (:func:`model_class`).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Architecture:
    """One HF architecture name's model class and its config defaults.

    Attributes:
        model: ``"module:Class"`` of the model.
        attention_bias: whether q/k/v carry a bias when config.json does not say.
        full_every: layers where ``(i + 1) % full_every == 0`` use global
            attention, the others the sliding window, when config.json has no
            ``layer_types`` (Gemma 2: 2, Gemma 3: its ``sliding_window_pattern``
            or 6); None: every layer alike.
    """

    model: str
    attention_bias: bool = False
    full_every: int | None = None


HF_ARCHITECTURES = {
    "LlamaForCausalLM": Architecture("engine.models.llama:LlamaForCausalLM"),
    "MistralForCausalLM": Architecture("engine.models.llama:LlamaForCausalLM"),
    "Qwen2ForCausalLM": Architecture("engine.models.llama:LlamaForCausalLM", attention_bias=True),
    "Qwen3ForCausalLM": Architecture("engine.models.qwen3:Qwen3ForCausalLM"),
    "Gemma2ForCausalLM": Architecture("engine.models.gemma:Gemma2ForCausalLM", full_every=2),
    "Gemma3ForCausalLM": Architecture("engine.models.gemma:Gemma3ForCausalLM", full_every=6),
    "Phi3ForCausalLM": Architecture("engine.models.llama:LlamaForCausalLM"),
}


@dataclass(frozen=True)
class GGUFArchitecture:
    """How one llama.cpp GGUF ``general.architecture`` maps onto an HF architecture
    (``convert_hf_to_gguf.py``'s model class for it, read backwards).

    Attributes:
        hf: the HF architecture name (``HF_ARCHITECTURES``) the file loads as.
        tensors: GGUF layer tensor -> HF module, where the architecture differs
            from ``engine.model_loader.gguf_loader.LAYER_NAMES``.
        permuted_qk: attn_q/attn_k rows are in llama.cpp's interleaved RoPE order (llama).
        norm_offset: subtracted from every norm weight (llama.cpp stores Gemma's
            ``1 + weight``; exact in float32 for weights in [-0.5, 1]).
        hidden_act: the MLP's activation (GGUF does not say).
        full_every: as ``Architecture.full_every``, when the file gives no
            ``attention.sliding_window_pattern`` (llama.cpp's own default).
    """

    hf: str
    tensors: tuple[tuple[str, str], ...] = ()
    permuted_qk: bool = False
    norm_offset: float = 0.0
    hidden_act: str = "silu"
    full_every: int | None = None


_GEMMA_TENSORS = (("post_attention_norm", "post_attention_layernorm"), ("ffn_norm", "pre_feedforward_layernorm"),
                  ("post_ffw_norm", "post_feedforward_layernorm"))
GGUF_ARCHITECTURES = {
    "llama": GGUFArchitecture("LlamaForCausalLM", permuted_qk=True),
    "qwen2": GGUFArchitecture("Qwen2ForCausalLM"),
    "qwen3": GGUFArchitecture("Qwen3ForCausalLM"),
    "gemma2": GGUFArchitecture("Gemma2ForCausalLM", _GEMMA_TENSORS, norm_offset=1.0, hidden_act="gelu_tanh",
                               full_every=2),
    "gemma3": GGUFArchitecture("Gemma3ForCausalLM", _GEMMA_TENSORS, norm_offset=1.0, hidden_act="gelu_tanh",
                               full_every=6),
    "phi3": GGUFArchitecture("Phi3ForCausalLM", (("attn_qkv", "self_attn.qkv_proj"), ("ffn_up", "mlp.gate_up_proj"))),
}


def model_class(architecture: str) -> type:
    """The model class of an HF architecture name (imported now).

    Raises:
        ValueError: an architecture not in ``HF_ARCHITECTURES``.
    """
    entry = HF_ARCHITECTURES.get(architecture)
    if entry is None:
        raise ValueError(f"unsupported architecture {architecture!r} (supported: {sorted(HF_ARCHITECTURES)})")
    module, name = entry.model.split(":")
    return getattr(importlib.import_module(module), name)
