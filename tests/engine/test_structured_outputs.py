"""Grammar-constrained decoding in the engine (engine/worker/structured_outputs.py,
the sampler's bitmask hook, the engine's matcher bookkeeping).

The bitmask and schema checks are unit tests; the rest runs the real
SmolLM2 model offline (``LLM``), where output validity is what matters.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from engine.sampling_params import SamplingParams, StructuredOutputsParams
from engine.worker.json_schema_subset import check_json_schema
from engine.worker.structured_outputs import GrammarBitmask, apply_token_bitmask
from tests.engine.grammar_helpers import allowed, manager

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 1, "maxItems": 2},
    },
    "required": ["name", "age", "hobbies"],
}
PHONE = r"\d{3}-\d{4}"
ASK = [{"role": "user", "content": "Describe a person as JSON."}]
CAPITAL = [{"role": "user", "content": 'Return a JSON object with the key "capital" for France.'}]
PLAIN = [[{"role": "user", "content": "What is the capital of France?"}],
         [{"role": "user", "content": "Name three colours."}]]


def _bits(vocab: int, allowed: list[int]) -> torch.Tensor:
    words = torch.zeros((vocab + 31) // 32, dtype=torch.int64)
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    return words.to(torch.int32).unsqueeze(0)  # bit 31 wraps to a negative int32, as xgrammar's


def test_apply_token_bitmask_touches_only_constrained_rows():
    logits = torch.randn(3, 70)
    mask = GrammarBitmask(rows=[1], bitmask=_bits(70, [2, 31, 69]))
    out = apply_token_bitmask(logits, mask)
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    finite = torch.isfinite(out[1]).nonzero().flatten().tolist()
    assert finite == [2, 31, 69]
    assert torch.equal(out[1, finite], logits[1, finite])
    assert torch.isfinite(logits).all()  # not modified in place


def test_check_json_schema_names_the_offending_part():
    bad_type = {"type": "object", "properties": {"age": {"type": "integer", "minimum": "zero"}}}
    with pytest.raises(ValueError, match=r"^schema\.properties\.age\.minimum: invalid JSON schema"):
        check_json_schema(bad_type)
    with pytest.raises(ValueError, match=r"schema\.properties\.tags: unsupported schema feature 'uniqueItems'"):
        check_json_schema({"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}})
    with pytest.raises(ValueError, match=r"schema\.anyOf\[1\]: unsupported schema feature 'not'"):
        check_json_schema({"anyOf": [{"type": "string"}, {"not": {"type": "null"}}]})
    with pytest.raises(ValueError, match="remote reference"):
        check_json_schema({"properties": {"a": {"$ref": "https://example.com/s.json"}}})
    check_json_schema(PERSON)  # a supported schema passes
    check_json_schema({"type": "object", "properties": {"enum": {"enum": [{"not": 1}]}}})  # values are not schemas


def test_a_reference_must_point_into_the_schema():
    """Found by a user trial: ``$ref: "#/$defs/nope"`` was refused by the compile without a path; and xgrammar
    compiles a reference to an ``$anchor`` as any JSON value at all (accepted, then broken)."""
    defs = {"$defs": {"a/b": {"type": "string"}, "c d": {"type": "integer"}}}
    for ref in ("#", "#/$defs/a~1b", "#/$defs/c%20d"):   # the root; RFC 6901 and percent escapes
        check_json_schema({**defs, "type": "object", "properties": {"x": {"$ref": ref}}})
    check_json_schema({"type": "object", "properties": {"$ref": {"type": "string"}}})   # a property's name
    with pytest.raises(ValueError, match=r"^schema\.properties\.x\.\$ref: invalid JSON schema: reference "
                                         r"'#/\$defs/nope' points to nothing in this schema \(no 'nope'\)"):
        check_json_schema({**defs, "properties": {"x": {"$ref": "#/$defs/nope"}}})
    with pytest.raises(ValueError, match=r"points to a list, not a schema"):
        check_json_schema({"properties": {"x": {"$ref": "#/required"}}, "required": ["x"]})
    with pytest.raises(ValueError, match=r"^schema\.\$ref: unsupported schema feature: reference '#foo'"):
        check_json_schema({"$defs": {"a": {"$anchor": "foo", "type": "string"}}, "$ref": "#foo"})


@pytest.mark.parametrize("low, high, type_", [("minimum", "maximum", "number"), ("minLength", "maxLength", "string"),
                                              ("minItems", "maxItems", "array"),
                                              ("minProperties", "maxProperties", "object")])
def test_a_lower_bound_over_its_upper_bound_is_named_by_its_path(low, high, type_):
    """Found by a user trial: ``minimum`` over ``maximum`` came back as xgrammar's "Invalid range" with no
    path (``minItems`` over ``maxItems`` in a tool's parameters likewise)."""
    with pytest.raises(ValueError, match=rf"^schema\.properties\.x\.{low}: invalid JSON schema: {low} 5 is "
                                         rf"greater than {high} 2"):
        check_json_schema({"type": "object", "properties": {"x": {"type": type_, low: 5, high: 2}}})
    room = {"array": {"items": {"type": "integer"}}, "object": {"properties": {"a": {}, "b": {}}}}.get(type_, {})
    check_json_schema({"type": "object", "properties": {"x": {"type": type_, low: 2, high: 2, **room}}})


def test_a_lark_grammar_is_refused_saying_to_write_ebnf():
    """A trial: vLLM reads Lark grammars; here ``?start: "cat" | "dog"`` got only the EBNF lexer's error."""
    so, _ = manager()
    with pytest.raises(ValueError, match=r"^grammar: .*; Lark grammars .* are not read here: write it in EBNF"):
        so.compile(StructuredOutputsParams(grammar='?start: "cat" | "dog"'))
    with pytest.raises(ValueError) as e:                        # a broken EBNF grammar is not called Lark
        so.compile(StructuredOutputsParams(grammar='root ::= "cat" |'))
    assert "Lark" not in str(e.value)


def test_a_regex_the_compile_refuses_is_named_by_its_path():
    """Found by a user trial: ``pattern: "[a-"`` came back as ``json: Regex parsing error ...``, no path (now
    refused before the compile: Python's re, which checks the answers, cannot read it either); ``a{,3}``, which
    Python reads and xgrammar does not, is named the same way by the compile."""
    so, _ = manager()
    with pytest.raises(ValueError, match=r"^schema\.properties\.s\.pattern: pattern '\[a-' is not a regex"):
        so.compile(StructuredOutputsParams(json={"type": "object", "properties": {"s": {"type": "string",
                                                                                      "pattern": "[a-"}}}))
    schema = {"type": "object", "properties": {"ok": {"type": "string", "pattern": "[0-9]+"},
                                               "s": {"type": "string", "pattern": "a{,3}"}}}
    spec = StructuredOutputsParams(json=schema, where=("response_format.json_schema.schema",))
    with pytest.raises(ValueError, match=r"^response_format\.json_schema\.schema\.properties\.s\.pattern: invalid "
                                         r"JSON schema: Regex parsing error"):
        so.compile(spec)
    with pytest.raises(ValueError, match=r"^schema\.patternProperties\.b\{,2\}: invalid JSON schema: Regex"):
        so.compile(StructuredOutputsParams(json={"type": "object", "patternProperties": {"b{,2}": {}}}))
    # the same schema from another field: one digest, its remembered refusal told with this sender's path
    again = StructuredOutputsParams(json=schema, where=("structured_outputs.json",))
    with pytest.raises(ValueError, match=r"^structured_outputs\.json\.properties\.s\.pattern: invalid JSON schema"):
        so.compile(again)


def test_structured_outputs_params_need_exactly_one_spec():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=[])
    a = StructuredOutputsParams(json={"type": "object", "required": ["a"]})
    b = StructuredOutputsParams(json={"required": ["a"], "type": "object"}, where=("x",), digest="d")
    assert a.key() == b.key() and a.kind == "json"


