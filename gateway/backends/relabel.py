"""Answers speak the client's names: every successful answer, JSON or each event of a stream, reports the
public ``model`` the client asked for (an alias resolved to the public name it stands for, as OpenAI reports
the model an alias resolves to; never the upstream's or the engine's name) and an ``id`` made from the gateway's
request id (``chatcmpl-<request id>``, ``cmpl-<request id>``: the id in the logs and the ``x-request-id``
header), whichever backend answered. This module relabels a whole answer's JSON (bodies without ``id``/``model``,
errors, pass as they are); a stream's events are written under those names by the client API's codec at the edge
(``gateway/translate/chat_events.py``: ``ChatEncoder``).
"""

from __future__ import annotations

import msgspec

_decode = msgspec.json.decode
_encode = msgspec.json.encode
_PREFIX = {"chat/completions": "chatcmpl-", "completions": "cmpl-"}


def answer_id(endpoint: str, request_id: str) -> str:
    """The ``id`` of the answer to request ``request_id`` on ``endpoint`` ("chat/completions" | "completions")."""
    return _PREFIX.get(endpoint, "") + request_id


def _relabel(payload: bytes, id_: str, model: str) -> bytes:
    if payload[:1] != b"{":
        return payload
    try:
        obj = _decode(payload)
    except msgspec.DecodeError:
        return payload               # the attempt loop judges malformed events; not ours to fix
    if not isinstance(obj, dict) or ("id" not in obj and "model" not in obj):
        return payload
    obj["id"], obj["model"] = id_, model
    return _encode(obj)


def relabel_json(content: bytes, id_: str, model: str) -> bytes:
    """A JSON answer (bytes) with ``id`` and ``model`` replaced; other bytes unchanged."""
    return _relabel(content, id_, model)
