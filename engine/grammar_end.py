"""Where a constrained answer may end, seen from its text: a stop string counts only there.

The grammar owns a constrained answer's end (EOS and ``stop_token_ids`` are content until the grammar may
end, ``engine/worker/structured_outputs.py``); a stop string is matched on the text, in the front end, so it
gets the same rule from the text before it (``may_end(spec)``): a stop string whose preceding text could
not end the answer is content, and the search goes on (``stop: ["}"]`` no longer cuts
``{"city": "Paris"`` out of a tool call; ``stop: [":"]`` no longer empties it).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable


def may_end(spec) -> Callable[[str], bool] | None:
    """A predicate on the text before a stop string: True where the grammar of ``spec`` (a
    ``StructuredOutputsParams``) may end the answer. None when ``spec`` is None (every stop string counts).
    An EBNF grammar's end cannot be told from the text here: its stop strings are always content."""
    if spec is None:
        return None
    if spec.json is not None or spec.json_object:
        return is_json
    if spec.regex is not None:
        return lambda text: _fullmatch(spec.regex, text)
    if spec.choice is not None:
        choices = set(spec.choice)
        return lambda text: text in choices
    if spec.structural_tag is not None:
        return _tags_closed(json.loads(spec.structural_tag)["format"])
    return lambda text: False


def is_json(text: str) -> bool:
    """True when ``text`` is one whole JSON value (str, any length)."""
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _fullmatch(regex: str, text: str) -> bool:
    try:
        return re.fullmatch(regex, text) is not None
    except re.error:
        return False


def _tags_closed(fmt: dict) -> Callable[[str], bool]:
    """Tool calls (``chat_structured._tool_grammar``): the text may end outside a call, after at least one
    call unless calls are optional (``triggered_tags``, tool_choice auto)."""
    tags = fmt.get("tags") or [fmt]
    begins = sorted({t["begin"] for t in tags})
    ends = sorted({t["end"] for t in tags})
    optional = fmt.get("type") == "triggered_tags" and not fmt.get("at_least_one")

    def closed(text: str) -> bool:
        opened = sum(text.count(b) for b in begins)
        done = sum(text.count(e) for e in ends)
        return opened == done and (optional or done > 0)
    return closed
