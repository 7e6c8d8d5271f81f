"""The second line of structured outputs (engine/serving/answer_check.py), without a model: an answer
about to end with ``stop``/``tool_calls`` that breaks its schema ends with ``length`` and
``schema_violation``, is counted, and is logged with its schema's digest (never its text)."""

from __future__ import annotations

import logging

from engine.serving.answer_check import AnswerCheck, checked_finish
from engine.sampling_params import StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0}}, "required": ["n"]}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": SCHEMA}}]


class Engine:
    def __init__(self):
        self.structured_output_invalid = 0

    def count_invalid_structured_output(self):
        self.structured_output_invalid += 1


def call(arguments: str, name: str = "f") -> dict:
    return {"id": "c", "type": "function", "function": {"name": name, "arguments": arguments}}


def test_a_response_format_answer_is_checked(caplog):
    engine, check = Engine(), AnswerCheck.of(StructuredOutputsParams(json=SCHEMA), None, False)
    assert checked_finish(engine, check, "stop", None, '{"n": 3}') == ("stop", None)
    assert checked_finish(engine, check, "length", None, '{"n": ') == ("length", None)   # already not a promise
    with caplog.at_level(logging.WARNING, "engine.serving.answer_check"):
        assert checked_finish(engine, check, "stop", "}", '{"n": -1}') == ("length", "schema_violation")
        assert checked_finish(engine, check, "stop", None, '{"n": 1') == ("length", "schema_violation")
    assert engine.structured_output_invalid == 2
    assert all(check.digest in r.getMessage() and '{"n"' not in r.getMessage() for r in caplog.records)
    obj = AnswerCheck.of(StructuredOutputsParams(json_object=True), None, False)
    assert checked_finish(engine, obj, "stop", None, "[1]") == ("length", "schema_violation")
    assert AnswerCheck.of(StructuredOutputsParams(regex="a+"), None, False) is None
    assert AnswerCheck.of(None, None, False) is None


def test_tool_call_arguments_are_checked_against_their_tool():
    engine, check = Engine(), AnswerCheck.of(None, TOOLS, True)
    assert checked_finish(engine, check, "tool_calls", None, "", [call('{"n": 1}')]) == ("tool_calls", None)
    assert checked_finish(engine, check, "stop", None, "plain text", []) == ("stop", None)
    for bad in ([call('{"n": "x"}')], [call('{"n": 1}'), call('{ "n": 2 ')], [call('{"n": 1}', name="g")]):
        assert checked_finish(engine, check, "tool_calls", None, "", bad) == ("length", "schema_violation")
    assert engine.structured_output_invalid == 3


def test_a_check_that_cannot_finish_ends_the_answer_not_the_request():
    """A trial's answer nested ~300 levels (a recursive schema) made jsonschema raise RecursionError, and a
    pattern Python's re cannot read (``\\z``) raised re.error: each a 500 (the gateway's breaker opened). Such an
    answer is not vouched for: ``length`` and ``schema_violation``, the request answered."""
    engine = Engine()
    nested = {"type": "array", "items": {"$ref": "#"}, "maxItems": 1}
    deep = AnswerCheck.of(StructuredOutputsParams(json=nested), None, False)
    assert checked_finish(engine, deep, "stop", None, "[" * 400 + "]" * 400) == ("length", "schema_violation")
    assert checked_finish(engine, deep, "stop", None, "[" * 5000 + "]" * 5000) == ("length", "schema_violation")
    assert checked_finish(engine, deep, "stop", None, "[[[]]]") == ("stop", None)
    unread = {"type": "string", "pattern": "a\\z"}       # refused at validation; here as if it slipped through
    bad = AnswerCheck.of(StructuredOutputsParams(json=unread), None, False)
    assert checked_finish(engine, bad, "stop", None, '"az"') == ("length", "schema_violation")
    assert engine.structured_output_invalid == 3
