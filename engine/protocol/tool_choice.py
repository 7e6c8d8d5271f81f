"""OpenAI's rule that a ``tool_choice`` needs ``tools``: read by the gateway's edge validation (chat, and the
Responses and Messages bodies translated onto chat) and by the engine's own chat server
(``engine/serving/chat_structured.py``), so the request gets the same 400 wherever it enters, before routing."""

from __future__ import annotations

from typing import Any

# The refusal's message (param ``tool_choice``): the engine's wording since its first tool support.
TOOL_CHOICE_WITHOUT_TOOLS = "tool_choice: is only allowed when tools are given"


def tool_choice_without_tools(choice: Any, tools: Any) -> bool:
    """Whether ``choice`` (a request's ``tool_choice``; None: not given) asks for tools that ``tools`` (the
    request's ``tools``; None or empty: none) does not give. ``"none"`` needs no tools."""
    return choice is not None and choice != "none" and not tools
