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


# Sequences are processed in chunks whose gathered keys and values take about
# this many bytes: they stay in the CPU's cache between the gather and the
# attention.
CHUNK_BYTES = 4 << 20
# A prefill chunk's queries are attended in tiles of this many rows, which
# bounds the float32 score buffer to QUERY_TILE * num_heads * context.
QUERY_TILE = 128
# Every gathered context is padded to a multiple of KV_PAD tokens, and
# probabilities @ values runs over KV_TILE tokens at a time, the tiles'
# bfloat16 results summed in float32 in order. oneDNN's bfloat16 matmul gives
# each output element the same bits for every row count and every reduction
# length that is a multiple of 64 up to 512, but not for other lengths (48) or
# longer ones (it splits K), so these two fix every reduction's shape.
KV_PAD = 64
KV_TILE = 512


@dataclass
class _Prefill:
    """One sequence with ``q_len`` > 1 queries, consecutive rows from ``start``."""

    start: int  # first query row
    q_len: int
    seq_len: int
    num_blocks: int
    blocks: torch.Tensor  # [num_blocks] int64
    masks: list[torch.Tensor]  # per QUERY_TILE rows: [rows, 1, num_blocks * block_size] float32, -inf past each query


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
    and the scratch buffers.
    """

    prefills: list[_Prefill]
    decode_chunks: list[_DecodeChunk]
    k_buf: torch.Tensor | None = None  # [chunk * max_blocks, block_size, num_kv_heads, head_dim]
    v_buf: torch.Tensor | None = None
    q_buf: torch.Tensor | None = None  # [rows, num_kv_heads, group, num_kv_heads, head_dim], zero off the diagonal


def plan_attention(
    key_cache: torch.Tensor,
    num_heads: int,
    query_start_loc: list[int] | torch.Tensor,
    seq_lens: list[int] | torch.Tensor,
    block_tables: torch.Tensor,
    window: int | None = None,
) -> AttentionPlan:
    """Precompute the per-step part of :func:`paged_attention`.

    Args:
        key_cache: [num_blocks, block_size, num_kv_heads, head_dim] (any
            layer's; only its shape, dtype and device are read).
        num_heads: query heads.
        query_start_loc, seq_lens, block_tables: as :func:`paged_attention`.
        window: a sliding window (Mistral, Gemma 2/3's local layers): a
            query at position ``p`` sees keys ``p - window < k <= p``
            (transformers' ``sliding_window_overlay``); None: every earlier key.

    Returns:
        An :class:`AttentionPlan` to pass to every layer's ``paged_attention``.
    """
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    device, dtype = key_cache.device, key_cache.dtype
    qsl = query_start_loc.tolist() if isinstance(query_start_loc, torch.Tensor) else list(query_start_loc)
    lens = seq_lens.tolist() if isinstance(seq_lens, torch.Tensor) else list(seq_lens)
    bt = block_tables.to(device, torch.int64)
    plan = AttentionPlan([], [])
    decodes = []
    for i, seq_len in enumerate(lens):
        q_len = qsl[i + 1] - qsl[i]
        if q_len == 1:
            decodes.append(i)
        elif q_len > 1:
            nb = _padded_blocks(seq_len, block_size)
            blocks = bt[i, :nb]
            if blocks.numel() < nb:
                blocks = torch.cat([blocks, blocks.new_zeros(nb - blocks.numel())])
            # Entries past the sequence's last block may be anything (padding): read block 0 there.
            pos = torch.arange(nb, device=device) * block_size
            plan.prefills.append(_Prefill(qsl[i], q_len, seq_len, nb, torch.where(pos < seq_len, blocks, 0),
                                          _causal_masks(seq_len - q_len, q_len, nb * block_size, device, window)))
    group = num_heads // num_kv_heads
    max_prefill_blocks = max((p.num_blocks for p in plan.prefills), default=0)
    max_blocks = max_prefill_blocks
    q_rows = min(QUERY_TILE, max((p.q_len for p in plan.prefills), default=0))
    per_block_bytes = 2 * block_size * num_kv_heads * head_dim * key_cache.element_size()
    chunk = 0
    if decodes:
        decodes.sort(key=lambda i: lens[i])
        decode_blocks = _padded_blocks(lens[decodes[-1]], block_size)
        chunk = max(1, min(len(decodes), CHUNK_BYTES // (decode_blocks * per_block_bytes)))
        max_blocks = max(max_blocks, chunk * decode_blocks)
        q_rows = max(q_rows, chunk)
    plan.k_buf = torch.empty((max_blocks, block_size, num_kv_heads, head_dim), dtype=dtype, device=device)
    plan.v_buf = torch.empty_like(plan.k_buf)
    plan.q_buf = torch.zeros((q_rows, num_kv_heads, group, num_kv_heads, head_dim), dtype=dtype, device=device)
    if not decodes:
        return plan
    pos = torch.arange(decode_blocks * block_size, device=device)
    for c in range(0, len(decodes), chunk):
        seqs = decodes[c : c + chunk]
        n = len(seqs)
        nb = _padded_blocks(lens[seqs[-1]], block_size)  # the longest in the chunk: sorted
        rows_list = [qsl[i] for i in seqs]
        consecutive = rows_list == list(range(rows_list[0], rows_list[0] + n))
        rows = rows_list[0] if consecutive else torch.tensor(rows_list, device=device)
        seq_len = torch.tensor([lens[i] for i in seqs], device=device)
        # Table entries past a sequence's last block may be anything (padding): read block 0 there.
        blocks = bt[torch.tensor(seqs, device=device), :nb]
        if blocks.shape[1] < nb:
            blocks = torch.cat([blocks, blocks.new_zeros(n, nb - blocks.shape[1])], dim=1)
        blocks = torch.where(pos[None, :nb] * block_size < seq_len[:, None], blocks, 0).reshape(-1)
        mask = torch.zeros((n, 1, nb * block_size), dtype=torch.float32, device=device)
        mask.masked_fill_(pos[None, None, : nb * block_size] >= seq_len[:, None, None], float("-inf"))
        if window is not None:  # keys the window has left behind: the first ones, in every chunk alike
            mask.masked_fill_(pos[None, None, : nb * block_size] <= seq_len[:, None, None] - 1 - window, float("-inf"))
        plan.decode_chunks.append(_DecodeChunk(rows, n, nb, blocks, mask))
    return plan


def _causal_masks(first: int, q_len: int, ctx: int, device: torch.device,
                  window: int | None = None) -> list[torch.Tensor]:
    """Additive masks of a prefill chunk whose first query sits at position
    ``first``, one per ``QUERY_TILE`` rows: [rows, 1, ctx_t] float32, 0 where
    the key position is <= the query's (and, with a ``window``, > the query's
    minus the window), -inf elsewhere (padding included).
    A tile's context ``ctx_t`` stops at its last query's position rounded up
    to ``KV_PAD`` tokens (causal: later keys are all masked), so a long
    prompt's early tiles skip the keys they cannot see; the padding argument
    of :func:`paged_attention` makes the result the same bits as over the
    whole context."""
    masks = []
    for r0 in range(0, q_len, QUERY_TILE):
        last = first + min(r0 + QUERY_TILE, q_len)  # one past the tile's last query position
        ctx_t = min(ctx, (last + KV_PAD - 1) // KV_PAD * KV_PAD)
        q_pos = torch.arange(first + r0, last, device=device)
        pos = torch.arange(ctx_t, device=device)
        mask = torch.zeros((q_pos.numel(), 1, ctx_t), dtype=torch.float32, device=device)
        mask.masked_fill_(pos[None, None, :] > q_pos[:, None, None], float("-inf"))
        if window is not None:
            mask.masked_fill_(pos[None, None, :] <= q_pos[:, None, None] - window, float("-inf"))
        masks.append(mask)
    return masks


def _padded_blocks(seq_len: int, block_size: int) -> int:
    """Blocks gathered for a context of ``seq_len`` tokens: whole blocks covering
    at least a multiple of ``KV_PAD`` tokens."""
    tokens = (seq_len + KV_PAD - 1) // KV_PAD * KV_PAD
    return (tokens + block_size - 1) // block_size


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
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of packed queries over paged keys and values.

    Sequence ``i`` has queries ``query[query_start_loc[i]:query_start_loc[i+1]]``
    (``q_len`` tokens), which are the *last* ``q_len`` of its ``seq_lens[i]``
    tokens; query ``j`` attends to key positions ``<= seq_len - q_len + j``.
    Grouped-query attention: query head ``h`` reads KV head
    ``h // (num_heads // num_kv_heads)``.

    Batch-invariant: a query's output depends only on the query and its own
    context, never on how many rows share the step, whether they are
    prefill or decode rows, or how much of the context was cached. Every row
    runs the same arithmetic: a sequence's key and value blocks are gathered
    into one [ctx, num_kv_heads * head_dim] buffer (ctx padded to whole
    blocks), the query is laid out block-diagonally, [num_heads,
    num_kv_heads * head_dim] with query head ``h``'s vector in KV head
    ``h // group``'s columns and zeros elsewhere, so one matmul against the
    gathered keys gives every head's scores; positions past the query's own
    (causal) end get -inf, a float32 softmax over the padded row follows,
    and the diagonal blocks of probabilities @ values, computed over
    ``KV_TILE``-token tiles summed in order, are the outputs. The padding
    (to ``KV_PAD`` tokens) only appends exact zeros to each reduction, and
    with these shapes oneDNN's bfloat16 matmul gives each output element the
    same bits whatever the number of rows (tests/engine/test_batch_invariance.py). Decodes are
    sorted by length and attended in chunks; a prefill chunk's queries in
    tiles of ``QUERY_TILE`` rows. This does ``num_kv_heads`` times the
    (small) arithmetic of a per-head layout but no copy of the keys, and is
    several times faster than SDPA's CPU kernel at decode sizes.

    Args:
        query: [num_query_tokens, num_heads, head_dim].
        key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim].
        query_start_loc: [num_seqs + 1] cumulative query lengths.
        seq_lens: [num_seqs] context length of each sequence (cached + new).
        block_tables: [num_seqs, max_blocks] int32 physical block ids.
        scale: softmax scale, usually head_dim ** -0.5.
        out: optional [num_query_tokens, num_heads, head_dim] output buffer.
        plan: optional :func:`plan_attention` result for these metadata,
            shared by the layers of one step; computed here when None (a
            sliding window is the plan's: ``plan_attention(window=...)``).
        softcap: logit soft-capping (Gemma 2): ``cap * tanh(s / cap)`` of the
            scaled scores ``s``, before the mask (transformers'
            ``eager_attention_forward`` of ``modeling_gemma2``); None: none.

    Returns:
        [num_query_tokens, num_heads, head_dim], query's dtype.
    """
    if out is None:
        out = torch.empty_like(query)
    if plan is None:
        plan = plan_attention(key_cache, query.shape[1], query_start_loc, seq_lens, block_tables)
    for p in plan.prefills:
        _prefill_one(query, key_cache, value_cache, p, plan, scale, out, softcap)
    for chunk in plan.decode_chunks:
        _decode_chunk(query, key_cache, value_cache, chunk, plan, scale, out, softcap)
    return out


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, q_buf: torch.Tensor,
            scale: float, softcap: float | None = None) -> torch.Tensor:
    """The arithmetic every query row goes through.

    Args:
        q: [b, r, num_heads, head_dim] queries (r rows per batch entry).
        k, v: [b, ctx, num_kv_heads * head_dim] gathered keys and values.
        mask: float32, broadcastable to [b, r, num_heads, ctx]: 0 = attend, -inf = not.
        q_buf: [>= b * r, kvh, group, kvh, head_dim] scratch, zero off the diagonal.

    Returns:
        [b * r, group, head_dim, num_kv_heads] outputs (a strided view).
    """
    b, r, num_heads, head_dim = q.shape
    num_kv_heads = q_buf.shape[1]
    group, width, ctx = num_heads // num_kv_heads, k.shape[-1], k.shape[1]
    qb = q_buf[: b * r]
    torch.diagonal(qb, dim1=1, dim2=3).copy_(q.reshape(b * r, num_kv_heads, group, head_dim).permute(0, 2, 3, 1))
    scores = torch.bmm(qb.view(b, r * num_heads, width), k.transpose(1, 2))  # [b, r * H, ctx]
    if softcap is None:
        scores = torch.add(mask, scores.view(b, r, num_heads, ctx), alpha=scale)
    else:  # elementwise: each score's bits are still its own
        scores = torch.tanh(scores.view(b, r, num_heads, ctx).float() * scale / softcap) * softcap + mask
    probs = torch.softmax(scores, dim=-1).to(v.dtype).view(b, r * num_heads, ctx)
    if ctx <= KV_TILE:
        o = torch.bmm(probs, v)
    else:  # the same bits as one tile when the later tiles' probabilities are all zero
        o = torch.zeros((b, r * num_heads, width), dtype=torch.float32, device=v.device)
        for t in range(0, ctx, KV_TILE):
            o += torch.bmm(probs[:, :, t:t + KV_TILE].contiguous(), v[:, t:t + KV_TILE])
        o = o.to(v.dtype)
    o = o.view(b * r, num_kv_heads, group, num_kv_heads, head_dim)
    return torch.diagonal(o, dim1=1, dim2=3)  # [b * r, G, D, kvh]


def _prefill_one(query, key_cache, value_cache, p: _Prefill, plan: AttentionPlan, scale, out, softcap=None) -> None:
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    num_heads = query.shape[1]
    ctx, width = p.num_blocks * block_size, num_kv_heads * head_dim
    k = torch.index_select(key_cache, 0, p.blocks, out=plan.k_buf[: p.num_blocks]).view(1, ctx, width)
    v = torch.index_select(value_cache, 0, p.blocks, out=plan.v_buf[: p.num_blocks]).view(1, ctx, width)
    for t, mask in enumerate(p.masks):
        r0, r, ctx_t = t * QUERY_TILE, mask.shape[0], mask.shape[-1]
        rows = slice(p.start + r0, p.start + r0 + r)
        o = _attend(query[rows].unsqueeze(0), k[:, :ctx_t], v[:, :ctx_t], mask.unsqueeze(0), plan.q_buf, scale,
                    softcap)
        out[rows].view(r, num_kv_heads, num_heads // num_kv_heads, head_dim).permute(0, 2, 3, 1).copy_(o)


def _decode_chunk(query, key_cache, value_cache, c: _DecodeChunk, plan: AttentionPlan, scale, out,
                  softcap=None) -> None:
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
    o = _attend(q.unsqueeze(1), k, v, c.mask.unsqueeze(1), plan.q_buf, scale, softcap)  # [n, G, D, kvh]
    if isinstance(c.rows, int):
        out[c.rows : c.rows + n].view(n, num_kv_heads, group, head_dim).permute(0, 2, 3, 1).copy_(o)
    else:
        out.index_copy_(0, c.rows, o.permute(0, 3, 1, 2).reshape(n, num_heads, head_dim).to(out.dtype))
