"""Prompt lookup (n-gram) proposals, as vLLM's ``v1/spec_decode/ngram_proposer.py``: find the earliest
occurrence of the sequence's last n tokens (the longest n from ``prompt_lookup_max`` down to
``prompt_lookup_min``) in its prompt and output, the suffix itself excluded, and propose the tokens that followed
it. The earliest, as vLLM's: on repeating text the latest match is one period back, and proposed one period of
tokens only (a trial's "fox fox fox" got one token a step at k = 4)."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from engine.core.request import Request


class NgramProposer:
    """Proposes up to k tokens by prompt lookup.

    Args:
        prompt_lookup_min: shortest n-gram matched.
        prompt_lookup_max: longest n-gram matched (tried first).
    """

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, requests: list[Request], ks: list[int]) -> list[list[int]]:
        """Each request's proposal of up to its k tokens (empty: no match)."""
        return [self.lookup(r.all_token_ids, k) for r, k in zip(requests, ks)]

    def forget(self, request_ids: list[str]) -> None:
        """Nothing to forget: a proposal reads only the sequence's tokens."""

    def lookup(self, token_ids: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens following the earliest match of the longest matching suffix of ``token_ids``
        (empty: no match, or k = 0)."""
        if k <= 0 or len(token_ids) <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        total = len(tokens)
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            # windows starting at 0 .. total - n - 1 (the suffix itself excluded)
            windows = sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == tokens[total - n:]).all(axis=1))
            if hits.size:
                start = int(hits[0]) + n
                return tokens[start:start + k].tolist()
        return []
