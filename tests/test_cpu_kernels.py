"""The C bfloat16 kernels besides attention (tests/test_kernels.py has that):
the linear kernel (kernels/cpu_linear.py: float64 reference, row-count
invariance without tiles, strided inputs, bias and residual, float32 logits,
the 8-bit head, the model's choice of it), on each build's body
(``linear_build``: this CPU's fastest, and the AVX2/FMA one, which an AVX-512
CPU runs too; skipped where a build has no fast body and the model keeps
oneDNN, covered by test_batch_invariance_kernels.py); the AVX2 body against
the portable C one, bit for bit; and RMSNorm and SwiGLU
(kernels/cpu_norm_act.py) against PyTorch's ops."""

from __future__ import annotations

import pytest
import torch

import torch.nn.functional as F

from kernels import cpu_linear, cpu_norm_act
from kernels.cpu_build import MARCH_ENV

# gcc -march of the builds each linear test runs on: this CPU's own (its fastest body), and x86-64-v3
# (AVX2/FMA/F16C: the AVX2 body, on an AVX-512 CPU too; on an AVX2-only CPU both are that body)
LINEAR_BUILDS = ["native", "x86-64-v3"]


@pytest.fixture(params=LINEAR_BUILDS)
def linear_build(request, monkeypatch) -> str:
    """The process's kernel build for the test ($TANDEM_CPU_MARCH); returns
    its linear body (cpu_linear.ISAS). Skips a build without a fast body."""
    monkeypatch.setenv(MARCH_ENV, request.param)
    if not cpu_linear.available():
        pytest.skip(f"the {request.param} build has no fast C linear body here ({cpu_linear.isa()})")
    return cpu_linear.isa()


def _case(n=200, k=150, m=130, seed=0):
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(n, k, generator=g) * 0.1).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16()
    x = torch.randn(m, k, generator=g).bfloat16()
    residual = torch.randn(m, n, generator=g).bfloat16()
    return weight, bias, x, residual


def test_matches_float64_with_bias_and_residual(linear_build):
    weight, bias, x, residual = _case()  # 200 columns: not a multiple of the 64-column panels
    packed = cpu_linear.pack(weight)
    for b, r in [(None, None), (bias, None), (None, residual), (bias, residual)]:
        y = cpu_linear.linear(x, packed, b, r)
        ref = x.double() @ weight.double().T
        ref = ref + (0 if b is None else b.double()) + (0 if r is None else r.double())
        assert y.dtype == torch.bfloat16 and y.shape == (130, 200)
        assert ((y.double() - ref).norm() / ref.norm()).item() < 5e-3


def test_float32_output_is_the_unrounded_sum(linear_build):
    weight, bias, x, residual = _case(seed=2)
    packed = cpu_linear.pack(weight)
    y32 = cpu_linear.linear(x, packed, bias, residual, out_dtype=torch.float32)
    y16 = cpu_linear.linear(x, packed, bias, residual)
    ref = x.double() @ weight.double().T + bias.double() + residual.double()
    assert y32.dtype == torch.float32
    assert ((y32.double() - ref).norm() / ref.norm()).item() < 1e-5  # no bfloat16 rounding of the sums
    assert torch.equal(y32.bfloat16(), y16)  # rounded once, the same bits as the bfloat16 output
    with pytest.raises(ValueError, match="out_dtype"):
        cpu_linear.linear(x, packed, out_dtype=torch.float16)


@pytest.mark.parametrize("shape", [(200, 150), (576, 1536), (49152, 576)])
def test_a_row_has_the_same_bits_for_every_row_count(linear_build, shape):
    weight, bias, x, residual = _case(*shape, m=100, seed=1)
    packed = cpu_linear.pack(weight)
    rows = [0, 5, 6, 47, 48, 99]
    alone = torch.cat([cpu_linear.linear(x[i:i + 1], packed, bias, residual[i:i + 1]) for i in rows])
    for m in (7, 49, 100):
        got = cpu_linear.linear(x[:m], packed, bias, residual[:m])
        keep = [j for j, i in enumerate(rows) if i < m]
        assert torch.equal(got[[rows[j] for j in keep]], alone[keep]), m


def test_strided_and_batched_inputs(linear_build):
    weight, _, x, residual = _case(k=150)
    packed = cpu_linear.pack(weight)
    wide = torch.cat([x, x], dim=1)[:, :150]  # rows 300 elements apart
    assert not wide.is_contiguous()
    assert torch.equal(cpu_linear.linear(wide, packed), cpu_linear.linear(x, packed))
    assert torch.equal(cpu_linear.linear(x.view(10, 13, 150), packed).view(130, 200), cpu_linear.linear(x, packed))
    assert cpu_linear.linear(x[:0], packed).shape == (0, 200)


