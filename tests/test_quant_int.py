"""The integer bodies of the 4-bit and 8-bit kernels (kernels/csrc/quant_int.h:
integer dot products on per-row Q8_1-quantized inputs): the AVX2 body, built
with ``-march=x86-64-v3`` so that an AVX-512 CPU runs it too, and this CPU's
own (the AVX512-VNNI body, quant_int512.h, on an AVX-512 machine). Each
against a float64 model of the arithmetic, its error against the float64
product on the dequantized weights within the bound its input rounding
allows, rows whose bits do not depend on the row count or the thread count,
Q4_0 and Q4_1, bias, residual and both output dtypes, and the 8-bit head
taking any row count; and the two bodies against each other, bit for bit
(tests/test_quant_int_isa.py)."""

from __future__ import annotations

import math

import pytest
import torch

from kernels import cpu_linear
from kernels.cpu_build import MARCH_ENV


@pytest.fixture(params=["x86-64-v3", "native"])
def int_build(request, monkeypatch) -> str:
    """An integer build for the test (its quant_body; skipped where this CPU has none of that build)."""
    monkeypatch.setenv(MARCH_ENV, request.param)
    if not cpu_linear.integer_copies():
        pytest.skip(f"no integer body in the {request.param} build here ({cpu_linear.quant_body()})")
    return cpu_linear.quant_body()


def _quantize_rows(x: torch.Tensor):
    """quant_int.h's row quantization, in torch float32: qx [m, k] (integers),
    dx, sx [m, k / 32]."""
    xb = x.float().view(x.shape[0], -1, 32)
    amax = xb.abs().amax(-1)
    inv = torch.where(amax != 0, torch.tensor(127.0) / amax, torch.zeros(()))
    qx = torch.round(xb * inv[..., None])  # half to even, as the kernel's rounding mode
    dx = amax / 127.0
    return qx, dx, dx * qx.sum(-1)


