"""``ToolCallOrder``: a chat stream's tool-call deltas, interleaved by index or not, as calls opened, streamed and
closed one after another."""

from __future__ import annotations

from gateway.translate.tool_calls import ToolCallOrder
from gateway.values import ToolCallDelta


def piece(index: int, arguments: str, name: str | None = None) -> ToolCallDelta:
    if name:
        return ToolCallDelta(index, f"call_{index}", "function", name, arguments)
    return ToolCallDelta(index, arguments=arguments)


def run(deltas: list[ToolCallDelta]) -> list[tuple]:
    order = ToolCallOrder()
    actions = [a for d in deltas for a in order.feed(d)] + order.flush()
    return [(kind, call.k, *rest) for kind, call, *rest in actions]


def test_calls_one_after_another_stream_live():
    assert run([piece(0, "", "f"), piece(0, '{"a": 1}'), piece(1, "", "g"), piece(1, "{}")]) == [
        ("open", 0), ("args", 0, '{"a": 1}'), ("close", 0), ("open", 1), ("args", 1, "{}"), ("close", 1)]


def test_interleaved_pieces_wait_for_the_live_call():
    assert run([piece(0, "", "f"), piece(1, "", "g"), piece(0, '{"a"'), piece(1, '{"b"'), piece(0, ": 1}"),
                piece(1, ": 2}")]) == [
        ("open", 0), ("args", 0, '{"a"'), ("args", 0, ": 1}"), ("close", 0), ("open", 1), ("args", 1, '{"b"'),
        ("args", 1, ": 2}"), ("close", 1)]


def test_a_call_never_whole_is_closed_by_the_flush_and_the_waiting_ones_follow():
    assert run([piece(0, '{"a"', "f"), piece(1, "{}", "g"), piece(2, "{}", "h")]) == [
        ("open", 0), ("args", 0, '{"a"'), ("close", 0), ("open", 1), ("args", 1, "{}"), ("close", 1),
        ("open", 2), ("args", 2, "{}"), ("close", 2)]


def names(deltas: list[ToolCallDelta]) -> list[tuple]:
    """The (k, id, name) of each call as it opens, with the number of deltas fed before."""
    order, out = ToolCallOrder(), []
    for i, d in enumerate(deltas):
        out += [(i, call.k, call.id, call.name) for kind, call, *_ in order.feed(d) if kind == "open"]
    return out + [(len(deltas), call.k, call.id, call.name) for kind, call, *_ in order.flush() if kind == "open"]


def test_a_name_streamed_in_pieces_opens_whole_once_its_arguments_start():
    deltas = [ToolCallDelta(0, "call_a", "function", "get_", ""), ToolCallDelta(0, None, None, "weather", ""),
              ToolCallDelta(0, None, None, None, '{"city": '), ToolCallDelta(0, None, None, None, '"Paris"}')]
    assert names(deltas) == [(2, 0, "call_a", "get_weather")]
    assert run(deltas) == [("open", 0), ("args", 0, '{"city": '), ("args", 0, '"Paris"}'), ("close", 0)]


def test_a_name_is_whole_when_a_later_call_appears_or_the_calls_end():
    deltas = [ToolCallDelta(0, "call_a", "function", "f", ""), ToolCallDelta(1, "call_b", "function", "g", "")]
    assert names(deltas) == [(1, 0, "call_a", "f"), (2, 1, "call_b", "g")]


def test_calls_sharing_an_index_but_not_an_id_are_two_calls():
    deltas = [ToolCallDelta(0, "call_a", "function", "f", '{"city": "Paris"}'),
              ToolCallDelta(0, "call_b", "function", "f", '{"city": "Tokyo"}'),
              ToolCallDelta(0, "call_c", "function", "g", '{"tz": '), ToolCallDelta(0, None, None, None, '"UTC"}')]
    assert names(deltas) == [(0, 0, "call_a", "f"), (1, 1, "call_b", "f"), (2, 2, "call_c", "g")]
    assert run(deltas) == [("open", 0), ("args", 0, '{"city": "Paris"}'), ("close", 0), ("open", 1),
                           ("args", 1, '{"city": "Tokyo"}'), ("close", 1), ("open", 2), ("args", 2, '{"tz": '),
                           ("args", 2, '"UTC"}'), ("close", 2)]


def test_calls_without_an_index_are_told_apart_by_their_ids():
    deltas = [ToolCallDelta(repr(None), "call_a", "function", "f", "{}"),
              ToolCallDelta(repr(None), "call_b", "function", "g", "{}")]
    assert names(deltas) == [(0, 0, "call_a", "f"), (1, 1, "call_b", "g")]


def test_a_closed_calls_late_piece_is_dropped():
    deltas = [piece(0, "{}", "f"), piece(1, "{}", "g"), ToolCallDelta(0, None, None, None, " ")]
    assert run(deltas) == [("open", 0), ("args", 0, "{}"), ("close", 0), ("open", 1), ("args", 1, "{}"),
                           ("close", 1)]
