"""Sampling parameters, with vLLM's names, defaults and validation."""

from __future__ import annotations

from dataclasses import InitVar, dataclass, field
from enum import IntEnum
from typing import Any

import msgspec

from engine.protocol.param_ranges import PARAM_RANGES


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A grammar the completion must follow (vLLM's ``StructuredOutputsParams``).

    Exactly one of the spec fields is set.

    Attributes:
        json: a JSON schema (a dict, a boolean or its JSON text): the output is
            one JSON value valid under it (``engine/worker/json_schema_subset.py``).
        json_object: the output is one JSON object (OpenAI's ``json_object``).
        regex: the output matches this regular expression.
        choice: the output is exactly one of these strings (a list, not a string).
        grammar: an EBNF grammar (xgrammar's GBNF dialect, root rule ``root``).
        structural_tag: xgrammar's structural-tag JSON (used for tool calls:
            free text, then tagged JSON arguments).
        where: the request paths of the spec's schemas, for error messages
            (``json``: one; ``structural_tag``: one per tag, in order); not
            part of the key.
        digest: the compile pool's key, set once it compiled (saves hashing
            the spec again in the engine step); not part of the key. Set
            alone (no spec field), the spec is a reference to a grammar the
            engine compiled already: what a request carries to the engine
            core (``core_messages.params_to_wire``), so that a 400 KB schema
            crosses the core's pipe once, in its ``CompileGrammar``.

    Raises:
        ValueError: none or several fields set, or a field of the wrong type
            (the message names it).
    """

    json: str | dict | bool | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    structural_tag: str | None = None
    where: tuple[str, ...] = ()
    digest: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        if isinstance(self.where, list):
            object.__setattr__(self, "where", tuple(self.where))
        set_fields = [f for f in _SPECS if getattr(self, f) is not None]
        if self.json_object:
            set_fields.append("json_object")
        if len(set_fields) != 1 and not (not set_fields and self.digest is not None):
            raise ValueError(f"structured_outputs: exactly one of json, json_object, regex, choice, grammar, "
                             f"structural_tag must be set, got {set_fields or 'none'}")
        if self.choice is not None and (not isinstance(self.choice, tuple) or not self.choice
                                        or not all(isinstance(c, str) for c in self.choice)):
            if not isinstance(self.choice, tuple):
                got = type(self.choice).__name__
            elif not self.choice:
                got = "an empty list"
            else:
                got = "an item of type " + next(type(c).__name__ for c in self.choice if not isinstance(c, str))
            raise ValueError(f"structured_outputs.choice: must be a non-empty list of strings, got {got}")
        for name in ("regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name}: must be a non-empty string, got {type(value).__name__}")
        if self.json is not None and not isinstance(self.json, (dict, bool, str)):
            raise ValueError(f"structured_outputs.json: must be a JSON schema (an object), "
                             f"got {type(self.json).__name__}")

    @property
    def kind(self) -> str:
        """The field that is set ("json", "json_object", "regex", ...; "digest": a reference)."""
        if self.json_object:
            return "json_object"
        return next((f for f in _SPECS if getattr(self, f) is not None), "digest")

    @property
    def is_reference(self) -> bool:
        """True when only ``digest`` is set: the grammar is found by it in the engine's cache."""
        return self.kind == "digest"

    def key(self) -> str:
        """Canonical text of the spec (what the grammar cache's digest hashes):
        compact JSON with sorted keys (msgspec: 2x json.dumps' speed on a 400 KB schema). A schema
        given as JSON text (as ``tandem engine serve`` passes it, compacted, ``chat_structured.schema_value``;
        or after crossing the core's pipe, ``params_to_wire``) is hashed as it is: the same schema with its
        keys in another order is another entry of the cache."""
        value = getattr(self, self.kind)
        if isinstance(value, (dict, tuple, bool)):
            value = msgspec.json.encode(value, order="sorted").decode()
        return f"{self.kind}:{value}"


_SPECS = ("json", "regex", "choice", "grammar", "structural_tag")


class RequestOutputKind(IntEnum):
    """What each ``RequestOutput`` of a request holds (vLLM's names and values).

    ``CUMULATIVE``: each choice's text, token ids and logprobs so far (an output names the choices with news);
    ``DELTA``: only what is new since the request's previous output; ``FINAL_ONLY``: one output, once every
    choice finished, holding all of them whole. ``LLM.generate`` returns final outputs whatever the kind, as
    vLLM's does.
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    """How to sample one request's completion(s).

    Names and defaults follow vLLM's ``SamplingParams``. Every field is
    validated in ``__post_init__``; a bad value raises ``ValueError`` whose
    message starts with the parameter's name.

    Attributes:
        n: number of completions (choices) for the prompt, >= 1. Children share
            the prompt's KV blocks (copy-on-write).
        temperature: 0 means greedy (argmax); otherwise logits are divided by it.
        top_p: nucleus sampling mass in [0, 1] (OpenAI's range; 0: the likeliest token alone, as the smallest
            nucleus holds it; vLLM refuses 0).
        top_k: keep the k most likely tokens; 0 or -1 disables.
        min_p: drop tokens whose probability is below ``min_p`` times the top
            token's probability; in [0, 1].
        presence_penalty, frequency_penalty: OpenAI's additive penalties over
            generated tokens, in [-2, 2].
        repetition_penalty: multiplicative penalty (CTRL paper, Keskar et al.
            2019) over prompt and generated tokens, > 0; 1 disables.
        logit_bias: token id -> a bias in [-100, 100] added to its logit before sampling (OpenAI's and vLLM's;
            the reported logprobs stay the model's raw ones).
        seed: seeds this request's own generator, so its output does not
            depend on what it is batched with.
        max_tokens: maximum new tokens per completion (None: up to
            ``max_model_len``).
        min_tokens: nothing stops the completion before this many tokens:
            EOS and ``stop_token_ids`` are suppressed, and a stop string
            complete within them is no stop (it stays in the text).
        stop: strings that end the completion; not included in the text unless
            ``include_stop_str_in_output``.
        stop_token_ids: token ids that end the completion (kept in token ids,
            not in the text).
        ignore_eos: keep generating past EOS.
        logprobs: number of top log-probabilities per generated token (the sampled token's is always
            returned when not None; -1: every token of the vocabulary, as vLLM's); the engine's
            ``max_logprobs`` (20 by default, OpenAI's limit) caps it.
        prompt_logprobs: number of top log-probabilities per prompt token (-1: every token).
        detokenize: False: the outputs carry token ids and no text (``text`` and the logprobs'
            ``decoded_token`` empty), as in vLLM; stop strings need the text, so ``stop`` is refused with it.
        skip_special_tokens: drop special tokens from the text.
        spaces_between_special_tokens: kept for vLLM compatibility.
        structured_outputs: a grammar the completion must follow
            (engine/worker/structured_outputs.py), or None.
        allowed_token_ids: sampling is restricted to these token ids (vLLM's; the reported logprobs stay the
            model's raw ones).
        bad_words: words the completion never generates (vLLM's): each word's last token is banned wherever
            the output ends with its other tokens, the word tokenized as it is and after a space
            (``engine/worker/token_restrictions.py``).
        bad_words_token_ids: ``bad_words`` tokenized (vLLM's ``_bad_words_token_ids``): set by the engine core
            from its tokenizer when ``bad_words`` is; None otherwise.
        truncate_prompt_tokens: vLLM's: the prompt's last N tokens only (left truncation; -1: the last
            ``max_model_len``), applied where the prompt is tokenized (``LLMEngine.add_request``), which refuses
            0, values below -1 or above ``max_model_len`` in the OpenAI server's words; None: as given.
        output_kind: a ``RequestOutputKind``: what the outputs of ``AsyncEngine.generate`` and
            ``LLMEngine.step`` hold for this request. The default is DELTA (vLLM's is CUMULATIVE): this engine's
            streams have always carried deltas, and its servers read them.
        extra_args: vLLM's free-form arguments for custom plugins (a dict, kept as given; nothing here reads
            it).

    vLLM's ``guided_decoding`` (renamed ``structured_outputs``) and per-request ``logits_processors`` are taken
    only as None (or no processors) and refused otherwise, saying what to use instead.

    Raises:
        ValueError: a parameter is out of range or of the wrong type; the message names it.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    truncate_prompt_tokens: int | None = None
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.DELTA
    extra_args: dict[str, Any] | None = None
    guided_decoding: InitVar[Any] = None     # refused unless None: vLLM's older name of structured_outputs
    logits_processors: InitVar[Any] = None   # refused unless None or empty

    def __post_init__(self, guided_decoding: Any, logits_processors: Any) -> None:
        _refuse_unsupported(guided_decoding, logits_processors)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        self.stop = _listed(self.stop, "stop", "a string or a list of strings")
        self.stop_token_ids = _listed(self.stop_token_ids, "stop_token_ids", "a list of token ids")
        if isinstance(self.allowed_token_ids, tuple):
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        if _is_int(self.output_kind) and self.output_kind in _OUTPUT_KINDS:   # its value, off the core's wire
            self.output_kind = RequestOutputKind(self.output_kind)
        self._verify_types()
        self._verify()

    def _verify_types(self) -> None:
        """The fields that are no numbers: their types, and what ``detokenize=False`` cannot serve."""
        for name in _BOOL_FIELDS:   # "no" is truthy: a string here would silently read as True
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be a bool (True or False), got {type(value).__name__} {value!r}")
        spec = self.structured_outputs
        if spec is not None and not isinstance(spec, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams (engine.sampling_params) or "
                             f"None, got {type(spec).__name__}: e.g. StructuredOutputsParams(json=schema)")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind (CUMULATIVE, DELTA or FINAL_ONLY), got "
                             f"{type(self.output_kind).__name__} {self.output_kind!r}")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise ValueError(f"extra_args must be a dict or None, got {type(self.extra_args).__name__}")
        if self.stop and not self.detokenize:   # vLLM's words
            raise ValueError("stop strings are only supported when detokenize is True. Set detokenize=True to use "
                             "stop.")

    def _verify(self) -> None:
        def check(ok: bool, name: str, msg: str) -> None:
            if not ok:
                raise ValueError(f"{name} {msg}")

        check(_is_int(self.n) and self.n >= 1, "n", f"must be an integer >= 1, got {self.n!r}")
        for name in _FLOAT_FIELDS:   # a string ("0.5") is no number: say so, not which range it missed
            value = getattr(self, name)
            check(_is_num(value), name, f"must be a number, got {type(value).__name__} {value!r}")
        check(_is_num(self.temperature) and self.temperature >= 0, "temperature",
              f"must be >= 0, got {self.temperature!r}")
        check(_is_num(self.top_p) and 0 <= self.top_p <= 1, "top_p", f"must be in [0, 1], got {self.top_p!r}")
        check(_is_int(self.top_k) and self.top_k >= 0, "top_k",
              f"must be 0 or -1 (disabled) or a positive integer, got {self.top_k!r}")
        check(_is_num(self.min_p) and 0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p!r}")
        check(_is_num(self.presence_penalty) and -2 <= self.presence_penalty <= 2, "presence_penalty",
              f"must be in [-2, 2], got {self.presence_penalty!r}")
        check(_is_num(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2, "frequency_penalty",
              f"must be in [-2, 2], got {self.frequency_penalty!r}")
        check(_is_num(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty",
              f"must be > 0, got {self.repetition_penalty!r}")
        check(self.logit_bias is None or (isinstance(self.logit_bias, dict) and all(
            _is_int(t) and t >= 0 and _is_num(b) and -100 <= b <= 100 for t, b in self.logit_bias.items())),
            "logit_bias", f"must map token ids to biases in [-100, 100], got {self.logit_bias!r}")
        seeds = PARAM_RANGES["seed"]         # the server's range (torch's manual_seed's): one table
        check(self.seed is None or (_is_int(self.seed) and seeds.lo <= self.seed <= seeds.hi), "seed",
              f"must be an integer in [-2**63, 2**64 - 1] (torch's manual_seed range, the server's), got {self.seed!r}")
        check(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1), "max_tokens",
              f"must be at least 1, got {self.max_tokens!r}")
        check(_is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens",
              f"must be >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None:
            check(self.min_tokens <= self.max_tokens, "min_tokens",
                  f"must be <= max_tokens={self.max_tokens}, got {self.min_tokens}")
        check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        check(all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
              "must be non-negative integers")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            check(v is None or (_is_int(v) and v >= -1), name,
                  f"must be an integer >= 0, or -1 (every token of the vocabulary), got {v!r}")
        ids = self.allowed_token_ids
        check(ids is None or (isinstance(ids, list) and ids and all(_is_int(t) and t >= 0 for t in ids)),
              "allowed_token_ids", f"must be a non-empty list of token ids (integers >= 0), got {ids!r}")
        # a trial: the grammar's next tokens and these had none in common, and each answer ended at once as a
        # "length" schema violation (at temperature 0 a retry loops): refused, as nothing can enforce both
        check(ids is None or self.structured_outputs is None, "allowed_token_ids",
              "cannot be combined with structured outputs or tools: the grammar's next tokens may all lie outside "
              "the allowed ones, and no answer could then be written")
        words = self.bad_words
        check(words is None or (isinstance(words, list) and all(isinstance(w, str) and w.strip() for w in words)),
              "bad_words", f"must be a list of words (strings with a non-space character), got {words!r}")
        tokenized = self.bad_words_token_ids
        check(tokenized is None or (isinstance(tokenized, list) and all(
            isinstance(w, list) and w and all(_is_int(t) and t >= 0 for t in w) for w in tokenized)),
            "bad_words_token_ids", "must be a list of non-empty token-id lists")
        keep = self.truncate_prompt_tokens   # the server's range, 0 refused; max_model_len bounds it (llm_prompts.py)
        check(keep is None or (_is_int(keep) and keep >= PARAM_RANGES["truncate_prompt_tokens"].lo and keep != 0),
              "truncate_prompt_tokens", f"must be an integer >= 1, or -1 (what fits max_model_len), got {keep!r}")

    @property
    def greedy(self) -> bool:
        """True when the next token is the argmax (temperature 0)."""
        return self.temperature == 0.0


_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
_OUTPUT_KINDS = frozenset(RequestOutputKind)
_BOOL_FIELDS = ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
                "detokenize")


def _refuse_unsupported(guided_decoding: Any, logits_processors: Any) -> None:
    """ValueError for vLLM's fields this engine does not serve, naming what to use instead."""
    if guided_decoding is not None:
        raise ValueError("guided_decoding is not supported: vLLM renamed it structured_outputs; pass "
                         "structured_outputs=StructuredOutputsParams(json=..., regex=..., choice=..., grammar=...) "
                         "(engine.sampling_params)")
    if logits_processors is not None and not (isinstance(logits_processors, (list, tuple)) and not logits_processors):
        raise ValueError("logits_processors are not supported: a request's parameters reach the engine core as "
                         "data (msgpack, to its own process under AsyncEngine and the servers), which a Python "
                         "callable is not, and the sampler treats a step's batch in one pass (vLLM V1 refuses "
                         "per-request logits processors too); restrict the output with logit_bias, "
                         "allowed_token_ids, bad_words or structured_outputs")


def _listed(value: Any, name: str, what: str) -> list:
    """``value`` (None, a list or a tuple) as a new list; ValueError naming ``name`` for anything else."""
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return list(value)
    raise ValueError(f"{name} must be {what}, got {type(value).__name__} {value!r}")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)
