"""PyTorch paths of the attention kernels: the CPU backend and the reference
that the Triton kernels are tested against.

Cache layout (vLLM's flash layout), per layer:
    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim]
A token at slot ``s`` lives at block ``s // block_size``, offset
``s % block_size``.
"""

from __future__ import annotations

from dataclasses import dataclass

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
# gather and the attention.
DECODE_CHUNK_BYTES = 4 << 20


@dataclass
class _Prefill:
    """``num_seqs`` sequences with the same ``q_len`` > 1 and ``seq_len`` whose
    queries are consecutive rows from ``start`` (usually one sequence)."""

    start: int  # first query row
    num_seqs: int
    q_len: int
    seq_len: int
    blocks: torch.Tensor  # [num_seqs * ceil(seq_len / block_size)] int64
    mask: torch.Tensor | None  # [q_len, seq_len] bool (True = attend); None = plain causal (q_len == seq_len)


@dataclass
class _DecodeChunk:
    """Sequences with one query token each, attended together."""

    rows: torch.Tensor | int  # [n] int64 query rows, or the first row when they are consecutive
    n: int
    num_blocks: int  # blocks gathered per sequence (the longest in the chunk)
    blocks: torch.Tensor  # [n * num_blocks] int64; entries past a sequence's end read block 0
    mask: torch.Tensor  # [n, 1, num_blocks * block_size] float32, 0 = attend, -inf = padding


@dataclass
class AttentionPlan:
    """The index work of :func:`paged_attention` for one step, done once and
    shared by every layer (all layers use the same block tables).

    Built by :func:`plan_attention`; holds the gather indices, length masks
    and the scratch buffers of the decode path.
    """

    prefills: list[_Prefill]
    decode_chunks: list[_DecodeChunk]
    k_buf: torch.Tensor | None = None  # [chunk * max_blocks, block_size, num_kv_heads, head_dim]
    v_buf: torch.Tensor | None = None
    q_buf: torch.Tensor | None = None  # [chunk, num_kv_heads, group, num_kv_heads, head_dim], zero off the diagonal


