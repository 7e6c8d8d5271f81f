"""Packed checkpoint weights kept packed on CUDA: 4-bit grouped (GPTQ, AWQ,
compressed-tensors W4A16, GGUF Q4_0/Q4_1), W8A16 int8 and FP8 E4M3
projections run by the Triton GEMM that dequantizes in its tiles
(``kernels/triton_quant_linear.py``): bitwise the dense batch-invariant Triton
GEMM on the loader's reference dequantization, reading 4.25-8 bits a weight
instead of 16."""

from __future__ import annotations

import torch

from engine.quantization.fp8 import FP8Weight
from engine.quantization.int8 import Int8Weight


def _kind(part) -> str:
    if isinstance(part, FP8Weight):
        return "fp8"
    if isinstance(part, Int8Weight):
        return "int8" if part.activations is None else "w8a8"
    return "int4"  # Int4Weight or GGUFBlocks: value = d q + m per group (codes_d_m)


def triton_packable(pieces: list, device: torch.device) -> bool:
    """Whether row-stacked ``pieces`` run packed through the Triton GEMM: on a CUDA device, one kind (4-bit
    with its inputs in order, W8A16 int8 or FP8; W8A8 has its own path), one input width and group size."""
    if not pieces or device.type != "cuda":
        return False
    kinds = {_kind(p) for p in pieces}
    if len(kinds) != 1 or kinds == {"w8a8"}:
        return False
    k, group = pieces[0].shape[1], getattr(pieces[0], "group_size", pieces[0].shape[1])
    if kinds == {"int4"} and (k % 2 or any(getattr(p, "qtype", "Q4_1") not in ("Q4_0", "Q4_1") for p in pieces)):
        return False
    return all(p.shape[1] == k and getattr(p, "group_size", k) == group and getattr(p, "perm", None) is None
               for p in pieces)


class TritonPackedLinear:
    """``y = x @ W.T`` with W held packed on its device (see :func:`triton_packable`).

    Args:
        pieces: the weight's parts stacked along output rows in order (q, k, v of a fused projection).
        device: where the packed tensors live (CUDA; CPU with Triton's interpreter, in tests).

    Attributes:
        kind: ``kernels.triton_quant_linear.INT4``, ``INT8`` or ``FP8``.
        codes: uint8 [out, in // 2] (4-bit, two a byte), int8 [out, in] or uint8 [out, in] (FP8 bits).
        scales, offsets: float32 [out, groups] (offsets: the 4-bit m; None otherwise).
    """

    c_packed = None  # no C kernel form: the CPU's one-call decoder stack is not built over these layers

    def __init__(self, pieces: list, device: torch.device) -> None:
        from kernels import triton_quant_linear as tq  # imports triton: CUDA (or its interpreter) only

        self._kernel = tq.dequant_linear
        kind = _kind(pieces[0])
        self.out_features = sum(p.shape[0] for p in pieces)
        self.in_features = pieces[0].shape[1]
        self.group_size = getattr(pieces[0], "group_size", self.in_features)
        self.offsets = None
        if kind == "int4":
            parts = [p.codes_d_m() for p in pieces]
            self.kind = tq.INT4
            codes = tq.pack_int4_codes(torch.cat([c for c, _, _ in parts]))
            scales = torch.cat([d for _, d, _ in parts])
            self.offsets = torch.cat([m for _, _, m in parts]).float().contiguous().to(device)
        elif kind == "int8":
            self.kind, codes = tq.INT8, torch.cat([p.codes for p in pieces])
            scales = torch.cat([p.scales for p in pieces])
        else:
            self.kind, codes = tq.FP8, torch.cat([p.codes.view(torch.uint8) for p in pieces])
            scales = torch.cat([p.scales.expand(p.shape[0], 1) for p in pieces])
        self.codes = codes.contiguous().to(device)
        self.scales = scales.float().contiguous().to(device)

    @property
    def nbytes(self) -> int:
        """Bytes held on the device (codes, scales, offsets)."""
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.offsets) if t is not None)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
        """[..., in_features] -> [..., out_features] in x's dtype; ``bias`` and then ``residual`` added to the
        float32 accumulator before the one rounding."""
        lead = x.shape[:-1]
        res = None if residual is None else residual.reshape(-1, self.out_features).contiguous()
        y = self._kernel(x.reshape(-1, self.in_features).contiguous(), self.kind, self.codes, self.scales,
                         self.offsets, self.group_size, self.in_features, bias, res)
        return y.view(*lead, self.out_features)
