"""GGUF Q4_0/Q4_1 weights run in 4 bits (engine/layers/quant_linear.py): the
scale/zero mapping is exact, the matmul matches the dequantized weight, and a
row's result does not depend on the other rows of its batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.layers.quant_linear import GGUFBlocks, Int4Linear, int4_packable

gguf = pytest.importorskip("gguf")


def _blocks(qtype: str, n: int, k: int, seed: int = 0) -> tuple[GGUFBlocks, torch.Tensor]:
    """Random weight quantized by the gguf package, and its float32 dequantization."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * 0.05 + rng.uniform(-0.02, 0.02, (n, 1))).astype(np.float32)
    qt = gguf.GGMLQuantizationType[qtype]
    data = gguf.quants.quantize(w, qt)
    return GGUFBlocks(qtype, (n, k), data), torch.from_numpy(np.array(gguf.quants.dequantize(data, qt)))


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_scale_and_zero_reproduce_dequantization(qtype):
    blocks, ref = _blocks(qtype, 48, 96)
    codes, scales, zeros = blocks.codes_scales_zeros()
    assert codes.dtype == torch.int32 and int(codes.min()) >= 0 and int(codes.max()) <= 15
    w = ((codes.float() - 8).view(48, 3, 32) * scales[..., None] + zeros[..., None]).view(48, 96)
    torch.testing.assert_close(w, ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(blocks.dequantize(), ref, atol=0, rtol=0)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_dequantize_is_the_gguf_packages_bit_for_bit(qtype):
    """GGUFBlocks.dequantize (torch, whole tensors) against the gguf package's numpy dequantization, on rows
    whose magnitudes span 1e-7..1e4 (subnormal float16 scales, Q4_1 mins that round) and a real checkpoint's."""
    rng = np.random.default_rng(7)
    w = (rng.standard_normal((64, 256)) * np.logspace(-7, 4, 64)[:, None]
         + rng.uniform(-1, 1, (64, 1)) * np.logspace(-7, 4, 64)[:, None]).astype(np.float32)
    qt = gguf.GGMLQuantizationType[qtype]
    blocks = GGUFBlocks(qtype, (64, 256), gguf.quants.quantize(w, qt))
    assert torch.equal(blocks.dequantize(), torch.from_numpy(np.array(gguf.quants.dequantize(blocks.data, qt))))


def test_dequantize_matches_the_package_on_smollm2():
    from engine.config import default_model_path
    from engine.gguf_file import open_gguf

    checked = set()
    for t in open_gguf(default_model_path()).tensors[:12]:
        if t.tensor_type.name in ("Q4_0", "Q4_1", "Q8_0"):
            blocks = GGUFBlocks(t.tensor_type.name, tuple(int(x) for x in reversed(t.shape.tolist())), t.data)
            ref = gguf.quants.dequantize(blocks.data, t.tensor_type).reshape(blocks.shape)
            assert torch.equal(blocks.dequantize(), torch.from_numpy(np.ascontiguousarray(ref, dtype=np.float32)))
            checked.add(blocks.qtype)
    assert checked == {"Q4_1", "Q8_0"}


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_int4_linear_matches_dequantized_weight(qtype):
    (a, wa), (b, wb) = _blocks(qtype, 32, 64, 1), _blocks(qtype, 16, 64, 2)
    w = torch.cat([wa, wb])  # two pieces stacked along output rows, as fused q/k/v
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    bias, residual = torch.randn(48), torch.randn(5, 48)
    lin = Int4Linear([a, b], torch.float32)
    assert (lin.out_features, lin.in_features) == (48, 64)
    assert lin.nbytes <= w.numel()  # <= 8 bits a weight: 4-bit codes, float32 (d, m) per 32, padded panels
    torch.testing.assert_close(lin(x), x @ w.t(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lin(x, bias, residual), residual + (x @ w.t() + bias), atol=1e-5, rtol=1e-5)
    lin16 = Int4Linear([a, b], torch.bfloat16)
    y = lin16(x.bfloat16().view(1, 5, 64))
    assert y.shape == (1, 5, 48) and y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float().view(5, 48), x @ w.t(), atol=0.05, rtol=0.05)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("k", [576, 1536])
def test_row_result_independent_of_batch_size(dtype, k):
    """Batch invariance: one row alone and inside batches of 1..128 rows, at
    several positions, gives the same bits."""
    blocks, _ = _blocks("Q4_1", 64, k, 3)
    lin = Int4Linear([blocks], dtype)
    gen = torch.Generator().manual_seed(1)
    row = torch.randn(1, k, generator=gen).to(dtype)
    alone = lin(row)[0]
    for m in range(1, 129):
        batch = torch.randn(m, k, generator=gen).to(dtype)
        for pos in {0, m // 2, m - 1}:
            batch[pos] = row[0]
            assert torch.equal(lin(batch)[pos], alone), (m, pos)


def test_packable_shapes():
    q40 = GGUFBlocks("Q4_0", (16, 64), np.zeros((16, 2 * 18), np.uint8))
    q41 = GGUFBlocks("Q4_1", (16, 64), np.zeros((16, 2 * 20), np.uint8))
    q80 = GGUFBlocks("Q8_0", (16, 64), np.zeros((16, 2 * 34), np.uint8))
    assert int4_packable([q40, q41])
    assert not int4_packable([q40, q80])  # a Q8_0 part: dequantized instead
    assert not int4_packable([GGUFBlocks("Q4_0", (8, 64), np.zeros((8, 36), np.uint8))])  # 8 rows: kernel needs 16k
    assert not int4_packable([])
    with pytest.raises(ValueError, match="not a 4-bit type"):
        q80.codes_scales_zeros()
    with pytest.raises(ValueError, match="does not encode"):
        GGUFBlocks("Q4_0", (16, 64), np.zeros((16, 10), np.uint8)).codes_scales_zeros()


def test_quantization_gguf_needs_a_gguf_on_cpu(tmp_path):
    from engine.config import EngineArgs
    from engine.model_loader import load_model
    from tests.tiny_models import save_byte_level_llama

    path = save_byte_level_llama(tmp_path)
    with pytest.raises(ValueError, match="needs a .gguf model on CPU"):
        load_model(EngineArgs(model=path, device="cpu", quantization="gguf"))
    with pytest.raises(ValueError, match="quantization must be one of none, gguf, gptq, awq, compressed-tensors"):
        EngineArgs(model=path, quantization="q4")


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_c_kernel_gives_the_dequantized_bfloat16_weights_bits(monkeypatch, qtype):
    """The portable build's 4-bit kernel (kernels/csrc/linear_q4_cpu.c, quant_f32.h) on Int4Linear's
    packing of GGUF blocks: its results equal, bit for bit, the bfloat16 kernel's on the weights the
    loader dequantizes (gguf's float32 dequantization rounded to bfloat16) for every row count, with
    bias, residual and float32 output. (The x86 builds run integer dots instead, with their own bits:
    tests/test_quant_int.py.) 5 bits a weight where this CPU packs them."""
    from kernels import cpu_linear
    from kernels.cpu_build import MARCH_ENV

    (a, wa), (b, wb) = _blocks(qtype, 96, 576, 4), _blocks(qtype, 64, 576, 5)
    lin = Int4Linear([a, b], torch.bfloat16)
    if lin.c_packed is not None:
        # 5 bits per weight (codes + float16 d, m per 32), 160 outputs padded to 3 panels of 64: 0.375x of bf16
        assert lin.nbytes == 192 * 576 // 2 + 192 * (576 // 32) * 2 * 2 < 0.4 * 160 * 576 * 2
    monkeypatch.setenv(MARCH_ENV, "x86-64")
    if cpu_linear.quant_body() != "dequantized":
        pytest.skip("no portable C build here")
    codes, d, m = (torch.cat(t) for t in zip(a.codes_d_m(), b.codes_d_m()))
    packed = cpu_linear.pack_q4(codes, d, m.half().float() if qtype == "Q4_1" else None)
    dense = cpu_linear.pack(torch.cat([wa, wb]).bfloat16())
    gen = torch.Generator().manual_seed(3)
    bias = torch.randn(160, generator=gen).bfloat16()
    for rows in (1, 2, 3, 4, 7, 50, 130):
        x = torch.randn(rows, 576, generator=gen).bfloat16()
        residual = torch.randn(rows, 160, generator=gen).bfloat16()
        assert torch.equal(cpu_linear.linear(x, packed), cpu_linear.linear(x, dense))
        assert torch.equal(cpu_linear.linear(x, packed, bias, residual), cpu_linear.linear(x, dense, bias, residual))
        assert torch.equal(cpu_linear.linear(x, packed, out_dtype=torch.float32),
                           cpu_linear.linear(x, dense, out_dtype=torch.float32))
    with pytest.raises(ValueError, match="pack_q4 takes"):
        cpu_linear.pack_q4(torch.zeros(4, 48, dtype=torch.int32), torch.zeros(4, 1), None)
    with pytest.raises(ValueError, match="0..15"):
        cpu_linear.pack_q4(torch.full((4, 32), 16), torch.zeros(4, 1), None)
    with pytest.raises(ValueError, match="float16 values"):
        cpu_linear.pack_q4(torch.zeros(4, 32, dtype=torch.int32), torch.full((4, 1), 0.1), None)


def _checkpoint_piece(n: int, k: int, group: int, g_idx: torch.Tensor | None, sym: bool, seed: int):
    """A random GPTQ-style Int4Weight (group size ``group``, each input's group ``g_idx``, or in
    order) as grouped_int4 makes it, and the bfloat16 weights the 4-bit kernel computes with, in the
    inputs' order: bf16(d q + m) with m = -z d rounded to float16 (asymmetric)."""
    from engine.quantization.int4 import grouped_int4

    gen = torch.Generator().manual_seed(seed)
    groups = k // group
    codes = torch.randint(0, 16, (n, k), generator=gen)
    zeros = torch.full((groups, n), 8) if sym else torch.randint(0, 17, (groups, n), generator=gen)
    scales = (torch.rand(groups, n, generator=gen) * 0.02 + 1e-3).half()
    piece = grouped_int4(codes, zeros, scales, g_idx, "test")
    g = torch.arange(k) // group if g_idx is None else g_idx
    d = scales.float().t()[:, g]
    m = (-zeros.float() * scales.float()).half().float().t()[:, g]
    return piece, (codes * d + m).bfloat16()


@pytest.mark.parametrize("march", ["native", "x86-64"])
@pytest.mark.parametrize("group, act_order, sym", [(64, False, False), (128, True, False), (128, True, True),
                                                   (640, False, False), (32, True, False)])
def test_checkpoint_groups_and_act_order_give_the_dequantized_bfloat16_bits(monkeypatch, march, group, act_order,
                                                                           sym):
    """The 4-bit kernel at a checkpoint's group size (one float16 d, m per group, not per 32 inputs)
    and with GPTQ's act-order (the codes sorted by group, the kernel gathering the activations'
    columns to match): bitwise the bfloat16 kernel's results on the dequantized weights in the
    codes' input order and the activations' columns gathered, in the portable build (this CPU's own
    where its copies dequantize), two pieces stacked as a fused projection; the scales cost 4 bytes
    per group and 64 outputs, not per 32 inputs. The integer builds (every x86 build with AVX2) are
    pinned to their model in tests/test_quant_int.py."""
    from kernels import cpu_linear
    from kernels.cpu_build import MARCH_ENV

    monkeypatch.setenv(MARCH_ENV, march)
    if cpu_linear.quant_body() != "dequantized":
        pytest.skip(f"the {march} build runs integer dots ({cpu_linear.quant_body()}): tests/test_quant_int.py")
    k = 640
    g_idx = None
    if act_order:  # one order for the fused pieces: q/k/v (gate/up) read one input, GPTQ gives them one
        g_idx = torch.empty(k, dtype=torch.int64)
        g_idx[torch.randperm(k, generator=torch.Generator().manual_seed(0))] = torch.arange(k) // group
    a, wa = _checkpoint_piece(96, k, group, g_idx, sym, 1)
    b, wb = _checkpoint_piece(64, k, group, g_idx, sym, 2)
    assert (a.perm is not None) == act_order
    if cpu_linear.isa() == "portable":  # Int4Linear packs for the fast bodies only: pack as it would
        codes, d, m = (torch.cat(t) for t in zip(a.codes_d_m(), b.codes_d_m()))
        packed = cpu_linear.pack_q4(codes, d, None if sym else m.half().float(), group, a.perm)
    else:
        packed = Int4Linear([a, b], torch.bfloat16).c_packed
    assert packed.group == group and packed.scales.numel() == 3 * 64 * (k // group) * 2
    order = torch.arange(k) if a.perm is None else a.perm
    dense = cpu_linear.pack(torch.cat([wa, wb])[:, order].contiguous())
    gen = torch.Generator().manual_seed(3)
    bias = torch.randn(160, generator=gen).bfloat16()
    for rows in (1, 2, 3, 4, 7, 50):
        x = torch.randn(rows, k, generator=gen).bfloat16()
        xo = x[:, order].contiguous()
        residual = torch.randn(rows, 160, generator=gen).bfloat16()
        assert torch.equal(cpu_linear.linear(x, packed, bias, residual), cpu_linear.linear(xo, dense, bias, residual))
        assert torch.equal(cpu_linear.linear(x, packed, out_dtype=torch.float32),
                           cpu_linear.linear(xo, dense, out_dtype=torch.float32))
