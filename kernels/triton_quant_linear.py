"""Batch-invariant linear layer over packed weights for CUDA (Triton): 4-bit
grouped (GPTQ, AWQ, compressed-tensors W4A16), int8 grouped (W8A16) and FP8
E4M3 (compressed-tensors ``float-quantized``), dequantized in the GEMM's tiles.

The weights stay in their packed form on the device (4 bits a weight plus
float32 scale and offset per group, or a byte a weight plus float32 scales);
each tile of ``BLOCK_K`` x ``BLOCK_N`` weights is turned into float32 values
by the reference dequantization's own arithmetic, rounded once to the
activations' dtype, and multiplied by ``triton_batch_invariant``'s kernel
itself, the one that multiplies a dense weight (same tiles, same K order,
float32 accumulator, bias then residual added before the one rounding). So a projection's outputs are
bit for bit those of the dense Triton GEMM on the weight dequantized at load,
and, like it, do not depend on the row count:

- 4-bit: value = q d + m per group (d = s, m = -z s: the loader's
  ``Int4Weight.codes_d_m``). q d and m are exact in float32 (a float16 scale
  times a 4-bit integer) and so is their sum (q - z) s, so the tile's values
  equal ``Int4Weight.dequantize`` exactly. Codes are packed two a byte along
  the inputs (input 2j in the low nibble of byte j, 2j + 1 in the high one).
- int8: value = float(q) * s per group, one float32 rounding, as
  ``Int8Weight.dequantize``.
- FP8 E4M3 (``float8_e4m3fn``): the code's bits are read as a byte and made
  into the float32 with the same value by moving its fields (exact for every
  code; 0x7F/0xFF are NaN), then times the row's float32 scale, one rounding,
  as ``FP8Weight.dequantize``.

The tiling and the row-invariance argument are ``triton_batch_invariant``'s
(He et al., "Defeating Nondeterminism in LLM Inference", Thinking Machines Lab
2025); the dequantize-in-the-tile layout is the one of vLLM's Triton AWQ/GPTQ
GEMMs (``vllm/model_executor/layers/quantization/awq_triton.py``), here with
no split-K so that the sums keep one order.
"""

from __future__ import annotations

import torch

from kernels.triton_batch_invariant import FP8, INT4, INT8, launch_linear

__all__ = ["FP8", "INT4", "INT8", "dequant_linear", "pack_int4_codes"]


def pack_int4_codes(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes two a byte along the inputs, as the kernel reads them.

    Args:
        codes: integer [out, in], values 0..15, ``in`` even.

    Returns:
        uint8 [out, in // 2]: byte j holds input 2j in its low nibble and 2j + 1 in its high one.
    """
    c = codes.to(torch.uint8)
    return (c[:, 0::2] | (c[:, 1::2] << 4)).contiguous()


def dequant_linear(x: torch.Tensor, kind: int, codes: torch.Tensor, scales: torch.Tensor,
                   offsets: torch.Tensor | None, group_size: int, in_features: int,
                   bias: torch.Tensor | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
    """``residual + x @ W.T + bias`` with W dequantized in the tiles, bits independent of the row count.

    Args:
        x: [M, K] bfloat16/float16/float32, last dimension contiguous (K = ``in_features``).
        kind: ``INT4`` (codes uint8 [N, K // 2] from :func:`pack_int4_codes`, value = q d + m),
            ``INT8`` (codes int8 [N, K], value = q s) or ``FP8`` (codes uint8 [N, K]: float8_e4m3fn bits,
            value = float(code) s).
        scales: float32 [N, K // group_size] (d for INT4, s otherwise), contiguous.
        offsets: float32 [N, K // group_size] (m for INT4), contiguous; None for INT8 and FP8.
        group_size: inputs per scale (a divisor of K; K for one scale a row).
        bias: [N] or None; residual: [M, N] or None, added to the float32 accumulator before rounding.

    Returns:
        [M, N], x's dtype: bitwise ``triton_batch_invariant.linear(x, W.to(x.dtype), bias, residual)``
        for W the float32 reference dequantization.

    Raises:
        ValueError: shapes that do not match, a kind without its offsets, a strided last dimension.
    """
    m, k = x.shape
    n = codes.shape[0]
    if k != in_features or in_features % group_size or scales.shape != (n, in_features // group_size):
        raise ValueError(f"dequant_linear: x {tuple(x.shape)}, codes {tuple(codes.shape)}, scales "
                         f"{tuple(scales.shape)} do not match {in_features} inputs in groups of {group_size}")
    if (kind == INT4) != (offsets is not None):
        raise ValueError("dequant_linear: 4-bit weights take offsets (m), the others none")
    return launch_linear(x, kind, codes, scales, offsets, group_size, n, bias, residual)
