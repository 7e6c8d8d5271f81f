"""Structured outputs keep one promise over the whole JSON Schema 2020-12 validation vocabulary (issue #49
item 1): a schema is refused before generation with a 400 naming a keyword of the schema and its path, or
every answer the grammar lets through validates with ``jsonschema``.

Schemas are drawn from every validation keyword (supported or not), single and in pairs, with numeric edge
values (tiny and huge bounds, more than 6 decimals, fractional bounds on integers, equal and crossed bounds),
nested through the applicators. No model: each accepted schema's real xgrammar grammar is walked over a
character vocabulary (``tests.engine.grammar_helpers.walk``), once greedy (the lowest allowed token, ending
as soon as the grammar may) and seeded random walks; every finished answer must validate. A model would only
choose among the grammar's allowed tokens, so the walks cover what any model could write.

``TANDEM_SCHEMA_EXAMPLES`` raises the number of schemas for a longer run (the suite runs a fixed-seed
bounded one).
"""

from __future__ import annotations

import json
import os
import random
import re

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.sampling_params import StructuredOutputsParams
from engine.worker.grammar_compiler import GrammarRefused
from engine.worker.json_schema_subset import ANNOTATIONS, SUPPORTED, UNSUPPORTED, check_json_schema
from tests.engine.grammar_helpers import allowed, manager, walk

EXAMPLES = int(os.environ.get("TANDEM_SCHEMA_EXAMPLES", "120"))
WALKS = 8   # answers per accepted schema: one greedy, the rest seeded

# Numeric edge values: zero, signs, 6 and 7 decimals, fractions on integer bounds, float precision limits.
EDGE_NUMBERS = [0, 1, -1, 2, 3, 10, -7, 0.5, -0.25, 1.5, 1e-6, 1e-7, 2e-7, 0.1234567, 123.456, 2 ** 53, 1e16,
                1e20, -1e-6]
COUNTS = st.sampled_from([0, 1, 2, 3])
NAMES = ["a", "b", "k1", "ab"]
PATTERNS = ["^[a-c]{1,3}$", "^k[0-9]$", "^a", "[0-9]", "^(?!x)y$"]
TYPES = ["object", "array", "string", "number", "integer", "boolean", "null"]
SCALARS = st.sampled_from([0, 1, 2, -1, 1.5, "x", "a", "", True, False, None, [1], {"q": 1}])


def _keyword_values(children):
    """A strategy of values per keyword of the vocabulary (valid ones mostly, a few malformed)."""
    numbers = st.sampled_from(EDGE_NUMBERS)
    schema_map = st.dictionaries(st.sampled_from(NAMES), children, min_size=1, max_size=2)
    return {
        "type": st.one_of(st.sampled_from(TYPES), st.lists(st.sampled_from(TYPES), min_size=1, max_size=2,
                                                             unique=True)),
        "enum": st.lists(SCALARS, min_size=1, max_size=3, unique_by=repr),
        "const": SCALARS,
        "anyOf": st.lists(children, min_size=1, max_size=2),
        "oneOf": st.lists(children, min_size=1, max_size=2),
        "allOf": st.lists(children, min_size=1, max_size=2),
        "$ref": st.sampled_from(["#", "#/$defs/d"]),
        "properties": schema_map,
        "required": st.lists(st.sampled_from(NAMES), max_size=2, unique=True),
        "additionalProperties": st.one_of(st.booleans(), children),
        "patternProperties": st.dictionaries(st.sampled_from(PATTERNS), children, min_size=1, max_size=2),
        "minProperties": COUNTS, "maxProperties": COUNTS,
        "items": st.one_of(st.booleans(), children),
        "prefixItems": st.lists(children, min_size=1, max_size=2),
        "minItems": COUNTS, "maxItems": COUNTS, "minLength": COUNTS, "maxLength": COUNTS,
        "pattern": st.sampled_from(PATTERNS),
        "format": st.sampled_from(["email", "uuid", "ipv6", "date", "ipv4"]),
        "minimum": numbers, "maximum": numbers, "exclusiveMinimum": numbers, "exclusiveMaximum": numbers,
        "multipleOf": st.sampled_from([1, 2, 3, 0.5, 1e-7]),
        # refused keywords: each must be named by the 400
        "not": children, "if": children, "then": children, "else": children, "contains": children,
        "minContains": COUNTS, "maxContains": COUNTS, "uniqueItems": st.booleans(),
        "dependentRequired": st.just({"a": ["b"]}), "dependentSchemas": st.builds(lambda c: {"a": c}, children),
        "propertyNames": children, "unevaluatedItems": st.booleans(), "unevaluatedProperties": st.booleans(),
    }


VOCABULARY = sorted(set(SUPPORTED) - {"$defs", "definitions"} | set(UNSUPPORTED) - {
    "dependencies", "contentEncoding", "contentMediaType", "contentSchema", "$dynamicRef", "$recursiveRef"})


