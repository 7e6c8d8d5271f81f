"""Admission's 429s as the official ``openai`` SDK (its default ``max_retries``: 2) reads them
(``gateway/http/exceptions.py``): one that its retries cannot pass (a request larger than a TPM limit, a spent
budget whose Retry-After is beyond the SDK's one-minute cap) says ``x-should-retry: false`` and is sent once; a
rate limit that frees up within the cap keeps its Retry-After alone, for the SDK to wait out. Real parts: the
gateway (the Litestar app under uvicorn, in this process), the fault-injecting upstream
(``tests/gateway/fault_upstream.py``), the SDK over httpx (its requests counted by an event hook)."""

from __future__ import annotations

import contextlib

import httpx
import openai
import pytest

from gateway.config.compile import load_config_text
from gateway.http.app import create_app
from gateway.runtime import Gateway
from tests.gateway.fault_upstream import FaultUpstream
from tests.gateway.support import serve_app, sha

BIG, BROKE, BUSY = "sk-tandem-big-0123456789abcdef", "sk-tandem-broke-0123456789abcd", "sk-tandem-busy-0123456789abcde"
POOR = "sk-tandem-poor-0123456789abcde"
HELLO = [{"role": "user", "content": "hello"}]


def config(up: FaultUpstream) -> str:
    return (f"reload: {{watch: false}}\nauth:\n  keys:\n"
            f"    - {{tenant: big, sha256: {sha(BIG)}, tpm: 100}}\n"
            f"    - {{tenant: broke, sha256: {sha(BROKE)}}}\n"
            f"    - {{tenant: busy, sha256: {sha(BUSY)}, rpm: 1}}\n"
            f"    - {{tenant: poor, sha256: {sha(POOR)}, rpm: 1}}\n"
            "limits: {window_s: 2}\n"
            "budgets:\n  tenants: {broke: {usd: 0.000001, period: day}, poor: {usd: 0.0001, period: day}}\n"
            "resilience:\n  health: {interval_s: 0}\nobservability:\n  logs: {requests: false}\n"
            "models:\n  - name: m1\n"
            f"backends:\n  up:\n    type: openai\n    base_url: {up.base_url}\n    prices: {{input: 1, output: 2}}\n"
            "routes:\n  r1:\n    targets: [{backend: up}]\npolicy:\n  default_route: r1\n")


@pytest.fixture
def up():
    with FaultUpstream("up") as u:
        yield u


@contextlib.asynccontextmanager
async def gateway(up: FaultUpstream):
    """The gateway's base URL and the list its SDK clients' requests are appended to."""
    gw = Gateway(None, load_config_text(config(up)), start_engine=False)
    server, task, url = await serve_app(create_app(gw))
    try:
        yield url, []
    finally:
        server.should_exit = True
        await task


def sdk(url: str, key: str, sent: list) -> openai.AsyncOpenAI:
    """The SDK with its default retries; every request it sends is appended to ``sent``."""

    async def note(request: httpx.Request) -> None:
        sent.append(request)

    return openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, timeout=20,
                              http_client=httpx.AsyncClient(event_hooks={"request": [note]}))


@pytest.mark.parametrize("key,max_tokens,code", [(BIG, 200, "rate_limit_exceeded"), (BROKE, 10, "budget_exceeded")],
                         ids=["larger-than-tpm", "budget-spent"])
async def test_a_429_the_sdk_cannot_pass_is_sent_once(up, key, max_tokens, code):
    async with gateway(up) as (url, sent):
        async with sdk(url, key, sent) as client:
            with pytest.raises(openai.RateLimitError) as exc:
                await client.chat.completions.create(model="m1", messages=HELLO, max_tokens=max_tokens)
    assert exc.value.body["code"] == code and exc.value.response.headers["x-should-retry"] == "false"
    assert len(sent) == 1 and up.calls == 0
    if code == "budget_exceeded":            # the period's end stays said, for the application
        assert int(exc.value.response.headers["retry-after"]) > 60


async def test_a_request_without_max_tokens_is_never_too_large_for_its_default(up):
    """An ops trial's ``tpm: 300`` key got a permanent 429 "Request too large" on every chat without
    ``max_tokens`` (the 512 completion tokens admission reserves then): the guess is held to the TPM limit, and the
    real usage is what is counted after."""
    async with gateway(up) as (url, sent):
        async with sdk(url, BIG, sent) as client:
            reply = await client.chat.completions.create(model="m1", messages=HELLO)    # tpm 100, no max_tokens
    assert reply.choices and up.calls == 1


async def test_a_rate_limit_freed_within_the_sdks_cap_is_left_to_the_sdk(up):
    async with gateway(up) as (url, _):
        async with httpx.AsyncClient(base_url=url, headers={"authorization": f"Bearer {BUSY}"}, timeout=20) as c:
            body = {"model": "m1", "messages": HELLO, "max_tokens": 5}
            assert (await c.post("/v1/chat/completions", json=body)).status_code == 200
            r = await c.post("/v1/chat/completions", json=body)
    assert r.status_code == 429 and int(r.headers["retry-after"]) <= 2 and "x-should-retry" not in r.headers


async def test_a_request_the_budget_refuses_uses_none_of_the_rate_limit(up):
    """Admission takes the rate limits first; a request its tenant's budget then refuses never reached a backend
    and gives its RPM/TPM admission back (before, a budget 429 used up an ``rpm: 1`` key's minute, so the cheap
    request after it was refused too)."""
    async with gateway(up) as (url, _):
        async with httpx.AsyncClient(base_url=url, headers={"authorization": f"Bearer {POOR}"}, timeout=20) as c:
            r = await c.post("/v1/chat/completions", json={"model": "m1", "messages": HELLO, "max_tokens": 500})
            assert r.status_code == 429 and r.json()["error"]["code"] == "budget_exceeded", r.text
            r = await c.post("/v1/chat/completions", json={"model": "m1", "messages": HELLO, "max_tokens": 1})
            assert r.status_code == 200, r.text
            r = await c.post("/v1/chat/completions", json={"model": "m1", "messages": HELLO, "max_tokens": 1})
    assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded", r.text   # rpm 1 holds
    assert up.calls == 1
