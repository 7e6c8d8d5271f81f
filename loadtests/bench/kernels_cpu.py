"""CPU timing of the PyTorch attention path against the first per-sequence loop.

    python -m loadtests.bench.kernels_cpu [--num-seqs 64] [--context 200] [--threads 1 2]

Decode batch (one query token per sequence), SmolLM2-135M attention shapes
(9 query heads, 3 KV heads, head_dim 64), float32, block_size 16, shuffled
block tables. Prints the minimum and median of --repeats calls in milliseconds
per call (one layer) and the speedup of the minimum.
"""

from __future__ import annotations

import argparse
import time

import torch

from kernels.reference import per_sequence_paged_attention, relative_error
from kernels.torch_attention import paged_attention


def _time_ms(fn, repeats: int) -> tuple[float, float]:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    times.sort()
    return 1e3 * times[0], 1e3 * times[len(times) // 2]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-seqs", type=int, default=64)
    p.add_argument("--context", type=int, default=200, help="tokens per sequence")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeats", type=int, default=50)
    args = p.parse_args(argv)
    n, ctx, heads, kv_heads, head_dim, block_size = args.num_seqs, args.context, 9, 3, 64, 16
    g = torch.Generator().manual_seed(0)
    per_seq = (ctx + block_size - 1) // block_size
    num_blocks = n * per_seq + 1
    key_cache = torch.randn((num_blocks, block_size, kv_heads, head_dim), generator=g)
    value_cache = torch.randn_like(key_cache)
    block_tables = torch.randperm(num_blocks, generator=g)[: n * per_seq].view(n, per_seq).to(torch.int32)
    query = torch.randn((n, heads, head_dim), generator=g)
    qsl = torch.arange(n + 1, dtype=torch.int32)
    seq_lens = torch.full((n,), ctx, dtype=torch.int32)
    a = (query, key_cache, value_cache, qsl, seq_lens, block_tables, head_dim**-0.5)
    err = relative_error(paged_attention(*a), per_sequence_paged_attention(*a))
    print(f"decode {n} seqs x {ctx} tokens, heads {heads}/{kv_heads}, head_dim {head_dim}; rel diff {err:.1e}")
    for threads in args.threads:
        torch.set_num_threads(threads)
        base = _time_ms(lambda: per_sequence_paged_attention(*a), args.repeats)
        fast = _time_ms(lambda: paged_attention(*a), args.repeats)
        print(
            f"threads={threads}: per-sequence loop min {base[0]:.2f} ms (median {base[1]:.2f}), "
            f"torch path min {fast[0]:.2f} ms (median {fast[1]:.2f}); speedup {base[0] / fast[0]:.2f}x"
        )


if __name__ == "__main__":
    main()
