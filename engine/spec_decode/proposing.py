"""The engine's side of speculative decoding: before each step, a proposal for every running sequence that is
decoding (as many tokens as are worth their cost, ``adaptive.py``); after it, how many were accepted (each
sequence's acceptance rate, the step's cost, and vLLM's ``spec_decode`` counters)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine.core.request import Request
from engine.spec_decode.adaptive import Acceptance, StepCost
from engine.spec_decode.config import SpeculativeConfig


@dataclass
class SpecDecodeStats:
    """Cumulative counters (vLLM's ``vllm:spec_decode_*`` metrics) and the acceptance histogram.

    Attributes:
        method: the proposer (``SpeculativeConfig.method``), the metrics' ``method`` label.
        num_drafts: proposals verified (one per sequence and step with proposed tokens).
        num_draft_tokens: tokens proposed and verified.
        num_accepted_tokens: proposed tokens accepted.
        num_accepted_tokens_per_pos: accepted tokens by position in the proposal.
        accepted_per_draft: verified proposals by how many of their tokens were accepted (index 0..k).
    """

    method: str = ""
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    accepted_per_draft: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed tokens (0 when none were proposed)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verified proposal yields on average: 1 (the sampled token) + accepted ones (vLLM's)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def engine_stats(self) -> dict:
        """These counters as ``EngineStats``' ``spec_*`` fields."""
        return dict(spec_method=self.method, spec_num_drafts=self.num_drafts,
                    spec_num_draft_tokens=self.num_draft_tokens, spec_num_accepted_tokens=self.num_accepted_tokens,
                    spec_num_accepted_tokens_per_pos=tuple(self.num_accepted_tokens_per_pos),
                    spec_accepted_per_draft=tuple(self.accepted_per_draft))

    def observe(self, proposed: int, accepted: int) -> None:
        """Count one verified proposal."""
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        for pos in range(accepted):
            self.num_accepted_tokens_per_pos[pos] += 1
        self.accepted_per_draft[accepted] += 1


def _decoding(req: Request) -> bool:
    """Whether a running sequence may get a proposal this step: it decodes (its known tokens all computed but
    the last), has an output (not a leader at its fork point) and no grammar (proposals would skip its mask)."""
    return (req.num_computed_tokens == req.num_tokens - 1 and req.num_output_tokens > 0
            and req.sampling_params.structured_outputs is None)


class SpecDecoder:
    """Proposes for running sequences and learns from what was accepted.

    Args:
        config: the speculative config.
        max_model_len: the engine's context limit (a proposal never reaches past it).
        proposer: what guesses the tokens (``propose(requests, ks) -> proposals``, ``forget(request_ids)``):
            ``NgramProposer`` or ``DraftModelProposer``.
    """

    def __init__(self, config: SpeculativeConfig, max_model_len: int, proposer) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.proposer = proposer
        k = config.num_speculative_tokens
        self.stats = SpecDecodeStats(method=config.method, num_accepted_tokens_per_pos=[0] * k,
                                     accepted_per_draft=[0] * (k + 1))
        self.cost = StepCost()
        self._acceptance: dict[str, Acceptance] = {}
        self._started: float | None = None

    def propose(self, running: list[Request]) -> None:
        """Set ``spec_token_ids`` of every running sequence: a proposal of as many tokens as pay for themselves
        where it is decoding, else none. Forgets the sequences no longer running."""
        self._started = time.monotonic()
        ids = {r.request_id for r in running}
        gone = [rid for rid in self._acceptance if rid not in ids]
        for rid in gone:
            del self._acceptance[rid]
        if gone:
            self.proposer.forget(gone)
        decoding = []
        for req in running:
            req.spec_token_ids = []
            if _decoding(req):
                decoding.append(req)
        threshold = self.cost.threshold(len(decoding))
        asks: list[tuple[Request, int]] = []
        for req in decoding:
            acc = self._acceptance.setdefault(req.request_id, Acceptance())
            room = min(req.max_tokens - req.num_output_tokens, self.max_model_len - req.num_tokens) - 1
            k = min(acc.next_k(threshold, self.config.num_speculative_tokens), room)
            if k > 0:
                asks.append((req, k))
        if asks:
            for (req, _), tokens in zip(asks, self.proposer.propose([r for r, _ in asks], [k for _, k in asks])):
                req.spec_token_ids = tokens
                if not tokens:   # nothing found: a failed probe, so a text with nothing to copy stops looking
                    self._acceptance[req.request_id].observe(1, 0)

    def observe(self, sched, sampled: dict[str, list[int]]) -> None:
        """Count a step's verified proposals, update each sequence's acceptance rate, and time the step (a
        decode-only one) for the cost line."""
        decode_only = True
        query_tokens = 0
        for entry in sched.scheduled:
            proposed = len(entry.spec_token_ids)
            query_tokens += entry.num_new_tokens
            decode_only &= entry.sample and entry.num_new_tokens == proposed + 1
            tokens = sampled.get(entry.request.request_id)
            if not proposed or tokens is None:
                continue
            accepted = len(tokens) - 1
            self.stats.observe(proposed, accepted)
            acc = self._acceptance.get(entry.request.request_id)
            if acc is not None:
                acc.observe(proposed, accepted)
        if self._started is not None and decode_only and query_tokens:
            now = time.monotonic()   # several decode steps of one call (nothing proposed): their mean
            self.cost.observe((now - self._started) / sched.num_steps, query_tokens, now)
        self._started = None
