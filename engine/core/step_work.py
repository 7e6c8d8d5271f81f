"""What a step computed, for the prompt-token metric and the TTFT calibration (``engine/core/ttft_calibration.py``):
its prefill tokens, decode rows, prefill chunks and their attention pairs (``quad_of``); and the tokens of each
step, for vLLM's ``vllm:iteration_tokens_total`` histogram (``IterationTokens``).

A pooling chunk through part of the layers (``ScheduledRequest.layers``, ``engine/core/step_cost.py``) is that
share of its work in each step it runs in: its tokens, pairs and chunk are weighed by its layers over the model's;
its tokens count as prompt tokens once, in the step of its last layer.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

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


# vLLM's bucket bounds of ``vllm:iteration_tokens_total`` (vllm/v1/metrics/loggers.py), tokens.
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass
class IterationTokens:
    """The tokens of each engine step (prompt tokens computed plus tokens generated, as vLLM's
    ``vllm:iteration_tokens_total``), counted since the engine started.

    Attributes:
        counts: steps per bucket: ``counts[i]`` those with at most ``ITERATION_TOKEN_BUCKETS[i]`` tokens and more
            than the bucket before; the last entry, past every bound.
        total: the tokens of every step counted.
    """

    counts: list[int] = field(default_factory=lambda: [0] * (len(ITERATION_TOKEN_BUCKETS) + 1))
    total: int = 0

    def observe_call(self, prompt_tokens: int, generated: list[int], num_steps: int) -> None:
        """Count one call of ``num_steps`` steps: ``prompt_tokens`` computed in its first step, ``generated[i]``
        tokens kept for sequence i over the call (a sequence adds one token a step while it runs; a call of one
        step may add several: accepted proposals). A step that kept nothing (its sequences had finished) is not
        counted."""
        steps = [prompt_tokens + sum(generated)] if num_steps <= 1 else [
            (prompt_tokens if i == 0 else 0) + sum(1 for n in generated if n > i) for i in range(num_steps)]
        for tokens in steps:
            if tokens > 0:
                self.counts[bisect.bisect_left(ITERATION_TOKEN_BUCKETS, tokens)] += 1
                self.total += tokens
