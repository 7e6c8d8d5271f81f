"""Request schemas and serving helpers that need no model (fast)."""

from __future__ import annotations

import asyncio
import gc
import json
import re

import msgspec
import pytest

from engine.serving.chat_structured import plan_chat
from engine.serving.protocol import ChatCompletionRequest, CompletionRequest, RequestValidationError, parse_request
from engine.outputs import CompletionOutput, Logprob
from engine.serving.chat import cut_after_final_message, normalize_messages
from engine.serving.logprobs import _byte_decoder
from engine.protocol.errors import ServingError
from engine.serving.serving import merge_choice, merge_streams


def test_chat_request_defaults_and_vllm_extras():
    req = parse_request({"messages": [{"role": "user", "content": "hi"}], "top_k": 5, "ignore_eos": True,
                         "stream_options": {"include_usage": True}, "unknown_field": 1}, ChatCompletionRequest)
    assert req.max_tokens is None and req.n == 1 and req.logprobs is False and req.top_k == 5
    assert req.ignore_eos and req.stream_options.include_usage and req.add_generation_prompt


def test_completion_request_defaults():
    req = parse_request({"prompt": "hi"}, CompletionRequest)
    assert req.max_tokens == 16 and req.echo is False and req.logprobs is None and req.add_special_tokens


def test_json_null_means_not_given():
    """OpenAI: a null field takes its default (``"max_tokens": null`` on /v1/completions is 16, as vLLM 0.32
    reads it); the gateway drops a client's nulls before the engine sees them (OpenAI's reading)."""
    req = parse_request({"prompt": [1, 2, 3], "max_tokens": None, "n": None, "stream": None, "echo": None,
                         "temperature": None}, CompletionRequest)
    assert req.max_tokens == 16 and req.n == 1 and req.stream is False and req.echo is False
    assert parse_request({"prompt": [1, 2, 3]}, CompletionRequest).max_tokens == 16
    chat = parse_request({"messages": [{"role": "user", "content": "hi"}], "max_tokens": None, "logprobs": None,
                          "n": None}, ChatCompletionRequest)
    assert chat.max_tokens is None and chat.logprobs is False and chat.n == 1


@pytest.mark.parametrize("body,param", [
    ({"messages": [], "temperature": "hot"}, "temperature"),
    ({"messages": [], "max_tokens": 1.5}, "max_tokens"),
    ({"messages": [], "stop": [1]}, "stop"),
    ({"messages": [], "stream_options": {"include_usage": "yes"}}, "stream_options"),
    ({"messages": "hi"}, "messages"),
    ({"temperature": 1}, "messages"),
    ({"messages": [], "logprobs": 3}, "logprobs"),
])
def test_type_errors_name_the_field(body, param):
    with pytest.raises(RequestValidationError) as exc:
        parse_request(body, ChatCompletionRequest)
    assert exc.value.param == param
    missing = param not in body          # OpenAI's words and code for a missing field
    assert str(exc.value).startswith(f"Missing required parameter: '{param}'" if missing else (
        param, f"Invalid type for '{param}"))
    assert exc.value.code == ("missing_required_parameter" if missing else "invalid_type"), exc.value.code


def test_a_wrong_type_is_worded_as_openai_words_it():
    """A new user's ``"response_format": "json_object"`` got msgspec's own wording (``Expected `object | null`,
    got `str` - at `$.response_format```) and ``code: null``."""
    with pytest.raises(RequestValidationError) as exc:
        parse_request({"messages": [], "response_format": "json_object"}, ChatCompletionRequest)
    assert str(exc.value) == "Invalid type for 'response_format': expected an object, but got a string instead."
    assert (exc.value.param, exc.value.code) == ("response_format", "invalid_type")
    with pytest.raises(RequestValidationError) as exc:
        parse_request({"messages": [], "stop": [1]}, ChatCompletionRequest)
    assert str(exc.value) == "Invalid type for 'stop[0]': expected a string, but got an integer instead."


def test_body_must_be_an_object():
    with pytest.raises(RequestValidationError) as exc:
        parse_request([1, 2], CompletionRequest)
    assert exc.value.param is None


def test_serving_error_is_openai_shaped():
    err = ServingError(404, "no such model", param="model", code="model_not_found")
    assert err.to_dict() == {"error": {"message": "no such model", "type": "invalid_request_error",
                                       "param": "model", "code": "model_not_found"}}


