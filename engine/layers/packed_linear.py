"""The CPU path of the model's linear layers: each bfloat16 weight packed once
for the C kernel (``kernels.cpu_linear``) or, where that cannot run, for
oneDNN, and the row tiling that keeps oneDNN's results batch-invariant.

``PackedWeights`` is one module's set of packed weights; the linear methods
(``engine.layers.linear``) call ``linear(name, x, weight, bias, residual)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels import cpu_linear, cpu_linear_f32


def c_panels_for(weight: torch.Tensor) -> bool:
    """Whether a [out, in] weight runs on the C kernel's bfloat16 panels
    (:func:`_pack_for_cpu`): bfloat16 on CPU, ``in`` even, a fast C body here."""
    return weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and weight.shape[-1] % 2 == 0 \
        and cpu_linear.available()


def _pack_for_cpu(weight: torch.Tensor) -> torch.Tensor | cpu_linear.PackedLinear | cpu_linear_f32.PackedF32Linear \
        | None:
    """A packed copy of a bfloat16 or float32 [out, in] CPU weight, or None.

    On a CPU with AVX512-BF16 or AVX2/FMA (and a C compiler): the C
    kernel's panels (:mod:`kernels.cpu_linear`), batch-invariant for every
    row count; on AVX512-BF16 faster than oneDNN at every row count
    measured, on AVX2 in place of oneDNN's slow bfloat16 path there (the
    weights widened to float32 in registers). Elsewhere oneDNN's
    blocked copy: ``torch.ops.mkldnn._linear_pointwise`` on it computes
    exactly ``F.linear`` (same bits) but skips oneDNN's per-call weight
    reorder (10-20 % faster at decode and prefill sizes, ~2x at batch 1).
    float32 on those CPUs: the float32 C kernel's panels (``kernels.cpu_linear_f32``: one
    fused-multiply-add chain per output, row-invariant, so no tiles zero-padded to 32 rows as MKL
    needs); elsewhere ``F.linear`` (MKL; oneDNN's float32 results differ in the last bits). The C panels
    replace the dense weights once packed (``LlamaForCausalLM.prepack_weights``); oneDNN's copy doubles them.
    """
    if weight.device.type != "cpu":
        return None
    if weight.dtype == torch.float32:
        return cpu_linear_f32.pack_f32(weight.detach()) if cpu_linear.available() else None
    if weight.dtype != torch.bfloat16:
        return None
    if c_panels_for(weight):
        return cpu_linear.pack(weight)
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
    except (AttributeError, RuntimeError):
        return None


# Rows per matmul call in batch-invariant mode. oneDNN picks its bfloat16
# GEMM kernel (and its K blocking) from the number of rows M: on an
# AMX/AVX512-BF16 CPU every M <= 32 gives each row the same bits, larger M
# switches kernels. Feeding every linear layer tiles of at most this many
# rows makes a row's result independent of the batch it is in, and the same
# for a prompt position and a generated one: a token's keys and values have
# the same bits whether it was computed in a prompt, a decode or a recompute,
# so the prefix cache can serve a conversation's earlier answer to its next
# turn. (Zero-padded 128-row AMX tiles for prompt rows were up to 2x faster
# in the linears but made prompt and generated positions differ; prefill is
# dominated by attention at long prompts, so one tile kind costs little.)
ROW_TILE = 32


def check_row_invariance(weight: torch.Tensor, packed: torch.Tensor | None, with_residual: bool,
                         tile: int = ROW_TILE) -> bool:
    """Whether ``x @ weight.T`` (plus a residual when ``with_residual``)
    through the path :class:`PackedWeights` uses gives every row the same
    bits for every row count 1..``tile`` (random inputs).

    Args:
        weight: [out, in] linear weight (bfloat16 or float32, CPU).
        packed: its oneDNN-packed copy, or None for ``F.linear``.
        with_residual: check the fused residual-add call instead of the plain one.
        tile: the largest row count to check.

    Returns:
        True when every row of an M-row call equals the same row computed
        alone, for M = 2..tile. Cost: about 2 * ``tile`` small matmuls.
    """
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tile, weight.shape[1], generator=gen).to(weight.dtype)
    res = torch.randn(tile, weight.shape[0], generator=gen).to(weight.dtype) if with_residual else None

    def call(lo: int, hi: int) -> torch.Tensor:
        return _linear_call(x[lo:hi], weight, packed, None, None if res is None else res[lo:hi])

    alone = torch.cat([call(i, i + 1) for i in range(tile)])
    return all(torch.equal(call(0, m), alone[:m]) for m in range(2, tile + 1))


def _linear_call(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | cpu_linear.PackedLinear | None,
                 bias: torch.Tensor | None, residual: torch.Tensor | None) -> torch.Tensor:
    """One matmul call: ``x @ weight.T + bias (+ residual)``, through the packed copy when there is one."""
    if isinstance(packed, cpu_linear.PackedLinear):
        return cpu_linear.linear(x, packed, bias, residual)
    if isinstance(packed, cpu_linear_f32.PackedF32Linear):
        return cpu_linear_f32.linear_f32(x, packed, bias, residual)
    if packed is None:
        y = F.linear(x, weight, bias)
        return y if residual is None else residual + y
    if residual is None:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return torch.ops.mkldnn._linear_pointwise.binary(x, residual, packed, bias, "add")


class PackedWeights:
    """Lazily packed copies of a module's bfloat16 linear weights
    (:func:`_pack_for_cpu`), redone when a weight is replaced or changed in
    place (its version counter moves).

    Attributes:
        batch_invariant: run CPU linears in tiles of at most ``ROW_TILE``
            rows, so that a row's output bits do not depend on how many rows
            share the call. A weight whose matmul fails
            :func:`check_row_invariance` (checked once per shape, dtype and
            call kind, in ``row_checks``) gets full, zero-padded tiles instead.
        triton_linear: the fixed-configuration Triton GEMM
            (``kernels.triton_batch_invariant.linear``) every linear runs
            through instead, in batch-invariant mode on CUDA (where cuBLAS
            picks kernels by shape); else None.
    """

    def __init__(self, row_checks: dict | None = None) -> None:
        self._entries: dict[str, tuple[torch.Tensor, int, torch.Tensor | cpu_linear.PackedLinear | None]] = {}
        self.batch_invariant = False
        self.triton_linear = None
        # (shape, dtype, packed?, residual?) -> needs padded tiles; shared by a model's layers
        self._row_checks = {} if row_checks is None else row_checks

    def get(self, name: str, weight: torch.Tensor) -> torch.Tensor | cpu_linear.PackedLinear | None:
        """The packed copy of ``weight`` (packing it now if needed), or None."""
        entry = self._entries.get(name)
        if entry is None or entry[0] is not weight or entry[1] != weight._version:
            entry = (weight, weight._version, _pack_for_cpu(weight))
            self._entries[name] = entry
        return entry[2]

    def nbytes(self) -> int:
        """Bytes of the packed copies held (the C kernel's panels, oneDNN's blocked weights)."""
        return sum(p.nbytes if isinstance(p, cpu_linear.DensePanels) else p.numel() * p.element_size()
                   for _, _, p in self._entries.values() if p is not None)

    def release_dense(self, name: str, module: nn.Module) -> None:
        """Replace ``module.weight`` by an empty parameter and keep serving
        the packed copy of ``name`` under it (see ``prepack_weights``)."""
        packed = self._entries[name][2]
        empty = nn.Parameter(module.weight.data.new_empty(0), requires_grad=False)
        module.weight = empty
        self._entries[name] = (empty, empty._version, packed)

    def _needs_padding(self, weight: torch.Tensor, packed: torch.Tensor | cpu_linear.PackedLinear | None,
                       with_residual: bool) -> bool:
        """Whether this weight's shape and call kind need full, zero-padded tiles."""
        if isinstance(packed, cpu_linear.DensePanels):
            return False  # the C kernels' panels (bfloat16, float32) are row-invariant by construction: never tiled
        key = (tuple(weight.shape), weight.dtype, packed is not None, with_residual)
        if key not in self._row_checks:
            self._row_checks[key] = not check_row_invariance(weight, packed, with_residual)
        return self._row_checks[key]

    def linear(self, name: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               residual: torch.Tensor | None = None) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` (plus ``residual`` when given) through
        the packed copy when there is one; oneDNN then adds the residual to the
        float32 accumulator before rounding. In batch-invariant mode on CPU
        the rows go in tiles of at most ``ROW_TILE`` (zero-padded to exactly
        ``ROW_TILE`` for a weight that needs it).

        Args:
            x: [num_rows, in_features]; residual: [num_rows, out_features] or None.

        Returns:
            [num_rows, out_features], x's dtype.
        """
        if self.triton_linear is not None:
            return self.triton_linear(x.contiguous(), weight, bias, residual)
        if x.device.type != "cpu":
            y = F.linear(x, weight, bias)
            return y if residual is None else residual + y
        packed = self.get(name, weight)
        if not self.batch_invariant or isinstance(packed, cpu_linear.DensePanels):  # the C kernels: any row count
            return _linear_call(x, weight, packed, bias, residual)
        pad = self._needs_padding(weight, packed, residual is not None)
        rows = x.shape[0]
        if rows <= ROW_TILE and not pad:
            return _linear_call(x, weight, packed, bias, residual)
        out = x.new_empty(rows, weight.shape[0])
        for i in range(0, rows, ROW_TILE):
            j = min(i + ROW_TILE, rows)
            xi = x[i:j]
            ri = None if residual is None else residual[i:j]
            m = j - i
            if pad and m < ROW_TILE:  # full tiles only: every call has the same shape
                xi = torch.cat([xi, xi.new_zeros(ROW_TILE - m, xi.shape[1])])
                ri = None if ri is None else torch.cat([ri, ri.new_zeros(ROW_TILE - m, ri.shape[1])])
            out[i:j] = _linear_call(xi, weight, packed, bias, ri)[:m]
        return out
