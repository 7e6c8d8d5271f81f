"""``speculative_config`` (vLLM's name and keys): which proposer, how many tokens it may guess."""

from __future__ import annotations

from dataclasses import dataclass

from engine.json_config import config_object, json_object

METHODS = ("ngram", "draft_model")
# vLLM's keys that change nothing here (speculation never changes an output bit; these tune only its speed or
# memory in vLLM): taken (``SpeculativeConfig.parse``) and said once at start (``unused_keys``), so a vLLM config
# runs as written.
UNUSED_KEYS = {
    "draft_tensor_parallel_size": "the draft model runs beside the target's ranks",
    "disable_by_batch_size": "a cost model decides per step whether proposals pay (speculative-decoding.md)",
    "revision": "models are local paths", "code_revision": "models are local paths",
    "enforce_eager": "there is no graph capture on this engine's CPU path",
    "disable_logprobs": "logprobs are the target's own either way",
    "disable_padded_drafter_batch": "drafts are batched unpadded",
}


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding settings (vLLM's ``SpeculativeConfig`` keys).

    Attributes:
        method: "ngram" (prompt lookup: the continuation of the last n tokens' earliest occurrence in the
            prompt and output so far; no extra model) or "draft_model" (a smaller model's greedy continuation).
            None (unset) is inferred from ``model`` as vLLM does: "draft_model" for a path, "ngram" for
            ``"[ngram]"`` / ``"ngram"`` (then no model) or no model.
        num_speculative_tokens: most tokens proposed per sequence and step (k).
        prompt_lookup_max: longest n-gram matched (tried first; ngram). One bound given alone is the other too
            (vLLM's rule); neither: 4 and 2.
        prompt_lookup_min: shortest n-gram matched (ngram).
        model: the draft model, a ``.gguf`` file or HF directory of any registered architecture with the
            target's tokenizer (draft_model only).
        max_model_len: the draft's context, tokens (draft_model; default and cap: its ``max_position_embeddings``):
            a sequence past it gets no proposal.
    """

    method: str | None = None
    num_speculative_tokens: int = 4
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: str | None = None
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max   # vLLM's: one bound alone is the other too
        object.__setattr__(self, "prompt_lookup_min", lo if lo is not None else hi if hi is not None else 2)
        object.__setattr__(self, "prompt_lookup_max", hi if hi is not None else lo if lo is not None else 4)
        if self.method is None:   # vLLM's inference from the model named
            ngram = self.model is None or self.model in ("ngram", "[ngram]")
            object.__setattr__(self, "method", "ngram" if ngram else "draft_model")
            if ngram:
                object.__setattr__(self, "model", None)
        checks = [
            (self.method in METHODS, "method", f"must be one of {', '.join(METHODS)}, got {self.method!r}"),
            (isinstance(self.num_speculative_tokens, int) and self.num_speculative_tokens >= 1,
             "num_speculative_tokens", f"must be an integer >= 1, got {self.num_speculative_tokens!r}"),
            (isinstance(self.prompt_lookup_min, int) and self.prompt_lookup_min >= 1, "prompt_lookup_min",
             f"must be an integer >= 1, got {self.prompt_lookup_min!r}"),
            (isinstance(self.prompt_lookup_max, int) and self.prompt_lookup_max >= self.prompt_lookup_min,
             "prompt_lookup_max", f"must be an integer >= prompt_lookup_min, got {self.prompt_lookup_max!r}"),
            ((self.model is not None) == (self.method == "draft_model"), "model",
             "is the draft model's path, needed by method draft_model and by no other" if self.model is None
             else f"is only read by method draft_model, got it with method {self.method!r}"),
            (self.model is None or (isinstance(self.model, str) and self.model), "model",
             f"must be a path, got {self.model!r}"),
            (self.max_model_len is None or (isinstance(self.max_model_len, int) and self.max_model_len >= 1),
             "max_model_len", f"must be an integer >= 1, got {self.max_model_len!r}"),
        ]
        for ok, name, msg in checks:
            if not ok:
                raise ValueError(f"speculative_config.{name} {msg}")

    @classmethod
    def parse(cls, value: "SpeculativeConfig | dict | str | None") -> "SpeculativeConfig | None":
        """A config from a dict, a JSON object text (``--speculative-config``) or None (no speculation).

        Raises:
            ValueError: not a JSON object, an unknown key, or a bad value (the message names it).
        """
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        value = json_object(value, "speculative_config")
        value = config_object({k: v for k, v in value.items() if k not in UNUSED_KEYS}, "speculative_config", cls)
        return cls(**value)


def unused_keys(value: "SpeculativeConfig | dict | str | None") -> list[str]:
    """One line per vLLM key of ``value`` (``--speculative-config``) that changes nothing here (``UNUSED_KEYS``),
    for the engine's start to log once (``parse`` is also read where a config is only checked)."""
    if value is None or isinstance(value, SpeculativeConfig):
        return []
    value = json_object(value, "speculative_config")
    return [f"speculative_config.{key}={value[key]!r} taken, not used: {UNUSED_KEYS[key]}"
            for key in sorted(set(value) & set(UNUSED_KEYS))]
