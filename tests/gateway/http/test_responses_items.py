"""The Responses API's output and stored items (issue 48, items 4-6) with the official ``openai`` SDK as the client,
against a real gateway on 127.0.0.1 whose only backend is a scripted chat upstream
(``tests/gateway/script_upstream.py``): parallel tool calls whose argument pieces interleave by ``index``, the
backend's reasoning as a ``reasoning`` item, and ``input_items`` paged by the SDK's auto-pagination.
"""

from __future__ import annotations

import json

from openai import AsyncOpenAI

from gateway.config.compile import load_config_text
from gateway.http.app import create_app
from gateway.runtime import Gateway
from tests.gateway.script_upstream import ScriptUpstream, data, upstream  # noqa: F401 (the fixture)
from tests.gateway.support import serve_app, sha

KEY = "sk-tandem-items-0123456789abcdef"
TOOLS = [{"type": "function", "name": n, "parameters": {"type": "object"}} for n in ("get_weather", "get_time")]


def config(up: ScriptUpstream) -> str:
    return (f"reload: {{watch: false}}\nauth:\n  keys:\n    - {{tenant: t1, sha256: {sha(KEY)}}}\n"
            "resilience:\n  retry: {max_attempts: 1}\n  health: {interval_s: 0}\n"
            "observability:\n  logs: {requests: false}\nmodels:\n  - name: m1\n"
            f"backends:\n  up:\n    type: openai\n    base_url: {up.base_url}\n"
            "routes:\n  r1:\n    targets: [{backend: up}]\npolicy:\n  default_route: r1\n")


class served:
    """A gateway on ``config(up)``: ``async with served(up) as client`` (an ``AsyncOpenAI`` for it)."""

    def __init__(self, up: ScriptUpstream):
        self.gw = Gateway(None, load_config_text(config(up)), start_engine=False)

    async def __aenter__(self) -> AsyncOpenAI:
        self.server, self.task, url = await serve_app(create_app(self.gw))
        self.client = AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=20)
        return self.client

    async def __aexit__(self, *exc) -> None:
        await self.client.close()
        self.server.should_exit = True
        await self.task


