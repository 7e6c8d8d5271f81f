"""The gateway with the real engine: the local backend runs SmolLM2 in the
gateway's process, and the "aggregator" is a second real OpenAI-compatible
server (``tandem engine serve``) with a
tiny random Llama. Official ``openai`` client, sync, async and streaming."""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import time
from dataclasses import replace

import httpx
import openai
import pytest
import pytest_asyncio

from gateway.backends.local import LocalBackend
from gateway.config.backend_schema import EngineConfig, LocalBackendConfig
from gateway.config.schema import GatewayConfig
from gateway.errors import BackendError
from gateway.request.validate import check_request
from gateway.values import GatewayRequest
from gateway.resilience.layer import Resilience
from tests.gateway.support import ROOT, GatewayProcess, engine_serve
from tests.tiny_models import save_byte_level_llama

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A 2-layer random Llama, byte-level tokenizer (one character = one token), chat template."""
    return save_byte_level_llama(tmp_path_factory.mktemp("tiny"), max_position_embeddings=8192)


@pytest.fixture(scope="module")
def aggregator(tiny_model, tmp_path_factory):
    """``tandem engine serve`` with the tiny model on a free port."""
    with engine_serve(["--model", tiny_model, "--dtype", "float32", "--kv-cache-memory", "64MiB",
                       "--served-model-name", "tiny-agg"], tmp_path_factory.mktemp("agg")) as url:
        yield url


CONFIG = """
server: {{drain_timeout_s: 10}}
models:
  - {{name: smollm2, aliases: [gpt-4o-mini]}}
backends:
  local:
    type: local
    engine: {{served_model_name: smollm2, max_model_len: 512, max_num_seqs: 8, kv_cache_memory: 128MiB,
             scheduling_policy: priority}}
  agg:
    type: openai
    base_url: {agg}/v1
    api_key_env: AGG_TEST_KEY
    models: {{smollm2: tiny-agg}}
    max_model_len: 8192
    prices: {{input: 0.1, output: 0.2}}
  keyless:
    type: openai
    base_url: http://127.0.0.1:9/v1
    api_key_env: TANDEM_TEST_UNSET_KEY
routes:
  local-first:
    targets: [{{backend: local, weight: 50}}, {{backend: agg, weight: 50}}]
    fallbacks: [{{backend: agg}}, {{backend: local}}]
  local-only:
    targets: [{{backend: local}}]
    fallbacks: [{{backend: agg}}]
  aggregator:
    targets: [{{backend: agg}}]
    fallbacks: [{{backend: local}}]
  keyless-first:
    targets: [{{backend: keyless}}]
    fallbacks: [{{backend: local}}]
  local-alone:
    targets: [{{backend: local}}]
policy:
  default_route: local-only
  rules:
    - {{name: keyless, match: {{header.x-route-test: keyless}}, route: keyless-first}}
    - {{name: alone, match: {{header.x-route-test: alone}}, route: local-alone}}
    - {{name: structured, match: {{response_format: true}}, route: aggregator}}
    - {{name: low, match: {{priority: low}}, route: aggregator}}
    - {{name: long, match: {{prompt_tokens: {{gt: 400}}}}, route: aggregator}}
    - {{name: canary, match: {{header.x-canary-test: "1"}}, route: local-first}}
"""


@pytest.fixture(scope="module")
def gateway(aggregator, tmp_path_factory):
    path = tmp_path_factory.mktemp("gwe") / "config.yaml"
    path.write_text(CONFIG.format(agg=aggregator))
    g = GatewayProcess(path, env={"AGG_TEST_KEY": "agg-key"}).start(timeout=300)
    yield g
    g.stop()


def client(g) -> openai.OpenAI:
    return openai.OpenAI(base_url=g.url + "/v1", api_key="client", max_retries=0, timeout=120)


MSG = [{"role": "user", "content": "What is the capital of France?"}]


def request_line(gateway, rid: str, timeout: float = 10.0) -> dict | None:
    """Request ``rid``'s JSON request-log line in ``gateway``'s log (None if it is not there within ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        lines = [json.loads(x) for x in gateway.log().splitlines() if x.startswith("{") and rid in x]
        line = next((x for x in lines if x.get("event") == "request" and x["request_id"] == rid), None)
        if line is not None or time.monotonic() >= deadline:
            return line
        time.sleep(0.05)


def test_sync_chat_from_local_smollm2(gateway):
    raw = client(gateway).chat.completions.with_raw_response.create(model="gpt-4o-mini", messages=MSG, max_tokens=8,
                                                                    temperature=0)
    r = raw.parse()
    assert raw.headers["x-tandem-backend"] == "local" and raw.headers["x-tandem-route"] == "local-only"
    assert r.choices[0].message.content and r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 5 and 0 < r.usage.completion_tokens <= 8
    assert r.model == "smollm2"


async def test_async_stream_from_local(gateway):
    c = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="client", max_retries=0, timeout=120)
    stream = await c.chat.completions.create(model="smollm2", messages=MSG, max_tokens=8, temperature=0, stream=True)
    deltas, finish = [], None
    async for ch in stream:
        if ch.choices:
            deltas.append(ch.choices[0].delta.content or "")
            finish = ch.choices[0].finish_reason or finish
    await c.close()
    assert "".join(deltas) and finish in ("stop", "length") and len(deltas) >= 2
    # Same answer as the non-streamed greedy request.
    full = client(gateway).chat.completions.create(model="smollm2", messages=MSG, max_tokens=8, temperature=0)
    assert "".join(deltas) == full.choices[0].message.content


