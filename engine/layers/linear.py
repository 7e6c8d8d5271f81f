"""The linear methods of a decoder's projections and output head, each chosen
once (at load, when the weights move or are packed, and when batch-invariant
mode changes; vLLM's ``LinearMethod`` idea) with the quantized copy it reads
and the row counts it reads it for, rather than per call:

* a GGUF Q4_0/Q4_1 projection kept in 4 bits (``quantization: gguf``), or a
  4-bit checkpoint's: ``engine.layers.quant_linear.Int4Linear`` (the C 4-bit
  kernel in bfloat16); an FP8 checkpoint's kept in 8 bits:
  ``engine.layers.fp8_linear.FP8Linear`` (:func:`load_packed`); an int8 one
  (compressed-tensors W8A16, W8A8): ``engine.layers.int8_linear.Int8Linear``
  (:func:`load_int8`); on CUDA, 4-bit, W8A16 and FP8 projections stay packed
  as a ``engine.layers.triton_packed_linear.TritonPackedLinear`` (the Triton
  GEMM dequantizing in its tiles);
* a dense weight: on CPU through ``engine.layers.packed_linear.PackedWeights``
  (the C kernel's bfloat16 panels, oneDNN's packed copy, or ``F.linear``, in
  row tiles in batch-invariant mode); on CUDA ``F.linear``, or the
  fixed-configuration Triton GEMM in batch-invariant mode;
* beside a bfloat16 weight from a 4-bit GGUF (``quantization: none``): its
  4-bit copy, read by the C decoder stack for steps of few rows
  (:func:`load_int4`);
* the output head: float32 sums from the C panels, with a Q8_0 head's 8-bit
  copy for steps of few rows (:func:`q8_head_copy`), else the dense method.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.fp8_linear import FP8Linear, fp8_packable
from engine.layers.int8_linear import Int8Linear, int8_packable
from engine.layers.packed_linear import PackedWeights, c_panels_for
from engine.layers.quant_linear import GGUFBlocks, Int4Linear, int4_packable, int4_values, q8_codes_d
from engine.layers.triton_packed_linear import TritonPackedLinear, triton_packable
from engine.quantization.fp8 import FP8Weight
from engine.quantization.int8 import Int8Weight
from kernels import cpu_linear

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
LinearMethod = Callable[..., torch.Tensor]  # (x [rows, in], residual [rows, out] or None) -> [rows, out]


def linear_method(module: nn.Linear, name: str, packed: PackedWeights, int4: Int4Linear | None,
                  copy: cpu_linear.PackedQ4Linear | None = None) -> LinearMethod:
    """The method of one projection: ``y = x @ W.T + bias (+ residual)``.

    Args:
        module: the projection (its weight and bias are read at each call:
            they may be reloaded or released once packed; the bfloat16 path
            repacks a weight changed in place, ``PackedWeights.get``).
        name: its name in ``packed``.
        packed: the layer's packed copies (CPU) and batch-invariant settings.
        int4: its 4-bit form when the projection was kept in 4 bits, else None.
        copy: its 4-bit copy when made from the weight as it is now, else
            None (chosen with the method: a weight changed in place after
            that needs the kernels chosen again). It is read by calls of up to
            :func:`kernels.cpu_linear.copy_max_rows` rows, asked once here (as
            the C stack's ``project`` chooses: every row on x86 builds, integer
            dots with their own bits, so a row's bits never depend on the
            batch; few rows on the portable build, the panels' bits).
    """
    if int4 is not None:
        return lambda x, residual=None: int4(x, module.bias, residual)
    if packed.triton_linear is not None:
        kernel = packed.triton_linear
        return lambda x, residual=None: kernel(x.contiguous(), module.weight, module.bias, residual)
    if module.weight.device.type != "cpu":
        return lambda x, residual=None: _dense(x, module.weight, module.bias, residual)
    if copy is None:
        return lambda x, residual=None: packed.linear(name, x, module.weight, module.bias, residual)
    max_rows = cpu_linear.copy_max_rows()

    def method(x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if x.dtype == torch.bfloat16 and math.prod(x.shape[:-1]) <= max_rows:
            return cpu_linear.linear(x, copy, module.bias, residual)
        return packed.linear(name, x, module.weight, module.bias, residual)
    return method


def _dense(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           residual: torch.Tensor | None) -> torch.Tensor:
    y = F.linear(x, weight, bias)
    return y if residual is None else residual + y


def c_head(module: nn.Module, packed: PackedWeights, q8: cpu_linear.PackedQ8Linear | None = None
           ) -> Callable[[int], cpu_linear.PackedQ8Linear | cpu_linear.PackedLinear] | None:
    """Which form of the output head the C linear kernel reads for a call of n rows: the 8-bit copy of a Q8_0
    head for calls of up to ``cpu_linear.copy_max_rows`` rows (every call on x86 builds), else its bfloat16
    panels; None where the head is not on the C kernel (``head_method``'s arguments)."""
    if not c_panels_for(module.weight):
        return None
    max_rows = cpu_linear.copy_max_rows() if q8 is not None else -1
    return lambda rows: q8 if rows <= max_rows else packed.get("lm_head", module.weight)


def head_method(module: nn.Module, packed: PackedWeights, q8: cpu_linear.PackedQ8Linear | None = None
                ) -> Callable[[torch.Tensor], torch.Tensor]:
    """The output head's method: [rows, hidden] -> [rows, vocab] float32 logits.

    bfloat16 on a CPU with the C linear kernel: the unrounded float32 sums of
    its panels, or of the 8-bit copy of a Q8_0 head (about half the bytes)
    for calls of up to ``cpu_linear.copy_max_rows`` rows (every call on x86
    builds, integer dots with their own bits; few rows and the same bits on
    the portable build): ``c_head``;
    elsewhere the dense method's model-dtype logits, cast.

    Args:
        module: ``lm_head``, or the embedding when tied (its ``.weight`` is read per call).
        packed: the model's packed copies (under "lm_head").
        q8: the head's 8-bit copy when made from the weight as it is now,
            else None (chosen with the method, as ``linear_method``'s copy).
    """
    pick = c_head(module, packed, q8)
    if pick is not None:
        return lambda hidden: cpu_linear.linear(hidden, pick(hidden.shape[0]), out_dtype=torch.float32)
    if packed.triton_linear is not None:
        kernel = packed.triton_linear
        return lambda hidden: kernel(hidden.contiguous(), module.weight, None, None).float()
    if module.weight.device.type != "cpu":
        return lambda hidden: F.linear(hidden, module.weight).float()
    return lambda hidden: packed.linear("lm_head", hidden, module.weight).float()


def q8_head_copy(tensor: GGUFBlocks, dst: torch.Tensor) -> cpu_linear.PackedQ8Linear | None:
    """The C kernel's 8-bit copy of a Q8_0 output head (or tied embedding)
    loaded into ``dst``, where the C kernel reads it (bfloat16 on CPU), else None."""
    if dst.dtype == torch.bfloat16 and dst.device.type == "cpu" and cpu_linear.q4_available():
        return cpu_linear.pack_q8(*q8_codes_d(tensor))
    return None


def load_int4(layer: nn.Module, name: str, pieces: list[tuple[int, GGUFBlocks]], param: nn.Parameter,
              q4_copy: bool = False) -> None:
    """Keep a projection's GGUF 4-bit parts ((row offset, blocks), in row
    order) as the layer's ``Int4Linear`` (``layer.int4[name]``) and free its
    dense weight; dequantize them into ``param`` instead when they cannot be
    packed (some part of another type, shapes the kernel refuses, not on
    CPU), or as well when ``q4_copy`` (keeping the C kernel's 4-bit copy in
    ``layer.q4_copy[name]`` when it takes them)."""
    blocks = [b for _, b in pieces]
    covers_all = sum(b.shape[0] for b in blocks) == param.shape[0]
    if covers_all and not q4_copy and _keep_on_device(layer, name, blocks, param):
        return
    packable = param.device.type == "cpu" and covers_all and int4_packable(blocks)
    if q4_copy or not packable:
        # both copies of a GGUF weight (q4_copy: GGUFBlocks only) from one decoding of its blocks
        parts = [b.codes_d_m() for b in blocks] if q4_copy and packable and param.dtype == torch.bfloat16 else None
        for i, (offset, b) in enumerate(pieces):
            param.data[offset:offset + b.shape[0]].copy_(b.dequantize() if parts is None else int4_values(*parts[i]))
        if parts is not None:
            packed = Int4Linear(blocks, param.dtype, parts).c_packed
            if packed is not None:
                layer.q4_copy[name] = (packed, param, param._version)
        return
    layer.int4[name] = Int4Linear(blocks, param.dtype)
    getattr(layer, name).weight = nn.Parameter(param.data.new_empty(0), requires_grad=False)


def _keep_on_device(layer: nn.Module, name: str, parts: list, param: nn.Parameter) -> bool:
    """Keep a projection's packed parts (covering it whole) as a :class:`TritonPackedLinear` on the
    parameter's CUDA device (``layer.int4[name]``), freeing its dense weight, where :func:`triton_packable`
    says so; return whether it did."""
    if not triton_packable(parts, param.device):
        return False
    layer.int4[name] = TritonPackedLinear(parts, param.device)
    getattr(layer, name).weight = nn.Parameter(param.data.new_empty(0), requires_grad=False)
    return True


def load_packed(layer: nn.Module, name: str, pieces: list[tuple[int, object]], param: nn.Parameter,
                q4_copy: bool = False) -> None:
    """Keep a projection's quantized parts ((row offset, part), in row order) packed as the layer's
    method (``layer.int4[name]``: 4-bit parts by :func:`load_int4`, FP8 parts as an ``FP8Linear``
    where :func:`fp8_packable` says so), freeing its dense weight; else dequantize them into ``param``."""
    parts = [p for _, p in pieces]
    if any(isinstance(p, Int8Weight) for p in parts):
        load_int8(layer, name, pieces, param)
        return
    if not all(isinstance(p, FP8Weight) for p in parts):
        load_int4(layer, name, pieces, param, q4_copy)
        return
    covers_all = sum(p.shape[0] for p in parts) == param.shape[0]
    if covers_all and _keep_on_device(layer, name, parts, param):
        return
    if covers_all and fp8_packable(parts, param.dtype, param.device):
        layer.int4[name] = FP8Linear(parts)
        getattr(layer, name).weight = nn.Parameter(param.data.new_empty(0), requires_grad=False)
        return
    for offset, p in pieces:
        param.data[offset:offset + p.shape[0]].copy_(p.dequantize())


def load_int8(layer: nn.Module, name: str, pieces: list[tuple[int, object]], param: nn.Parameter) -> None:
    """Keep a projection's int8 parts ((row offset, ``Int8Weight``), in row order) as the layer's
    ``Int8Linear`` (``layer.int4[name]``), freeing its dense weight: on the C kernel where
    :func:`int8_packable` says so, and W8A8 always (its activations are quantized on every path);
    else (W8A16 off the kernel) dequantize them into ``param``.

    Raises:
        ValueError: W8A8 parts that do not cover the whole projection (or mixed with other kinds).
    """
    parts = [p for _, p in pieces]
    covers_all = all(isinstance(p, Int8Weight) for p in parts) and sum(p.shape[0] for p in parts) == param.shape[0]
    w8a8 = any(getattr(p, "activations", None) == "token" for p in parts)
    if w8a8 and (not covers_all or any(p.activations != "token" for p in parts)):
        raise ValueError(f"{name}: W8A8 int8 parts must cover the whole fused projection")
    if covers_all and not w8a8 and _keep_on_device(layer, name, parts, param):
        return
    packable = covers_all and int8_packable(parts, param.dtype, param.device)
    if packable or w8a8:
        layer.int4[name] = Int8Linear(parts, packable)
        getattr(layer, name).weight = nn.Parameter(param.data.new_empty(0), requires_grad=False)
        return
    for offset, p in pieces:
        param.data[offset:offset + p.shape[0]].copy_(p.dequantize())


def pack_projections(layer: nn.Module, release_dense: bool = True) -> None:
    """Pack each dense projection of ``layer`` now (``PackedWeights.get``);
    with ``release_dense``, free each dense weight the C kernel's panels now
    hold (``PackedWeights.release_dense``): the weights are not kept twice,
    and the projection can no longer be reloaded or repacked."""
    for name in PROJECTIONS:
        if name not in layer.int4:
            lin = getattr(layer, name)
            if isinstance(layer.packed.get(name, lin.weight), cpu_linear.DensePanels) and release_dense:
                layer.packed.release_dense(name, lin)