@pytest.mark.parametrize("field, value", [("choice", "yes"), ("choice", ["a", 1]), ("regex", 5), ("grammar", ["x"]),
                                          ("json", ["type", "object"])])
def test_structured_outputs_params_check_their_types(field, value):
    """Failure 7: ``{"choice": "yes"}`` was split into characters and answered "s"/"e"."""
    with pytest.raises(ValueError, match=f"^structured_outputs.{field}: must be"):
        StructuredOutputsParams(**{field: value})


# ------------------------------------------------ termination, at the mask (no model)
class _Row:
    def __init__(self, min_tokens=0, stop_token_ids=()):
        self.request_id, self.num_output_tokens = "r", 0
        self.sampling_params = SamplingParams(min_tokens=min_tokens, stop_token_ids=list(stop_token_ids))


def test_min_tokens_never_masks_the_end_of_a_grammar_that_must_end():
    """Failure 6 (at the mask): after "yes" the grammar allows only its end; min_tokens must not forbid it too."""
    so, tok = manager()
    row = _Row(min_tokens=10)
    so.add("r", StructuredOutputsParams(regex="yes|yes!+"), [])
    for ch in "yes":
        so.accept("r", tok.vocab.index(ch))
        row.num_output_tokens += 1
    assert allowed(so.grammar_bitmask([row]).bitmask[0], tok.vocab_size) == [tok.vocab.index("!")]  # can go on
    so.accept("r", tok.vocab.index("!"))
    row.num_output_tokens = 10
    assert tok.eos_token_id in allowed(so.grammar_bitmask([row]).bitmask[0], tok.vocab_size)
    so.add("r", StructuredOutputsParams(choice=["yes", "no"]), [])
    for ch in "no":
        so.accept("r", tok.vocab.index(ch))
    row.num_output_tokens = 2
    assert allowed(so.grammar_bitmask([row]).bitmask[0], tok.vocab_size) == [tok.eos_token_id]


