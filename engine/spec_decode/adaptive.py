"""How many tokens to propose for one sequence next, from how its last proposals fared: a sequence whose
guesses keep failing stops paying for them (k = 0 for a growing number of steps), one whose guesses land gets
the full k again."""

from __future__ import annotations

from dataclasses import dataclass

_MAX_BACKOFF = 32  # steps without proposals after repeated total misses, at most


@dataclass
class AdaptiveK:
    """Per-sequence proposal length.

    Attributes:
        max_k: ``num_speculative_tokens``.
        k: tokens to propose next.
        skip: steps left without proposals.
        backoff: the next pause's length after a total miss (doubles per consecutive miss).
    """

    max_k: int
    k: int = 0
    skip: int = 0
    backoff: int = 1

    def __post_init__(self) -> None:
        self.k = self.max_k

    def next_k(self) -> int:
        """Tokens to propose this step (0 while paused)."""
        if self.skip > 0:
            self.skip -= 1
            return 0
        return self.k

    def observe(self, proposed: int, accepted: int) -> None:
        """Record one verified proposal: ``accepted`` of ``proposed`` tokens kept."""
        if proposed <= 0:
            return
        if accepted == 0:
            self.skip = self.backoff
            self.backoff = min(2 * self.backoff, _MAX_BACKOFF)
            self.k = 1
            return
        self.backoff = 1
        self.k = self.max_k if accepted == proposed else min(self.max_k, accepted + 1)
