"""A 4-bit grouped weight (GPTQ, AWQ) in the form the engine's 4-bit kernel
reads: codes 0..15 with value = d * code + m per block of 32 inputs.

A group-quantized checkpoint stores w[n, k] = (q[n, k] - z[n, g]) * s[n, g]
for group g = k // group_size (a multiple of 32): each 32-block of the group
gets d = s and m = -z * s. In float32 both products are exact (s is a
float16 value, z and q are 4-bit integers), so the engine's float32 weights
equal the reference dequantization bit for bit (``Int4Linear``'s PyTorch
path). The C kernel (bfloat16 activations) keeps d and m as float16: m is
then rounded (relative error at most 2**-12, below bfloat16's 2**-9 of the
weight) unless the group is symmetric (z = 8: m = -8 d, exact).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32  # inputs per (d, m) pair in the engine's 4-bit kernels


def unpack_int32(packed: torch.Tensor, dim: int, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """Eight 4-bit codes per int32 along ``dim``: nibble ``i`` (bits 4i..4i+3)
    of an element holds code ``order[i]`` of its run of eight.

    Args:
        packed: int32 tensor, 2-D.
        dim: the packed dimension (0 or 1); it grows 8 times.
        order: the position within the run of eight held by each nibble.

    Returns:
        uint8 codes 0..15, ``packed``'s shape with ``dim`` multiplied by 8.
    """
    shifts = torch.tensor([4 * order.index(p) for p in range(8)], dtype=torch.int32)  # position p's nibble
    runs = ((packed.to(torch.int32).unsqueeze(-1) >> shifts) & 0xF).to(torch.uint8)  # [..., 8]: position p
    if dim == 1:
        return runs.reshape(packed.shape[0], packed.shape[1] * 8)
    return runs.permute(0, 2, 1).reshape(packed.shape[0] * 8, packed.shape[1])


@dataclass
class Int4Weight:
    """One [out, in] weight as 4-bit codes with a float16 scale and a 4-bit
    zero point per output row and group of ``group_size`` inputs.

    Attributes:
        codes: uint8 [out, in], 0..15 (a byte a weight while loading; the kernels pack two a byte).
        zeros: int32 [out, groups], 0..16 (symmetric formats: 8; auto-gptq's stored zero + 1 may be 16).
        scales: float32 [out, groups], float16 values.
        group_size: inputs per group, a multiple of 32 dividing ``in``.
    """

    codes: torch.Tensor
    zeros: torch.Tensor
    scales: torch.Tensor
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        """(out_features, in_features)."""
        return tuple(self.codes.shape)

    @property
    def qtype(self) -> str:
        """The GGUF block type with the same arithmetic per 32 inputs: "Q4_0"
        (value = d (q - 8), every zero point 8) or "Q4_1" (value = d q + m)."""
        return "Q4_0" if bool((self.zeros == 8).all()) else "Q4_1"

    @property
    def nbytes(self) -> int:
        """Bytes as the checkpoint packs them: 4 bits a code and a zero point, 2 bytes a scale."""
        return self.codes.numel() // 2 + self.zeros.numel() // 2 + self.scales.numel() * 2

    def _per_block(self, t: torch.Tensor) -> torch.Tensor:
        return t.repeat_interleave(self.group_size // BLOCK, dim=1)

    def codes_d_m(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The weight as value = code * d + m per block of 32 inputs.

        Returns:
            codes: int32 [out, in]; d, m: float32 [out, in // 32] (d float16 values; m = -z d exactly).
        """
        d = self._per_block(self.scales)
        return self.codes.to(torch.int32), d, -self._per_block(self.zeros).float() * d

    def dequantize(self) -> torch.Tensor:
        """float32 [out, in]: (q - z) * s, the reference dequantization."""
        z = self.zeros.repeat_interleave(self.group_size, dim=1)
        s = self.scales.repeat_interleave(self.group_size, dim=1)
        return (self.codes.to(torch.int32) - z).float() * s


def grouped_int4(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                 g_idx: torch.Tensor | None, where: str) -> Int4Weight | torch.Tensor:
    """A checkpoint's 4-bit weight as an :class:`Int4Weight`, or as its dense
    float32 dequantization where the groups are not runs of inputs that the
    4-bit kernel's 32-blocks can follow (GPTQ's ``desc_act`` reordering).

    Args:
        codes: integer [out, in], 0..15.
        zeros, scales: [groups, out] (the checkpoints' layout): integer zero
            points 0..15 and float16 scales.
        g_idx: int [in], the group of each input, or None for k // (in / groups).
        where: the weight's name, for errors.

    Raises:
        ValueError: shapes that do not fit together, or a group index out of range.
    """
    out, k = codes.shape
    groups = scales.shape[0]
    if scales.shape != (groups, out) or zeros.shape != (groups, out) or groups == 0 or k % groups:
        raise ValueError(f"{where}: scales {tuple(scales.shape)} / zeros {tuple(zeros.shape)} do not fit a "
                         f"{out}x{k} weight")
    group_size = k // groups
    zeros_t, scales_t = zeros.t().to(torch.int32).contiguous(), scales.t().float().contiguous()
    trivial = torch.arange(k, dtype=torch.int64) // group_size
    if g_idx is not None:
        g_idx = g_idx.to(torch.int64)
        if g_idx.shape != (k,) or int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
            raise ValueError(f"{where}: g_idx of shape {tuple(g_idx.shape)} / range does not index {groups} groups")
    if (g_idx is None or torch.equal(g_idx, trivial)) and group_size % BLOCK == 0:
        return Int4Weight(codes.to(torch.uint8).contiguous(), zeros_t, scales_t, group_size)
    g = trivial if g_idx is None else g_idx
    return (codes.to(torch.int32) - zeros_t[:, g]).float() * scales_t[:, g]