def test_stop_token_ids_stop_only_where_the_grammar_may_end_and_are_content_before():
    """Failure 5 (at the mask): a stop token id stops the row only where the grammar may end; before, one the
    grammar allows is content (neither a stop, which cut the JSON, nor masked, which bent it: a user trial's
    unbounded integer could not be followed by its stop token "," and ran on in digits)."""
    so, tok = manager()
    a = tok.vocab.index("a")
    row = _Row(stop_token_ids=[a])
    so.add("r", StructuredOutputsParams(json={"type": "string", "maxLength": 4}), [a])
    assert a not in allowed(so.grammar_bitmask([row]).bitmask[0], tok.vocab_size)   # the grammar's own mask
    for ch in '"b':
        assert not so.accept("r", tok.vocab.index(ch))
    assert a in allowed(so.grammar_bitmask([row]).bitmask[0], tok.vocab_size)       # inside the string
    assert so.is_content("r", a) and not so.accept("r", a)                           # content, fed to the grammar
    so.accept("r", tok.vocab.index('"'))
    assert {a, tok.eos_token_id} <= set(allowed(so.grammar_bitmask([row]).bitmask[0], tok.vocab_size))
    assert not so.is_content("r", a)   # the grammar may end: a stop token ends the row through the scheduler
    assert not so.accept("r", a)       # and never enters the grammar
    quote = tok.vocab.index('"')
    so.add("r", StructuredOutputsParams(json={"type": "string"}), [quote])
    assert allowed(so.grammar_bitmask([row]).bitmask[0], tok.vocab_size) == [quote]  # the only way on
    assert so.is_content("r", quote) and not so.accept("r", quote)  # so it is content, not a stop


def test_stop_tokens_let_through_as_content_are_only_those_the_grammar_allows():
    """Found by a user trial: where the grammar's only ways on were stop tokens, every stop token was let
    through, one the grammar forbids too; sampled, the grammar rejected it and the JSON was cut ("stop")."""
    so, tok = manager()
    quote, a = tok.vocab.index('"'), tok.vocab.index("a")
    row = _Row(stop_token_ids=[quote, a])
    so.add("r", StructuredOutputsParams(json={"type": "string"}), [quote, a])
    assert allowed(so.grammar_bitmask([row]).bitmask[0], tok.vocab_size) == [quote]  # not a: not JSON here
    assert so.is_content("r", quote) and not so.accept("r", quote)


