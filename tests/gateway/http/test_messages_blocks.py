"""``/v1/messages`` content blocks (issue 48, items 4, 5 and 7) with the official ``anthropic`` SDK as the client,
against a real gateway on 127.0.0.1: over a scripted chat upstream (``tests/gateway/script_upstream.py``),
parallel tool calls whose argument pieces interleave by ``index`` come as blocks one after another, the
backend's reasoning as a ``thinking`` block, a ``tool_result``'s image reaches the backend, ``count_tokens``
counts tools and images, a refusal and a cut or malformed tool call give the same Message streamed or not, a
malformed ``output_config`` or tool definition is refused before the backend; over a fake Anthropic upstream
(``tests/gateway/anthropic_upstream.py``) the client's ``anthropic-beta`` header is forwarded.
"""

from __future__ import annotations

import json

import anthropic
import pytest

from gateway.config.compile import load_config_text
from gateway.http.app import create_app
from gateway.request.validate import IMAGE_TOKENS_ESTIMATE
from gateway.runtime import Gateway
from tests.gateway.anthropic_upstream import AnthropicUpstream
from tests.gateway.http.test_responses_items import INTERLEAVED, call, chunk, stream
from tests.gateway.script_upstream import ScriptUpstream, upstream  # noqa: F401 (the fixture)
from tests.gateway.support import serve_app, sha

KEY = "sk-tandem-blocks-0123456789abcdef"
TOOLS = [{"name": n, "input_schema": {"type": "object"}} for n in ("get_weather", "get_time")]
IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}


def config(base_url: str, kind: str = "openai") -> str:
    key = "    api_key_env: TEST_ANTHROPIC_KEY\n" if kind == "anthropic" else ""
    return (f"reload: {{watch: false}}\nauth:\n  keys:\n    - {{tenant: t1, sha256: {sha(KEY)}}}\n"
            "resilience:\n  retry: {max_attempts: 1}\n  health: {interval_s: 0}\n"
            "observability:\n  logs: {requests: false}\nmodels:\n  - name: m1\n"
            f"backends:\n  up:\n    type: {kind}\n    base_url: {base_url}\n{key}"
            "routes:\n  r1:\n    targets: [{backend: up}]\npolicy:\n  default_route: r1\n")


class served:
    """A gateway on ``cfg``: ``async with served(cfg) as client`` (an ``AsyncAnthropic`` for it)."""

    def __init__(self, cfg: str):
        self.gw = Gateway(None, load_config_text(cfg), start_engine=False)

    async def __aenter__(self) -> anthropic.AsyncAnthropic:
        self.server, self.task, url = await serve_app(create_app(self.gw))
        self.client = anthropic.AsyncAnthropic(base_url=url, api_key=KEY, max_retries=0, timeout=20)
        return self.client

    async def __aexit__(self, *exc) -> None:
        await self.client.close()
        self.server.should_exit = True
        await self.task


ASK = {"model": "m1", "max_tokens": 50, "messages": [{"role": "user", "content": "weather and time?"}]}


async def test_interleaved_parallel_calls_are_blocks_one_after_another(upstream):
    upstream.push(stream(*INTERLEAVED))
    async with served(config(upstream.base_url)) as client:
        async with client.messages.stream(**ASK, tools=TOOLS) as s:
            events = [e async for e in s]
            final = await s.get_final_message()
    assert [(b.name, b.input) for b in final.content] == [("get_weather", {"city": "Paris"}),
                                                          ("get_time", {"tz": "CET"})]
    raw = [e for e in events if e.type.startswith("content_block_")]
    opened: list[int] = []
    for e in raw:                     # Anthropic's order: a block starts, gets its deltas, stops; then the next
        if e.type == "content_block_start":
            assert not opened, e
            opened.append(e.index)
        elif e.type == "content_block_delta":
            assert opened == [e.index], e
        else:
            assert opened.pop() == e.index
    assert [e.index for e in raw if e.type == "content_block_start"] == [0, 1]


async def test_reasoning_becomes_a_thinking_block_streamed_and_whole(upstream):
    upstream.push(stream(chunk({"role": "assistant", "reasoning_content": "Let me"}),
                         chunk({"reasoning_content": " think."}), chunk({"content": "Hello"}), chunk({}, "stop")))
    whole = {"id": "up-1", "object": "chat.completion", "created": 0, "model": "up-model",
             "usage": {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14},
             "choices": [{"index": 0, "finish_reason": "stop", "message": {
                 "role": "assistant", "content": "Hello", "reasoning_content": "Let me think."}}]}
    upstream.push({"body": json.dumps(whole).encode()})
    async with served(config(upstream.base_url)) as client:
        async with client.messages.stream(**ASK) as s:
            streamed = await s.get_final_message()
        plain = await client.messages.create(**ASK)
    for msg in (streamed, plain):
        thinking, text = msg.content
        assert (thinking.type, thinking.thinking, text.type, text.text) == ("thinking", "Let me think.", "text",
                                                                            "Hello")


