"""Request schemas of the OpenAI-compatible API (text generation), with
vLLM's extra sampling fields. The OpenAI error the serving layer returns
(``ServingError``) lives in ``engine/protocol/errors.py``, with the rules the
gateway reads too.

The schemas are ``msgspec.Struct``s: ``parse_request(body, ChatCompletionRequest)``
converts a decoded JSON object, checks every field's type and returns an
error naming the field (``$.temperature`` -> ``temperature``), and checks every
value range of ``engine.protocol.param_ranges.PARAM_RANGES`` (the table the gateway reads too);
``SamplingParams`` checks its own invariants again (its messages also start
with the parameter's name). Unknown fields are ignored, as vLLM does, except vLLM's older constraint
fields (``guided_json``...), refused rather than answered unconstrained.

Sources: OpenAI API reference (``/v1/chat/completions``, ``/v1/completions``);
vLLM ``entrypoints/openai/protocol.py`` for the extra fields' names and defaults.
"""

from __future__ import annotations

import functools
import re
from typing import Any, TypeVar

import msgspec

from engine.protocol.param_ranges import first_violation


class StreamOptions(msgspec.Struct, kw_only=True):
    """``stream_options``: ``include_usage`` adds a final chunk with ``usage``
    and ``choices: []``; vLLM's ``continuous_usage_stats`` also puts the
    running usage on every chunk (only together with ``include_usage``)."""

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _SamplingFields(msgspec.Struct, kw_only=True):
    """Fields shared by chat and completions (OpenAI's, then vLLM's extras)."""

    model: str | None = None
    frequency_penalty: float | None = 0.0
    presence_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    n: int | None = 1
    best_of: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    use_beam_search: bool = False
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None   # vLLM's: sampling restricted to them
    bad_words: list[str] | None = None   # vLLM's: words never generated (engine/worker/token_restrictions.py)
    truncate_prompt_tokens: int | None = None   # vLLM's: keep the prompt's last N tokens (-1: max_model_len)
    return_tokens_as_token_ids: bool | None = None   # vLLM's: logprobs name tokens "token_id:<id>"
    length_penalty: float = 1.0   # vLLM's beam-search knob: without beam search (refused) it changes nothing
    # vLLM's arguments of custom logits processors (none run here): unread, typed as vLLM types them
    vllm_xargs: dict[str, str | int | float | list[str | int | float]] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    prompt_logprobs: int | None = None
    priority: int | None = None
    request_id: str | None = None
    cache_salt: str | None = None   # vLLM's: prefix-cache blocks are shared only by requests of the same salt
    # vLLM's: the answer carries the prompt's token ids (``prompt_token_ids``) and each choice's (``token_ids``;
    # streamed: each chunk's new ones, the prompt's on the first chunk)
    return_token_ids: bool = False
    structured_outputs: dict[str, Any] | None = None  # vLLM: {"json" | "regex" | "choice": ...}
    # vLLM's older names of structured_outputs' keys (engine.protocol.guided.GUIDED_FIELDS): read only to be
    # refused (engine/serving/serving.py), never ignored (the answer would be unconstrained)
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    # vLLM's fields this engine does not implement (UNSERVED_FIELDS): read only to be refused, never ignored
    logits_processors: Any = None
    prompt_embeds: Any = None   # completions' (vLLM takes them only with --enable-prompt-embeds)


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    """Body of ``POST /v1/chat/completions``.

    ``messages`` items are ``{"role", "content"}`` where content is a string
    or a list of ``{"type": "text", "text"}`` parts. ``logprobs`` is a bool
    with ``top_logprobs`` (0-20) alternatives per token. ``max_completion_tokens``
    is OpenAI's newer name of ``max_tokens``; without either the completion
    may use the whole context (``max_model_len - prompt_tokens``).
    """

    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # vLLM extras
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None   # extra variables of the chat template
    chat_template: Any = None   # vLLM's request template: refused (UNSERVED_FIELDS), the model's own renders
    mm_processor_kwargs: Any = None   # vLLM's multimodal processor options: refused (UNSERVED_FIELDS), as LLM.chat
    # Tandem: continue this request from the tokens each choice had generated (a stream resumed on another
    # replica, docs/operators/replicas.md); one list per choice
    resume_token_ids: list[list[int]] | None = None


class CompletionRequest(_SamplingFields, kw_only=True):
    """Body of ``POST /v1/completions``.

    ``prompt`` is a string, a list of strings, a list of token ids or a list
    of token-id lists (one request per prompt; choice ``index`` is
    ``prompt_index * n + i``). ``logprobs`` is an int (0-20). ``max_tokens``
    defaults to 16 (OpenAI's default), absent or null (vLLM 0.32's ``normalize_null_max_tokens``); 0 with
    ``echo`` returns the prompt alone (``param_ranges.echo_only``).
    """

    prompt: str | list[Any]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None
    response_format: dict[str, Any] | None = None   # as chat's (vLLM's completions take it too)
    # vLLM extras
    add_special_tokens: bool = True


T = TypeVar("T")

# vLLM request fields this engine does not implement -> why a request carrying one is refused (ignoring it would
# answer something else than what vLLM answers: words it bans, a prompt it truncates, token ids it names)
UNSERVED_FIELDS = {
    "use_beam_search": "beam search is not supported",
    "logits_processors": "custom logits processors are not supported",
    "prompt_embeds": "prompt embeddings are not supported: send the prompt as text or token ids",
    "mm_processor_kwargs": "this engine serves no multimodal model",
    # vLLM takes one only with --trust-request-chat-template; ignoring it would render another prompt
    "chat_template": "this server does not take request chat templates: the model's own template renders every "
                     "request (chat_template_kwargs reach it)",
}

