"""The Responses <-> chat translation as pure functions: the cases the SDK tests against the gateway
(``tests/gateway/http/test_responses.py``) do not reach."""

from __future__ import annotations

import json

import pytest

from gateway.errors import ClientError
from gateway.translate.chat_events import decode_event
from gateway.translate.responses import from_chat, new_context, to_chat
from gateway.translate.responses_checks import check_body
from gateway.translate.responses_errors import responses_error
from gateway.translate.responses_events import ResponsesEvents
from gateway.translate.responses_items import input_items, to_messages
from gateway.values import ChatEvent


def _chunk(delta: dict | None = None, finish: str | None = None, usage: dict | None = None) -> ChatEvent:
    if usage is not None:
        return decode_event(json.dumps({"choices": [], "usage": usage}).encode())
    return decode_event(json.dumps({"choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish}]}).encode())


def test_items_to_messages_parallel_calls_join_one_assistant_turn_and_reasoning_is_dropped():
    items = input_items({"input": [
        {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"role": "assistant", "content": "thinking"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{\"x\": 1}"},
        {"type": "function_call_output", "call_id": "c1", "output": "1"},
        {"type": "function_call_output", "call_id": "c2", "output": "2"},
        {"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AA"}]}]}, "r")
    assert items[0]["id"] == "msg_r_0" and items[2]["content"] == [{"type": "output_text", "text": "thinking"}]
    assert to_messages(items) == [
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "thinking", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{\"x\": 1}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "1"},
        {"role": "tool", "tool_call_id": "c2", "content": "2"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA",
                                                                         "detail": "auto"}}]}]


def test_a_function_outputs_images_go_to_a_user_message_after_the_turns_tool_messages():
    """Chat's tool messages carry text only (OpenAI's API refuses image parts there): an agents trial's image in a
    ``function_call_output`` reached an OpenAI upstream inside the tool message. Its images now follow the turn's
    tool messages in a user message, as a Messages ``tool_result``'s do."""
    image = {"type": "input_image", "image_url": "data:image/png;base64,AA"}
    items = input_items({"input": [
        {"role": "user", "content": "look"},
        {"type": "function_call", "call_id": "c1", "name": "snap", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "snap", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "see"}, image]},
        {"type": "function_call_output", "call_id": "c2", "output": [image]},
        {"role": "user", "content": "and?"}]}, "r")
    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA", "detail": "auto"}}
    assert to_messages(items)[2:] == [
        {"role": "tool", "tool_call_id": "c1", "content": "see"},
        {"role": "tool", "tool_call_id": "c2", "content": ""},
        {"role": "user", "content": [part, part]},
        {"role": "user", "content": "and?"}]


def test_a_refused_image_of_a_function_output_is_named_as_the_clients_part():
    """The local engine takes text only; its refusal of the user message the translation put the image in is named
    as the ``function_call_output``'s own part (an agents trial's named ``input[1]``, another item)."""
    from gateway.translate.responses_errors import responses_error_object

    body = {"input": [{"role": "user", "content": "look"},
                      {"type": "function_call", "call_id": "c1", "name": "snap", "arguments": "{}"},
                      {"type": "function_call_output", "call_id": "c1", "output": [
                          {"type": "input_text", "text": "see"},
                          {"type": "input_image", "image_url": "data:image/png;base64,AA"}]}]}
    err = responses_error_object({"message": "messages[3].content[0]: part type 'image_url' is not supported "
                                             "(text only)", "param": "messages[3].content[0].type"}, body)
    assert (err["param"], err["message"]) == ("input[2].output[1].type", "input[2].output[1]: content part type "
                                              "'input_image' is not supported (text only)")


