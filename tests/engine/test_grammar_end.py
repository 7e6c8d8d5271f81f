"""A constrained answer's stop strings count only where its grammar may end (engine/grammar_end.py, issue #49
item 2), through the real ``IncrementalDetokenizer``: no model, a character tokenizer."""

from __future__ import annotations

import json

import pytest

from engine.detokenizer import IncrementalDetokenizer
from engine.serving.chat_structured import _tool_grammar
from engine.sampling_params import SamplingParams, StructuredOutputsParams
from tests.engine.entrypoints.test_serving_structured import TOOLS


class Chars:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def run(text: str, stop: list[str], spec) -> tuple[str, str | None]:
    d = IncrementalDetokenizer(Chars(), [], SamplingParams(stop=stop, structured_outputs=spec))
    out = ""
    for ch in text:
        delta, matched = d.update([ord(ch)])
        out += delta
        if matched:
            return out, matched
    return out + d.flush(), None


ANSWER = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'


@pytest.mark.parametrize("spec, text, stop, expected", [
    (StructuredOutputsParams(json={"type": "object"}), '{"a": {"b": 1}}', ["}"], ('{"a": {"b": 1}}', None)),
    (StructuredOutputsParams(json={"type": "object"}), '{"a": 1} \n', ["\n"], ('{"a": 1} ', "\n")),
    (StructuredOutputsParams(json_object=True), '{"a": "x:y"}', [":"], ('{"a": "x:y"}', None)),
    (StructuredOutputsParams(regex="[a-z]+!"), "ab!cd", ["!", "c"], ("ab!", "c")),
    (StructuredOutputsParams(choice=["yes", "no"]), "yes.", ["e", "."], ("yes", ".")),
    (StructuredOutputsParams(grammar='root ::= "a"'), "a,b", [","], ("a,b", None)),
    (StructuredOutputsParams(structural_tag=_tool_grammar(TOOLS, "required", False)), CALL + "\nx", ["}", ":", "\n"],
     (CALL, "\n")),
    (StructuredOutputsParams(structural_tag=_tool_grammar(TOOLS, "auto", True)), "Hi: " + CALL, [":"],
     ("Hi", ":")),
    (None, '{"a": {"b": 1}}', ["}"], ('{"a": {"b": 1', "}")),
    # a valid-JSON prefix the schema refuses is no end (a trial: "1" of 123, finish "length", schema_violation)
    (StructuredOutputsParams(json={"enum": [123, 456]}), "123", ["2", "5"], ("123", None)),
    (StructuredOutputsParams(json={"type": "integer", "minimum": 10, "maximum": 99}), "42 ", list("0123456789 "),
     ("42", " ")),
    (StructuredOutputsParams(json='{"type": "number", "minimum": 1.5, "maximum": 2}'), "1.75", ["."], ("1.75", None)),
    (StructuredOutputsParams(json_object=True), '{"a": 1}', ["1"], ('{"a": 1}', None)),
    # inside a second call's begin (before '", "arguments"'): not an end (a trial: the second call emptied)
    (StructuredOutputsParams(structural_tag=_tool_grammar(TOOLS, "required", True)), CALL + "\n" + CALL, [","],
     (CALL + "\n" + CALL, None)),
    (StructuredOutputsParams(structural_tag=_tool_grammar(TOOLS, "auto", True)), "ok " + CALL + "\nmore, " + CALL,
     [","], ("ok " + CALL + "\nmore", ",")),
    # tools beside a response format (tool_choice auto): the answer's JSON or whole calls may end, nothing inside
    (StructuredOutputsParams(structural_tag=_tool_grammar(TOOLS, "auto", True, ANSWER)), '{"n": 1} x', [" ", "}"],
     ('{"n": 1}', " ")),
    (StructuredOutputsParams(structural_tag=_tool_grammar(TOOLS, "auto", True, ANSWER)), CALL + "\nx", ["}", "\n"],
     (CALL, "\n")),
])
def test_a_stop_string_counts_only_where_the_grammar_may_end(spec, text, stop, expected):
    assert run(text, stop, spec) == expected


def test_the_tool_grammar_tags_are_what_the_rule_reads():
    fmt = json.loads(_tool_grammar(TOOLS, "required", True))["format"]
    assert fmt["type"] == "tags_with_separator" and all({"begin", "end"} <= set(t) for t in fmt["tags"])


@pytest.mark.parametrize("text, takes", [
    ('{"n": 1}', True), (CALL, True), (CALL + "\n" + CALL, True),
    ('{"n": "one"}', False), ('{"m": 1}', False), ("Hello", False), ('Sure: {"n": 1}', False),
    ('{"n": 1}' + CALL, False),
])
def test_tools_beside_a_response_format_admit_calls_or_one_answer_under_its_schema(text, takes):
    """tool_choice auto with a response format: whole calls, or the answer's JSON, never free text."""
    import xgrammar as xgr

    info = xgr.TokenizerInfo([chr(c) for c in range(1, 128)] + ["</s>"], stop_token_ids=[127])
    compiled = xgr.GrammarCompiler(info).compile_structural_tag(_tool_grammar(TOOLS, "auto", True, ANSWER))
    matcher = xgr.GrammarMatcher(compiled)
    assert (matcher.accept_string(text) and matcher.is_completed()) == takes
