"""Work on a big body runs off the event loop (``gateway/offload.py``) on every path that tokenizes: vLLM's
``/tokenize`` and ``/detokenize`` and Anthropic's ``/v1/messages/count_tokens`` rendered and tokenized 4 MB bodies
on the loop, so a security trial's two connections held every tenant's requests 5-19 s. A gateway with a
co-located engine (a tiny random Llama); the engine's handlers are wrapped to record the thread they run on."""

from __future__ import annotations

import threading

import httpx
import msgspec
import pytest

from gateway.offload import OFFLOAD_BYTES
from tests.gateway.backends.test_local import tiny_model  # noqa: F401 -- the module-scoped fixture
from tests.gateway.cache.test_response_cache import started

pytestmark = pytest.mark.slow


def _padded(body: dict, size: int) -> bytes:
    """``body`` as JSON with ``size`` spaces before its last brace: big in bytes, short in tokens."""
    raw = msgspec.json.encode(body)
    return raw[:-1] + b" " * size + b"}"


async def test_tokenization_and_count_tokens_of_big_bodies_run_off_the_loop(tiny_model):  # noqa: F811
    gw, server, task, client = await started(tiny_model)
    local = gw.snapshot.local
    threads: dict[str, list[int]] = {"tokenization": [], "render": []}

    def recording(name: str):
        real = getattr(local, name)

        def call(*args, **kwargs):
            threads[name].append(threading.get_ident())
            return real(*args, **kwargs)
        return call

    local.tokenization, local.render = recording("tokenization"), recording("render")
    messages = [{"role": "user", "content": "hello there"}]
    base = str(client.base_url).removesuffix("/v1/")
    json_type = {"content-type": "application/json"}
    try:
        async with httpx.AsyncClient(base_url=base, timeout=60) as c:
            small, big = [await c.post("/tokenize", content=_padded({"model": "tiny", "prompt": "hi"}, n),
                                       headers=json_type) for n in (0, OFFLOAD_BYTES)]
            detok = await c.post("/detokenize", content=_padded({"tokens": small.json()["tokens"]}, OFFLOAD_BYTES),
                                 headers=json_type)
            counted = await c.post("/v1/messages/count_tokens", headers=json_type,
                                   content=_padded({"model": "tiny", "messages": messages}, OFFLOAD_BYTES))
    finally:
        server.should_exit = True
        await task
    assert small.status_code == big.status_code == detok.status_code == counted.status_code == 200, counted.text
    assert small.json() == big.json() and detok.json()["prompt"] and counted.json()["input_tokens"] > 0
    loop = threading.get_ident()
    assert threads["tokenization"][0] == loop                    # a small body: at once, on the loop
    assert loop not in threads["tokenization"][1:] and len(threads["tokenization"]) == 3
    assert threads["render"] and loop not in threads["render"]  # count_tokens' rendering
