"""The float32 kernels (kernels/csrc/linear_f32_cpu.c, kernels/cpu_linear_f32.py), dense and 4-bit: each
of their bodies (portable C, AVX2/FMA, this CPU's own) against an exact model of the rule (a 4-bit weight
rebuilt as fma(d, q, m), then one fused multiply-add per input into a float32 accumulator, then bias and
residual), bit for bit; a row's bits whatever the row and thread counts; ``Int4Linear`` in float32 running
it on an act-order checkpoint weight; and the model's float32 projections on the dense kernel."""

from __future__ import annotations

import pytest
import torch

from engine.layers.quant_linear import Int4Linear
from engine.quantization.int4 import Int4Weight
from kernels import cpu_linear, cpu_linear_f32
from kernels.cpu_build import MARCH_ENV, why_unavailable


@pytest.fixture(params=["x86-64", "x86-64-v3", "native"])
def build(request, monkeypatch) -> str:
    """The kernel library built for one -march (skipped where it does not build or run here)."""
    monkeypatch.setenv(MARCH_ENV, request.param)
    reason = why_unavailable()
    if reason:
        pytest.skip(reason)
    return request.param


def _fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fmaf(a, b, c) elementwise, exactly rounded (float32 in, float32 out): a * b is exact in float64
    (24 + 24 bits); its sum with c is rounded to float64 to odd (TwoSum's error sets the last bit), which
    then rounds to float32 as the exact sum would (53 >= 24 + 2 bits; Boldo & Melquiond, "Emulation of FMA
    and correctly rounded sums: proved algorithms using rounding to odd", IEEE TC 2008)."""
    p, c64 = a.double() * b.double(), c.double()
    s = p + c64
    bb = s - p
    err = (p - (s - bb)) + (c64 - bb)
    even = (s.view(torch.int64) & 1) == 0
    toward = torch.where(err > 0, torch.full_like(s, float("inf")), torch.full_like(s, float("-inf")))
    odd = torch.where((err != 0) & even, torch.nextafter(s, toward), s)
    return odd.float()


def _model(x, codes, d, m, group, bias, residual):
    """The 4-bit kernel's rule in torch: [rows, n] float32."""
    dd, mm = (t.repeat_interleave(group, dim=1) for t in (d, m))
    return _dense_model(x, _fma32(dd, codes.float(), mm), bias, residual)


def _dense_model(x, w, bias, residual):
    """The dense kernel's rule in torch, w [n, k]: [rows, n] float32."""
    acc = torch.zeros(x.shape[0], w.shape[0], dtype=torch.float32)
    for i in range(w.shape[1]):
        acc = _fma32(x[:, i:i + 1].expand_as(acc), w[:, i][None, :].expand_as(acc), acc)
    return residual + (acc + bias)


def _weight(n, k, group, seed):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g)
    d = (torch.rand(n, k // group, generator=g) * 0.02 + 1e-3).half().float()
    m = (-torch.rand(n, k // group, generator=g) * 0.1).half().float()
    return codes, d, m


def test_fma_model_is_exact():
    """The model's fma against cases where a separate multiply and add would round twice."""
    a = torch.tensor([1 + 2 ** -23, 3.0, 0.1], dtype=torch.float32)
    b = torch.tensor([1 - 2 ** -23, 1 / 3, 10.0], dtype=torch.float32)
    c = torch.tensor([-1.0, -1.0, -1.0], dtype=torch.float32)
    got = _fma32(a, b, c)
    assert got[0].item() == -(2.0 ** -46)  # the product's exact value 1 - 2^-46, less 1
    assert torch.equal(got, (a.double() * b.double() + c.double()).float())  # these need no rounding to odd


@pytest.mark.parametrize("n,k,group,rows", [(100, 256, 128, 7), (64, 64, 32, 1), (33, 96, 32, 4)])
def test_every_body_is_its_rule_bit_for_bit(build, n, k, group, rows):
    codes, d, m = _weight(n, k, group, n + k)
    g = torch.Generator().manual_seed(rows)
    x, bias = torch.randn(rows, k, generator=g), torch.randn(n, generator=g)
    residual = torch.randn(rows, n, generator=g)
    packed = cpu_linear_f32.pack_q4_f32(codes, d, m, group)
    assert torch.equal(cpu_linear_f32.linear_f32(x, packed, bias, residual),
                       _model(x, codes, d, m, group, bias, residual))
    zero = torch.zeros(n)
    assert torch.equal(cpu_linear_f32.linear_f32(x, packed), _model(x, codes, d, m, group, zero, zero[None]))


def test_a_row_has_its_bits_for_any_row_and_thread_count(build):
    codes, d, m = _weight(96, 192, 64, 5)
    packed = cpu_linear_f32.pack_q4_f32(codes, d, m, 64)
    g = torch.Generator().manual_seed(0)
    row = torch.randn(1, 192, generator=g)
    alone = cpu_linear_f32.linear_f32(row, packed)[0]
    threads = torch.get_num_threads()
    try:
        for rows, t in [(2, 1), (3, 2), (4, 1), (17, 2), (64, 3)]:
            torch.set_num_threads(t)
            batch = torch.randn(rows, 192, generator=g)
            batch[rows // 2] = row[0]
            assert torch.equal(cpu_linear_f32.linear_f32(batch, packed)[rows // 2], alone), (rows, t)
    finally:
        torch.set_num_threads(threads)


def test_bad_shapes_are_refused():
    codes, d, m = _weight(32, 64, 32, 0)
    with pytest.raises(ValueError, match="multiple of 32"):
        cpu_linear_f32.pack_q4_f32(codes, d, m, 48)
    with pytest.raises(ValueError, match="0..15"):
        cpu_linear_f32.pack_q4_f32(codes + 16, d, m, 32)
    packed = cpu_linear_f32.pack_q4_f32(codes, d, m, 32)
    with pytest.raises(ValueError, match="float32"):
        cpu_linear_f32.linear_f32(torch.randn(2, 64).bfloat16(), packed)
    with pytest.raises(ValueError, match="residual"):
        cpu_linear_f32.linear_f32(torch.randn(2, 64), packed, residual=torch.randn(3, 32))


@pytest.mark.skipif(not cpu_linear.q4_available(), reason="no AVX2 or AVX512-BF16 C kernels here")
def test_int4_linear_in_float32_runs_it_on_an_act_order_checkpoint_weight():
    """A GPTQ act-order weight (its inputs permuted, groups of 128) in float32: the C kernel, not
    PyTorch's int4 matmul, and the product of its reference dequantization within float32 rounding."""
    g = torch.Generator().manual_seed(3)
    n, k, group = 48, 256, 128
    weight = Int4Weight(torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8),
                        torch.randint(0, 17, (n, k // group), generator=g, dtype=torch.int32),
                        (torch.rand(n, k // group, generator=g) * 0.02 + 1e-3).half().float(), group,
                        torch.randperm(k, generator=g))
    lin = Int4Linear([weight], torch.float32)
    assert lin.f32_packed is not None and lin.packed is None
    x, residual = torch.randn(2, 3, k, generator=g), torch.randn(2, 3, n, generator=g)
    y = lin(x, residual=residual)
    assert y.shape == (2, 3, n) and y.dtype == torch.float32
    torch.testing.assert_close(y, residual + x @ weight.dequantize().t(), atol=1e-5, rtol=1e-5)
    assert torch.equal(lin(x[1:2, 1:2]), lin(x)[1:2, 1:2])


@pytest.mark.parametrize("n,k,rows", [(100, 96, 7), (32, 64, 1), (33, 40, 4)])
def test_every_dense_body_is_its_rule_bit_for_bit(build, n, k, rows):
    g = torch.Generator().manual_seed(n * k + rows)
    w, x, bias = torch.randn(n, k, generator=g), torch.randn(rows, k, generator=g), torch.randn(n, generator=g)
    residual = torch.randn(rows, n, generator=g)
    packed = cpu_linear_f32.pack_f32(w)
    assert torch.equal(cpu_linear_f32.linear_f32(x, packed, bias, residual), _dense_model(x, w, bias, residual))
    batch = torch.randn(70, k, generator=g)
    alone = torch.cat([cpu_linear_f32.linear_f32(batch[i:i + 1], packed) for i in range(70)])
    assert torch.equal(cpu_linear_f32.linear_f32(batch, packed), alone)
    torch.testing.assert_close(cpu_linear_f32.linear_f32(batch, packed), batch @ w.t(), atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not cpu_linear.q4_available(), reason="no AVX2 or AVX512-BF16 C kernels here")
def test_a_float32_model_runs_its_projections_on_the_dense_kernel(tmp_path):
    """A float32 model's projections and head are packed for it, the projections' dense weights freed
    (the HF-parity tests, tests/engine/test_engine_parity.py, check what the model computes with them)."""
    from engine.config import EngineArgs
    from engine.model_loader import load_model
    from tests.tiny_models import save_byte_level_llama

    path = save_byte_level_llama(tmp_path)
    model, _, _ = load_model(EngineArgs(model=path, device="cpu", dtype="float32"))
    model.prepack_weights()
    layer = model.layers[0]
    assert isinstance(layer.packed.get("qkv_proj", layer.qkv_proj.weight), cpu_linear_f32.PackedF32Linear)
    assert layer.qkv_proj.weight.numel() == 0
    assert isinstance(model.packed.get("lm_head", model.embed_tokens.weight if model.lm_head is None
                                       else model.lm_head.weight), cpu_linear_f32.PackedF32Linear)
