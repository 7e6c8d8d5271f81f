"""The prompts the offline ``LLM`` takes, as vLLM's ``LLM`` takes them: a text, a token-id list (any integers:
Python's, numpy's), vLLM's prompt dicts (``{"prompt": text}`` / ``{"prompt_token_ids": ids}``, each with an
optional ``cache_salt``), or a list of these."""

from __future__ import annotations

import numbers

from engine.protocol.errors import ServingError
from engine.serving.serving import truncate_prompt, truncation

Prompt = str | list[int]


def prompt_list(prompts) -> list:
    """``prompts`` as a list: one text, one prompt dict or one token-id list (a numpy array too) is one prompt."""
    if isinstance(prompts, (str, dict)) or (len(prompts) and _is_token_id(prompts[0])):
        return [prompts]
    return list(prompts)


def parse_prompt(prompt, cache_salt: str | None) -> tuple[Prompt, str | None]:
    """(text or token ids as Python ints, cache salt) of one prompt: as given, or from vLLM's prompt dict (its own
    ``cache_salt`` wins).

    Raises:
        ValueError: a dict with neither ``prompt`` nor ``prompt_token_ids``, or a key this engine does not take
            (``multi_modal_data``...).
        TypeError: token ids that are not integers (a text given as ``prompt_token_ids``), or a prompt that is
            neither a text nor token ids."""
    if not isinstance(prompt, dict):
        return (prompt if isinstance(prompt, str) else token_ids(prompt, "prompt")), cache_salt
    if other := sorted(set(prompt) - {"prompt", "prompt_token_ids", "cache_salt"}):
        raise ValueError(f"prompt dict: {', '.join(other)} not supported (prompt, prompt_token_ids and cache_salt "
                         "are)")
    if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
        raise ValueError("prompt dict: give one of prompt (a text) or prompt_token_ids (token ids)")
    salt = prompt.get("cache_salt", cache_salt)
    if "prompt" in prompt:
        if not isinstance(prompt["prompt"], str):
            raise TypeError(f"prompt: must be a text (str), got {type(prompt['prompt']).__name__}; give token ids "
                            "as prompt_token_ids")
        return prompt["prompt"], salt
    return token_ids(prompt["prompt_token_ids"], "prompt_token_ids"), salt


def token_ids(value, name: str) -> list[int]:
    """``value`` (a sequence of integers: Python's, numpy's...) as a list of Python ints.

    Raises:
        TypeError: a text or another non-sequence, or an item that is not an integer (a bool is not), named."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__"):
        raise TypeError(f"{name}: must be a list of token ids (integers), got {type(value).__name__}"
                        + ("; give a text as {'prompt': text}" if isinstance(value, str) else ""))
    ids = list(value)
    for i, t in enumerate(ids):
        if not _is_token_id(t):
            raise TypeError(f"{name}[{i}]: must be an integer token id, got {type(t).__name__}")
    return [int(t) for t in ids]


def _is_token_id(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def truncated_prompts(prompts: list[list[int]], keep: int | None, max_model_len: int) -> list[list[int]]:
    """vLLM's ``truncate_prompt_tokens`` applied as the OpenAI server applies it (``engine.serving.serving``'s
    ``truncation`` and ``truncate_prompt``): each prompt's last ``keep`` tokens, -1: the last ``max_model_len``;
    None: as given.

    Raises:
        ValueError: the server's 400 in its words (not an integer, 0, below -1, above ``max_model_len``)."""
    if keep is None:
        return prompts
    try:
        limit = truncation(keep, max_model_len)
        return [truncate_prompt(ids, limit) for ids in prompts]
    except ServingError as exc:
        raise ValueError(exc.message) from None
