"""``POST /v1/ttft`` validates a body with the function its endpoint uses (``prepare_chat`` /
``prepare_completion``): every body the endpoint refuses gets the same status and error here (issue 49: a 9,000-
token prompt, prompt + max_tokens over the context, an unknown model, an invalid schema and ``logit_bias`` were
answered 200 with a prediction; a new-user trial: ``resume_token_ids`` chat refuses, too)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineArgs
from tests.tiny_models import save_byte_level_llama


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return save_byte_level_llama(tmp_path_factory.mktemp("tiny-ttft-validation"))


def _refused_bodies(max_model_len: int, vocab: int) -> list[tuple[str, dict]]:
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
    comp = {"model": "tiny", "prompt": "hello", "max_tokens": 4}
    schema = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "nope"}}}
    return [
        ("chat", {**chat, "messages": [{"role": "user", "content": "x" * 9000}]}),     # over the context
        ("chat", {**chat, "max_tokens": max_model_len}),                               # prompt + max_tokens over
        ("chat", {**chat, "model": "other"}),                                          # unknown model: 404
        ("chat", {**chat, "response_format": schema}),                                 # invalid schema
        ("chat", {**chat, "logit_bias": {str(vocab): 1}}),                             # past the vocabulary
        ("chat", {**chat, "stream": True, "resume_token_ids": [[-1]]}),                 # not a token id
        ("chat", {**chat, "stream": True, "resume_token_ids": [[vocab]]}),              # past the vocabulary
        ("chat", {**chat, "stream": True, "resume_token_ids": [[1], [2]]}),             # two lists, n=1
        ("completion", {**comp, "prompt": "x" * 9000}),
        ("completion", {**comp, "max_tokens": max_model_len}),
        ("completion", {**comp, "model": "other"}),
        ("completion", {**comp, "logit_bias": {str(vocab): 1}}),
    ]


async def test_ttft_refuses_what_its_endpoint_refuses_with_the_same_error(tiny_model):
    import uvicorn

    from engine.entrypoints.server import KEEP_ALIVE_S, build_app
    from tests.conftest import free_port

    engine = AsyncEngine(EngineArgs(model=tiny_model, dtype="float32", kv_cache_memory="16MiB",
                                    engine_core_process=False, served_model_name="tiny"))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(engine), host="127.0.0.1", port=port, log_level="warning",
                                           timeout_keep_alive=KEEP_ALIVE_S))
    task = asyncio.create_task(server.serve())
    try:
        while not (server.started and engine.ready):
            assert not task.done()
            await asyncio.sleep(0.02)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
            ok = await client.post("/v1/ttft", json={"model": "tiny", "prompt": "hello", "max_tokens": 4})
            assert ok.status_code == 200 and ok.json()["ttft_s"] > 0
            for kind, body in _refused_bodies(engine.max_model_len, engine.tokenizer.vocab_size):
                path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
                endpoint = await client.post(path, json=body)
                predicted = await client.post("/v1/ttft", json=body)
                assert endpoint.status_code in (400, 404), (kind, body, endpoint.text)
                assert (predicted.status_code, predicted.json()) == (endpoint.status_code, endpoint.json()), body
    finally:
        server.should_exit = True
        await task
