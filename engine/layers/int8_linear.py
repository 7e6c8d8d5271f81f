"""int8 linear weights (compressed-tensors W8A16 and W8A8) kept in 8 bits.

* W8A16 (bfloat16 activations): on CPU in bfloat16, the C 8-bit kernel
  (``kernels/csrc/linear_q4_cpu.c``, ``linear_q8``): on x86 builds integer
  dots on 8-bit-rounded inputs, as for GGUF (``csrc/quant_int.h``, the same
  bits on AVX2 and AVX-512); on the portable build the bfloat16 weights
  bf16(code * scale) rebuilt and run by the bfloat16 arithmetic. Elsewhere
  (float32, other devices) the loader dequantizes them (exact in float32).
* W8A8 (int8 activations quantized per token at run time, vLLM's
  CompressedTensorsW8A8Int8): always an :class:`Int8Linear`, the activations
  quantized on every path, never run as W8A16: on CPU in bfloat16 the C
  kernel ``linear_w8a8`` (``kernels/csrc/linear_w8a8_cpu.c``: exact integer
  sums, batch-invariant), elsewhere :func:`w8a8_torch`, the same steps.
"""

from __future__ import annotations

import torch

from engine.quantization.int8 import Int8Weight
from kernels import cpu_linear


def int8_packable(pieces: list[Int8Weight], dtype: torch.dtype, device: torch.device) -> bool:
    """Whether row-stacked ``pieces`` run on a C kernel: bfloat16 on a CPU where the kernels build
    with a fast body, one input width and group size that the kernel takes (W8A16: a multiple of
    32 dividing the inputs; W8A8: inputs a multiple of 4)."""
    if not pieces or dtype != torch.bfloat16 or device.type != "cpu" or not cpu_linear.q4_available():
        return False
    k, group = pieces[0].shape[1], pieces[0].group_size
    if any(p.shape[1] != k or p.group_size != group for p in pieces):
        return False
    return k % 4 == 0 if pieces[0].activations == "token" else group % 32 == 0 and k % group == 0


def w8a8_torch(x: torch.Tensor, w: Int8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [..., out] = the W8A8 kernel's steps in PyTorch (``csrc/linear_w8a8_cpu.c``'s top):
    x [..., in] rounded to float32, quantized per row (qx = rne(x * float32(127 / amax)), sx =
    amax / 127), the integer sums exact (float64), times float32(sx * sw), plus ``bias``."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax != 0, torch.tensor(127.0, device=x.device) / amax, torch.zeros((), device=x.device))
    q = torch.round(xf * inv).clamp(-127, 127)
    sx = amax / torch.tensor(127.0, device=x.device)
    acc = q.double() @ w.codes.to(x.device).double().t()  # exact: |sum| < 2**31 below 131,000 inputs
    y = acc.float() * (sx * w.scales.to(x.device).reshape(-1).float())
    return y if bias is None else y + bias.float()


class Int8Linear:
    """``y = x @ W.T`` with W held as int8 codes and float32 scales.

    Args:
        pieces: the weight's ``Int8Weight`` parts stacked along output rows in order (q, k, v of a
            fused projection), all W8A16 or all W8A8.
        c_kernel: whether they run on the C kernel (:func:`int8_packable`); W8A8 runs
            :func:`w8a8_torch` otherwise.

    Attributes:
        c_packed: the kernel's panels (``cpu_linear.PackedQ8Linear`` for W8A16,
            ``cpu_linear.PackedW8A8Linear`` for W8A8), or None.
        weight: the stacked ``Int8Weight`` when it runs in PyTorch, else None.
    """

    def __init__(self, pieces: list[Int8Weight], c_kernel: bool) -> None:
        w = Int8Weight(torch.cat([p.codes for p in pieces]), torch.cat([p.scales for p in pieces]),
                       pieces[0].group_size, pieces[0].activations)
        self.out_features, self.in_features = w.shape
        self.activations = w.activations
        self.c_packed, self.weight = None, None
        if not c_kernel:
            if w.activations != "token":
                raise ValueError("a W8A16 weight off the C kernel is dequantized at load, not kept in 8 bits")
            self.weight = w
        elif w.activations == "token":
            self.c_packed = cpu_linear.pack_w8a8(w.codes, w.scales)
        else:
            self.c_packed = cpu_linear.pack_q8(w.codes, w.scales, w.group_size)

    @property
    def nbytes(self) -> int:
        """Bytes held (codes and scales; the C kernel's outputs padded to panels of 64)."""
        return self.c_packed.nbytes if self.c_packed is not None else self.weight.nbytes

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
        """[..., in_features] -> [..., out_features] in x's dtype; ``bias`` and then ``residual``
        added in float32 when given."""
        if self.c_packed is not None:
            return cpu_linear.linear(x, self.c_packed, bias, residual)
        y = w8a8_torch(x, self.weight, bias)
        if residual is not None:
            y = y + residual.float()
        return y.to(x.dtype)
