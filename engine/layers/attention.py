"""Attention metadata of one step, and the PyTorch path for what the paged
kernels (``kernels``: C, PyTorch, Triton) lack: a sliding window (Mistral,
Gemma 2/3's local layers) and logit soft-capping (Gemma 2).

Semantics follow transformers: a query at position ``p`` sees keys at
positions ``p - window < k <= p`` (``masking_utils.sliding_window_overlay``);
soft-capping is ``cap * tanh(scores / cap)`` on the scaled scores, before
the mask (``eager_attention_forward`` of ``modeling_gemma2``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Where one step's tokens live in the paged KV cache.

    Attributes:
        slot_mapping: [num_tokens] int64, cache slot (block * block_size +
            offset) of each token; -1 = padding, not written.
        query_start_loc: [num_seqs + 1] int32, cumulative query lengths.
        seq_lens: [num_seqs] int32, context length (cached + new) per sequence.
        block_tables: [num_seqs, max_blocks] int32 physical block ids
            (0 = the null block pads short rows).
        attn_plan: the attention backend's per-step index work
            (``AttentionBackend.plan``), built once by the model's forward
            and shared by its layers; None when the backend has none.
        spans: per sequence (first query row, query count, context length),
            read once per step by models with :func:`windowed_attention`
            layers; None until then.
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    attn_plan: object | None = None
    spans: list[tuple[int, int, int]] | None = None


def sequence_spans(md: AttentionMetadata) -> list[tuple[int, int, int]]:
    """(first query row, query count, context length) of each sequence of the step (one host read)."""
    qsl, lens = md.query_start_loc.tolist(), md.seq_lens.tolist()
    return [(qsl[i], qsl[i + 1] - qsl[i], lens[i]) for i in range(len(lens))]


def needs_windowed(seq_len: int, window: int | None, softcap: float | None) -> bool:
    """Whether a sequence's attention differs from plain causal attention: soft-capping, or a window its
    context exceeds (a window of ``seq_len`` or more covers every key a causal query sees)."""
    return softcap is not None or (window is not None and seq_len > window)


def windowed_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                       md: AttentionMetadata, scale: float, window: int | None, softcap: float | None,
                       out: torch.Tensor) -> torch.Tensor:
    """Causal attention with a sliding window and/or soft-capped logits, per
    sequence, over the paged caches; writes the rows of the sequences
    :func:`needs_windowed` selects into ``out`` (the others keep the paged
    kernel's result, which is the same attention for them).

    Scores and softmax run in float32, probabilities are rounded to the
    value dtype before ``probs @ values`` (transformers' eager numerics).
    Each sequence is computed alone, so a row never depends on the rest of
    the batch.

    Args:
        query: [num_tokens, num_heads, head_dim].
        key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim].
        md: the step's metadata, with ``spans`` set (:func:`sequence_spans`).
        scale: softmax scale; window: keys per query (None: unbounded);
        softcap: the logit cap (None: none).
        out: [num_tokens, num_heads, head_dim], written in place.

    Returns:
        ``out``.
    """
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    group = query.shape[1] // num_kv_heads
    for i, (start, q_len, seq_len) in enumerate(md.spans):
        if q_len == 0 or not needs_windowed(seq_len, window, softcap):
            continue
        nb = (seq_len + block_size - 1) // block_size
        blocks = md.block_tables[i, :nb].long()
        k = key_cache[blocks].reshape(nb * block_size, num_kv_heads, head_dim)[:seq_len]
        v = value_cache[blocks].reshape(nb * block_size, num_kv_heads, head_dim)[:seq_len]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [S, H, D]
        q = query[start:start + q_len]
        scores = torch.einsum("lhd,shd->hls", q.float(), k.float()) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
        k_pos = torch.arange(seq_len, device=q.device)[None, :]
        hidden = k_pos > q_pos
        if window is not None:
            hidden |= k_pos <= q_pos - window
        scores.masked_fill_(hidden, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        out[start:start + q_len] = torch.einsum("hls,shd->lhd", probs, v)
    return out
