"""The value ranges of the request fields that reach the engine: one table that the gateway's edge validation
(``gateway/request/validate.py``) and the engine's own OpenAI server (``protocol.parse_request``) both read, so a
value out of range is the request's 400 naming the field wherever the request enters, never a failure deeper in
(a ``seed`` beyond 64 bits cannot be serialized to the engine core; an ``n`` of a million would allocate a
million sequences).

Ranges are OpenAI's (``temperature`` 0..2 as OpenAI refuses above 2), widened where vLLM reads more (completions'
``logprobs`` up to 20, ``top_k`` -1 = disabled), with 64-bit bounds on every integer (what msgpack carries to the engine core; ``seed``
takes torch's ``manual_seed`` range, signed or unsigned 64 bits). Errors use OpenAI's codes
(``integer_below_min_value``, ``decimal_above_max_value``, ...). One value outside them is taken: ``max_tokens`` 0
with ``echo`` on /v1/completions, the prompt scoring of OpenAI's legacy API and vLLM (``echo_only``).
"""

from __future__ import annotations

from dataclasses import dataclass
import re
from typing import Any, Container, Mapping

INT64_MIN, INT64_MAX = -(2 ** 63), 2 ** 63 - 1
UINT64_MAX = 2 ** 64 - 1


@dataclass(frozen=True, slots=True)
class Range:
    """Allowed values of one numeric field: ``lo`` (exclusive unless ``lo_inclusive``) to ``hi`` (inclusive);
    None: unbounded. ``integer``: the field is an integer (OpenAI's messages then say "integer")."""

    lo: float | None
    hi: float | None
    lo_inclusive: bool = True
    integer: bool = False


_COUNT = Range(1, INT64_MAX, integer=True)
PARAM_RANGES: Mapping[str, Range] = {
    "temperature": Range(0, 2),             # OpenAI's: 2.0001 is a 400
    "top_p": Range(0, 1),   # OpenAI's (and Anthropic's): 0 keeps the likeliest token alone; vLLM refuses 0
    "presence_penalty": Range(-2, 2),
    "frequency_penalty": Range(-2, 2),
    "repetition_penalty": Range(0, None, lo_inclusive=False),
    "min_p": Range(0, 1),
    "n": Range(1, 128, integer=True),             # OpenAI's limit
    "best_of": Range(1, 128, integer=True),
    "max_tokens": _COUNT,
    "max_completion_tokens": _COUNT,
    "min_tokens": Range(0, INT64_MAX, integer=True),
    "top_k": Range(-1, INT64_MAX, integer=True),  # -1 and 0: disabled
    "seed": Range(INT64_MIN, UINT64_MAX, integer=True),
    "top_logprobs": Range(0, 20, integer=True),
    "logprobs": Range(0, 20, integer=True),       # completions' integer (vLLM's max_logprobs); chat's is a bool
    "prompt_logprobs": Range(0, 20, integer=True),
    "priority": Range(INT64_MIN, INT64_MAX, integer=True),
    "truncate_prompt_tokens": Range(-1, INT64_MAX, integer=True),   # vLLM's; -1: the model's context (0: refused)
}
# Fields holding an array of numbers: the range of each item.
ITEM_RANGES: Mapping[str, Range] = {"stop_token_ids": Range(0, INT64_MAX, integer=True),
                                    "allowed_token_ids": Range(0, INT64_MAX, integer=True)}
# Fields holding an array: the most items (``stop``: OpenAI takes 4, vLLM any number; every stop string is looked
# for in each new piece of text, so 100,000 of them, a security trial's, cost the engine's front end 85 ms a token
# for every stream it serves).
ITEM_COUNTS: Mapping[str, int] = {"stop": 256}
# ``logit_bias``: token id (a JSON key: a string of decimal digits) -> a bias in -100..100 (OpenAI's).
LOGIT_BIAS = Range(-100, 100)
# String fields that may not be empty (vLLM's ``cache_salt``: "must be a non-empty string if provided"; the
# gateway took "" and passed it on, a trial).
NON_EMPTY: frozenset[str] = frozenset({"cache_salt"})
_TOKEN_ID = re.compile(r"[0-9]{1,19}")


@dataclass(frozen=True, slots=True)
class RangeViolation:
    """Why one field's value is out of range, as OpenAI words it: ``param`` (``stop_token_ids[2]`` for an
    item), ``message`` and ``code``."""

    param: str
    message: str
    code: str