@pytest.fixture(scope="module")
def llm():
    from engine.llm import LLM

    return LLM(dtype="float32", kv_cache_memory="128MiB")


def _params(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=kw.pop("max_tokens", 64), **kw)  # PERSON needs at most ~50 tokens


@pytest.mark.slow
def test_constrained_rows_follow_their_grammar_and_leave_unconstrained_rows_unchanged(llm):
    plain = [_params(temperature=0, max_tokens=24), _params(temperature=0.8, seed=7, max_tokens=24)]
    alone = [o.outputs[0].token_ids for o in llm.chat(PLAIN, plain)]

    constrained = [
        _params(temperature=0, structured_outputs=StructuredOutputsParams(json=PERSON)),
        _params(temperature=0.8, seed=3, structured_outputs=StructuredOutputsParams(json=PERSON)),
        _params(temperature=0, max_tokens=20, structured_outputs=StructuredOutputsParams(regex=PHONE)),
        _params(temperature=0.9, seed=5, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])),
        _params(temperature=0.7, seed=1, n=2, max_tokens=48, structured_outputs=StructuredOutputsParams(json_object=True)),
    ]
    outs = llm.chat([PLAIN[0], ASK, ASK, PLAIN[1], ASK, ASK, CAPITAL],
                    [plain[0], *constrained[:2], plain[1], *constrained[2:]])
    assert [outs[0].outputs[0].token_ids, outs[3].outputs[0].token_ids] == alone
    for out in (outs[1], outs[2]):
        assert out.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.outputs[0].text), PERSON)
    assert re.fullmatch(PHONE, outs[4].outputs[0].text)
    assert outs[5].outputs[0].text in ("yes", "no")
    for choice in outs[6].outputs:
        assert choice.finish_reason == "stop" and isinstance(json.loads(choice.text), dict)
    assert not llm.engine.structured_outputs._matchers  # every matcher freed with its request


@pytest.mark.slow
def test_preempted_constrained_requests_resume_their_grammar():
    from engine.llm import LLM

    small = LLM(dtype="float32", kv_cache_memory="8MiB", max_num_seqs=8)  # ~11 blocks of 16 tokens
    params = [_params(temperature=0, structured_outputs=StructuredOutputsParams(json=PERSON)),
              _params(temperature=0.8, seed=11, structured_outputs=StructuredOutputsParams(json=PERSON))] * 2
    outs = small.chat([ASK] * 4, params)
    assert small.engine.get_stats().num_preemptions > 0
    for out in outs:
        jsonschema.validate(json.loads(out.outputs[0].text), PERSON)
    assert outs[0].outputs[0].token_ids == outs[2].outputs[0].token_ids  # greedy: same with or without preemption
    assert outs[1].outputs[0].token_ids == outs[3].outputs[0].token_ids  # same seed, same draws


@pytest.mark.slow
def test_invalid_schema_is_refused_before_anything_is_queued(llm):
    bad = _params(structured_outputs=StructuredOutputsParams(json={"type": "object", "properties": {"a": {"not": {}}}}))
    with pytest.raises(ValueError, match="unsupported schema feature 'not'"):
        llm.chat(ASK, bad)
    with pytest.raises(ValueError, match="regex"):
        llm.chat(ASK, _params(structured_outputs=StructuredOutputsParams(regex="((")))
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.slow
def test_stop_token_ids_cannot_cut_the_json(llm):
    """Failure 5: ``stop_token_ids`` that the model writes mid-object cut the JSON with finish_reason "stop"."""
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 12}}, "required": ["capital"]}
    spec = StructuredOutputsParams(json=schema)
    free = llm.chat(CAPITAL, _params(temperature=0, max_tokens=24, structured_outputs=spec))[0].outputs[0]
    stops = free.token_ids[1:3]  # tokens the greedy JSON writes before it is complete
    out = llm.chat(CAPITAL, _params(temperature=0, max_tokens=24, stop_token_ids=stops,
                                    structured_outputs=spec))[0].outputs[0]
    assert out.finish_reason == "stop"
    jsonschema.validate(json.loads(out.text), schema)