def test_messages_are_normalized_for_templates():
    msgs = normalize_messages([
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "f", "arguments": "{}"}}]},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't."}]},   # OpenAI's refusal part
    ])
    assert [(m["role"], m["content"]) for m in msgs] == [("system", "be brief"), ("user", "a\nb"), ("assistant", ""),
                                                         ("assistant", "I can't.")]
    for i, bad in ((0, [{"role": "user", "content": None}]), (1, [{"role": "user", "content": "q"}, {"role": "assistant"}])):
        with pytest.raises(ServingError) as exc:   # as OpenAI: content is required but on tool-calling assistant turns
            normalize_messages(bad)
        assert exc.value.status_code == 400 and exc.value.param == f"messages[{i}].content"
    for bad, param in (([], "messages"), ([{"content": "x"}], "messages[0].role"),
                       ([{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content[0].type"),
                       ([{"role": "user", "content": 3}], "messages[0].content"),
                       ([{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}],  # assistants' only
                        "messages[0].content[0].type"),
                       ([{"role": "user", "content": "x", "name": 5}], "messages[0].name")):
        with pytest.raises(ServingError) as exc:
            normalize_messages(bad)
        assert exc.value.status_code == 400 and exc.value.param == param


def test_continue_final_message_cuts_after_its_content():
    text = "<s>user: hi</s><s>assistant: Once upon</s>\n"
    assert cut_after_final_message(text, [{"role": "assistant", "content": "Once upon"}]) == \
        "<s>user: hi</s><s>assistant: Once upon"


def test_merge_choice_accumulates_deltas():
    lp = [{7: Logprob(-0.5, 1)}, {8: Logprob(-1.0, 2)}, {9: Logprob(-2.0, 1)}]
    deltas = [CompletionOutput(0, "a", [7], lp[:1], num_generated_tokens=1),
              CompletionOutput(0, "bc", [8, 9], lp[1:], num_generated_tokens=3),
              CompletionOutput(0, "", [], None, finish_reason="stop", stop_reason="x", num_generated_tokens=3)]
    ch = CompletionOutput(0)
    for d in deltas:
        merge_choice(ch, d)
    assert (ch.text, ch.token_ids, ch.logprobs) == ("abc", [7, 8, 9], lp)
    assert (ch.finish_reason, ch.stop_reason, ch.num_generated_tokens) == ("stop", "x", 3)
    assert deltas[0].logprobs == lp[:1] and deltas[0].token_ids == [7]  # the deltas are not mutated
    plain = CompletionOutput(0)
    merge_choice(plain, CompletionOutput(0, "a", [7], num_generated_tokens=1))
    assert plain.logprobs is None


def test_byte_decoder_covers_every_byte_once():
    dec = _byte_decoder()
    assert sorted(dec.values()) == list(range(256))
    assert dec["Ġ"] == ord(" ") and dec["Ċ"] == ord("\n") and dec["A"] == ord("A")


async def test_merge_interleaves_and_closes_every_stream():
    closed = []

    async def stream(name, n, delay):
        try:
            for i in range(n):
                await asyncio.sleep(delay)
                yield f"{name}{i}"
        finally:
            closed.append(name)

    items = [item async for item in merge_streams([stream("a", 3, 0.001), stream("b", 2, 0.002)])]
    assert sorted(items) == [(0, "a0"), (0, "a1"), (0, "a2"), (1, "b0"), (1, "b1")]
    assert sorted(closed) == ["a", "b"]
    closed.clear()
    merged = merge_streams([stream("a", 100, 0.001), stream("b", 100, 0.001)])
    async for _ in merged:
        break
    await merged.aclose()  # the consumer went away: both streams are closed
    assert sorted(closed) == ["a", "b"]


def test_serve_args_use_vllm_flag_names():
    import argparse

    from engine.config import default_model_path, engine_args_from_cli
    from engine.entrypoints.server import add_serve_args

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    args = parser.parse_args(["--model", default_model_path(), "--port", "8123", "--host", "0.0.0.0",
                              "--max-num-batched-tokens", "512", "--no-enable-prefix-caching",
                              "--no-enable-chunked-prefill", "--kv-cache-memory", "256MiB", "--max-num-seqs", "4",
                              "--served-model-name", "smol", "--scheduling-policy", "priority"])
    assert (args.port, args.host) == (8123, "0.0.0.0")
    ea = engine_args_from_cli(args)
    assert ea.max_num_batched_tokens == 512 and not ea.enable_prefix_caching and not ea.enable_chunked_prefill
    assert ea.kv_cache_memory == 256 * 2**20 and ea.max_num_seqs == 4 and ea.served_model_name == ["smol"]
    assert ea.scheduling_policy == "priority"


@pytest.mark.parametrize("field,value,code", [
    ("seed", 2 ** 70, "integer_above_max_value"), ("seed", -(2 ** 63) - 1, "integer_below_min_value"),
    ("n", 129, "integer_above_max_value"), ("top_k", -2, "integer_below_min_value"),
    ("temperature", 2 ** 64, "decimal_above_max_value"), ("temperature", 2.0001, "decimal_above_max_value"),
    ("stop_token_ids", [3, 2 ** 64], "integer_above_max_value"),
    ("stop", ["a"] * 257, "array_above_max_length"),   # a security trial sent 100,000: 85 ms a token
    ("cache_salt", "", "string_below_min_length"),      # vLLM refuses it; the gateway passed it on (a trial)
])
def test_values_out_of_range_name_the_field_as_the_gateway_does(field, value, code):
    """``tandem engine serve`` and the gateway read one table (engine/protocol/param_ranges.py): the same
    value gets the same 400 from both."""
    from gateway.errors import ClientError
    from gateway.request.validate import check_request
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], field: value}
    with pytest.raises(RequestValidationError) as exc:
        parse_request(body, ChatCompletionRequest)
    assert exc.value.param.split("[")[0] == field and exc.value.code == code
    with pytest.raises(ClientError) as gw:
        check_request(body, "chat/completions", None)
    assert (gw.value.param, gw.value.code, gw.value.message) == (exc.value.param, code, str(exc.value))
    assert parse_request({**body, field: {"stop_token_ids": [1], "stop": ["a"] * 256, "cache_salt": "s"}.get(field, 1)},
                         ChatCompletionRequest)


@pytest.mark.parametrize("field,value", [("temperature", "hot"), ("n", 1.5), ("stop", 5), ("seed", True),
                                         ("logit_bias", [1]), ("ignore_eos", "yes"), ("cache_salt", 3)])
def test_a_wrong_type_gets_the_same_words_from_the_gateway_and_the_engine(field, value):
    """A trial: the gateway said "'temperature' must be number, got str" where the engine's server says OpenAI's
    "Invalid type for 'temperature': expected a number, but got a string instead."; one wording now."""
    from gateway.errors import ClientError
    from gateway.request.validate import check_request
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], field: value}
    with pytest.raises(RequestValidationError) as exc:
        parse_request(body, ChatCompletionRequest)
    with pytest.raises(ClientError) as gw:
        check_request(body, "chat/completions", None)
    assert (gw.value.param, gw.value.code, gw.value.message) == (exc.value.param, "invalid_type", str(exc.value))
    assert str(exc.value).startswith(f"Invalid type for '{field}': expected ")


