"""What one tensor-parallel rank holds of a model: its attention heads, its
part of the MLP's intermediate dimension and of the vocabulary (vLLM's
tensor parallelism, Shoeybi et al. 2019, "Megatron-LM").

* KV heads are split as evenly as the count allows (the first ranks take one
  more); each rank keeps the query heads of its KV heads (GQA groups stay
  whole), so a rank's attention needs no other rank's cache.
* With fewer KV heads than ranks, each KV head is replicated on the ranks
  ``r`` with ``r * num_kv_heads // world_size`` equal to it (vLLM's rule when
  ``world_size`` is a multiple of ``num_kv_heads``; here any count works) and
  its query heads are split between them. Refused (ValueError) only with
  more ranks than attention heads (a rank would get no query head).
* Unlike vLLM, head and intermediate counts need not divide evenly: ranks
  then differ by one head (one group) or one unit of the intermediate
  dimension. The unit is 32 elements (a GGUF quantization block, so a rank's
  slice of a quantized ``down_proj`` is whole blocks) when the dimension is a
  multiple of 32 with at least one unit per rank, else 1.
* The vocabulary is split into ``ceil(vocab / world_size)`` rows per rank
  (the last rank's padded with zero rows), so that every rank's logits have
  one shape and gather into ``[rows, world_size * per_rank]``.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.model_config import ModelConfig

_UNIT = 32  # elements per GGUF Q4_0/Q4_1/Q8_0 block


@dataclass(frozen=True)
class Span:
    """A range ``[start, start + size)`` of a global dimension (heads, elements, vocabulary rows)."""

    start: int
    size: int

    @property
    def stop(self) -> int:
        return self.start + self.size


@dataclass(frozen=True)
class TPShard:
    """One rank's part of a model (global indices).

    Attributes:
        rank, world_size: the rank in the tensor-parallel group and its size (1: the whole model).
        q_heads, kv_heads: attention heads this rank computes (query) and caches (key/value).
        intermediate: elements of the MLP's intermediate dimension (gate/up rows, down columns).
        vocab: vocabulary rows of the embedding and the output head held here.
        vocab_per_rank: rows of this rank's embedding and head tensors (``vocab.size`` plus zero padding).
    """

    rank: int
    world_size: int
    q_heads: Span
    kv_heads: Span
    intermediate: Span
    vocab: Span
    vocab_per_rank: int

    @property
    def num_heads(self) -> int:
        return self.q_heads.size

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads.size


def balanced(total: int, parts: int, index: int) -> Span:
    """Part ``index`` of ``total`` items cut into ``parts`` contiguous parts whose sizes differ by at most one
    (the first ``total % parts`` parts take one more)."""
    base, extra = divmod(total, parts)
    return Span(index * base + min(index, extra), base + (index < extra))


def _heads(num_heads: int, num_kv_heads: int, rank: int, world_size: int) -> tuple[Span, Span]:
    """(query heads, KV heads) of ``rank`` (see the module's docstring)."""
    group = num_heads // num_kv_heads
    if world_size > num_heads:
        raise ValueError(f"tensor_parallel_size {world_size} exceeds the model's {num_heads} attention heads: "
                         "every rank needs at least one")
    if num_kv_heads >= world_size:
        kv = balanced(num_kv_heads, world_size, rank)
        return Span(kv.start * group, kv.size * group), kv
    kv_head = rank * num_kv_heads // world_size
    # at most ceil(world_size / num_kv_heads) <= group ranks share one: each gets a query head
    sharing = [r for r in range(world_size) if r * num_kv_heads // world_size == kv_head]
    q = balanced(group, len(sharing), sharing.index(rank))
    return Span(kv_head * group + q.start, q.size), Span(kv_head, 1)


def plan_shard(config: ModelConfig, rank: int = 0, world_size: int = 1) -> TPShard:
    """``rank``'s part of a model of shape ``config`` split over ``world_size`` ranks (1: the whole model).

    Raises:
        ValueError: a split that leaves a rank without a query head (see the module's docstring).
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, {world_size})")
    q, kv = _heads(config.num_attention_heads, config.num_key_value_heads, rank, world_size)
    inter = config.intermediate_size
    unit = _UNIT if inter % _UNIT == 0 and inter // _UNIT >= world_size else 1
    units = balanced(inter // unit, world_size, rank)
    per_rank = -(-config.vocab_size // world_size)
    start = min(rank * per_rank, config.vocab_size)
    return TPShard(rank, world_size, q, kv, Span(units.start * unit, units.size * unit),
                   Span(start, min(per_rank, config.vocab_size - start)), per_rank)
