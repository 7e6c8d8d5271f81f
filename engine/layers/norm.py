"""RMSNorm (Zhang & Sennrich 2019) in the two numerics the supported models use."""

from __future__ import annotations

import torch
from torch import nn

from kernels import cpu_norm_act


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 like HF Llama (``weight * x.to(dtype)``;
    bfloat16 on CPU: one C pass rounded once, ``kernels.cpu_norm_act``).

    Attributes:
        triton_rms_norm: ``kernels.triton_batch_invariant.rms_norm`` (one
            Triton program per row) in batch-invariant mode on CUDA, where
            PyTorch's reduction splits a row's sum by the number of rows;
            else None.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.triton_rms_norm = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.triton_rms_norm is not None:
            return self.triton_rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.shape[-1] % 16 == 0 \
                and self.weight.dtype == torch.bfloat16 and cpu_norm_act.available():
            return cpu_norm_act.rms_norm(x, self.weight, self.eps)  # one C pass, one rounding
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: scales by ``1 + weight`` (the checkpoint stores the
    offset from one), all in float32, rounded once to the input's dtype (HF
    ``Gemma2RMSNorm``/``Gemma3RMSNorm``). PyTorch only: the C stack refuses
    models with it (``kernels.cpu_decoder.IMPLEMENTED``).
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps
        self.triton_rms_norm = None  # no batch-invariant kernel for it: set_batch_invariant leaves it None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)