def test_local_stream_is_billed_from_the_engines_own_count(gateway):
    """Issue 26: the gateway asks the engine for a stream's usage and bills it as counted (not estimated); a
    client that did not ask for usage sees no usage chunk, one that did gets the same counts."""
    c = client(gateway)
    raw = c.chat.completions.with_raw_response.create(model="smollm2", messages=MSG, max_tokens=8, temperature=0,
                                                      stream=True)
    chunks = list(raw.parse())
    assert chunks and all(ch.usage is None and ch.choices for ch in chunks)
    asked = list(c.chat.completions.create(model="smollm2", messages=MSG, max_tokens=8, temperature=0, stream=True,
                                           stream_options={"include_usage": True}))
    usage = asked[-1].usage
    # vLLM's continuous_usage_stats puts usage on every chunk only with include_usage (a trial: alone it did)
    alone = list(c.completions.create(model="smollm2", prompt="Hi", max_tokens=3, temperature=0, stream=True,
                                      stream_options={"continuous_usage_stats": True}))
    assert alone and all(ch.usage is None for ch in alone)
    both = list(c.completions.create(model="smollm2", prompt="Hi", max_tokens=3, temperature=0, stream=True,
                                     stream_options={"continuous_usage_stats": True, "include_usage": True}))
    assert all(ch.usage is not None for ch in both) and both[-1].usage.completion_tokens == 3
    line = request_line(gateway, raw.headers["x-request-id"])
    assert line is not None and line["usage_estimated"] is False
    assert (line["prompt_tokens"], line["completion_tokens"]) == (usage.prompt_tokens, usage.completion_tokens)


def test_completions_local(gateway):
    r = client(gateway).completions.create(model="smollm2", prompt="The capital of France is", max_tokens=4,
                                           temperature=0)
    assert r.choices[0].text


def test_vllms_token_restrictions_reach_the_local_engine(gateway):
    """vLLM's ``bad_words`` and ``return_tokens_as_token_ids`` through the gateway (a trial: refused as unknown
    parameters)."""
    c = client(gateway)
    ask = dict(model="smollm2", prompt="The capital of France is", max_tokens=4, temperature=0, logprobs=0)
    assert c.completions.create(**ask).choices[0].text.startswith(" Paris")
    banned = c.completions.create(**ask, extra_body={"bad_words": ["Paris"], "return_tokens_as_token_ids": True})
    assert "Paris" not in banned.choices[0].text
    assert all(t.startswith("token_id:") for t in banned.choices[0].logprobs.tokens)


def test_tokenize_and_detokenize_on_the_gateway(gateway):
    """vLLM's /tokenize and /detokenize on the gateway's base_url (a trial got 404 there: only ``tandem engine
    serve`` had them), by the local engine's tokenizer: a chat form counts what the chat answer's
    ``prompt_tokens`` says, an alias names the model, bad input is a 400 naming the field."""
    url = gateway.url
    r = httpx.post(url + "/tokenize", json={"model": "gpt-4o-mini", "prompt": "Hello world",
                                            "return_token_strs": True})
    assert r.status_code == 200 and r.json()["count"] == len(r.json()["tokens"]) == len(r.json()["token_strs"]) > 0
    assert r.json()["max_model_len"] == 512
    chat = client(gateway).chat.completions.create(model="smollm2", messages=MSG, max_tokens=1)
    counted = httpx.post(url + "/tokenize", json={"model": "smollm2", "messages": MSG}).json()
    assert counted["count"] == chat.usage.prompt_tokens
    back = httpx.post(url + "/detokenize", json={"tokens": counted["tokens"]}).json()
    assert "What is the capital of France?" in back["prompt"]
    for path, body, status, param in (("/tokenize", {"prompt": 3}, 400, "prompt"),
                                      ("/detokenize", {"tokens": [10 ** 9]}, 400, "tokens"),
                                      ("/tokenize", {"model": "nope", "prompt": "x"}, 404, "model")):
        r = httpx.post(url + path, json=body)
        assert r.status_code == status and r.json()["error"]["param"] == param, (path, r.text)


def test_completions_prompt_scoring_through_the_gateway(gateway):
    """``echo`` with ``max_tokens`` 0 (OpenAI's legacy prompt scoring, vLLM's): the engine's prompt-only answer,
    billed as no completion tokens; 0 without ``echo`` is still refused before routing (the shared rule,
    ``param_ranges.echo_only``)."""
    prompt = "The capital of France is Paris."
    raw = client(gateway).completions.with_raw_response.create(model="smollm2", prompt=prompt, max_tokens=0,
                                                               echo=True, logprobs=0)
    r = raw.parse()
    assert raw.headers["x-tandem-backend"] == "local"
    assert r.choices[0].text == prompt and r.usage.completion_tokens == 0 and r.choices[0].finish_reason == "length"
    assert len(r.choices[0].logprobs.tokens) == r.usage.prompt_tokens
    line = request_line(gateway, raw.headers["x-request-id"])
    assert line is not None and (line["prompt_tokens"], line["completion_tokens"]) == (r.usage.prompt_tokens, 0)
    bad = httpx.post(gateway.url + "/v1/completions", timeout=60,
                     json={"model": "smollm2", "prompt": prompt, "max_tokens": 0})
    assert bad.status_code == 400 and "x-tandem-backend" not in bad.headers
    assert (bad.json()["error"]["param"], bad.json()["error"]["code"]) == ("max_tokens", "integer_below_min_value")


