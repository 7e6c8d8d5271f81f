"""The Responses API's ``truncation: "auto"``, as a pure function: the conversation (``previous_response_id``'s
history and this turn's input items) made to fit a token budget by dropping items from its beginning, as OpenAI
documents it, instead of a 400 ``context_length_exceeded``.

What is dropped: whole units from the oldest on, a unit being one item, or a ``function_call`` with the
``function_call_output`` that answers it (chat, and OpenAI, refuse one without the other). Never dropped: the
``instructions`` (not an item), ``system`` and ``developer`` messages, and the last unit (the turn being
answered). The budget and the token count come from the request pipeline (``gateway/request/pipeline.py``:
the smallest context window its targets declare, counted by the local engine's tokenizer).

Before that, whatever ``truncation`` says, a stored history is held to the bytes a request may carry
(``history_within``): past them ``auto`` drops its oldest units the same way and ``disabled`` is a 400.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from gateway.errors import ClientError
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


def history_within(history: list[dict], items: list[dict], limit: int, auto: bool) -> list[dict]:
    """``history`` (a stored conversation) as this turn may continue it: whole while it and ``items`` (this turn's)
    take at most ``limit`` bytes of JSON (``server.max_body_size``, the most any request may carry); past that,
    with ``auto`` (``truncation: "auto"``), less its fewest oldest units (as ``fit_conversation`` drops them;
    never one answered in ``items``) that bring it within the limit. A chained conversation is bounded like a
    body sent whole: each turn renders and counts it, so without a bound a tenant's chain of 1 MB turns made
    every turn slower and the gateway larger (a trial: 14 s and +1 GiB by the 11th turn).

    Raises:
        ClientError: 400 ``context_length_exceeded`` (``param: input``) when it cannot be brought within the
            limit: without ``auto``, or when the units left cannot be dropped."""
    if not history:                     # a body sent whole: the front's limit held it already
        return history
    sizes = [len(msgspec.json.encode(item)) + 1 for item in history]
    total = sum(sizes) + sum(len(msgspec.json.encode(item)) + 1 for item in items)
    if total <= limit:
        return history
    if auto:
        dropped: set[int] = set()
        for unit in _units([*history, *items]):
            if total <= limit or unit[-1] >= len(history):
                break
            dropped.update(unit)
            total -= sum(sizes[i] for i in unit)
        if total <= limit:
            return [item for i, item in enumerate(history) if i not in dropped]
    raise ClientError(400, f"The conversation (previous_response_id's and this input's items) takes {total} bytes, "
                      f"more than the {limit} a request may carry here (server.max_body_size): send truncation "
                      "'auto' to have its oldest items dropped, or start a new conversation.",
                      param="input", code="context_length_exceeded")


def fit_conversation(body: dict, conversation: list[dict], budget: int,
                     count: Callable[[dict], int | None], whole: int | None = None) -> dict | None:
    """The chat body of ``body`` (a Responses body, ``to_chat``) on ``conversation`` less its fewest oldest units
    that bring the prompt to at most ``budget`` tokens (``count``: a chat body's prompt tokens, None when it cannot
    be counted; ``whole``: the whole conversation's, when the caller counted it already). None when the whole
    conversation fits already, when it cannot be counted, or when no drop makes it fit: the request then goes as
    it is (and a backend answers its ``context_length_exceeded``).

    The units kept are found from the newest back: 1, 2, 4, ... units while they fit, then by bisection between
    the last that fit and the first that did not (exponential search, Bentley and Yao 1976), a count per try. So
    each try renders about what fits, at most twice it, and the tries grow with the log of the units kept: a long
    stored history costs no rendering of its dropped part (counting from the oldest, each try rendered most of
    it, and a chain of ~1 MB turns took longer every turn)."""
    units = _units(conversation)
    n = len(units)

    def chat(kept: int) -> dict:
        dropped = {i for unit in units[:n - kept] for i in unit}
        return to_chat(body, [], [item for i, item in enumerate(conversation) if i not in dropped])

    def fits(kept: int) -> bool:
        tokens = count(chat(kept))
        return tokens is not None and tokens <= budget

    if whole is None:
        whole = count(chat(n))
    if whole is None or whole <= budget or n < 2 or not fits(1):
        return None
    good, bad = 1, n                    # keeping `good` units fits, keeping `bad` does not
    while (more := min(2 * good, bad - 1)) > good:
        if not fits(more):
            bad = more
            break
        good = more
    while bad - good > 1:
        mid = (good + bad) // 2
        if fits(mid):
            good = mid
        else:
            bad = mid
    return chat(good)
