"""A ``tool_use`` block's ``input`` from a chat tool call's ``arguments`` text, streamed or whole, the same way
(``gateway/translate/anthropic.py``): the longest prefix of the text that can begin one JSON object, read as the
``anthropic`` SDK reads a streamed block's partial JSON. Arguments cut by ``max_tokens`` keep their complete members
(an incomplete last key, string, number or literal is left out, open objects and arrays are closed); malformed
arguments (an upstream's) keep what came before the first character no JSON object can continue with; arguments
that are not an object (``[1, 2]``) give ``{}``. No key is invented: whatever a client receives is a prefix of what
the model wrote.
"""

from __future__ import annotations

import json

_WS = frozenset(" \t\n\r")
_DIGITS = frozenset("0123456789")
_HEX = frozenset("0123456789abcdefABCDEF")
_ESCAPES = frozenset('"\\/bfnrt')
_LITERALS = {"t": "rue", "f": "alse", "n": "ull"}
_WHOLE = frozenset({"0", "int", "frac", "exp"})      # number states that end a whole number


def _number(state: str, c: str) -> str | None:
    """JSON's number grammar: the state after ``c`` (None: ``c`` does not continue the number). States: ``-``,
    ``0``, ``int``, ``.``, ``frac``, ``e``, ``sign``, ``exp``; ``""`` before the first character."""
    if c in _DIGITS:
        if state in ("", "-"):
            return "0" if c == "0" else "int"
        return {"int": "int", ".": "frac", "frac": "frac", "e": "exp", "sign": "exp", "exp": "exp"}.get(state)
    if c == "-" and state == "":
        return "-"
    if c == "." and state in ("0", "int"):
        return "."
    if c in "eE" and state in ("0", "int", "frac"):
        return "e"
    if c in "+-" and state == "e":
        return "sign"
    return None


class ObjectPrefix:
    """The valid prefix of one JSON object's text, fed in pieces (a tool call's argument deltas, or the whole
    arguments at once): ``feed`` keeps what can still begin an object and drops the rest, from the first character
    that cannot; ``value`` reads what was kept."""

    def __init__(self):
        self.pieces: list[str] = []
        self.n = 0                          # characters kept
        self.stack: list[str] = []          # the closers of the open objects and arrays
        self.mode = "start"                 # what the next character may be
        self.sub = ""                       # a number's state, or the rest of a literal
        self.key = False                    # the open string is a key
        self.escape = 0                     # in a string: -1 after a backslash, n: hex digits of \\u still due
        self.commit = (0, "")               # the last point a value was whole: (characters, closers then)
        self.broken = False

    def feed(self, piece: str) -> str:
        """The part of ``piece`` kept: all of it while the text is a valid prefix of one object (whitespace after
        the object included), the part before the first character that is not, then nothing."""
        if self.broken:
            return ""
        for k, c in enumerate(piece):
            if not self._step(c):
                self.broken, piece = True, piece[:k]
                break
            self.n += 1
        self.pieces.append(piece)
        return piece

    def value(self) -> dict:
        """The object the kept text holds: its whole members, open objects and arrays closed (``{}`` for none)."""
        end, closers = self.commit
        if self.mode == "number" and self.sub in _WHOLE:
            end, closers = self.n, "".join(reversed(self.stack))
        return json.loads("".join(self.pieces)[:end] + closers) if end else {}

    def _mark(self, end: int) -> None:
        self.commit = (end, "".join(reversed(self.stack)))

    def _step(self, c: str) -> bool:
        mode = self.mode
        if mode == "string":
            return self._string(c)
        if mode == "number":
            if (state := _number(self.sub, c)) is not None:
                self.sub = state
                return True
            if self.sub not in _WHOLE:
                return False
            self.mode = "after"
            self._mark(self.n)
            return self._step(c)
        if mode == "literal":
            if not self.sub or c != self.sub[0]:
                return False
            self.sub = self.sub[1:]
            if not self.sub:
                self.mode = "after"
                self._mark(self.n + 1)
            return True
        if c in _WS:
            return True
        if mode == "start":
            return c == "{" and self._open("}")
        if mode in ("first_key", "key"):
            if c == "}" and mode == "first_key":
                return self._close(c)
            if c == '"':
                self.mode, self.key = "string", True
                return True
            return False
        if mode == "colon":
            if c == ":":
                self.mode = "value"
            return c == ":"
        if mode == "after":
            if c == "," and self.stack:
                self.mode = "key" if self.stack[-1] == "}" else "value"
                return True
            return self._close(c)
        if mode == "first_value" and c == "]":
            return self._close(c)
        return mode in ("value", "first_value") and self._value(c)

    def _value(self, c: str) -> bool:
        if c in "{[":
            return self._open("}" if c == "{" else "]")
        if c == '"':
            self.mode, self.key = "string", False
        elif c in _LITERALS:
            self.mode, self.sub = "literal", _LITERALS[c]
        elif (state := _number("", c)) is not None:
            self.mode, self.sub = "number", state
        else:
            return False
        return True

    def _open(self, closer: str) -> bool:
        self.stack.append(closer)
        self.mode = "first_key" if closer == "}" else "first_value"
        self._mark(self.n + 1)
        return True

    def _close(self, c: str) -> bool:
        if not self.stack or c != self.stack[-1]:
            return False
        self.stack.pop()
        self.mode = "after" if self.stack else "done"
        self._mark(self.n + 1)
        return True

    def _string(self, c: str) -> bool:
        if self.escape == -1:
            self.escape = 4 if c == "u" else 0
            return c == "u" or c in _ESCAPES
        if self.escape > 0:
            self.escape -= 1
            return c in _HEX
        if c == "\\":
            self.escape = -1
        elif c == '"':
            self.mode = "colon" if self.key else "after"
            if not self.key:
                self._mark(self.n + 1)
        return c >= " "


def tool_input(arguments: object) -> dict:
    """A whole answer's tool call ``arguments`` -> the ``tool_use`` block's ``input``, as its stream gives it."""
    prefix = ObjectPrefix()
    prefix.feed(arguments if isinstance(arguments, str) else "")
    return prefix.value()
