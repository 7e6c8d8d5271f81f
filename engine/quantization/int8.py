"""An int8 weight (compressed-tensors W8A16 ``pack-quantized`` 8-bit and W8A8
``int-quantized``) in the form the engine's 8-bit kernels read: the codes as
int8 with one float32 scale per output row and group of inputs (a whole row
per channel), w = code * scale; for W8A8 the activations are also quantized
to int8, per token and at run time (``activations == "token"``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def unpack_int8(packed: torch.Tensor, k: int) -> torch.Tensor:
    """The ``compressed_tensors`` package's ``pack_to_int32`` of 8-bit codes undone: four unsigned
    codes q + 128 per int32 along the inputs, input 4j + i in bits 8i..8i+7 of word j.

    Args:
        packed: int32 [out, ceil(k / 4)].
        k: the inputs.

    Returns:
        int8 [out, k], the signed codes q.
    """
    shifts = torch.tensor([0, 8, 16, 24], dtype=torch.int32)
    u = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & 0xFF  # [out, words, 4]
    return (u.reshape(packed.shape[0], -1)[:, :k] - 128).to(torch.int8)


@dataclass
class Int8Weight:
    """One [out, in] int8 weight.

    Attributes:
        codes: int8 [out, in].
        scales: float32 [out, groups]: one per output row and ``group_size`` inputs.
        group_size: inputs per scale (``in`` for a per-channel or per-tensor scale).
        activations: None (W8A16: bfloat16 activations) or "token" (W8A8: int8 activations
            quantized per token, symmetric, dynamic; per-channel scales only).
    """

    codes: torch.Tensor
    scales: torch.Tensor
    group_size: int
    activations: str | None = None

    @property
    def shape(self) -> tuple[int, int]:
        """(out_features, in_features)."""
        return tuple(self.codes.shape)

    @property
    def nbytes(self) -> int:
        """Bytes as the checkpoint holds them: a byte a weight and a float32 scale a group."""
        return self.codes.numel() + self.scales.numel() * 4

    def dequantize(self) -> torch.Tensor:
        """float32 [out, in]: code * scale, the reference dequantization (one rounding per weight)."""
        return self.codes.float() * self.scales.repeat_interleave(self.group_size, dim=1)

    def narrow(self, dim: int, start: int, length: int) -> Int8Weight:
        """Rows (``dim`` 0) or inputs (``dim`` 1) ``[start, start + length)``, as a tensor parallel split
        takes a dense weight's: rows with their scales; inputs at group boundaries.

        Raises:
            ValueError: an input split that does not start and end at group boundaries.
        """
        if dim == 0:
            return Int8Weight(self.codes.narrow(0, start, length), self.scales.narrow(0, start, length),
                              self.group_size, self.activations)
        if self.scales.shape[1] == 1:  # one scale a row: any split
            return Int8Weight(self.codes.narrow(1, start, length), self.scales, length, self.activations)
        if start % self.group_size or length % self.group_size:
            raise ValueError(f"inputs [{start}, {start + length}) of an 8-bit weight in groups of {self.group_size} "
                             "do not split at group boundaries")
        return Int8Weight(self.codes.narrow(1, start, length),
                          self.scales.narrow(1, start // self.group_size, length // self.group_size),
                          self.group_size, self.activations)