def test_low_priority_goes_to_the_aggregator(gateway):
    raw = client(gateway).chat.completions.with_raw_response.create(
        model="smollm2", messages=MSG, max_tokens=4, extra_headers={"x-priority": "low"})
    assert raw.headers["x-tandem-backend"] == "agg" and raw.headers["x-tandem-rule"] == "low"
    assert raw.parse().model == "smollm2"       # the public model, not the aggregator's name (tiny-agg)
    stream = client(gateway).completions.create(model="smollm2", prompt="abc", max_tokens=4, stream=True,
                                                extra_body={"priority": "low"})
    assert "".join(ch.choices[0].text for ch in stream if ch.choices)


def test_long_prompt_goes_to_the_aggregator(gateway):
    long = [{"role": "user", "content": "word " * 450}]    # > 400 SmolLM2 tokens, > local max_model_len budget
    raw = client(gateway).chat.completions.with_raw_response.create(model="smollm2", messages=long, max_tokens=2)
    assert raw.headers["x-tandem-rule"] == "long" and raw.headers["x-tandem-backend"] == "agg"


def test_response_format_routed_upstream_tools_served_locally(gateway):
    # The rule sends it to the aggregator (another tandem engine, tiny random model), which constrains it too.
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    r = httpx.post(gateway.url + "/v1/chat/completions", timeout=60, json={
        "model": "smollm2", "messages": MSG, "max_tokens": 32, "response_format": {
            "type": "json_schema", "json_schema": {"name": "ok", "schema": schema}}})
    assert r.headers["x-tandem-backend"] == "agg" and r.headers["x-tandem-rule"] == "structured"
    assert r.status_code == 200 and r.headers["x-tandem-attempts"] == "1"
    assert isinstance(json.loads(r.json()["choices"][0]["message"]["content"])["ok"], bool)
    # A format of no known shape is refused before routing (the engine's shapes, engine/protocol/chat_shapes.py)
    r = httpx.post(gateway.url + "/v1/chat/completions", timeout=60, json={
        "model": "smollm2", "messages": MSG, "max_tokens": 2, "response_format": {"type": "yaml"}})
    assert r.status_code == 400 and "x-tandem-attempts" not in r.headers
    assert r.json()["error"]["param"] == "response_format.type"
    # the engine's own 400 for a schema it cannot enforce is passed through after one attempt: a 4xx never
    # falls back
    lookaround = {"type": "object", "properties": {"a": {"type": "string", "pattern": "(?=x)x"}}}
    r = httpx.post(gateway.url + "/v1/chat/completions", timeout=60, json={
        "model": "smollm2", "messages": MSG, "max_tokens": 2, "response_format": {
            "type": "json_schema", "json_schema": {"name": "la", "schema": lookaround}}})
    assert r.status_code == 400 and r.headers["x-tandem-attempts"] == "1", r.text
    assert r.json()["error"]["param"] == "response_format"
    # No rule sends tools upstream and the local backend serves them (structured_outputs defaults to
    # [response_format, tools]): a schema-valid call from the local engine.
    raw = client(gateway).chat.completions.with_raw_response.create(
        model="smollm2", messages=MSG, max_tokens=64, temperature=0, tool_choice="required",
        parallel_tool_calls=False,
        tools=[{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"city": {"enum": ["Paris", "Lyon"]}}, "required": ["city"]}}}])
    assert raw.headers["x-tandem-backend"] == "local"
    reply = raw.parse()
    assert reply.choices[0].finish_reason == "tool_calls"
    assert json.loads(reply.choices[0].message.tool_calls[0].function.arguments)["city"] in ("Paris", "Lyon")


