"""The checks of a chat or completions body's object-valued parameters OpenAI shapes: ``stream_options`` (its known
fields, with ``stream``) and ``metadata`` (string pairs). Read by ``gateway/request/validate.py``."""

from __future__ import annotations

from gateway.errors import ClientError


# The values OpenAI's SDK types (``openai.types.chat.completion_create_params``) give chat's string parameters;
# any other is a 400 ``invalid_value`` naming it (OpenAI's answer; a backend would refuse it after routing).
CHAT_VALUES = {
    "service_tier": ("auto", "default", "flex", "scale", "priority", "fast"),
    "reasoning_effort": ("none", "minimal", "low", "medium", "high", "xhigh", "max"),
    "verbosity": ("low", "medium", "high"),
    "prompt_cache_retention": ("in_memory", "24h"),
}


# JSON's types as OpenAI's "Invalid type for ..." messages name them (the engine's server words msgspec's the same).
_JSON_WORDS = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
               dict: "an object"}


def invalid_type(param: str, types: tuple, value: object) -> ClientError:
    """OpenAI's 400 (``invalid_type``) for ``param`` whose ``value`` is none of the JSON ``types`` (int and float
    together: a number): "Invalid type for 'temperature': expected a number, but got a string instead.", as the
    engine's own server words it (``engine.serving.protocol``; tests/engine/serving/test_protocol.py pins both)."""
    words = ["a number"] if set(types) == {int, float} else [_JSON_WORDS[t] for t in types]
    want = words[0] if len(words) == 1 else "one of " + " or ".join(words)
    got = _JSON_WORDS.get(type(value), type(value).__name__)
    return ClientError(400, f"Invalid type for '{param}': expected {want}, but got {got} instead.", param=param,
                       code="invalid_type")


def one_of(value: object, allowed: tuple[str, ...], param: str) -> None:
    """Refuse ``value`` (of ``param``) unless it is one of ``allowed``: 400 ``invalid_value`` listing them, in
    OpenAI's words."""
    if value not in allowed:
        listed = ", ".join(f"'{a}'" for a in allowed[:-1]) + ("," if len(allowed) > 2 else "") + \
            f" and '{allowed[-1]}'"
        raise ClientError(400, f"Invalid value for '{param}': {value!r}. Supported values are: {listed}.",
                          param=param, code="invalid_value")


def check_objects(body: dict) -> None:
    """Raises ClientError(400) naming the field unless ``CHAT_VALUES``' parameters, ``stream_options`` and
    ``metadata`` are what OpenAI takes."""
    for name, allowed in CHAT_VALUES.items():
        if isinstance(body.get(name), str):     # another type: the type check names it
            one_of(body[name], allowed, name)
    if "stream_options" in body:
        check_stream_options(body)
    if isinstance(body.get("metadata"), dict):
        _check_metadata(body["metadata"])


# stream_options' fields, each a boolean: OpenAI's, and vLLM's continuous_usage_stats (usage on every chunk).
STREAM_OPTIONS = ("include_usage", "include_obfuscation", "continuous_usage_stats")


def check_stream_options(body: dict, fields: tuple[str, ...] = STREAM_OPTIONS) -> None:
    """OpenAI's 400s for ``stream_options``: only with ``stream: true``, only its known ``fields`` (chat's
    ``STREAM_OPTIONS``; the Responses API knows ``include_obfuscation`` alone), each a boolean."""
    if body.get("stream") is not True:
        raise ClientError(400, "The 'stream_options' parameter is only allowed when 'stream' is true",
                          param="stream_options", code="invalid_value")
    for name, value in body["stream_options"].items():
        if name not in fields:
            raise ClientError(400, f"Unrecognized request argument supplied: stream_options.{name}",
                              param=f"stream_options.{name}", code="unknown_parameter")
        if value is not None and not isinstance(value, bool):
            raise invalid_type(f"stream_options.{name}", (bool,), value)


def _check_metadata(metadata: dict) -> None:
    """OpenAI's 400s for ``metadata``: at most 16 pairs, keys of at most 64 characters, string values of at most 512
    (policy rules match ``metadata.<key>`` as strings; an upstream would refuse the others after routing)."""
    if len(metadata) > 16:
        raise ClientError(400, f"Invalid 'metadata': too many properties. Expected an object with at most 16 "
                          f"properties, but got an object with {len(metadata)} properties instead.",
                          param="metadata", code="object_above_max_properties")
    for key, value in metadata.items():
        if len(key) > 64:
            raise ClientError(400, f"Invalid 'metadata': a key of {len(key)} characters; at most 64.",
                              param="metadata", code="string_above_max_length")
        if not isinstance(value, str):
            raise invalid_type(f"metadata.{key}", (str,), value)
        if len(value) > 512:
            raise ClientError(400, f"Invalid 'metadata.{key}': string too long. Expected a string with maximum "
                              f"length 512, but got a string with length {len(value)} instead.",
                              param=f"metadata.{key}", code="string_above_max_length")
