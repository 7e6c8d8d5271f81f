"""Rotary position embeddings (Su et al. 2021, "RoFormer"), HF Llama's
rotate-half layout: the inverse frequencies (with ``rope_scaling``) and one
step's inputs to the model's layers."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engine.model_config import ModelConfig


def rope_inv_freq(config: ModelConfig, local: bool = False) -> torch.Tensor:
    """[rotary_dim // 2] float32 inverse frequencies, with ``rope_scaling``
    applied: "linear" (position interpolation, Chen et al. 2023) divides them
    by ``factor``; "llama3" follows Meta's Llama 3.1 reference (and HF's
    ``_compute_llama3_parameters``); "dynamic" (NTK-aware) raises the base
    once for the scaled length ``factor * max_position_embeddings``, as
    vLLM's ``DynamicNTKScalingRotaryEmbedding`` does (transformers instead
    recomputes it from each forward's length, which a KV cache cannot follow).
    ``local``: the sliding-window layers' table of Gemma 3 (base
    ``rope_local_theta``, no scaling)."""
    dim = config.rotary_dim
    theta = config.rope_local_theta if local else config.rope_theta
    rs = None if local else config.rope_scaling
    kind = None if rs is None else rs.get("rope_type", rs.get("type"))
    if kind == "dynamic":
        factor = rs["factor"]
        theta = theta * (factor * factor - (factor - 1)) ** (dim / (dim - 2))
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if kind == "linear":
        inv_freq = inv_freq / rs["factor"]
    elif kind == "llama3":
        factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old_len = rs["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    freq_factors = config.extra.get("rope_freq_factors")  # GGUF rope_freqs.weight
    if freq_factors is not None and not local:
        inv_freq = inv_freq / torch.as_tensor(freq_factors, dtype=torch.float32)
    return inv_freq


def apply_rope(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on [T, heads, head_dim] with cos/sin [T, 1, rotary_dim]; with a
    partial rotary dimension (Phi-3's ``partial_rotary_factor``) only the
    first ``rotary_dim`` elements of each head turn (HF's layout)."""
    rd = cos.shape[-1]
    if rd == qk.shape[-1]:
        return qk * cos + rotate_half(qk) * sin
    rot = qk[..., :rd]
    return torch.cat((rot * cos + rotate_half(rot) * sin, qk[..., rd:]), dim=-1)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[..., d] -> [..., d]: (-x2, x1) for x = (x1, x2), the halves RoPE rotates."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@dataclass
class RopeInputs:
    """One step's rotary-embedding inputs.

    Attributes:
        positions: [num_tokens] int64.
        cos_table, sin_table: [max_positions, rotary_dim] float32 (the C path
            reads them at ``positions``, in float32).
        cos, sin: [num_tokens, 1, rotary_dim] in the model's dtype, gathered for
            the PyTorch path (HF's numerics), or None when no layer needs them.
    """

    positions: torch.Tensor
    cos_table: torch.Tensor
    sin_table: torch.Tensor
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