# ------------------------------------------------------- schemas kept raw (issue #34)
def _plan(raw: bytes):
    """The structured-output plan of a chat body as ``tandem engine serve`` reads it (``decode_body``)."""
    from engine.serving.protocol import decode_body

    return _plan_body(decode_body(raw))


def _plan_body(body: dict):
    return plan_chat(parse_request(body, ChatCompletionRequest), body["messages"], None)


def test_a_schema_crosses_the_serving_process_as_its_compact_text():
    """``decode_body`` keeps ``response_format.json_schema.schema`` and ``structured_outputs.json`` unparsed:
    the spec holds the schema's compact JSON text (key order as sent), the same for any whitespace."""
    schema = {"type": "object", "properties": {"b": {"enum": ["x", "é"]}, "a": {"type": "integer"}}}
    for dump in (json.dumps(schema), json.dumps(schema, indent=3, ensure_ascii=False)):
        raw = ('{"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema", '
               f'"json_schema": {{"name": "s", "schema": {dump}}}}}}}').encode()
        spec = _plan(raw).structured_outputs
        assert isinstance(spec.json, str) and json.loads(spec.json) == schema and " " not in spec.json
        assert list(json.loads(spec.json)["properties"]) == ["b", "a"]
        extra = _plan(('{"messages": [{"role": "user", "content": "hi"}], "structured_outputs": '
                       f'{{"json": {dump}}}}}').encode()).structured_outputs
        assert extra.json == spec.json and extra.where == ("structured_outputs.json",)
    assert _plan(b'{"messages": [], "response_format": {"type": "json_schema", "json_schema": '
                 b'{"name": "s", "schema": true}}}').structured_outputs.json is True
    for no_schema in (b'', b', "schema": null'):   # absent or null, as OpenAI takes it: any JSON object
        assert _plan(b'{"messages": [], "response_format": {"type": "json_schema", "json_schema": {"name": "s"'
                     + no_schema + b'}}}').structured_outputs.json == {"type": "object"}


