"""A batch of prompts (``/v1/completions`` with a prompt list, ``/v1/embeddings`` with an input list) is a set of
sequences, each of which must fit a context alone, as OpenAI and vLLM treat it: the rules' ``prompt_tokens`` and
the "fits the backend's context" check read its longest prompt, not their sum (a trial's three 900-token prompts
were refused as 2,703 tokens by a 2,048-token route and sent to the aggregators by the ``long-prompt`` rule). A real
gateway in this process, two fault upstreams on 127.0.0.1, token-id prompts (counted exactly)."""

from __future__ import annotations

import contextlib

import httpx
import pytest

from gateway.config.compile import load_config_text
from gateway.http.app import create_app
from gateway.runtime import Gateway
from tests.gateway.fault_upstream import FaultUpstream
from tests.gateway.support import serve_app, sha

KEY = "sk-tandem-batch-0123456789abcdef"


@pytest.fixture(scope="module")
def ups():
    with FaultUpstream("small") as small, FaultUpstream("big") as big:
        yield small, big


def config(small: FaultUpstream, big: FaultUpstream) -> str:
    def backend(name: str, up: FaultUpstream, context: int) -> str:
        return (f"  {name}:\n    type: openai\n    base_url: {up.base_url}\n    models: {{m1: up-model}}\n"
                f"    max_model_len: {context}\n    timeouts: {{connect_s: 2, read_s: 10, first_token_s: 5}}\n")
    return (f"reload: {{watch: false}}\nauth:\n  keys:\n    - {{tenant: t1, sha256: {sha(KEY)}}}\n"
            "resilience:\n  retry: {max_attempts: 1}\n  health: {interval_s: 0}\n"
            "observability:\n  logs: {requests: false}\nmodels:\n  - name: m1\n"
            f"backends:\n{backend('small', small, 1024)}{backend('big', big, 32768)}"
            "routes:\n  near:\n    targets: [{backend: small}]\n  far:\n    targets: [{backend: big}]\n"
            "policy:\n  default_route: near\n  rules:\n"
            "    - {name: long-prompt, match: {prompt_tokens: {gt: 1000}}, route: far}\n")


@contextlib.asynccontextmanager
async def gateway(cfg: str):
    gw = Gateway(None, load_config_text(cfg))
    server, task, url = await serve_app(create_app(gw))
    try:
        async with httpx.AsyncClient(base_url=url, headers={"authorization": f"Bearer {KEY}"}, timeout=20) as h:
            yield h
    finally:
        server.should_exit = True
        await task


@pytest.mark.parametrize("path, field", [("/v1/completions", "prompt"), ("/v1/embeddings", "input")])
async def test_a_batch_of_short_prompts_is_routed_and_fitted_by_its_longest(ups, path, field):
    small, big = ups
    small.reset(), big.reset()
    async with gateway(config(small, big)) as h:
        extra = {"max_tokens": 4} if field == "prompt" else {}
        r = await h.post(path, json={"model": "m1", field: [[7] * 600] * 3, **extra})
        assert r.status_code == 200, r.text      # 1,800 tokens in all, each prompt fits the 1,024 context alone
        assert (r.headers["x-tandem-rule"], r.headers["x-tandem-route"]) == ("default", "near")
        assert small.calls_by_path == {path: 1} and big.calls_by_path == {}
        r = await h.post(path, json={"model": "m1", field: [[7] * 20, [7] * 1100], **extra})
        assert r.status_code == 200, r.text      # one prompt past the threshold: the batch is a long one
        assert (r.headers["x-tandem-rule"], r.headers["x-tandem-route"]) == ("long-prompt", "far")
        assert big.calls_by_path == {path: 1}


async def test_a_prompt_longer_than_every_context_is_still_refused(ups):
    small, big = ups
    small.reset(), big.reset()
    cfg = config(small, big).replace("route: far", "route: near")   # nothing larger on the route
    async with gateway(cfg) as h:
        # the answer needs room too (a capacity trial: a prompt of exactly the context was sent to the engine)
        for prompt, max_tokens in (([7] * 1024, 1), ([7] * 1000, 25)):
            r = await h.post("/v1/completions", json={"model": "m1", "prompt": prompt, "max_tokens": max_tokens})
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
        assert small.calls == 0
        r = await h.post("/v1/completions", json={"model": "m1", "prompt": [7] * 1000, "max_tokens": 24})
        assert r.status_code == 200 and small.calls == 1   # 1,024 in all: fits
        small.reset()
        r = await h.post("/v1/completions", json={"model": "m1", "prompt": [[7] * 20, [7] * 1100], "max_tokens": 4})
    error = r.json()["error"]
    assert r.status_code == 400 and error["code"] == "context_length_exceeded", r.text
    assert "requested 1104 tokens (1100 in the prompt, 4 in the completion)" in error["message"] and small.calls == 0
