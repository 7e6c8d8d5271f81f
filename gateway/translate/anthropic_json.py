"""A ``tool_use`` block's ``input`` from a chat tool call's ``arguments`` text, streamed or whole, the same way
(``gateway/translate/anthropic.py``): the longest prefix of the text that reads as one JSON object with the
``anthropic`` SDK's own partial reader (jiter's ``partial_mode``, which its stream helper applies to a block's
``partial_json``). Arguments cut by ``max_tokens`` keep their complete members; malformed arguments (an upstream's)
keep what came before the first character no JSON object can continue with; arguments that are not an object
(``[1, 2]``) give ``{}``. No key is invented: whatever a client receives is a prefix of what the model wrote.
"""

from __future__ import annotations

import jiter


def _read(text: str) -> dict | None:
    """The object the SDK reads from ``text`` (a prefix of one), or None when it reads none (not JSON, or not an
    object); whitespace alone is the beginning of one (``{}``)."""
    if not text.strip():
        return {}
    try:
        value = jiter.from_json(text.encode(), partial_mode=True)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


class ObjectPrefix:
    """The readable prefix of one JSON object's text, fed in pieces (a tool call's argument deltas, or the whole
    arguments at once): ``feed`` keeps what still reads as an object and drops the rest, from the first character
    that does not; ``value`` is the object kept."""

    def __init__(self):
        self.text = ""
        self.broken = False

    def feed(self, piece: str) -> str:
        """The part of ``piece`` kept: all of it while the text reads as an object, the part before the first
        character that does not, then nothing. A prefix of a readable text reads too, so the cut is found by
        bisection (a few reads of a short text, once per call)."""
        if self.broken or not piece:
            return ""
        if _read(self.text + piece) is not None:
            self.text += piece
            return piece
        self.broken = True
        lo, hi = 0, len(piece) - 1        # piece[:lo] reads; piece[:hi + 1] does not
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if _read(self.text + piece[:mid]) is not None:
                lo = mid
            else:
                hi = mid - 1
        self.text += piece[:lo]
        return piece[:lo]

    def value(self) -> dict:
        """The object the kept text holds (``{}`` for none)."""
        return _read(self.text) or {}


def tool_input(arguments: object) -> dict:
    """A whole answer's tool call ``arguments`` -> the ``tool_use`` block's ``input``, as its stream gives it."""
    prefix = ObjectPrefix()
    prefix.feed(arguments if isinstance(arguments, str) else "")
    return prefix.value()
