"""Which model class runs each architecture: HF ``config.json``
``architectures`` names and GGUF ``general.architecture`` values.

Adding an architecture: its model file (the spec of its variant flags over
``engine/models/llama.py``'s decoder and ``engine/layers``), one line here,
and its test in ``tests/engine/test_architectures.py``. Imports nothing
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
# GGUF ``general.architecture`` -> the HF architecture it corresponds to.
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


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
