"""Tensor-parallel layers with vLLM's names and meaning
(``vllm/model_executor/layers/linear.py``, ``vocab_parallel_embedding.py``):
each holds this rank's part of a weight (``engine/distributed/shard_plan.py``)
and says which part of a checkpoint tensor that is, so the loader reads only it.

* ``ColumnParallelLinear``: this rank's output rows; the output stays split
  (the next layer reads only its part). ``QKVParallelLinear`` (q, k, v heads)
  and ``MergedColumnParallelLinear`` (gate, up) stack several such parts.
* ``RowParallelLinear``: this rank's input columns; the ranks' partial
  outputs are summed by one all-reduce (``row_parallel_method``), and the
  residual is added once, after it.
* ``VocabParallelEmbedding`` / ``ParallelLMHead``: this rank's vocabulary
  rows; a lookup of an id held elsewhere gives zeros and the ranks' rows are
  summed (exact: one of them is nonzero); the head's logits are gathered on
  the driver (``gather_vocab``).

With one rank each layer holds the whole weight and adds nothing to a step:
the modules are ``nn.Linear``/``nn.Embedding`` whose linear methods
(``engine/layers/linear.py``) run as before, and the reductions are only
bound (``LlamaDecoderLayer.choose_kernels``) when there are several ranks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.shard_plan import Span


class ColumnParallelLinear(nn.Linear):
    """``y = x @ W_r.T + b_r`` for this rank's output rows ``W_r``: parts of one or several stacked
    checkpoint tensors (shard ids), each ``(full rows, this rank's span of them)``, in this order.

    Args:
        in_features: input width (whole on every rank).
        parts: shard id -> (rows of the whole part, this rank's span), in stacking order.
        bias: whether the projection has a bias (split with its rows).
    """

    def __init__(self, in_features: int, parts: dict, bias: bool = False) -> None:
        super().__init__(in_features, sum(span.size for _, span in parts.values()), bias=bias)
        self.parts = dict(parts)

    def row_copies(self, shard_ids: tuple) -> list[tuple[int, int, int]]:
        """``(source row, destination row, rows)`` to copy from a checkpoint tensor that stacks the parts
        ``shard_ids`` (one, or several fused: Phi-3's ``qkv_proj`` and ``gate_up_proj``) into this weight.

        Raises:
            KeyError: a shard id this layer does not have.
        """
        copies, source = [], 0
        order = list(self.parts)
        for sid in shard_ids:
            full, span = self.parts[sid]
            dst = sum(self.parts[p][1].size for p in order[:order.index(sid)])
            copies.append((source + span.start, dst, span.size))
            source += full
        return copies


class QKVParallelLinear(ColumnParallelLinear):
    """The fused q/k/v projection of this rank's query and KV heads (shard ids "q", "k", "v").

    Args:
        hidden_size: input width; head_dim: elements per head.
        total_heads, total_kv_heads: the model's head counts.
        q_heads, kv_heads: this rank's spans of them.
    """

    def __init__(self, hidden_size: int, head_dim: int, total_heads: int, total_kv_heads: int, q_heads: Span,
                 kv_heads: Span, bias: bool = False) -> None:
        q = Span(q_heads.start * head_dim, q_heads.size * head_dim)
        kv = Span(kv_heads.start * head_dim, kv_heads.size * head_dim)
        super().__init__(hidden_size, {"q": (total_heads * head_dim, q), "k": (total_kv_heads * head_dim, kv),
                                       "v": (total_kv_heads * head_dim, kv)}, bias=bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input stacked (gate and up: shard ids 0, 1), each split
    at the same ``span`` of its ``output_size`` rows."""

    def __init__(self, in_features: int, output_size: int, count: int, span: Span) -> None:
        super().__init__(in_features, {i: (output_size, span) for i in range(count)})


class RowParallelLinear(nn.Linear):
    """``x_r @ W_r.T`` for this rank's input columns ``W_r`` (``input_span`` of ``in_features`` whole); the
    ranks' outputs sum to the projection's (``row_parallel_method``). No bias (none of the registered
    architectures has one here)."""

    def __init__(self, in_features: int, out_features: int, input_span: Span) -> None:
        super().__init__(input_span.size, out_features, bias=False)
        self.input_span = input_span
        self.full_in_features = in_features


def row_parallel_method(method, tp):
    """A row-parallel projection's linear method over several ranks: this rank's partial output, summed
    over the ranks (``TensorParallelGroup.all_reduce``), then the residual added.

    Args:
        method: the linear method of this rank's weight (``engine.layers.linear.linear_method``).
        tp: the ``TensorParallelGroup``.
    """
    def reduced(x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        y = tp.all_reduce(method(x))
        return y if residual is None else residual + y
    return reduced


class VocabParallelEmbedding(nn.Embedding):
    """This rank's rows ``vocab`` of the embedding, in a tensor of ``rows`` rows (zero padding after them).

    Args:
        vocab: the global token ids held here; rows: this rank's row count (``TPShard.vocab_per_rank``).
        embedding_dim: hidden size.
        tp: the ``TensorParallelGroup``, or None with one rank (then a plain lookup).
    """

    def __init__(self, vocab: Span, rows: int, embedding_dim: int, tp=None) -> None:
        super().__init__(rows, embedding_dim)
        self.vocab = vocab
        self.tp = tp

    def reset_parameters(self) -> None:
        """Nothing: the weights are loaded (or drawn, ``init_dummy_weights``). ``nn.Embedding``'s normal draw,
        on the meta device the model is built on, imported ``torch._dynamo`` (1.5 s of CPU) for nothing."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab.start
        outside = (local < 0) | (local >= self.vocab.size)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """The output head's rows for this rank's vocabulary (its logits: ``gather_vocab``)."""


def gather_vocab(tp, logits: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
    """Every rank's logits ``[rows, vocab_per_rank]`` joined on the driver into ``[rows, vocab_size]``
    (the padding rows' columns dropped); None on the other ranks."""
    parts = tp.gather_to_driver(logits)
    if parts is None:
        return None
    return parts.permute(1, 0, 2).reshape(logits.shape[0], -1)[:, :vocab_size]
