"""OpenAI's rules that a ``tool_choice`` and a ``parallel_tool_calls`` need ``tools``: read by the gateway's edge validation (chat, and the
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


# OpenAI's refusal of ``parallel_tool_calls`` without ``tools`` (param ``parallel_tool_calls``).
PARALLEL_WITHOUT_TOOLS = ("Invalid value for 'parallel_tool_calls': 'parallel_tool_calls' is only allowed when "
                          "'tools' are specified.")


def parallel_without_tools(parallel: Any, tools: Any) -> bool:
    """Whether a request sets ``parallel_tool_calls`` (None: not given) without ``tools`` (None or empty)."""
    return parallel is not None and not tools