@pytest.mark.slow
def test_every_token_of_the_json_a_stop_token_still_cannot_cut_it(llm, caplog):
    """Found by a user trial (``stop_token_ids`` of separators such as ``",``): where the grammar could go on only
    by stop tokens, all of them were let through as content, one the grammar forbids too; greedy sampled that one,
    the grammar rejected it (an ERROR logged) and the JSON was cut with finish_reason "stop"."""
    spec = StructuredOutputsParams(json=PERSON)
    free = llm.chat(ASK, _params(temperature=0, structured_outputs=spec))[0].outputs[0]
    stops = sorted(set(free.token_ids) - {llm.tokenizer.eos_token_id})   # every token the greedy JSON writes
    with caplog.at_level("ERROR", logger="tandem.structured_outputs"):
        out = llm.chat(ASK, _params(temperature=0, stop_token_ids=stops, structured_outputs=spec))[0].outputs[0]
    assert out.finish_reason == "stop" and not caplog.records
    jsonschema.validate(json.loads(out.text), PERSON)
    assert out.text == free.text   # stop tokens before the grammar may end are its content: nothing bent


@pytest.mark.slow
def test_a_stop_token_the_json_needs_does_not_bend_it(llm):
    """Found by a user trial: with ``stop_token_ids`` [","] masked until the grammar could end, an unbounded
    integer could not be followed by "," and the model wrote digits up to max_tokens (``length``, invalid JSON)."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"},
                                               "city": {"type": "string", "maxLength": 12}},
              "required": ["name", "age", "city"]}
    spec = StructuredOutputsParams(json=schema)
    comma = llm.tokenizer.encode(",", add_special_tokens=False)
    free = llm.chat(ASK, _params(temperature=0, max_tokens=120, structured_outputs=spec))[0].outputs[0]
    out = llm.chat(ASK, _params(temperature=0, max_tokens=120, stop_token_ids=comma,
                                structured_outputs=spec))[0].outputs[0]
    assert len(comma) == 1 and out.finish_reason == "stop"
    jsonschema.validate(json.loads(out.text), schema)
    assert out.text == free.text


@pytest.mark.slow
def test_min_tokens_past_the_grammars_end_ends_cleanly(llm, caplog):
    """Failure 6: the engine emitted token 0, counted it and logged an ERROR."""
    params = _params(temperature=0, max_tokens=24, min_tokens=16,
                     structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    with caplog.at_level("ERROR", logger="tandem.structured_outputs"):
        out = llm.chat([{"role": "user", "content": "Is Paris in France?"}], params)[0].outputs[0]
    assert out.text in ("yes", "no") and out.finish_reason == "stop"
    assert 0 not in out.token_ids and out.token_ids[-1] == llm.engine.tokenizer.eos_token_id
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


def test_the_grammar_manager_built_once_ready_is_frozen_out_of_full_collections(llm):
    """Issue #34: the manager (xgrammar's modules, the tokenizer's vocabulary table) is built after the core's
    start-up freeze; left unfrozen, every full collection while serving walked its objects with the GIL held
    (50-100 ms, a stall of every running stream). Built by ``prepare_structured_outputs`` (what the core
    process runs once ready), they are in the permanent generation: no collection visits them."""
    import gc

    manager = llm.engine.core.prepare_structured_outputs()
    visited = {id(o) for o in gc.get_objects()}  # every object a full collection would walk
    assert gc.is_tracked(manager) and gc.is_tracked(manager.pool)
    assert id(manager) not in visited and id(manager.pool) not in visited and id(manager.pool.cache) not in visited