def test_refuses_what_it_cannot_run(linear_build):
    weight, _, x, residual = _case()
    with pytest.raises(ValueError, match="cannot pack"):
        cpu_linear.pack(weight[:, :149])
    with pytest.raises(ValueError, match="cannot pack"):
        cpu_linear.pack(weight.float())
    packed = cpu_linear.pack(weight)
    with pytest.raises(ValueError, match="linear takes bfloat16"):
        cpu_linear.linear(x.float(), packed)
    with pytest.raises(ValueError, match="residual must be"):
        cpu_linear.linear(x, packed, None, residual[:3])


def test_the_model_packs_bfloat16_weights_for_it(linear_build):
    from engine.layers.packed_linear import PackedWeights

    weight, bias, x, residual = _case()
    pw = PackedWeights()
    pw.batch_invariant = True
    assert isinstance(pw.get("w", weight), cpu_linear.PackedLinear)
    assert torch.equal(pw.linear("w", x, weight, bias, residual),
                       cpu_linear.linear(x, cpu_linear.pack(weight), bias, residual))
    # float32: the float32 kernel's panels (kernels/cpu_linear_f32.py), row-invariant, never tiled
    from kernels import cpu_linear_f32

    w32, x32 = weight.float(), x.float()
    assert isinstance(pw.get("f", w32), cpu_linear_f32.PackedF32Linear)
    assert torch.equal(pw.linear("f", x32, w32, bias.float()),
                       cpu_linear_f32.linear_f32(x32, cpu_linear_f32.pack_f32(w32), bias.float()))


def test_rms_norm_is_the_float32_norm_rounded_once():
    """weight * x / rms(x) in float32, rounded once to bfloat16 (HF rounds
    twice: before and after the weight); rows in batches equal rows alone."""
    from engine.models.llama import RMSNorm

    g = torch.Generator().manual_seed(4)
    x = (torch.randn(37, 576, generator=g) * 3).bfloat16()
    weight = (torch.rand(576, generator=g) + 0.5).bfloat16()
    y = cpu_norm_act.rms_norm(x, weight, 1e-5)
    xf = x.float()
    ref = weight.float() * xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)  # unrounded
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    assert ((y.float() - ref).abs() <= ref.abs() * 2 ** -8 * 1.01 + 1e-6).all()  # within half a bfloat16 step
    assert torch.equal(torch.cat([cpu_norm_act.rms_norm(x[i:i + 1], weight, 1e-5) for i in range(37)]), y)
    assert torch.equal(cpu_norm_act.rms_norm(x.view(37, 1, 576), weight, 1e-5).view(37, 576), y)
    norm = RMSNorm(576, 1e-5).bfloat16()
    norm.weight.data.copy_(weight)
    assert torch.equal(norm(x), y)  # the model's bfloat16 CPU path is this kernel
    with pytest.raises(ValueError, match="rms_norm takes"):
        cpu_norm_act.rms_norm(x.float(), weight, 1e-5)


def test_silu_mul_matches_pytorch():
    g = torch.Generator().manual_seed(5)
    gate_up = (torch.randn(33, 2 * 1536, generator=g) * 4).bfloat16()
    y = cpu_norm_act.silu_mul(gate_up)
    gate, up = gate_up.float().split(1536, dim=-1)
    ref = F.silu(gate) * up  # float32, unrounded
    assert y.shape == (33, 1536) and y.dtype == torch.bfloat16
    assert ((y.float() - ref).abs() <= ref.abs() * 2 ** -8 + 1e-6).all()  # one rounding
    assert torch.equal(torch.cat([cpu_norm_act.silu_mul(gate_up[i:i + 1]) for i in range(33)]), y)
    with pytest.raises(ValueError, match="silu_mul takes"):
        cpu_norm_act.silu_mul(gate_up[:, :-1])


@pytest.mark.skipif(not cpu_linear.available("native"), reason="no fast C linear body on this CPU")
def test_the_engine_frees_the_dense_projections_and_generates_the_same(tmp_path, monkeypatch):
    """bfloat16 on CPU: once packed for the C kernel the decoder projections'
    dense weights are freed (not kept twice); generation is unchanged."""
    from engine.llm import LLM
    from engine.models.llama import LlamaForCausalLM
    from engine.sampling_params import SamplingParams
    from tests.tiny_models import save_byte_level_llama

    path = save_byte_level_llama(tmp_path)
    prompts = ["hello there", "a longer prompt of some forty characters!"]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def run():
        llm = LLM(model=path, dtype="bfloat16", device="cpu", kv_cache_memory=16 * 2**20)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, sp)], llm.engine.model_runner.model

    freed, model = run()
    original = LlamaForCausalLM.prepack_weights
    monkeypatch.setattr(LlamaForCausalLM, "prepack_weights", lambda self: original(self, release_dense=False))
    kept, model_kept = run()
    assert freed == kept
    assert all(getattr(layer, name).weight.numel() == 0 for layer in model.layers
               for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))
    assert model_kept.layers[0].qkv_proj.weight.numel() > 0


