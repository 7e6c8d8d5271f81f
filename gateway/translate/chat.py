"""What the client-API translators read of a chat completion's message or stream delta beyond OpenAI's own
fields."""

from __future__ import annotations


def reasoning_of(message: dict) -> str | None:
    """The reasoning text of a chat message or delta: ``reasoning_content`` (vLLM's, DeepSeek's), or
    ``reasoning`` (vLLM's newer name, OpenRouter's)."""
    text = message.get("reasoning_content") or message.get("reasoning")
    return text if isinstance(text, str) and text else None