async def test_image_in_a_tool_result_reaches_the_backend_and_counts(upstream):
    turns = [{"role": "user", "content": "what does the camera see?"},
             {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                "input": {}}]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                           "content": [{"type": "text", "text": "snapshot"}, IMAGE]},
                                          {"type": "text", "text": "describe it"}]}]
    async with served(config(upstream.base_url)) as client:
        msg = await client.messages.create(model="m1", max_tokens=20, messages=turns, tools=TOOLS)
        sent = upstream.bodies[-1]["messages"]
        plain = (await client.messages.count_tokens(model="m1", messages=turns[:1])).input_tokens
        with_tools = (await client.messages.count_tokens(model="m1", messages=turns[:1], tools=TOOLS)).input_tokens
        with_image = (await client.messages.count_tokens(
            model="m1", messages=[{"role": "user", "content": [IMAGE, {"type": "text", "text": "x"}]}])).input_tokens
    assert msg.content[0].text == "ok"
    assert sent[2] == {"role": "tool", "tool_call_id": "toolu_1", "content": "snapshot"}
    assert sent[3] == {"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "text", "text": "describe it"}]}
    assert with_tools >= plain + len(json.dumps(TOOLS)) // 4 - 2    # the tool definitions are counted
    assert with_image >= IMAGE_TOKENS_ESTIMATE


async def test_tool_definitions_are_reserved_against_tpm(upstream):
    tools = [{"name": f"tool_{i}", "description": "d" * 400, "input_schema": {"type": "object"}} for i in range(30)]
    cfg = config(upstream.base_url).replace(f"sha256: {sha(KEY)}", f"sha256: {sha(KEY)}, tpm: 2000")
    async with served(cfg) as client:
        await client.messages.create(**ASK)                          # small: admitted
        try:
            await client.messages.create(**ASK, tools=tools)         # ~3,500 tokens of tools: over the minute's 2,000
        except anthropic.RateLimitError:
            refused = True
        else:
            refused = False
    assert refused


async def test_anthropic_beta_header_is_forwarded(monkeypatch):
    monkeypatch.setenv("TEST_ANTHROPIC_KEY", "sk-ant-upstream")
    with AnthropicUpstream() as claude:
        async with served(config(claude.base_url, "anthropic")) as client:
            await client.messages.create(**ASK, extra_headers={"anthropic-beta": "context-1m-2025-08-07"})
            async with client.messages.stream(**ASK, extra_headers={"anthropic-beta": "b2"}) as s:
                await s.get_final_message()
            await client.messages.create(**ASK)
    betas = [{k.lower(): v for k, v in headers.items()}.get("anthropic-beta") for _, headers, _ in claude.requests]
    assert betas == ["context-1m-2025-08-07", "b2", None]


async def test_an_image_refused_by_a_text_only_target_is_named_as_the_client_sent_it(upstream):
    """A target that cannot take images refuses the chat translation's ``image_url`` part (the local engine's own
    400, scripted here); the client sent an ``image`` block, and is told which, by its Messages path."""
    refusal = {"error": {"message": "messages[2].content[1]: part type 'image_url' is not supported (text only)",
                         "type": "invalid_request_error", "param": "messages[2].content[1].type",
                         "code": "invalid_value"}}
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
             {"role": "user", "content": [{"type": "text", "text": "and this?"}, IMAGE]}]
    async with served(config(upstream.base_url)) as client:
        upstream.push({"status": 400, "body": json.dumps(refusal).encode()})
        with pytest.raises(anthropic.BadRequestError) as e:
            await client.messages.create(model="m1", max_tokens=20, messages=turns)
    assert e.value.body["error"] == {"type": "invalid_request_error",
                     "message": "messages.2.content.1: content block type 'image' is not supported (text only)"}


async def test_count_tokens_of_an_unknown_model_is_messages_404(upstream):
    async with served(config(upstream.base_url)) as client:
        with pytest.raises(anthropic.NotFoundError) as counted:
            await client.messages.count_tokens(model="nope", messages=ASK["messages"])
        with pytest.raises(anthropic.NotFoundError) as created:
            await client.messages.create(**{**ASK, "model": "nope"})
    assert counted.value.body == created.value.body == {"type": "error", "error": {
        "type": "not_found_error", "message": "The model 'nope' does not exist; available: m1"}}


