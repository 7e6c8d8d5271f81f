"""The AVX512-VNNI body of the integer quantized kernels (kernels/csrc/quant_int512.h) against the AVX2 body
(quant_int.h, built with ``-march=x86-64-v3`` on the same CPU), bit for bit: 4-bit (Q4_1, Q4_0, a
checkpoint's group with act-order) and 8-bit (Q8_0, W8A16 groups) weights, row counts from a decode step's
to a prefill's, bias, residual, both output dtypes, partial panels, and the decoder stack's team entry
(linear_q4_team). One arithmetic, two ISAs: an output that differs in one bit fails."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_linear
from kernels.cpu_build import MARCH_ENV, load_library

BUILDS = ("native", "x86-64-v3")
ROWS = (1, 2, 3, 4, 7, 8, 9, 17, 64, 130)


@pytest.fixture(autouse=True)
def _vnni():
    if cpu_linear.quant_body("native") != "int8-avx512vnni" or cpu_linear.quant_body("x86-64-v3") != "int8-avx2":
        pytest.skip("needs a CPU with AVX512-VNNI (it runs the AVX2 build too): "
                    f"native {cpu_linear.quant_body('native')}, x86-64-v3 {cpu_linear.quant_body('x86-64-v3')}")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


def _inputs(rows: int, k: int, n: int, g: torch.Generator):
    """Activations with the rows' awkward blocks: all zero (amax 0), one large value among small ones,
    and values that round to 8 bits at a tie; bias float32, residual bfloat16."""
    x = torch.randn(rows, k, generator=g)
    x[0, :32] = 0
    if k >= 96:
        x[-1, 32:64] *= 1e-3
        x[-1, 40] = 300.0
        x[-1, 64:96] = torch.arange(32) - 15.5  # x * 127 / 16.5 near halves
    return x.bfloat16(), torch.randn(n, generator=g), torch.randn(rows, n, generator=g).bfloat16()


def _each_build(monkeypatch, pack, calls) -> dict[str, list[torch.Tensor]]:
    """calls(packed) on each build, its weight packed there by pack()."""
    out = {}
    for march in BUILDS:
        monkeypatch.setenv(MARCH_ENV, march)
        out[march] = calls(pack())
    return out


def _linear_calls(x, bias, residual):
    return lambda packed: [cpu_linear.linear(x, packed, bias, residual),
                           cpu_linear.linear(x, packed, None, residual, out_dtype=torch.float32),
                           cpu_linear.linear(x, packed, bias, None, out_dtype=torch.float32),
                           cpu_linear.linear(x, packed)]


def _same(outs: dict[str, list[torch.Tensor]], what) -> None:
    for a, b in zip(*outs.values(), strict=True):
        assert torch.equal(_bits(a), _bits(b)), (what, (a.float() - b.float()).abs().max().item())


@pytest.mark.parametrize("kind, group, n, k", [("q4_1", 32, 203, 320), ("q4_0", 32, 150, 576),
                                               ("q4_1", 64, 130, 256), ("q4_perm", 128, 203, 512)])
def test_4bit_kernels_give_the_avx2_bits(monkeypatch, kind, group, n, k):
    g = torch.Generator().manual_seed(group + n)
    codes = torch.randint(0, 16, (n, k), generator=g)
    d = (torch.rand(n, k // group, generator=g) * 0.02 + 1e-3).half().float()
    m = None if kind == "q4_0" else (-torch.rand(n, k // group, generator=g) * 0.1).half().float()
    perm = torch.randperm(k, generator=g) if kind == "q4_perm" else None
    for rows in ROWS:
        x, bias, residual = _inputs(rows, k, n, g)
        outs = _each_build(monkeypatch, lambda: cpu_linear.pack_q4(codes, d, m, group, perm),
                           _linear_calls(x, bias, residual))
        _same(outs, (kind, rows))


@pytest.mark.parametrize("group, n, k", [(32, 203, 320), (64, 150, 256), (128, 70, 384)])
def test_8bit_kernels_give_the_avx2_bits(monkeypatch, group, n, k):
    """Q8_0 (group 32) and compressed-tensors W8A16 groups; codes over the whole int8 range (-128 too)."""
    g = torch.Generator().manual_seed(group + n)
    codes = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int32).to(torch.int8)
    codes[0, :32] = -128
    d = torch.rand(n, k // group, generator=g) * 0.02 + 1e-4
    for rows in ROWS:
        x, bias, residual = _inputs(rows, k, n, g)
        outs = _each_build(monkeypatch, lambda: cpu_linear.pack_q8(codes, d, group), _linear_calls(x, bias, residual))
        _same(outs, rows)


def test_the_team_entry_gives_the_avx2_bits_and_linear_q4s(monkeypatch):
    """linear_q4_team (decoder_cpu.c's one-region decode step; called here outside any region, so one
    thread takes every item) on 1-3 rows: each build's equals its linear_q4, and the builds equal
    each other, bias and residual included."""
    g = torch.Generator().manual_seed(7)
    n, k, group = 203, 576, 32
    codes = torch.randint(0, 16, (n, k), generator=g)
    d = (torch.rand(n, k // group, generator=g) * 0.02 + 1e-3).half().float()
    m = (-torch.rand(n, k // group, generator=g) * 0.1).half().float()
    outs = {}
    for march in BUILDS:
        monkeypatch.setenv(MARCH_ENV, march)
        packed, lib = cpu_linear.pack_q4(codes, d, m), load_library()
        outs[march] = []
        for rows in (1, 2, 3):
            x, bias, residual = _inputs(rows, k, n, torch.Generator().manual_seed(rows))
            y = torch.empty(rows, n, dtype=torch.bfloat16)
            rc = lib.linear_q4_team(x.data_ptr(), k, packed.codes.data_ptr(), packed.scales.data_ptr(), group,
                                    bias.data_ptr(), residual.data_ptr(), n, y.data_ptr(), n, rows, n, k)
            assert rc == 0
            assert torch.equal(y, cpu_linear.linear(x, packed, bias, residual)), (march, rows)
            outs[march].append(y)
    _same(outs, "team")