def _violation(name: str, value: Any, r: Range) -> RangeViolation | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None   # a type error: the schema check names it
    # an integer in a decimal field is still sent to the engine as an integer: keep it to 64 bits
    hi = r.hi if r.hi is not None else (INT64_MAX if isinstance(value, int) else None)
    lo = r.lo if r.lo is not None else (INT64_MIN if isinstance(value, int) else None)
    kind = "integer" if r.integer else "decimal"
    if lo is not None and (value < lo or (value == lo and not r.lo_inclusive)):
        expect = f">= {lo}" if r.lo_inclusive or r.lo is None else f"> {lo}"
        return RangeViolation(name, f"Invalid '{name}': {kind} below minimum value. Expected a value {expect}, "
                                    f"but got {value} instead.", f"{kind}_below_min_value")
    if hi is not None and value > hi:
        return RangeViolation(name, f"Invalid '{name}': {kind} above maximum value. Expected a value <= {hi}, but "
                                    f"got {value} instead.", f"{kind}_above_max_value")
    return None


def _logit_bias_violation(value: Any) -> RangeViolation | None:
    """``logit_bias``'s first key that is not a token id (a non-negative integer, as a string) or value that is not
    a number in ``LOGIT_BIAS``; None when it is not an object (a type error: the schema check names it)."""
    if not isinstance(value, dict):
        return None
    for key, bias in value.items():
        if not isinstance(key, str) or not _TOKEN_ID.fullmatch(key) or int(key) > INT64_MAX:
            return RangeViolation("logit_bias", f"Invalid key in 'logit_bias': {key!r}. Expected a token id (a "
                                                "non-negative integer, as a string).", "invalid_value")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)):
            return RangeViolation("logit_bias", f"Invalid value for 'logit_bias' key {key!r}: expected a number "
                                                f"from -100 to 100, got {type(bias).__name__}.", "invalid_type")
        if (v := _violation("logit_bias", bias, LOGIT_BIAS)) is not None:
            return RangeViolation("logit_bias", v.message.replace("'logit_bias'", f"'logit_bias' key {key!r}"),
                                  v.code)
    return None


def check_param(name: str, value: Any) -> RangeViolation | None:
    """The violation of ``name``'s range by ``value`` (None: in range, not a number, or a field without a
    range). Array fields of ``ITEM_COUNTS`` are checked for their length, of ``ITEM_RANGES`` item by item;
    ``logit_bias`` key by key; ``NON_EMPTY`` strings for the empty string."""
    if name == "logit_bias":
        return _logit_bias_violation(value)
    if name in NON_EMPTY and value == "":
        return RangeViolation(name, f"Invalid '{name}': string too short. Expected a string with minimum length 1, "
                                    f"but got an empty string instead.", "string_below_min_length")
    r = PARAM_RANGES.get(name)
    if r is not None:
        return _violation(name, value, r)
    most = ITEM_COUNTS.get(name)
    if most is not None and isinstance(value, list) and len(value) > most:
        return RangeViolation(name, f"Invalid '{name}': array too long. Expected an array with maximum length "
                                    f"{most}, but got an array with length {len(value)} instead.",
                              "array_above_max_length")
    r = ITEM_RANGES.get(name)
    if r is not None and isinstance(value, list):
        for i, item in enumerate(value):
            if (v := _violation(f"{name}[{i}]", item, r)) is not None:
                return v
    return None


def echo_only(body: Mapping[str, Any]) -> bool:
    """Whether a /v1/completions ``body`` asks for its prompt alone: ``echo`` true and ``max_tokens`` 0. The answer
    is the prompt's text (and its logprobs), nothing generated: OpenAI's legacy prompt scoring, vLLM's
    ``echo_without_generation`` (``vllm/entrypoints/openai/completion/protocol.py``), what evaluation
    harnesses send to score a text."""
    max_tokens = body.get("max_tokens")
    return body.get("echo") is True and type(max_tokens) is int and max_tokens == 0


def first_violation(body: Mapping[str, Any], *, completions: bool = False,
                    known: Container[str] | None = None) -> RangeViolation | None:
    """The first field of a request body whose value is out of range, or None. ``completions``: the body is a
    /v1/completions one, whose ``max_tokens`` may be 0 with ``echo`` (``echo_only``); ``known``: the fields to
    check (None: all; the gateway leaves a field its endpoint does not know to the unknown-parameter rule)."""
    scoring = completions and echo_only(body)
    for name, value in body.items():
        if (scoring and name == "max_tokens") or (known is not None and name not in known):
            continue
        if (name in PARAM_RANGES or name in ITEM_RANGES or name in ITEM_COUNTS or name in NON_EMPTY
                or name == "logit_bias"):
            if (v := check_param(name, value)) is not None:
                return v
    return None
