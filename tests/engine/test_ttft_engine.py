"""The TTFT prediction through a real engine (the tiny random Llama, its core in its own process): the front
end's mirror of the prefix cache follows the core's cache, requests sent but not yet in the core's state count,
and the step costs are measured."""

from __future__ import annotations

import asyncio

import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineArgs
from engine.sampling_params import SamplingParams
from tests.tiny_models import save_byte_level_llama

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return save_byte_level_llama(tmp_path_factory.mktemp("tiny"))


def test_prediction_through_the_core_process(tiny_model):
    async def main():
        eng = AsyncEngine(EngineArgs(model=tiny_model, kv_cache_memory="64MiB", engine_core_process=True,
                                     block_size=16))
        await eng.start()
        try:
            prompt = [2 + i % 250 for i in range(400)]
            cold = eng.predict_ttft(prompt)
            assert cold is not None and cold.parts["uncached"] == 400
            async for _ in eng.generate(prompt, SamplingParams(max_tokens=4), "a"):
                pass
            warm = eng.predict_ttft(prompt + [7] * 20)
            assert warm.parts["uncached"] == 420 - 400 // 16 * 16
            assert eng.get_stats().ttft.step_s != 0.05   # measured, not the initial guess
            long = [2 + (7 * i) % 250 for i in range(1500)]
            gens = [eng.generate(long, SamplingParams(max_tokens=2), f"b{i}") for i in range(3)]
            firsts = [asyncio.ensure_future(g.__anext__()) for g in gens]
            await asyncio.sleep(0)   # the three are sent; the core may not have stepped yet
            burst = eng.predict_ttft(prompt[:50])
            assert burst.parts["ahead"] >= 1
            await asyncio.gather(*firsts)
            for g in gens:
                async for _ in g:
                    pass
        finally:
            await eng.shutdown()

    asyncio.run(main())


def test_engine_server_answers_a_ttft_prediction(tiny_model, tmp_path):
    """``POST /v1/ttft`` on ``tandem engine serve``: the prediction for a body as the completions endpoints
    take it; a prompt the engine has served comes back mostly cached."""
    import httpx
    import openai

    from loadtests.procs import Server, free_port, tandem_cmd

    port = free_port()
    srv = Server([*tandem_cmd("engine", "serve"), "--model", tiny_model, "--port", str(port), "--kv-cache-memory",
                  "64MiB", "--served-model-name", "tiny", "--uvicorn-log-level", "warning"],
                 f"http://127.0.0.1:{port}/health", f"http://127.0.0.1:{port}", log_dir=tmp_path,
                 name="engine").wait_ready(120)
    try:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "x" * 300}], "max_tokens": 2}
        cold = httpx.post(srv.base_url + "/v1/ttft", json=body, timeout=30).json()
        assert cold["ttft_s"] > 0 and cold["uncached_tokens"] == cold["prompt_tokens"] > 300
        openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x").chat.completions.create(**body)
        warm = httpx.post(srv.base_url + "/v1/ttft", json=body, timeout=30).json()
        assert warm["uncached_tokens"] < 20 and "uncached of" in warm["explanation"]
        bad = httpx.post(srv.base_url + "/v1/ttft", json={"model": "tiny", "messages": "nope"}, timeout=30)
        assert bad.status_code == 400
    finally:
        srv.stop()
