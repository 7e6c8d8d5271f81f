"""PyTorch paths of the attention kernels: the CPU backend and the reference
that the Triton kernels are tested against.

Cache layout (vLLM's flash layout), per layer:
    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim]
A token at slot ``s`` lives at block ``s // block_size``, offset
``s % block_size``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter new keys and values into the paged caches, in place.

    Args:
        key, value: [num_tokens, num_kv_heads, head_dim], the cache's dtype.
        key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim].
        slot_mapping: [num_tokens] int64; -1 skips the token (padding).
    """
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    flat_k = key_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    flat_v = value_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    flat_k.index_copy_(0, slot_mapping, key)
    flat_v.index_copy_(0, slot_mapping, value)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_start_loc: list[int] | torch.Tensor,
    seq_lens: list[int] | torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of packed queries over paged keys and values.

    Sequence ``i`` has queries ``query[query_start_loc[i]:query_start_loc[i+1]]``
    (``q_len`` tokens), which are the *last* ``q_len`` of its ``seq_lens[i]``
    tokens; query ``j`` attends to key positions ``<= seq_len - q_len + j``.
    Grouped-query attention: query head ``h`` reads KV head
    ``h // (num_heads // num_kv_heads)``.

    Args:
        query: [num_query_tokens, num_heads, head_dim].
        key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim].
        query_start_loc: [num_seqs + 1] cumulative query lengths.
        seq_lens: [num_seqs] context length of each sequence (cached + new).
        block_tables: [num_seqs, max_blocks] int32 physical block ids.
        scale: softmax scale, usually head_dim ** -0.5.
        out: optional [num_query_tokens, num_heads, head_dim] output buffer.

    Returns:
        [num_query_tokens, num_heads, head_dim], query's dtype.
    """
    if out is None:
        out = torch.empty_like(query)
    qsl = query_start_loc.tolist() if isinstance(query_start_loc, torch.Tensor) else list(query_start_loc)
    lens = seq_lens.tolist() if isinstance(seq_lens, torch.Tensor) else list(seq_lens)
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    num_heads = query.shape[1]
    for i, seq_len in enumerate(lens):
        start, end = qsl[i], qsl[i + 1]
        q_len = end - start
        if q_len == 0:
            continue
        num_blocks = (seq_len + block_size - 1) // block_size
        blocks = block_tables[i, :num_blocks].long()
        k = key_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        v = value_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        q = query[start:end].transpose(0, 1)  # [H, q_len, D]
        k = k.transpose(0, 1)
        v = v.transpose(0, 1)
        mask = None
        if q_len > 1:
            q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
            k_pos = torch.arange(seq_len, device=query.device)
            mask = k_pos[None, :] <= q_pos[:, None]
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, enable_gqa=num_heads != num_kv_heads
        )
        out[start:end] = o.transpose(0, 1)
    return out
