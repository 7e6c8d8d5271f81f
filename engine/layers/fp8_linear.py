"""FP8 E4M3 linear weights (compressed-tensors ``float-quantized``) run in 8
bits on CPU: the C kernel (``kernels/csrc/linear_q4_cpu.c``, ``linear_fp8``)
upcasts each tile of codes to the bfloat16 values bf16(code * scale) the
loader would have made and runs the bfloat16 arithmetic on them, so a
projection gives the bfloat16 kernel's bits on the dequantized weights (batch
invariant like it) while reading a byte a weight instead of two."""

from __future__ import annotations

import torch

from engine.quantization.fp8 import FP8Weight
from kernels import cpu_linear


def fp8_packable(pieces: list[FP8Weight], dtype: torch.dtype, device: torch.device) -> bool:
    """Whether row-stacked ``pieces`` run on the C FP8 kernel: bfloat16 activations on a CPU where the
    kernels build with a fast body, one input width that is a multiple of 32."""
    if not pieces or dtype != torch.bfloat16 or device.type != "cpu" or not cpu_linear.q4_available():
        return False
    k = pieces[0].shape[1]
    return k % 32 == 0 and all(p.shape[1] == k for p in pieces)


class FP8Linear:
    """``y = x @ W.T`` with W held as FP8 codes and a float32 scale per output row.

    Args:
        pieces: the weight's ``FP8Weight`` parts stacked along output rows in order (q, k, v of a
            fused projection); see :func:`fp8_packable`.

    Attributes:
        c_packed: the kernel's panels (``cpu_linear.PackedFP8Linear``).
    """

    def __init__(self, pieces: list[FP8Weight]) -> None:
        codes = torch.cat([p.codes for p in pieces])
        scales = torch.cat([p.scales for p in pieces])
        self.out_features, self.in_features = codes.shape
        self.c_packed = cpu_linear.pack_fp8(codes, scales, self.in_features)

    @property
    def nbytes(self) -> int:
        """Bytes held (codes and scales, the outputs padded to panels of 64)."""
        return self.c_packed.nbytes

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
        """[..., in_features] bfloat16 -> [..., out_features] bfloat16; ``bias`` and then ``residual``
        added in float32 when given."""
        return cpu_linear.linear(x, self.c_packed, bias, residual)