@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"])
def test_the_portable_build_of_rms_norm_and_silu_mul(march):
    """The non-AVX-512 code of norm_act_cpu.c (built for x86-64-v3: SwiGLU on 8
    AVX2 lanes and a scalar tail; for x86-64: all scalar): the same results as
    this CPU's build within one bfloat16 step, and each row's bits whatever
    the row count."""
    g = torch.Generator().manual_seed(6)
    x = (torch.randn(9, 576, generator=g) * 3).bfloat16()
    weight = (torch.rand(576, generator=g) + 0.5).bfloat16()
    gate_up = (torch.randn(9, 2 * 203, generator=g) * 4).bfloat16()  # 203: 25 vectors of 8 lanes and a tail of 3
    gate_up[0, :8] = torch.tensor([0.0, -0.0, 90.0, -90.0, float("inf"), float("-inf"), float("nan"), 1e-30])
    silu = cpu_norm_act.silu_mul(gate_up, march=march)
    for portable, native in [(cpu_norm_act.rms_norm(x, weight, 1e-5, march=march),
                              cpu_norm_act.rms_norm(x, weight, 1e-5)),
                             (silu, cpu_norm_act.silu_mul(gate_up))]:
        same = (portable == native) | (portable.isnan() & native.isnan())  # the infinities and NaNs too
        close = (portable.float() - native.float()).abs() <= native.float().abs() * 2 ** -7 + 1e-6
        assert (close | same).all()
    alone = torch.cat([cpu_norm_act.silu_mul(gate_up[i:i + 1], march=march) for i in range(9)])
    assert torch.equal(alone.view(torch.int16), silu.view(torch.int16))  # bitwise, NaNs included


