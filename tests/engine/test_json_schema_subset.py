"""The supported JSON-schema subset (engine/worker/json_schema_subset.py): outside it a
400 naming the keyword and its path, before any compile; inside it enforced
(issue #34 failure 4). No model: random schemas of the subset are walked
through their real xgrammar grammar over a character vocabulary with random
token picks, and every finished output must validate with ``jsonschema``.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.worker.json_schema_subset import KEYWORDS, check_json_schema, markdown_table
from engine.sampling_params import StructuredOutputsParams
from tests.engine.grammar_helpers import manager, walk
from loadtests.workloads import JSON_SCHEMAS_PATH

REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "app-teams" / "structured-outputs-reference.md"


@pytest.mark.parametrize("schema, path, keyword", [
    ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 3}}, "schema", "contains"),
    ({"type": "object", "properties": {"a": {"type": "string"}}, "dependentSchemas": {"a": {"required": ["b"]}}},
     "schema", "dependentSchemas"),
    ({"type": "object", "properties": {"code": {"type": "string", "pattern": "^(?=.*[0-9])[a-z0-9]{4}$"}}},
     "schema.properties.code.pattern", "pattern"),
    ({"type": "string", "pattern": "^(?!x)[a-z]+$"}, "schema.pattern", "pattern"),
    ({"type": "string", "pattern": "^(a)\\1$"}, "schema.pattern", "pattern"),
    ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}, "schema.maxLength", "maxLength"),
    ({"type": "string", "format": "email", "minLength": 40}, "schema.minLength", "minLength"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]}, "schema.required",
     "'b'"),
    ({"type": "object", "properties": {"n": {"type": "number", "multipleOf": 0.5}}},
     "schema.properties.n.multipleOf", "multipleOf"),
    ({"type": "object", "propertyNames": {"maxLength": 3}}, "schema", "propertyNames"),
    ({"type": "string", "format": "credit-card"}, "schema.format", "format"),
    ({"type": "string", "format": "date"}, "schema.format", "format"),
    ({"type": "integer", "multipleOf": 3, "maximum": 30}, "schema.multipleOf", "maximum"),
    # the grammar ignores a fractional step on an integer: 1.5 allows only the multiples of 3
    ({"type": "integer", "multipleOf": 1.5}, "schema.multipleOf", "write multipleOf 3"),
    ({"type": "object", "nullable": True}, "schema", "nullable"),
    # a new-user trial: xgrammar's own message, no keyword or path ("Integer constraint must be a whole number",
    # "Integer exceeds maximum limit", "maxProperties is less than the number of required properties")
    ({"type": "integer", "minimum": 0.5, "maximum": 1.5}, "schema.minimum", "write minimum 1"),
    ({"type": "integer", "exclusiveMinimum": 2.5}, "schema.exclusiveMinimum", "write minimum 3"),
    ({"type": "integer", "maximum": 1.5}, "schema.maximum", "write maximum 1"),
    ({"type": ["integer", "number"], "minimum": 2.5}, "schema.minimum", "'minimum'"),
    ({"type": "integer", "maximum": 1e20}, "schema.maximum", "'maximum'"),
    ({"type": "object", "properties": {"n": {"type": "integer", "minimum": -2 ** 64}}},
     "schema.properties.n.minimum", "'minimum'"),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"],
      "maxProperties": 1}, "schema.maxProperties", "maxProperties 1 is less than the 2 required properties"),
    # found by the property test once a compile refusal had to name a keyword: xgrammar's messages, no path
    ({"type": "number", "minimum": 0, "exclusiveMaximum": 0}, "schema.minimum", "no value can match"),
    ({"type": "integer", "exclusiveMinimum": 1, "exclusiveMaximum": 2}, "schema.exclusiveMinimum", "no integer"),
    # an object without properties takes any keys: refused as unsupported, not as impossible (a trial)
    ({"type": "object", "minProperties": 1}, "schema.minProperties", "unsupported schema feature 'minProperties'"),
    ({"type": "object", "properties": {"a": {"type": "string"}}, "minProperties": 2}, "schema.minProperties",
     "no value can match"),
    ({"type": "array", "minItems": 1}, "schema.minItems", "'minItems'"),
    ({"type": "string", "pattern": "^[a-c]{1,3}$", "format": "email"}, "schema.pattern", "'format'"),
    ({"$ref": "#"}, "schema.$ref", "no schema content"),
    # a trial: written as a rounded float (1.1805916207174113e+21), then length / schema_violation
    ({"type": "object", "properties": {"a": {"const": 2 ** 70 + 1}}}, "schema.properties.a.const", "+-2^63"),
    ({"enum": [18446744073709551617, 3]}, "schema.enum", "18446744073709551617"),
    ({"const": {"n": [1, -2 ** 63 - 1]}}, "schema.const", "+-2^63"),
    # a trial: no number of 6 decimals in the range, the grammar wrote {"a": }
    ({"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 0.000001}, "schema.exclusiveMinimum",
     "at most 6 decimals"),
    ({"type": "number", "minimum": 0.0000001, "maximum": 0.0000009}, "schema.minimum", "decimals"),
])
def test_outside_the_subset_is_refused_naming_the_keyword_and_its_path(schema, path, keyword):
    """Each of these got 200 and an output that broke the schema (``contains``, ``dependentSchemas``, a lookahead
    in ``pattern``, a length beside ``pattern``/``format``, ``required`` naming an unlisted property)."""
    with pytest.raises(ValueError) as err:
        check_json_schema(schema)
    message = str(err.value)
    assert message.startswith(f"{path}:") and keyword in message, message


def test_inside_the_subset_passes_and_values_are_checked():
    check_json_schema(json.loads(JSON_SCHEMAS_PATH
                                 .read_text())["nested_company"])
    check_json_schema({"type": "array", "uniqueItems": False, "title": "t", "description": "d"})
    check_json_schema({"type": "integer", "multipleOf": 0.5})     # every integer is a multiple: harmless
    check_json_schema({"const": 2 ** 63 - 1})                       # int64: written exactly
    check_json_schema({"type": "number", "exclusiveMinimum": 0, "maximum": 0.000001})   # 0.000001 fits
    check_json_schema({"type": "number", "minimum": 0.5, "exclusiveMaximum": 0.500001})  # 0.5 fits
    with pytest.raises(ValueError, match=r"^schema\.properties\.a\.minLength: invalid JSON schema"):
        check_json_schema({"properties": {"a": {"type": "string", "minLength": -1}}})
    with pytest.raises(ValueError, match=r"^schema\.type: invalid JSON schema"):
        check_json_schema({"type": "text"})


def test_the_docs_list_the_subset_of_the_table():
    assert markdown_table() in REFERENCE.read_text()


# ------------------------------------------------------------ property test
_NAMES = ["a", "b", "id", "name"]
_PATTERNS = ["^[a-c]{1,3}$", "^[0-9]{2}-[A-Z]$", "^(ab|cd)+$", "^x?y*z$"]


def _string():
    plain = st.fixed_dictionaries({"type": st.just("string")}, optional={
        "minLength": st.integers(0, 3), "maxLength": st.integers(3, 6)})
    return st.one_of(plain, st.builds(lambda p: {"type": "string", "pattern": p}, st.sampled_from(_PATTERNS)),
                     st.builds(lambda f: {"type": "string", "format": f}, st.sampled_from(["email", "uuid", "ipv6"])))


def _number():
    integer = st.one_of(
        st.fixed_dictionaries({"type": st.just("integer")}, optional={
            "minimum": st.integers(-50, 0), "maximum": st.integers(1, 50)}),
        st.builds(lambda m: {"type": "integer", "multipleOf": m}, st.sampled_from([2, 5])))
    bounded = st.builds(lambda lo, span: {"type": "number", "minimum": lo, "maximum": lo + span},
                        st.integers(-10, 10), st.integers(1, 20))
    exclusive = st.builds(lambda lo: {"type": "integer", "exclusiveMinimum": lo, "exclusiveMaximum": lo + 4},
                          st.integers(-5, 5))
    return st.one_of(integer, bounded, exclusive)


def _leaf():
    return st.one_of(_string(), _number(), st.just({"type": "boolean"}), st.just({"type": "null"}),
                     st.builds(lambda v: {"enum": v}, st.lists(st.one_of(st.integers(0, 9), st.sampled_from(
                         ["x", "y", None])), min_size=1, max_size=3, unique_by=repr)),
                     st.builds(lambda v: {"const": v}, st.sampled_from([1, "k", True, [1, 2], {"q": 1}])))


def _object(children):
    def build(props, required_mask, closed):
        required = [n for n, keep in zip(props, required_mask) if keep]
        out = {"type": "object", "properties": props, "required": required}
        if closed:
            out["additionalProperties"] = False
        return out
    props = st.dictionaries(st.sampled_from(_NAMES), children, min_size=1, max_size=3)
    return st.builds(build, props, st.lists(st.booleans(), min_size=3, max_size=3), st.booleans())


def _array(children):
    return st.one_of(
        st.builds(lambda item, lo, extra: {"type": "array", "items": item, "minItems": lo, "maxItems": lo + extra},
                  children, st.integers(0, 2), st.integers(0, 2)),
        st.builds(lambda items: {"type": "array", "prefixItems": items, "items": False},
                  st.lists(children, min_size=1, max_size=2)))


SCHEMAS = st.recursive(_leaf(), lambda children: st.one_of(
    _object(children), _array(children),
    st.builds(lambda a, b: {"anyOf": [a, b]}, children, children)), max_leaves=6)


@pytest.fixture(scope="module")
def char_manager():
    return manager()


@settings(max_examples=60, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                                    HealthCheck.function_scoped_fixture])
@given(schema=SCHEMAS)
def test_every_output_of_a_random_schema_of_the_subset_validates(char_manager, schema):
    """Random schemas built only of the table's keywords; outputs sampled through the real grammar with random
    token picks (several per schema); each finished one must validate with ``jsonschema`` (formats included)."""
    check_json_schema(schema)
    so, tok = char_manager
    spec = StructuredOutputsParams(json=schema)
    validator = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    rng = random.Random(json.dumps(schema, sort_keys=True))
    finished = 0
    for i in range(4):
        ids, ended = walk(so, tok, spec, rng, limit=300, rid=f"w{i}")
        if not ended:
            continue
        finished += 1
        text = tok.text(ids)
        errors = [e.message for e in validator.iter_errors(json.loads(text))]
        assert not errors, (text, errors)
    assert finished or re.search(r'"type": "(string|array)"', json.dumps(schema))  # only long strings can run out


def test_the_table_names_each_keyword_once():
    names = [k.name for k in KEYWORDS]
    assert len(names) == len(set(names))


SAFE_PATTERNS = [r"^.+$", r"^\s+$", r"^[\x00-\x7f]+$", r"^[^a]+$", r'^["a]$', r"^[\x00-\x22]$", r"^[^\"\\]+$",
                 r"^\d{3}-\d{4}$", r"^[\w.+-]+@[\w-]+\.[a-z]{2,}$"]
UNSAFE_PATTERNS = {r'^\"[a-z]\"$': r'\"', r"^\\[a-z]$": r"\\", r"^\\$": r"\\", r"^a\nb$": r"\n", r"^a\x01$": r"\x01",
                   r"^[\\]$": r"\\", r"^\x22$": r"\x22", r"^\u0022$": r"\u0022", r'^a"$': '"', r"^\t$": r"\t",
                   r"^[\n]$": r"\n", r"^\cJ$": r"\cJ"}
# Each character a JSON string must write escaped, as written raw (what the grammar of an unsafe pattern allowed)
RAW = ['"', "\\", "\n", "\t", "\x01", "\x1f"]


def _accepts(pattern: str, value: str) -> bool:
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": pattern}}, "required": ["a"]}
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    return _is_grammar_accept_string(grammar, '{"a": "' + value + '"}')


@pytest.mark.parametrize("pattern", SAFE_PATTERNS)
def test_a_pattern_whose_classes_and_dots_span_json_escapes_passes_and_its_grammar_writes_none_raw(pattern):
    """xgrammar leaves quotes, backslashes and control characters out of ``.``, ``\\s``, classes and ranges:
    such a pattern passes the check, and no string with one of them written raw is accepted."""
    check_json_schema({"type": "string", "pattern": pattern})
    assert not any(_accepts(pattern, "a" + raw) or _accepts(pattern, raw) for raw in RAW)


@pytest.mark.parametrize("pattern, literal", UNSAFE_PATTERNS.items())
def test_a_pattern_naming_a_json_escaped_character_is_refused(pattern, literal):
    """A trial's ``^\\"[a-z]\\"$`` was accepted and its grammar wrote ``{"a": ""a""}`` (invalid JSON) then
    ``length``: a literal quote, backslash or control character is matched unescaped. Refused, naming it; the
    grammar does accept the raw character (what the refusal prevents)."""
    with pytest.raises(ValueError) as err:
        check_json_schema({"type": "object", "properties": {"a": {"type": "string", "pattern": pattern}}})
    assert str(err.value).startswith("schema.properties.a.pattern: unsupported schema feature 'pattern' with "
                                     f"{literal!r}"), str(err.value)
    raw = {r"\"": '"', r"\\": "\\", r"\x22": '"', r"\u0022": '"', '"': '"', r"\n": "\n", r"\t": "\t",
           r"\x01": "\x01", r"\cJ": "\n"}[literal]
    value = {r"^\\[a-z]$": raw + "b", r"^\"[a-z]\"$": raw + "b" + raw, r"^a\nb$": "a" + raw + "b",
             r"^a\x01$": "a" + raw, r'^a"$': "a" + raw}.get(pattern, raw)
    assert _accepts(pattern, value)


@pytest.mark.parametrize("pattern, named", [
    ("a\\z", "not a regex Python's re reads"), ("a\\q", "not a regex Python's re reads"),
    ("ab$c", "with '$' there"), ("a^", "with '^' there"), ("$a", "with '$' there"), ("^a$b", "with '$' there"),
    ("(a$)b", "with '$' there"), ("[a-c]$d", "with '$' there"), ("a\\Z", "with '\\\\Z' there"),
    ("a\\Ab", "with '\\\\A' there")])
def test_a_pattern_the_answer_check_reads_otherwise_is_refused(pattern, named):
    """A trial's ``a\\z`` passed, then the answer check (Python's re, through jsonschema) raised on it: a 500 per
    request, the gateway's breaker opened. Its ``ab$c`` and ``a\\Z`` passed, the grammar read them otherwise
    (dropping the anchor, taking the letter) and every answer ended ``schema_violation``. Each is a 400 now."""
    with pytest.raises(ValueError) as err:
        check_json_schema({"type": "object", "properties": {"a": {"type": "string", "pattern": pattern}}})
    assert str(err.value).startswith("schema.properties.a.pattern: ") and named in str(err.value), str(err.value)


@pytest.mark.parametrize("pattern, value", [("^a|^b", "b"), ("[$^]", "$"), ("\\$a\\^", "$a^"), ("^(a|b)$", "a"),
                                            ("[^\\]a]$", "b"), ("a$|b", "a")])
def test_anchors_where_the_grammar_and_python_agree_pass(pattern, value):
    """Anchors at the ends or beside a top-level alternation, and ^ $ as characters (in a class, escaped): passed;
    what the grammar writes, Python's re accepts too."""
    import re

    check_json_schema({"type": "string", "pattern": pattern})
    assert _accepts(pattern, value) and re.search(pattern, value)


