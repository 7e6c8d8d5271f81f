"""The Responses API's ``truncation: "auto"`` as a pure function (``fit_conversation``): which items it drops to
fit a budget. The pipeline's side (the window, the local engine's count) is tested against a real engine in
``tests/gateway/http/test_responses_truncation.py``."""

from __future__ import annotations

import json

from gateway.translate.responses import to_chat
from gateway.translate.responses_items import input_items
from gateway.translate.responses_truncation import fit_conversation

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
    assert len(counted) <= 2 + 8


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
