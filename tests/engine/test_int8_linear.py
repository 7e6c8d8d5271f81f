"""The W8A8 int8 kernel (kernels/csrc/linear_w8a8_cpu.c) on each body (AVX512-VNNI where this CPU
has it, AVX2 built with -march=x86-64-v3, portable C built with -march=x86-64) against a float64
model of its arithmetic (per-token quantization, exact integer sums, one float32 scale per (row,
channel), bias, residual): bitwise, for every row count and thread count (batch-invariant), and
the same bits on every body; the engine's PyTorch path of the layer (float32 models, other
devices) is that model too."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_linear
from kernels.cpu_build import MARCH_ENV, why_unavailable


def _model(x: torch.Tensor, codes: torch.Tensor, sw: torch.Tensor, bias=None, residual=None) -> torch.Tensor:
    """float32 [m, n]: the kernel's steps, each float32 operation done here in float32 (IEEE, one
    rounding each) and the integer sums in float64 (exact)."""
    xf = x.float()
    amax = xf.abs().amax(dim=1, keepdim=True)
    inv = torch.where(amax != 0, torch.tensor(127.0) / amax, torch.zeros(()))
    q = torch.round(xf * inv).clamp(-127, 127)  # half to even
    sx = amax / torch.tensor(127.0)
    acc = q.double() @ codes.double().t()  # exact integers
    assert acc.abs().max() < 2**31
    y = acc.float() * (sx * sw.reshape(1, -1).float())
    if bias is not None:
        y = y + bias.float()
    if residual is not None:
        y = y + residual.float()
    return y


def _case(n: int, k: int, m: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int32).to(torch.int8)
    sw = torch.rand(n, generator=g) * 0.01 + 1e-4
    x = (torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 4).bfloat16()
    x[0] = 0  # a row of zeros: scale 0, codes 0
    x[1, :8] = torch.tensor([127.0, 2.5, -3.5, 0.5, -0.5, 1.5, 126.5, -127.0])  # ties: to even
    x[1, 8:] = 0
    return codes, sw, x


@pytest.fixture(params=["native", "x86-64-v3", "x86-64"])
def body(request, monkeypatch):
    """Each build of the kernels this CPU runs: its own (AVX512-VNNI here), AVX2, portable."""
    monkeypatch.setenv(MARCH_ENV, request.param)
    if why_unavailable(request.param):
        pytest.skip(f"the kernels do not build for -march={request.param}")
    return request.param


def test_w8a8_kernel_is_its_float64_model_bitwise_for_every_row_count(body):
    """Per-token quantization with ties to even, the integer sums, the scales, bias and residual,
    bfloat16 and float32 outputs: bitwise the model; each row alone gives the batch's bits at 1 and
    2 threads; padded output columns (200 = 3 panels and 8) and inputs not a multiple of 32."""
    n, k, m = 200, 260, 9
    codes, sw, x = _case(n, k, m, 0)
    g = torch.Generator().manual_seed(1)
    bias = torch.randn(n, generator=g)
    residual = torch.randn(m, n, generator=g).bfloat16()
    packed = cpu_linear.pack_w8a8(codes, sw)
    for b, r in [(None, None), (bias, None), (bias, residual)]:
        want = _model(x, codes, sw, b, r)
        got = cpu_linear.linear(x, packed, b, r, out_dtype=torch.float32)
        assert torch.equal(got, want)
        assert torch.equal(cpu_linear.linear(x, packed, b, r), want.bfloat16())
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            batched = cpu_linear.linear(x, packed, bias, residual)
            for i in range(m):
                alone = cpu_linear.linear(x[i:i + 1], packed, bias, residual[i:i + 1])
                assert torch.equal(alone[0], batched[i])
    finally:
        torch.set_num_threads(threads)


def test_w8a8_bodies_agree_and_the_model_is_near_the_exact_product(monkeypatch):
    """Every body gives the same bits (the sums are exact); they are within float32 rounding of the
    float64 product of the per-token dequantized activations and the dequantized weights."""
    codes, sw, x = _case(130, 512, 5, 2)
    outs = []
    for march in ("native", "x86-64-v3", "x86-64"):
        if why_unavailable(march):
            continue
        monkeypatch.setenv(MARCH_ENV, march)
        outs.append(cpu_linear.linear(x, cpu_linear.pack_w8a8(codes, sw), out_dtype=torch.float32))
    assert len(outs) >= 2 and all(torch.equal(o, outs[0]) for o in outs)
    xf = x.float()
    amax = xf.abs().amax(1, keepdim=True)
    q = torch.round(xf * torch.where(amax != 0, torch.tensor(127.0) / amax, torch.zeros(())))
    exact = (q.double() * (amax / torch.tensor(127.0)).double()) @ (codes.double() * sw.double()[:, None]).t()
    assert torch.allclose(outs[0].double(), exact, rtol=1e-5, atol=1e-5 * exact.abs().max().item())


def test_w8a8_layer_torch_path_is_the_kernel(body):
    """``Int8Linear``'s PyTorch path (float32 models and devices without the kernel) computes the
    same steps: the kernel's bits from bfloat16 inputs."""
    from engine.layers.int8_linear import w8a8_torch
    from engine.quantization.int8 import Int8Weight

    codes, sw, x = _case(70, 96, 6, 3)
    bias = torch.randn(70)
    w = Int8Weight(codes, sw.reshape(-1, 1), 96, activations="token")
    got = w8a8_torch(x.float(), w, bias)
    assert torch.equal(got, _model(x, codes, sw, bias))
    assert torch.equal(got.bfloat16(), cpu_linear.linear(x, cpu_linear.pack_w8a8(codes, sw), bias))


def test_pack_w8a8_refuses_what_it_cannot_take():
    with pytest.raises(ValueError, match="pack_w8a8 takes"):
        cpu_linear.pack_w8a8(torch.zeros(8, 30, dtype=torch.int8), torch.ones(8))
    with pytest.raises(ValueError, match="pack_w8a8 takes"):
        cpu_linear.pack_w8a8(torch.zeros(8, 32, dtype=torch.int32), torch.ones(8))
