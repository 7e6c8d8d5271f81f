"""Each client endpoint is named in its request's log line (``endpoint``) and SERVER span (``tandem.endpoint``):
one request on each, with the official ``openai`` and ``anthropic`` SDKs as clients, to a gateway (the Litestar app
under uvicorn, in this process, with the OpenTelemetry SDK's in-memory exporter) over the fault-injecting upstream,
whose only API is chat completions (and embeddings): Responses and Messages requests are served as chat ones, and
still named as what the client called."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from gateway.config.compile import load_config_text
from gateway.http.app import create_app
from gateway.observability.tracing import Tracing
from gateway.runtime import Gateway
from tests.gateway.fault_upstream import FaultUpstream
from tests.gateway.http.test_messages import KEY, config
from tests.gateway.support import serve_app, wait_until

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture
def up():
    with FaultUpstream("up") as u:
        yield u


async def test_log_lines_and_spans_name_the_endpoint(up, tmp_path):
    log_path = tmp_path / "requests.jsonl"
    cfg = config(up).replace("logs: {requests: false}", f"logs: {{destination: '{log_path}'}}")
    gw = Gateway(None, load_config_text(cfg), start_engine=False)
    spans = InMemorySpanExporter()
    gw.obs.tracing = Tracing(span_exporter=spans)
    server, task, url = await serve_app(create_app(gw))
    ids = {}
    try:
        oa = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        an = anthropic.AsyncAnthropic(base_url=url, api_key=KEY, max_retries=0)
        r = await oa.chat.completions.with_raw_response.create(model="m1", messages=HI)
        ids["chat/completions"] = r.headers["x-request-id"]
        r = await oa.completions.with_raw_response.create(model="m1", prompt="hi")
        ids["completions"] = r.headers["x-request-id"]
        r = await oa.embeddings.with_raw_response.create(model="m1", input="hi")
        ids["embeddings"] = r.headers["x-request-id"]
        r = await oa.responses.with_raw_response.create(model="m1", input="hi")
        ids["responses"] = r.headers["x-request-id"]
        r = await an.messages.with_raw_response.create(model="m1", max_tokens=5, messages=HI)
        ids["messages"] = r.headers["x-request-id"]
        with pytest.raises(anthropic.BadRequestError) as e:     # a refusal is named too
            await an.messages.create(model="m1", max_tokens=5, messages=[])
        ids["messages refused"] = e.value.response.headers["x-request-id"]
        await oa.close()
        await an.close()
    finally:
        server.should_exit = True
        await task

    def logged() -> dict | None:
        lines = [json.loads(x) for x in log_path.read_text().splitlines()] if log_path.exists() else []
        by_id = {x["request_id"]: x for x in lines}
        return by_id if all(i in by_id for i in ids.values()) else None

    lines = wait_until(logged)
    assert {name: (lines[i]["endpoint"], lines[i]["status"]) for name, i in ids.items()} == {
        "chat/completions": ("chat/completions", 200), "completions": ("completions", 200),
        "embeddings": ("embeddings", 200), "responses": ("responses", 200), "messages": ("messages", 200),
        "messages refused": ("messages", 400)}
    server_spans = [s for s in spans.get_finished_spans() if s.kind == SpanKind.SERVER]
    assert sorted((s.attributes["tandem.endpoint"], s.attributes["url.path"]) for s in server_spans) == [
        ("chat/completions", "/v1/chat/completions"), ("completions", "/v1/completions"),
        ("embeddings", "/v1/embeddings"), ("messages", "/v1/messages"), ("messages", "/v1/messages"),
        ("responses", "/v1/responses")]
