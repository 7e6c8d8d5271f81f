"""bfloat16 linear layers in C (``csrc/linear_cpu.c``), with a body for
AVX512-BF16 CPUs, one for AVX2/FMA CPUs and a portable one (:func:`isa`).

``y = x @ W.T (+ bias) (+ residual)`` with W packed once into 64-column
panels (one layout for every body: VDPBF16PS's operand, which the float32
bodies widen in registers). Every output element is one float32 accumulator
over k in order, rounded once, so a row's bits do not depend on how many rows
share the call: batch-invariant for any row count without the 32-row tiles
(and their copies) the oneDNN path needs. The bodies' bits differ from one
another (VDPBF16PS adds a pair of products before the accumulator, the
float32 bodies one product at a time); each is deterministic. Against oneDNN's packed bfloat16 GEMM
(``loadtests/bench/kernels_cpu.py``, SmolLM2's shapes, weights in cache,
time ratio): 0.67-0.84x at 1 row, 0.75-0.87x at 8, 0.89-0.95x at 32,
0.96-1.0x at 64 and 256 rows; in the engine, where a decode step's weights
stream from memory, one row is 1.5-2.8x faster.

Used by the model's linear layers (``engine.models.llama``) when
:func:`available` says so (an AVX512-BF16 or AVX2 body); elsewhere they keep
oneDNN. :class:`PackedQ4Linear`
is the 4-bit counterpart (``csrc/linear_q4_cpu.c``) for GGUF Q4_0/Q4_1
weights under ``quantization: gguf`` and 4-bit checkpoints (GPTQ, AWQ,
compressed-tensors), :class:`PackedFP8Linear` the 8-bit one for FP8 checkpoints,
:class:`PackedQ8Linear` for int8 weights (GGUF Q8_0 heads, compressed-tensors W8A16) and
:class:`PackedW8A8Linear` for int8 weights with int8 activations (W8A8, ``csrc/linear_w8a8_cpu.c``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from kernels.cpu_build import default_march, load_library, rows_2d, why_unavailable

PANEL = 64  # output columns per packed panel
ISAS = ("portable", "avx2", "avx512bf16")  # linear_isa()'s 0, 1, 2 in csrc/linear_cpu.c


def isa(march: str | None = None) -> str | None:
    """The body the linear kernels run in this build (:data:`ISAS`), or None
    when the library does not build here; ``march`` as
    :func:`kernels.cpu_build.load_library`."""
    return _isa(march or default_march())


@functools.lru_cache(maxsize=8)
def _isa(march: str) -> str | None:
    return None if why_unavailable(march) else ISAS[load_library(march).linear_isa()]


def available(march: str | None = None) -> bool:
    """Whether the library builds here with a fast linear body (AVX512-BF16
    or AVX2/FMA: faster than oneDNN's bfloat16 GEMM; the portable C body is not)."""
    return isa(march) in ("avx2", "avx512bf16")


@dataclass(frozen=True)
class DensePanels:
    """A dense [out_features, in_features] weight in one of the C kernels' panel layouts (``data``); the
    kernels dispatch on the subclass (:class:`PackedLinear`, ``cpu_linear_f32.PackedF32Linear``)."""

    data: torch.Tensor
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        return self.data.nbytes


@dataclass(frozen=True)
class PackedLinear(DensePanels):
    """A [out_features, in_features] bfloat16 weight in the kernel's layout.

    Attributes:
        data: bfloat16 [ceil(out / 64) * 64 * in] panels ([out / 64][in / 2][64][2]).
        out_features, in_features: the weight's shape (in_features even).
    """


@dataclass(frozen=True)
class QuantPanels:
    """Codes and per-group scales of a quantized [out_features, in_features]
    weight in one of the C kernels' layouts (``csrc/linear_q4_cpu.c``'s, ``csrc/linear_f32_cpu.c``'s;
    in_features a multiple of 32; one scale per ``group`` inputs, a multiple of 32 dividing it); the kernels
    dispatch on the subclass."""

    codes: torch.Tensor
    scales: torch.Tensor
    out_features: int
    in_features: int
    group: int

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes


@dataclass(frozen=True)
class PackedQ4Linear(QuantPanels):
    """A 4-bit weight, w = d q + m per ``group`` inputs (GGUF Q4_0/Q4_1: 32;
    a GPTQ/AWQ/compressed-tensors checkpoint's own group): 4 bits per weight
    plus 4 bytes of scales per group (GGUF: 5 bits per weight; groups of 128:
    4.25). On x86 builds (:func:`integer_copies`) the kernel runs integer
    dot products on 8-bit-rounded inputs (csrc/quant_int.h: the same bits on
    AVX2 and AVX-512); on the portable build it computes with the bfloat16
    values bf16((d * q) + m) (Q4_0: bf16(d * (q - 8))), bitwise. codes: uint8
    [ceil(out / 64) * 64 * in / 2], two per byte, in the build's layout;
    scales: float16 [ceil(out / 64), in / group, 2, 64] (per panel of 64
    outputs and group, d then m; Q4_0's m is -8 d). ``perm`` (int32 [in], or
    None): the codes' input j is the activations' column perm[j] (GPTQ's
    act-order, gathered by the kernel)."""

    perm: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return super().nbytes + (0 if self.perm is None else self.perm.nbytes)


@dataclass(frozen=True)
class PackedQ8Linear(QuantPanels):
    """An 8-bit weight w = d q, q int8, one float32 d per output row and
    ``group`` inputs: a GGUF Q8_0 head's copy (float16 d per 32 inputs, read
    by calls of up to :func:`copy_max_rows` rows) or a compressed-tensors
    W8A16 layer (its group, or a whole row per channel; any row count), from
    8-9 bits per weight instead of 16: integer dot products on 8-bit-rounded
    inputs on x86 builds (csrc/quant_int.h), bitwise the bfloat16 kernel's
    results on bf16(d q) on the portable one. codes: int8 [ceil(out / 64) *
    64 * in]; scales: float32 [ceil(out / 64) * in / group * 64]."""


@dataclass(frozen=True)
class PackedW8A8Linear:
    """An int8 weight with one float32 scale per output channel whose inputs are quantized to int8
    per row at each call (compressed-tensors W8A8, ``csrc/linear_w8a8_cpu.c``): exact integer sums,
    then one float32 scale per (row, channel); every body gives the same bits, for any row count.

    Attributes:
        codes: int8 [ceil(out / 64) * 64 * in] panels ([out / 64][in / 4][64][4]).
        col_sums: int32 [ceil(out / 64) * 64], each output channel's sum of codes.
        scales: float32 [ceil(out / 64) * 64], the channels' scales (padding 0).
        out_features, in_features: the weight's shape (in a multiple of 4).
    """

    codes: torch.Tensor
    col_sums: torch.Tensor
    scales: torch.Tensor
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.col_sums.nbytes + self.scales.nbytes


@dataclass(frozen=True)
class PackedFP8Linear(QuantPanels):
    """An FP8 E4M3 weight (w = v d, v an FP8 value, d float32 per output row
    and ``group`` inputs: a per-tensor or per-channel scale is one group of
    ``in``): 8 bits per weight, tiles upcast to the bfloat16 values bf16(v d)
    and run by the bfloat16 arithmetic (these CPUs have no FP8 arithmetic), so
    every body gives its linear_bf16 bits on the dequantized weights, for any
    row count. codes: uint8 [ceil(out / 64) * 64 * in]; scales: float32
    [ceil(out / 64) * in / group * 64]."""


# QUANT_COPY_MAX_ROWS of csrc/kernels.h: on a build without integer copies, calls of up to this many rows read
# a weight's quantized copy rather than its bfloat16 panels (faster where reading the weights bounds the call;
# the same bits)
COPY_MAX_ROWS = 2
# linear_quant_int()'s 0, 1, 2 in csrc/linear_q4_cpu.c: the arithmetic of the 4-bit and int8 kernels
QUANT_BODIES = ("dequantized", "int8-avx2", "int8-avx512vnni")


def quant_body(march: str | None = None) -> str | None:
    """The arithmetic the 4-bit and int8 kernels (:class:`PackedQ4Linear`, :class:`PackedQ8Linear`) run in
    this build (:data:`QUANT_BODIES`), or None when the library does not build here: "dequantized" (the
    portable build: the bfloat16 kernel's bits on the dequantized weights) or integer dot products on
    8-bit-rounded inputs (``csrc/quant_int.h``; its AVX2 and AVX512-VNNI bodies give the same bits);
    ``march`` as :func:`kernels.cpu_build.load_library`."""
    return _quant_body(march or default_march())


@functools.lru_cache(maxsize=8)
def _quant_body(march: str) -> str | None:
    return None if why_unavailable(march) else QUANT_BODIES[load_library(march).linear_quant_int()]


def uses_amx(march: str | None = None) -> bool:
    """Whether this build's integer kernels take the block sums of calls of 16 rows or more from AMX tile
    multiplies (``csrc/quant_amx.h``: AMX-INT8 in the CPU and the build, the tile state granted by the
    kernel, ``$TANDEM_CPU_AMX`` not "0", read once per process); the same bits as the VNNI and AVX2 bodies.
    ``march`` as :func:`kernels.cpu_build.load_library`."""
    return not why_unavailable(march) and bool(load_library(march).linear_quant_amx())


def integer_copies(march: str | None = None) -> bool:
    """Whether this build's quantized copies run integer dots (every x86 build with AVX2, AVX-512 included:
    ``QUANT_COPY_EVERY_ROW`` of ``csrc/kernels.h``): their own bits, not the bfloat16 panels', the same on
    every such machine. The one question every caller asks (:func:`copy_max_rows`, the loader's log, the
    tests)."""
    return quant_body(march) in ("int8-avx2", "int8-avx512vnni")


def copy_max_rows(march: str | None = None) -> float:
    """The most rows a call may have to read a weight's quantized copy
    (:class:`PackedQ4Linear`, :class:`PackedQ8Linear`) rather than its
    bfloat16 panels: every row count (``math.inf``) where the copies run
    integer dots (:func:`integer_copies`: other bits, so a row's bits would
    otherwise depend on the batch; QUANT_COPY_EVERY_ROW of ``csrc/kernels.h``),
    else :data:`COPY_MAX_ROWS` (the copy gives the panels' bits). The model's
    linear and head methods ask once, when they are chosen (``engine.layers.linear``)."""
    return math.inf if integer_copies(march) else COPY_MAX_ROWS


def check_codes(codes: torch.Tensor) -> None:
    """Raise ValueError unless every 4-bit code is in 0..15."""
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) > 15):
        raise ValueError("4-bit codes must be in 0..15")


