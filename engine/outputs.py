"""What the engine returns: vLLM's ``RequestOutput`` and ``CompletionOutput``; the offline pooling API's
``PoolingRequestOutput`` and ``EmbeddingRequestOutput``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Logprob:
    """Log-probability of one token (natural log, from the model's raw
    distribution before temperature, penalties and top-k/top-p).

    ``rank`` is 1 for the most likely token. ``decoded_token`` is the token's
    text (may be a partial UTF-8 sequence, rendered as-is)."""

    logprob: float
    rank: int
    decoded_token: str = ""


# One generated (or prompt) position: {token_id: Logprob}; the sampled token is
# always present, plus the top-k when requested.
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One choice (``index``) of a request.

    In delta mode (``AsyncEngine.generate`` and ``LLMEngine.step`` under the
    default ``output_kind``, DELTA) ``text``, ``token_ids`` and ``logprobs``
    hold only what is new since the previous output for this index; in final
    mode (``LLM.generate``, or ``output_kind`` CUMULATIVE or FINAL_ONLY) they
    are cumulative.

    Attributes:
        index: OpenAI choice index, 0..n-1.
        text: decoded text (stop strings removed unless asked for).
        token_ids: generated token ids.
        logprobs: one entry per token in ``token_ids`` when requested, else None.
        finish_reason: None while running, else "stop", "length" or "abort".
        stop_reason: the stop string or stop token id that ended it, if any.
        num_generated_tokens: total tokens generated so far for this index
            (cumulative in both modes).
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_generated_tokens: int = 0

    @property
    def cumulative_logprob(self) -> float | None:
        """vLLM's: the sum of the logprobs of ``token_ids`` (natural log, in order), None when logprobs were not
        asked for (``SamplingParams.logprobs``)."""
        if self.logprobs is None:
            return None
        return sum(pos[t].logprob for t, pos in zip(self.token_ids, self.logprobs))

    def finished(self) -> bool:
        """vLLM's (a method, as there): whether this choice has ended (``finish_reason`` set)."""
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Timestamps (``time.monotonic()`` seconds) and the request's parameters that vLLM's per-request histograms
    read (``max_tokens_param``: its ``max_tokens``, None when unset; ``n_param``: its ``n``)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    max_tokens_param: int | None = None
    n_param: int = 1


@dataclass
class RequestOutput:
    """The engine's answer for one client request (all of its ``n`` choices).

    Attributes:
        request_id: the client's request id (the parent id when n > 1).
        prompt: the prompt text when it was given as text.
        prompt_token_ids: the prompt, tokens.
        prompt_logprobs: per prompt position (None for the first) when requested.
        outputs: the choices with news (DELTA and CUMULATIVE outputs) or all choices (final ones).
        finished: True once every choice has finished.
        num_cached_tokens: prompt tokens served from the prefix cache.
        metrics: timestamps.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None


@dataclass
class PoolingOutput:
    """vLLM's: one prompt's pooled hidden states.

    Attributes:
        data: ``torch.Tensor`` of float32, shape ``[hidden_size]`` (the ``embed`` task's vector).
    """

    data: Any


@dataclass
class PoolingRequestOutput:
    """vLLM's answer to one pooling prompt (``LLM.encode``).

    Attributes:
        request_id: the prompt's request id (``offline-<n>``, the counter ``LLM.generate`` draws from).
        outputs: the pooled data (``PoolingOutput``; ``EmbeddingOutput`` in an ``EmbeddingRequestOutput``).
        prompt_token_ids: the prompt, tokens.
        num_cached_tokens: prompt tokens served from the prefix cache (0: a pooling request reads none, its
            pooled states may need every position).
        finished: True (the offline API answers once the vector is pooled).
    """

    request_id: str
    outputs: Any
    prompt_token_ids: list[int]
    num_cached_tokens: int = 0
    finished: bool = True


@dataclass
class EmbeddingOutput:
    """vLLM's: one prompt's embedding.

    Attributes:
        embedding: ``hidden_size`` float32 values (as Python floats, exact).
    """

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        """The vector's length."""
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput(PoolingRequestOutput):
    """vLLM's answer to one ``LLM.embed`` prompt: a ``PoolingRequestOutput`` whose ``outputs`` is an
    ``EmbeddingOutput`` (``outputs.embedding``)."""

    outputs: EmbeddingOutput
