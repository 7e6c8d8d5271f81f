"""Several decode steps per scheduler call (vLLM's multi-step scheduling, ``num_scheduler_steps``).

A one-sequence decode step of a small model on CPU spends ~15 % of its time in Python between the C calls
(scheduling, sampling, the runner's inputs, the outputs), and that Python runs cold: the weights' pass evicts the
interpreter's code and data from the last-level cache every step (``docs/benchmarks/decode-roofline.md``). When
every scheduled entry is a decode whose next token is the raw logits' argmax (``sampler.picks_raw_argmax``), the
step may run several decodes in one C call (``kernels/cpu_decoder.py``'s ``decode_greedy``) and hand back their
tokens together, as accepted proposals are: ``Scheduler.update_from_output`` appends them one at a time and drops
what follows a stop, so a request's tokens are the ones a step at a time gives.

While it runs, a request arriving waits for it (its time to first token), as does an abort: the steps are
capped so that the call reads about ``MULTI_STEP_BYTES`` (each step reads the weights again and every row's keys
and values), and none run while a request waits or is swapped out. A count of bytes, not of measured seconds, so
that the steps a batch runs do not depend on the host's speed or load. Each step's tokens are still reported
apart (``EngineCore._news``): a stream's chunks are those of one step per call.
"""

from __future__ import annotations

from collections.abc import Callable

from engine.core.request import Request
from engine.core.scheduler_output import SchedulerOutput

# Bytes a call of several decode steps may read: a request arriving meanwhile waits for it. 1 GB is ~25 ms at
# the 40-50 GB/s the Intel host of docs/benchmarks/decode-roofline.md reads its weights at (a quarter of the
# ~100 ms gap between tokens a reader notices), eight one-sequence steps of the embedded model (98 MB each).
MULTI_STEP_BYTES = 1_000_000_000


def steps_allowed(num_scheduler_steps: int, step_bytes: int) -> int:
    """Decode steps one scheduler call may run: ``num_scheduler_steps``, fewer where that many steps reading
    ``step_bytes`` each would read more than ``MULTI_STEP_BYTES``; at least 1."""
    if num_scheduler_steps <= 1:
        return 1
    return max(1, min(num_scheduler_steps, MULTI_STEP_BYTES // max(step_bytes, 1)))


def lookahead_steps(out: SchedulerOutput, kv, max_steps: int, max_model_len: int,
                    qualifies: Callable[[Request], bool]) -> int:
    """The decode steps the batch ``out`` runs: ``max_steps`` or fewer (none past a request's ``max_tokens`` or
    ``max_model_len``) when every entry is a whole decode (one new token after the prompt, sampled, no proposals,
    all layers) of a request ``qualifies`` accepts, the step moves no blocks to or from the CPU and nothing was
    preempted; else 1. For more than one, each request's block table is made long enough for them
    (``kv.allocate_slots``) and its entry's ``block_ids`` refreshed; where a table cannot grow, 1 (the blocks
    taken stay with their requests, which need them next)."""
    if max_steps < 2 or not out.scheduled or out.preempted or out.blocks_to_swap_in or out.blocks_to_swap_out:
        return 1
    steps = max_steps
    for e in out.scheduled:
        req = e.request
        if (e.num_new_tokens != 1 or not e.sample or e.spec_token_ids or e.layers is not None
                or req.pooling_params is not None or req.num_computed_tokens < req.num_prompt_tokens
                or not qualifies(req)):
            return 1
        steps = min(steps, req.max_tokens - req.num_output_tokens, max_model_len - req.num_tokens)
    if steps < 2:
        return 1
    for e in out.scheduled:
        if not kv.allocate_slots(e.request, steps):
            return 1
        e.block_ids = kv.get_block_ids(e.request.request_id)
    return steps