def check_group(k: int, group: int, where: str) -> None:
    """Raise ValueError (naming ``where``) unless ``group`` is a multiple of 32 dividing ``k``."""
    if group <= 0 or group % 32 or k % group:
        raise ValueError(f"{where} takes a group size that is a multiple of 32 dividing in_features ({k}), "
                         f"got {group}")


def pack_q8(codes: torch.Tensor, d: torch.Tensor, group: int = 32) -> PackedQ8Linear:
    """Pack an 8-bit weight w = d q: codes [out, in] int8, d [out, in / group] float32.

    Raises:
        ValueError: shapes that do not match, in not a multiple of 32, a group that does not fit.
    """
    n, k = codes.shape
    check_group(k, group, "pack_q8")
    if d.shape != (n, k // group):
        raise ValueError(f"pack_q8 takes codes [n, k] (k % 32 == 0) and d [n, k / group], got {tuple(codes.shape)}, "
                         f"{tuple(d.shape)}")
    c = codes.to(torch.int8).contiguous()
    d32 = d.to(torch.float32).contiguous()
    panels = (n + PANEL - 1) // PANEL
    out_codes = torch.empty(panels * PANEL * k, dtype=torch.int8)
    out_scales = torch.empty(panels * (k // group) * PANEL, dtype=torch.float32)
    load_library().linear_q8_pack(c.data_ptr(), d32.data_ptr(), group, n, k, out_codes.data_ptr(),
                                  out_scales.data_ptr())
    return PackedQ8Linear(out_codes, out_scales, n, k, group)


def pack_fp8(codes: torch.Tensor, d: torch.Tensor, group: int) -> PackedFP8Linear:
    """Pack an FP8 weight: codes [out, in] float8_e4m3fn (or their bytes, uint8), d [out, in / group]
    float32, w = float(codes) * d.

    Raises:
        ValueError: shapes that do not match, in not a multiple of 32, a group that does not fit.
    """
    n, k = codes.shape
    check_group(k, group, "pack_fp8")
    if d.shape != (n, k // group) or codes.dtype not in (torch.float8_e4m3fn, torch.uint8):
        raise ValueError(f"pack_fp8 takes codes [n, k] float8_e4m3fn and d [n, k / group], got {codes.dtype} "
                         f"{tuple(codes.shape)}, {tuple(d.shape)}")
    c = codes.contiguous().view(torch.uint8)
    d32 = d.to(torch.float32).contiguous()
    panels = (n + PANEL - 1) // PANEL
    out_codes = torch.empty(panels * PANEL * k, dtype=torch.uint8)
    out_scales = torch.empty(panels * (k // group) * PANEL, dtype=torch.float32)
    load_library().linear_fp8_pack(c.data_ptr(), d32.data_ptr(), group, n, k, out_codes.data_ptr(),
                                   out_scales.data_ptr())
    return PackedFP8Linear(out_codes, out_scales, n, k, group)


def pack_w8a8(codes: torch.Tensor, scales: torch.Tensor) -> PackedW8A8Linear:
    """Pack a W8A8 weight: codes [out, in] int8 (in a multiple of 4), scales [out] (or [out, 1]) float32.

    Raises:
        ValueError: shapes or dtypes that do not match.
    """
    n, k = codes.shape
    if codes.dtype != torch.int8 or k % 4 or scales.numel() != n:
        raise ValueError(f"pack_w8a8 takes codes [n, k] int8 (k % 4 == 0) and scales [n], got {codes.dtype} "
                         f"{tuple(codes.shape)}, {tuple(scales.shape)}")
    panels = (n + PANEL - 1) // PANEL
    out_codes = torch.empty(panels * PANEL * k, dtype=torch.int8)
    col_sums = torch.empty(panels * PANEL, dtype=torch.int32)
    padded = torch.zeros(panels * PANEL, dtype=torch.float32)
    padded[:n] = scales.reshape(-1).float()
    load_library().linear_w8a8_pack(codes.contiguous().data_ptr(), n, k, out_codes.data_ptr(), col_sums.data_ptr())
    return PackedW8A8Linear(out_codes, col_sums, padded, n, k)


def q4_available(march: str | None = None) -> bool:
    """Whether the 4-bit and 8-bit kernels have a fast body here (the ISAs of :func:`available`)."""
    return available(march)


def pack_q4(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, group: int = 32,
            perm: torch.Tensor | None = None) -> PackedQ4Linear:
    """Pack a 4-bit weight: w = (d * q) + m per group of ``group`` inputs
    (Q4_1), or w = d * (q - 8) when ``m`` is None (Q4_0), each operation
    rounded in float32 as the ``gguf`` package dequantizes (the kernel relies
    on d and m being float16 values, as GGUF stores them: d * q is then exact).

    Args:
        codes: [out, in] integers 0..15 (in a multiple of 32), input j of the
            codes being the activations' column ``perm[j]`` when given.
        d, m: [out, in / group] float32 scale and min of each group, float16 values.
        group: inputs per (d, m): a multiple of 32 dividing ``in`` (GGUF: 32).
        perm: int [in], a permutation of the inputs, or None (in order).

    Raises:
        ValueError: shapes that do not match, in not a multiple of 32, a group
            that does not fit, codes out of range, scales that are not float16
            values, a perm that is not a permutation.
    """
    n, k = codes.shape
    check_group(k, group, "pack_q4")
    if d.shape != (n, k // group) or (m is not None and m.shape != (n, k // group)):
        raise ValueError(f"pack_q4 takes codes [n, k] (k % 32 == 0) and d, m [n, k / group], got "
                         f"{tuple(codes.shape)}, {tuple(d.shape)}, {None if m is None else tuple(m.shape)}")
    check_codes(codes)
    if perm is not None:
        perm = perm.to(torch.int32).contiguous()
        if perm.shape != (k,) or not torch.equal(torch.sort(perm).values, torch.arange(k, dtype=torch.int32)):
            raise ValueError(f"pack_q4's perm must be a permutation of the {k} inputs")
    c = codes.to(torch.uint8).contiguous()
    d32 = d.to(torch.float32)
    m32 = -8 * d32 if m is None else m.to(torch.float32)  # Q4_0: d * (q - 8) = d * q + (-8 d), both exact
    if any(not torch.equal(t, t.half().float()) for t in (d32, m32)):
        raise ValueError("pack_q4 takes scales and mins that are float16 values (GGUF's; Q4_0's -8 d too)")
    panels = (n + PANEL - 1) // PANEL
    out_codes = torch.empty(panels * PANEL * k // 2, dtype=torch.uint8)
    load_library().linear_q4_pack(c.data_ptr(), n, k, out_codes.data_ptr())
    scales = torch.zeros(2, panels * PANEL, k // group, dtype=torch.float16)  # padded columns: d = m = 0
    scales[0, :n], scales[1, :n] = d32, m32
    out_scales = scales.view(2, panels, PANEL, k // group).permute(1, 3, 0, 2).contiguous()
    return PackedQ4Linear(out_codes, out_scales, n, k, group, perm)


def pack(weight: torch.Tensor) -> PackedLinear:
    """Pack a CPU bfloat16 weight [out, in] (in even).

    Raises:
        ValueError: not a 2-D CPU bfloat16 tensor with an even in_features.
    """
    if weight.dim() != 2 or weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or weight.shape[1] % 2:
        raise ValueError(f"cannot pack a {weight.dtype} {tuple(weight.shape)} weight on {weight.device}")
    n, k = weight.shape
    w = weight.detach().contiguous()
    data = torch.empty((n + PANEL - 1) // PANEL * PANEL * k, dtype=torch.bfloat16)
    load_library().linear_bf16_pack(w.data_ptr(), n, k, data.data_ptr())
    return PackedLinear(data, n, k)


def linear(x: torch.Tensor, packed: PackedLinear | QuantPanels | PackedW8A8Linear, bias: torch.Tensor | None = None,
           residual: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """[..., in] @ W.T (+ bias [out], added in float32) (+ residual [..., out]) -> [..., out].

    ``out_dtype`` bfloat16 rounds each sum once; float32 returns the sums
    unrounded (the model's logits: a bfloat16 logit of ~20 is only good to
    0.125, which makes ties of greedy candidates that float32 separates).

    Raises:
        ValueError: a dtype other than bfloat16 or a width that does not match.
    """
    lead = x.shape[:-1]
    if x.dtype != torch.bfloat16 or x.shape[-1] != packed.in_features:
        raise ValueError(f"linear takes bfloat16 [..., {packed.in_features}], got {x.dtype} {tuple(x.shape)}")
    x2 = rows_2d(x)
    m, n = x2.shape[0], packed.out_features
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"out_dtype must be bfloat16 or float32, got {out_dtype}")
    y = torch.empty((m, n), dtype=out_dtype)
    r2 = None
    if residual is not None:
        r2 = rows_2d(residual)
        if r2.dtype != torch.bfloat16 or r2.shape != (m, n):
            raise ValueError(f"residual must be bfloat16 [{m}, {n}], got {r2.dtype} {tuple(r2.shape)}")
    b = None if bias is None else bias.detach().to(torch.float32).contiguous()
    if not m:
        return y.view(*lead, n)
    lib, xs = load_library(), (x2.data_ptr(), x2.stride(0))
    rest = (None if b is None else b.data_ptr(), None if r2 is None else r2.data_ptr(),
            0 if r2 is None else r2.stride(0), y.data_ptr(), n, m, n, packed.in_features,
            out_dtype == torch.float32, torch.get_num_threads())
    if isinstance(packed, PackedQ4Linear):
        rc = lib.linear_q4(*xs, packed.codes.data_ptr(), packed.scales.data_ptr(), packed.group,
                           None if packed.perm is None else packed.perm.data_ptr(), *rest)
    elif isinstance(packed, PackedQ8Linear):
        rc = lib.linear_q8(*xs, packed.codes.data_ptr(), packed.scales.data_ptr(), packed.group, *rest)
    elif isinstance(packed, PackedW8A8Linear):
        rc = lib.linear_w8a8(*xs, packed.codes.data_ptr(), packed.col_sums.data_ptr(), packed.scales.data_ptr(), *rest)
    elif isinstance(packed, PackedFP8Linear):
        rc = lib.linear_fp8(*xs, packed.codes.data_ptr(), packed.scales.data_ptr(), packed.group, *rest)
    else:
        rc = lib.linear_bf16(*xs, packed.data.data_ptr(), *rest)
    if rc:
        raise (MemoryError if rc == 2 else RuntimeError)(f"the linear kernel returned {rc}")
    return y.view(*lead, n)
