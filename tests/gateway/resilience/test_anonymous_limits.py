"""A config without virtual keys (anonymous mode, loopback only) limits its requests under the tenant name
``anonymous``, the name its usage and budgets are kept under: an operator's trial set
``limits.tenants.anonymous: {rpm: 30}`` (logged as "limits added") and 40 requests all got 200, the limit
looked up under the raw empty tenant. A real gateway app on 127.0.0.1, the official openai client, a fault
upstream as the backend."""

from __future__ import annotations

import openai
import pytest

from gateway.config.compile import load_config_text
from gateway.http.app import create_app
from gateway.runtime import Gateway
from tests.gateway.fault_upstream import FaultUpstream
from tests.gateway.support import serve_app


def config(up: FaultUpstream) -> str:
    return ("reload: {watch: false}\nlimits:\n  tenants: {anonymous: {rpm: 2}}\n"
            "resilience:\n  retry: {max_attempts: 1}\n  health: {interval_s: 0}\n"
            "observability:\n  logs: {requests: false}\nmodels:\n  - name: m1\n"
            f"backends:\n  up:\n    type: openai\n    base_url: {up.base_url}\n"
            "routes:\n  r1:\n    targets: [{backend: up}]\npolicy:\n  default_route: r1\n")


async def test_requests_without_a_key_are_limited_as_the_anonymous_tenant():
    with FaultUpstream("up") as up:
        gw = Gateway(None, load_config_text(config(up)))
        server, task, url = await serve_app(create_app(gw))
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=20)
        try:
            ask = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
            for _ in range(2):
                r = await client.chat.completions.with_raw_response.create(**ask)
                assert r.http_response.status_code == 200 and r.headers.get("x-ratelimit-limit-requests") == "2"
            with pytest.raises(openai.RateLimitError) as e:     # rpm 2: the third is refused, never sent upstream
                await client.chat.completions.create(**ask)
            assert e.value.code == "rate_limit_exceeded" and len(up.requests) == 2
        finally:
            await client.close()
            server.should_exit = True
            await task
