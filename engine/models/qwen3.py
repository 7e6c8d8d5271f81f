"""Qwen3 (Qwen team 2025): the Llama decoder with an RMSNorm over each q and
k head before RoPE (HF ``modeling_qwen3.py``) and no q/k/v bias."""

from __future__ import annotations

from engine.models.llama import LlamaForCausalLM
from engine.models.spec import ModelSpec


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 dense models (its sliding window, off in released configs, rides the config)."""

    spec = ModelSpec(qk_norm=True)
