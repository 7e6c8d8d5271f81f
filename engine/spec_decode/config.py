"""``speculative_config`` (vLLM's name and keys): which proposer, how many tokens it may guess."""

from __future__ import annotations

from dataclasses import dataclass

from engine.json_config import config_object

METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding settings (vLLM's ``SpeculativeConfig`` keys).

    Attributes:
        method: "ngram" (prompt lookup: the continuation of the last n tokens' latest earlier occurrence in the
            prompt and output so far; no extra model) or "draft_model" (a smaller model's greedy continuation).
            None (unset) is inferred from ``model`` as vLLM does: "draft_model" for a path, "ngram" for
            ``"[ngram]"`` / ``"ngram"`` (then no model) or no model.
        num_speculative_tokens: most tokens proposed per sequence and step (k).
        prompt_lookup_max: longest n-gram matched (tried first; ngram).
        prompt_lookup_min: shortest n-gram matched (ngram).
        model: the draft model, a ``.gguf`` file or HF directory of any registered architecture with the
            target's tokenizer (draft_model only).
    """

    method: str | None = None
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    model: str | None = None

    def __post_init__(self) -> None:
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
        value = config_object(value, "speculative_config", cls)
        return cls(**value)
