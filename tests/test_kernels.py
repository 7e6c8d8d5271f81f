"""Attention kernels against a float64 reference: the C kernel of the "cpu"
backend (its AVX512-BF16 build where the CPU has one, and the portable build),
the PyTorch path and the Triton kernels in Triton's interpreter.

Interpreter approach: TRITON_INTERPRET=1 only works when it is set before
``triton`` is first imported (triton wraps its standard library, tl.max,
tl.sum..., at import). So, on a machine without CUDA, this module sets it at
import time if nothing has imported triton yet; the Triton cases then run in
this process. If triton was already imported in compiled mode (another test
module imported it first), the in-process Triton cases skip and
``test_triton_cases_in_subprocess`` runs them in a child pytest with the
variable set from the start, so they run exactly once either way. Setting the
variable is harmless for the rest of a CPU-only pytest process: nothing can
launch compiled Triton kernels there, and the engine's "auto" backend is the
C kernel (or the PyTorch path) on CPU. With CUDA the variable is left alone (kernels run
compiled; these tests then still check the CPU paths).

Every case draws fresh random inputs (never zeros), shuffles the block table,
fills unused cache blocks with random values, poisons the output with NaN
before the run and checks that every element was written. fp32 tolerance:
||out - ref|| / ||ref|| < 1e-5.
"""

from __future__ import annotations

import os
import sys

if "triton" not in sys.modules and not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")


import json
import subprocess

import pytest
import torch

from kernels import get_attention_backend
from kernels.reference import (
    default_scale,
    reference_paged_attention,
    reference_reshape_and_cache,
    relative_error,
)

TOL = 1e-5
BACKENDS = ["cpu", "torch", "triton"]


def triton_in_process() -> bool:
    """True when Triton's interpreter works in this process."""
    try:
        from kernels.triton_jit import interpreter_active
    except ImportError:
        return False
    return interpreter_active()


def require_triton_interpreter():
    pytest.importorskip("triton")
    if not triton_in_process():
        pytest.skip("triton was imported before TRITON_INTERPRET=1: covered by test_triton_cases_in_subprocess")


@pytest.fixture
def backend(request):
    """The backend under test; the Triton one runs in the interpreter."""
    if request.param == "triton":
        require_triton_interpreter()
    return get_attention_backend(request.param, "cpu")


def make_case(seed, seq_lens, query_lens, num_heads, num_kv_heads, head_dim=64, block_size=16, spare_blocks=5):
    """Random paged caches holding ``seq_lens`` tokens per sequence under a shuffled block table.

    Returns a dict of the paged_attention arguments (float32, CPU). Block
    table entries past a sequence's last block are -1 (never read).
    """
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [(n + block_size - 1) // block_size for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=g)
    value_cache = torch.randn(shape, generator=g)
    perm = torch.randperm(num_blocks, generator=g).to(torch.int32)
    block_tables = torch.full((len(seq_lens), max(blocks_per_seq) + 1), -1, dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_per_seq):
        block_tables[i, :n] = perm[used : used + n]
        used += n
    query_start_loc = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.tensor(query_lens).cumsum(0)
    query = torch.randn((int(query_start_loc[-1]), num_heads, head_dim), generator=g)
    return dict(
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        query_start_loc=query_start_loc,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables,
        scale=default_scale(head_dim),
    )


def check_attention(fn, case, **kw):
    ref = reference_paged_attention(**case)
    out = torch.full_like(case["query"], float("nan"))
    res = fn(**case, out=out, **kw)
    assert res is out
    assert torch.isfinite(out).all(), "some output elements were not written"
    err = relative_error(out, ref)
    assert err < TOL, err
    return out


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("seq_len", [1, 15, 16, 17, 200])
def test_decode_single_context_length(backend, seq_len):
    case = make_case(seq_len, [seq_len], [1], num_heads=9, num_kv_heads=3)
    check_attention(backend.paged_attention, case)


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3), (8, 2)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_mixed_lengths_gqa_block_sizes(backend, num_heads, num_kv_heads, block_size):
    lens = [200, 1, 17, 15, 16, 33]
    case = make_case(100 + num_heads + block_size, lens, [1] * len(lens), num_heads, num_kv_heads, block_size=block_size)
    check_attention(backend.paged_attention, case)


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("head_dim", [32, 128])
def test_other_head_dims(backend, head_dim):
    case = make_case(7 + head_dim, [17, 40], [1, 5], num_heads=8, num_kv_heads=2, head_dim=head_dim)
    check_attention(backend.paged_attention, case)


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("block_size", [16, 32])
def test_prefill_chunk_mid_prompt_with_decodes(backend, block_size):
    # seq 0: a 23-token chunk starting at position 30; seq 2: a whole 17-token
    # prompt; seq 4: a 2-token chunk at the end of a 200-token prompt.
    lens = [53, 16, 17, 1, 200, 15]
    qlens = [23, 1, 17, 1, 2, 1]
    case = make_case(block_size, lens, qlens, num_heads=9, num_kv_heads=3, block_size=block_size)
    check_attention(backend.paged_attention, case)


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_sequence_without_queries_is_skipped(backend):
    case = make_case(3, [20, 30, 5], [2, 0, 1], num_heads=4, num_kv_heads=2)
    check_attention(backend.paged_attention, case)