@pytest.mark.parametrize("fmt, message", [
    (b'{"type": "json_schema", "json_schema": {"name": "s", "schema": {}, "strict": "yes"}}',
     "response_format.json_schema.strict: must be a boolean, got str"),
    (b'{"type": "json_schema", "json_schema": {"name": "s", "schema": {}}, "foo": 1}',
     "response_format.foo: unknown parameter for type 'json_schema'"),
    (b'{"type": "json_object", "schema": {"type": "object"}}',   # another API's way: would go unenforced
     "response_format.schema: unknown parameter for type 'json_object'"),
    (b'{"type": "json_schema", "json_schema": {"name": "s", "schemas": {}}}',
     "response_format.json_schema.schemas: unknown parameter"),
])
def test_response_format_refuses_what_openai_refuses(fmt, message):
    """Found by a user trial: these were answered 200, the unknown key or the bad ``strict`` ignored."""
    with pytest.raises(RequestValidationError, match=re.escape(message)):
        _plan(b'{"messages": [], "response_format": ' + fmt + b'}')


@pytest.mark.parametrize("extra, message", [
    (b'{"bogus": 1}', "structured_outputs.bogus: unknown parameter"),
    (b'{"choice": []}', "structured_outputs.choice: must be a non-empty list of strings, got an empty list"),
    (b'{"choice": [1, 2]}', "structured_outputs.choice: must be a non-empty list of strings, got an item of type int"),
])
def test_structured_outputs_field_names_what_is_wrong(extra, message):
    """Found by a user trial: an unknown key was "exactly one of json, ... is supported" without naming it, and
    a list was "got tuple" (the list as the engine keeps it)."""
    with pytest.raises(RequestValidationError, match=re.escape(message)):
        _plan(b'{"messages": [], "structured_outputs": ' + extra + b'}')


@pytest.mark.parametrize("raw, message", [
    (b'{"messages": [], "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": [1]}}}',
     "response_format.json_schema.schema: must be a JSON schema (an object), got list"),
    (b'{"messages": [], "structured_outputs": {"json": "{}"}}',
     "structured_outputs.json: must be a JSON schema (an object), got str"),
])
def test_a_raw_schema_that_is_not_one_is_refused_as_a_decoded_one_was(raw, message):
    with pytest.raises(RequestValidationError, match=message.replace("(", r"\(").replace(")", r"\)")) as e:
        _plan(raw)
    assert e.value.code == "invalid_type"     # a trial's answer had code null


@pytest.mark.parametrize("extra, code", [(b'"x"', "invalid_type"), (b'{"bogus": 1}', "unknown_parameter"),
                                         (b'{"choice": "ab"}', "invalid_type"),
                                         (b'{"regex": "a", "choice": ["b"]}', "invalid_value")])
def test_structured_outputs_refusals_carry_a_code(extra, code):
    with pytest.raises(RequestValidationError) as e:
        _plan(b'{"messages": [], "structured_outputs": ' + extra + b'}')
    assert (e.value.param, e.value.code) == ("structured_outputs", code)


def test_decode_body_decodes_everything_but_the_schemas():
    """Other fields, and a schema's containers that are not objects (the caller refuses them), decode as
    ``msgspec.json.decode`` does; a null schema is "not given"; a body that is not an object decodes whole."""
    from engine.serving.protocol import decode_body

    raw = (b'{"model": "m", "n": null, "response_format": {"type": "json_schema", "json_schema": '
           b'{"name": "s", "schema": {"type": "object"}, "strict": true}}, "structured_outputs": {"json": null, '
           b'"regex": "a+"}, "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}')
    body = decode_body(raw)
    schema = body["response_format"]["json_schema"].pop("schema")
    assert isinstance(schema, msgspec.Raw) and bytes(schema) == b'{"type": "object"}'
    plain = msgspec.json.decode(raw)
    del plain["response_format"]["json_schema"]["schema"]
    assert body == plain
    assert decode_body(b'{"response_format": "text", "structured_outputs": [1]}') == {
        "response_format": "text", "structured_outputs": [1]}
    assert decode_body(b"[1, 2]") == [1, 2]
    with pytest.raises(msgspec.DecodeError):
        decode_body(b'{"response_format": {"json_schema": {"schema": {"a": }}}}')
    with pytest.raises(RecursionError):
        decode_body(b'{"structured_outputs": {"json": ' + b'{"a": ' * 3000 + b'1' + b'}' * 3001 + b'}')