def test_q8_head_gives_the_bfloat16_bits(monkeypatch):
    """The portable build's 8-bit (GGUF Q8_0) output-head kernel: bitwise the bfloat16 kernel on
    bf16(d * q), for 1-3 rows and 9 (compressed-tensors W8A16 layers take any row count), bfloat16
    and float32 outputs. (The x86 builds run integer dots instead: tests/test_quant_int.py.)"""
    monkeypatch.setenv(MARCH_ENV, "x86-64")
    if cpu_linear.quant_body() != "dequantized":
        pytest.skip("no portable C build here")
    g = torch.Generator().manual_seed(8)
    n, k = 300, 192
    codes = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int32).to(torch.int8)
    d = (torch.rand(n, k // 32, generator=g) * 0.02).half().float()
    dense = cpu_linear.pack((d.repeat_interleave(32, 1) * codes.float()).bfloat16())
    q8 = cpu_linear.pack_q8(codes, d)
    assert q8.nbytes < 0.6 * dense.nbytes
    for rows in (1, 2, 3, 9):
        x = torch.randn(rows, k, generator=g).bfloat16()
        for out in (torch.bfloat16, torch.float32):
            assert torch.equal(cpu_linear.linear(x, q8, out_dtype=out), cpu_linear.linear(x, dense, out_dtype=out))
    with pytest.raises(ValueError, match="pack_q8 takes"):
        cpu_linear.pack_q8(codes[:, :40], d)


@pytest.mark.parametrize("march", ["native", "x86-64-v3", "x86-64"])
def test_fp8_kernel_gives_the_bfloat16_bits_of_the_dequantized_weights(monkeypatch, march):
    """The FP8 E4M3 kernel (compressed-tensors float-quantized checkpoints): every byte value but NaN
    (subnormals, both zeros, +-448) upcast exactly, so its outputs are, bit for bit, the bfloat16
    kernel's on bf16(float(code) * scale) (torch's float8 conversion and product, the reference
    dequantization) in each build (AVX512-BF16, AVX2, portable), for 1-3 rows (in registers) and
    more (scratch panels), a scale per row (one group of all inputs) or per 32/64 inputs, bias,
    residual, both output dtypes; 8 bits a weight in memory."""
    monkeypatch.setenv(MARCH_ENV, march)
    if cpu_linear.isa() is None:
        pytest.skip("the kernels do not build here")
    g = torch.Generator().manual_seed(11)
    n, k = 150, 320
    codes = (torch.randn(n, k, generator=g) * 40).to(torch.float8_e4m3fn)
    every = torch.arange(256, dtype=torch.uint8)
    codes.view(torch.uint8)[0, :256] = torch.where((every & 0x7f) == 0x7f, 0, every)  # no NaN bytes
    bias = torch.randn(n, generator=g)
    for group in (k, 64, 32):
        d = torch.rand(n, k // group, generator=g) * 0.01 + 1e-4
        packed = cpu_linear.pack_fp8(codes, d, group)
        assert packed.codes.nbytes == 192 * k and packed.scales.numel() == 192 * (k // group)
        dense = cpu_linear.pack((codes.float() * d.repeat_interleave(group, 1)).bfloat16())
        for rows in (1, 2, 3, 4, 9, 70):
            x = torch.randn(rows, k, generator=g).bfloat16()
            residual = torch.randn(rows, n, generator=g).bfloat16()
            assert torch.equal(cpu_linear.linear(x, packed, bias, residual), cpu_linear.linear(x, dense, bias, residual))
            assert torch.equal(cpu_linear.linear(x, packed, out_dtype=torch.float32),
                               cpu_linear.linear(x, dense, out_dtype=torch.float32))
    with pytest.raises(ValueError, match="multiple of 32 dividing"):
        cpu_linear.pack_fp8(codes, torch.ones(n, 3), k // 3)


def test_the_avx2_body_gives_the_portable_bodys_bits(monkeypatch):
    """csrc/f32_panel.h's AVX2 body runs its portable C body's operations in
    the same order (one fmaf per input, in input order; bias, residual, one
    rounding): the same bits, bfloat16 and float32 outputs, 1-2 rows (whole
    panels) and more (16-column tiles), a partial last group of 8 columns.
    (The 4-bit and 8-bit kernels' x86 bodies run integer dots, not the
    portable body's dequantized panels: tests/test_quant_int.py.)"""
    if cpu_linear.isa("x86-64-v3") != "avx2" or cpu_linear.isa("x86-64") != "portable":
        pytest.skip("no x86-64 AVX2 CPU")
    weight, bias, x, residual = _case(n=203, k=96, m=9, seed=9)
    outs = {}
    for march in ("x86-64-v3", "x86-64"):
        monkeypatch.setenv(MARCH_ENV, march)
        packed = cpu_linear.pack(weight)
        outs[march] = [cpu_linear.linear(x[:m], packed, bias, residual[:m], out_dtype=out)
                       for m in (1, 2, 3, 9) for out in (torch.bfloat16, torch.float32)]
    assert all(torch.equal(a, b) for a, b in zip(outs["x86-64-v3"], outs["x86-64"]))


def test_python_row_limits_mirror_the_c_header():
    """cpu_linear's row limits are the C kernels' (csrc/kernels.h): the head
    and the decoder stack must switch to the quantized copies at the same
    row count."""
    import re
    from pathlib import Path

    header = (Path(cpu_linear.__file__).parent / "csrc" / "kernels.h").read_text()
    define = lambda name: int(re.search(rf"#define {name} (\d+)", header).group(1))  # noqa: E731
    assert cpu_linear.COPY_MAX_ROWS == define("QUANT_COPY_MAX_ROWS")


def test_ctypes_signatures_mirror_the_c_definitions():
    """kernels/cpu_build.py's SIGNATURES (what ctypes passes) match every
    exported (non-static) function defined in csrc/*.c: the same names, and
    per argument the same kind (pointer, int64_t, int, float) and return."""
    import ctypes
    import re

    from kernels import cpu_build

    kinds = {"int64_t": ctypes.c_int64, "int": ctypes.c_int, "float": ctypes.c_float, "void": None}
    defined = {}
    for src in cpu_build.SOURCES:
        text = re.sub(r"/\*.*?\*/", "", src.read_text(), flags=re.S).replace("\\\n", "\n")
        found = re.findall(r"^(int|void) (\w+)\(([^)]*)\)\s*\{", text, flags=re.M)
        macros = re.findall(r"^#define (\w+)\(NAME[^)]*\)\s+(int|void) NAME\(([^)]*)\)", text, flags=re.M)
        for macro, ret, args in macros:  # DEFINE_ATTENTION(name, ...): one function per use
            found += [(ret, name, args) for name in re.findall(rf"^{macro}\((\w+),", text, flags=re.M)]
        for ret, name, args in found:
            params = [a.strip() for a in args.split(",") if a.strip() not in ("", "void")]
            defined[name] = ([ctypes.c_void_p if "*" in a else kinds[a.rsplit(" ", 1)[0].replace("const ", "")]
                              for a in params], kinds[ret])
    assert set(defined) == set(cpu_build.SIGNATURES)
    for name, (argtypes, restype) in cpu_build.SIGNATURES.items():
        assert (argtypes, restype) == defined[name], name
