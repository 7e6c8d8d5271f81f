"""RMSNorm (Zhang & Sennrich 2019) in the two numerics the supported models use.

Each norm chooses its kernel once (vLLM's ``CustomOp`` idea): at construction
and again whenever its weight moves to another dtype or device (``.to()``,
``.bfloat16()``, ``.to_empty()``: ``nn.Module._apply``) or batch-invariant
mode installs a Triton kernel (:meth:`RMSNorm.use_triton`); ``forward`` calls
the chosen one.
"""

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
            else None (:meth:`use_triton`).
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.triton_rms_norm = None
        self._choose()

    def _choose(self) -> None:
        """Bind ``forward`` to the kernel for the weight's dtype and device."""
        w = self.weight
        if self.triton_rms_norm is not None:
            self._kernel = self._triton
        elif w.dtype == torch.bfloat16 and w.device.type == "cpu" and w.shape[0] % 16 == 0 \
                and cpu_norm_act.available():
            self._kernel = self._c  # one C pass, one rounding
        else:
            self._kernel = self._torch

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        self._choose()
        return out

    def use_triton(self, kernel) -> None:
        """Run through ``kernel`` (``triton_batch_invariant.rms_norm``), or None: the dtype's own kernel."""
        self.triton_rms_norm = kernel
        self._choose()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._kernel(x)

    def _triton(self, x: torch.Tensor) -> torch.Tensor:
        return self.triton_rms_norm(x, self.weight, self.eps)

    def _c(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_norm_act.rms_norm(x, self.weight, self.eps)

    def _torch(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: scales by ``1 + weight`` (the checkpoint stores the
    offset from one), all in float32, rounded once to the input's dtype (HF
    ``Gemma2RMSNorm``/``Gemma3RMSNorm``). PyTorch only (one kernel): the C
    stack refuses models with it (``kernels.cpu_decoder.IMPLEMENTED``) and it
    has no batch-invariant Triton kernel.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps
        self.triton_rms_norm = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)
