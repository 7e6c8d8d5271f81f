"""Logprob formats of the OpenAI API: chat ``logprobs.content`` (token,
logprob, bytes, top_logprobs), legacy completions ``logprobs`` (tokens,
token_logprobs, top_logprobs, text_offset) and vLLM's ``prompt_logprobs``.

Logprobs are the model's own distribution (log-softmax of the raw logits,
before temperature, penalties and top-k/top-p; see engine/worker/sampler.py); they
are clamped to -9999.0 so that -inf stays valid JSON.
"""

from __future__ import annotations

import codecs
import math

from engine.outputs import PositionLogprobs
from engine.tokenizer import bytes_to_unicode

_MIN_LOGPROB = -9999.0


def _clamp(lp: float) -> float:
    return _MIN_LOGPROB if math.isnan(lp) or lp < _MIN_LOGPROB else float(lp)


def _byte_decoder() -> dict[str, int]:
    """Byte-level BPE spelling -> byte (the inverse of GPT-2's table)."""
    return {c: b for b, c in bytes_to_unicode().items()}


class _TokenTexts:
    """Cached text and raw bytes of single tokens, for logprobs.

    ``bytes`` are exact for byte-level BPE tokens (a token may hold part of a
    multi-byte character); other tokens fall back to their decoded UTF-8."""

    def __init__(self, tokenizer) -> None:
        self._tok = tokenizer
        self._decoder = _byte_decoder()
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def get(self, token_id: int, decoded: str = "") -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is not None:
            return hit
        text = decoded or self._tok.decode([token_id], skip_special_tokens=False)
        spelled = self._tok.convert_ids_to_tokens([token_id])[0] or ""
        if spelled and all(ch in self._decoder for ch in spelled) and token_id not in self._tok.all_special_ids:
            raw = [self._decoder[ch] for ch in spelled]
        else:
            raw = list(text.encode("utf-8"))
        self._cache[token_id] = (text, raw)
        return text, raw

class _TokenIdTexts:
    """vLLM's ``return_tokens_as_token_ids``: each token named ``token_id:<id>`` (bytes: that name's UTF-8), so a
    token that is not a whole character stays tellable from another."""

    def get(self, token_id: int, decoded: str = "") -> tuple[str, list[int]]:
        name = f"token_id:{token_id}"
        return name, list(name.encode())


def legacy_name(text: str, raw: list[int]) -> str:
    """A token's name in legacy completions ``logprobs`` (``tokens``, the keys of ``top_logprobs``): its text, or,
    for a token holding part of a character (its bytes no UTF-8 text alone), ``bytes:\\xNN...`` as OpenAI names
    it, so that two such tokens are told apart (an engine trial's CJK tokens all read "\ufffd": one key for them
    all, the sampled token's logprob overwritten by another's)."""
    if "\ufffd" not in text:
        return text
    try:
        bytes(raw).decode("utf-8")
        return text
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


class TextCursor:
    """Where the next token's text starts in an answer's text (characters; ``text_offset``): each token advances it
    by the characters its bytes complete, a character begun by one token and ended by the next counted once (an
    engine trial's offsets ran past the end of a text with CJK and emoji, one character counted per token)."""

    __slots__ = ("chars", "_decoder")

    def __init__(self) -> None:
        self.chars = 0
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def advance(self, raw: list[int]) -> int:
        """The offset of the token of bytes ``raw``; the cursor moves past it."""
        start = self.chars
        self.chars += len(self._decoder.decode(bytes(raw)))
        return start