def test_a_pydantic_discriminated_union_passes_and_its_grammar_keeps_the_branches_apart():
    """A trial's ``Annotated[Union[Cat, Dog], Field(discriminator="type")]`` (what ``chat.completions.parse``
    sends) was refused for its ``discriminator`` (OpenAPI's annotation) and its ``oneOf`` of ``$ref`` branches
    told apart only by a required property's ``const``. Both pass; the same union with one ``const`` twice is
    still refused (a value could match both branches)."""
    from typing import Annotated, Literal, Union

    from pydantic import BaseModel, Field

    class Cat(BaseModel):
        type: Literal["cat"]
        meows: int

    class Dog(BaseModel):
        type: Literal["dog"]
        barks: int

    class Pet(BaseModel):
        pet: Annotated[Union[Cat, Dog], Field(discriminator="type")]

    schema = Pet.model_json_schema()
    check_json_schema(schema)
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    assert _is_grammar_accept_string(grammar, '{"pet": {"type": "cat", "meows": 1}}')
    assert not _is_grammar_accept_string(grammar, '{"pet": {"type": "dog", "meows": 1}}')
    schema["$defs"]["Dog"]["properties"]["type"]["const"] = "cat"
    with pytest.raises(ValueError, match=r"^schema\.properties\.pet\.oneOf: unsupported schema feature 'oneOf'"):
        check_json_schema(schema)


