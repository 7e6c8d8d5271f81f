"""GPU check and benchmark of the Triton attention kernels.

    python -m loadtests.bench.kernels_gpu --out bench_out          # on a CUDA machine, < 5 minutes
    python -m loadtests.bench.kernels_gpu --out bench_out --dry-run  # anywhere: shape list and report files only

1. Correctness: each kernel (reshape_and_cache, paged attention without and
   with split-KV) against the float64 reference in bf16 and fp16, relative
   error ||out - ref|| / ||ref|| < 1e-2, on small mixed prefill/decode batches.
2. Decode timing with ``triton.testing.do_bench`` (median): batches of
   1, 16, 64, 256 sequences x contexts 512, 4096, 32768 tokens, Llama-3-8B
   attention shapes (32 query heads, 8 KV heads, head_dim 128), bf16,
   block_size 16. Achieved bandwidth = bytes of K and V read / time, shown as
   a fraction of the device-to-device copy bandwidth measured in the same run
   (copy bandwidth = 2 x bytes copied / time). Baseline: PyTorch SDPA over
   contiguous [num_seqs, kv_heads, context, head_dim] keys and values (the
   query heads of a KV head folded into the query axis, so no GQA expansion).
   Combinations that do not fit in free device memory are skipped.

Writes ``kernels_bench.json`` and ``kernels_bench.md`` to --out.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

BATCHES = (1, 16, 64, 256)
CONTEXTS = (512, 4096, 32768)
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
CHECK_TOL = 1e-2


@dataclass
class DecodeResult:
    """One timed decode batch; times in microseconds, bandwidths in GB/s."""

    num_seqs: int
    context_len: int
    kv_bytes: int
    status: str = "pending"  # ok | skipped: <why>
    triton_us: float | None = None
    num_splits: int | None = None
    triton_nosplit_us: float | None = None
    triton_split_us: float | None = None
    forced_splits: int | None = None
    sdpa_us: float | None = None
    triton_gbps: float | None = None
    triton_frac_copy: float | None = None
    sdpa_gbps: float | None = None
    sdpa_frac_copy: float | None = None
    tile_n_us: dict[int, float] | None = None  # no-split time per key tile size (64 x 4k only)


@dataclass
class Report:
    device: str
    dry_run: bool
    copy_gbps: float | None = None
    checks: list[dict] = field(default_factory=list)
    decode: list[DecodeResult] = field(default_factory=list)
    elapsed_s: float = 0.0


def decode_shapes() -> list[DecodeResult]:
    """All (num_seqs, context_len) combinations with the bytes of K and V they read."""
    per_token = 2 * NUM_KV_HEADS * HEAD_DIM * 2  # K and V, bf16
    return [DecodeResult(b, c, b * c * per_token) for b in BATCHES for c in CONTEXTS]


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def write_report(report: Report, out_dir: Path) -> tuple[Path, Path]:
    """Write kernels_bench.json and kernels_bench.md into ``out_dir``; returns both paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    data = asdict(report)
    json_path = out_dir / "kernels_bench.json"
    json_path.write_text(json.dumps(data, indent=2))
    lines = [
        f"# Paged attention decode, {report.device}",
        "",
        f"Heads {NUM_HEADS}/{NUM_KV_HEADS} (query/KV), head_dim {HEAD_DIM}, bf16, block_size {BLOCK_SIZE}. "
        f"Measured device copy bandwidth: {_fmt(report.copy_gbps, '.0f')} GB/s. Median of triton.testing.do_bench.",
        "",
        "| seqs | context | KV MiB | triton µs | splits | % copy BW | no-split µs | split µs (n) | SDPA µs | SDPA % copy BW | triton/SDPA | status |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in report.decode:
        ratio = r.triton_us / r.sdpa_us if r.triton_us and r.sdpa_us else None
        split = f"{_fmt(r.triton_split_us, '.1f')} ({r.forced_splits})" if r.forced_splits else "-"
        lines.append(
            f"| {r.num_seqs} | {r.context_len} | {r.kv_bytes / 2**20:.0f} | {_fmt(r.triton_us, '.1f')} | "
            f"{_fmt(r.num_splits, 'd')} | {_fmt(r.triton_frac_copy and 100 * r.triton_frac_copy, '.0f')} | "
            f"{_fmt(r.triton_nosplit_us, '.1f')} | {split} | {_fmt(r.sdpa_us, '.1f')} | "
            f"{_fmt(r.sdpa_frac_copy and 100 * r.sdpa_frac_copy, '.0f')} | {_fmt(ratio, '.2f')} | {r.status} |"
        )
    for r in report.decode:
        if r.tile_n_us:
            sweep = ", ".join(f"{n}: {us:.1f} µs" for n, us in r.tile_n_us.items())
            lines += ["", f"Key tile size (TILE_N) at {r.num_seqs} x {r.context_len}, no split: {sweep}"]
    lines += ["", "## Correctness (relative error vs float64 reference)", ""]
    lines += ["| check | dtype | rel err | ok |", "|---|---|---:|---|"]
    for c in report.checks:
        lines.append(f"| {c['name']} | {c['dtype']} | {c['rel_err']:.2e} | {c['ok']} |")
    lines += ["", f"Elapsed: {report.elapsed_s:.0f} s"]
    md_path = out_dir / "kernels_bench.md"
    md_path.write_text("\n".join(lines) + "\n")
    return json_path, md_path


def _random_case(seq_lens, query_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, device, gen):
    """Paged inputs with a shuffled block table (as tests/test_kernels.py, on ``device``)."""
    blocks = [(n + block_size - 1) // block_size for n in seq_lens]
    num_blocks = sum(blocks) + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=gen).to(device, dtype)
    value_cache = torch.randn(shape, generator=gen).to(device, dtype)
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    block_tables = torch.zeros((len(seq_lens), max(blocks)), dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks):
        block_tables[i, :n] = perm[used : used + n]
        used += n
    qsl = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(query_lens).cumsum(0)
    query = torch.randn((int(qsl[-1]), num_heads, head_dim), generator=gen).to(device, dtype)
    return dict(
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        query_start_loc=qsl.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        scale=head_dim**-0.5,
    )


CHECK_CONFIGS = [  # (name, seq_lens, query_lens, heads, kv_heads, head_dim, block_size, num_splits)
    ("decode mixed, 32/8 heads, d128, bs16", [1, 15, 16, 17, 200, 1000], [1] * 6, 32, 8, 128, 16, 1),
    ("prefill chunk + decodes, 9/3 heads, d64, bs32", [300, 17, 64, 1], [45, 1, 64, 1], 9, 3, 64, 32, 1),
    ("split-KV decode, 32/8 heads, d128, bs16", [3000, 17, 700], [1, 1, 1], 32, 8, 128, 16, 8),
]


def run_checks(device: torch.device, configs: list[tuple] | None = None,
               dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16)) -> list[dict]:
    """Each kernel against the float64 reference in each of ``dtypes``, on
    ``configs`` (default ``CHECK_CONFIGS``; smaller ones and float16 only
    suit Triton's interpreter on CPU, which miscomputes bfloat16)."""
    from kernels import triton_attention
    from kernels.reference import reference_paged_attention, reference_reshape_and_cache, relative_error

    checks = []
    gen = torch.Generator().manual_seed(0)
    configs = CHECK_CONFIGS if configs is None else configs
    for dtype in dtypes:
        for name, lens, qlens, h, kvh, d, bs, splits in configs:
            case = _random_case(lens, qlens, h, kvh, d, bs, dtype, device, gen)
            out = torch.full_like(case["query"], float("nan"))
            triton_attention.paged_attention(**case, out=out, num_splits=splits)
            cpu_case = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in case.items()}
            ref = reference_paged_attention(**cpu_case)
            err = relative_error(out, ref) if torch.isfinite(out).all() else math.inf
            checks.append(dict(name=name, dtype=str(dtype).removeprefix("torch."), rel_err=err, ok=err < CHECK_TOL))
        # reshape_and_cache is a copy: exact.
        key = torch.randn((100, 8, 128), generator=gen).to(device, dtype)
        value = torch.randn((100, 8, 128), generator=gen).to(device, dtype)
        slots = torch.randperm(64 * 16, generator=gen)[:100]
        slots[::7] = -1
        kc = torch.randn((64, 16, 8, 128), generator=gen).to(device, dtype)
        vc = torch.randn_like(kc)
        ek, ev = kc.cpu(), vc.cpu()
        reference_reshape_and_cache(key.cpu(), value.cpu(), ek, ev, slots)
        triton_attention.reshape_and_cache(key, value, kc, vc, slots.to(device))
        err = relative_error(torch.cat([kc, vc]), torch.cat([ek, ev]))
        checks.append(dict(name="reshape_and_cache", dtype=str(dtype).removeprefix("torch."), rel_err=err, ok=err == 0.0))
    return checks


