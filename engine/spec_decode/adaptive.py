"""How many tokens to propose for one sequence next: as many as are worth their cost.

A verify step computes every proposed token whether it is accepted or not. A step of ``t`` query tokens costs
``fixed_s + row_s * t`` (a line fitted online to the engine's decode steps, the ``TTFTCalibration`` decode line);
with ``rows`` sequences decoding, an output token costs ``(fixed_s + row_s * rows) / rows`` without speculation.
A proposed token at depth j (0-based) is kept only if the j tokens before it and itself are accepted, with
probability ``alpha ** (j + 1)`` under a per-sequence acceptance rate ``alpha``; it saves an output token's cost
then and costs ``row_s`` always. So a sequence proposes the largest k with ``alpha ** k >= threshold``,
``threshold = margin * row_s * rows / (fixed_s + row_s * rows)`` (a token must save a quarter more than it costs:
the rate is an estimate): on this box about 0.14 for one sequence (a step is mostly reading the weights: extra
query tokens are cheap) and above 1 for 64 (mostly arithmetic: a verify token costs what it saves at best, so
none is proposed). A sequence whose guesses fail stops proposing, but for a one-token probe now and then.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.core.ttft_calibration import TTFTCalibration

_PRIOR_ACCEPTED, _PRIOR_REJECTED = 1.0, 1.0  # alpha's prior: 0.5, worth two proposals
_KEEP = 0.7          # weight of a sequence's earlier evidence at each verified proposal (bursts of copying)
_MARGIN = 1.25       # what a proposed token must save, in units of what it costs
_MAX_WAIT = 32       # steps between one-token probes of a sequence whose guesses fail, at most


@dataclass
class Acceptance:
    """A sequence's acceptance rate: the probability that a proposed token is accepted once the ones before it
    were, estimated as accepted / (accepted + rejections) over its recent proposals (a rejection ends a
    proposal early; the geometric model's estimate), starting from a prior. A sequence whose rate is too low
    for any proposal still probes with one token now and then, 1, 2, 4 ... 32 steps apart while the probes
    fail (a text it starts to copy is found again; a text it never copies costs a token every 32 steps).

    Attributes:
        accepted: recent accepted tokens, weighted (prior included).
        rejected: recent rejections, weighted (prior included).
        wait: steps left before the next probe.
        backoff: the wait after the next failed probe.
    """

    accepted: float = _PRIOR_ACCEPTED
    rejected: float = _PRIOR_REJECTED
    wait: int = 0
    backoff: int = 1

    @property
    def rate(self) -> float:
        """alpha, in (0, 1)."""
        return self.accepted / (self.accepted + self.rejected)

    def next_k(self, threshold: float, max_k: int) -> int:
        """Tokens to propose this step: as many as pay for themselves at ``threshold``
        (:func:`worth_proposing`), else a one-token probe when one is due (never where no rate could pay)."""
        k = worth_proposing(self.rate, threshold, max_k)
        if k or threshold >= 1.0:
            return k
        if self.wait > 0:
            self.wait -= 1
            return 0
        return min(1, max_k)

    def observe(self, proposed: int, accepted: int) -> None:
        """Fold in one verified proposal: ``accepted`` of ``proposed`` tokens kept."""
        if proposed <= 0:
            return
        self.accepted = _KEEP * self.accepted + accepted
        self.rejected = _KEEP * self.rejected + (1.0 if accepted < proposed else 0.0)
        if accepted:
            self.wait, self.backoff = 0, 1
        else:
            self.wait, self.backoff = self.backoff, min(2 * self.backoff, _MAX_WAIT)


def worth_proposing(alpha: float, threshold: float, max_k: int) -> int:
    """The largest k <= ``max_k`` with ``alpha ** k >= threshold`` (0: not even one token pays)."""
    if alpha >= 1.0 or threshold <= 0.0:
        return max_k
    if alpha <= 0.0 or threshold >= 1.0:
        return 0
    return max(0, min(max_k, int(math.log(threshold) / math.log(alpha) + 1e-9)))


class StepCost:
    """The decode step's cost line, measured on the steps the engine runs with speculation (seconds).

    Args:
        step_s: a first guess of a one-token decode step (replaced by the first steps measured).
    """

    def __init__(self, step_s: float = 0.05) -> None:
        self._line = TTFTCalibration(step_s=step_s)

    def observe(self, seconds: float, query_tokens: int, at: float) -> None:
        """One decode-only step: ``query_tokens`` tokens computed (proposals included) in ``seconds``, ending at
        ``at`` (``time.monotonic()``)."""
        self._line.observe(seconds, 0, query_tokens, at=at)

    def threshold(self, rows: int) -> float:
        """The acceptance probability a proposed token needs with ``rows`` sequences decoding:
        ``margin * row_s * rows / (fixed_s + row_s * rows)``."""
        fixed, row = self._line.fixed_s, self._line.row_s
        rows = max(rows, 1)
        return _MARGIN * row * rows / (fixed + row * rows) if fixed + row * rows > 0 else 1.0