def plan_attention(
    key_cache: torch.Tensor,
    num_heads: int,
    query_start_loc: list[int] | torch.Tensor,
    seq_lens: list[int] | torch.Tensor,
    block_tables: torch.Tensor,
) -> AttentionPlan:
    """Precompute the per-step part of :func:`paged_attention`.

    Args:
        key_cache: [num_blocks, block_size, num_kv_heads, head_dim] (any
            layer's; only its shape, dtype and device are read).
        num_heads: query heads.
        query_start_loc, seq_lens, block_tables: as :func:`paged_attention`.

    Returns:
        An :class:`AttentionPlan` to pass to every layer's ``paged_attention``.
    """
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    device, dtype = key_cache.device, key_cache.dtype
    qsl = query_start_loc.tolist() if isinstance(query_start_loc, torch.Tensor) else list(query_start_loc)
    lens = seq_lens.tolist() if isinstance(seq_lens, torch.Tensor) else list(seq_lens)
    decodes, prefills = [], []
    for i, seq_len in enumerate(lens):
        q_len = qsl[i + 1] - qsl[i]
        if q_len == 1:
            decodes.append(i)
        elif q_len > 1:
            last = prefills[-1] if prefills else None
            if last and (last[2], last[3]) == (q_len, seq_len) and last[0] + last[1] * q_len == qsl[i]:
                last[1] += 1  # same shape, next rows: one SDPA call for both
                last[4].append(i)
            else:
                prefills.append([qsl[i], 1, q_len, seq_len, [i]])
    plan = AttentionPlan([], [])
    for start, num_seqs, q_len, seq_len, seqs in prefills:
        nb = (seq_len + block_size - 1) // block_size
        blocks = block_tables[seqs, :nb].to(device, torch.int64).reshape(-1)
        mask = None
        if q_len != seq_len:
            q_pos = torch.arange(seq_len - q_len, seq_len, device=device)
            mask = torch.arange(seq_len, device=device)[None, :] <= q_pos[:, None]
        plan.prefills.append(_Prefill(start, num_seqs, q_len, seq_len, blocks, mask))
    if not decodes:
        return plan
    decodes.sort(key=lambda i: lens[i])
    max_blocks = (lens[decodes[-1]] + block_size - 1) // block_size
    per_seq_bytes = 2 * max_blocks * block_size * num_kv_heads * head_dim * key_cache.element_size()
    chunk = max(1, min(len(decodes), DECODE_CHUNK_BYTES // per_seq_bytes))
    group = num_heads // num_kv_heads
    plan.k_buf = torch.empty((chunk * max_blocks, block_size, num_kv_heads, head_dim), dtype=dtype, device=device)
    plan.v_buf = torch.empty_like(plan.k_buf)
    plan.q_buf = torch.zeros((chunk, num_kv_heads, group, num_kv_heads, head_dim), dtype=dtype, device=device)
    pos = torch.arange(max_blocks * block_size, device=device)
    bt = block_tables.to(device, torch.int64)
    for c in range(0, len(decodes), chunk):
        seqs = decodes[c : c + chunk]
        n = len(seqs)
        nb = (lens[seqs[-1]] + block_size - 1) // block_size  # the longest in the chunk: sorted
        rows_list = [qsl[i] for i in seqs]
        consecutive = rows_list == list(range(rows_list[0], rows_list[0] + n))
        rows = rows_list[0] if consecutive else torch.tensor(rows_list, device=device)
        seq_len = torch.tensor([lens[i] for i in seqs], device=device)
        # Table entries past a sequence's last block may be anything (padding): read block 0 there.
        blocks = bt[torch.tensor(seqs, device=device), :nb]
        blocks = torch.where(pos[None, :nb] * block_size < seq_len[:, None], blocks, 0).reshape(-1)
        mask = torch.zeros((n, 1, nb * block_size), dtype=torch.float32, device=device)
        mask.masked_fill_(pos[None, None, : nb * block_size] >= seq_len[:, None, None], float("-inf"))
        plan.decode_chunks.append(_DecodeChunk(rows, n, nb, blocks, mask))
    return plan


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_start_loc: list[int] | torch.Tensor,
    seq_lens: list[int] | torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    plan: AttentionPlan | None = None,
) -> torch.Tensor:
    """Causal attention of packed queries over paged keys and values.

    Sequence ``i`` has queries ``query[query_start_loc[i]:query_start_loc[i+1]]``
    (``q_len`` tokens), which are the *last* ``q_len`` of its ``seq_lens[i]``
    tokens; query ``j`` attends to key positions ``<= seq_len - q_len + j``.
    Grouped-query attention: query head ``h`` reads KV head
    ``h // (num_heads // num_kv_heads)``.

    Sequences with one query token (decodes) are sorted by length and run in
    chunks: their key and value blocks are gathered into one padded
    [chunk, ctx, num_kv_heads * head_dim] buffer and attended with two
    batched matmuls, an additive length mask and a float32 softmax. The KV
    heads are not split apart: the query is laid out block-diagonally,
    [chunk, num_heads, num_kv_heads * head_dim] with query head ``h``'s
    vector in KV head ``h // group``'s columns and zeros elsewhere, so one
    matmul against the gathered keys gives every head's scores, and the
    diagonal blocks of probabilities @ values are the outputs. This does
    ``num_kv_heads`` times the (small) arithmetic but no copy of the keys,
    and is several times faster than SDPA's CPU kernel at decode sizes. In
    16-bit dtypes the scores are rounded to the dtype before the softmax (as
    transformers' eager attention does). Other sequences (prefill chunks) run
    one SDPA call each (one for a run of consecutive sequences of the same
    shape), the KV heads broadcast over their query-head group.

    Args:
        query: [num_query_tokens, num_heads, head_dim].
        key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim].
        query_start_loc: [num_seqs + 1] cumulative query lengths.
        seq_lens: [num_seqs] context length of each sequence (cached + new).
        block_tables: [num_seqs, max_blocks] int32 physical block ids.
        scale: softmax scale, usually head_dim ** -0.5.
        out: optional [num_query_tokens, num_heads, head_dim] output buffer.
        plan: optional :func:`plan_attention` result for these metadata,
            shared by the layers of one step; computed here when None.

    Returns:
        [num_query_tokens, num_heads, head_dim], query's dtype.
    """
    if out is None:
        out = torch.empty_like(query)
    if plan is None:
        plan = plan_attention(key_cache, query.shape[1], query_start_loc, seq_lens, block_tables)
    for p in plan.prefills:
        _prefill_one(query, key_cache, value_cache, p, scale, out)
    for chunk in plan.decode_chunks:
        _decode_chunk(query, key_cache, value_cache, chunk, plan, scale, out)
    return out


def _prefill_one(query, key_cache, value_cache, p: _Prefill, scale, out) -> None:
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    group = query.shape[1] // num_kv_heads
    g, q_len, seq_len = p.num_seqs, p.q_len, p.seq_len
    ctx = p.blocks.numel() // g * block_size
    # Keys and values [g * kvh, 1, seq_len, D], broadcast over the query heads of each KV
    # head (SDPA's enable_gqa falls back to the slow math kernel on CPU).
    k = key_cache.index_select(0, p.blocks).view(g, ctx, num_kv_heads, head_dim)[:, :seq_len].transpose(1, 2)
    v = value_cache.index_select(0, p.blocks).view(g, ctx, num_kv_heads, head_dim)[:, :seq_len].transpose(1, 2)
    shape = (g * num_kv_heads, group, seq_len, head_dim)
    k = k.reshape(g * num_kv_heads, 1, seq_len, head_dim).expand(shape)
    v = v.reshape(g * num_kv_heads, 1, seq_len, head_dim).expand(shape)
    rows = slice(p.start, p.start + g * q_len)
    # [g, q_len, kvh, G, D] -> [g * kvh, G, q_len, D]
    q = query[rows].view(g, q_len, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    q = q.reshape(g * num_kv_heads, group, q_len, head_dim)
    if p.mask is None:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    else:
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=p.mask, scale=scale)
    out[rows].view(g, q_len, num_kv_heads, group, head_dim).copy_(
        o.view(g, num_kv_heads, group, q_len, head_dim).permute(0, 3, 1, 2, 4))


def _decode_chunk(query, key_cache, value_cache, c: _DecodeChunk, plan: AttentionPlan, scale, out) -> None:
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    num_heads = query.shape[1]
    group = num_heads // num_kv_heads
    n, ctx, width = c.n, c.num_blocks * block_size, num_kv_heads * head_dim
    k = torch.index_select(key_cache, 0, c.blocks, out=plan.k_buf[: n * c.num_blocks]).view(n, ctx, width)
    v = torch.index_select(value_cache, 0, c.blocks, out=plan.v_buf[: n * c.num_blocks]).view(n, ctx, width)
    if isinstance(c.rows, int):
        q = query[c.rows : c.rows + n]
    else:
        q = query.index_select(0, c.rows)
    qb = plan.q_buf[:n]  # [n, kvh, G, kvh, D]: head h's query in KV head h // G's columns
    torch.diagonal(qb, dim1=1, dim2=3).copy_(q.view(n, num_kv_heads, group, head_dim).permute(0, 2, 3, 1))
    scores = torch.bmm(qb.view(n, num_heads, width), k.transpose(1, 2))  # [n, H, ctx]
    probs = torch.softmax(torch.add(c.mask, scores, alpha=scale), dim=-1).to(v.dtype)
    o = torch.bmm(probs, v).view(n, num_kv_heads, group, num_kv_heads, head_dim)
    o = torch.diagonal(o, dim1=1, dim2=3)  # [n, G, D, kvh]
    if isinstance(c.rows, int):
        out[c.rows : c.rows + n].view(n, num_kv_heads, group, head_dim).permute(0, 2, 3, 1).copy_(o)
    else:
        out.index_copy_(0, c.rows, o.permute(0, 3, 1, 2).reshape(n, num_heads, head_dim).to(out.dtype))
