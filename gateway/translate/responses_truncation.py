"""The Responses API's ``truncation: "auto"``, as a pure function: the conversation (``previous_response_id``'s
history and this turn's input items) made to fit a token budget by dropping items from its beginning, as OpenAI
documents it, instead of a 400 ``context_length_exceeded``.

What is dropped: whole units from the oldest on, a unit being one item, or a ``function_call`` with the
``function_call_output`` that answers it (chat, and OpenAI, refuse one without the other). Never dropped: the
``instructions`` (not an item), ``system`` and ``developer`` messages, and the last unit (the turn being
answered). The budget and the token count come from the request pipeline (``gateway/request/pipeline.py``:
the smallest context window its targets declare, counted by the local engine's tokenizer).
"""

from __future__ import annotations

from collections.abc import Callable

from gateway.translate.responses import to_chat

_KEPT_ROLES = ("system", "developer")


def _units(conversation: list[dict]) -> list[list[int]]:
    """The droppable units of ``conversation``, oldest first, as item indices: each item but a system or
    developer message, a ``function_call`` joined by the ``function_call_output`` answering it."""
    units: list[list[int]] = []
    unit_of_call: dict = {}
    for i, item in enumerate(conversation):
        kind = item.get("type")
        if kind == "message" and item.get("role") in _KEPT_ROLES:
            continue
        if kind == "function_call_output" and item.get("call_id") in unit_of_call:
            units[unit_of_call[item["call_id"]]].append(i)
            continue
        if kind == "function_call":
            unit_of_call[item.get("call_id")] = len(units)
        units.append([i])
    return units


def fit_conversation(body: dict, conversation: list[dict], budget: int,
                     count: Callable[[dict], int | None], whole: int | None = None) -> dict | None:
    """The chat body of ``body`` (a Responses body, ``to_chat``) on ``conversation`` less its fewest oldest units
    that bring the prompt to at most ``budget`` tokens (``count``: a chat body's prompt tokens, None when it cannot
    be counted; ``whole``: the whole conversation's, when the caller counted it already); found by bisection, a
    count per try. None when the whole conversation fits already, when it
    cannot be counted, or when no drop makes it fit: the request then goes as it is (and a backend answers its
    ``context_length_exceeded``)."""
    units = _units(conversation)

    def chat(k: int) -> dict:
        dropped = {i for unit in units[:k] for i in unit}
        return to_chat(body, [], [item for i, item in enumerate(conversation) if i not in dropped])

    def fits(k: int) -> bool:
        n = count(chat(k))
        return n is not None and n <= budget

    if whole is None:
        whole = count(chat(0))
    if whole is None or whole <= budget or len(units) < 2 or not fits(len(units) - 1):
        return None
    lo, hi = 1, len(units) - 1          # fits(hi); the fewest units dropped that fit lie in lo..hi
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid + 1
    return chat(lo)
