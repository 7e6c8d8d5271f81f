"""Straightforward float64 references for the attention kernels (tests only).

Nothing here is fast: one sequence and one head at a time, explicit
matmul + mask + softmax, so that the definition of the kernels can be read
off in one place. See kernels/torch_attention.py for the cache layout.
"""

from __future__ import annotations

import math

import torch


def reference_reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write token ``t`` into slot ``slot_mapping[t]`` one token at a time; -1 skips.

    Shapes as in :func:`kernels.torch_attention.reshape_and_cache`.
    """
    block_size = key_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        key_cache[slot // block_size, slot % block_size] = key[t]
        value_cache[slot // block_size, slot % block_size] = value[t]


def reference_paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_start_loc: list[int] | torch.Tensor,
    seq_lens: list[int] | torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal paged attention computed in float64.

    Args: as :func:`kernels.torch_attention.paged_attention` (``window``:
    keys ``pos - window < k <= pos``; ``softcap``: ``cap * tanh(s / cap)``
    of the scaled scores).

    Returns:
        [num_query_tokens, num_heads, head_dim] float64. Rows of sequences
        with no query tokens are absent by construction.
    """
    qsl = [int(x) for x in query_start_loc]
    lens = [int(x) for x in seq_lens]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    num_heads = query.shape[1]
    group = num_heads // num_kv_heads
    out = torch.zeros(query.shape, dtype=torch.float64)
    for i, seq_len in enumerate(lens):
        q_len = qsl[i + 1] - qsl[i]
        if q_len == 0:
            continue
        slots = [int(block_tables[i, p // block_size]) * block_size + p % block_size for p in range(seq_len)]
        k = key_cache.reshape(-1, num_kv_heads, key_cache.shape[-1])[slots].double().cpu()
        v = value_cache.reshape(-1, num_kv_heads, value_cache.shape[-1])[slots].double().cpu()
        for j in range(q_len):
            pos = seq_len - q_len + j  # absolute position of this query token
            for h in range(num_heads):
                q = query[qsl[i] + j, h].double().cpu()
                first = 0 if window is None else max(0, pos - window + 1)
                kh, vh = k[first: pos + 1, h // group], v[first: pos + 1, h // group]
                s = (kh @ q) * scale
                w = torch.softmax(s if softcap is None else torch.tanh(s / softcap) * softcap, dim=0)
                out[qsl[i] + j, h] = w @ vh
    return out


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| (Frobenius), computed in float64."""
    out, ref = out.double().cpu(), ref.double().cpu()
    return float(torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref))


def default_scale(head_dim: int) -> float:
    """Softmax scale 1/sqrt(head_dim) (Vaswani et al., 2017)."""
    return 1.0 / math.sqrt(head_dim)