def test_a_large_schema_makes_no_python_object_per_node_on_the_way_to_the_core():
    """Issue #34: the serving process decoded a 400 KB schema into ~8,600 containers (their decode and the
    garbage collections they set off held its event loop 10-60 ms), then encoded it again for the core.
    From the HTTP body (``request_state.json_body``) to the bytes of the core's ``CompileGrammar``, the schema now
    stays one text. Counted, not timed: the garbage collector's count of tracked objects alive (collections
    off), which grows by one per container made."""
    from engine.core.core_messages import CompileGrammar, encode, params_to_wire
    from engine.entrypoints.request_state import json_body
    from loadtests.bench.structured_isolation import big_schema, schema_body

    schema = big_schema(400)
    raw = schema_body("m", schema)

    class Request:
        async def body(self) -> bytes:
            return raw

    gc.collect()
    gc.disable()
    try:
        before = gc.get_count()[0]
        coro = json_body(Request())
        try:
            coro.send(None)
        except StopIteration as done:
            body = done.value
        spec = _plan_body(body).structured_outputs
        wire = encode(CompileGrammar(0, params_to_wire(spec)))
        made = gc.get_count()[0] - before
    finally:
        gc.enable()
    assert made < 100, made   # the old path: 8,692
    assert json.loads(msgspec.msgpack.decode(wire)[2]["json"]) == schema


@pytest.mark.parametrize("function, message", [
    ({"name": "f", "parameters": {}, "foo": 1}, "tools[0].function.foo: unknown parameter"),
    ({"name": "f", "parameters": {}, "strict": "yes"}, "tools[0].function.strict: must be a boolean, got str"),
])
def test_a_tools_function_refuses_what_openai_refuses(function, message):
    """Found by a user trial: an unknown key and a string ``strict`` were answered 200, ignored."""
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}],
                       "tools": [{"type": "function", "function": function}]}).encode()
    with pytest.raises(RequestValidationError, match=re.escape(message)):
        _plan(body)
    ok = {"name": "f", "description": "d", "parameters": {"type": "object"}, "strict": True}
    _plan(json.dumps({"messages": [{"role": "user", "content": "hi"}],
                      "tools": [{"type": "function", "function": ok}]}).encode())


@pytest.mark.parametrize("extra, message", [
    ({"tools": [{"type": "function", "function": {"name": "f"}, "parameters": {"type": "object"}}]},
     "tools[0].parameters: unknown parameter"),
    ({"tools": [{"type": "function", "function": {"name": "f"}, "name": "f"}]}, "tools[0].name: unknown parameter"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "f", "x": 1}}}, "tool_choice.function.x: unknown"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "f"}, "x": 1}}, "tool_choice.x: unknown parameter"),
])
def test_a_tool_or_tool_choice_with_a_key_openai_does_not_take_is_refused(extra, message):
    """A RAG developer's trial: a function's ``parameters`` put one level too high (beside ``function``) was
    answered 200 with the schema ignored (arguments ``{}``); Responses refused the same mistake. OpenAI's code for
    a key it does not take, as at the top level (a new user's trial read ``invalid_value`` here): the engine's and
    the gateway's edge say it alike."""
    from gateway.errors import ClientError
    from gateway.request.validate import check_request

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}
    with pytest.raises(RequestValidationError, match=re.escape(message)) as e:
        _plan(json.dumps(body).encode())
    assert e.value.code == "unknown_parameter"
    with pytest.raises(ClientError, match=re.escape(message)) as gw:
        check_request(body, "chat/completions", None, frozenset({"tools"}))
    assert (gw.value.status, gw.value.code, gw.value.param) == (400, "unknown_parameter", message.split(":")[0])
