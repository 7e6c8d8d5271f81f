"""The engine core's embedding calls: each ``add_embed`` call's pooling requests, the hidden rows a step kept for
them, and the vectors pooled once a request is finished (``engine/pooling.py``); ``EngineCore`` owns one."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.core.core_messages import EMBED_ID_PREFIX, embed_request_ids
from engine.core.request import Request, RequestStatus
from engine.pooling import pool

def embed_call_id(seq_id: str) -> int:
    """The call id in a pooling request's id."""
    return int(seq_id[len(EMBED_ID_PREFIX):].rsplit("-", 1)[0])


@dataclass
class EmbedCall:
    """One ``add_embed`` call: its pooling requests' ids in input order, the vectors pooled so far, an error."""

    seq_ids: list[str]
    vectors: dict[str, list[float]] = field(default_factory=dict)
    error: str | None = None


class EmbedCalls:
    """The embed calls in progress and the rows kept for their pooling requests."""

    def __init__(self) -> None:
        self.calls: dict[int, EmbedCall] = {}                       # call id -> its requests and vectors
        self.pooled_rows: dict[str, dict[int, torch.Tensor]] = {}   # pooling request -> first position -> rows

    def start(self, call_id: int, count: int) -> list[str]:
        """Register call ``call_id`` of ``count`` prompts; returns its pooling requests' ids, in input order.

        Raises:
            ValueError: the call id is in use.
        """
        if call_id in self.calls:
            raise ValueError(f"embed call {call_id} is already running")
        seq_ids = embed_request_ids(call_id, count)
        self.calls[call_id] = EmbedCall(seq_ids)
        return seq_ids

    def abort(self, seq_id: str) -> None:
        """Mark the call of pooling request ``seq_id`` failed (its step failed, the engine stopped, or its caller
        left: the front end aborts the call's requests)."""
        self.calls[embed_call_id(seq_id)].error = "the embedding was aborted (engine step failed or stopped)"

    def forget(self, seq_id: str) -> None:
        """Drop the rows kept for ``seq_id`` (a request that ended)."""
        self.pooled_rows.pop(seq_id, None)

    def step(self, pooled_hidden: dict, seqs: dict[str, Request], finished: list[Request]) -> None:
        """Keep this step's pooled rows (``pooled_hidden``: request id -> (first position, rows [n, hidden]) of
        the requests still in ``seqs``); pool each finished pooling request into its call's vector."""
        for sid, (start, rows) in pooled_hidden.items():
            if sid not in seqs:
                continue
            kept = self.pooled_rows.setdefault(sid, {})
            if start == 0:
                kept.clear()   # recomputed from the start after a preemption: earlier rows are stale
            kept[start] = rows
        for req in finished:
            if req.pooling_params is None or req.status != RequestStatus.FINISHED_STOPPED:
                continue
            kept = self.pooled_rows.pop(req.request_id)
            hidden = torch.cat([kept[k] for k in sorted(kept)])
            self.calls[embed_call_id(req.request_id)].vectors[req.request_id] = pool(hidden, req.pooling_params).tolist()

    def take(self) -> list[tuple[int, list[list[float]] | None, str | None]]:
        """The calls that ended since the last take: (call id, vectors, None) or (call id, None, error)."""
        done = [(cid, c) for cid, c in self.calls.items() if c.error or len(c.vectors) == len(c.seq_ids)]
        for cid, _ in done:
            del self.calls[cid]
        return [(cid, None, c.error) if c.error else (cid, [c.vectors[s] for s in c.seq_ids], None)
                for cid, c in done]
