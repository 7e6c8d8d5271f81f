"""Triton kernels: KV-cache write and unified paged attention.

Same interface and cache layout as kernels/torch_attention.py:
    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim]

Unified attention (the idea of vLLM's ``triton_unified_attention``): one
kernel serves prefill chunks and decodes. Queries are packed per sequence;
the grid's first axis walks "query blocks" of ``BLOCK_Q`` tokens of one
sequence, the second axis the KV heads. A program loads the ``BLOCK_Q`` query
tokens x the query heads sharing its KV head as one [BLOCK_M, head_dim] tile
(grouped-query attention, Ainslie et al. 2023; the head group is padded to a
power of two), walks the sequence's keys and values through its block table
``TILE_N`` tokens at a time (a tile may span several paged blocks), and keeps
an online softmax in float32 (Milakov & Gimelshein 2018; FlashAttention-2,
Dao 2023). Causal: sequence ``i``'s queries are its last ``q_len`` tokens.

Split-KV (flash-decoding, Dao et al. 2023): a third grid axis splits each
sequence's keys into ``num_splits`` ranges; every split writes a normalised
partial output and its log-sum-exp, and a second kernel merges them. It
lets a few long decodes fill the GPU.

Triton's interpreter (TRITON_INTERPRET=1) runs the kernels on CPU tensors
(``kernels/triton_jit.py`` wraps them for either mode).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_jit import launchable

# Tokens of keys/values per inner-loop iteration, independent of block_size.
DEFAULT_TILE_N = 32
# Split-KV is considered for decode batches whose block tables can hold at
# least this many tokens (the table width is known without a device sync).
SPLIT_KV_MIN_CONTEXT = 2048
MAX_SPLITS = 16


def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    num_tokens,
    stride_k_t,
    stride_k_h,
    stride_v_t,
    stride_v_h,
    stride_kc_blk,
    stride_kc_slot,
    stride_kc_h,
    stride_vc_blk,
    stride_vc_slot,
    stride_vc_h,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_HD: tl.constexpr,
):
    # One program writes BLOCK_T tokens x (all KV heads x head_dim).
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_hd = tl.arange(0, BLOCK_HD)
    head = offs_hd // HEAD_DIM
    dim = offs_hd % HEAD_DIM
    t_ok = offs_t < num_tokens
    slot = tl.load(slot_mapping_ptr + offs_t, mask=t_ok, other=-1).to(tl.int64)
    ok = (slot >= 0)[:, None] & (head < NUM_KV_HEADS)[None, :]
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    t64 = offs_t.to(tl.int64)
    k = tl.load(key_ptr + t64[:, None] * stride_k_t + head[None, :] * stride_k_h + dim[None, :], mask=ok)
    v = tl.load(value_ptr + t64[:, None] * stride_v_t + head[None, :] * stride_v_h + dim[None, :], mask=ok)
    kc = key_cache_ptr + blk[:, None] * stride_kc_blk + off[:, None] * stride_kc_slot + head[None, :] * stride_kc_h
    vc = value_cache_ptr + blk[:, None] * stride_vc_blk + off[:, None] * stride_vc_slot + head[None, :] * stride_vc_h
    tl.store(kc + dim[None, :], k, mask=ok)
    tl.store(vc + dim[None, :], v, mask=ok)


def _unified_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,  # [T, H, D] or, with split-KV, partial outputs [T, H, S, D] float32
    lse_ptr,  # split-KV only: [T, H, S] float32 log2-sum-exp of each split
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    scale_log2,  # softmax scale * log2(e)
    num_seqs,
    stride_q_t,
    stride_q_h,
    stride_o_t,
    stride_o_h,
    stride_kc_blk,
    stride_kc_slot,
    stride_kc_h,
    stride_vc_blk,
    stride_vc_slot,
    stride_vc_h,
    stride_bt,
    NUM_QUERIES_PER_KV: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # Sequence owning this query block: the last i with
    # query_start_loc[i] // BLOCK_Q + i <= q_block (sequence i's query blocks
    # start there; the "+ i" leaves room for each sequence's partial block).
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start_mid = tl.load(query_start_loc_ptr + mid)
        if start_mid // BLOCK_Q + mid <= q_block:
            lo = mid + 1
        else:
            hi = mid
    seq = lo - 1

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block_local = q_block - (q_start // BLOCK_Q + seq)
    if q_block_local * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    # Rows of the tile: (query token, query head within the KV head's group).
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q_tok = q_block_local * BLOCK_Q + offs_m // GROUP_PAD
    head_in_group = offs_m % GROUP_PAD
    head = kv_head * NUM_QUERIES_PER_KV + head_in_group
    row_ok = (q_tok < q_len) & (head_in_group < NUM_QUERIES_PER_KV)
    tok64 = (q_start + q_tok).to(tl.int64)
    q = tl.load(
        q_ptr + tok64[:, None] * stride_q_t + head[:, None] * stride_q_h + offs_d[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    q_pos = context_len + q_tok  # absolute position of each row's token

    # Keys 0..last_key (inclusive) are visible to some row of this tile.
    last_key = context_len + tl.minimum(q_block_local * BLOCK_Q + BLOCK_Q, q_len) - 1
    num_tiles = (last_key + TILE_N) // TILE_N
    if NUM_SPLITS == 1:
        tile_lo = 0
        tile_hi = num_tiles
    else:
        per_split = (num_tiles + NUM_SPLITS - 1) // NUM_SPLITS
        tile_lo = split * per_split
        tile_hi = tl.minimum(tile_lo + per_split, num_tiles)

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    offs_n = tl.arange(0, TILE_N)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for j in range(tile_lo, tile_hi):
        k_pos = j * TILE_N + offs_n
        k_ok = k_pos <= last_key
        blk = tl.load(bt_row + k_pos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        in_blk = k_pos % BLOCK_SIZE
        k_off = blk * stride_kc_blk + in_blk * stride_kc_slot + kv_head * stride_kc_h
        v_off = blk * stride_vc_blk + in_blk * stride_vc_slot + kv_head * stride_vc_h
        k = tl.load(k_cache_ptr + k_off[None, :] + offs_d[:, None], mask=k_ok[None, :], other=0.0)  # [D, N]
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2  # [M, N] float32
        visible = k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + v_off[:, None] + offs_d[None, :], mask=k_ok[:, None], other=0.0)  # [N, D]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    acc = acc / l_safe[:, None]
    if NUM_SPLITS == 1:
        o_ptr = out_ptr + tok64[:, None] * stride_o_t + head[:, None] * stride_o_h + offs_d[None, :]
        tl.store(o_ptr, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        # Partials [T, H, S, D] and lse [T, H, S], contiguous float32.
        row = (tok64 * stride_o_t + head * stride_o_h) * NUM_SPLITS + split
        tl.store(out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=row_ok[:, None])
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(lse_ptr + row, lse, mask=row_ok)


def _merge_splits_kernel(
    partial_ptr,  # [T, H, S, D] float32
    lse_ptr,  # [T, H, S] float32
    out_ptr,  # [T, H, D]
    num_rows,  # T * H
    num_heads,
    stride_o_t,
    stride_o_h,
    NUM_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    # out = sum_s 2^(lse_s - max) * partial_s / sum_s 2^(lse_s - max).
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = rows < num_rows
    rows64 = rows.to(tl.int64)
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, HEAD_DIM)
    lse = tl.load(lse_ptr + rows64[:, None] * NUM_SPLITS + offs_s[None, :], mask=ok[:, None], other=0.0)
    m = tl.max(lse, axis=1)
    w = tl.exp2(lse - m[:, None])  # [R, S]; empty splits have lse = -inf -> 0
    denom = tl.sum(w, axis=1)
    acc = tl.zeros([BLOCK_R, HEAD_DIM], dtype=tl.float32)
    for s in range(NUM_SPLITS):
        w_s = tl.sum(tl.where(offs_s[None, :] == s, w, 0.0), axis=1)
        part = tl.load(
            partial_ptr + (rows64[:, None] * NUM_SPLITS + s) * HEAD_DIM + offs_d[None, :],
            mask=ok[:, None] & (w_s > 0.0)[:, None],
            other=0.0,
        )
        acc += w_s[:, None] * part
    acc = acc / denom[:, None]
    tok = rows64 // num_heads
    head = rows64 % num_heads
    o_ptr = out_ptr + tok[:, None] * stride_o_t + head[:, None] * stride_o_h + offs_d[None, :]
    tl.store(o_ptr, acc.to(out_ptr.dtype.element_ty), mask=ok[:, None])


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter new keys and values into the paged caches, in place (Triton).

    Args:
        key, value: [num_tokens, num_kv_heads, head_dim], the cache's dtype;
            the last dimension contiguous (token/head strides are free).
        key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim],
            last dimension contiguous.
        slot_mapping: [num_tokens] int32/int64; -1 skips the token (padding).
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    for t in (key, value, key_cache, value_cache):
        if t.stride(-1) != 1:
            raise ValueError("reshape_and_cache needs the last dimension contiguous")
    block_hd = triton.next_power_of_2(num_kv_heads * head_dim)
    # About 8K elements per program: 16 tokens of SmolLM2's 3x64, 8 of 8x128.
    block_t = max(1, min(16, 8192 // block_hd))
    kernel = launchable(_reshape_and_cache_kernel, key.device)
    kernel[(triton.cdiv(num_tokens, block_t),)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        num_tokens,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=key_cache.shape[1],
        BLOCK_T=block_t,
        BLOCK_HD=block_hd,
    )


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8


def choose_num_splits(
    num_query_tokens: int, num_seqs: int, num_kv_heads: int, max_context: int, num_sms: int
) -> int:
    """Split-KV selection rule (no device sync: uses shapes only).

    Split only decode batches (one query token per sequence) whose block tables
    can hold at least SPLIT_KV_MIN_CONTEXT tokens and whose (sequence, KV head)
    programs fill less than two waves of the GPU; then split so there are about
    two programs per SM, at most MAX_SPLITS, a power of two.
    """
    if num_query_tokens != num_seqs or max_context < SPLIT_KV_MIN_CONTEXT:
        return 1
    programs = num_seqs * num_kv_heads
    if programs >= 2 * num_sms:
        return 1
    splits = min(MAX_SPLITS, triton.next_power_of_2((2 * num_sms + programs - 1) // programs))
    while splits > 1 and max_context // splits < 512:
        splits //= 2
    return splits


def _as_tensor(x, device: torch.device) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.to(device)
    return torch.tensor(list(x), dtype=torch.int32, device=device)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_start_loc: list[int] | torch.Tensor,
    seq_lens: list[int] | torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    tile_n: int = DEFAULT_TILE_N,
) -> torch.Tensor:
    """Causal attention of packed queries over paged keys and values (Triton).

    Sequence ``i``'s queries ``query[query_start_loc[i]:query_start_loc[i+1]]``
    are the last ``q_len`` of its ``seq_lens[i]`` tokens. Query head ``h``
    reads KV head ``h // (num_heads // num_kv_heads)``.

    Args:
        query: [num_query_tokens, num_heads, head_dim], last dim contiguous;
            head_dim a power of two >= 16.
        key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim];
            block_size a power of two.
        query_start_loc: [num_seqs + 1] int32/int64 cumulative query lengths.
        seq_lens: [num_seqs] int32/int64 context lengths (cached + new tokens).
        block_tables: [num_seqs, max_blocks] int32 physical block ids.
        scale: softmax scale, usually head_dim ** -0.5.
        out: optional [num_query_tokens, num_heads, head_dim] output buffer
            (last dim contiguous).
        num_splits: split-KV factor (power of two); None picks it with
            :func:`choose_num_splits`; 1 disables it.
        tile_n: key/value tokens per inner iteration (power of two >= 16).

    Returns:
        ``out``: [num_query_tokens, num_heads, head_dim], query's dtype.

    Raises:
        ValueError: unsupported shapes. RuntimeError: non-CUDA tensors without
        TRITON_INTERPRET=1.
    """
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if head_dim < 16 or head_dim & (head_dim - 1) or block_size & (block_size - 1):
        raise ValueError(f"head_dim ({head_dim}) must be a power of two >= 16 and block_size ({block_size}) a power of two")
    if tile_n < 16 or tile_n & (tile_n - 1):
        raise ValueError(f"tile_n must be a power of two >= 16, got {tile_n}")
    if out is None:
        out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    device = query.device
    qsl = _as_tensor(query_start_loc, device)
    lens = _as_tensor(seq_lens, device)
    num_seqs = lens.shape[0]
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    block_m = max(16, group_pad)
    block_q = block_m // group_pad
    if num_splits is None:
        num_splits = choose_num_splits(
            num_tokens, num_seqs, num_kv_heads, block_tables.shape[1] * block_size, _sm_count(device)
        )
    if num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two, got {num_splits}")
    precision = "ieee" if query.dtype == torch.float32 else "tf32"
    scale_log2 = scale * 1.4426950408889634  # log2(e): the kernel uses exp2
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, num_splits)
    kernel = launchable(_unified_attention_kernel, device)
    common = dict(
        NUM_QUERIES_PER_KV=group,
        GROUP_PAD=group_pad,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        TILE_N=tile_n,
        NUM_SPLITS=num_splits,
        DOT_PRECISION=precision,
    )
    cache_strides = (
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
    )
    if num_splits == 1:
        kernel[grid](
            query, key_cache, value_cache, out, out, block_tables, lens, qsl, scale_log2,
            num_seqs, query.stride(0), query.stride(1), out.stride(0), out.stride(1),
            *cache_strides, block_tables.stride(0), **common,
        )
        return out
    partial = torch.empty((num_tokens, num_heads, num_splits, head_dim), dtype=torch.float32, device=device)
    lse = torch.empty((num_tokens, num_heads, num_splits), dtype=torch.float32, device=device)
    kernel[grid](
        query, key_cache, value_cache, partial, lse, block_tables, lens, qsl, scale_log2,
        num_seqs, query.stride(0), query.stride(1), num_heads, 1,
        *cache_strides, block_tables.stride(0), **common,
    )
    # Rows no split wrote (none for valid inputs) stay out of the merge: every
    # (token, head) has key 0 in split 0.
    block_r = 16
    merge = launchable(_merge_splits_kernel, device)
    merge[(triton.cdiv(num_tokens * num_heads, block_r),)](
        partial, lse, out, num_tokens * num_heads, num_heads, out.stride(0), out.stride(1),
        NUM_SPLITS=num_splits, HEAD_DIM=head_dim, BLOCK_R=block_r,
    )
    return out
