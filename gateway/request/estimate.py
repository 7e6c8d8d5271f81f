"""The prompt-length estimate's unit, when no tokenizer is at hand: ~4 characters of text a token (OpenAI's rule of
thumb for English BPE text), and a character outside ASCII a token of its own. BPE vocabularies give a CJK
character or an emoji a token or more (SmolLM2's: 2.3 and 2.0 a character; OpenAI's about one): at 4 characters a
token, a policy trial's 1,000 Chinese characters were estimated at 254 tokens (2,280 counted), and its rules and
budgets read a quarter of the prompt."""

from __future__ import annotations

CHARS_PER_TOKEN = 4


def text_weight(text: str) -> int:
    """``text``'s length in estimate characters: an ASCII character 1, any other ``CHARS_PER_TOKEN`` (a token).
    ASCII text (most requests) is not copied: ``str.isascii`` reads a flag of the string."""
    if text.isascii():
        return len(text)
    return len(text) + (CHARS_PER_TOKEN - 1) * (len(text) - len(text.encode("ascii", "ignore")))


def estimate_text_tokens(text: str) -> int:
    """Tokens of ``text`` by the estimate: its ``text_weight`` over ``CHARS_PER_TOKEN``, rounded up."""
    return -(-text_weight(text) // CHARS_PER_TOKEN)