# The request fields whose value is a JSON schema for structured outputs, as paths of object keys.
SCHEMA_PATHS = (("response_format", "json_schema", "schema"), ("structured_outputs", "json"))
_RAW_OBJECT = msgspec.json.Decoder(dict[str, msgspec.Raw])


def decode_body(data: bytes) -> Any:
    """A request body's JSON, decoded into Python objects except the schemas at ``SCHEMA_PATHS``, which stay
    ``msgspec.Raw`` (their JSON text, unparsed; ``chat_structured.schema_value`` reads them).

    A schema is work for the engine core's grammar pool, not for the serving process, whose event loop also
    writes every stream's events: decoded there, a 400 KB schema made ~8,600 containers (and their garbage
    collections), ~10-60 ms with the GIL held (issue #34). Kept raw, its text crosses to the core as it
    came (compacted by ``msgspec.json.format``, C): the objects on the way down are decoded as
    ``dict[str, Raw]`` (C, no object per nested value).

    Raises:
        msgspec.DecodeError: malformed JSON. RecursionError: nested past msgspec's limit (~1,000 levels).
    """
    try:
        top = _RAW_OBJECT.decode(data)
    except msgspec.ValidationError:   # well-formed so far, not an object: decoded whole, the caller refuses it
        return msgspec.json.decode(data)
    return {k: _keep_raw(v, path[1:]) if (path := _schema_path(k)) else msgspec.json.decode(v)
            for k, v in top.items()}


def _schema_path(key: str) -> tuple[str, ...] | None:
    return next((p for p in SCHEMA_PATHS if p[0] == key), None)


def _keep_raw(raw: msgspec.Raw, path: tuple[str, ...]) -> Any:
    """``raw`` decoded, but the value at ``path`` (keys of nested objects) kept raw; a value on the way that
    is not an object is decoded whole (its type error is then the caller's to report)."""
    if not path:
        return None if len(raw) == 4 and bytes(raw) == b"null" else raw   # null: "not given", as decoded
    try:
        obj = _RAW_OBJECT.decode(raw)
    except msgspec.ValidationError:
        return msgspec.json.decode(raw)
    return {k: _keep_raw(v, path[1:]) if k == path[0] else msgspec.json.decode(v) for k, v in obj.items()}


_PATH_RE = re.compile(r"at `\$\.?([A-Za-z_][A-Za-z0-9_]*)")


class RequestValidationError(ValueError):
    """A request body does not match its schema.

    Attributes:
        param: the top-level field at fault (None when the body itself is).
        code: OpenAI's error code when there is one (``integer_above_max_value``...).
    """

    def __init__(self, message: str, param: str | None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


# msgspec's type names -> OpenAI's words in its "Invalid type for ..." messages.
_TYPE_WORDS = {"object": "an object", "str": "a string", "int": "an integer", "float": "a number",
               "array": "an array", "bool": "a boolean"}
_TYPE_RE = re.compile(r"^Expected `([^`]+)`, got `([^`]+)` - at `\$\.?([^`]*)`$")


def _invalid_type(text: str, param: str | None) -> str | None:
    """OpenAI's message for a field of the wrong type ("Invalid type for 'response_format': expected an object,
    but got a string instead."), from msgspec's (``Expected `object | null`, got `str` - at `$.response_format```);
    None for any other error."""
    m = _TYPE_RE.match(text)
    if m is None or param is None:
        return None
    wanted = [_TYPE_WORDS.get(t.strip(), t.strip()) for t in m.group(1).split("|") if t.strip() != "null"]
    expected = wanted[0] if len(wanted) == 1 else "one of " + " or ".join(wanted)
    return (f"Invalid type for '{m.group(3) or param}': expected {expected}, but got "
            f"{_TYPE_WORDS.get(m.group(2), m.group(2))} instead.")


def parse_request(body: Any, schema: type[T]) -> T:
    """Check ``body`` (a decoded JSON object) against ``schema``.

    A top-level JSON null means "not given", as in OpenAI's API: the field's
    default applies (``"max_tokens": null`` on /v1/completions is 16 tokens, as vLLM 0.32 reads it).

    Raises:
        RequestValidationError: the body is not an object, a required field
            is missing, a field has the wrong type or a value is out of range
            (``param_ranges``); ``param`` names it.
    """
    if not isinstance(body, dict):
        raise RequestValidationError("the request body must be a JSON object", None, "invalid_type")
    try:
        parsed = msgspec.convert({k: v for k, v in body.items() if v is not None}, schema)
    except msgspec.ValidationError as exc:
        text = str(exc)
        match = _PATH_RE.search(text)
        param = match.group(1) if match else None
        missing = re.search(r"missing required field `([^`]+)`", text)
        if param is None and missing:
            param = missing.group(1)
        typed = _invalid_type(text, param)
        if typed is not None:
            raise RequestValidationError(typed, param, "invalid_type") from None
        if missing:   # OpenAI's words and code
            raise RequestValidationError(f"Missing required parameter: '{missing.group(1)}'.", param,
                                         "missing_required_parameter") from None
        message = f"{param}: {text}" if param else text
        raise RequestValidationError(message, param, "invalid_value") from None
    if (bad := first_violation(body, completions=schema is CompletionRequest)) is not None:
        raise RequestValidationError(bad.message, bad.param, bad.code)
    return parsed


def ignored_fields(body: dict, schema: type) -> list[str]:
    """The top-level fields of ``body`` that a request ``schema`` (a msgspec Struct) does not read, sorted: taken
    and ignored, as vLLM's server takes them (and logs them)."""
    return sorted(body.keys() - _field_names(schema))


@functools.cache
def _field_names(schema: type) -> frozenset[str]:
    return frozenset(f.encode_name for f in msgspec.structs.fields(schema))
