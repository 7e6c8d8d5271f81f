"""The Responses API's ``truncation: "auto"`` as a pure function (``fit_conversation``): which items it drops to
fit a budget. The pipeline's side (the window, the local engine's count) is tested against a real engine in
``tests/gateway/http/test_responses_truncation.py``."""

from __future__ import annotations

import json

import pytest

from gateway.errors import ClientError
from gateway.translate.responses import to_chat
from gateway.translate.responses_items import input_items
from gateway.translate.responses_truncation import fit_conversation, history_within

BODY = {"model": "m", "instructions": "be brief", "input": [
    {"role": "user", "content": "A" * 100},
    {"role": "developer", "content": "answer in French"},
    {"role": "assistant", "content": "B" * 100},
    {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
    {"role": "user", "content": "C" * 100},     # between a call and its output (chat keeps the pair anyway)
    {"type": "function_call_output", "call_id": "c1", "output": "D" * 100},
    {"role": "assistant", "content": "E" * 100},
    {"role": "user", "content": "last?"}]}
ITEMS = input_items(BODY, "r")


def size(chat: dict) -> int:
    """A stand-in for a tokenizer's count: the messages' JSON length (grows with every item)."""
    return len(json.dumps(chat["messages"]))


def kept(*indices: int) -> dict:
    return to_chat(BODY, [], [ITEMS[i] for i in indices])


def test_the_whole_conversation_that_fits_is_left_as_it_is():
    assert fit_conversation(BODY, ITEMS, size(kept(*range(8))), size) is None


def test_the_fewest_oldest_items_are_dropped_never_instructions_or_developer_messages():
    # dropping the first user message is enough: only it goes
    assert fit_conversation(BODY, ITEMS, size(kept(*range(1, 8))), size) == kept(*range(1, 8))
    # one token less: the assistant's message goes too; the developer message stays, instructions first
    chat = fit_conversation(BODY, ITEMS, size(kept(*range(1, 8))) - 1, size)
    assert chat == kept(1, 3, 4, 5, 6, 7)
    assert [m["role"] for m in chat["messages"][:2]] == ["system", "developer"]


def test_a_function_call_goes_with_its_output():
    # the call is the next oldest unit: its output, three items later, goes with it (chat refuses either alone)
    chat = fit_conversation(BODY, ITEMS, size(kept(1, 3, 4, 5, 6, 7)) - 1, size)
    assert chat == kept(1, 4, 6, 7)
    assert not any(m["role"] == "tool" or m.get("tool_calls") for m in chat["messages"])


def test_the_last_item_is_never_dropped_and_what_cannot_fit_goes_as_it_is():
    assert fit_conversation(BODY, ITEMS, size(kept(1, 7)), size) == kept(1, 7)
    assert fit_conversation(BODY, ITEMS, size(kept(1, 7)) - 1, size) is None
    assert fit_conversation(BODY, ITEMS, 10, lambda chat: None) is None      # nothing counts it


def test_the_search_counts_a_logarithmic_number_of_times():
    body = {"model": "m", "input": [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i:03}"}
                                    for i in range(256)]}
    items = input_items(body, "r")
    counted = []

    def count(chat: dict) -> int:
        counted.append(1)
        return size(chat)

    budget = size(to_chat(body, [], items[200:]))
    assert fit_conversation(body, items, budget, count) == to_chat(body, [], items[200:])
    assert len(counted) <= 1 + 2 * 6 + 1      # the whole; 56 units kept: 1, 2, .. 64, then bisection in 32..64


def test_a_count_the_caller_made_of_the_whole_conversation_is_not_made_again():
    """The pipeline passes routing's rendering count of the whole body (``whole``): the whole conversation is then
    never rendered again, and the answer is the one counting it would give."""
    counted = []

    def counting(chat: dict) -> int:
        counted.append(len(chat["messages"]))
        return size(chat)

    budget = size(kept(*range(1, 8))) - 1
    assert fit_conversation(BODY, ITEMS, budget, counting, whole=size(kept(*range(8)))) == \
        fit_conversation(BODY, ITEMS, budget, size)
    assert len(kept(*range(8))["messages"]) not in counted


def test_the_tries_render_about_what_is_kept_never_the_dropped_history():
    """A long stored history, a budget that keeps its last 10 turns: each try renders at most twice what is kept
    (1, 2, 4, 8, 16 turns, then bisection between 8 and 16), never the 4,086 turns dropped."""
    body = {"model": "m", "input": [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i:04}"}
                                    for i in range(4096)]}
    items = input_items(body, "r")
    rendered = []

    def count(chat: dict) -> int:
        rendered.append(len(chat["messages"]))
        return size(chat)

    budget = size(to_chat(body, [], items[-10:]))
    assert fit_conversation(body, items, budget, count, whole=size(to_chat(body, [], items))) == \
        to_chat(body, [], items[-10:])
    assert max(rendered) <= 2 * 10 and len(rendered) <= 2 * 4 + 1


def _turn(i: int, text: str = "x" * 100) -> list[dict]:
    return [{"id": f"u{i}", "type": "message", "role": "user", "content": text},
            {"id": f"a{i}", "type": "message", "role": "assistant", "content": text}]


def _bytes(items: list[dict]) -> int:
    return sum(len(json.dumps(i, separators=(",", ":"))) + 1 for i in items)


def test_a_stored_conversation_within_the_body_limit_is_continued_whole():
    history, items = [i for t in range(10) for i in _turn(t)], _turn(10)
    limit = _bytes(history + items)
    assert history_within(history, items, limit, auto=False) is history
    assert history_within([], items, 1, auto=False) == []      # a body alone: the front's limit held it


def test_past_the_body_limit_auto_drops_the_oldest_turns_and_disabled_is_a_400():
    history = [{"id": "s", "type": "message", "role": "system", "content": "be brief"},
               *[i for t in range(10) for i in _turn(t)]]
    items = _turn(10)
    limit = _bytes(history + items) - _bytes(_turn(0)) - 1     # two items and a byte too many: three items go
    kept = history_within(history, items, limit, auto=True)
    assert kept == [history[0], _turn(1)[1], *[i for t in range(2, 10) for i in _turn(t)]]   # the system stays
    assert _bytes(kept + items) <= limit
    with pytest.raises(ClientError) as e:
        history_within(history, items, limit, auto=False)
    assert (e.value.status, e.value.code, e.value.param) == (400, "context_length_exceeded", "input")
    assert "truncation" in e.value.message and "server.max_body_size" in e.value.message


def test_a_call_answered_in_this_turn_is_never_dropped_for_size():
    call = {"id": "fc", "type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    history = [*_turn(0, "y" * 1000), call]
    items = [{"id": "fco", "type": "function_call_output", "call_id": "c1", "output": "ok"}]
    assert history_within(history, items, _bytes([call, *items]), auto=True) == [call]
    with pytest.raises(ClientError):      # the call cannot go without its answer: no drop brings it within
        history_within(history, items, _bytes([call, *items]) - 1, auto=True)
