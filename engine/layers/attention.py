"""Attention metadata of one step, and the path for what the C and Triton
paged kernels lack: a sliding window (Mistral, Gemma 2/3's local layers) and
logit soft-capping (Gemma 2), given by the PyTorch paged kernel
(``kernels/torch_attention.py``), which has both.

Semantics follow transformers: a query at position ``p`` sees keys at
positions ``p - window < k <= p`` (``masking_utils.sliding_window_overlay``);
soft-capping is ``cap * tanh(scores / cap)`` on the scaled scores, before
the mask (``eager_attention_forward`` of ``modeling_gemma2``).

Which kernel gives a row depends on the row alone, never on its chunk: a
trial found a Gemma 3 prompt's logprobs changed with the batch, the chunk
size and preemption, when a whole chunk went to a per-sequence einsum as soon
as its context passed the window (the einsum's shapes, and so its rounding,
were the chunk's).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import torch_attention


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
        windowed: per window (None: none), the PyTorch kernel's plan of
            the step and the rows :func:`windowed_attention` takes from it,
            made by the first layer that asks.
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    attn_plan: object | None = None
    windowed: dict | None = None


def windowed_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                       md: AttentionMetadata, scale: float, window: int | None, softcap: float | None,
                       out: torch.Tensor | None) -> torch.Tensor:
    """Causal attention with a sliding window and/or soft-capped logits over
    the paged caches.

    With ``softcap`` every row is the PyTorch paged kernel's (``out`` may be
    None). With a window alone, ``out`` holds the paged kernel's attention of
    every row, right for a query at a position below ``window`` (its window
    holds every key it sees causally); the rows at ``window`` or later are
    replaced by the PyTorch kernel's. Both kernels are batch-invariant, and a
    row's kernel is chosen by its position alone, so its bits depend only on
    the query and its context (tests/engine/test_windowed_invariance.py).

    Args:
        query: [num_tokens, num_heads, head_dim].
        key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim].
        md: the step's metadata.
        scale: softmax scale; window: keys per query (None: unbounded);
        softcap: the logit cap (None: none).
        out: [num_tokens, num_heads, head_dim], written in place (None: a
            new tensor, with ``softcap``).

    Returns:
        ``out``.
    """
    plan, later = _windowed_plan(md, key_cache, query.shape[1], window)
    args = (query, key_cache, value_cache, md.query_start_loc, md.seq_lens, md.block_tables, scale)
    if softcap is not None:
        return torch_attention.paged_attention(*args, out=out, plan=plan, softcap=softcap)
    if later.numel():
        full = torch_attention.paged_attention(*args, plan=plan)
        out.index_copy_(0, later, full.index_select(0, later))
    return out


def _windowed_plan(md: AttentionMetadata, key_cache: torch.Tensor, num_heads: int,
                   window: int | None) -> tuple[torch_attention.AttentionPlan, torch.Tensor]:
    """The PyTorch kernel's plan of the step for ``window``, and the query rows (int64) at a position of
    ``window`` or later (none without a window), made once a step per window."""
    md.windowed = md.windowed if md.windowed is not None else {}
    if window not in md.windowed:
        qsl, lens = md.query_start_loc.tolist(), md.seq_lens.tolist()
        later = [qsl[i] + j for i in range(len(lens)) for j in range(qsl[i + 1] - qsl[i])
                 if window is not None and lens[i] - (qsl[i + 1] - qsl[i]) + j >= window]
        plan = torch_attention.plan_attention(key_cache, num_heads, qsl, lens, md.block_tables, window)
        md.windowed[window] = (plan, torch.tensor(later, dtype=torch.int64, device=key_cache.device))
    return md.windowed[window]
