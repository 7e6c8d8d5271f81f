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
