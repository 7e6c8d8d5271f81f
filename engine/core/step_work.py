"""What a step computed, for the prompt-token metric and the TTFT calibration (``engine/core/ttft_calibration.py``):
its prefill tokens, decode rows, prefill chunks and their attention pairs (``quad_of``).

A pooling chunk through part of the layers (``ScheduledRequest.layers``, ``engine/core/step_cost.py``) is that
share of its work in each step it runs in: its tokens, pairs and chunk are weighed by its layers over the model's;
its tokens count as prompt tokens once, in the step of its last layer.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.core.scheduler_output import ScheduledRequest
from engine.core.step_cost import attention_pairs


@dataclass
class StepWork:
    """One step's work.

    Attributes:
        prompt_tokens: prompt tokens computed (through every layer) in the step.
        prefill_tokens: prefill tokens, a chunk through part of the layers weighed by its share of them.
        decode_rows: rows past their prompt (decodes, proposals' verification).
        chunks: prefill chunks, weighed alike.
        quad: attention (query, key) pairs of every row (``engine.core.ttft.quad_of``), weighed alike.
    """

    prompt_tokens: int = 0
    prefill_tokens: float = 0.0
    decode_rows: int = 0
    chunks: float = 0.0
    quad: float = 0.0


def step_work(scheduled: list[ScheduledRequest], num_layers: int) -> StepWork:
    """The work of a step's ``scheduled`` entries, of a model of ``num_layers`` decoder layers."""
    work = StepWork()
    for entry in scheduled:
        req, start, new = entry.request, entry.num_computed_tokens, entry.num_new_tokens
        share = 1.0 if entry.layers is None else (entry.layers[1] - entry.layers[0]) / num_layers
        work.quad += share * attention_pairs(new, start)
        if start < req.num_prompt_tokens:
            prompt = min(new, req.num_prompt_tokens - start)
            work.prefill_tokens += share * prompt
            work.chunks += share
            if entry.layers is None or entry.layers[1] == num_layers:
                work.prompt_tokens += prompt
        else:
            work.decode_rows += 1
    return work
