"""Batch-invariant linear layer and RMSNorm for CUDA (Triton).

cuBLAS, like oneDNN on CPU, picks its GEMM kernel (tile sizes, split-K) from
the problem's shape, so a row of ``x @ W.T`` can round differently in a batch
of 1 and a batch of 64; PyTorch's CUDA reductions likewise choose how many
threads share one row's sum from the number of rows. These kernels use one
fixed configuration whatever the row count, so each output row is computed
by the same instructions in the same order (the approach of vLLM's
batch-invariant mode and of He et al., "Defeating Nondeterminism in LLM
Inference", Thinking Machines Lab 2025):

- ``linear``: output tiles of ``BLOCK_M`` x ``BLOCK_N``, the reduction over
  K in ``BLOCK_K`` steps in order, float32 accumulator, no split-K; bias and
  residual are added to the float32 accumulator before the one rounding
  (as the CPU path's oneDNN post-op does). The same kernel reads packed
  4-bit, int8 and FP8 weights and dequantizes them in its tiles
  (``kernels/triton_quant_linear.py``), so a packed projection's bits are
  the dense one's on the dequantized weight by construction.
- ``rms_norm``: one program per row, the whole row in one block.

The engine calls them in batch-invariant mode on CUDA only
(``engine.models.llama``); on CPU the model tiles oneDNN's calls instead.
Softmax for logprobs stays on PyTorch: its CUDA kernel gives each row one
thread block whose size depends on the vocabulary only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_jit import launchable

# One configuration for every call (tensor-core friendly for bf16/fp16).
BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 64
NUM_WARPS = 4
# How ``_linear_kernel`` reads its weight: dense in x's dtype, or packed and dequantized in the tile
# (``kernels/triton_quant_linear.py``)
DENSE, INT4, INT8, FP8 = 0, 1, 2, 3


def _linear_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    m_ptr,
    bias_ptr,
    res_ptr,
    out_ptr,
    num_rows,
    out_features,
    in_features,
    group_size,
    stride_xm,
    stride_qn,
    stride_sn,
    stride_rm,
    stride_om,
    KIND: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_RES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < num_rows
    n_ok = offs_n < out_features
    rows = offs_m.to(tl.int64)
    cols = offs_n.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        kk = k0 + offs_k
        k_ok = kk < in_features
        w_ok = n_ok[None, :] & k_ok[:, None]
        a = tl.load(x_ptr + rows[:, None] * stride_xm + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if KIND == 0:  # DENSE: the weight in x's dtype
            w = tl.load(q_ptr + cols[None, :] * stride_qn + kk[:, None], mask=w_ok, other=0.0)
        elif KIND == 1:  # INT4: two 4-bit codes a byte along the inputs
            byte = tl.load(q_ptr + cols[None, :] * stride_qn + (kk // 2)[:, None], mask=w_ok, other=0).to(tl.int32)
            val = ((byte >> ((kk % 2) * 4)[:, None]) & 0xF).to(tl.float32)
        elif KIND == 2:  # INT8: int8 codes
            val = tl.load(q_ptr + cols[None, :] * stride_qn + kk[:, None], mask=w_ok, other=0).to(tl.float32)
        else:  # FP8: E4M3 bits: sign, 4 exponent bits (bias 7), 3 mantissa bits
            bits = tl.load(q_ptr + cols[None, :] * stride_qn + kk[:, None], mask=w_ok, other=0).to(tl.int32)
            sign = (bits & 0x80) << 24
            exp = (bits >> 3) & 0xF
            man = bits & 0x7
            normal = (sign | ((exp + 120) << 23) | (man << 20)).to(tl.float32, bitcast=True)
            subnormal = man.to(tl.float32) * 0.001953125  # m 2**-9, exact
            subnormal = tl.where(sign != 0, -subnormal, subnormal)
            nan = (sign | 0x7FC00000).to(tl.float32, bitcast=True)
            val = tl.where(exp == 0, subnormal, tl.where((exp == 15) & (man == 7), nan, normal))
        if KIND != 0:  # the reference dequantization's float32 arithmetic
            group = (kk // group_size).to(tl.int64)
            w = val * tl.load(s_ptr + cols[None, :] * stride_sn + group[:, None], mask=w_ok, other=0.0)
            if KIND == 1:
                w += tl.load(m_ptr + cols[None, :] * stride_sn + group[:, None], mask=w_ok, other=0.0)
        acc = tl.dot(a, w.to(x_ptr.dtype.element_ty), acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    ok = m_ok[:, None] & n_ok[None, :]
    if HAS_RES:
        acc += tl.load(res_ptr + rows[:, None] * stride_rm + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=ok)


def _rms_norm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    hidden_size,
    stride_xm,
    stride_om,
    eps,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    ok = offs < hidden_size
    x = tl.load(x_ptr + row * stride_xm + offs, mask=ok, other=0.0).to(tl.float32)
    normed = (x * tl.rsqrt(tl.sum(x * x, axis=0) / hidden_size + eps)).to(out_ptr.dtype.element_ty)
    w = tl.load(w_ptr + offs, mask=ok, other=0.0)
    tl.store(out_ptr + row * stride_om + offs, (w.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty),
             mask=ok)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           residual: torch.Tensor | None = None) -> torch.Tensor:
    """``residual + x @ weight.T + bias`` with bits that do not depend on the row count.

    Args:
        x: [M, K], bfloat16/float16/float32, last dimension contiguous.
        weight: [N, K], x's dtype, last dimension contiguous.
        bias: [N] or None.
        residual: [M, N] or None, last dimension contiguous; added to the
            float32 accumulator before rounding.

    Returns:
        [M, N], x's dtype. float32 inputs use exact float32 products (no TF32).

    Raises:
        ValueError: shapes or dtypes do not match, or a last dimension is strided.
        RuntimeError: CPU tensors without Triton's interpreter.
    """
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k or weight.dtype != x.dtype:
        raise ValueError(f"linear: x {tuple(x.shape)} {x.dtype} does not match weight {tuple(weight.shape)} "
                         f"{weight.dtype}")
    return launch_linear(x, DENSE, weight, None, None, k, n, bias, residual)


def launch_linear(x: torch.Tensor, kind: int, weight: torch.Tensor, scales: torch.Tensor | None,
                  offsets: torch.Tensor | None, group_size: int, out_features: int, bias: torch.Tensor | None,
                  residual: torch.Tensor | None) -> torch.Tensor:
    """Launch ``_linear_kernel`` over ``x`` [M, K] for a weight read as ``kind`` (``DENSE``: ``weight`` [N, K] in
    x's dtype; packed: the codes with their float32 ``scales`` and, for ``INT4``, ``offsets``, per
    ``group_size`` inputs; see ``kernels/triton_quant_linear.py``), after the checks every kind shares.

    Returns:
        [M, N] in x's dtype (N = ``out_features``).

    Raises:
        ValueError: a residual of another shape, or a strided last dimension.
    """
    m, k = x.shape
    if residual is not None and tuple(residual.shape) != (m, out_features):
        raise ValueError(f"linear: residual {tuple(residual.shape)} should be {(m, out_features)}")
    for t in (x, weight, scales, offsets, residual):
        if t is not None and t.stride(-1) != 1:
            raise ValueError("linear needs the last dimension contiguous")
    out = torch.empty((m, out_features), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    kernel = launchable(_linear_kernel, x.device)
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(out_features, BLOCK_N))
    kernel[grid](
        x, weight, x if scales is None else scales, x if offsets is None else offsets, x if bias is None else bias,
        x if residual is None else residual, out,
        m, out_features, k, group_size, x.stride(0), weight.stride(0), 0 if scales is None else scales.stride(0),
        0 if residual is None else residual.stride(0), out.stride(0),
        KIND=kind, HAS_BIAS=bias is not None, HAS_RES=residual is not None,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=NUM_WARPS,
    )
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich 2019) as ``engine.models.llama.RMSNorm``
    computes it (float32 statistics, normalised value rounded to x's dtype,
    then times the weight), one program per row.

    Args:
        x: [M, N], last dimension contiguous; weight: [N], x's dtype.

    Returns:
        [M, N], x's dtype.

    Raises:
        RuntimeError: CPU tensors without Triton's interpreter.
    """
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty_like(x2)
    if x2.shape[0]:
        launchable(_rms_norm_kernel, x.device)[(x2.shape[0],)](
            x2, weight, out, x2.shape[1], x2.stride(0), out.stride(0), eps,
            BLOCK_N=triton.next_power_of_2(x2.shape[1]))
    return out.reshape(shape)