def test_responses_api_on_the_local_engine_and_the_aggregator(gateway):
    """``/v1/responses`` translated onto the engine's chat path (issue 28): SmolLM2 answers greedily the same text
    streamed or not, a required tool is a schema-valid ``function_call`` item from the local engine, and a
    ``text.format`` json_schema goes, by the response_format rule, to the aggregator, which constrains it."""
    c = client(gateway)
    r = c.responses.create(model="smollm2", input=MSG, max_output_tokens=16, temperature=0)
    assert r.status in ("completed", "incomplete") and r.output_text and 0 < r.usage.output_tokens <= 16
    events = list(c.responses.create(model="smollm2", input=MSG, max_output_tokens=16, temperature=0, stream=True))
    assert events[0].type == "response.created" and events[-1].type == f"response.{r.status}"
    assert events[-1].response.output_text == r.output_text
    assert events[-1].response.usage.input_tokens == r.usage.input_tokens
    tool = {"type": "function", "name": "f", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Lyon"]}}, "required": ["city"]}}
    raw = c.responses.with_raw_response.create(model="smollm2", input=MSG, tools=[tool], tool_choice="required",
                                               max_output_tokens=64, temperature=0)
    call = raw.parse().output[0]
    assert raw.headers["x-tandem-backend"] == "local" and call.type == "function_call" and call.name == "f"
    assert json.loads(call.arguments)["city"] in ("Paris", "Lyon")
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    raw = c.responses.with_raw_response.create(model="smollm2", input=MSG, max_output_tokens=32, text={
        "format": {"type": "json_schema", "name": "ok", "schema": schema}})
    assert raw.headers["x-tandem-backend"] == "agg" and raw.headers["x-tandem-rule"] == "structured"
    assert isinstance(json.loads(raw.parse().output_text)["ok"], bool)


def test_responses_logprobs_are_chats_streamed_or_not(gateway):
    """``include: ["message.output_text.logprobs"]`` with ``top_logprobs`` gives the output text's token logprobs
    (a trial got ``[]``, the fields silently dropped): the same as chat's for the same greedy request, streamed
    (the deltas' and the done event's) as not; ``top_logprobs`` and ``max_tool_calls`` are echoed."""
    c = client(gateway)
    chat = c.chat.completions.create(model="smollm2", messages=MSG, max_tokens=16,
                                     temperature=0, logprobs=True, top_logprobs=2)
    def flat(lps):
        return [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs]) for t in lps]

    want = flat(chat.choices[0].logprobs.content)
    kw = dict(model="smollm2", input=MSG, max_output_tokens=16, temperature=0, top_logprobs=2, max_tool_calls=3,
              include=["message.output_text.logprobs"])
    r = c.responses.create(**kw)
    assert flat(r.output[0].content[0].logprobs) == want and len(want) == chat.usage.completion_tokens > 0
    assert (r.top_logprobs, r.max_tool_calls) == (2, 3)
    events = list(c.responses.create(**kw, stream=True))
    deltas = [t for e in events if e.type == "response.output_text.delta" for t in e.logprobs]
    done = next(e for e in events if e.type == "response.output_text.done")
    for lps in (deltas, done.logprobs, events[-1].response.output[0].content[0].logprobs):
        assert flat(lps) == want
    plain = c.responses.create(model="smollm2", input=MSG, max_output_tokens=16, temperature=0)
    assert plain.output[0].content[0].logprobs == []                     # not asked for: none
    # an answer that ends its turn: the end token (no text) keeps its logprob streamed too (an SDK trial's
    # stream lost it)
    kw = dict(kw, input="Capital of Japan? One word.", max_output_tokens=40)
    whole = c.responses.create(**kw)
    assert whole.status == "completed" and len(whole.output[0].content[0].logprobs) == whole.usage.output_tokens
    events = list(c.responses.create(**kw, stream=True))
    deltas = [t for e in events if e.type == "response.output_text.delta" for t in e.logprobs]
    done = next(e for e in events if e.type == "response.output_text.done")
    for lps in (deltas, done.logprobs, events[-1].response.output[0].content[0].logprobs):
        assert flat(lps) == flat(whole.output[0].content[0].logprobs)


def test_truncate_prompt_tokens_minus_one_is_routed_on_what_the_engine_keeps(gateway):
    """vLLM's ``truncate_prompt_tokens: -1`` keeps what fits the context: a RAG trial's over-long inputs were routed
    on their whole length and refused (400 context_length_exceeded) by a route the engine serves whole."""
    r = httpx.post(gateway.url + "/v1/embeddings", timeout=120, headers={"x-route-test": "alone"},
                   json={"model": "smollm2", "truncate_prompt_tokens": -1, "input": ["word " * 1000, "word"]})
    assert r.status_code == 200 and r.headers["x-tandem-backend"] == "local", r.text
    assert r.json()["usage"]["prompt_tokens"] == 512 + 1, r.json()["usage"]


def test_engine_validation_errors_pass_through(gateway):
    """A rule only the engine checks (min_tokens <= max_tokens) comes back as the engine's 400 after one call;
    a range (top_p, top_k: engine/protocol/param_ranges.py, the table both read) is refused before routing,
    with OpenAI's code."""
    r = httpx.post(gateway.url + "/v1/chat/completions", timeout=60,
                   json={"model": "smollm2", "messages": MSG, "min_tokens": 10, "max_tokens": 5})
    assert r.status_code == 400 and r.headers["x-tandem-backend"] == "local" and r.headers["x-tandem-attempts"] == "1"
    assert r.json()["error"]["param"] == "min_tokens"
    for field, value, code in [("top_p", 7, "decimal_above_max_value"), ("top_k", -5, "integer_below_min_value")]:
        r = httpx.post(gateway.url + "/v1/chat/completions", timeout=60,
                       json={"model": "smollm2", "messages": MSG, field: value})
        assert r.status_code == 400 and "x-tandem-backend" not in r.headers
        assert (r.json()["error"]["param"], r.json()["error"]["code"]) == (field, code)


