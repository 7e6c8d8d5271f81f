"""A chat stream's tool-call deltas as calls that open, stream and close one after another, the order the Responses
API's items and Anthropic's content blocks must have (no item or block receives a piece after it closed).

Chat streams tell calls apart by ``index`` only, and may interleave their argument pieces (index 0, 1, 0, 1...,
as some upstreams stream parallel calls). ``ToolCallOrder`` streams the first call live and keeps the pieces of
later calls until the live one is finished; a call is finished when its arguments are a whole JSON value (a
JSON object cannot grow and stay one) and a later call is waiting, or when the stream's tool calls end (text,
reasoning or the finish). Upstreams that stream one call after another (the usual case) see every call live.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from gateway.values import ToolCallDelta


@dataclass(slots=True)
class Call:
    """One chat tool call as it builds up: its position ``k`` among the stream's calls, ``id``, ``name``,
    the ``arguments`` received so far."""

    k: int
    id: str | None
    name: str
    arguments: str = ""


def _whole(arguments: str) -> bool:
    try:
        json.loads(arguments)
    except ValueError:
        return False
    return True


class ToolCallOrder:
    """The tool-call state of one stream. ``feed`` each chat tool-call delta and ``flush`` when the calls end;
    both answer actions in order: ``("open", call)``, ``("args", call, piece)``, ``("close", call)`` (the call's
    ``arguments`` whole by then)."""

    def __init__(self):
        self.calls: dict[int, Call] = {}     # chat index -> call, of the calls not yet closed
        self.pending: list[int] = []         # chat indices in first-seen order, the live one first
        self.live = False                    # pending[0] is open (its pieces streamed as they come)
        self.count = 0                       # calls seen in the whole stream (the next call's k)
        self.done: set[int] = set()          # chat indices of the closed calls

    def feed(self, delta: ToolCallDelta) -> list[tuple]:
        """The actions of one tool-call piece of a chat delta (``ChoiceDelta.tool_calls``)."""
        index = delta.index
        call = self.calls.get(index)
        if call is None:
            if index in self.done:
                return []                    # a closed call's late piece (whitespace after its JSON)
            call = self.calls[index] = Call(self.count, delta.id, delta.name or "")
            self.count += 1
            self.pending.append(index)
        elif not call.name and delta.name:
            call.name = delta.name
        piece = delta.arguments or ""
        call.arguments += piece
        out: list[tuple] = []
        if not self.live:
            out += self._open_next()
        elif piece and index == self.pending[0]:
            out.append(("args", call, piece))
        return out + self._advance()

    def _open_next(self) -> list[tuple]:
        call = self.calls[self.pending[0]]
        self.live = True
        out: list[tuple] = [("open", call)]
        if call.arguments:
            out.append(("args", call, call.arguments))
        return out

    def _close_live(self) -> list[tuple]:
        index = self.pending.pop(0)
        self.live = False
        self.done.add(index)
        return [("close", self.calls.pop(index))]

    def _advance(self) -> list[tuple]:
        """Close the live call while it is whole and a later one waits, opening the next."""
        out: list[tuple] = []
        while self.live and len(self.pending) > 1 and _whole(self.calls[self.pending[0]].arguments):
            out += self._close_live() + self._open_next()
        return out

    def flush(self) -> list[tuple]:
        """The calls end: close the live one, then open, stream and close each waiting one in order."""
        out: list[tuple] = []
        while self.pending:
            if not self.live:
                out += self._open_next()
            out += self._close_live()
        return out
