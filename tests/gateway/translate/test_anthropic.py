"""The Messages <-> chat translation as pure functions (``gateway/translate/anthropic.py``,
``anthropic_answer.py``): field mapping and refusals, stop reasons, the event order of a stream with text then a
tool call, a mid-stream failure as Anthropic's ``error`` event, and the Anthropic -> chat -> Anthropic round trip of a
``type: anthropic`` backend's events."""

from __future__ import annotations

import asyncio
import json

import pytest

from gateway.errors import ClientError
from gateway.sse import EventReader
from gateway.translate.anthropic import MessageEvents, chat_to_message, message_events, messages_to_chat
from gateway.translate.anthropic_render import anthropic_error
from gateway.translate.anthropic_answer import chat_events, message_to_chat
from gateway.translate.chat_events import ChatEncoder, decode_stream
from gateway.values import MALFORMED

USER = [{"role": "user", "content": "hi"}]


def test_request_mapping_and_refusals():
    chat = messages_to_chat({"model": "m", "max_tokens": 9, "system": "s", "messages": USER, "stream": True,
                             "cache_control": {"type": "ephemeral"}, "metadata": {"user_id": "u"},
                             "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}})
    assert chat == {"model": "m", "messages": [{"role": "system", "content": "s"}, *USER], "max_tokens": 9,
                    "stream": True, "user": "u", "stream_options": {"include_usage": True},
                    "response_format": {"type": "json_schema", "json_schema": {"name": "output", "strict": True,
                                                                               "schema": {"type": "object"}}}}
    assert "max_tokens" not in messages_to_chat({"model": "m", "messages": USER}, count_only=True)
    assert messages_to_chat({"model": "m", "max_tokens": 1, "messages": USER, "mcp_servers": [], "container": None,
                             "context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}}) == {
        "model": "m", "messages": USER, "max_tokens": 1}
    for body, param in [({"model": "m", "messages": USER}, "max_tokens"),
                        ({"model": "m", "max_tokens": 1, "messages": []}, "messages"),
                        ({"model": "m", "max_tokens": 1, "messages": USER, "frobnicate": 1}, "frobnicate"),
                        ({"model": "m", "max_tokens": 1, "messages": [{"role": "system", "content": "x"}]},
                         "messages.0.role"),
                        ({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": [
                            {"type": "document"}]}]}, "messages.0.content.0.type"),
                        ({"model": "m", "max_tokens": 1, "messages": USER,
                          "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
                        # tools run on Anthropic's side by other fields (an SDK trial's were dropped: 200s as if
                        # the tools had been offered)
                        ({"model": "m", "max_tokens": 1, "messages": USER, "mcp_servers": [
                            {"type": "url", "url": "https://mcp.example.com/sse", "name": "ex"}]}, "mcp_servers"),
                        ({"model": "m", "max_tokens": 1, "messages": USER, "container": {
                            "skills": [{"type": "anthropic", "skill_id": "pptx", "version": "latest"}]}}, "container"),
                        ({"model": "m", "max_tokens": 1, "messages": USER, "container": "container_01"}, "container"),
                        ({"model": "m", "max_tokens": 1, "messages": USER, "tool_choice": {"type": "some"}},
                         "tool_choice"),
                        # Anthropic's own ranges and required fields (the chat checks after the translation are
                        # wider, and named OpenAI's paths: the new-user trial got 200s and tool_calls paths)
                        ({"model": "m", "max_tokens": 1, "messages": USER, "temperature": 1.5}, "temperature"),
                        ({"model": "m", "max_tokens": 1, "messages": USER, "top_p": -0.1}, "top_p"),
                        ({"model": "m", "max_tokens": 1, "messages": USER, "top_k": -1}, "top_k"),
                        ({"model": "m", "max_tokens": 1, "messages": USER, "tools": [{"name": "f"}]},
                         "tools.0.input_schema"),
                        ({"model": "m", "max_tokens": 1, "messages": [*USER, {"role": "assistant", "content": [
                            {"type": "text", "text": "x"}, {"type": "tool_use", "id": "t1", "input": {}}]}]},
                         "messages.1.content.1.name"),
                        ({"model": "m", "max_tokens": 1, "messages": [*USER, {"role": "assistant", "content": [
                            {"type": "tool_use", "id": "t1", "name": "f", "input": "{}"}]}]},
                         "messages.1.content.0.input"),
                        ({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": [
                            {"type": "tool_result", "content": "ok"}]}]}, "messages.0.content.0.tool_use_id"),
                        # Anthropic's rules a new-user trial found accepted: a tool_result answers a tool_use of
                        # the message just before it; an enabled thinking budget is >= 1024 and < max_tokens
                        ({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": [
                            {"type": "tool_result", "tool_use_id": "t9", "content": "ok"}]}]},
                         "messages.0.content.0.tool_use_id"),
                        ({"model": "m", "max_tokens": 1, "messages": [
                            *USER, {"role": "assistant", "content": [
                                {"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
                            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1"}]},
                            {"role": "assistant", "content": "ok"},
                            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1"}]}]},
                         "messages.4.content.0.tool_use_id"),
                        # and each tool_use is answered in the message just after it (an app trial's was not)
                        ({"model": "m", "max_tokens": 1, "messages": [
                            *USER, {"role": "assistant", "content": [
                                {"type": "tool_use", "id": "t1", "name": "f", "input": {}},
                                {"type": "tool_use", "id": "t2", "name": "f", "input": {}}]},
                            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1"}]}]},
                         "messages.1.content"),
                        ({"model": "m", "max_tokens": 4000, "messages": USER,
                          "thinking": {"type": "enabled", "budget_tokens": 10}}, "thinking.budget_tokens"),
                        # thinking not an object, or of no known type (a new user's thinking: 5 was taken)
                        ({"model": "m", "max_tokens": 1, "messages": USER, "thinking": 5}, "thinking"),
                        ({"model": "m", "max_tokens": 1, "messages": USER, "thinking": {"type": "on"}},
                         "thinking.type"),
                        # the canary key is a string (a trial's user_id 5 was taken)
                        ({"model": "m", "max_tokens": 1, "messages": USER, "metadata": {"user_id": 5}},
                         "metadata.user_id"),
                        ({"model": "m", "max_tokens": 1, "messages": USER, "metadata": "u"}, "metadata"),
                        # Anthropic's metadata is user_id alone (a new-user trial's {"a": 1} was a 200)
                        ({"model": "m", "max_tokens": 1, "messages": USER, "metadata": {"a": 1}}, "metadata.a"),
                        ({"model": "m", "max_tokens": 2000, "messages": USER,
                          "thinking": {"type": "enabled", "budget_tokens": 2000}}, "max_tokens")]:
        with pytest.raises(ClientError) as e:
            messages_to_chat(body)
        assert e.value.status == 400 and e.value.param == param, body
    # what those rules let through: a result of the call just before, a budget in bounds (dropped: a hint)
    ok = messages_to_chat({"model": "m", "max_tokens": 3000, "thinking": {"type": "enabled", "budget_tokens": 1024},
                           "tools": [{"name": "f", "input_schema": {"type": "object"}}],
                           "messages": [*USER, {"role": "assistant", "content": [
                               {"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
                               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                                             "content": "ok"}]}]})
    assert ok["messages"][-1] == {"role": "tool", "tool_call_id": "t1", "content": "ok"} and "thinking" not in ok


def test_answer_stop_reasons_and_usage():
    chat = {"choices": [{"message": {"content": "ok"}, "finish_reason": "stop", "stop_reason": "END"}],
            "usage": {"prompt_tokens": 4, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 3}}}
    msg = chat_to_message(chat, "msg_1", "m", ["END"])
    assert (msg["stop_reason"], msg["stop_sequence"]) == ("stop_sequence", "END")
    # Anthropic's input_tokens leaves the cache reads out: 4 prompt tokens of which 3 cached
    assert msg["usage"] == {"input_tokens": 1, "output_tokens": 2, "cache_creation_input_tokens": 0,
                            "cache_read_input_tokens": 3}
    chat["usage"].pop("prompt_tokens_details")  # nothing cached: the fields are there, 0 (Anthropic sends them)
    assert chat_to_message(chat, "msg_1", "m")["usage"] == {"input_tokens": 4, "output_tokens": 2,
                                                           "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
    chat["usage"]["prompt_tokens_details"] = {"cached_tokens": 3}
    assert chat_to_message(chat, "msg_1", "m", None)["stop_reason"] == "end_turn"
    chat["choices"][0]["finish_reason"] = "length"
    assert chat_to_message(chat, "msg_1", "m")["stop_reason"] == "max_tokens"
    # tool calls make tool_use where the reply ended on its own; one cut by max_tokens inside a call stays
    # max_tokens (a trial got tool_use with the half-written name "get_": an agent would run it), as streamed
    call = {"id": "c1", "type": "function", "function": {"name": "get_", "arguments": ""}}
    chat["choices"][0]["message"] = {"content": None, "tool_calls": [call]}
    assert chat_to_message(chat, "msg_1", "m")["stop_reason"] == "max_tokens"
    for finish in ("tool_calls", "stop"):
        chat["choices"][0]["finish_reason"] = finish
        assert chat_to_message(chat, "msg_1", "m")["stop_reason"] == "tool_use"
    # a native answer read as chat and rendered back keeps its blocks, stop reason and usage
    native = {"id": "x", "model": "c", "content": [{"type": "text", "text": "a"}, {
        "type": "tool_use", "id": "t1", "name": "f", "input": {"k": 1}}], "stop_reason": "tool_use",
        "stop_sequence": None, "usage": {"input_tokens": 5, "output_tokens": 7}}
    back = chat_to_message(message_to_chat(native), "msg_2", "m")
    assert back["content"] == native["content"] and back["stop_reason"] == "tool_use"
    assert back["usage"] == {"input_tokens": 5, "output_tokens": 7, "cache_creation_input_tokens": 0,
                             "cache_read_input_tokens": 0}


def _chunk(delta: dict, finish: str | None = None) -> bytes:
    return b"data: " + json.dumps({"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}).encode() \
        + b"\n\n"


async def _aiter(items):
    for x in items:
        yield x


def _events(raw: bytes) -> list[tuple[str, dict]]:
    """(event name, data) of an Anthropic SSE byte string."""
    out = []
    for block in raw.decode().strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        out.append((lines["event"], json.loads(lines["data"])))
    return out


def test_stream_events_text_then_tool_call_then_usage():
    chunks = [_chunk({"role": "assistant", "content": ""}), _chunk({"content": "Let me check."}),
              _chunk({"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "f", "arguments": ""}}]}),
              _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"a": 1}'}}]}),
              _chunk({}, "tool_calls"),
              b'data: {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 5}}\n\n',
              b"data: [DONE]\n\n"]

    async def run():
        return b"".join([c async for c in message_events(decode_stream(_aiter(chunks)), MessageEvents("msg_1", "m", 9))])

    events = _events(asyncio.run(run()))
    assert [n for n, _ in events] == ["message_start", "ping", "content_block_start", "content_block_delta",
                                      "content_block_stop", "content_block_start", "content_block_delta",
                                      "content_block_stop", "message_delta", "message_stop"]
    assert events[0][1]["message"]["usage"] == {"input_tokens": 9, "output_tokens": 0,    # the estimate, first,
                                                 "cache_creation_input_tokens": 0,       # with every field
                                                 "cache_read_input_tokens": 0}           # Anthropic's has
    assert events[5][1]["content_block"] == {"type": "tool_use", "id": "c1", "name": "f", "input": {}}
    assert events[6][1]["delta"] == {"type": "input_json_delta", "partial_json": '{"a": 1}'}
    assert events[8][1]["delta"]["stop_reason"] == "tool_use"
    assert events[8][1]["usage"] == {"input_tokens": 3, "output_tokens": 5,             # the backend's count
                                     "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}


def test_message_start_splits_the_prompt_as_the_final_usage_does():
    """A new user's stream said ``input_tokens: 31, cache_read_input_tokens: 0`` in ``message_start`` (the gateway's
    count) and ``15`` / ``16`` in ``message_delta``; a backend's first chunk that carries usage (vLLM's
    ``continuous_usage_stats``) now makes ``message_start`` say the split the final usage says."""
    def usage(completion: int) -> dict:
        return {"prompt_tokens": 31, "completion_tokens": completion, "total_tokens": 31 + completion,
                "prompt_tokens_details": {"cached_tokens": 16}}

    def chunk(delta: dict, completion: int, finish: str | None = None) -> bytes:
        return b"data: " + json.dumps({"choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
                                       "usage": usage(completion)}).encode() + b"\n\n"

    chunks = [chunk({"role": "assistant", "content": ""}, 0), chunk({"content": "Hel"}, 1),
              chunk({"content": "lo"}, 2, "length"),
              b"data: " + json.dumps({"choices": [], "usage": usage(2)}).encode() + b"\n\n", b"data: [DONE]\n\n"]

    async def run():
        return b"".join([c async for c in message_events(decode_stream(_aiter(chunks)),
                                                         MessageEvents("msg_1", "m", 31))])

    events = dict(_events(asyncio.run(run())))
    split = {"input_tokens": 15, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 16}
    assert events["message_start"]["message"]["usage"] == {**split, "output_tokens": 0}
    assert events["message_delta"]["usage"] == {**split, "output_tokens": 2}


def test_stream_failure_becomes_an_error_event():
    chunks = [_chunk({"content": "a"}), b'data: {"error": {"message": "boom", "type": "upstream_error"}}\n\n']

    async def run():
        return b"".join([c async for c in message_events(decode_stream(_aiter(chunks)), MessageEvents("msg_1", "m", 0))])

    events = _events(asyncio.run(run()))
    assert events[-1] == ("error", {"type": "error", "error": {"type": "api_error", "message": "boom"}})
    assert "message_stop" not in [n for n, _ in events]


def test_native_events_read_as_chat_chunks():
    ev = [("message_start", {"type": "message_start", "message": {"id": "x", "model": "c",
                                                                   "usage": {"input_tokens": 4}}}),
          ("content_block_start", {"type": "content_block_start", "index": 0,
                                   "content_block": {"type": "text", "text": ""}}),
          ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                   "delta": {"type": "text_delta", "text": "hi"}}),
          ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "stop_sequence",
                                                                "stop_sequence": "END"},
                             "usage": {"output_tokens": 2}}),
          ("message_stop", {"type": "message_stop"})]
    raw = [f"event: {n}\ndata: {json.dumps(d)}\n\n".encode() for n, d in ev]

    async def run():
        return b"".join([c async for c in ChatEncoder("x", "c").stream(chat_events(_aiter(raw)))])

    reader = EventReader()
    reader.feed(asyncio.run(run()))
    datas = []
    while (item := reader.pop()) is not None:
        datas.append(item[1])
    assert datas[-1] == b"[DONE]"
    objs = [json.loads(d) for d in datas[:-1]]
    assert objs[1]["choices"][0]["delta"] == {"content": "hi"}
    assert objs[2]["choices"][0]["finish_reason"] == "stop" and objs[2]["choices"][0]["stop_reason"] == "END"
    assert objs[3]["usage"] == {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}


def test_a_malformed_native_event_is_judged_not_dropped():
    # a trial's upstream sent `data: {not json` mid-stream: the text it carried was lost and the stream ended
    # "stop" with [DONE]; an OpenAI upstream's malformed event is judged by the attempt loop (an error event)
    raw = [b'event: message_start\ndata: {"type": "message_start", "message": {"id": "x", "model": "c"}}\n\n',
           b"event: content_block_delta\ndata: {not json\n\n"]

    async def run():
        return [ev for batch in [b async for b in chat_events(_aiter(raw))] for ev in batch]

    assert asyncio.run(run())[-1] is MALFORMED


def test_a_native_error_event_is_judged_as_its_types_status():
    # a trial: an overloaded_error event before any content ended as 502 upstream_failed after four tries, where
    # the same upstream's whole 529 answer is a 503 overloaded; the event now carries the status its type is sent
    # with, and the attempt loop classifies it as it classifies that status
    from gateway.resilience.outcomes import classify_error_object

    raw = [b'event: message_start\ndata: {"type": "message_start", "message": {"id": "x", "model": "c"}}\n\n',
           b'event: error\ndata: {"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}\n\n']

    async def run():
        return [ev for batch in [b async for b in chat_events(_aiter(raw))] for ev in batch]

    err = asyncio.run(run())[-1].error
    assert err["code"] == 529 and err["type"] == "overloaded_error"
    failure = classify_error_object(err, b"", "event before content")
    assert (failure.kind, failure.status) == ("error_event", 529)


def test_error_bodies_in_anthropics_format():
    assert json.loads(anthropic_error(429, b'{"error": {"message": "slow down", "type": "rate_limit_error"}}')) == \
        {"type": "error", "error": {"type": "rate_limit_error", "message": "slow down"}}
    native = b'{"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}'
    assert anthropic_error(529, native) == native
    assert json.loads(anthropic_error(502, b"Bad Gateway"))["error"] == {"type": "api_error", "message": "Bad Gateway"}
    # a context-length 400 in Anthropic's words (a new-user trial read OpenAI's "completion" on /v1/messages),
    # read from the gateway's own 400 (gateway.resilience.outcomes.too_long_body: its wording and this reading stay
    # together) and from the local engine's (engine/serving/serving.py, vLLM's words) as the gateway passes it on
    from gateway.resilience.outcomes import too_long_body
    both = ("input length and `max_tokens` exceed context limit: 3090 + 32 > 2048, decrease input length or "
            "`max_tokens` and try again")
    alone = "prompt is too long: 3091 tokens > 2048 maximum"
    vllm = json.dumps({"error": {"message": "This model's maximum context length is 2048 tokens (max_model_len). "
                                 "However, you requested 3122 tokens (3090 in the messages, 32 in the completion). "
                                 "Please reduce the length of the messages or of max_tokens.", "type": "BadRequestError",
                                 "code": "context_length_exceeded"}}).encode()
    for openai, want in ((too_long_body(2048, 3122, 32, "messages"), both), (vllm, both),
                         (too_long_body(2048, 3092, None, "messages"), alone),
                         (too_long_body(2048, 3091, 0, "messages"), alone)):
        assert json.loads(anthropic_error(400, openai))["error"] == {"type": "invalid_request_error", "message": want}


def test_a_refusal_names_the_messages_bodys_paths():
    """A backend's refusal of the translated chat body names its fields as the Messages body the client sent, its
    indices as Anthropic writes them (``tools.1``: an agent trial saw both forms on one endpoint)."""
    body = json.loads(anthropic_error(400, json.dumps({"error": {
        "message": "tools[1].function.parameters.properties.x.minimum: 1e-07 cannot be enforced; "
                   "response_format.json_schema.schema.enum: [1, 2] is not of type string",
        "type": "invalid_request_error"}}).encode()))
    assert body == {"type": "error", "error": {"type": "invalid_request_error", "message":
                    "tools.1.input_schema.properties.x.minimum: 1e-07 cannot be enforced; "
                    "output_config.format.schema.enum: [1, 2] is not of type string"}}


def _refused(body: dict) -> ClientError:
    with pytest.raises(ClientError) as e:
        messages_to_chat({"model": "m", "max_tokens": 9, "messages": USER, **body})
    assert e.value.status == 400 and e.value.code == "invalid_request_error", body
    return e.value


def test_output_config_is_checked_as_anthropic_checks_it():
    """A user trial's schema under the wrong key, an unknown format type, a format without a schema and a misspelt
    key all got 200s, the schema unenforced: each is Anthropic's 400 naming the path."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for oc, param, message in [
            ({"format": {"type": "json_schema", "json_schema": {"schema": schema}}}, "output_config.format.schema",
             "output_config.format.schema: Field required; "
             "output_config.format.json_schema: Extra inputs are not permitted"),
            ({"format": {"type": "xml"}}, "output_config.format.type",
             "output_config.format.type: Input should be 'json_schema', got 'xml'; "
             "output_config.format.schema: Field required"),
            ({"format": {"type": "json_schema"}}, "output_config.format.schema",
             "output_config.format.schema: Field required"),
            ({"format": {"schema": schema}}, "output_config.format.type", "output_config.format.type: Field required"),
            ({"format": {"type": "json_schema", "schema": "{}"}}, "output_config.format.schema",
             "output_config.format.schema: Input should be a valid dictionary, got str"),
            ({"format": "json"}, "output_config.format",
             "output_config.format: Input should be a valid dictionary, got str"),
            ({"formt": {"type": "json_schema", "schema": schema}}, "output_config.formt",
             "output_config.formt: Extra inputs are not permitted"),
            ({"effort": "extreme"}, "output_config.effort",
             "output_config.effort: Input should be 'low', 'medium', 'high', 'xhigh' or 'max', got 'extreme'"),
            ("json", "output_config", "output_config: Input should be a valid dictionary, got str")]:
        e = _refused({"output_config": oc})
        assert (e.param, e.message) == (param, message), oc
    # what passes: a well-formed format (enforced), effort (a service hint, dropped), nulls
    chat = messages_to_chat({"model": "m", "max_tokens": 9, "messages": USER, "output_config": {
        "effort": "high", "format": {"type": "json_schema", "schema": schema}}})
    assert chat["response_format"]["json_schema"]["schema"] == schema and "effort" not in json.dumps(chat)
    for oc in ({"effort": "low"}, {"format": None, "effort": None}, None, {}):
        assert "response_format" not in messages_to_chat({"model": "m", "max_tokens": 9, "messages": USER,
                                                          "output_config": oc})


def test_a_prefill_with_structured_outputs_is_refused():
    """A prefill is continued (``continue_final_message``) and the format's grammar started over after it: the
    whole was not JSON. Anthropic documents the two as incompatible."""
    fmt = {"format": {"type": "json_schema", "schema": {"type": "object"}}}
    turns = [*USER, {"role": "assistant", "content": '{"a":'}]
    e = _refused({"messages": turns, "output_config": fmt})
    assert e.param == "output_config.format" and "prefill" in e.message and "structured outputs" in e.message
    assert messages_to_chat({"model": "m", "max_tokens": 9, "messages": turns})["continue_final_message"] is True


def test_tool_definitions_results_and_calls_are_checked():
    """An array ``input_schema`` was taken and its arguments came back as ``{"_value": [...]}``; a string
    ``is_error`` and a ``tool_use`` id used twice in one message were taken too."""
    e = _refused({"tools": [{"name": "f", "input_schema": {"type": "object"}},
                            {"name": "g", "input_schema": {"type": "array", "items": {"type": "integer"}}}]})
    assert (e.param, e.message) == ("tools.1.input_schema.type", "tools.1.input_schema.type: Input should be "
                                                                 "'object', got 'array'")
    e = _refused({"tools": [{"name": "f", "input_schema": {"properties": {}}}]})
    assert (e.param, e.message) == ("tools.0.input_schema.type", "tools.0.input_schema.type: Field required")
    use = {"type": "tool_use", "id": "t1", "name": "f", "input": {}}
    e = _refused({"messages": [*USER, {"role": "assistant", "content": [use]}, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t1", "content": "no", "is_error": "yes"}]}]})
    assert (e.param, e.message) == ("messages.2.content.0.is_error",
                                    "messages.2.content.0.is_error: Input should be a valid boolean, got 'yes'")
    e = _refused({"messages": [*USER, {"role": "assistant", "content": [use, {**use, "input": {"x": 1}}]},
                               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1"}]}]})
    assert e.param == "messages.1.content.1.id" and "`tool_use` ids must be unique" in e.message
    e = _refused({"tools": [{"name": "f", "input_schema": {"type": "object"}}], "tool_choice": {"type": "tool"}})
    assert (e.param, e.message) == ("tool_choice.name", "tool_choice.name: Field required (a string)")
    ok = messages_to_chat({"model": "m", "max_tokens": 9, "tools": [{"name": "f", "input_schema": {"type": "object"}}],
                           "messages": [*USER, {"role": "assistant", "content": [use]}, {"role": "user", "content": [
                               {"type": "tool_result", "tool_use_id": "t1", "content": "no", "is_error": True}]}]})
    assert ok["messages"][-1] == {"role": "tool", "tool_call_id": "t1", "content": "Error: no"}


def test_a_chat_refusal_names_tool_choice_as_messages_does():
    """The local engine refuses a forced tool that is not among the tools in chat's path; the client sent
    ``tool_choice.name``."""
    body = json.loads(anthropic_error(400, json.dumps({"error": {
        "message": "tool_choice.function.name: 'g' is not one of the tools", "type": "invalid_request_error",
        "param": "tool_choice"}}).encode()))
    assert body["error"]["message"] == "tool_choice.name: 'g' is not one of the tools"


def _stream_message(chunks: list[bytes]) -> dict:
    """The Message the events of chat ``chunks`` build, read as the anthropic SDK's stream helper reads them: text
    deltas joined, a ``tool_use`` block's ``partial_json`` joined and parsed by the SDK's partial JSON parser (jiter),
    the stop reason of ``message_delta`` (the helper itself, over HTTP: ``tests/gateway/http/test_messages_blocks.py``).
    """
    from jiter import from_json

    async def run():
        return b"".join([c async for c in message_events(decode_stream(_aiter(chunks)),
                                                         MessageEvents("msg_1", "m", 5))])

    message, partial = None, {}
    for name, data in _events(asyncio.run(run())):
        if name == "message_start":
            message = {k: v for k, v in data["message"].items() if k != "usage"}
        elif name == "content_block_start":
            message["content"].append(dict(data["content_block"]))
        elif name == "content_block_delta" and data["delta"]["type"] == "text_delta":
            message["content"][data["index"]]["text"] += data["delta"]["text"]
        elif name == "content_block_delta" and data["delta"]["type"] == "input_json_delta":
            partial[data["index"]] = partial.get(data["index"], "") + data["delta"]["partial_json"]
            message["content"][data["index"]]["input"] = from_json(partial[data["index"]].encode(),
                                                                   partial_mode=True)
        elif name == "message_delta":
            message.update(data["delta"])
    return message


def test_a_refusal_is_a_text_block_and_stop_reason_refusal_streamed_or_not():
    """A user trial's refusal (chat's ``message.refusal``, content null) came back as ``content: []``,
    ``end_turn``; streamed, its ``delta.refusal`` was dropped the same way."""
    whole = chat_to_message({"choices": [{"message": {"content": None, "refusal": "I can't help with that."},
                                          "finish_reason": "stop"}]}, "msg_1", "m")
    assert whole["content"] == [{"type": "text", "text": "I can't help with that."}]
    assert whole["stop_reason"] == "refusal"
    streamed = _stream_message([_chunk({"role": "assistant", "refusal": ""}), _chunk({"refusal": "I can't "}),
                                _chunk({"refusal": "help with that."}), _chunk({}, "stop"), b"data: [DONE]\n\n"])
    assert streamed == {k: v for k, v in whole.items() if k != "usage"}
    # text, then a refusal: two text blocks both ways; content_filter is a refusal too
    both = chat_to_message({"choices": [{"message": {"content": "Well.", "refusal": "No."},
                                         "finish_reason": "content_filter"}]}, "msg_1", "m")
    assert [b["text"] for b in both["content"]] == ["Well.", "No."] and both["stop_reason"] == "refusal"
    streamed = _stream_message([_chunk({"content": "Well."}), _chunk({"refusal": "No."}),
                                _chunk({}, "content_filter"), b"data: [DONE]\n\n"])
    assert [b["text"] for b in streamed["content"]] == ["Well.", "No."] and streamed["stop_reason"] == "refusal"


ARGUMENTS = ('{"city": "Paris", "n": [1, 2.5, -3e+2, {"x": null, "y": true}], "s": "a\\"b\\u00e9c", "f": false, '
             '"o": {"k": [[], {}]}, "z": 0}')


def test_tool_arguments_cut_or_malformed_invent_no_key_and_stream_as_they_answer():
    """Arguments cut by ``max_tokens`` (every prefix of ``ARGUMENTS``) or malformed were ``{"_raw_arguments":
    ...}`` whole (a key the gateway made up, which a client could pass to its tool) and something else streamed
    (the SDK's partial parse, or its ValueError). Now both are the arguments' longest prefix that can begin a JSON
    object, read as the SDK reads a partial block, whole or streamed in pieces."""
    from jiter import from_json

    def chat(arguments: str) -> dict:
        call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
        return {"choices": [{"message": {"content": None, "tool_calls": [call]}, "finish_reason": "length"}]}

    def streamed(arguments: str, size: int) -> dict:
        pieces = [arguments[k:k + size] for k in range(0, len(arguments), size)]
        calls = [{"index": 0, "id": "c1", "function": {"name": "f", "arguments": ""}}]
        return _stream_message([_chunk({"tool_calls": calls})] + [
            _chunk({"tool_calls": [{"index": 0, "function": {"arguments": p}}]}) for p in pieces] + [
            _chunk({}, "length"), b"data: [DONE]\n\n"])["content"][0]["input"]

    for k in range(len(ARGUMENTS) + 1):
        prefix = ARGUMENTS[:k]
        whole = chat_to_message(chat(prefix), "msg_1", "m")
        assert whole["stop_reason"] == "max_tokens"
        expected = from_json(prefix.encode(), partial_mode=True) if prefix else {}
        assert whole["content"][0]["input"] == expected, prefix
        assert streamed(prefix, 7) == expected, prefix
    for bad, expected in [('{"a": 1,, "b": 2}', {"a": 1}), ('{"a": 1}}', {"a": 1}), ('[1, 2, 3]', {}),
                          ('{"a": trux}', {}), ('{"a": 12x}', {"a": 12}), ("not json", {}),
                          ('{"a": {"b": [1, 2}', {"a": {"b": [1, 2]}})]:
        assert chat_to_message(chat(bad), "msg_1", "m")["content"][0]["input"] == expected, bad
        assert streamed(bad, 3) == expected == streamed(bad, 1), bad


def test_disable_parallel_tool_use_without_tools_asks_chat_for_nothing_it_would_refuse():
    """Chat refuses ``parallel_tool_calls`` without ``tools`` (OpenAI's rule); a Messages ``tool_choice`` of type
    none with ``disable_parallel_tool_use`` and no tools is no reason to send it."""
    none = messages_to_chat({"model": "m", "max_tokens": 9, "messages": USER,
                             "tool_choice": {"type": "none", "disable_parallel_tool_use": True}})
    assert "parallel_tool_calls" not in none
    tools = [{"name": "f", "input_schema": {"type": "object"}}]
    one = messages_to_chat({"model": "m", "max_tokens": 9, "messages": USER, "tools": tools,
                            "tool_choice": {"type": "auto", "disable_parallel_tool_use": True}})
    assert one["parallel_tool_calls"] is False


def test_an_empty_stop_sequence_is_named_as_the_messages_body_names_it():
    """A new user's ``stop_sequences: [""]`` was refused naming chat's ``stop``."""
    with pytest.raises(ClientError) as e:
        messages_to_chat({"model": "m", "max_tokens": 9, "messages": USER, "stop_sequences": ["ok", ""]})
    assert e.value.param == "stop_sequences.1" and e.value.message.startswith("stop_sequences.1: must be a non-empty")
    assert messages_to_chat({"model": "m", "max_tokens": 9, "messages": USER, "stop_sequences": ["ok"]})["stop"] \
        == ["ok"]


@pytest.mark.parametrize("messages, param", [
    ([{"role": "user", "content": []}], "messages.0.content"),            # a new user's 500 (IndexError)
    ([{"role": "user", "content": ""}], "messages.0.content"),
    ([{"role": "user", "content": [{"type": "text", "text": ""}]}], "messages.0.content.0.text"),
    # a missing or non-string text blamed the block's type (a trial)
    ([{"role": "user", "content": [{"type": "text"}]}], "messages.0.content.0.text"),
    ([{"role": "user", "content": [{"type": "text", "text": 5}]}], "messages.0.content.0.text"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": []}, {"role": "user", "content": "x"}],
     "messages.1.content"),
])
def test_empty_content_is_refused_as_anthropic_refuses_it(messages, param):
    """Every turn has content and every text block text, but a final assistant turn (a prefill to continue)."""
    for count_only in (False, True):
        with pytest.raises(ClientError) as e:
            messages_to_chat({"model": "m", "max_tokens": 9, "messages": messages}, count_only=count_only)
        assert e.value.status == 400 and e.value.param == param, (messages, e.value.message)
    prefill = messages_to_chat({"model": "m", "max_tokens": 9, "messages": USER + [{"role": "assistant",
                                                                                     "content": ""}]})
    assert prefill["messages"][-1] == {"role": "assistant", "content": ""} and prefill["continue_final_message"]


def test_a_whole_answers_tool_arguments_keep_their_characters():
    """An agents trial's non-streamed call gave ``{"city":"\\u6771\\u4eac"}``, its streamed twin ``東京``."""
    chat = message_to_chat({"id": "msg_1", "model": "c", "stop_reason": "tool_use", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"city": "東京 🌸"}}]})
    assert chat["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] == '{"city":"東京 🌸"}'