def _model(x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
    """The kernel's float32 arithmetic (one fma per term, blocks in order), in
    float64 then rounded per step: [rows, n] float32."""
    qx, dx, sx = _quantize_rows(x)
    cb = codes.double().view(codes.shape[0], -1, 32)
    isum = torch.einsum("rbi,nbi->rnb", qx.double(), cb)  # exact integers
    acc = torch.zeros(x.shape[0], codes.shape[0], dtype=torch.float32)
    for b in range(cb.shape[1]):
        ddx = (d[:, b][None, :] * dx[:, b][:, None]).float()
        acc = (isum[..., b] * ddx.double() + acc.double()).float()
        if m is not None:
            acc = (m[:, b][None, :].double() * sx[:, b][:, None].double() + acc.double()).float()
    return acc


def _weights(n: int, k: int, seed: int, bits: int):
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(n, k // 32, generator=g) * 0.02 + 1e-3).half().float()
    if bits == 8:
        return torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int32).to(torch.int8), d, None
    return torch.randint(0, 16, (n, k), generator=g), d, (-torch.rand(n, k // 32, generator=g) * 0.1).half().float()


@pytest.mark.parametrize("kind", ["q4_1", "q4_0", "q8_0"])
def test_the_integer_dots_match_their_float64_model_and_the_float64_product(int_build, kind):
    """Outputs within float32 rounding of the float64 model of the kernel's
    arithmetic, and within the inputs' 8-bit rounding (|x - dx qx| <= dx / 2
    per input) of the float64 product on the dequantized weights; a partial
    last panel (n = 203) and a partial group of 8 columns included."""
    n, k, rows = 203, 160, 7
    codes, d, m = _weights(n, k, seed=3, bits=8 if kind == "q8_0" else 4)
    if kind == "q4_0":
        m = -8 * d
    packed = cpu_linear.pack_q8(codes, d) if kind == "q8_0" else \
        cpu_linear.pack_q4(codes, d, None if kind == "q4_0" else m)
    w = (d.repeat_interleave(32, 1).double() * codes.double()
         + (0 if m is None else m.repeat_interleave(32, 1).double()))
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(4)).bfloat16()
    y = cpu_linear.linear(x, packed, out_dtype=torch.float32).double()
    scale = x.double().abs() @ w.abs().T
    model = _model(x, codes, d, None if kind == "q8_0" else m).double()
    assert ((y - model).abs() <= 1e-5 * scale + 1e-30).all()
    _, dx, _ = _quantize_rows(x)
    input_bound = (dx.double() / 2) @ w.abs().view(n, -1, 32).sum(-1).T  # sum over blocks of dx/2 * sum |w|
    exact = x.double() @ w.T
    assert ((y - exact).abs() <= input_bound + 1e-5 * scale).all()
    assert ((y - exact).abs() > 1e-4 * scale).any()  # the inputs are rounded: not the bfloat16 kernel's bits


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_a_row_has_the_same_bits_for_every_row_count_and_thread_count(int_build, kind):
    """Each row alone, in batches of 2-9 rows, and on one or two threads:
    the same bits, with bias and residual, bfloat16 and float32 outputs; the
    8-bit kernel takes any row count."""
    n, k = 150, 96
    codes, d, m = _weights(n, k, seed=5, bits=8 if kind == "q8_0" else 4)
    packed = cpu_linear.pack_q8(codes, d) if kind == "q8_0" else cpu_linear.pack_q4(codes, d, m)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(9, k, generator=g).bfloat16()
    bias, residual = torch.randn(n, generator=g), torch.randn(9, n, generator=g).bfloat16()
    threads = torch.get_num_threads()
    try:
        for out in (torch.bfloat16, torch.float32):
            alone = torch.cat([cpu_linear.linear(x[r:r + 1], packed, bias, residual[r:r + 1], out_dtype=out)
                               for r in range(9)])
            for t in (1, 2):
                torch.set_num_threads(t)
                for rows in (2, 3, 4, 5, 9):
                    y = cpu_linear.linear(x[:rows], packed, bias, residual[:rows], out_dtype=out)
                    assert torch.equal(y, alone[:rows]), (out, t, rows)
    finally:
        torch.set_num_threads(threads)


def test_the_model_reads_its_copies_at_every_row_count_on_integer_builds(int_build):
    """cpu_linear.copy_max_rows: an integer build's copies serve every call (their bits are not the
    bfloat16 panels'); the portable build's calls of up to COPY_MAX_ROWS. Every x86 build with AVX2 is an
    integer build, the AVX-512 one included."""
    assert cpu_linear.copy_max_rows() == math.inf
    assert cpu_linear.copy_max_rows(march="x86-64") == cpu_linear.COPY_MAX_ROWS
    assert not cpu_linear.integer_copies("x86-64") and cpu_linear.quant_body("x86-64") == "dequantized"
    if cpu_linear.isa("native") == "avx512bf16":
        assert cpu_linear.integer_copies("native")


@pytest.mark.parametrize("group, act_order", [(64, False), (128, True), (256, False)])
def test_checkpoint_groups_and_act_order_follow_the_model(int_build, group, act_order):
    """A checkpoint's group size (one d, m per group of 64-256 inputs, not per 32) and GPTQ's
    act-order (codes in another input order, the kernel gathering the activations' columns): the
    same float64 model of the arithmetic, on the gathered inputs and each block's group scales, and
    a row's bits independent of the row count."""
    n, k, rows = 150, 512, 5
    g = torch.Generator().manual_seed(group)
    codes = torch.randint(0, 16, (n, k), generator=g)
    d = (torch.rand(n, k // group, generator=g) * 0.02 + 1e-3).half().float()
    m = (-torch.rand(n, k // group, generator=g) * 0.1).half().float()
    perm = torch.randperm(k, generator=g) if act_order else None
    packed = cpu_linear.pack_q4(codes, d, m, group, perm)
    assert packed.scales.numel() == 3 * 64 * (k // group) * 2
    x = torch.randn(rows, k, generator=g).bfloat16()
    y = cpu_linear.linear(x, packed, out_dtype=torch.float32)
    per_block = group // 32
    xo = x if perm is None else x[:, perm]
    model = _model(xo, codes, d.repeat_interleave(per_block, 1), m.repeat_interleave(per_block, 1)).double()
    w = d.repeat_interleave(group, 1).double() * codes.double() + m.repeat_interleave(group, 1).double()
    assert ((y.double() - model).abs() <= 1e-5 * (xo.double().abs() @ w.abs().T) + 1e-30).all()
    alone = torch.cat([cpu_linear.linear(x[r:r + 1], packed, out_dtype=torch.float32) for r in range(rows)])
    assert torch.equal(y, alone)
