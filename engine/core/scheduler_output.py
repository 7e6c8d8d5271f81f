"""What the scheduler hands the model runner for one step."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.request import Request


@dataclass
class ScheduledRequest:
    """One request's share of a step.

    The model runner computes the tokens
    ``request.all_token_ids[num_computed_tokens : num_computed_tokens + num_new_tokens]``
    at positions ``num_computed_tokens ...``, writes their keys and values to
    the slots given by ``block_ids`` (the request's whole block table, already
    long enough), and attends over the first ``num_computed_tokens +
    num_new_tokens`` tokens. It samples a token for this request only when
    ``sample`` is True (the chunk reaches the end of the known tokens). The
    last ``len(spec_token_ids)`` new tokens are ``spec_token_ids``
    (proposals, after the request's known tokens): it then needs logits at
    each of the last ``len(spec_token_ids) + 1`` positions.

    A pooling chunk with ``layers`` (first, end) runs through those layers
    only, in a pass of its own: from its tokens' embeddings when first is 0,
    else from the hidden state the runner kept for it at the previous step;
    before the last layer its hidden state is kept again, and the scheduler
    counts its tokens as computed only after the last layer.

    Attributes:
        request: the request (not mutated by the model runner).
        num_computed_tokens: tokens already in the cache before this step.
        num_new_tokens: tokens to compute this step (>= 1).
        block_ids: the request's block table (physical block ids), in order.
        sample: whether to sample a next token from the last position.
        spec_token_ids: proposed tokens, the last of the new tokens.
        layers: (first, end) decoder layers this step runs the chunk through;
            None: all of them, in the step's batch.
    """

    request: Request
    num_computed_tokens: int
    num_new_tokens: int
    block_ids: list[int]
    sample: bool
    spec_token_ids: list[int] = field(default_factory=list)
    layers: tuple[int, int] | None = None


@dataclass
class SchedulerOutput:
    """One step's batch, in batch order (running requests first).

    Before the forward pass the model runner applies, in this order:
    ``blocks_to_swap_out`` (device block -> CPU block), ``blocks_to_swap_in``
    (CPU block -> device block), then ``blocks_to_copy`` (copy-on-write,
    src device block -> dst device block).

    Attributes:
        scheduled: requests in this step with their token counts.
        num_batched_tokens: sum of ``num_new_tokens``.
        blocks_to_copy: (src, dst) device block pairs.
        blocks_to_swap_out: (device block, cpu block) pairs.
        blocks_to_swap_in: (cpu block, device block) pairs.
        preempted: requests preempted in this step (for metrics).
        finished_req_ids: requests whose chunk in flight through part of the
            layers ended otherwise (finished, aborted or preempted by
            recompute) since the previous step: the runner drops their
            hidden states (vLLM's name).
        num_steps: decode steps the batch runs in this call (``engine/core/multi_step.py``): each entry, a
            decode, gets that many tokens (its table long enough for them); 1 for any other batch.
    """

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_batched_tokens: int = 0
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    finished_req_ids: set[str] = field(default_factory=set)
    num_steps: int = 1

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.blocks_to_swap_out