GROUPS = {   # the keywords that constrain each type, and the ones for any type
    "object": ["properties", "required", "additionalProperties", "patternProperties", "minProperties",
               "maxProperties"],
    "array": ["items", "prefixItems", "minItems", "maxItems"],
    "string": ["minLength", "maxLength", "pattern", "format"],
    "number": ["minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"],
    "any": ["enum", "const", "anyOf", "oneOf", "allOf", "$ref"],
}
GROUPS["integer"] = GROUPS["number"]
REFUSED = sorted(set(VOCABULARY) - {k for group in GROUPS.values() for k in group} - {"type"})


def _node(children):
    """One schema object: often a type, then one to three keywords: of that type's group mostly, of any
    group, or a refused one (every keyword and every pair is reachable)."""
    values = _keyword_values(children)
    assert set(values) == set(VOCABULARY), set(values) ^ set(VOCABULARY)

    @st.composite
    def build(draw):
        node = {}
        kind = draw(st.sampled_from(TYPES + ["number", "object", "string", None]))
        if kind is not None and draw(st.integers(0, 4)):
            node["type"] = kind
        pools = [GROUPS.get(kind or "any", GROUPS["any"])] * 4 + [GROUPS["any"], VOCABULARY, REFUSED]
        for _ in range(draw(st.integers(1, 3))):
            key = draw(st.sampled_from(draw(st.sampled_from(pools))))
            if key not in node:
                node[key] = draw(values[key])
        return node
    return build()


def _leaf():
    return st.one_of(st.builds(lambda t: {"type": t}, st.sampled_from(TYPES)), st.just(True), st.just({}),
                     st.builds(lambda v: {"const": v}, SCALARS),
                     st.builds(lambda lo, hi: {"type": "number", "minimum": lo, "maximum": hi},
                               st.sampled_from(EDGE_NUMBERS), st.sampled_from(EDGE_NUMBERS)))


def _with_defs(schema):
    """Every ``$ref: #/$defs/d`` resolves: the root carries one definition."""
    if isinstance(schema, dict) and "#/$defs/d" in json.dumps(schema):
        return {**schema, "$defs": {"d": {"type": "integer", "minimum": 0, "maximum": 9}}}
    return schema


SCHEMAS = st.recursive(_leaf(), _node, max_leaves=4).map(_with_defs)


def _keywords_in(schema) -> set[str]:
    found: set[str] = set()

    def visit(node):
        if isinstance(node, dict):
            found.update(node)
            for v in node.values():
                visit(v)
        elif isinstance(node, list):
            for v in node:
                visit(v)
    visit(schema)
    return found


def _assert_names_a_keyword(message: str, schema) -> None:
    """A refusal names its path (``schema...``) and a keyword the schema holds."""
    assert message.startswith("schema"), message
    named = set(re.findall(r"'([$A-Za-z]+)'", message)) | set(re.findall(r"\.([$A-Za-z]+)(?=[.:\[])", message))
    assert named & (_keywords_in(schema) - ANNOTATIONS), (message, schema)


def _greedy_walk(so, tok, spec, limit=300):
    """The deterministic walk: the lowest allowed token, the end as soon as the grammar allows it."""
    from types import SimpleNamespace

    from engine.sampling_params import SamplingParams
    sp = SamplingParams(structured_outputs=spec)
    req = SimpleNamespace(request_id="greedy", num_output_tokens=0, sampling_params=sp)
    so.add("greedy", spec, sp.stop_token_ids)
    out: list[int] = []
    try:
        for _ in range(limit):
            choices = allowed(so.grammar_bitmask([req]).bitmask[0], tok.vocab_size)
            t = tok.eos_token_id if tok.eos_token_id in choices else choices[0]
            out.append(t)
            req.num_output_tokens += 1
            if so.accept("greedy", t) or t == tok.eos_token_id:
                return out, True
        return out, False
    finally:
        so.free("greedy")


@pytest.fixture(scope="module")
def char_manager():
    return manager()


@settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                 HealthCheck.filter_too_much, HealthCheck.data_too_large])
@given(schema=SCHEMAS)
def test_a_schema_of_the_vocabulary_is_refused_naming_a_keyword_or_every_answer_validates(char_manager, schema):
    so, tok = char_manager
    try:
        check_json_schema(schema)
    except ValueError as exc:
        _assert_names_a_keyword(str(exc), schema)
        return
    spec = StructuredOutputsParams(json=schema)
    validator = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    rng = random.Random(json.dumps(schema, sort_keys=True))
    try:
        walks = [_greedy_walk(so, tok, spec)]
    except GrammarRefused as exc:   # the compile's own refusal: also a 400 before generation, naming the keyword
        assert exc.status == 400, exc
        _assert_names_a_keyword(str(exc), schema)   # (xgrammar's bare "Integer constraint must be..." does not)
        return
    walks += [walk(so, tok, spec, rng, limit=300, rid=f"w{i}") for i in range(WALKS - 1)]
    for ids, ended in walks:
        if ended:
            text = tok.text(ids)
            errors = [e.message for e in validator.iter_errors(json.loads(text))]
            assert not errors, (schema, text, errors)
