"""The memory roofline of one stream's decode step: the bytes of weights a
one-row step reads (``engine/models/c_stack.py``'s ``decode_weight_bytes``),
this machine's read bandwidth measured now, and their quotient, the time below
which no engine can produce a token (issue 56).

``tandem bench engine`` prints the roofline beside Tandem's TPOT p50 (and
per round beside the peer's decode rate), the bandwidth measured in the same
run: on a shared box it moves with the load (22-40 GB/s within minutes on the 2-core
AVX512-BF16 machine of docs/benchmarks/decode-roofline.md).
"""

from __future__ import annotations

import time

import torch

READ_MIB = 512  # above the last-level cache (32 MiB on the Zen 4 box; ~128-192 MiB usable on the Intel host)


def read_bandwidth(num_threads: int, mib: int = READ_MIB, repeats: int = 5) -> float:
    """This machine's read bandwidth, GB/s (1e9 bytes/s): the median of ``repeats`` ``torch.sum`` over a float32
    tensor of ``mib`` MiB with ``num_threads`` torch threads (the issue's measure: a streaming read, as a decode
    step's pass over the weights is). The tensor is freed before returning."""
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        x = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
        x.sum()  # fault the pages in
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            x.sum()
            times.append(time.perf_counter() - start)
        times.sort()
        return x.numel() * 4 / times[len(times) // 2] / 1e9
    finally:
        torch.set_num_threads(previous)


def weights_mib(weight_bytes: int) -> int:
    """The MiB of a read-bandwidth buffer the size of ``weight_bytes`` (at least 1): what a decode step reads
    again every token, which a last-level cache larger than the weights may hold between steps (the Intel
    host of docs/benchmarks/decode-roofline.md reads <= 128 MiB at 46-50 GB/s and >= 192 MiB at 24-27)."""
    return max(1, round(weight_bytes / 2**20))


def roofline_ms(weight_bytes: int, bandwidth_gb_s: float) -> float:
    """The time to read ``weight_bytes`` once at ``bandwidth_gb_s``, ms: one token's floor."""
    return weight_bytes / (bandwidth_gb_s * 1e9) * 1e3
