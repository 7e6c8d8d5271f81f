"""bfloat16 RMSNorm and SwiGLU activation in C (``csrc/norm_act_cpu.c``).

One pass per row instead of PyTorch's eight (RMSNorm: float, pow, mean, add,
rsqrt, mul, cast, mul) or two (silu, mul) elementwise kernels with float32
temporaries, and one rounding to bfloat16 per output instead of two (more
accurate); each row is computed alone, so batch-invariant. Used by the
model (``engine.models.llama``) for bfloat16 on CPU when the C library
builds; float32 stays on PyTorch (the parity tests compare it with
transformers).
"""

from __future__ import annotations

import functools

import torch

from kernels.cpu_build import load_library, rows_2d, why_unavailable


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """Whether the C library builds and loads here."""
    return why_unavailable() is None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, march: str | None = None) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich 2019): ``bf16(weight * x / sqrt(mean(x^2) + eps))``,
    float32 throughout, one rounding (HF Llama rounds ``x / rms`` to bfloat16
    before the weight multiplies it, a second rounding error).

    Args:
        x: [..., hidden] bfloat16 (hidden a multiple of 16); weight: [hidden] bfloat16.

    Returns:
        [..., hidden] bfloat16. ``march`` picks the build
        (:func:`kernels.cpu_build.load_library`; tests run the portable one).

    Raises:
        ValueError: other dtypes or shapes.
    """
    n = x.shape[-1]
    if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16 or weight.shape != (n,) or n % 16:
        raise ValueError(f"rms_norm takes bfloat16 [..., n] (n % 16 == 0) and weight [n], got {x.dtype} "
                         f"{tuple(x.shape)} and {weight.dtype} {tuple(weight.shape)}")
    x2 = rows_2d(x)
    y = torch.empty((x2.shape[0], n), dtype=torch.bfloat16)
    w = weight.detach().contiguous()
    load_library(march).rms_norm_bf16(x2.data_ptr(), x2.stride(0), w.data_ptr(), y.data_ptr(), n, x2.shape[0], n,
                                 eps, torch.get_num_threads())
    return y.view(x.shape)


def silu_mul(gate_up: torch.Tensor, march: str | None = None) -> torch.Tensor:
    """SwiGLU's ``silu(gate) * up`` (Shazeer 2020) for ``gate_up = [gate | up]``.

    Args:
        gate_up: [..., 2 * intermediate] bfloat16.

    Returns:
        [..., intermediate] bfloat16 (float32 inside, one rounding); ``march``
        as in :func:`rms_norm`.

    Raises:
        ValueError: another dtype or an odd width.
    """
    if gate_up.dtype != torch.bfloat16 or gate_up.shape[-1] % 2:
        raise ValueError(f"silu_mul takes bfloat16 [..., 2 * n], got {gate_up.dtype} {tuple(gate_up.shape)}")
    inter = gate_up.shape[-1] // 2
    g2 = rows_2d(gate_up)
    y = torch.empty((g2.shape[0], inter), dtype=torch.bfloat16)
    load_library(march).silu_mul_bf16(g2.data_ptr(), g2.stride(0), y.data_ptr(), inter, g2.shape[0], inter,
                                 torch.get_num_threads())
    return y.view(*gate_up.shape[:-1], inter)
