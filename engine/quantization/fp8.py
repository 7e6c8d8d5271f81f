"""An FP8 E4M3 weight (compressed-tensors ``float-quantized``) in the form the
engine's 8-bit kernel reads: the checkpoint's codes as they are, with one
float32 scale per output row (a per-tensor scale repeated on every row), so
that w = float(code) * scale is the checkpoint's dequantization, product for
product."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class FP8Weight:
    """One [out, in] FP8 weight.

    Attributes:
        codes: float8_e4m3fn [out, in], the checkpoint's ``weight``.
        scales: float32 [out, 1], the checkpoint's ``weight_scale`` per output row.
    """

    codes: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        """(out_features, in_features)."""
        return tuple(self.codes.shape)

    @property
    def nbytes(self) -> int:
        """Bytes as the checkpoint holds them: a byte a weight and a float32 scale a row."""
        return self.codes.numel() + self.scales.numel() * 4

    def dequantize(self) -> torch.Tensor:
        """float32 [out, in]: code * scale, the reference dequantization (one rounding per weight)."""
        return self.codes.float() * self.scales

    def narrow(self, dim: int, start: int, length: int) -> FP8Weight:
        """Rows (``dim`` 0) or inputs (``dim`` 1) ``[start, start + length)``, as a tensor parallel split
        takes them (the scales follow the rows)."""
        if dim == 0:
            return FP8Weight(self.codes.narrow(0, start, length), self.scales.narrow(0, start, length))
        return FP8Weight(self.codes.narrow(1, start, length), self.scales)
