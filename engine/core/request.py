"""A request (one sequence) as the scheduler and the KV cache manager see it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.sampling_params import SamplingParams

if TYPE_CHECKING:   # engine.pooling imports torch, which the front end's process does without
    from engine.pooling import PoolingParams


class RequestStatus(enum.IntEnum):
    """Life cycle of a request. Values above ``SWAPPED`` are finished states."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # preempted by recompute: back in the waiting queue, blocks freed
    SWAPPED = 3  # preempted by swapping: its blocks live in CPU memory
    FINISHED_STOPPED = 4  # EOS, a stop token id or a stop string
    FINISHED_LENGTH = 5  # max_tokens or max_model_len reached
    FINISHED_ABORTED = 6  # the client went away, or the engine aborted it

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's ``finish_reason`` for a finished status, else None."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(eq=False)
class ForkGroup:
    """The ``n`` sibling sequences of one prompt (parallel sampling).

    The leader (index 0) prefills the prompt up to its last token. The
    scheduler then forks the leader's block table into every sibling
    (reference counts, no copy), and each sibling computes the last prompt
    token itself, which writes into the shared last block: copy-on-write.
    ``forked`` turns True once that happened; siblings wait until then.
    """

    parent_id: str
    members: list["Request"] = field(default_factory=list)
    forked: bool = False


@dataclass(eq=False)
class Request:
    """One sequence: a prompt, its sampling parameters and its generated tokens.

    For ``n > 1`` the engine creates ``n`` Requests sharing one ``ForkGroup``;
    ``index`` is the OpenAI choice index and ``parent_id`` the client's id.

    Invariants (checked in tests):
        0 <= num_computed_tokens <= num_tokens;
        the tokens ``all_token_ids[:num_computed_tokens]`` have their keys and
        values in the KV cache blocks of this request's block table.

    Attributes:
        request_id: unique engine-wide (children: ``f"{parent_id}-{index}"``
            when n > 1, else ``parent_id``).
        prompt_token_ids: the prompt, tokens.
        sampling_params: how to sample.
        eos_token_id: the tokenizer's EOS id (None: no EOS stop).
        max_tokens: resolved budget of new tokens (never None).
        arrival_time: ``time.monotonic()`` seconds at submission.
        priority: lower value = served first under the ``priority`` policy
            (vLLM's convention).
        num_computed_tokens: tokens whose KV is in the cache.
        num_cached_tokens: prompt tokens found in the prefix cache at first
            scheduling (-1 until scheduled).
        pooling_params: set for a pooling request (an embedding): its prompt
            is prefilled in chunks like any other, nothing is sampled, and it
            finishes once the whole prompt is computed (``max_tokens`` 0).
        spec_token_ids: tokens proposed for this sequence's next step
            (speculative decoding, ``engine/spec_decode/``); not part of its
            tokens until verified.
        num_computed_layers: layers a pooling chunk carried through part of
            the layers per step has run through (0: no chunk in flight;
            ``engine/core/step_cost.py``); its hidden state waits in the
            model runner, its tokens count as computed after its last layer.
        layer_chunk_tokens: that chunk's tokens (after ``num_computed_tokens``).
        cache_salt: mixed into the hash of the prompt's first block (vLLM's ``cache_salt``): requests share
            prefix-cache blocks only when their salts are equal (None: the unsalted cache).
        input_index: a pooling request's place among its embedding call's inputs (OpenAI's ``data[].index``;
            0 for every other request): the scheduler seats each call's first inputs before any call's later
            ones (``Scheduler.seat_order``).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    max_tokens: int = 16
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    parent_id: str = ""
    index: int = 0
    group: ForkGroup | None = None
    pooling_params: PoolingParams | None = None
    cache_salt: str | None = None
    input_index: int = 0
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    spec_token_ids: list[int] = field(default_factory=list)
    num_computed_layers: int = 0
    layer_chunk_tokens: int = 0
    # Timestamps (time.monotonic seconds) for metrics.
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    def __post_init__(self) -> None:
        if not self.parent_id:
            self.parent_id = self.request_id
        self._all_token_ids: list[int] = list(self.prompt_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by the generated tokens (do not mutate)."""
        return self._all_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        """Append sampled tokens to the output (and to ``all_token_ids``)."""
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        self.output_token_ids.extend(token_ids)
        self._all_token_ids.extend(token_ids)
