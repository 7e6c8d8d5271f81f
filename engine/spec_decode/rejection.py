"""Verification of proposed tokens, lossless by construction.

A sequence with drafts d_0..d_{k-1} was computed with them as extra query tokens, so the step has its logits at
k + 1 positions; the batch- and chunk-invariant model makes the logits at depth j bitwise those a one-token
decode step would have had after the sequence's output plus d_0..d_{j-1}. Depth by depth, the target's own
sampler samples a token from those logits, seeing the sequence as if d_0..d_{j-1} were already its output
(penalties, ``min_tokens``, and the seeded draw of that output position): the sampled token is kept, and while
it equals d_j the next depth is sampled too. The tokens kept are therefore exactly those the engine without
speculation samples, with the same logprobs. For a deterministic proposer (prompt lookup, a draft model's
argmax) this is the standard rejection rule (Leviathan et al. 2023) with a point-mass draft q: d_j is accepted
with probability p(d_j), and after a rejection the token comes from p restricted to tokens other than d_j, i.e.
from (p - q)+ normalised.
Greedy rows accept the longest prefix equal to the argmax, plus the argmax after it (the bonus token).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.core.request import Request


@dataclass(eq=False)
class DraftView:
    """A request as the sampler sees it at draft depth ``len(extra)``: its output followed by ``extra``."""

    request: Request
    extra: list[int] = field(default_factory=list)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def index(self) -> int:
        return self.request.index

    @property
    def sampling_params(self):
        return self.request.sampling_params

    @property
    def eos_token_id(self) -> int | None:
        return self.request.eos_token_id

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def output_token_ids(self) -> list[int]:
        return self.request.output_token_ids + self.extra

    @property
    def all_token_ids(self) -> list[int]:
        return self.request.all_token_ids + self.extra

    @property
    def num_output_tokens(self) -> int:
        return self.request.num_output_tokens + len(self.extra)


@dataclass
class VerifyResult:
    """Per row (a scheduled entry that samples): the tokens kept (accepted drafts, then the token sampled after
    them) and, where the request asked for logprobs, one entry per kept token."""

    token_ids: list[list[int]]
    logprobs: list[list | None]


def sample_with_drafts(sampler, last_logits: torch.Tensor, requests: list[Request], drafts: list[list[int]],
                       draft_logits: list[torch.Tensor | None], grammar_bitmask=None) -> VerifyResult:
    """Sample every row, verifying its drafts (see the module docstring).

    Args:
        sampler: the engine's ``Sampler``.
        last_logits: ``[rows, vocab]``: each row's logits at its last computed position (depth ``len(drafts[i])``).
        requests: each row's request (not mutated).
        drafts: each row's proposed tokens (empty: none).
        draft_logits: each row's ``[len(drafts[i]), vocab]`` logits at depths 0..k-1 (None when no drafts).
        grammar_bitmask: the constrained rows' masks (depth 0 only: rows with a grammar get no drafts).
    """
    n = len(requests)
    kept: list[list[int]] = [[] for _ in range(n)]
    lps: list[list | None] = [None if r.sampling_params.logprobs is None else [] for r in requests]
    active = list(range(n))
    depth = 0
    while active:
        rows = [draft_logits[i][depth] if depth < len(drafts[i]) else last_logits[i] for i in active]
        logits = last_logits if depth == 0 and not any(drafts) else torch.stack(rows)
        views = [DraftView(requests[i], drafts[i][:depth]) for i in active]
        out = sampler.sample(logits, views, grammar_bitmask=grammar_bitmask if depth == 0 else None)
        still = []
        for i, tok, lp in zip(active, out.token_ids, out.logprobs):
            kept[i].append(tok)
            if lps[i] is not None:
                lps[i].append(lp)
            if depth < len(drafts[i]) and tok == drafts[i][depth]:
                still.append(i)
        active = still
        depth += 1
    return VerifyResult(token_ids=kept, logprobs=lps)