@pytest.mark.parametrize("window, softcap", [(8, None), (20, None), (None, 1.5), (8, 1.5)])
def test_torch_path_window_and_softcap(window, softcap):
    """The PyTorch kernel's sliding window and soft-capped scores (what engine/layers/attention.py takes from it
    for Mistral and Gemma) against the float64 reference: decodes and prefill chunks, windows shorter than some
    contexts and longer than others."""
    from kernels import torch_attention

    case = make_case(31, [53, 16, 7, 1, 200, 15], [23, 1, 7, 1, 2, 1], num_heads=9, num_kv_heads=3)
    ref = reference_paged_attention(**case, window=window, softcap=softcap)
    plan = torch_attention.plan_attention(case["key_cache"], 9, case["query_start_loc"], case["seq_lens"],
                                          case["block_tables"], window)
    out = torch_attention.paged_attention(**case, plan=plan, softcap=softcap)
    assert relative_error(out, ref) < TOL
    assert relative_error(out, reference_paged_attention(**case)) > 1e-3    # the window or the cap mattered


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_torch_path_half_precision(dtype):
    """The CPU path in 16-bit caches: same result as the float64 reference within 1e-2."""
    case = make_case(9, [200, 1, 17, 53], [1, 1, 1, 9], num_heads=9, num_kv_heads=3)
    for name in ("query", "key_cache", "value_cache"):
        case[name] = case[name].to(dtype)
    ref = reference_paged_attention(**case)
    out = get_attention_backend("torch", "cpu").paged_attention(**case)
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert relative_error(out, ref) < 1e-2


