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
        windowed: what :func:`windowed_attention` derives once a step per
            window (the PyTorch kernel's plans, the rows past the window),
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
    holds every key it sees causally); the rows at ``window`` or later, and
    only they, are computed by the PyTorch kernel and replace theirs. Both
    kernels are batch-invariant, and a row's kernel is chosen by its position
    alone, so its bits depend only on the query and its context
    (tests/engine/test_windowed_invariance.py).

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
    num_heads = query.shape[1]
    if softcap is not None:
        plan = _per_step(md, (window, "every row"), lambda: torch_attention.plan_attention(
            key_cache, num_heads, md.query_start_loc, md.seq_lens, md.block_tables, window))
        return torch_attention.paged_attention(query, key_cache, value_cache, md.query_start_loc, md.seq_lens,
                                               md.block_tables, scale, out=out, plan=plan, softcap=softcap)
    later, start_loc, plan = _per_step(md, (window, "past it"), lambda: _past_window(md, key_cache, num_heads,
                                                                                     window))
    if later.numel():   # those rows alone, each sequence's as the last rows of its chunk (any chunk: same bits)
        attended = torch_attention.paged_attention(query.index_select(0, later), key_cache, value_cache, start_loc,
                                                   md.seq_lens, md.block_tables, scale, plan=plan)
        out.index_copy_(0, later, attended)
    return out


def _per_step(md: AttentionMetadata, key: tuple, make):
    """``make()``, made by the step's first layer that asks for ``key`` and kept in ``md.windowed``."""
    md.windowed = md.windowed if md.windowed is not None else {}
    if key not in md.windowed:
        md.windowed[key] = make()
    return md.windowed[key]


def _past_window(md: AttentionMetadata, key_cache: torch.Tensor, num_heads: int,
                 window: int) -> tuple[torch.Tensor, list[int], torch_attention.AttentionPlan]:
    """The step's query rows at a position of ``window`` or later (int64, in order: of each sequence the last
    rows of its chunk), their cumulative count per sequence (the ``query_start_loc`` of those rows alone), and
    the PyTorch kernel's plan over them."""
    qsl, lens = md.query_start_loc.tolist(), md.seq_lens.tolist()
    past = [max(0, min(qsl[i + 1] - qsl[i], lens[i] - window)) for i in range(len(lens))]
    later = [r for i, k in enumerate(past) for r in range(qsl[i + 1] - k, qsl[i + 1])]
    start_loc = [0]
    for k in past:
        start_loc.append(start_loc[-1] + k)
    plan = torch_attention.plan_attention(key_cache, num_heads, start_loc, lens, md.block_tables, window)
    return torch.tensor(later, dtype=torch.int64, device=key_cache.device), start_loc, plan