async def test_a_tool_result_without_its_tool_use_is_refused_as_anthropic_does(upstream):
    """A new-user trial's ``tool_result`` with no ``tool_use`` before it got a 200: the backend was shown the
    result of a call it never made. Now Anthropic's 400, and nothing reaches the backend."""
    turns = [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9", "content": "sunny"}]}]
    async with served(config(upstream.base_url)) as client:
        sent = len(upstream.bodies)
        with pytest.raises(anthropic.BadRequestError) as e:
            await client.messages.create(model="m1", max_tokens=20, messages=turns, tools=TOOLS)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert e.value.body["error"]["message"].startswith(
        "messages.0.content.0: unexpected `tool_use_id` found in `tool_result` blocks: toolu_9."), e.value.body
    assert len(upstream.bodies) == sent


def whole(message: dict, finish: str) -> dict:
    """A ScriptUpstream script: a whole chat completion of ``message`` (usage as ``stream``'s)."""
    return {"body": json.dumps({"id": "up-1", "object": "chat.completion", "created": 0, "model": "up-model",
                                "usage": {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14},
                                "choices": [{"index": 0, "finish_reason": finish, "message": {
                                    "role": "assistant", "content": None, **message}}]}).encode()}


async def both_ways(client: anthropic.AsyncAnthropic, **kwargs) -> tuple[dict, dict]:
    """The Message of one request streamed (the SDK's stream helper's final message) and then whole, as dicts
    without their ids (each request has its own)."""
    async with client.messages.stream(**{**ASK, **kwargs}) as s:
        streamed = await s.get_final_message()
    plain = await client.messages.create(**{**ASK, **kwargs})
    return streamed.model_dump(exclude={"id"}), plain.model_dump(exclude={"id"})


async def test_a_refusal_is_kept_and_is_the_same_message_streamed_or_not(upstream):
    """A user trial's refusal (chat's ``refusal``, content null) came back as ``content: []`` and ``end_turn``,
    streamed or not: the refusal text was lost and the client could not tell it was refused."""
    text = "I can't help with that."
    upstream.push(stream(chunk({"role": "assistant", "refusal": ""}), chunk({"refusal": "I can't "}),
                         chunk({"refusal": "help with that."}), chunk({}, "stop")),
                  whole({"refusal": text}, "stop"))
    async with served(config(upstream.base_url)) as client:
        streamed, plain = await both_ways(client)
    assert streamed == plain
    assert [(b["type"], b["text"]) for b in plain["content"]] == [("text", text)]
    assert plain["stop_reason"] == "refusal"


async def test_a_cut_or_malformed_tool_call_holds_the_same_input_streamed_or_not(upstream):
    """Arguments cut by ``max_tokens`` or malformed by an upstream were ``{"_raw_arguments": ...}`` whole (a key
    a client could pass to its tool) and the SDK's partial parse streamed (or its ValueError, malformed): now the
    complete members of their valid prefix, both ways."""
    for arguments, finish, stop, expected in [('{"city": "Paris", "unit": "cel', "length", "max_tokens",
                                               {"city": "Paris"}),
                                              ('{"city": "Paris"}}', "tool_calls", "tool_use", {"city": "Paris"})]:
        upstream.push(stream(call(0, "", "get_weather"), call(0, arguments[:9]), call(0, arguments[9:]),
                             chunk({}, finish)),
                      whole({"tool_calls": [{"id": "call_0", "type": "function", "function": {
                          "name": "get_weather", "arguments": arguments}}]}, finish))
        async with served(config(upstream.base_url)) as client:
            streamed, plain = await both_ways(client, tools=TOOLS)
        assert streamed == plain, arguments
        assert [(b["type"], b["input"]) for b in plain["content"]] == [("tool_use", expected)]
        assert plain["stop_reason"] == stop


async def test_malformed_output_config_and_tools_are_refused_before_the_backend(upstream):
    """A user trial's ``output_config`` of the wrong shape got 200s with its schema unenforced (under
    ``json_schema``: any JSON); an array ``input_schema``, a prefill with a format, a string ``is_error`` and
    duplicate ``tool_use`` ids were taken too. Each is Anthropic's 400 naming the path; the backend is not called."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    use = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}
    refused = [
        ({"output_config": {"format": {"type": "json_schema", "json_schema": {"schema": schema}}}},
         "output_config.format.schema: Field required; "
         "output_config.format.json_schema: Extra inputs are not permitted"),
        ({"output_config": {"format": {"type": "xml"}}}, "output_config.format.type: Input should be 'json_schema'"),
        ({"output_config": {"format": {"type": "json_schema"}}}, "output_config.format.schema: Field required"),
        ({"output_config": {"formt": {"type": "json_schema", "schema": schema}}},
         "output_config.formt: Extra inputs are not permitted"),
        ({"tools": [{"name": "f", "input_schema": {"type": "array", "items": {"type": "integer"}}}]},
         "tools.0.input_schema.type: Input should be 'object'"),
        ({"output_config": {"format": {"type": "json_schema", "schema": schema}},
          "messages": [*ASK["messages"], {"role": "assistant", "content": '{"a":'}]},
         "output_config.format: prefilling the assistant message cannot be combined with structured outputs"),
        ({"tools": TOOLS, "messages": [*ASK["messages"], {"role": "assistant", "content": [use]}, {
            "role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "is_error": "yes"}]}]},
         "messages.2.content.0.is_error: Input should be a valid boolean"),
        ({"tools": TOOLS, "messages": [*ASK["messages"], {"role": "assistant", "content": [use, use]}, {
            "role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1"}]}]},
         "messages.1.content.1: `tool_use` ids must be unique"),
        # a new user's chat field on /v1/messages was named as output_config.format (the chat paths' rewrite)
        ({"extra_body": {"response_format": {"type": "json_object"}}},
         "response_format: Extra inputs are not permitted"),
        # a trial's prefill "Hello " was continued; Anthropic refuses it
        ({"messages": [*ASK["messages"], {"role": "assistant", "content": "Hello "}]},
         "messages: final assistant content cannot end with trailing whitespace")]
    async with served(config(upstream.base_url)) as client:
        calls = upstream.calls
        for body, message in refused:
            with pytest.raises(anthropic.BadRequestError) as e:
                await client.messages.create(**{**ASK, **body})
            assert e.value.body["error"]["type"] == "invalid_request_error"
            assert e.value.body["error"]["message"].startswith(message), (body, e.value.body)
        assert upstream.calls == calls
        await client.messages.create(**ASK, output_config={"format": {"type": "json_schema", "schema": schema},
                                                           "effort": "low"})
    assert upstream.bodies[-1]["response_format"]["json_schema"]["schema"] == schema
    assert "effort" not in json.dumps(upstream.bodies[-1])


async def test_a_forced_tool_that_is_not_among_the_tools_is_named_as_messages_names_it(upstream):
    """The local engine refuses ``tool_choice`` naming a missing tool in chat's path (its 400, scripted here): the
    client sent ``tool_choice.name``, and is told that."""
    refusal = {"error": {"message": "tool_choice.function.name: 'g' is not one of the tools",
                         "type": "invalid_request_error", "param": "tool_choice", "code": None}}
    async with served(config(upstream.base_url)) as client:
        upstream.push({"status": 400, "body": json.dumps(refusal).encode()})
        with pytest.raises(anthropic.BadRequestError) as e:
            await client.messages.create(**ASK, tools=TOOLS, tool_choice={"type": "tool", "name": "g"})
    assert e.value.body["error"] == {"type": "invalid_request_error",
                                     "message": "tool_choice.name: 'g' is not one of the tools"}


async def test_the_sdks_threaded_tool_runner_continues_without_a_thread(upstream):
    """The SDK's ``tool_runner`` asks for a server-held Thread by default (``thread: {"type": "create"}``); the
    gateway holds none and says so with the code the SDK recovers from, so the runner sends the whole conversation
    again without ``thread`` and the tool loop runs (an agents trial's runner got an "Extra inputs" 400 it could
    not recover from). The refusal reaches no backend."""
    from anthropic import beta_async_tool

    @beta_async_tool
    async def get_weather(city: str) -> str:
        """The weather of a city.

        Args:
            city: the city
        """
        return f"sunny in {city}"

    called = {"id": "up-1", "object": "chat.completion", "created": 0, "model": "up-model", "choices": [{
        "index": 0, "finish_reason": "tool_calls", "message": {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}
        ]}}]}
    upstream.reset()                              # the module's upstream: no script of another test left
    upstream.push({"body": json.dumps(called).encode()})
    async with served(config(upstream.base_url)) as client:
        with pytest.raises(anthropic.BadRequestError) as e:
            await client.beta.messages.create(**ASK, extra_body={"thread": {"type": "create"}})
        assert e.value.body["error"]["details"] == {"error_code": "thread_unsupported_request"}, e.value.body
        assert e.value.body["error"]["type"] == "invalid_request_error" and upstream.calls == 0
        runner = client.beta.messages.tool_runner(**ASK, tools=[get_weather])
        replies = [m async for m in runner]
    assert [m.stop_reason for m in replies] == ["tool_use", "end_turn"] and replies[-1].content[0].text == "ok"
    assert upstream.calls == 2 and all("thread" not in b for b in upstream.bodies)
    assert upstream.bodies[-1]["messages"][-1] == {"role": "tool", "tool_call_id": "toolu_1",    # ids as Anthropic's
                                                  "content": "sunny in Paris"}
