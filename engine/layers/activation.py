"""Gated MLP activations over a fused [num_tokens, 2 * intermediate] gate/up
projection (gate first): SwiGLU (Shazeer 2020, Llama's ``silu(gate) * up``)
and GeGLU with tanh-approximated GELU (Gemma's ``gelu_pytorch_tanh``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import cpu_norm_act

ACTIVATIONS = ("silu", "gelu_tanh")


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2 I] -> [T, I]: ``silu(gate) * up`` (bfloat16 on CPU: one C pass, one rounding)."""
    if gate_up.dtype == torch.bfloat16 and gate_up.device.type == "cpu" and cpu_norm_act.available():
        return cpu_norm_act.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2 I] -> [T, I]: ``gelu_tanh(gate) * up`` in the input's dtype (HF Gemma's MLP)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def gated_activation(name: str):
    """The function for an activation name of ``ACTIVATIONS`` (chosen once, at construction).

    Raises:
        ValueError: an unknown name.
    """
    if name == "silu":
        return silu_and_mul
    if name == "gelu_tanh":
        return gelu_tanh_and_mul
    raise ValueError(f"unsupported activation {name!r} (supported: {', '.join(ACTIVATIONS)})")
