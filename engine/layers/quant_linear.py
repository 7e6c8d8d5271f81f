"""GGUF 4-bit linear weights run in 4 bits on CPU (``quantization: gguf``).

llama.cpp's Q4_0 and Q4_1 store a weight row in blocks of 32 elements
(ggml's ``block_q4_0``/``block_q4_1``; spec:
https://github.com/ggml-org/ggml/blob/master/docs/gguf.md):

* Q4_0: ``d`` (float16), 16 bytes of 4-bit codes q; value = (q - 8) * d.
* Q4_1: ``d``, ``m`` (float16), 16 bytes of codes; value = q * d + m.

Byte j of a block holds element j in its low nibble and element j + 16 in
its high nibble. PyTorch's CPU weight-only int4 matmul
(``aten._weight_int4pack_mm_for_cpu``) computes with value = (q - 8) * scale
+ zero per group of ``qGroupSize`` input elements, so both types map exactly:
Q4_0 is (scale d, zero 0) and Q4_1 is (scale d, zero m + 8d). The scales are
held in the activations' dtype: exact in float32, rounded to 8 mantissa bits
in bfloat16 (the float16 ``d`` has 11).

In bfloat16 on a CPU with AVX512-BF16 or AVX2/FMA the C kernel of
``kernels/csrc/linear_q4_cpu.c`` runs them instead: the weights exact (d q +
m in float32 sums, not scales rounded to bfloat16), batch-invariant, and
part of the one-call decoder stack (``kernels/cpu_decoder.py``). In float32
on those CPUs ``kernels/csrc/linear_f32_cpu.c`` does (each weight the
gguf package's float32 value, one fused-multiply-add chain per output, the
same bits on every body and for any batch): PyTorch's int4 matmul runs scalar
code in float32 (``loadtests/bench/kernels_cpu.py --only f32``).

Q8_0 (and the k-quants) have no exact counterpart among PyTorch's CPU
kernels (``_weight_int8pack_mm`` takes one scale per output row, Q8_0 has
one per 32 elements): those tensors are dequantized as with ``none``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from kernels import cpu_linear, cpu_linear_f32

GROUP = 32  # elements per Q4_0/Q4_1 block
INT4_TYPES = {"Q4_0": 18, "Q4_1": 20}  # GGUF type -> bytes per block


@dataclass
class GGUFBlocks:
    """One GGUF tensor kept in its quantized blocks.

    Attributes:
        qtype: GGUF type name ("Q4_0", "Q4_1").
        shape: (out_features, in_features) of the weight it encodes.
        data: uint8 [out_features, in_features // 32 * bytes per block],
            one row of blocks per output row (the file's layout).
    """

    qtype: str
    shape: tuple[int, int]
    data: np.ndarray

    group_size: ClassVar[int] = GROUP  # inputs per (d, m), as a checkpoint's Int4Weight says its own
    perm: ClassVar[None] = None  # the inputs in order (a checkpoint's act-order weight says its own)

    def dequantize(self) -> torch.Tensor:
        """float32 [out_features, in_features]: the ``gguf`` package's dequantization, bit for bit
        (Q4_0 d (q - 8), Q4_1 d q + m, Q8_0 d q: each product exact, one rounding at most), computed here
        over whole tensors for those types (the package's numpy path takes ~0.8 s for SmolLM2's 210;
        tests/engine/test_quant_linear.py pins the two together); other types through the package."""
        if self.qtype in INT4_TYPES:
            codes, d, m = self._int4_blocks()
            return int4_values(codes.view(self.shape), d, m)
        if self.qtype == "Q8_0":
            codes, d = q8_codes_d(self)
            return (codes.float().view(*d.shape, GROUP) * d[..., None]).view(self.shape)
        import gguf

        arr = gguf.quants.dequantize(self.data, gguf.GGMLQuantizationType[self.qtype])
        return torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32).reshape(self.shape))

    def codes_scales_zeros(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The weight as value = (code - 8) * scale + zero per block of 32.

        Returns:
            codes: int32 [out, in], 0..15.
            scales, zeros: float32 [out, in // 32].

        Raises:
            ValueError: not a Q4_0/Q4_1 tensor, or its data does not match its shape.
        """
        codes, d, m = self.codes_d_m()
        return codes, d, m + 8 * d

    def codes_d_m(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The weight as value = code * d + m per block of 32 (Q4_0: m = -8 d).

        Returns:
            codes: int32 [out, in], 0..15.
            d, m: float32 [out, in // 32] (float16 in the file: exact).

        Raises:
            ValueError: not a Q4_0/Q4_1 tensor, or its data does not match its shape.
        """
        codes, d, m = self._int4_blocks()
        return codes.view(self.shape).to(torch.int32), d, m

    def _int4_blocks(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """codes uint8 [out, in // 32, 32] (byte j of a block: element j low, j + 16 high), d and m
        float32 [out, in // 32]."""
        if self.qtype not in INT4_TYPES:
            raise ValueError(f"{self.qtype} is not a 4-bit type ({sorted(INT4_TYPES)})")
        n, k = self.shape
        nbytes = INT4_TYPES[self.qtype]
        if k % GROUP or self.data.size != n * (k // GROUP) * nbytes:
            raise ValueError(f"{self.qtype} data of {self.data.size} bytes does not encode a {n}x{k} weight")
        blocks = _tensor(self.data).view(n, k // GROUP, nbytes)
        d = blocks[..., 0:2].contiguous().view(torch.float16)[..., 0].float()
        if self.qtype == "Q4_0":
            m, qs = -8 * d, blocks[..., 2:18]
        else:
            m, qs = blocks[..., 2:4].contiguous().view(torch.float16)[..., 0].float(), blocks[..., 4:20]
        return torch.cat([qs & 0x0F, qs >> 4], dim=-1), d, m


def int4_values(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """float32 [out, in]: ``code * d + m`` per group of inputs, GGUF's 4-bit dequantization (the product
    exact, one rounding in the sum).

    Args:
        codes: integer [out, in], 0..15.
        d, m: float32 [out, groups]; a group is ``in // groups`` consecutive inputs.
    """
    n, k = codes.shape
    return (codes.view(n, d.shape[1], -1).float() * d[..., None] + m[..., None]).view(n, k)


def _tensor(data: np.ndarray) -> torch.Tensor:
    """A GGUF tensor's bytes (often a read-only view of the memory-mapped file) as a uint8 tensor of its own."""
    return torch.from_numpy(np.array(data, dtype=np.uint8, copy=True))


def q8_codes_d(blocks: GGUFBlocks) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q8_0 tensor (ggml's block_q8_0: float16 d, 32 int8 codes; w = d q) as
    (codes int8 [out, in], d float32 [out, in // 32]).

    Raises:
        ValueError: not Q8_0, or its data does not match its shape.
    """
    n, k = blocks.shape
    if blocks.qtype != "Q8_0" or k % GROUP or blocks.data.size != n * (k // GROUP) * 34:
        raise ValueError(f"{blocks.qtype} data of {blocks.data.size} bytes is not a Q8_0 {n}x{k} weight")
    raw = _tensor(blocks.data).view(n, k // GROUP, 34)
    d = raw[..., 0:2].contiguous().view(torch.float16)[..., 0].float()
    return raw[..., 2:].contiguous().view(torch.int8).reshape(n, k), d


# the group sizes PyTorch's int4 CPU matmul takes (aten._weight_int4pack_mm_for_cpu's qGroupSize)
TORCH_GROUPS = (256, 128, 64, 32)


def int4_packable(pieces: list) -> bool:
    """Whether row-stacked ``pieces`` can run through the int4 kernel: all
    Q4_0/Q4_1 arithmetic, one input width that is a multiple of 32, one
    group size (a multiple of 32) and one input order, and a total of output
    rows that is a multiple of 16 (``_convert_weight_to_int4pack_for_cpu``)."""
    if not pieces or any(p.qtype not in INT4_TYPES for p in pieces):
        return False
    k, group, perm = pieces[0].shape[1], pieces[0].group_size, pieces[0].perm
    rows = sum(p.shape[0] for p in pieces)
    same_order = all((p.perm is None) == (perm is None) and (perm is None or torch.equal(p.perm, perm))
                     for p in pieces)
    return all(p.shape[1] == k and p.group_size == group for p in pieces) and same_order \
        and k % GROUP == 0 and group % GROUP == 0 and k % group == 0 and rows % 16 == 0


class Int4Linear:
    """``y = x @ W.T`` with W held as 4-bit codes and a scale and zero per group of inputs.

    Args:
        pieces: the weight's GGUF tensors (or ``engine.quantization.int4.Int4Weight``
            values, the same arithmetic per group of their own size, maybe
            with their inputs in another order), stacked along output rows in
            order (e.g. q, k, v of a fused projection); see :func:`int4_packable`.
        dtype: the activations' dtype (float32, bfloat16 or float16); the
            PyTorch kernel's scales and zeros are stored in it.
        parts: the pieces' ``codes_d_m()`` where the caller has them already (else decoded here).

    Raises:
        ValueError: the pieces cannot be packed (:func:`int4_packable`).
    """

    def __init__(self, pieces: list, dtype: torch.dtype, parts: list | None = None) -> None:
        if not int4_packable(pieces):
            raise ValueError(f"cannot pack {[(p.qtype, p.shape, p.group_size) for p in pieces]} as int4")
        parts = parts or [p.codes_d_m() for p in pieces]
        codes = torch.cat([c for c, _, _ in parts])
        d = torch.cat([s for _, s, _ in parts])
        m = torch.cat([z for _, _, z in parts])
        self.out_features, self.in_features = codes.shape
        self.dtype = dtype
        self.group = pieces[0].group_size
        self.perm = pieces[0].perm  # codes' input j is x's column perm[j], or None
        self.packed = self.scales_and_zeros = None
        # bfloat16 on an AVX512-BF16 or AVX2 CPU: the C kernel (kernels/csrc/linear_q4_cpu.c: integer dots on
        # 8-bit-rounded inputs, the same bits on both ISAs); one type per projection (Q4_1 keeps its min).
        kinds = {p.qtype for p in pieces}
        self.c_packed = self.f32_packed = None
        if dtype == torch.float32 and cpu_linear.q4_available():
            self.f32_packed = cpu_linear_f32.pack_q4_f32(codes, d, m, self.group)
        elif dtype == torch.bfloat16 and len(kinds) == 1 and cpu_linear.q4_available():
            # the kernel keeps d and m as float16: GGUF's are; a GPTQ/AWQ group's m = -z s is rounded to
            # float16 here (relative error <= 2**-12, below bfloat16's rounding of the weight it adds to)
            self.c_packed = cpu_linear.pack_q4(codes, d, m.half().float() if kinds == {"Q4_1"} else None,
                                               self.group, self.perm)
        if self.c_packed is None and self.f32_packed is None:
            # PyTorch's kernel takes groups of 32 to 256 inputs: a larger group is given as runs of its largest
            self.torch_group = next(g for g in TORCH_GROUPS if self.group % g == 0)
            d, m = (t.repeat_interleave(self.group // self.torch_group, dim=1) for t in (d, m))
            # uint8 [out, in // 2]: two codes per byte in the kernel's own order.
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
            # [in // group, out, 2]: (scale, zero) per group and output row, value = (q - 8) * scale + zero.
            self.scales_and_zeros = torch.stack([d.t(), (m + 8 * d).t()], dim=-1).to(dtype).contiguous()

    @property
    def nbytes(self) -> int:
        """Bytes held (codes + scales and zeros + the input order)."""
        if self.c_packed is not None:
            return self.c_packed.nbytes  # its input order included
        perm = 0 if self.perm is None else self.perm.nbytes
        if self.f32_packed is not None:
            return self.f32_packed.nbytes + perm
        return self.packed.nbytes + self.scales_and_zeros.nbytes + perm

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
        """[..., in_features] -> [..., out_features] in x's dtype (which must be
        the dtype given at construction); ``bias`` [out_features] and then
        ``residual`` [..., out_features] are added when given.

        Each output row depends on its own input row only: measured bitwise
        equal for one row alone and inside batches of 1 to 128 rows
        (tests/engine/test_quant_linear.py).
        """
        if self.c_packed is not None:
            return cpu_linear.linear(x, self.c_packed, bias, residual)  # bias and residual added in float32
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self.perm is not None:
            x2 = x2.index_select(1, self.perm)
        if self.f32_packed is not None:
            y = cpu_linear_f32.linear_f32(x2, self.f32_packed, bias,
                                             None if residual is None else residual.reshape(-1, self.out_features))
            return y.view(*lead, self.out_features)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2.contiguous(), self.packed, self.torch_group,
                                                       self.scales_and_zeros)
        y = y.view(*lead, self.out_features)
        if bias is not None:
            y = y + bias
        return y if residual is None else residual + y
