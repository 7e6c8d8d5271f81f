"""How many tokens of a request one scheduler step computes: all its next tokens, a chunk of them (chunked
prefill), or none; the speculative proposals that ride along a decode; and a pooling chunk's passage through
part of the layers.

A pooling request's chunks beside generation work are sized by their cost, attention over their context included
(``engine/core/step_cost.py``), and deep in a long input carried through part of the layers per step
(``ScheduledRequest.layers``; preempted by recompute, such a chunk starts over).
"""

from __future__ import annotations

from engine.core.request import Request
from engine.core.scheduler_output import ScheduledRequest
from engine.core.step_cost import StepAllowance


def chunk_tokens(num_new: int, budget: int, max_num_batched_tokens: int, enable_chunked_prefill: bool) -> int:
    """Tokens a step schedules of a request's ``num_new`` next tokens with ``budget`` tokens of the step left:
    all, a chunk (chunked prefill, or a sequence that could never fit in one step), or 0 (wait). The one rule
    both the scheduler and the TTFT simulation (``engine/core/ttft_sim.py``) follow."""
    if num_new <= budget:
        return num_new
    if enable_chunked_prefill or num_new > max_num_batched_tokens:
        return budget
    return 0


def next_chunk(allowance: StepAllowance, req: Request, computed: int, need: int, budget: int,
               max_num_batched_tokens: int, enable_chunked_prefill: bool) -> tuple[int, tuple[int, int] | None]:
    """(tokens to schedule of ``req``'s ``need`` tokens past ``computed`` under ``budget`` and, for a pooling chunk,
    the step's ``allowance``, the layers they run through: None for all) (``chunk_tokens``, ``StepAllowance``)."""
    pooling = req.pooling_params is not None
    split = allowance.split(pooling, computed, min(budget, need), req.num_computed_layers, req.layer_chunk_tokens)
    if split is not None:
        return split
    budget = allowance.limit(pooling, computed, budget)
    return chunk_tokens(need, budget, max_num_batched_tokens, enable_chunked_prefill), None


def spec_tokens(req: Request, num_new: int, budget: int, max_model_len: int) -> list[int]:
    """The request's proposals that ride along this step (speculative
    decoding): only after a whole decode of its known tokens, as many as
    the budget and ``max_model_len`` leave room for."""
    if not req.spec_token_ids or req.num_computed_tokens + num_new != req.num_tokens:
        return []
    room = min(budget - num_new, max_model_len - req.num_tokens)
    return req.spec_token_ids[:max(room, 0)]


def drop_layer_chunk(req: Request, dropped: set[str]) -> None:
    """Forget ``req``'s chunk in flight through part of the layers (finished, or preempted by recompute); its id
    joins ``dropped`` when the runner holds its hidden state."""
    if req.num_computed_layers:
        dropped.add(req.request_id)
    req.num_computed_layers = req.layer_chunk_tokens = 0


def layer_pass_midway(req: Request, sr: ScheduledRequest, num_layers: int) -> bool:
    """Record a step's pass of ``req``'s chunk through layers ``sr.layers``; True while the chunk is midway (not
    through all ``num_layers``: its tokens are not computed yet)."""
    midway = sr.layers[1] < num_layers
    req.num_computed_layers = sr.layers[1] if midway else 0
    req.layer_chunk_tokens = sr.num_new_tokens if midway else 0
    return midway