def test_canary_is_sticky_per_user_over_http(gateway):
    c = client(gateway)
    seen = {}
    for i in range(12):
        for _ in range(2):
            raw = c.completions.with_raw_response.create(model="smollm2", prompt="hi", max_tokens=1, user=f"user-{i}",
                                                          extra_headers={"x-canary-test": "1"})
            seen.setdefault(f"user-{i}", set()).add(raw.headers["x-tandem-backend"])
    assert all(len(v) == 1 for v in seen.values())             # one user, one arm
    assert set().union(*seen.values()) == {"local", "agg"}     # 50/50 over 12 users reaches both arms


def test_a_field_only_upstreams_serve(gateway, tmp_path):
    """``prediction`` (OpenAI's predicted outputs), which the local engine does not serve: a route whose only
    upstream has no key (its variable unset) gets a 400 ``unsupported_parameter`` naming the route, the rule and
    the reason (no retry serves it until the config gives a key: two trials read the 503 it was as "retry"),
    which `tandem route explain` predicts word for word; a route with no upstream a 400 naming the field; a route
    with a live upstream after the local target goes to it (no error from the gateway)."""
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "prediction": {"type": "content", "content": "hello"}}
    r = httpx.post(gateway.url + "/v1/chat/completions", json=body, headers={"x-route-test": "keyless"}, timeout=60)
    err = r.json()["error"]
    assert (r.status_code, err["param"], err["code"]) == (400, "prediction", "unsupported_parameter"), r.text
    assert "'keyless-first' (rule 'keyless') that could serve it has an API key" in err["message"], err
    assert "keyless: environment variable TANDEM_TEST_UNSET_KEY is unset" in err["message"], err
    assert [r.headers[f"x-tandem-{h}"] for h in ("route", "rule", "backend", "attempts")] == [
        "keyless-first", "keyless", "none", "0"]
    calls = []
    retrying = openai.OpenAI(base_url=gateway.url + "/v1", api_key="client", max_retries=2, http_client=httpx.Client(
        event_hooks={"request": [calls.append]}))
    with pytest.raises(openai.BadRequestError):
        retrying.chat.completions.create(**body, extra_headers={"x-route-test": "keyless"})
    assert len(calls) == 1
    path = tmp_path / "req.json"
    path.write_text(json.dumps(body))
    explain = subprocess.run([sys.executable, "-m", "gateway.commands", "route", "explain", "--config",
                              gateway.config_path, "--request", str(path), "--header", "x-route-test=keyless"],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert f"400 unsupported_parameter: {err['message']}" in explain.stdout, explain.stdout + explain.stderr
    r = httpx.post(gateway.url + "/v1/chat/completions", json=body, headers={"x-route-test": "alone"}, timeout=60)
    err = r.json()["error"]
    assert (r.status_code, err["param"], err["code"]) == (400, "prediction", "unsupported_parameter"), r.text
    assert "route 'local-alone' (rule 'alone') sends the request to no upstream" in err["message"], err
    r = httpx.post(gateway.url + "/v1/chat/completions", json=body, timeout=60)   # local-only, agg as fallback
    assert (r.headers["x-tandem-route"], r.headers["x-tandem-backend"]) == ("local-only", "agg"), r.text


def test_ready_and_models(gateway):
    ready = httpx.get(gateway.url + "/health/ready").json()
    assert ready["ready"] and ready["backends"]["local"]["available"] and ready["backends"]["agg"]["available"], ready
    assert [m.id for m in client(gateway).models.list()] == ["smollm2"]


def _request(backend, body: dict, request_id: str, rendered: bool = True) -> tuple[GatewayRequest, dict]:
    """The gateway's request value for ``body`` (public model "public", rendered as routing renders it when
    ``rendered``) and the body the local backend receives."""
    endpoint = "chat/completions" if "messages" in body else "embeddings" if "input" in body else "completions"
    req = replace(check_request({"model": "public", **body}, endpoint, None, request_id=request_id),
                  public_model="public")
    if rendered:
        req = replace(req, rendered=backend.render(endpoint, req.body))
    return req, {**req.body, "model": backend.served_model_name}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def tiny_backend(tiny_model):
    """A started in-process ``LocalBackend`` on the tiny model, shared by the tests that only send it requests
    (building and starting one took about 10 s a test on a busy 2-core box)."""
    backend = LocalBackend("local", LocalBackendConfig(type="local", engine=EngineConfig(
        model=tiny_model, dtype="float32", kv_cache_memory="64MiB")))
    await backend.start()
    yield backend
    await backend.aclose()


@pytest.mark.asyncio(loop_scope="module")
async def test_routing_count_is_the_engines_prompt(tiny_backend):
    """The prompt length routing reads (``LocalBackend.render``) is the prompt the engine runs
    (``usage.prompt_tokens``), whatever template, tool and special-token options the client sets; the gateway's
    own fields (``priority``) and the model name do not change it."""
    backend = tiny_backend
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    tools = [{"type": "function", "function": {"name": "add", "description": "Add two numbers.", "parameters": {
        "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}}]
    for i, body in enumerate([{"messages": msgs}, {"messages": msgs, "add_generation_prompt": False},
                              {"messages": msgs, "add_special_tokens": True}, {"messages": msgs, "tools": tools},
                              {"prompt": "Hello there"}, {"prompt": ["Hello there", "Hi"]}, {"prompt": [[5, 6, 7], [8]]},
                              {"prompt": "Hello there", "add_special_tokens": False},
                              {"prompt": "Hello there, how are you", "truncate_prompt_tokens": 4},
                              {"messages": msgs, "truncate_prompt_tokens": 6},
                              # embeddings were counted by the ~4-characters estimate (a policy trial)
                              {"input": "Hello there"}, {"input": ["Hello", "Hi there, you"]}, {"input": [[5, 6, 7]]},
                              {"input": "Hello there, how are you", "truncate_prompt_tokens": 3},
                              {"input": "Hello there", "add_special_tokens": False}]):
        req, _ = _request(backend, {**body, "priority": "high"}, f"count-{i}")
        extra = {} if "input" in body else {"max_tokens": 1}
        _, engine_body = _request(backend, {**body, **extra}, f"count-{i}", rendered=False)
        reply = await backend.send(replace(req, rendered=None), engine_body)   # the engine renders it itself
        assert req.rendered.prompt_tokens == json.loads(reply.body)["usage"]["prompt_tokens"], body
    longest = backend.render("embeddings", {"input": ["Hi", "Hello there, how are you today"]})
    assert longest.longest_prompt_tokens == backend.render("embeddings", {"input": "Hello there, how are you today"}
                                                           ).prompt_tokens
    assert backend.render("completions", {"prompt": ""}) is None    # refused: the estimate counts


@pytest.mark.asyncio(loop_scope="module")
async def test_the_engine_runs_routings_rendering(tiny_backend):
    """A rendering handed over with the request is what the engine runs: it does not parse or tokenize the body
    again (a rendering of another prompt shows in ``usage``), still checks the model the body names, and labels
    the answer with the gateway's id and public model itself (no relabelling pass)."""
    backend = tiny_backend
    long_body = {"prompt": "one two three four five six seven eight", "max_tokens": 1}
    long, _ = _request(backend, long_body, "long")
    short, short_body = _request(backend, {"prompt": "one", "max_tokens": 1}, "own")
    own = json.loads((await backend.send(short, short_body)).body)
    assert (own["id"], own["model"]) == ("cmpl-own", "public")
    reply = json.loads((await backend.send(replace(short, rendered=long.rendered), short_body)).body)
    assert reply["usage"]["prompt_tokens"] == long.rendered.prompt_tokens > own["usage"]["prompt_tokens"]
    long_stream, _ = _request(backend, {**long_body, "stream": True,
                                        "stream_options": {"include_usage": True}}, "long-stream")
    short_stream, body = _request(backend, {"prompt": "one", "max_tokens": 1, "stream": True}, "handed-stream")
    stream = await backend.open_stream(replace(short_stream, rendered=long_stream.rendered), body)
    events = [ev async for batch in stream for ev in batch]
    assert events[-1].done and not any(ev.done for ev in events[:-1])
    last = events[-2]
    assert (last.id, last.model, last.usage["prompt_tokens"]) == (
        "cmpl-handed-stream", "public", long.rendered.prompt_tokens)
    with pytest.raises(BackendError) as e:
        await backend.send(long, {**short_body, "model": "nope"})
    assert e.value.status == 404
    # embeddings: the rendering's token ids are embedded (tokenized once), -1 truncation applied by the call
    long_embed, _ = _request(backend, {"input": long_body["prompt"]}, "long-embed")
    short_embed, body = _request(backend, {"input": "one"}, "short-embed")
    reply = json.loads((await backend.send(replace(short_embed, rendered=long_embed.rendered), body)).body)
    assert reply["usage"]["prompt_tokens"] == long_embed.rendered.prompt_tokens > 1


def _local_config(tiny_model) -> GatewayConfig:
    """A config with one local backend on the tiny model."""
    return GatewayConfig.model_validate({
        "models": [{"name": "m"}], "backends": {"local": {"type": "local", "engine": {
            "model": tiny_model, "dtype": "float32", "kv_cache_memory": "64MiB"}}},
        "routes": {"r": {"targets": [{"backend": "local"}]}}, "policy": {"default_route": "r"}})


def _probed_local(tiny_model) -> tuple[GatewayConfig, Resilience, LocalBackend]:
    """A config with one local backend on the tiny model, its resilience layer probing it, and the (unstarted)
    backend."""
    cfg = _local_config(tiny_model)
    layer = Resilience(cfg)
    backend = LocalBackend("local", cfg.backends["local"])
    layer.start(lambda: {"local": backend})
    return cfg, layer, backend


async def _started_then_killed(backend: LocalBackend):
    """Start ``backend``'s engine and SIGKILL its core: (the dead engine, a deadline 30 s on, monotonic)."""
    import signal

    await backend.start()
    first = backend.engine
    os.kill(first.core_pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while first.is_alive and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return first, deadline


async def test_a_probe_during_the_load_does_not_outlive_it(tiny_model):
    """The active prober runs from gateway start, while the local engine is loading. Loading is no failure:
    once the engine is up, ``/health/ready``'s view (``Resilience.status``) says available at once, not
    after the next probe round (a failed probe counted for three rounds, 30 s by default)."""
    cfg, layer, backend = _probed_local(tiny_model)
    try:
        await layer.prober.probe_once()                     # a round during the load
        backends, _ = await layer.status(cfg.routes, {"local": backend})
        assert backends["local"] == {"available": False, "reason": "engine is loading"}
        await backend.start()
        backends, _ = await layer.status(cfg.routes, {"local": backend})
        assert backends["local"] == {"available": True, "reason": ""}
        assert await layer.prober.probe_once() == {"local": True}
    finally:
        await layer.stop()
        await backend.aclose()


async def test_an_engine_whose_core_died_is_restarted(tiny_model):
    """An operator trial killed the engine core: the backend stayed "available" while every request failed, the
    breaker cycled open and half-open for good and nothing brought the engine back. The next probe round finds
    it dead, marks the backend unavailable (why, and that it restarts) and loads a new engine, which serves."""
    cfg, layer, backend = _probed_local(tiny_model)
    try:
        first, deadline = await _started_then_killed(backend)
        assert await layer.prober.probe_once() == {"local": False}
        backends, _ = await layer.status(cfg.routes, {"local": backend})
        assert not backends["local"]["available"] and "engine core died" in backends["local"]["reason"]
        assert "restarting" in backends["local"]["reason"] and backend.restarts == 1
        with pytest.raises(BackendError) as e:       # meanwhile: unavailable, never a hang
            await backend.send(*_request(backend, {"prompt": "one", "max_tokens": 1}, "during", rendered=False))
        assert e.value.status == 503
        while not backend.available and time.monotonic() < deadline + 60:
            await asyncio.sleep(0.1)
        assert backend.available and backend.engine is not first and backend.engine.is_alive
        reply = json.loads((await backend.send(*_request(backend, {"prompt": "one", "max_tokens": 2}, "after"))).body)
        assert reply["usage"]["completion_tokens"] == 2
        assert await layer.prober.probe_once() == {"local": True}
    finally:
        await layer.stop()
        await backend.aclose()


async def test_a_dead_engine_is_restarted_by_the_request_that_meets_it_with_probing_off(tiny_model):
    """With ``resilience.health.interval_s: 0`` nothing probed the engine, so a killed core was never restarted (an
    observability trial: 40 s and counting, every request a 503 before its fallback). The first request to meet
    the dead engine marks it unavailable and starts a new one; it gets the 503 (its fallbacks serve it)."""
    backend = LocalBackend("local", _local_config(tiny_model).backends["local"])     # no prober at all
    try:
        first, deadline = await _started_then_killed(backend)
        with pytest.raises(BackendError) as e:
            await backend.send(*_request(backend, {"prompt": "one", "max_tokens": 1}, "meets", rendered=False))
        assert e.value.status == 503 and "engine core died" in e.value.message and backend.restarts == 1
        while not backend.available and time.monotonic() < deadline + 60:
            await asyncio.sleep(0.1)
        assert backend.engine is not first and backend.engine.is_alive
        reply = json.loads((await backend.send(*_request(backend, {"prompt": "one", "max_tokens": 2}, "after"))).body)
        assert reply["usage"]["completion_tokens"] == 2 and backend.restarts == 1
    finally:
        await backend.aclose()


async def test_a_restarted_engine_is_served_at_once_not_after_its_breakers_cooldown(tiny_model):
    """A stress trial killed the engine core with 8 streams open: their failures opened the local target's
    breaker (30 s), the engine was back in ~6 s, and every request got 503 until the breaker half-opened. A
    restarted engine is new: its targets' breakers are closed once it is loaded. Here the breaker is opened as
    those failures open it (recorded failures) with a cooldown far past the test, then the core is killed.
    The vLLM metrics follow the new engine (an SRE's trial: they stayed flat after a restart) and the restart
    is counted."""
    import signal

    from gateway.config.compile import load_config_text
    from gateway.runtime import Gateway
    from tests.gateway.support import serve_ready

    text = ("reload: {watch: false}\nobservability:\n  logs: {requests: false}\nmodels:\n  - name: m\n"
            f"backends:\n  local:\n    type: local\n    engine: {{model: {tiny_model}, dtype: float32, "
            "kv_cache_memory: 64MiB}\nroutes:\n  r:\n    targets: [{backend: local}]\n"
            "resilience:\n  health: {interval_s: 0}\n  retry: {max_attempts: 1}\n"
            "  breaker: {consecutive_failures: 3, open_s: 600}\npolicy:\n  default_route: r\n")
    gw = Gateway(None, load_config_text(text), start_engine=True)
    server, task, url = await serve_ready(gw)
    try:
        local, breakers = gw.snapshot.local, gw.resilience.breakers
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            r = await c.post("/v1/completions", json={"model": "m", "prompt": "one", "max_tokens": 2})
            assert r.status_code == 200, r.text
            before = _scraped(await c.get("/metrics"))
        assert before["vllm:generation_tokens_total"] == 2 and before["tandem_engine_restarts_total"] == 0
        streaming = httpx.AsyncClient(base_url=url, timeout=60)     # a stream in flight when the core dies
        stream = await streaming.send(streaming.build_request("POST", "/v1/completions", json={
            "model": "m", "prompt": "one", "max_tokens": 1000, "ignore_eos": True, "stream": True}), stream=True)
        lines = stream.aiter_lines()
        while not (await anext(lines)).startswith("data: {"):
            pass
        for _ in range(3):
            await breakers.record("local", False, status=500)
        assert (await breakers.get("local")).state == "open"
        first = local.engine
        os.kill(first.core_pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while first.is_alive and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        rest = [line async for line in lines]
        await streaming.aclose()
        assert any('"error"' in line for line in rest), rest[-3:]
        with pytest.raises(RuntimeError):
            await local.probe()                      # the probe finds it dead and restarts it
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:   # loading again: as at start (an SRE
            # trial's gateway said ready, and its clients got 502 / 503s the SDKs must not retry)
            await _answers_engine_loading(c)
        while (local.restarts == 0 or not local.available or local.engine is first) \
                and time.monotonic() < deadline + 120:
            await asyncio.sleep(0.1)
        for _ in range(50):                          # the restart's last step closes the breaker
            if (await breakers.get("local")).state == "closed":
                break
            await asyncio.sleep(0.1)
        assert (await breakers.get("local")).state == "closed"
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            r = await c.post("/v1/completions", json={"model": "m", "prompt": "one", "max_tokens": 2})
            assert r.status_code == 200, r.text
            after = _scraped(await c.get("/metrics"))
        assert after["tandem_engine_restarts_total"] == 1 and after["vllm:num_requests_running"] == 0
        # the stream the core took with it finished as an "error" (an observability trial's was never counted)
        assert after["vllm:request_success_total"] == before["vllm:request_success_total"] + 2
        assert after['vllm:request_success_total{finished_reason="error"}'] == 1
        # killed again, with nothing probing: the request that meets the dead engine gets the same 503
        second = local.engine
        os.kill(second.core_pid, signal.SIGKILL)
        while second.is_alive and time.monotonic() < deadline + 180:
            await asyncio.sleep(0.05)
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            await _answers_engine_loading(c)
    finally:
        server.should_exit = True
        await task                                   # the app's shutdown stops the gateway and its engine


async def _answers_engine_loading(c: httpx.AsyncClient) -> None:
    """A completion on a gateway whose only engine is restarting: 503 ``engine_loading`` with ``Retry-After``, which
    the SDKs retry (no ``x-should-retry: false``), and ``/health/ready`` 503 ``not_ready``."""
    r = await c.post("/v1/completions", json={"model": "m", "prompt": "one", "max_tokens": 2})
    assert (r.status_code, r.json()["error"]["code"]) == (503, "engine_loading"), r.text
    assert r.headers["retry-after"] == "5" and "x-should-retry" not in r.headers
    r = await c.get("/health/ready")
    assert (r.status_code, r.json()["status"]) == (503, "not_ready"), r.text


def _scraped(r: httpx.Response) -> dict[str, float]:
    """A /metrics answer's samples summed per name (labels dropped), and per name and ``finished_reason``."""
    from prometheus_client.parser import text_string_to_metric_families

    assert r.status_code == 200, r.text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
            if "finished_reason" in sample.labels:   # and per finish reason
                key = f'{sample.name}{{finished_reason="{sample.labels["finished_reason"]}"}}'
                out[key] = out.get(key, 0.0) + sample.value
    return out


def test_route_explain_gives_the_gateways_decision(gateway, tmp_path):
    """A prompt whose 4-chars-per-token estimate (~260) and real token count (~500) fall on both sides of the
    `long` rule (prompt_tokens > 400): `tandem route explain` counts like the gateway and names the same route."""
    rng = random.Random(7)
    text = " ".join("".join(rng.choice("qxzjkvwy") for _ in range(rng.randint(3, 8))) for _ in range(180))[:1000]
    body = {"model": "smollm2", "messages": [{"role": "user", "content": text}], "max_tokens": 1}
    served = client(gateway).chat.completions.with_raw_response.create(**body)
    req = tmp_path / "req.json"
    req.write_text(json.dumps(body))
    r = subprocess.run([sys.executable, "-m", "gateway.commands", "route", "explain", "--config",
                        gateway.config_path, "--request", str(req), "--json"], cwd=ROOT, capture_output=True,
                       text=True, env={**os.environ, "AGG_TEST_KEY": "x"}, timeout=120)
    assert r.returncode == 0, r.stderr
    assert served.headers["x-tandem-route"] == "aggregator"
    assert json.loads(r.stdout)["route"] == served.headers["x-tandem-route"]


def test_embeddings_input_that_fits_is_not_refused_on_an_estimate(gateway):
    """The gateway skips a backend as too small only on a counted prompt: 400 words of "hello " are ~400 SmolLM2
    tokens (within the local engine's 512) but 600 by the ~4-characters-a-token estimate, which refused them
    with 400 "resulted in 600 tokens". Input that really does not fit gets the engine's own 400 with its count."""
    alone = {"x-route-test": "alone"}
    r = client(gateway).embeddings.create(model="smollm2", input="hello " * 400, extra_headers=alone)
    assert 400 <= r.usage.prompt_tokens < 512 and len(r.data) == 1
    with pytest.raises(openai.BadRequestError) as e:
        client(gateway).embeddings.create(model="smollm2", input="hello " * 600, extra_headers=alone)
    error = e.value.body
    assert (error["param"], error["code"]) == ("input", "context_length_exceeded")
    counted = int(error["message"].split("resulted in ")[1].split(" ")[0])
    assert 512 < counted < 700   # the engine's count (~600), not the estimate (900)
