"""Fixtures of the rollout tests: gateways in this process (the Litestar app under uvicorn) on fault-injecting
upstreams, their admin API over HTTP."""

from __future__ import annotations

import contextlib

import httpx

from gateway.config.compile import load_config_text
from gateway.http.app import create_app
from gateway.runtime import Gateway
from tests.gateway.support import serve_app

ADMIN_TOKEN = "admin-token-rollouts-31"
ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}


def two_upstreams(stable, cand, extra: str = "", route_extra: str = "", weights=(100, 0)) -> str:
    """A config with backends ``stable`` and ``cand`` (openai upstreams) and route ``main`` over both."""
    return ("reload: {watch: false}\nresilience:\n  health: {interval_s: 0}\n"
            "observability:\n  logs: {requests: false}\n" + extra +
            "models:\n  - name: m1\n"
            f"backends:\n  stable:\n    type: openai\n    base_url: {stable.base_url}\n"
            "    prices: {input: 1, output: 2}\n"
            f"  cand:\n    type: openai\n    base_url: {cand.base_url}\n"
            f"routes:\n  main:\n    targets: [{{backend: stable, weight: {weights[0]}}}, "
            f"{{backend: cand, weight: {weights[1]}}}]\n{route_extra}"
            "policy:\n  default_route: main\n")


@contextlib.asynccontextmanager
async def gateway(text: str, start_engine: bool = False):
    """A gateway on config ``text``: yields (gateway, its base url, an admin client)."""
    gw = Gateway(None, load_config_text(text), start_engine=start_engine)
    server, task, url = await serve_app(create_app(gw))
    async with httpx.AsyncClient(base_url=url, headers=ADMIN, timeout=30) as c:
        try:
            yield gw, url, c
        finally:
            server.should_exit = True
            await task
