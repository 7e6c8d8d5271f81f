"""A hand-over on an SLO route, end to end: the gateway with a co-located engine (the embedded SmolLM2, one
seat, priority scheduling: steps of tens of ms, so that the requests below meet in the engine's queue in time)
and a fault-injector aggregator on 127.0.0.1. A request routed locally in time is overtaken in the engine's queue
by urgent ones; at its checkpoint the engine re-predicts it late and withdraws it, nothing computed, and the
aggregator answers it: once, with the engine's breaker untouched. A request the engine has started is never
withdrawn."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.gateway.observability.test_observability import families, value
from tests.gateway.support import FaultInjectorUpstream, serve_ready

pytestmark = pytest.mark.slow

SLO_MS = 1500


def config(agg: FaultInjectorUpstream) -> str:
    return ("reload: {watch: false}\nresilience:\n  health: {interval_s: 0}\n"
            "observability:\n  logs: {requests: false}\n"
            "models:\n  - name: tiny\n"
            "backends:\n  local:\n    type: local\n    prices: {input: 0.5, output: 1.5}\n"
            "    engine: {served_model_name: tiny, kv_cache_memory: 64MiB, max_model_len: 1024, max_num_seqs: 1,"
            " scheduling_policy: priority}\n"
            f"  agg:\n    type: openai\n    base_url: {agg.base_url}\n    api_key_env: TEST_UPSTREAM_KEY\n"
            "    models: {tiny: agg-model}\n    prices: {input: 5, output: 10}\n"
            "routes:\n"
            f"  slo:\n    targets: [{{backend: local}}, {{backend: agg}}]\n    slo: {{ttft_ms: {SLO_MS}}}\n"
            "  urgent:\n    targets: [{backend: local}]\n"
            "  direct:\n    targets: [{backend: agg}]\n"
            "policy:\n  default_route: slo\n  rules:\n"
            "    - {name: urgent, match: {priority: {lte: 0}}, route: urgent}\n"
            "    - {name: direct, match: {priority: {gte: 5}}, route: direct}\n")


@pytest.mark.parametrize("stream", [True, False])
async def test_a_request_overtaken_in_the_queue_is_handed_over_before_it_starts(monkeypatch, stream):
    from gateway.config.compile import load_config_text
    from gateway.runtime import Gateway

    monkeypatch.setenv("TEST_UPSTREAM_KEY", "k")
    agg = FaultInjectorUpstream("agg").start()
    gw = Gateway(None, load_config_text(config(agg)), start_engine=True)
    server, task, url = await serve_ready(gw)
    try:
        async with httpx.AsyncClient(base_url=url, timeout=120) as c:
            def body(priority: int, max_tokens: int, text: str = "hi") -> dict:
                return {"model": "tiny", "messages": [{"role": "user", "content": text}], "stream": True,
                        "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "priority": priority}

            async def send(b: dict) -> tuple[httpx.Headers, str]:
                async with c.stream("POST", "/v1/chat/completions", json=b) as r:
                    assert r.status_code == 200
                    return r.headers, (await r.aread()).decode()

            # the aggregator's TTFT measured once: a hand-over needs to know how late it may come
            assert (await send(body(5, 4)))[0]["x-tandem-backend"] == "agg"
            started = await send(body(1, 4))        # an idle engine: local, started at once, never withdrawn
            assert started[0]["x-tandem-backend"] == "local" and started[0]["x-tandem-attempts"] == "1"
            near_end = asyncio.Event()

            async def hold_the_seat() -> tuple[httpx.Headers, str]:
                tokens = 0   # with logprobs, every token comes in an event (even bytes of a character held back)
                try:
                    async with c.stream("POST", "/v1/chat/completions", json={**body(0, 60), "logprobs": True}) as r:
                        async for line in r.aiter_lines():
                            if line.startswith("data: {"):
                                for ch in json.loads(line[6:]).get("choices") or ():
                                    tokens += len((ch.get("logprobs") or {}).get("content") or ())
                            if tokens >= 40:   # 20 tokens left: a short wait for the seat
                                near_end.set()
                        return r.headers, ""
                finally:
                    near_end.set()

            first = asyncio.ensure_future(hold_the_seat())
            await near_end.wait()
            x = asyncio.ensure_future(send({**body(1, 4, "late"), "stream": stream}))   # in time: a short seat wait
            await asyncio.sleep(0.02)
            # three long answers jump ahead of it: its first token is seconds away
            # (900 tokens: the first of them takes the seat when the held one ends, and must not finish before the
            # test cancels it, even on a loaded machine: 200 tokens of the tiny model did once in a full suite run)
            urgent = [asyncio.ensure_future(send(body(0, 900, f"u{i}"))) for i in range(3)]
            headers, text = await x
            assert headers["x-tandem-backend"] == "agg", headers["x-tandem-slo"]
            assert headers["x-tandem-attempts"] == "2", headers["x-tandem-slo"]
            assert "hand over to agg" in headers["x-tandem-slo"]
            if stream:
                assert "tok0" in text and text.rstrip().endswith("data: [DONE]")
            else:
                assert json.loads(text)["choices"][0]["message"]["content"] == "hello from agg"
            assert [call["body"]["messages"][0]["content"] for call in agg.calls] == ["hi", "late"]
            assert (await first)[0]["x-tandem-backend"] == "local"
            for u in urgent:   # the client leaves: the engine aborts them
                u.cancel()
            await asyncio.gather(*urgent, return_exceptions=True)
            fams = families((await c.get("/metrics")).text)
            breaker = await gw.resilience.breakers.get("local")
    finally:
        server.should_exit = True
        await task
        agg.stop()
    assert breaker.state == "closed" and breaker.consecutive_failures == 0
    assert value(fams, "tandem_requests_total", model="tiny", route="slo", backend="agg", status=200,
                 attempt="fallback") == 1
    if not stream:   # a stream's local attempt answered 200 (a role event) before the engine's error
        assert value(fams, "tandem_upstream_attempts_total", backend="local", attempt="initial",
                     outcome="withdrawn") == 1
    assert value(fams, "vllm:request_success_total", model_name="tiny", finished_reason="length") == 2   # no "late"
