"""CPU kernels: the C kernels of ``kernels/csrc/`` against the paths they replace.

    python -m loadtests.bench.kernels_cpu [--repeats 20] [--threads 2] [--only f32]

Attention (``kernels.cpu_attention`` vs ``kernels.torch_attention``, the
PyTorch path: gather + block-diagonal bmm), SmolLM2-135M's shapes (9 query
heads, 3 KV heads, head_dim 64), bfloat16, block_size 16, shuffled block
tables in a pool larger than the caches: decode batches of 64 x ~164 and
64 x ~1150 tokens, one decode of 150, a 20 x 100-token prefill and one
2000-token prefill, and the 64 x ~164 decode over 30 layers with keys and
values coming from DRAM, as in an engine step. Linear layers (``kernels.cpu_linear`` vs oneDNN's packed
bfloat16 GEMM, ``mkldnn._linear_pointwise``) at SmolLM2's five weight shapes
and 1, 8, 32, 64 and 256 rows. The 4-bit GGUF kernel (``cpu_linear.pack_q4``)
against the bfloat16 one on the same weights, over a 30-layer pass (weights
streaming from memory) at 1, 2, 3, 8 and 64 rows. The float32 kernels
(``kernels.cpu_linear_f32``), one layer's four projections: dense against MKL's
GEMM in row tiles zero-padded to 32 rows (the engine's batch-invariant float32
path before them) at 1-512 rows, 4-bit against PyTorch's int4 matmul in float32
(``_weight_int4pack_mm_for_cpu``) at 1-64 rows. ``--only`` runs one group. Each line prints the C kernel's time over the
baseline's (medians of ``--repeats`` calls, the two interleaved call by
call), so < 1 means the C kernel is faster. OpenMP's pool sleeps between
calls (``OMP_WAIT_POLICY=PASSIVE`` unless set; set below when run as a
program, before torch loads libgomp): a spinning pool on a machine shared with
other work quantises the timings to the scheduler's slices.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

if __name__ == "__main__":   # this program's threading policy, before torch is imported (importing sets nothing)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402  (after the policy above)

from kernels import cpu_attention, cpu_linear, cpu_linear_f32, torch_attention  # noqa: E402
from kernels.reference import reference_paged_attention, relative_error  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]  # qkv, o, gate_up, down, lm_head


def interleaved_ms(a, b, repeats: int) -> tuple[float, float]:
    """Median milliseconds of ``a()`` and ``b()``, called alternately after one warm-up each."""
    a(), b()
    ta, tb = [], []
    for _ in range(repeats):
        for fn, times in ((a, ta), (b, tb)):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(ta), 1e3 * statistics.median(tb)


def attention_case(lens: list[int], q_lens: list[int], seed: int = 0) -> dict:
    """paged_attention arguments: bfloat16 caches in a pool twice the size needed, shuffled tables."""
    g = torch.Generator().manual_seed(seed)
    need = sum((n + BLOCK - 1) // BLOCK for n in lens)
    pool = 2 * need + 1
    key_cache = torch.randn((pool, BLOCK, KV_HEADS, HEAD_DIM), generator=g).bfloat16()
    value_cache = torch.randn_like(key_cache, dtype=torch.float32).bfloat16()
    perm = (torch.randperm(pool - 1, generator=g) + 1).to(torch.int32)
    width = max((n + BLOCK - 1) // BLOCK for n in lens)
    tables = torch.zeros((len(lens), width), dtype=torch.int32)
    used = 0
    for i, n in enumerate(lens):
        nb = (n + BLOCK - 1) // BLOCK
        tables[i, :nb] = perm[used:used + nb]
        used += nb
    qsl = torch.zeros(len(lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(q_lens).cumsum(0)
    query = torch.randn((int(qsl[-1]), HEADS, HEAD_DIM), generator=g).bfloat16()
    return dict(query=query, key_cache=key_cache, value_cache=value_cache, query_start_loc=qsl,
                seq_lens=torch.tensor(lens, dtype=torch.int32), block_tables=tables, scale=HEAD_DIM ** -0.5)


def bench_attention(repeats: int) -> None:
    rng = random.Random(0)
    cases = {
        "decode 64 x ~164": ([rng.randrange(100, 229) for _ in range(64)], [1] * 64),
        "decode 64 x ~1150": ([rng.randrange(1000, 1300) for _ in range(64)], [1] * 64),
        "decode 1 x 150": ([150], [1]),
        "prefill 20 x 100": ([100] * 20, [100] * 20),
        "prefill 1 x 2000": ([2000], [2000]),
    }
    for label, (lens, q_lens) in cases.items():
        case = attention_case(lens, q_lens)
        plans = {m: m.plan_attention(case["key_cache"], HEADS, case["query_start_loc"], case["seq_lens"],
                                     case["block_tables"]) for m in (cpu_attention, torch_attention)}
        c, base = interleaved_ms(lambda: cpu_attention.paged_attention(**case, plan=plans[cpu_attention]),
                                 lambda: torch_attention.paged_attention(**case, plan=plans[torch_attention]),
                                 max(2, repeats // (10 if "2000" in label or "1150" in label else 1)))
        small = {k: (v[:2] if k in ("seq_lens", "block_tables") else v) for k, v in case.items()}
        if label.startswith("decode 64"):  # accuracy on two rows, against float64
            small["query"], small["query_start_loc"] = case["query"][:2], case["query_start_loc"][:3]
            err = relative_error(cpu_attention.paged_attention(**small).double(),
                                 reference_paged_attention(**small))
            label += f" (rel. error vs float64 {err:.1e})"
        print(f"attention {label:<45} C {c:8.3f} ms  torch path {base:8.3f} ms  C/torch {c / base:.2f}x")


def bench_attention_sweep(repeats: int, layers: int = 30) -> None:
    """A decode step's attention as the engine meets it: 64 sequences of
    ~164 tokens over 30 layers, each layer its own cache, and 64 MiB (a
    step's weights, in part) streamed between two layers, so that every
    layer's keys and values come from DRAM. Prints the C kernel's time over
    the PyTorch path's and the C kernel's read rate (GB/s of K and V)."""
    rng = random.Random(0)
    lens = [rng.randrange(100, 229) for _ in range(64)]
    cases = [attention_case(lens, [1] * 64, seed=i) for i in range(layers)]
    plans = {m: [m.plan_attention(c["key_cache"], HEADS, c["query_start_loc"], c["seq_lens"], c["block_tables"])
                 for c in cases] for m in (cpu_attention, torch_attention)}  # each layer its own block tables
    junk = torch.zeros(64 << 20, dtype=torch.uint8)

    def sweep(module) -> float:  # seconds in attention only
        total = 0.0
        for case, plan in zip(cases, plans[module]):
            junk.add_(1)
            t = time.perf_counter()
            module.paged_attention(**case, plan=plan)
            total += time.perf_counter() - t
        return total

    c, base = [], []
    for _ in range(max(3, repeats // 4)):
        c.append(sweep(cpu_attention))
        base.append(sweep(torch_attention))
    c_s, base_s = statistics.median(c), statistics.median(base)
    kv_bytes = sum(lens) * KV_HEADS * HEAD_DIM * 2 * 2 * layers
    print(f"attention decode 64 x ~164, {layers} layers, K/V from DRAM  C {1e3 * c_s:8.3f} ms  torch path "
          f"{1e3 * base_s:8.3f} ms  C/torch {c_s / base_s:.2f}x  (C reads K/V at {kv_bytes / c_s / 1e9:.1f} GB/s)")


def bench_linear(repeats: int) -> None:
    g = torch.Generator().manual_seed(0)
    for n, k in SHAPES:
        weight = torch.randn((n, k), generator=g).bfloat16()
        packed = cpu_linear.pack(weight)
        onednn = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        row = []
        for m in (1, 8, 32, 64, 256):
            x = torch.randn((m, k), generator=g).bfloat16()
            c, base = interleaved_ms(lambda: cpu_linear.linear(x, packed),
                                     lambda: torch.ops.mkldnn._linear_pointwise(x, onednn, None, "none", [], ""),
                                     repeats)
            row.append(f"M={m}: {c / base:.2f}x")
        print(f"linear {n:>5} x {k:<5} C/oneDNN  " + "  ".join(row))


def bench_linear_q4(repeats: int) -> None:
    """The 4-bit GGUF kernel against the bfloat16 one on the same (dequantized)
    weights, over a 30-layer pass of SmolLM2's four projections (120 distinct
    weights, 106 M parameters: they stream from memory as in a decode step)."""
    g = torch.Generator().manual_seed(1)
    pairs = []
    for _ in range(30):
        for n, k in SHAPES[:4]:
            codes = torch.randint(0, 16, (n, k), generator=g)
            d = (torch.rand(n, k // 32, generator=g) * 0.02).half().float()
            m = (-torch.rand(n, k // 32, generator=g) * 0.1).half().float()
            dense = d.repeat_interleave(32, 1) * codes.float() + m.repeat_interleave(32, 1)
            pairs.append((cpu_linear.pack_q4(codes, d, m), cpu_linear.pack(dense.bfloat16()), k))
    row = []
    for rows in (1, 2, 3, 8, 64):
        xs = {k: torch.randn((rows, k), generator=g).bfloat16() for k in (576, 1536)}
        q4, bf16 = interleaved_ms(lambda: [cpu_linear.linear(xs[k], a) for a, _, k in pairs],
                                  lambda: [cpu_linear.linear(xs[k], b) for _, b, k in pairs], max(3, repeats // 4))
        row.append(f"M={rows}: {q4 / bf16:.2f}x")
    print("linear 4-bit/bf16, 30-layer pass  " + "  ".join(row))


def _padded_tiles(x: torch.Tensor, weight: torch.Tensor, tile: int = 32) -> torch.Tensor:
    """``F.linear`` the way the engine ran a float32 weight in batch-invariant mode before the C kernel:
    row tiles zero-padded to ``tile`` rows (engine.layers.packed_linear's ROW_TILE)."""
    rows = x.shape[0]
    out = x.new_empty(rows, weight.shape[0])
    for i in range(0, rows, tile):
        xi = x[i:i + tile]
        m = xi.shape[0]
        if m < tile:
            xi = torch.cat([xi, xi.new_zeros(tile - m, xi.shape[1])])
        out[i:i + m] = torch.nn.functional.linear(xi, weight)[:m]
    return out


def bench_linear_f32(repeats: int) -> None:
    """The float32 kernels against what they replace, on one layer of SmolLM2's four projections: dense
    weights against MKL's GEMM in row tiles zero-padded to 32 rows, 4-bit ones against PyTorch's int4
    matmul in float32 (scalar code: a 30-layer pass would take seconds a call)."""
    g = torch.Generator().manual_seed(2)
    dense, q4 = [], []
    for n, k in SHAPES[:4]:
        weight = torch.randn((n, k), generator=g) * 0.05
        dense.append((cpu_linear_f32.pack_f32(weight), weight, k))
        codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
        d = (torch.rand(n, k // 32, generator=g) * 0.02).half().float()
        m = (-torch.rand(n, k // 32, generator=g) * 0.1).half().float()
        torch_packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        scales_and_zeros = torch.stack([d.t(), (m + 8 * d).t()], dim=-1).contiguous()
        q4.append((cpu_linear_f32.pack_q4_f32(codes, d, m, 32), (torch_packed, scales_and_zeros), k))
    for name, rows_list, pairs, base in (
            ("dense C/MKL (padded tiles)", (1, 8, 32, 128, 512), dense,
             lambda xs: [_padded_tiles(xs[k], w) for _, w, k in dense]),
            ("4-bit C/PyTorch int4", (1, 2, 8, 64), q4,
             lambda xs: [torch.ops.aten._weight_int4pack_mm_for_cpu(xs[k], w, 32, sz) for _, (w, sz), k in q4])):
        row = []
        for rows in rows_list:
            xs = {k: torch.randn((rows, k), generator=g) for k in (576, 1536)}
            c, b = interleaved_ms(lambda: [cpu_linear_f32.linear_f32(xs[k], a) for a, _, k in pairs],
                                  lambda: base(xs), max(3, repeats // 4))
            row.append(f"M={rows}: {c / b:.3f}x")
        print(f"linear float32 {name}, one layer  " + "  ".join(row))


GROUPS = ("attention", "linear", "q4", "f32")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=20, help="calls of each kernel per case")
    p.add_argument("--threads", type=int, default=None, help="torch/OpenMP threads (None: torch's default)")
    p.add_argument("--only", choices=GROUPS, default=None, help="run one group of cases")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"threads {torch.get_num_threads()}; C kernel build: {cpu_attention.available() or 'ok'}; "
          f"C linear body: {cpu_linear.isa()} ($TANDEM_CPU_MARCH picks the build)")
    run = set(GROUPS) if args.only is None else {args.only}
    if "attention" in run:
        bench_attention(args.repeats)
        bench_attention_sweep(args.repeats)
    if "linear" in run and cpu_linear.available():
        bench_linear(args.repeats)
    if "q4" in run and cpu_linear.q4_available():
        bench_linear_q4(args.repeats)
    if "f32" in run and cpu_linear.q4_available():
        bench_linear_f32(args.repeats)


if __name__ == "__main__":
    main()