@pytest.mark.parametrize("schema, path", [
    ({"type": "object", "properties": {"a": False}, "required": ["a"]}, "schema.properties.a"),
    ({"anyOf": [False, {"type": "integer"}]}, "schema.anyOf[0]"),
    ({"type": "array", "prefixItems": [True]}, "schema.prefixItems[0]"),
    ({"type": "array", "prefixItems": [{"type": "integer"}] * 2, "items": False, "maxItems": 1}, "schema.maxItems"),
    (False, "schema")])
def test_what_the_grammar_refuses_without_a_path_is_refused_naming_it(schema, path):
    """A trial got xgrammar's own words with no path (``json: Schema 'false' cannot accept any value``,
    ``maxItems is less than the number of prefixItems``): each is refused naming where."""
    with pytest.raises(ValueError) as err:
        check_json_schema(schema)
    assert str(err.value).startswith(path + ": "), str(err.value)


def test_an_object_without_properties_is_open_in_both_compiles_as_the_table_says():
    """The table's ``additionalProperties`` line, held to what xgrammar enforces: closed where ``properties`` is
    given, open (any key) where it is not, as a response format's schema (the engine's strict compile) and as a
    tool's parameters (a structural tag) alike (an agent trial read "absent means false" and got a forced call
    of a ``parameters: {}`` tool with arguments ``{"type": "object", "default": "red"}``)."""
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    from engine.serving.chat_structured import plan_chat
    from engine.serving.protocol import ChatCompletionRequest, parse_request

    def grammars(parameters: dict):
        body = {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required",
                "tools": [{"type": "function", "function": {"name": "f", "parameters": parameters}}]}
        tag = plan_chat(parse_request(body, ChatCompletionRequest), body["messages"], None).structured_outputs
        tools = xgr.Grammar.from_structural_tag(tag.structural_tag)
        fmt = xgr.Grammar.from_json_schema(json.dumps(parameters), any_whitespace=False, strict_mode=True)
        return (lambda args: _is_grammar_accept_string(tools, '<tool_call>\n{"name": "f", "arguments": ' + args
                                                        + "}\n</tool_call>")), \
               (lambda args: _is_grammar_accept_string(fmt, args))

    for parameters, open_ in (({"type": "object"}, True), ({"type": "object", "properties": {}}, False),
                              ({"type": "object", "properties": {"b": {"type": "integer"}}}, False)):
        for accepts in grammars(parameters):
            assert accepts("{}")
            assert accepts('{"a": 1}') is open_, parameters
    assert "absent means false where `properties` is given" in REFERENCE.read_text()
