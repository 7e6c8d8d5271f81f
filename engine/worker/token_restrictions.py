"""vLLM's token restrictions of a request: ``allowed_token_ids`` (sampling is restricted to them) and
``bad_words`` (words a completion never generates), resolved against the model when a request is added
(``resolved_for_model``) and applied by the sampler (``engine/worker/sampler.py``).

A word is a token sequence; its last token is banned at a step where the output so far ends with its other
tokens (a one-token word: at every step). A word is tokenized as it is and, when it gives another first token
of the same length, after a space (a byte-level BPE spells "Ġword" mid-text and "word" at the start), as vLLM's
``SamplingParams.update_from_tokenizer`` and ``v1/sample/ops/bad_words.py`` do. Only the output is matched, not
the prompt (vLLM's ``past_tokens_ids``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


def bad_words_token_ids(tokenizer, words: Sequence[str]) -> list[list[int]]:
    """The token sequences ``words`` ban (``tokenizer``: the engine's ``engine.tokenizer.Tokenizer``), in
    order: each word (leading spaces stripped) as it is, then after a space where that is another sequence of the
    same length."""
    out: list[list[int]] = []
    for word in words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        out.append(bare)
        if spaced[0] != bare[0] and len(spaced) == len(bare):
            out.append(spaced)
    return out


def banned_next_tokens(sequences: Sequence[Sequence[int]], output_token_ids: Sequence[int]) -> list[int]:
    """The tokens ``sequences`` (``bad_words_token_ids``) ban after ``output_token_ids``: the last token of each
    sequence whose other tokens end the output."""
    n = len(output_token_ids)
    banned = []
    for seq in sequences:
        k = len(seq) - 1
        if k <= n and list(output_token_ids[n - k:n]) == list(seq[:k]):
            banned.append(seq[k])
    return banned


def resolved_for_model(params, tokenizer, vocab: int):
    """``params`` (``SamplingParams``) with its ``bad_words`` tokenized by ``tokenizer`` into
    ``bad_words_token_ids`` (unless it has none or the caller set them).

    Raises:
        ValueError: an ``allowed_token_ids`` id outside ``[0, vocab)``."""
    if params.allowed_token_ids and any(t >= vocab for t in params.allowed_token_ids):
        raise ValueError(f"allowed_token_ids must be token ids of this model, in [0, {vocab})")
    if not params.bad_words or params.bad_words_token_ids is not None:
        return params
    return dataclasses.replace(params, bad_words_token_ids=bad_words_token_ids(tokenizer, params.bad_words))
