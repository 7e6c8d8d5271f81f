"""The Triton GEMM over packed weights (kernels/triton_quant_linear.py), in Triton's interpreter on CPU (or on
CUDA): for 4-bit grouped, int8 grouped and FP8 E4M3 weights, each output is bitwise the dense batch-invariant
Triton GEMM's on the weight the loader's reference dequantization gives, and a row's bits do not depend on the
row count."""

from __future__ import annotations

import pytest
import torch

from engine.quantization.fp8 import FP8Weight
from engine.quantization.int4 import Int4Weight
from engine.quantization.int8 import Int8Weight

N, K = 200, 192  # not a multiple of the 64-wide output tiles; three 64-wide K steps


@pytest.fixture(scope="module")
def kernels():
    from kernels.triton_jit import interpreter_active

    if not torch.cuda.is_available() and not interpreter_active():
        pytest.skip("triton was imported before TRITON_INTERPRET=1 (tests/conftest.py sets it first)")
    from kernels import triton_batch_invariant, triton_quant_linear

    return triton_batch_invariant, triton_quant_linear


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _int4(g: torch.Generator, group: int, symmetric: bool) -> Int4Weight:
    codes = torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)
    zeros = torch.full((N, K // group), 8, dtype=torch.int32) if symmetric else \
        torch.randint(0, 17, (N, K // group), generator=g, dtype=torch.int32)
    scales = (torch.rand(N, K // group, generator=g) * 0.02 + 1e-3).half().float()
    return Int4Weight(codes, zeros, scales, group)


def _int8(g: torch.Generator, group: int) -> Int8Weight:
    codes = torch.randint(-128, 128, (N, K), generator=g, dtype=torch.int8)
    return Int8Weight(codes, torch.rand(N, K // group, generator=g) * 1e-3 + 1e-5, group)


def _fp8(g: torch.Generator) -> FP8Weight:
    bits = torch.randint(0, 256, (N, K), generator=g, dtype=torch.uint8)
    bits[(bits & 0x7F) == 0x7F] = 0x3C  # no NaN codes here (test_fp8_codes_decode_exactly has them)
    return FP8Weight(bits.view(torch.float8_e4m3fn), torch.rand(N, 1, generator=g) * 0.05 + 1e-3)


def _packed_args(tq, weight) -> tuple:
    """(kind, codes, scales, offsets, group_size) of one weight as the kernel reads it."""
    if isinstance(weight, Int4Weight):
        codes, d, m = weight.codes_d_m()
        return tq.INT4, tq.pack_int4_codes(codes), d.contiguous(), m.contiguous(), weight.group_size
    if isinstance(weight, Int8Weight):
        return tq.INT8, weight.codes.contiguous(), weight.scales.contiguous(), None, weight.group_size
    return tq.FP8, weight.codes.view(torch.uint8).contiguous(), weight.scales.contiguous(), None, K


WEIGHTS = {
    "int4 asymmetric, groups of 64": lambda g: _int4(g, 64, symmetric=False),
    "int4 symmetric, groups of 32": lambda g: _int4(g, 32, symmetric=True),
    "int4 one group a row": lambda g: _int4(g, K, symmetric=False),
    "int8 groups of 32": lambda g: _int8(g, 32),
    "int8 one scale a row": lambda g: _int8(g, K),
    "fp8 one scale a row": _fp8,
}


# float32 runs exact products (ieee); float16 is what the interpreter can run of the half-precision path
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", list(WEIGHTS))
def test_packed_gemm_is_the_dense_gemm_on_the_reference_dequantization(kernels, name, dtype):
    bi, tq = kernels
    g = torch.Generator().manual_seed(11)
    weight = WEIGHTS[name](g)
    kind, codes, scales, offsets, group = (t.to(_device()) if isinstance(t, torch.Tensor) else t
                                           for t in _packed_args(tq, weight))
    dense = weight.dequantize().to(dtype).to(_device())
    x = torch.randn(70, K, generator=g).to(dtype).to(_device())
    bias = torch.randn(N, generator=g).to(dtype).to(_device())
    residual = torch.randn(70, N, generator=g).to(dtype).to(_device())

    full = tq.dequant_linear(x, kind, codes, scales, offsets, group, K, bias, residual)
    assert torch.equal(full, bi.linear(x, dense, bias, residual))
    rows = [0, 5, 63, 64, 69]
    alone = torch.cat([tq.dequant_linear(x[i:i + 1], kind, codes, scales, offsets, group, K, bias,
                                         residual[i:i + 1]) for i in rows])
    assert torch.equal(full[rows], alone)
    assert torch.equal(tq.dequant_linear(x[:3], kind, codes, scales, offsets, group, K), bi.linear(x[:3], dense))


def test_a_wrong_zero_point_or_group_order_changes_the_output(kernels):
    """The equality above is not vacuous: the weight with one group's zero point moved, or with two groups'
    scales swapped, gives other outputs."""
    bi, tq = kernels
    g = torch.Generator().manual_seed(12)
    weight = _int4(g, 64, symmetric=False)
    x = torch.randn(4, K, generator=g).to(_device())
    good = tq.dequant_linear(x, *_packed(tq, weight))
    shifted = Int4Weight(weight.codes, weight.zeros.clone(), weight.scales, 64)
    shifted.zeros[7, 1] = (shifted.zeros[7, 1] + 1) % 17
    swapped = Int4Weight(weight.codes, weight.zeros, weight.scales[:, [1, 0, 2]].contiguous(), 64)
    assert not torch.equal(good, tq.dequant_linear(x, *_packed(tq, shifted)))
    assert not torch.equal(good, tq.dequant_linear(x, *_packed(tq, swapped)))


def _packed(tq, weight) -> tuple:
    kind, codes, scales, offsets, group = _packed_args(tq, weight)
    dev = _device()
    return kind, codes.to(dev), scales.to(dev), None if offsets is None else offsets.to(dev), group, K


def test_fp8_codes_decode_exactly(kernels):
    """Every finite E4M3 code: a float32 identity matrix times the codes (scale 1) gives float(code) itself;
    a weight row holding 0x7F or 0xFF (NaN) gives NaN outputs."""
    _, tq = kernels
    bits = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(2, 128)
    nan_codes = (bits & 0x7F) == 0x7F
    finite = torch.where(nan_codes, bits & 0x80, bits)  # the two NaN codes replaced by +0 and -0
    eye = torch.eye(128, dtype=torch.float32).to(_device())
    ones = torch.ones(2, 1).to(_device())
    out = tq.dequant_linear(eye, tq.FP8, finite.to(_device()), ones, None, 128, 128)
    expected = finite.view(torch.float8_e4m3fn).float().T.to(_device())
    assert torch.equal(out, expected)
    assert tq.dequant_linear(eye, tq.FP8, bits.to(_device()), ones, None, 128, 128).isnan().all()


def test_refusals(kernels):
    _, tq = kernels
    x = torch.zeros(2, K)
    codes = torch.zeros(N, K, dtype=torch.int8)
    with pytest.raises(ValueError, match="do not match"):
        tq.dequant_linear(x, tq.INT8, codes, torch.ones(N, 2), None, 64, K)
    with pytest.raises(ValueError, match="offsets"):
        tq.dequant_linear(x, tq.INT8, codes, torch.ones(N, 3), torch.ones(N, 3), 64, K)
    with pytest.raises(ValueError, match="contiguous"):
        tq.dequant_linear(x.T.contiguous().T, tq.INT8, codes, torch.ones(N, 3), None, 64, K)