def measure_copy_gbps(device: torch.device) -> float:
    """Device-to-device copy bandwidth in GB/s (read + write bytes / time)."""
    from triton.testing import do_bench

    src = torch.empty(2 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), return_mode="median")
    del src, dst
    torch.cuda.empty_cache()
    return 2 * (2 << 30) / (ms * 1e-3) / 1e9


def time_decode(r: DecodeResult, device: torch.device, copy_gbps: float) -> None:
    """Fill in ``r`` with triton (auto, no split, forced split) and SDPA timings."""
    import torch.nn.functional as F
    from triton.testing import do_bench

    from kernels import triton_attention

    b, ctx = r.num_seqs, r.context_len
    free, _ = torch.cuda.mem_get_info(device)
    # Paged K/V + contiguous K/V for SDPA + slack.
    if 2 * r.kv_bytes + (1 << 30) > 0.9 * free:
        r.status = f"skipped: needs {2 * r.kv_bytes / 2**30:.0f} GiB, {free / 2**30:.0f} GiB free"
        return
    dtype = torch.bfloat16
    blocks_per_seq = ctx // BLOCK_SIZE
    num_blocks = b * blocks_per_seq
    key_cache = torch.randn((num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), dtype=dtype, device=device)
    value_cache = torch.randn_like(key_cache)
    block_tables = torch.randperm(num_blocks, device=device, dtype=torch.int64).to(torch.int32).view(b, blocks_per_seq)
    query = torch.randn((b, NUM_HEADS, HEAD_DIM), dtype=dtype, device=device)
    qsl = torch.arange(b + 1, dtype=torch.int32, device=device)
    seq_lens = torch.full((b,), ctx, dtype=torch.int32, device=device)
    out = torch.empty_like(query)
    args = (query, key_cache, value_cache, qsl, seq_lens, block_tables, HEAD_DIM**-0.5)

    def bench(fn):
        return 1e3 * do_bench(fn, warmup=10, rep=50, return_mode="median")

    r.num_splits = triton_attention.choose_num_splits(
        b, b, NUM_KV_HEADS, ctx, torch.cuda.get_device_properties(device).multi_processor_count
    )
    r.triton_us = bench(lambda: triton_attention.paged_attention(*args, out=out))
    r.triton_nosplit_us = bench(lambda: triton_attention.paged_attention(*args, out=out, num_splits=1))
    r.forced_splits = r.num_splits if r.num_splits > 1 else 8
    r.triton_split_us = bench(lambda: triton_attention.paged_attention(*args, out=out, num_splits=r.forced_splits))
    if (b, ctx) == (64, 4096):  # the target case: how the key tile size matters
        r.tile_n_us = {
            n: bench(lambda n=n: triton_attention.paged_attention(*args, out=out, num_splits=1, tile_n=n))
            for n in (16, 32, 64, 128)
        }

    # Baseline: the same keys/values, contiguous per sequence and head (built
    # one at a time, freeing each paged cache, to keep the peak near 2x K+V).
    del args
    k = key_cache[block_tables.long()].view(b, ctx, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
    del key_cache
    v = value_cache[block_tables.long()].view(b, ctx, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
    del value_cache
    q = query.view(b, NUM_KV_HEADS, NUM_HEADS // NUM_KV_HEADS, HEAD_DIM)
    r.sdpa_us = bench(lambda: F.scaled_dot_product_attention(q, k, v))
    del k, v
    torch.cuda.empty_cache()
    r.triton_gbps = r.kv_bytes / (r.triton_us * 1e-6) / 1e9
    r.sdpa_gbps = r.kv_bytes / (r.sdpa_us * 1e-6) / 1e9
    r.triton_frac_copy = r.triton_gbps / copy_gbps
    r.sdpa_frac_copy = r.sdpa_gbps / copy_gbps
    r.status = "ok"


def main(argv: list[str] | None = None) -> int:
    """Run checks and timings (or only the report plumbing with --dry-run); exit 1 if a check fails."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("bench_out"), help="directory for kernels_bench.{json,md}")
    p.add_argument("--dry-run", action="store_true", help="no GPU: list the shapes and write the report files")
    p.add_argument("--budget-s", type=float, default=240.0, help="skip remaining timings after this many seconds")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    if args.dry_run:
        report = Report(device=f"dry run on {platform.machine()}", dry_run=True, decode=decode_shapes())
        for r in report.decode:
            r.status = "skipped: dry run"
    else:
        if not torch.cuda.is_available():
            print("loadtests.bench.kernels_gpu needs a CUDA device (use --dry-run to test the plumbing)", file=sys.stderr)
            return 2
        device = torch.device("cuda")
        report = Report(device=torch.cuda.get_device_name(device), dry_run=False, decode=decode_shapes())
        report.checks = run_checks(device)
        for c in report.checks:
            print(f"check {c['name']} {c['dtype']}: rel err {c['rel_err']:.2e} {'ok' if c['ok'] else 'FAIL'}", flush=True)
        report.copy_gbps = measure_copy_gbps(device)
        print(f"copy bandwidth {report.copy_gbps:.0f} GB/s", flush=True)
        for r in report.decode:
            if time.perf_counter() - t0 > args.budget_s:
                r.status = "skipped: time budget"
                continue
            try:
                time_decode(r, device, report.copy_gbps)
            except torch.cuda.OutOfMemoryError:
                r.status = "skipped: out of memory"
                torch.cuda.empty_cache()
            print(f"decode {r.num_seqs} x {r.context_len}: triton {_fmt(r.triton_us, '.1f')} us "
                  f"sdpa {_fmt(r.sdpa_us, '.1f')} us {r.status}", flush=True)
    report.elapsed_s = time.perf_counter() - t0
    json_path, md_path = write_report(report, args.out)
    print(md_path.read_text())
    print(f"wrote {json_path} and {md_path}")
    return 0 if all(c["ok"] for c in report.checks) else 1


if __name__ == "__main__":
    sys.exit(main())
