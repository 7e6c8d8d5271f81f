"""A 4-bit grouped weight (GPTQ, AWQ, compressed-tensors W4A16) in the form
the engine's 4-bit kernel reads: codes 0..15 with value = d * code + m per
group of inputs, at the checkpoint's own group size (its scales cost what they
cost in the checkpoint: 4.25 bits a weight for groups of 128).

A group-quantized checkpoint stores w[n, k] = (q[n, k] - z[n, g]) * s[n, g]
for group g of input k: each group gets d = s and m = -z * s. In float32
both products are exact (s is a float16 value, z and q are 4-bit integers),
so the engine's float32 weights equal the reference dequantization bit for
bit (``Int4Linear``'s PyTorch path). The C kernel (bfloat16 activations)
keeps d and m as float16: m is then rounded (relative error at most 2**-12,
below bfloat16's 2**-9 of the weight) unless the group is symmetric (z = 8:
m = -8 d, exact).

GPTQ's act-order (``desc_act``) quantizes the inputs in another order and
says each input's group in ``g_idx``; the inputs are then sorted by group
(``perm``) so that each group is a run, the codes kept in that order, and the
kernels gather the activations' columns to match (the same products, summed
in another order) rather than dequantizing the weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32  # the engine's 4-bit kernels' codes come in blocks of 32 inputs; a group is a multiple of it


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
        codes: uint8 [out, in], 0..15 (a byte a weight while loading; the kernels pack two a byte),
            in the order ``perm`` gives.
        zeros: int32 [out, groups], 0..16 (symmetric formats: 8; auto-gptq's stored zero + 1 may be 16).
        scales: float32 [out, groups], float16 values.
        group_size: inputs per group, dividing ``in`` (the kernels take multiples of 32).
        perm: int64 [in]: codes' column j is input perm[j] (GPTQ act-order), or None (in order).
    """

    codes: torch.Tensor
    zeros: torch.Tensor
    scales: torch.Tensor
    group_size: int
    perm: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        """(out_features, in_features)."""
        return tuple(self.codes.shape)

    @property
    def qtype(self) -> str:
        """The GGUF block type with the same arithmetic per group: "Q4_0"
        (value = d (q - 8), every zero point 8) or "Q4_1" (value = d q + m)."""
        return "Q4_0" if bool((self.zeros == 8).all()) else "Q4_1"

    @property
    def nbytes(self) -> int:
        """Bytes as the checkpoint packs them: 4 bits a code and a zero point, 2 bytes a scale."""
        return self.codes.numel() // 2 + self.zeros.numel() // 2 + self.scales.numel() * 2

    def codes_d_m(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The weight as value = code * d + m per group of ``group_size`` inputs (in ``perm``'s order).

        Returns:
            codes: int32 [out, in]; d, m: float32 [out, groups] (d float16 values; m = -z d exactly).
        """
        return self.codes.to(torch.int32), self.scales, -self.zeros.float() * self.scales

    def narrow(self, dim: int, start: int, length: int) -> Int4Weight:
        """Rows (``dim`` 0) or inputs (``dim`` 1) ``[start, start + length)``, as a tensor parallel split
        takes a dense weight's: rows with their groups' scales and zero points; inputs at group boundaries, or
        anywhere for one group a row (per-channel: the part keeps the row's scale and zero point, as
        ``Int8Weight.narrow``).

        Raises:
            ValueError: an input split that does not start and end at group boundaries, or of an
                act-order weight (its groups are not runs of the inputs).
        """
        if dim == 0:
            return Int4Weight(self.codes.narrow(0, start, length), self.zeros.narrow(0, start, length),
                              self.scales.narrow(0, start, length), self.group_size, self.perm)
        if self.scales.shape[1] == 1 and self.perm is None:  # one group a row (per-channel): any split
            return Int4Weight(self.codes.narrow(1, start, length), self.zeros, self.scales, length)
        if self.perm is not None:
            raise ValueError("a 4-bit weight with act-order (GPTQ desc_act) cannot be split by its inputs: its groups "
                             "are not runs of the inputs; use a checkpoint without desc_act, or fewer ranks")
        if start % self.group_size or length % self.group_size:
            raise ValueError(f"inputs [{start}, {start + length}) of a 4-bit weight in groups of {self.group_size}"
                             " do not split at group boundaries")
        g0, groups = start // self.group_size, length // self.group_size
        return Int4Weight(self.codes.narrow(1, start, length), self.zeros.narrow(1, g0, groups),
                          self.scales.narrow(1, g0, groups), self.group_size)

    def dequantize(self) -> torch.Tensor:
        """float32 [out, in] in the inputs' order: (q - z) * s, the reference dequantization."""
        z = self.zeros.repeat_interleave(self.group_size, dim=1)
        s = self.scales.repeat_interleave(self.group_size, dim=1)
        w = (self.codes.to(torch.int32) - z).float() * s
        if self.perm is None:
            return w
        out = torch.empty_like(w)
        out[:, self.perm] = w
        return out


def act_order(g_idx: torch.Tensor, groups: int) -> torch.Tensor | None:
    """The input order that makes each group of a GPTQ ``g_idx`` a run of
    ``in / groups`` inputs (a stable sort by group), or None when its groups
    are not all that size.

    Args:
        g_idx: int [in], each input's group.
    """
    perm = torch.argsort(g_idx, stable=True)
    expected = torch.arange(g_idx.numel(), dtype=torch.int64) // (g_idx.numel() // groups)
    return perm if torch.equal(g_idx[perm], expected) else None


def grouped_int4(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                 g_idx: torch.Tensor | None, where: str) -> Int4Weight | torch.Tensor:
    """A checkpoint's 4-bit weight as an :class:`Int4Weight` (inputs sorted by
    group when ``g_idx`` reorders them), or as its dense float32 dequantization
    where ``g_idx``'s groups are not all ``in / groups`` inputs.

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
    if g_idx is None:
        return Int4Weight(codes.to(torch.uint8).contiguous(), zeros_t, scales_t, group_size)
    g_idx = g_idx.to(torch.int64)
    if g_idx.shape != (k,) or int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
        raise ValueError(f"{where}: g_idx of shape {tuple(g_idx.shape)} / range does not index {groups} groups")
    perm = act_order(g_idx, groups)
    if perm is None:
        return (codes.to(torch.int32) - zeros_t[:, g_idx]).float() * scales_t[:, g_idx]
    in_order = torch.equal(perm, torch.arange(k))
    return Int4Weight(codes.to(torch.uint8)[:, perm].contiguous(), zeros_t, scales_t, group_size,
                      None if in_order else perm)
