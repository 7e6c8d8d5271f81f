"""One reader for the engine's JSON-object options (``--speculative-config``, ``--kv-events-config``,
``--override-generation-config``)."""

from __future__ import annotations

import json
from dataclasses import fields


def json_object(value: dict | str, name: str) -> dict:
    """``value``, a dict or its JSON text, as a dict.

    Raises:
        ValueError: not valid JSON, or not an object (named with ``name``).
    """
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {type(value).__name__}")
    return value


def config_object(value: dict | str, name: str, cls) -> dict:
    """``value`` (a dict or its JSON text) as the keyword arguments of dataclass ``cls``.

    Raises:
        ValueError: not valid JSON, not an object, or a key ``cls`` does not have (each named, with ``name``).
    """
    value = json_object(value, name)
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"{name}: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    return value