def chunk(delta: dict, finish: str | None = None) -> dict:
    return {"id": "up-1", "object": "chat.completion.chunk", "created": 0, "model": "up-model",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def stream(*chunks: dict, usage: dict | None = None) -> dict:
    """A ScriptUpstream script: the chunks, a usage chunk, ``[DONE]``."""
    tail = {"id": "up-1", "object": "chat.completion.chunk", "created": 0, "model": "up-model", "choices": [],
            "usage": usage or {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14}}
    return {"parts": [data(c) for c in (*chunks, tail)] + [b"data: [DONE]\n\n"]}


def call(index: int, arguments: str, name: str | None = None) -> dict:
    c: dict = {"index": index, "function": {"arguments": arguments}}
    if name:
        c.update(id=f"call_{index}", type="function")
        c["function"]["name"] = name
    return chunk({"tool_calls": [c]})


# two parallel calls whose argument pieces come 0, 1, 0, 1 (as some upstreams stream them)
INTERLEAVED = (call(0, "", "get_weather"), call(1, "", "get_time"), call(0, '{"city": '), call(1, '{"tz": '),
               call(0, '"Paris"}'), call(1, '"CET"}'), chunk({}, "tool_calls"))


async def test_interleaved_parallel_calls_stream_whole_arguments(upstream):
    upstream.push(stream(*INTERLEAVED))
    async with served(upstream) as client:
        events = [e async for e in await client.responses.create(model="m1", input="w", tools=TOOLS, stream=True)]
        final = events[-1].response
        stored = await client.responses.retrieve(final.id)
    done = {e.output_index: e.arguments for e in events if e.type == "response.function_call_arguments.done"}
    assert done == {0: '{"city": "Paris"}', 1: '{"tz": "CET"}'}
    for response in (final, stored):
        assert [(o.name, json.loads(o.arguments)) for o in response.output] == [
            ("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
    # items one after another: no delta for an item after its output_item.done
    closed: set[int] = set()
    for e in events:
        if e.type in ("response.function_call_arguments.delta", "response.function_call_arguments.done"):
            assert e.output_index not in closed, e
        if e.type == "response.output_item.done":
            closed.add(e.output_index)
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == '{"city": "Paris"}{"tz": "CET"}'


async def test_reasoning_becomes_a_reasoning_item_streamed_and_whole(upstream):
    usage = {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14,
             "completion_tokens_details": {"reasoning_tokens": 4}}
    upstream.push(stream(chunk({"role": "assistant", "reasoning_content": "Let me"}),
                         chunk({"reasoning_content": " think."}), chunk({"content": "Hello"}), chunk({}, "stop"),
                         usage=usage))
    whole = {"id": "up-1", "object": "chat.completion", "created": 0, "model": "up-model", "usage": usage,
             "choices": [{"index": 0, "finish_reason": "stop", "message": {
                 "role": "assistant", "content": "Hello", "reasoning_content": "Let me think."}}]}
    upstream.push({"body": json.dumps(whole).encode()})
    async with served(upstream) as client:
        async with client.responses.stream(model="m1", input="hi") as s:
            events = [e async for e in s]
            final = await s.get_final_response()
        plain = await client.responses.create(model="m1", input="hi")
    types = [e.type for e in events]
    assert types[2:6] == ["response.output_item.added", "response.reasoning_text.delta",
                          "response.reasoning_text.delta", "response.reasoning_text.done"]
    for r in (final, plain):
        reasoning, message = r.output
        assert reasoning.type == "reasoning" and reasoning.content[0].text == "Let me think."
        assert reasoning.id != message.id and r.output_text == "Hello"
        assert r.usage.output_tokens_details.reasoning_tokens == 4


async def test_a_refusal_streamed_is_the_refusal_part_the_whole_answer_has(upstream):
    # a trial's stream carried delta.refusal (content null) and the Responses events lost it
    upstream.push(stream(chunk({"role": "assistant", "content": None, "refusal": ""}),
                         chunk({"refusal": "I can't help"}), chunk({"refusal": " with that."}), chunk({}, "stop")))
    whole = {"id": "up-1", "object": "chat.completion", "created": 0, "model": "up-model", "choices": [{
        "index": 0, "finish_reason": "stop",
        "message": {"role": "assistant", "content": None, "refusal": "I can't help with that."}}]}
    upstream.push({"body": json.dumps(whole).encode()})
    async with served(upstream) as client:
        async with client.responses.stream(model="m1", input="hi") as s:
            events = [e async for e in s]
            final = await s.get_final_response()
        stored = await client.responses.retrieve(final.id)
        plain = await client.responses.create(model="m1", input="hi")
    assert [e.type for e in events][2:] == [
        "response.output_item.added", "response.content_part.added", "response.refusal.delta",
        "response.refusal.delta", "response.refusal.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    assert events[3].part.type == "refusal" and events[3].part.refusal == ""
    assert [e.delta for e in events[4:6]] == ["I can't help", " with that."]
    assert events[6].refusal == "I can't help with that." and events[7].part.refusal == events[6].refusal
    for r in (final, stored, plain):
        (message,) = r.output
        assert [(p.type, p.refusal) for p in message.content] == [("refusal", "I can't help with that.")]
        assert r.status == message.status == "completed" and r.output_text == ""
    assert final.output[0].model_dump() == {**plain.output[0].model_dump(), "id": final.output[0].id}


async def test_input_items_auto_pagination_returns_every_item(upstream):
    items: list[dict] = [{"role": "user", "content": "start"}]
    for i in range(12):
        items += [{"type": "function_call", "call_id": f"c{i}", "name": "get_weather", "arguments": "{}"},
                  {"type": "function_call_output", "call_id": f"c{i}", "output": f"sunny {i}"}]
    async with served(upstream) as client:
        r = await client.responses.create(model="m1", input=items, tools=TOOLS)
        listed = [item async for item in client.responses.input_items.list(r.id, limit=10, order="asc")]
        newest = [item async for item in client.responses.input_items.list(r.id, limit=7)]
        page = await client.responses.input_items.list(r.id, limit=10, order="asc")
    assert len(items) == 25 and len(listed) == 25 and len({i.id for i in listed}) == 25
    assert [getattr(i, "call_id", None) for i in listed[1:]] == [f"c{i // 2}" for i in range(24)]
    assert [i.id for i in newest] == [i.id for i in reversed(listed)]
    assert (page.first_id, page.last_id, page.has_more) == (listed[0].id, listed[9].id, True)
    sent = upstream.bodies[-1]["messages"]
    assert len(sent) == 25      # the user message, 12 assistant tool calls, 12 tool results
