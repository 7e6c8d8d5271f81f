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
    if spec.json is not None:
        return _schema_valid(spec.json)
    if spec.json_object:
        return lambda text: isinstance(_value(text), dict)
    if spec.regex is not None:
        return lambda text: _fullmatch(spec.regex, text)
    if spec.choice is not None:
        choices = set(spec.choice)
        return lambda text: text in choices
    if spec.structural_tag is not None:
        return _format_closed(json.loads(spec.structural_tag)["format"])
    return lambda text: False


def is_json(text: str) -> bool:
    """True when ``text`` is one whole JSON value (str, any length)."""
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


_NOT_JSON = object()


def _value(text: str):
    """The JSON value ``text`` holds whole, or ``_NOT_JSON``."""
    try:
        return json.loads(text)
    except ValueError:
        return _NOT_JSON


def _schema_valid(schema) -> Callable[[str], bool]:
    """A JSON schema's grammar may end where the text is one whole JSON value that the schema accepts (the subset
    check, ``engine/worker/json_schema_subset.py``, lets through only schemas the grammar enforces exactly): a
    valid-JSON prefix such as ``1`` of ``123`` under ``{"enum": [123, 456]}`` is not an end."""
    import jsonschema  # lazy: only constrained requests with stop strings reach here

    try:
        validator = jsonschema.Draft202012Validator(json.loads(schema) if isinstance(schema, str) else schema)
    except (ValueError, jsonschema.SchemaError):
        return is_json

    def ends(text: str) -> bool:
        value = _value(text)
        return value is not _NOT_JSON and validator.is_valid(value)
    return ends


def _fullmatch(regex: str, text: str) -> bool:
    try:
        return re.fullmatch(regex, text) is not None
    except re.error:
        return False


def _format_closed(fmt: dict) -> Callable[[str], bool]:
    """A structural tag's format: an ``or`` (tool calls, or a text answer under a schema:
    ``chat_structured._tool_grammar``) may end where one of its elements may; else ``_tags_closed``."""
    if fmt.get("type") == "or":
        ends = [_format_closed(element) for element in fmt["elements"]]
        return lambda text: any(end(text) for end in ends)
    if fmt.get("type") == "json_schema":
        return _schema_valid(fmt["json_schema"])
    return _tags_closed(fmt)


def _tags_closed(fmt: dict) -> Callable[[str], bool]:
    """Tool calls (``chat_structured._tool_grammar``): the text may end after whole calls only (each a tag's
    begin, one whole JSON value, its end), at least one unless calls are optional (``triggered_tags``, tool_choice
    auto), and not inside a call's begin: free text after the last call (``triggered_tags`` only) holds no
    trigger, and a separator or a named call allows nothing after its calls. Counting begins and ends instead
    let ``stop: [","]`` cut a second call inside its begin (``{"name": "f"`` before ``", "arguments"``)."""
    tags = fmt.get("tags") or [fmt]
    ends = {t["begin"]: t["end"] for t in tags}
    free = fmt.get("type") == "triggered_tags"
    triggers = fmt.get("triggers") or []
    optional = free and not fmt.get("at_least_one")
    decoder = json.JSONDecoder()

    def closed(text: str) -> bool:
        pos, calls = 0, 0
        while True:
            found = [(i, b) for b in ends if (i := text.find(b, pos)) >= 0]
            if not found:
                break
            i, begin = min(found)
            try:
                _, end = decoder.raw_decode(text, i + len(begin))
            except ValueError:
                return False            # inside a call's arguments
            if not text.startswith(ends[begin], end):
                return False            # the arguments whole, the call not closed yet
            pos, calls = end + len(ends[begin]), calls + 1
        tail = text[pos:]
        if free:
            if any(t in tail for t in triggers):
                return False            # a call begun, its begin not whole yet
        elif tail:
            return False                # only another call may follow a separator; nothing a named call
        return optional or calls > 0
    return closed
