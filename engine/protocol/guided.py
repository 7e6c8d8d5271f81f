"""vLLM's older structured-output fields (``guided_json``, ``guided_regex``, ``guided_choice``,
``guided_grammar``), which vLLM replaced by keys of ``structured_outputs``: neither server serves them, and
ignoring one would answer unconstrained, so both refuse them with the key to send instead. Read by the engine's
own server (``engine/serving/serving.py``) and by the gateway's edge validation (``gateway/request/validate.py``),
so the hint is the same wherever the request enters."""

from __future__ import annotations

# structured_outputs' keys under their older guided_* names (vLLM's StructuredOutputsParams)
GUIDED_KEYS = ("json", "regex", "choice", "grammar")
GUIDED_FIELDS = tuple(f"guided_{key}" for key in GUIDED_KEYS)


def guided_field_hint(name: str) -> str | None:
    """The sentence naming what to send instead of ``name`` (a request field), or None when ``name`` is not one
    of vLLM's guided_* fields."""
    if name not in GUIDED_FIELDS:
        return None
    key = name.removeprefix("guided_")
    return (f"vLLM's guided_* fields are not served (vLLM replaced them with structured_outputs); send "
            f"\"structured_outputs\": {{\"{key}\": ...}} (or response_format)")
