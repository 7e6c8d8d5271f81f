"""The model runner's CPU KV pool: zeros, resident only as far as it is written."""

from __future__ import annotations

import os

import torch

from engine.model_runner import _zeros


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_cpu_pool_is_zero_and_lazily_resident():
    before = _rss_bytes()
    pool = _zeros((4, 2, 2048, 16, 2, 64), torch.bfloat16, torch.device("cpu"))  # 128 MiB
    assert pool.shape == (4, 2, 2048, 16, 2, 64) and pool.dtype == torch.bfloat16 and pool.is_contiguous()
    assert _rss_bytes() - before < 32 * 2**20  # torch.zeros would have made all 128 MiB resident
    pool[1, 0, 7] = 1.5
    assert float(pool[1, 0, 7].float().mean()) == 1.5 and int(pool.count_nonzero()) == 16 * 2 * 64