@pytest.mark.parametrize("body, param", [
    ({"model": "m", "input": "x", "tools": [{"type": "file_search", "vector_store_ids": []}]}, "tools[0].type"),
    ({"model": "m", "input": "x", "tool_choice": {"type": "web_search_preview"}}, "tool_choice.type"),
    ({"model": "m", "input": "x", "background": True}, "background"),
    ({"model": "m"}, "input"),
    ({"input": "x"}, "model"),
    ({"model": "m", "input": "x", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
])
def test_refusals_name_the_parameter(body, param):
    with pytest.raises(ClientError) as e:
        check_body(body)
    assert (e.value.status, e.value.param) == (400, param)


@pytest.mark.parametrize("chat_param, message, param, expected", [
    # the local engine's schema check, as it names the translated chat body
    ("response_format", "response_format.json_schema.schema.properties.tags: unsupported schema feature 'contains'",
     "text.format", "text.format.schema.properties.tags: unsupported schema feature 'contains'"),
    ("tools[1].function.parameters", "tools[1].function.parameters.properties.messages: invalid JSON schema: x",
     "tools[1].parameters", "tools[1].parameters.properties.messages: invalid JSON schema: x"),
    ("max_tokens", "Invalid 'max_tokens': integer below minimum value.", "max_output_tokens",
     "Invalid 'max_output_tokens': integer below minimum value."),
    ("messages[3].content", "Invalid value for 'messages[3].content': expected a string", "input",
     "Invalid value for 'input': expected a string"),
    # a tool_choice has no `function` level on the Responses API
    ("tool_choice", "tool_choice.function.name: 'g' is not one of the tools", "tool_choice",
     "tool_choice.name: 'g' is not one of the tools"),
])
def test_chat_errors_name_the_responses_parameter(chat_param, message, param, expected):
    e = responses_error(ClientError(400, message, param=chat_param, code="invalid_value"))
    assert (e.param, e.message, e.code) == (param, expected, "invalid_value")


def test_unknown_item_type_is_refused_naming_it():
    with pytest.raises(ClientError) as e:
        to_chat({"model": "m", "input": [{"type": "item_reference", "id": "x"}]}, [],
                input_items({"input": [{"type": "item_reference", "id": "x"}]}, "r"))
    assert e.value.param == "input[0].type"


def test_named_tool_choice_and_length_stop():
    chat = to_chat({"model": "m", "input": "x", "tools": [{"type": "function", "name": "f"}],
                    "tool_choice": {"type": "function", "name": "f"}}, [], input_items({"input": "x"}, "r"))
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    r = from_chat({"choices": [{"message": {"content": "abc"}, "finish_reason": "length"}]},
                  new_context({"model": "m"}, "r", "m"))
    assert (r["status"], r["incomplete_details"], r["usage"]) == ("incomplete", {"reason": "max_output_tokens"}, None)
    assert r["completed_at"] is None      # OpenAI's: set only when completed (a trial found it missing)


@pytest.mark.parametrize("deltas, statuses", [
    # cut in the text: the message is incomplete
    ([{"content": "Count: 1, 2"}], [("message", "incomplete")]),
    # a call finished, the next cut in its arguments: only the cut one is incomplete
    ([{"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "f", "arguments": "{}"}}]},
      {"tool_calls": [{"index": 1, "id": "c2", "function": {"name": "g", "arguments": ""}}]}],
     [("function_call", "completed"), ("function_call", "incomplete")]),
    # text, then a call cut: the text ended before the cut
    ([{"content": "Let me check."}, {"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "get_"}}]}],
     [("message", "completed"), ("function_call", "incomplete")]),
    # cut in the reasoning: it is incomplete, and no empty message is made up after it (a trial's was)
    ([{"reasoning_content": "Hmm, the"}], [("reasoning", "incomplete")]),
    # cut before anything was said (a call cut inside its name, dropped): no output at all, as OpenAI's
    ([{"role": "assistant", "content": ""}], []),
    # reasoning done, text cut
    ([{"reasoning_content": "ok"}, {"content": "Par"}], [("reasoning", "completed"), ("message", "incomplete")]),
])
def test_items_a_length_cut_ends_are_incomplete_streamed_and_not(deltas, statuses):
    # OpenAI marks the output items max_output_tokens cut as incomplete (a trial saw them all "completed")
    ctx = new_context({"model": "m"}, "r", "m")
    ev = ResponsesEvents(ctx)
    events = ev.start()
    for d in deltas:
        events += ev.feed(_chunk(d))
    events += ev.feed(_chunk(finish="length")) + ev.finish()
    streamed = events[-1]["response"]
    assert streamed["status"] == "incomplete"
    assert [(o["type"], o["status"]) for o in streamed["output"]] == statuses
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [(o["type"], o["status"]) for o in done] == statuses
    # the same reply as one chat completion
    message: dict = {"content": "".join(d.get("content", "") for d in deltas) or None}
    if reasoning := "".join(d.get("reasoning_content", "") for d in deltas):
        message["reasoning_content"] = reasoning
    calls = [c for d in deltas for c in d.get("tool_calls", ())]
    if calls:
        message["tool_calls"] = [{"id": c["id"], "type": "function", "function": {
            "name": c["function"]["name"], "arguments": c["function"].get("arguments", "")}} for c in calls]
    plain = from_chat({"choices": [{"message": message, "finish_reason": "length"}]}, ctx)
    assert [(o["type"], o["status"]) for o in plain["output"]] == statuses


def test_stream_text_then_two_calls_then_usage():
    ev = ResponsesEvents(new_context({"model": "m"}, "r", "m"))
    out = ev.start()
    for c in [_chunk({"role": "assistant", "content": ""}), _chunk({"content": "hi"}),
              _chunk({"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "f", "arguments": "{"}}]}),
              _chunk({"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]}),
              _chunk({"tool_calls": [{"index": 1, "id": "c2", "function": {"name": "g", "arguments": "{}"}}]}),
              _chunk(finish="tool_calls"),
              _chunk(usage={"prompt_tokens": 7, "completion_tokens": 4,
                            "prompt_tokens_details": {"cached_tokens": 3}})]:
        out += ev.feed(c)
    out += ev.finish()
    assert [e["type"] for e in out] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    final = out[-1]["response"]
    assert [(o["type"], o.get("call_id"), o.get("arguments")) for o in final["output"]] == [
        ("message", None, None), ("function_call", "c1", "{}"), ("function_call", "c2", "{}")]
    assert [o["output_index"] for o in out if o["type"] == "response.output_item.done"] == [0, 1, 2]
    assert final["usage"]["input_tokens_details"] == {"cached_tokens": 3} and final["usage"]["total_tokens"] == 11
    assert [e["sequence_number"] for e in out] == list(range(len(out)))


def test_stream_without_finish_fails_and_empty_answer_is_one_empty_message():
    ev = ResponsesEvents(new_context({"model": "m"}, "r", "m"))
    ev.start()
    ev.feed(_chunk({"content": "par"}))
    assert ev.finish()[-1]["response"]["status"] == "failed"
    ev = ResponsesEvents(new_context({"model": "m"}, "r", "m"))
    ev.start()
    ev.feed(_chunk(finish="stop"))
    assert ev.finish()[-1]["response"]["output"][0]["content"][0]["text"] == ""


def test_stream_text_after_a_call_is_a_second_message_with_its_own_id():
    ev = ResponsesEvents(new_context({"model": "m"}, "r", "m"))
    ev.start()
    for c in [_chunk({"content": "a"}), _chunk({"tool_calls": [{"index": 0, "id": "c1", "function": {
              "name": "f", "arguments": "{}"}}]}), _chunk({"content": "b"}), _chunk(finish="stop")]:
        ev.feed(c)
    output = ev.finish()[-1]["response"]["output"]
    assert [o["type"] for o in output] == ["message", "function_call", "message"]
    assert len({o["id"] for o in output}) == 3 and output[2]["content"][0]["text"] == "b"


@pytest.mark.parametrize("bad, param", [
    ({"role": "user"}, "input[2].content"),           # a new-user trial: param 'input', "got null"
    ({"role": "user", "content": 3}, "input[2].content"),
    ({"role": "user", "content": []}, "input[2].content"),             # answered "incomplete" (a trial)
    ({"role": "user", "content": [5]}, "input[2].content[0]"),         # said "part type 'None'"
    # a part's text not a string was a 500 (a trial), a missing one taken as empty; arguments are required
    ({"role": "user", "content": [{"type": "input_text", "text": 5}]}, "input[2].content[0].text"),
    ({"role": "user", "content": [{"type": "input_text", "text": None}]}, "input[2].content[0].text"),
    ({"role": "user", "content": [{"type": "input_text"}]}, "input[2].content[0].text"),
    ({"role": "assistant", "content": [{"type": "output_text", "text": ["a"]}]}, "input[2].content[0].text"),
    ({"type": "function_call", "call_id": "c1", "name": "f"}, "input[2].arguments"),
    ({"type": "function_call", "call_id": "c1", "arguments": "{}"}, "input[2].name"),
    ({"type": "function_call", "name": "f", "arguments": "{}"}, "input[2].call_id"),
    ({"type": "function_call", "call_id": "c1", "name": "f", "arguments": {"x": 1}}, "input[2].arguments"),
    ({"type": "function_call_output", "output": "1"}, "input[2].call_id"),
    ({"type": "function_call_output", "call_id": "c1"}, "input[2].output"),
    # an object output named only 'input' (an agents trial)
    ({"type": "function_call_output", "call_id": "c1", "output": {"sky": "sunny"}}, "input[2].output"),
])
def test_a_malformed_call_item_is_refused_naming_its_own_index(bad, param):
    """The item's own path: the chat translation's check named input[0].function.name (the chat body's
    messages[k].tool_calls[0] mapped back onto the first item) for an item at input[2] (new-user trial)."""
    body = {"model": "m", "input": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, bad]}
    with pytest.raises(ClientError) as e:
        to_chat(body, [], input_items(body, "r"))
    assert (e.value.status, e.value.param) == (400, param) and param in e.value.message


def test_the_first_call_no_output_answers_is_named():
    # a set difference named an arbitrary one of several unanswered calls
    calls = [{"type": "function_call", "call_id": c, "name": "f", "arguments": "{}"} for c in ("c3", "c1", "c2")]
    items = input_items({"input": [{"role": "user", "content": "hi"}, *calls,
                                   {"type": "function_call_output", "call_id": "c3", "output": "x"}]}, "r")
    with pytest.raises(ClientError, match="No tool output found for function call c1"):
        to_messages(items)


_SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
_F = {"type": "function", "name": "f"}


@pytest.mark.parametrize("extra, param, code", [
    # a user trial's body: chat's json_schema level inside text.format went unenforced (200, unconstrained)
    ({"text": {"format": {"type": "json_schema", "name": "x", "json_schema": _SCHEMA}}}, "text.format.json_schema",
     "unknown_parameter"),
    ({"text": {"format": {"type": "json_object", "schema": _SCHEMA}}}, "text.format.schema", "unknown_parameter"),
    ({"text": {"format": {"type": "text", "name": "x"}}}, "text.format.name", "unknown_parameter"),
    ({"text": {"fromat": {"type": "json_object"}}}, "text.fromat", "unknown_parameter"),
    ({"text": {"format": {"type": "json_schema", "schema": _SCHEMA}}}, "text.format.name",
     "missing_required_parameter"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema", "missing_required_parameter"),
    ({"text": {"format": {"name": "x"}}}, "text.format.type", "missing_required_parameter"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format.type", "invalid_value"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": _SCHEMA, "strict": "yes"}}},
     "text.format.strict", "invalid_type"),
    ({"text": {"verbosity": "loud"}}, "text.verbosity", "invalid_value"),
    ({"text": {"format": "json_object"}}, "text.format", "invalid_type"),
    # tool_choice in the Responses shape (no `function` level), named as the client wrote it
    ({"tools": [_F], "tool_choice": {"type": "function", "name": "g"}}, "tool_choice.name", "invalid_value"),
    ({"tools": [_F], "tool_choice": {"type": "function"}}, "tool_choice.name", "missing_required_parameter"),
    ({"tools": [_F], "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice.function",
     "unknown_parameter"),
    ({"tools": [_F], "tool_choice": "any"}, "tool_choice", "invalid_value"),
    ({"tools": [{**_F, "description": 5}]}, "tools[0].description", "invalid_type"),
    ({"tools": [{**_F, "parameters": "{}"}]}, "tools[0].parameters", "invalid_type"),
    ({"parallel_tool_calls": False}, "parallel_tool_calls", "invalid_value"),
])
def test_nested_objects_are_checked_as_openai_checks_them(extra, param, code):
    _assert_refused(extra, param, code)


def _assert_refused(extra: dict, param: str, code: str) -> None:
    """A Responses body with ``extra`` is OpenAI's 400 of ``code`` naming ``param``."""
    with pytest.raises(ClientError) as e:
        check_body({"model": "m", "input": "x", **extra})
    assert (e.value.status, e.value.param, e.value.code) == (400, param, code)
    assert param in e.value.message


def test_well_formed_nested_objects_pass_and_verbosity_becomes_chats():
    body = {"model": "m", "input": "x", "tools": [{**_F, "description": "d", "parameters": {}, "strict": True}],
            "tool_choice": {"type": "function", "name": "f"}, "parallel_tool_calls": False,
            "text": {"verbosity": "low", "format": {"type": "json_schema", "name": "x", "schema": _SCHEMA,
                                                    "strict": None, "description": "n"}}}
    check_body(body)
    check_body({"model": "m", "input": "x", "tool_choice": {"type": "function", "name": "f"}})   # chat's rule next
    chat = to_chat(body, [], input_items(body, "r"))
    assert chat["verbosity"] == "low" and chat["response_format"]["json_schema"]["name"] == "x"
    r = from_chat({"choices": [{"message": {"content": "{}"}, "finish_reason": "stop"}]}, new_context(body, "r", "m"))
    assert r["text"]["verbosity"] == "low"


def _stream_of(deltas: list[dict]) -> list[dict]:
    ev = ResponsesEvents(new_context({"model": "m"}, "r", "m"))
    events = ev.start()
    for d in deltas:
        events += ev.feed(_chunk(d))
    return events + ev.feed(_chunk(finish="stop")) + ev.finish()


@pytest.mark.parametrize("deltas, parts", [
    ([{"role": "assistant", "content": None, "refusal": ""}, {"refusal": "I can't"}, {"refusal": " help."}],
     [("refusal", "I can't help.")]),
    ([{"content": "Well"}, {"refusal": "no."}], [("output_text", "Well"), ("refusal", "no.")]),
])
def test_a_streamed_refusal_is_a_refusal_part_as_the_whole_answer_has(deltas, parts):
    events = _stream_of(deltas)
    added = [(e["content_index"], e["part"]["type"]) for e in events if e["type"] == "response.content_part.added"]
    assert added == [(k, kind) for k, (kind, _) in enumerate(parts)]
    refusal = [e for e in events if e["type"].startswith("response.refusal.")]
    assert [e["type"] for e in refusal[:-1]] == ["response.refusal.delta"] * (len(refusal) - 1)
    assert refusal[-1]["type"] == "response.refusal.done" and refusal[-1]["refusal"] == parts[-1][1]
    assert "".join(e["delta"] for e in refusal[:-1]) == parts[-1][1]
    done = [(e["content_index"], e["part"]) for e in events if e["type"] == "response.content_part.done"]
    assert [(k, p["type"], p.get("text", p.get("refusal"))) for k, p in done] == [
        (k, kind, text) for k, (kind, text) in enumerate(parts)]
    # the same output as the whole answer's (the chat message with content and refusal)
    text = "".join(d.get("content") or "" for d in deltas)
    whole = from_chat({"choices": [{"message": {"content": text or None, "refusal": parts[-1][1]},
                                    "finish_reason": "stop"}]}, new_context({"model": "m"}, "r", "m"))
    assert events[-1]["type"] == "response.completed"
    assert events[-1]["response"]["output"] == whole["output"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


@pytest.mark.parametrize("extra, param, code", [
    # a new user's trial got 200 for each (any string, any include, any effort or tier)
    ({"truncation": "sometimes"}, "truncation", "invalid_value"),
    ({"include": ["bogus.thing"]}, "include[0]", "invalid_value"),
    ({"include": ["message.output_text.logprobs", 3]}, "include[1]", "invalid_type"),
    ({"reasoning": {"effort": "maximum"}}, "reasoning.effort", "invalid_value"),
    ({"reasoning": {"summary": "short"}}, "reasoning.summary", "invalid_value"),
    ({"reasoning": {"budget": 3}}, "reasoning.budget", "unknown_parameter"),
    ({"service_tier": "gold"}, "service_tier", "invalid_value"),
    ({"prompt_cache_retention": "forever"}, "prompt_cache_retention", "invalid_value"),
    ({"max_tool_calls": -3}, "max_tool_calls", "integer_below_min_value"),
    ({"max_tool_calls": 0}, "max_tool_calls", "integer_below_min_value"),
    # OpenAI's floor (chat's max_tokens takes 1): a Responses trial's 1-15 were taken
    ({"max_output_tokens": 15}, "max_output_tokens", "integer_below_min_value"),
    ({"max_output_tokens": 0}, "max_output_tokens", "integer_below_min_value"),
    ({"stream": True, "stream_options": {"foo": True}}, "stream_options.foo", "unknown_parameter"),
    ({"stream": True, "stream_options": {"include_usage": True}}, "stream_options.include_usage",
     "unknown_parameter"),                                   # chat's, not the Responses API's
    ({"stream": True, "stream_options": {"include_obfuscation": 1}}, "stream_options.include_obfuscation",
     "invalid_type"),
    ({"stream_options": {"include_obfuscation": False}}, "stream_options", "invalid_value"),   # chat refuses it
])
def test_parameter_values_are_checked_as_the_sdk_types_allow(extra, param, code):
    _assert_refused(extra, param, code)


def test_max_output_tokens_below_16_is_openais_400():
    with pytest.raises(ClientError) as e:
        check_body({"model": "m", "input": "x", "max_output_tokens": 0})
    assert e.value.message == ("Invalid 'max_output_tokens': integer below minimum value. Expected a value >= 16, "
                               "but got 0 instead.")
    check_body({"model": "m", "input": "x", "max_output_tokens": 16})


def test_values_sent_are_echoed_and_valid_ones_pass():
    body = {"model": "m", "input": "x", "truncation": "disabled", "service_tier": "flex",
            "reasoning": {"effort": "low", "summary": "auto"}, "prompt_cache_key": "k", "safety_identifier": "u1",
            "prompt_cache_retention": "24h", "include": ["reasoning.encrypted_content", "file_search_call.results"],
            "max_tool_calls": 2, "stream": True, "stream_options": {"include_obfuscation": False}}
    check_body(body)
    r = from_chat({"choices": [{"message": {"content": "a"}, "finish_reason": "stop"}]}, new_context(body, "r", "m"))
    assert (r["truncation"], r["service_tier"], r["reasoning"]) == ("disabled", "flex",
                                                                    {"effort": "low", "summary": "auto"})
    assert (r["prompt_cache_key"], r["safety_identifier"], r["prompt_cache_retention"]) == ("k", "u1", "24h")
    plain = from_chat({"choices": [{"message": {"content": "a"}, "finish_reason": "stop"}]},
                      new_context({"model": "m", "input": "x"}, "r", "m"))
    assert (plain["truncation"], plain["service_tier"], plain["reasoning"]) == (
        "disabled", "default", {"effort": None, "summary": None})
    auto = new_context({"model": "m", "input": "x", "truncation": "auto", "service_tier": "auto"}, "r", "m")
    assert from_chat({"choices": [{"message": {"content": "a"}, "finish_reason": "stop"}]}, auto)["truncation"] \
        == "auto"


@pytest.mark.parametrize("item, param, code", [
    # a new user's trial got 200 for each: the unknown key was dropped, the misplaced part taken as text
    ({"role": "user", "content": "x", "foo": 1}, "input[0].foo", "unknown_parameter"),
    ({"role": "user", "content": [{"type": "input_text", "text": "x", "foo": 1}]}, "input[0].content[0].foo",
     "unknown_parameter"),
    ({"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}", "function": {}}, "input[0].function",
     "unknown_parameter"),
    ({"type": "function_call_output", "call_id": "c", "output": "1", "tool_call_id": "c"},
     "input[0].tool_call_id", "unknown_parameter"),
    ({"type": "reasoning", "id": "rs", "summary": [], "text": "x"}, "input[0].text", "unknown_parameter"),
    ({"role": "assistant", "content": [{"type": "output_text", "text": "x", "extra": 1}]},
     "input[0].content[0].extra", "unknown_parameter"),
    ({"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png", "url": "u"}]},
     "input[0].content[0].url", "unknown_parameter"),
    ({"role": "assistant", "content": [{"type": "refusal", "refusal": "no", "text": "no"}]},
     "input[0].content[0].text", "unknown_parameter"),
    ({"role": "user", "content": "x", "status": 3}, "input[0].status", "invalid_type"),
    # chat's text part, and parts of the other side of the conversation
    ({"role": "user", "content": [{"type": "text", "text": "x"}]}, "input[0].content[0].type", "invalid_value"),
    ({"role": "user", "content": [{"type": "output_text", "text": "x"}]}, "input[0].content[0].type",
     "invalid_value"),
    ({"role": "developer", "content": [{"type": "refusal", "refusal": "x"}]}, "input[0].content[0].type",
     "invalid_value"),
    ({"role": "assistant", "content": [{"type": "input_text", "text": "x"}]}, "input[0].content[0].type",
     "invalid_value"),
    ({"type": "function_call_output", "call_id": "c", "output": [{"type": "output_text", "text": "1"}]},
     "input[0].output[0].type", "invalid_value"),
])
def test_unknown_keys_and_misplaced_parts_of_items_are_refused(item, param, code):
    body = {"model": "m", "input": [item]}
    with pytest.raises(ClientError) as e:
        input_items(body, "r")
    assert (e.value.status, e.value.param, e.value.code) == (400, param, code)
    assert param in e.value.message


def test_items_with_every_key_the_sdk_gives_pass():
    items = [{"type": "message", "id": "m0", "role": "user", "status": "completed", "content": [
                {"type": "input_text", "text": "a", "prompt_cache_breakpoint": {"mode": "explicit"}},
                {"type": "input_image", "image_url": "data:image/png;base64,AA", "file_id": None, "detail": "low"}]},
             {"type": "reasoning", "id": "rs", "summary": [], "content": [], "encrypted_content": None,
              "status": "completed"},
             {"type": "message", "id": "m1", "role": "assistant", "status": "completed", "phase": "final_answer",
              "content": [{"type": "output_text", "text": "b", "annotations": [], "logprobs": []},
                          {"type": "refusal", "refusal": "c"}]},
             {"type": "function_call", "id": "fc", "call_id": "c1", "name": "f", "arguments": "{}",
              "status": "completed", "caller": {"type": "direct"}, "namespace": "default", "async": False},
             {"type": "function_call_output", "id": "fco", "call_id": "c1", "status": "completed", "name": "f",
              "caller": None, "namespace": None, "output": [{"type": "input_text", "text": "1"}]}]
    messages = to_messages(input_items({"input": items}, "r"))
    assert [m["role"] for m in messages] == ["user", "assistant", "tool"]
    assert messages[1]["content"] == "bc" and messages[2]["content"] == "1"


def test_every_key_the_openai_sdk_sends_in_an_input_item_is_taken():
    """The tables against the installed ``openai`` SDK's param types: a key it documents is never refused (an
    agent trial's history saved with ``model_dump(by_alias=True)`` was refused on ``input[1].async``, a key the
    SDK's ``ResponseFunctionToolCallParam`` gained with ``caller`` and ``namespace``)."""
    from openai.types import responses as t
    from openai.types.responses import response_input_item_param as items

    from gateway.translate.responses_items import ITEM_KEYS, PART_KEYS

    def keys(typed) -> set[str]:
        return set(typed.__required_keys__ | typed.__optional_keys__)

    for kind, typed in (("message", t.EasyInputMessageParam), ("message", items.Message),
                        ("message", t.ResponseOutputMessageParam), ("function_call", t.ResponseFunctionToolCallParam),
                        ("function_call_output", items.FunctionCallOutput),
                        ("reasoning", t.ResponseReasoningItemParam)):
        assert keys(typed) <= set(ITEM_KEYS[kind]), (kind, keys(typed) - set(ITEM_KEYS[kind]))
    for kind, typed in (("input_text", t.ResponseInputTextParam), ("input_image", t.ResponseInputImageParam),
                        ("output_text", t.ResponseOutputTextParam), ("refusal", t.ResponseOutputRefusalParam)):
        assert keys(typed) <= set(PART_KEYS[kind]), (kind, keys(typed) - set(PART_KEYS[kind]))


def test_a_follow_ups_item_is_named_by_its_own_index_not_the_conversations():
    # the stored conversation comes first in the translation: its items were counted in the index (input[2])
    history = input_items({"input": "hi"}, "a") + [
        {"type": "message", "id": "m", "status": "completed", "role": "assistant",
         "content": [{"type": "output_text", "text": "x", "annotations": [], "logprobs": []}]}]
    body = {"model": "m", "input": [{"role": "user", "content": "ok"},
                                    {"role": "user", "content": [{"type": "input_text"}]}]}
    with pytest.raises(ClientError) as e:
        to_chat(body, history, input_items(body, "b"))
    assert e.value.param == "input[1].content[0].text" and "input[1]" in e.value.message