class LogprobFormatter:
    """Renders a model's ``PositionLogprobs`` in the API's formats.

    Args:
        tokenizer: the engine's tokenizer (token texts and bytes are cached).
        as_token_ids: name the tokens of chat and completions logprobs ``token_id:<id>`` (vLLM's
            ``return_tokens_as_token_ids``); vLLM's ``prompt_logprobs`` keep the decoded tokens.
    """

    def __init__(self, tokenizer, as_token_ids: bool = False) -> None:
        self._tokenizer = tokenizer
        self._texts: _TokenTexts | _TokenIdTexts | None = _TokenIdTexts() if as_token_ids else None

    def _token_texts(self) -> _TokenTexts | _TokenIdTexts:
        if self._texts is None:
            self._texts = _TokenTexts(self._tokenizer)
        return self._texts

    def chat_logprobs(self, token_ids: list[int], positions: list[PositionLogprobs], top: int) -> list[dict]:
        """OpenAI chat ``logprobs.content``: token, logprob, bytes, top_logprobs."""
        texts = self._token_texts()
        content = []
        for tok, pos in zip(token_ids, positions):
            lp = pos.get(tok)
            text, raw = texts.get(tok, lp.decoded_token if lp else "")
            tops = []
            if top:
                for t, l in sorted(pos.items(), key=lambda kv: kv[1].rank):
                    if l.rank > top or len(tops) >= top:
                        break
                    t_text, t_raw = texts.get(t, l.decoded_token)
                    tops.append({"token": t_text, "logprob": _clamp(l.logprob), "bytes": t_raw})
            content.append({"token": text, "logprob": _clamp(lp.logprob) if lp else _MIN_LOGPROB,
                            "bytes": raw, "top_logprobs": tops})
        return content

    def append_completion_logprobs(self, lps: dict, token_ids: list[int], positions: list[PositionLogprobs],
                                    k: int, cursor: TextCursor) -> TextCursor:
        """Append generated tokens to legacy completions logprobs, their ``text_offset`` from ``cursor`` (moved
        past them; returned). ``top_logprobs`` holds the top ``k`` plus the sampled token (OpenAI: up to
        logprobs+1 entries); tokens are named by ``legacy_name``."""
        texts = self._token_texts()
        for tok, pos in zip(token_ids, positions):
            lp = pos.get(tok)
            text, raw = texts.get(tok, lp.decoded_token if lp else "")
            lps["tokens"].append(legacy_name(text, raw))
            lps["token_logprobs"].append(_clamp(lp.logprob) if lp else _MIN_LOGPROB)
            lps["top_logprobs"].append(self.top_dict(pos, k, tok))
            lps["text_offset"].append(cursor.advance(raw))
        return cursor

    def append_prompt_logprobs(self, lps: dict, token_ids: list[int], positions: list, k: int) -> TextCursor:
        """Append an echoed prompt's tokens (the first has no logprob); returns the cursor after them."""
        texts = self._token_texts()
        cursor = TextCursor()
        for i, tok in enumerate(token_ids):
            pos = positions[i] if i < len(positions) else None
            lp = pos.get(tok) if pos else None
            text, raw = texts.get(tok, lp.decoded_token if lp else "")
            lps["tokens"].append(legacy_name(text, raw))
            lps["token_logprobs"].append(_clamp(lp.logprob) if lp else None)
            lps["top_logprobs"].append(self.top_dict(pos, k, tok) if pos else None)
            lps["text_offset"].append(cursor.advance(raw))
        return cursor

    def top_dict(self, pos: PositionLogprobs, k: int, sampled: int) -> dict[str, float]:
        texts = self._token_texts()
        out: dict[str, float] = {}
        for t, l in sorted(pos.items(), key=lambda kv: kv[1].rank):
            if l.rank <= k or t == sampled:
                out[legacy_name(*texts.get(t, l.decoded_token))] = _clamp(l.logprob)
        return out

    def prompt_logprobs_vllm(self, token_ids: list[int], positions: list) -> list:
        """vLLM's ``prompt_logprobs`` field: per prompt position None or
        {token_id: {"logprob", "rank", "decoded_token"}}."""
        texts = self._token_texts()
        out = []
        for i in range(len(token_ids)):
            pos = positions[i] if i < len(positions) else None
            out.append(None if pos is None else {
                str(t): {"logprob": _clamp(l.logprob), "rank": l.rank,
                         "decoded_token": texts.get(t, l.decoded_token)[0]} for t, l in pos.items()})
        return out




def empty_completion_logprobs() -> dict:
    """The legacy completions ``logprobs`` object with no token yet."""
    return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
