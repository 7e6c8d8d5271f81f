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


# Decode batches are processed in chunks of sequences whose gathered keys and
# values take about this many bytes: they stay in the CPU's cache between the
# gather and the attention, and no large buffer is allocated per layer.
DECODE_CHUNK_BYTES = 4 << 20


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

    Sequences with one query token (decodes) are sorted by length and run in
    chunks: their keys and values are gathered into one padded
    [chunk, max_len, num_kv_heads, head_dim] buffer and attended with one
    batched SDPA call and a length mask, the query heads of a KV head folded
    into SDPA's query-length axis. Other sequences (prefill chunks) run one
    SDPA call each, with ``is_causal`` when the chunk is the whole sequence
    and an explicit offset causal mask otherwise.

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
    decodes = []
    for i, seq_len in enumerate(lens):
        q_len = qsl[i + 1] - qsl[i]
        if q_len == 1:
            decodes.append(i)
        elif q_len > 1:
            _prefill_one(query, key_cache, value_cache, qsl[i], q_len, seq_len, block_tables[i], scale, out)
    if decodes:
        _decode_batch(query, key_cache, value_cache, qsl, lens, decodes, block_tables, scale, out)
    return out


def _gather(cache: torch.Tensor, blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """cache [num_blocks, block_size, kvh, d], blocks [n] int64 -> [n, block_size, kvh, d]."""
    return torch.index_select(cache, 0, blocks, out=out) if out is not None else cache.index_select(0, blocks)


def _prefill_one(query, key_cache, value_cache, start, q_len, seq_len, block_table, scale, out) -> None:
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    num_heads = query.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = block_table[:num_blocks].long()
    k = _gather(key_cache, blocks).view(-1, num_kv_heads, head_dim)[:seq_len].transpose(0, 1)
    v = _gather(value_cache, blocks).view(-1, num_kv_heads, head_dim)[:seq_len].transpose(0, 1)
    q = query[start : start + q_len].transpose(0, 1)  # [H, q_len, D]
    gqa = num_heads != num_kv_heads
    if q_len == seq_len:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        k_pos = torch.arange(seq_len, device=query.device)
        mask = k_pos[None, :] <= q_pos[:, None]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    out[start : start + q_len] = o.transpose(0, 1)


def _decode_batch(query, key_cache, value_cache, qsl, lens, decodes, block_tables, scale, out) -> None:
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    num_heads = query.shape[1]
    group = num_heads // num_kv_heads
    device = query.device
    decodes = sorted(decodes, key=lambda i: lens[i])
    max_blocks = (lens[decodes[-1]] + block_size - 1) // block_size
    per_seq_bytes = 2 * max_blocks * block_size * num_kv_heads * head_dim * key_cache.element_size()
    chunk = max(1, min(len(decodes), DECODE_CHUNK_BYTES // per_seq_bytes))
    k_buf = torch.empty((chunk * max_blocks, block_size, num_kv_heads, head_dim), dtype=key_cache.dtype, device=device)
    v_buf = torch.empty_like(k_buf)
    pos = torch.arange(max_blocks * block_size, device=device)
    for c in range(0, len(decodes), chunk):
        seqs = decodes[c : c + chunk]
        n = len(seqs)
        nb = (lens[seqs[-1]] + block_size - 1) // block_size  # longest in the chunk: sorted
        ctx = nb * block_size
        seq_idx = torch.tensor(seqs, device=block_tables.device)
        rows = torch.tensor([qsl[i] for i in seqs], device=device)
        seq_len = torch.tensor([lens[i] for i in seqs], device=device)
        # Table entries past a sequence's last block may be anything (padding): read block 0 there.
        blocks = block_tables.index_select(0, seq_idx)[:, :nb].to(device, torch.int64)
        in_use = pos[None, :nb] * block_size < seq_len[:, None]
        blocks = torch.where(in_use, blocks, 0).reshape(-1)
        k = _gather(key_cache, blocks, k_buf[: n * nb]).view(n, ctx, num_kv_heads, head_dim).transpose(1, 2)
        v = _gather(value_cache, blocks, v_buf[: n * nb]).view(n, ctx, num_kv_heads, head_dim).transpose(1, 2)
        q = query.index_select(0, rows).view(n, num_kv_heads, group, head_dim)
        mask = (pos[None, :ctx] < seq_len[:, None])[:, None, None, :]  # [n, 1, 1, ctx]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        out.index_copy_(0, rows, o.reshape(n, num_heads, head_dim).to(out.dtype))
