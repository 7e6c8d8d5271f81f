"""Streams that outlive their replica (issue #30): a ``prefix_affinity`` route over three real ``tandem engine
serve`` replicas (a tiny random Llama, one character per token) with ``resume: true``; the replica serving a
stream is SIGKILLed mid-stream and the client, reading with the official ``openai`` SDK, gets the same text,
finish reason and usage as a run without a failure, greedy and seeded, in one uninterrupted stream."""

from __future__ import annotations

import logging
import os
import signal

import httpx
import openai
import pytest

from tests.gateway.support import engine_replicas, serve_app

pytestmark = pytest.mark.slow
NAMES = ("r1", "r2", "r3")
# tokens a stream asks for: the replica is killed when the client has read 40, and must still be generating then
# (a replica makes them several times faster than the client reads them through the in-process gateway)
TOKENS = 1500


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    yield from engine_replicas(tmp_path_factory, NAMES)


def config(replicas, log_path=None) -> str:
    backends = "".join(f"  {n}:\n    type: openai\n    base_url: {s.base_url}/v1\n    models: {{tiny: bench}}\n"
                       f"    max_model_len: 4096\n" for n, s in replicas.items())
    logs = f"{{destination: '{log_path}'}}" if log_path else "{requests: false}"
    return (f"reload: {{watch: false}}\nobservability:\n  logs: {logs}\n"
            "resilience:\n  breaker: {consecutive_failures: 1, open_s: 60}\n  health: {interval_s: 0}\n"
            f"models:\n  - name: tiny\nbackends:\n{backends}"
            "routes:\n  replicas:\n    select: prefix_affinity\n    resume: true\n    resume_attempts: 2\n"
            "    affinity: {metrics_interval_s: 0.1}\n"
            f"    targets: [{', '.join(f'{{backend: {n}}}' for n in NAMES)}]\n"
            "policy:\n  default_route: replicas\n  rules: []\n")


async def read(client, body: dict, kill=None):
    """(text, finish reason, usage, headers) of one stream; ``kill(backend)`` after 40 content chunks."""
    async with client.chat.completions.with_streaming_response.create(**body) as resp:
        text, finish, usage, seen = "", None, None, 0
        async for chunk in await resp.parse():
            for c in chunk.choices:
                text += c.delta.content or ""
                finish = c.finish_reason or finish
                assert "token_ids" not in (c.model_extra or {})      # the gateway's, removed for the client
            usage = chunk.usage or usage
            seen += 1
            if kill is not None and seen == 40:
                kill(resp.headers["x-tandem-backend"])
        return text, finish, usage, resp.headers


async def test_a_stream_survives_its_replica_sigkill(replicas, caplog, tmp_path):
    import json

    from gateway.config.compile import load_config_text
    from gateway.http.app import create_app
    from gateway.runtime import Gateway

    log_path = tmp_path / "requests.jsonl"
    gw = Gateway(None, load_config_text(config(replicas, log_path)), start_engine=False)
    server, task, url = await serve_app(create_app(gw))
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    killed: list[str] = []

    def kill(backend: str) -> None:
        os.killpg(os.getpgid(replicas[backend].pid), signal.SIGKILL)
        killed.append(backend)

    msgs = [{"role": "user", "content": "tell me a long story"}]
    cases = [dict(temperature=0, extra_body={"ignore_eos": True}),
             dict(temperature=1.0, seed=11, extra_body={"ignore_eos": True})]
    try:
        references = [await read(client, dict(model="tiny", messages=msgs, max_tokens=TOKENS, stream=True,
                                              stream_options={"include_usage": True}, **p)) for p in cases]
        unseeded = await read(client, dict(model="tiny", messages=msgs, max_tokens=5, stream=True))
        assert int(unseeded[3]["x-tandem-seed"]) >= 0                 # sampled without a seed: one was chosen
        with caplog.at_level(logging.INFO, logger="tandem.gateway.resume"):
            resumed = [await read(client, dict(model="tiny", messages=msgs, max_tokens=TOKENS, stream=True,
                                               stream_options={"include_usage": True}, **p), kill) for p in cases]
        async with httpx.AsyncClient() as h:
            metrics = (await h.get(url + "/metrics")).text
    finally:
        server.should_exit = True
        await task
    assert len(killed) == 2 and killed[0] != killed[1], (killed, [(r[1], r[2], len(r[0])) for r in resumed])
    # the request log and metrics say a replica died under each (a scale-out trial: "ok", credited to the dead one)
    lines = {x["request_id"]: x for x in map(json.loads, log_path.read_text().splitlines())}
    for (*_, headers), dead in zip(resumed, killed):
        line = lines[headers["x-request-id"]]
        assert line["backend"] != dead and line["failed_attempts"] == [
            {"backend": dead, "outcome": "stream_interrupted", "status": 200}], line
        assert f'tandem_stream_errors_total{{backend="{dead}",model="tiny"}} 1.0' in metrics, metrics
    assert caplog.text.count("stream resumed on") == 2, caplog.text
    for ref, got in zip(references, resumed):
        assert ref[1] == "length" and ref[2].completion_tokens == TOKENS
        assert got[:2] == ref[:2]                                         # text, finish reason
        assert (got[2].prompt_tokens, got[2].completion_tokens) == (ref[2].prompt_tokens, TOKENS)
