"""A chat stream's tool-call deltas as calls that open, stream and close one after another, the order the Responses
API's items and Anthropic's content blocks must have (no item or block receives a piece after it closed).

Chat streams tell calls apart by ``index``, and may interleave their argument pieces (index 0, 1, 0, 1...,
as some upstreams stream parallel calls). ``ToolCallOrder`` streams the first call live and keeps the pieces of
later calls until the live one is finished; a call is finished when its arguments are a whole JSON value (a
JSON object cannot grow and stay one) and a later call is waiting, or when the stream's tool calls end (text,
reasoning or the finish). Upstreams that stream one call after another (the usual case) see every call live.

A call opens (its item or block names the function) once its name is whole: its name's pieces are joined, as
the openai SDK's stream helper joins them, until its arguments start, a later call appears or the calls end.
A delta with an ``id`` other than that of the call at its ``index`` starts a new call (upstreams that give every
call index 0, or none, still have one id per call).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from gateway.values import ToolCallDelta


@dataclass(slots=True)
class Call:
    """One chat tool call as it builds up: its position ``k`` among the stream's calls, ``id``, ``name``,
    the ``arguments`` received so far, and whether its name is whole (``named``)."""

    k: int
    id: str | None
    name: str
    arguments: str = ""
    named: bool = False


def _whole(arguments: str) -> bool:
    try:
        json.loads(arguments)
    except ValueError:
        return False
    return True


class ToolCallOrder:
    """The tool-call state of one stream. ``feed`` each chat tool-call delta and ``flush`` when the calls end;
    both answer actions in order: ``("open", call)`` (its name whole), ``("args", call, piece)``,
    ``("close", call)`` (the call's ``arguments`` whole by then)."""

    def __init__(self):
        self.calls: dict[int, Call] = {}     # call k -> call, of the calls not yet closed
        self.at: dict[object, int] = {}      # chat index -> the k of the latest call at that index
        self.pending: list[int] = []         # call ks in first-seen order, the live one first
        self.live = False                    # pending[0] is open (its pieces streamed as they come)
        self.count = 0                       # calls seen in the whole stream (the next call's k)

    def feed(self, delta: ToolCallDelta) -> list[tuple]:
        """The actions of one tool-call piece of a chat delta (``ChoiceDelta.tool_calls``)."""
        k = self.at.get(delta.index)
        if k is not None and delta.id is not None and k in self.calls and self.calls[k].id not in (None, delta.id):
            k = None                         # a new id at a used index: another call
        if k is None:
            if self.pending:                 # a later call: the earlier ones' names are whole
                for earlier in self.pending:
                    self.calls[earlier].named = True
            k = self.at[delta.index] = self.count
            self.calls[k] = Call(k, delta.id, delta.name or "")
            self.count += 1
            self.pending.append(k)
        elif k not in self.calls:
            return []                        # a closed call's late piece (whitespace after its JSON)
        else:
            call = self.calls[k]
            call.id = call.id or delta.id
            if delta.name and not call.named:
                call.name += delta.name
        call = self.calls[k]
        piece = delta.arguments or ""
        call.arguments += piece
        call.named = call.named or bool(call.arguments)
        out: list[tuple] = []
        if not self.live:
            out += self._open_next()
        elif piece and k == self.pending[0]:
            out.append(("args", call, piece))
        return out + self._advance()

    def _open_next(self) -> list[tuple]:
        """Open the first waiting call if its name is whole (with the arguments it already has)."""
        call = self.calls[self.pending[0]]
        if not call.named:
            return []
        self.live = True
        out: list[tuple] = [("open", call)]
        if call.arguments:
            out.append(("args", call, call.arguments))
        return out

    def _close_live(self) -> list[tuple]:
        k = self.pending.pop(0)
        self.live = False
        return [("close", self.calls.pop(k))]

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
            self.calls[self.pending[0]].named = True
            if not self.live:
                out += self._open_next()
            out += self._close_live()
        return out
