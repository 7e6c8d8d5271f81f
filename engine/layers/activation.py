"""Gated MLP activations over a fused [num_tokens, 2 * intermediate] gate/up
projection (gate first): SwiGLU (Shazeer 2020, Llama's ``silu(gate) * up``)
and GeGLU with tanh-approximated GELU (Gemma's ``gelu_pytorch_tanh``).
The kernel is chosen once, for the weights' dtype and device
(:func:`gated_activation`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import cpu_norm_act

ACTIVATIONS = ("silu", "gelu_tanh")


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2 I] -> [T, I]: ``silu(gate) * up`` in PyTorch (rounded after the silu and after the product)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2 I] -> [T, I]: ``gelu_tanh(gate) * up`` in the input's dtype (HF Gemma's MLP)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def gated_activation(name: str, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
    """The function for an activation name of ``ACTIVATIONS`` on tensors of
    ``dtype`` on ``device`` (chosen once: at construction and when the
    layer's weights move): SwiGLU in bfloat16 on CPU is one C pass with one
    rounding (``kernels.cpu_norm_act.silu_mul``), else PyTorch's.

    Raises:
        ValueError: an unknown name.
    """
    if name == "silu":
        if dtype == torch.bfloat16 and torch.device(device).type == "cpu" and cpu_norm_act.available():
            return cpu_norm_act.silu_mul
        return silu_and_mul
    if name == "gelu_tanh":
        return gelu_tanh_and_mul
    raise ValueError(f"unsupported activation {name!r} (supported: {', '.join(ACTIVATIONS)})")
