"""float32 linear layers in C (``csrc/linear_f32_cpu.c``): dense float32 weights and 4-bit ones.

``y = x @ W.T (+ bias) (+ residual)`` with float32 x, bias, residual and y, for W a dense float32
weight (:func:`pack_f32`) or a 4-bit one, w = d q + m per group of inputs (GGUF Q4_0/Q4_1,
GPTQ/AWQ/compressed-tensors 4-bit: :func:`pack_q4_f32`; each weight rebuilt as ``fmaf(d, q, m)``, the
``gguf`` package's float32 dequantization bit for bit). Each output is one float32 fused-multiply-add
chain over the inputs in order, so every body (AVX-512, AVX2/FMA, portable C) gives the same bits and a
row's bits do not depend on how many rows share the call. They replace, in float32, MKL's GEMM in row
tiles zero-padded to 32 rows (``engine.layers.packed_linear``'s batch-invariant tiling) and PyTorch's
``_weight_int4pack_mm_for_cpu``, which runs scalar code in float32 (``loadtests/bench/kernels_cpu.py
--only f32`` has both ratios).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.cpu_build import load_library, rows_2d
from kernels.cpu_linear import DensePanels, QuantPanels, check_codes, check_group

PANEL = 32  # output columns per packed panel (QF_PANEL of the C file)


@dataclass(frozen=True)
class PackedF32Linear(DensePanels):
    """A dense float32 [out_features, in_features] weight in the kernel's layout.

    Attributes:
        data: float32 [ceil(out / 32), in, 32] panels (padded columns 0).
        out_features, in_features: the weight's shape.
    """


@dataclass(frozen=True)
class PackedQ4F32Linear(QuantPanels):
    """A 4-bit weight in the float32 kernel's layout.

    Attributes:
        codes: uint8 [ceil(out / 32) * in * 16], two codes a byte (per panel of
            32 columns and input: column j in the low nibble of byte j, 16 + j in its high one).
        scales: float32 [ceil(out / 32), in / group, 2, 32]: d, then m, per panel and group.
        out_features, in_features: the weight's shape.
        group: inputs per (d, m): a multiple of 32 dividing in_features.
    """


def pack_f32(weight: torch.Tensor) -> PackedF32Linear:
    """Pack a CPU float32 weight [out, in].

    Raises:
        ValueError: not a 2-D CPU float32 tensor.
    """
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
        raise ValueError(f"pack_f32 takes a 2-D CPU float32 weight, got {weight.dtype} {tuple(weight.shape)} "
                         f"on {weight.device}")
    n, k = weight.shape
    w = weight.detach().contiguous()
    data = torch.empty((n + PANEL - 1) // PANEL, k, PANEL, dtype=torch.float32)
    load_library().linear_f32_pack(w.data_ptr(), n, k, data.data_ptr())
    return PackedF32Linear(data, n, k)


def pack_q4_f32(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor, group: int) -> PackedQ4F32Linear:
    """Pack a 4-bit weight w = d * q + m (one float32 rounding; exact products where d is a float16 value).

    Args:
        codes: [out, in] integers 0..15.
        d, m: [out, in / group] float32 scale and offset of each group (Q4_0: m = -8 d).
        group: inputs per (d, m), a multiple of 32 dividing ``in``.

    Raises:
        ValueError: shapes that do not match, a group that does not fit, codes out of range.
    """
    n, k = codes.shape
    check_group(k, group, "pack_q4_f32")
    if d.shape != (n, k // group) or m.shape != (n, k // group):
        raise ValueError(f"pack_q4_f32 takes codes [n, k] and d, m [n, k / group], got {tuple(codes.shape)}, "
                         f"{tuple(d.shape)}, {tuple(m.shape)}")
    check_codes(codes)
    panels = (n + PANEL - 1) // PANEL
    out_codes = torch.empty(panels * k * PANEL // 2, dtype=torch.uint8)
    out_scales = torch.empty(panels, k // group, 2, PANEL, dtype=torch.float32)
    c = codes.to(torch.uint8).contiguous()
    d32, m32 = (t.to(torch.float32).contiguous() for t in (d, m))
    load_library().linear_q4_f32_pack(c.data_ptr(), d32.data_ptr(), m32.data_ptr(), n, k, group,
                                      out_codes.data_ptr(), out_scales.data_ptr())
    return PackedQ4F32Linear(out_codes, out_scales, n, k, group)


def linear_f32(x: torch.Tensor, packed: PackedF32Linear | PackedQ4F32Linear, bias: torch.Tensor | None = None,
               residual: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [..., in] @ W.T (+ bias [out]) (+ residual [..., out]) -> float32 [..., out], for a dense
    or a 4-bit packed weight.

    Raises:
        ValueError: a dtype other than float32 or a shape that does not match.
    """
    lead, n = x.shape[:-1], packed.out_features
    if x.dtype != torch.float32 or x.shape[-1] != packed.in_features:
        raise ValueError(f"linear_f32 takes float32 [..., {packed.in_features}], got {x.dtype} {tuple(x.shape)}")
    x2 = rows_2d(x)
    m = x2.shape[0]
    r2 = None
    if residual is not None:
        r2 = rows_2d(residual)
        if r2.dtype != torch.float32 or r2.shape != (m, n):
            raise ValueError(f"residual must be float32 [{m}, {n}], got {r2.dtype} {tuple(r2.shape)}")
    b = None if bias is None else bias.detach().to(torch.float32).contiguous()
    y = torch.empty((m, n), dtype=torch.float32)
    if m:
        rest = (None if b is None else b.data_ptr(), None if r2 is None else r2.data_ptr(),
                0 if r2 is None else r2.stride(0), y.data_ptr(), n, m, n, packed.in_features,
                torch.get_num_threads())
        if isinstance(packed, PackedQ4F32Linear):
            rc = load_library().linear_q4_f32(x2.data_ptr(), x2.stride(0), packed.codes.data_ptr(),
                                              packed.scales.data_ptr(), packed.group, *rest)
        else:
            rc = load_library().linear_f32(x2.data_ptr(), x2.stride(0), packed.data.data_ptr(), *rest)
        if rc:
            raise RuntimeError(f"the float32 linear kernel returned {rc}")
    return y.view(*lead, n)