@pytest.mark.parametrize("march", ["native", "x86-64-v3"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block_size", [8, 32])
def test_cpu_kernel_builds(march, dtype, block_size):
    """Both builds of the C kernel (this CPU's, with its AVX512-BF16 paths
    where it has them, and the portable one) in both dtypes, prefill and
    decode rows mixed, GQA, block sizes of 32 and of 8 (under 16 the scores
    take the portable path in every build): float64 reference within 1e-5
    (float32) or 1e-2 (bfloat16)."""
    from kernels import cpu_attention

    case = make_case(31, [200, 1, 17, 53, 90], [1, 1, 1, 9, 90], num_heads=9, num_kv_heads=3,
                     block_size=block_size)
    for name in ("query", "key_cache", "value_cache"):
        case[name] = case[name].to(dtype)
    ref = reference_paged_attention(**case)
    out = torch.full_like(case["query"], float("nan"))
    assert cpu_attention.paged_attention(**case, out=out, march=march) is out
    assert torch.isfinite(out).all()
    assert relative_error(out, ref) < (1e-5 if dtype == torch.float32 else 1e-2)


def test_cpu_backend_choice(monkeypatch, tmp_path, caplog):
    """auto takes the C kernel where it builds and takes the model's dtype and
    heads, else the PyTorch path with a warning; asking for "cpu" where it
    cannot run is an error that says why."""
    from kernels import cpu_build

    assert get_attention_backend("auto", "cpu", dtype=torch.bfloat16, heads=(9, 3, 64)).name == "cpu"
    assert get_attention_backend("auto", "cpu", dtype=torch.float16, heads=(9, 3, 64)).name == "torch"
    assert get_attention_backend("auto", "cpu", dtype=torch.float32, heads=(9, 3, 40)).name == "torch"
    with pytest.raises(ValueError, match="does not take torch.float16"):
        get_attention_backend("cpu", "cpu", dtype=torch.float16, heads=(9, 3, 64))
    with pytest.raises(ValueError, match="not cuda"):
        get_attention_backend("cpu", "cuda")
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("TANDEM_KERNEL_CACHE", str(tmp_path))
    cpu_build._load_library.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="kernels"):
            assert get_attention_backend("auto", "cpu").name == "torch"
        assert "C kernel is not available" in caplog.text and "no-such-compiler" in caplog.text
        with pytest.raises(RuntimeError, match="no-such-compiler"):
            get_attention_backend("cpu", "cpu")
    finally:
        cpu_build._load_library.cache_clear()


def test_cpu_kernel_rejects_what_it_cannot_read():
    from kernels import cpu_attention

    case = make_case(2, [20], [1], num_heads=4, num_kv_heads=2)
    with pytest.raises(ValueError, match="does not take torch.float16"):
        cpu_attention.paged_attention(**{**case, "query": case["query"].half(), "key_cache": case["key_cache"].half(),
                                         "value_cache": case["value_cache"].half()})
    with pytest.raises(ValueError, match="contiguous"):
        cpu_attention.paged_attention(**{**case, "key_cache": case["key_cache"].transpose(0, 1)})
    with pytest.raises(ValueError, match="out must be"):
        cpu_attention.paged_attention(**case, out=torch.empty(2, 4, 64))


def test_triton_float16():
    """16-bit inputs with float32 accumulation (fp16: bf16 arithmetic is broken in the interpreter)."""
    require_triton_interpreter()
    case = make_case(21, [200, 17, 40], [1, 1, 6], num_heads=8, num_kv_heads=2)
    for name in ("query", "key_cache", "value_cache"):
        case[name] = case[name].half()
    ref = reference_paged_attention(**case)
    out = get_attention_backend("triton", "cpu").paged_attention(**case)
    assert out.dtype == torch.float16 and torch.isfinite(out).all()
    assert relative_error(out, ref) < 1e-2


@pytest.mark.parametrize("num_splits", [2, 8])
def test_triton_split_kv(num_splits):
    require_triton_interpreter()
    from kernels import triton_attention

    # Decodes, including lengths shorter than one tile per split, and a prefill chunk.
    case = make_case(11 + num_splits, [200, 1, 17, 64, 53], [1, 1, 1, 1, 7], num_heads=9, num_kv_heads=3)
    check_attention(triton_attention.paged_attention, case, num_splits=num_splits, tile_n=16)


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_list_metadata(backend):
    case = make_case(5, [17, 3], [1, 3], num_heads=4, num_kv_heads=1)
    case["query_start_loc"] = case["query_start_loc"].tolist()
    case["seq_lens"] = case["seq_lens"].tolist()
    check_attention(backend.paged_attention, case)


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("block_size", [16, 32])
def test_reshape_and_cache(backend, block_size):
    g = torch.Generator().manual_seed(block_size)
    num_blocks, num_kv_heads, head_dim, num_tokens = 6, 3, 64, 37
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(cache_shape, generator=g)
    value_cache = torch.randn(cache_shape, generator=g)
    # Keys and values as slices of a fused qkv projection (non-contiguous tokens).
    qkv = torch.randn((num_tokens, 9 + 2 * num_kv_heads, head_dim), generator=g)
    key, value = qkv[:, 9 : 9 + num_kv_heads], qkv[:, 9 + num_kv_heads :]
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[[0, 5, 36]] = -1  # padding
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    reference_reshape_and_cache(key, value, expected_k, expected_v, slots)
    backend.reshape_and_cache(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, expected_k)
    assert torch.equal(value_cache, expected_v)


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_write_then_attend(backend):
    """A prefill then a decode step through both kernels, against the reference."""
    g = torch.Generator().manual_seed(42)
    block_size, num_heads, num_kv_heads, head_dim = 16, 9, 3, 64
    key_cache = torch.randn((8, block_size, num_kv_heads, head_dim), generator=g)
    value_cache = torch.randn_like(key_cache)
    block_tables = torch.tensor([[5, 2, 7], [1, 6, -1]], dtype=torch.int32)
    # Step 1: prompts of 35 and 20 tokens (the second padded with 3 -1 slots).
    steps = [([35, 20], [35, 20], 3), ([36, 21], [1, 1], 0)]
    for seq_lens, qlens, pad in steps:
        slots = []
        for i, (n, q) in enumerate(zip(seq_lens, qlens)):
            slots += [int(block_tables[i, p // block_size]) * block_size + p % block_size for p in range(n - q, n)]
        slots += [-1] * pad
        num_tokens = len(slots)
        key = torch.randn((num_tokens, num_kv_heads, head_dim), generator=g)
        value = torch.randn_like(key)
        backend.reshape_and_cache(key, value, key_cache, value_cache, torch.tensor(slots))
        query = torch.randn((sum(qlens), num_heads, head_dim), generator=g)
        case = dict(
            query=query,
            key_cache=key_cache,
            value_cache=value_cache,
            query_start_loc=torch.tensor([0, qlens[0], sum(qlens)], dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=block_tables,
            scale=default_scale(head_dim),
        )
        check_attention(backend.paged_attention, case)


def test_backend_selection(monkeypatch):
    assert get_attention_backend("auto", "cpu").name == "cpu"  # the C kernel: this box has a compiler
    assert get_attention_backend("torch", torch.device("cpu")).name == "torch"
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_attention_backend("flash", "cpu")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        get_attention_backend("triton", "cpu")


def test_triton_on_cpu_without_interpreter_is_a_clear_error():
    """In a fresh process without TRITON_INTERPRET, both entry points say what to do."""
    pytest.importorskip("triton")
    code = """
import torch
from kernels import get_attention_backend, triton_attention
try:
    get_attention_backend("triton", "cpu")
except RuntimeError as e:
    assert "TRITON_INTERPRET=1" in str(e), e
else:
    raise SystemExit("get_attention_backend did not raise")
q = torch.randn(1, 2, 16)
kc = torch.randn(1, 16, 1, 16)
bt = torch.zeros(1, 1, dtype=torch.int32)
try:
    triton_attention.paged_attention(q, kc, kc, torch.tensor([0, 1]), torch.tensor([1]), bt, 0.25)
except RuntimeError as e:
    assert "CUDA device" in str(e) and "TRITON_INTERPRET=1" in str(e), e
else:
    raise SystemExit("paged_attention did not raise")
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_triton_cases_in_subprocess():
    """The Triton cases, when this process cannot run the interpreter (see module docstring)."""
    pytest.importorskip("triton")
    if triton_in_process():
        pytest.skip("the Triton cases run in this process")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "triton and not subprocess and not clear_error"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]


def test_split_rule():
    pytest.importorskip("triton")
    from kernels.triton_attention import choose_num_splits

    # Long-context decode of one sequence on 132 SMs: split.
    assert choose_num_splits(1, 1, 8, 32768, 132) == 16
    # Short contexts, prefill batches, or enough programs already: no split.
    assert choose_num_splits(1, 1, 8, 512, 132) == 1
    assert choose_num_splits(100, 4, 8, 32768, 132) == 1
    assert choose_num_splits(64, 64, 8, 4096, 132) == 1
    n = choose_num_splits(4, 4, 8, 4096, 132)
    assert 1 < n <= 8 and n & (n - 1) == 0


def test_bench_dry_run(tmp_path):
    """loadtests/bench/kernels_gpu.py's CPU-independent parts: shape list, JSON and markdown writing."""
    proc = subprocess.run(
        [sys.executable, "-m", "loadtests.bench.kernels_gpu", "--dry-run", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads((tmp_path / "kernels_bench.json").read_text())
    shapes = {(r["num_seqs"], r["context_len"]) for r in data["decode"]}
    assert shapes == {(b, c) for b in (1, 16, 64, 256) for c in (512, 4096, 32768)}
    table = (tmp_path / "kernels_bench.md").read_text()
    assert "| 64 | 4096 |" in table
    assert table.count("\n|") >= 2 + len(shapes)


def test_bench_report_with_results(tmp_path):
    """The report writer with measured values (what a GPU run fills in)."""
    from loadtests.bench.kernels_gpu import DecodeResult, Report, write_report

    r = DecodeResult(64, 4096, 64 * 4096 * 4096, status="ok", triton_us=250.0, num_splits=1, triton_nosplit_us=250.0,
                     triton_split_us=300.0, forced_splits=8, sdpa_us=220.0, triton_gbps=4295.0,
                     triton_frac_copy=0.8, sdpa_gbps=4880.0, sdpa_frac_copy=0.9, tile_n_us={32: 250.0, 64: 240.0})
    report = Report(device="test", dry_run=False, copy_gbps=5368.7, decode=[r],
                    checks=[dict(name="decode", dtype="bfloat16", rel_err=3e-3, ok=True)])
    json_path, md_path = write_report(report, tmp_path)
    assert json.loads(json_path.read_text())["decode"][0]["triton_frac_copy"] == 0.8
    row = next(line for line in md_path.read_text().splitlines() if line.startswith("| 64 |"))
    assert "| 250.0 |" in row and "| 80 |" in row and "300.0 (8)" in row and "| 1.14 |" in row, row
    assert "64: 240.0 µs" in md_path.read_text()


@pytest.mark.slow
def test_kernels_compile_for_cuda():
    """The compiled (non-interpreter) pipeline down to PTX/cubin for sm_90, no GPU needed.

    Compiled kernels are kept in Triton's own cache under the C kernels' cache
    dir (``$TANDEM_KERNEL_CACHE``), not a fresh temporary dir: Triton keys each
    entry by the kernel's source (and its line number), the signature and
    constexprs, Triton's own sources and library, the target (CUDA arch) and
    ptxas version, so an unchanged tree checks from the cache while a changed
    kernel, Triton or target compiles again; a failed compile stores nothing.
    """
    pytest.importorskip("triton")
    from kernels.cpu_build import _cache_dir

    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TRITON_ALWAYS_COMPILE")}
    env["TRITON_CACHE_DIR"] = str(_cache_dir() / "triton-compile-check")
    proc = subprocess.run(
        [sys.executable, "-m", "loadtests.bench.compile_check", "--arch", "90"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    from loadtests.bench.compile_check import configurations

    assert proc.stdout.count("cubin") == len(configurations()) >= 12, proc.stdout
