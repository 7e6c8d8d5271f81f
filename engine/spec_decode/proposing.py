"""The engine's side of speculative decoding: before each step, a proposal for every running sequence that is
decoding (prompt lookup, k adapted per sequence); after it, how many were accepted (per-sequence k, and vLLM's
``spec_decode`` counters)."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.request import Request
from engine.spec_decode.adaptive import AdaptiveK
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.ngram_proposer import NgramProposer


@dataclass
class SpecDecodeStats:
    """Cumulative counters (vLLM's ``vllm:spec_decode_*`` metrics).

    Attributes:
        num_drafts: proposals verified (one per sequence and step with proposed tokens).
        num_draft_tokens: tokens proposed and verified.
        num_accepted_tokens: proposed tokens accepted.
        num_accepted_tokens_per_pos: accepted tokens by position in the proposal.
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed tokens (0 when none were proposed)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verified proposal yields on average: 1 (the sampled token) + accepted ones (vLLM's)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


class SpecDecoder:
    """Proposes for running sequences and learns from what was accepted.

    Args:
        config: the speculative config.
        max_model_len: the engine's context limit (a proposal never reaches past it).
    """

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.stats = SpecDecodeStats(num_accepted_tokens_per_pos=[0] * config.num_speculative_tokens)
        self._k: dict[str, AdaptiveK] = {}

    def propose(self, running: list[Request]) -> None:
        """Set ``spec_token_ids`` of every running sequence: a proposal where it is decoding (its known tokens
        all computed but the last) without a grammar, else none. Forgets the k of sequences no longer running."""
        self._k = {r.request_id: self._k[r.request_id] for r in running if r.request_id in self._k}
        for req in running:
            req.spec_token_ids = []
            if (req.num_computed_tokens != req.num_tokens - 1 or req.num_output_tokens == 0
                    or req.sampling_params.structured_outputs is not None):
                continue  # a prefill, a leader at its fork point, or a grammar (proposals would skip its mask)
            state = self._k.get(req.request_id)
            if state is None:
                state = self._k[req.request_id] = AdaptiveK(self.config.num_speculative_tokens)
            room = min(req.max_tokens - req.num_output_tokens, self.max_model_len - req.num_tokens) - 1
            k = min(state.next_k(), room)
            if k > 0:
                req.spec_token_ids = self.proposer.propose(req.all_token_ids, k)

    def observe(self, sched, sampled: dict[str, list[int]]) -> None:
        """Count a step's verified proposals and adapt each sequence's k."""
        s = self.stats
        for entry in sched.scheduled:
            proposed = len(entry.spec_token_ids)
            tokens = sampled.get(entry.request.request_id)
            if not proposed or tokens is None:
                continue
            accepted = len(tokens) - 1
            s.num_drafts += 1
            s.num_draft_tokens += proposed
            s.num_accepted_tokens += accepted
            for pos in range(accepted):
                s.num_accepted_tokens_per_pos[pos] += 1
            state = self._k.get(entry.request.request_id)
            if state is not None:
                state.observe(proposed, accepted)
