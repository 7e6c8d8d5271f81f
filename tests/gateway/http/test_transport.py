"""A request's client-disconnect watch (``gateway/http/transport.py``): one task awaiting ``receive`` per request,
handed from the answer to the stream that relays it, on the hot path and on Litestar's handlers; a client that
leaves before the stream starts or while it runs still cancels the upstream; no watch outlives its request."""

from __future__ import annotations

import asyncio

import httpx
import pytest

import gateway.http.transport as transport
from gateway.config.compile import load_config_text
from gateway.http.app import create_app
from gateway.runtime import Gateway
from tests.gateway.fault_upstream import FaultUpstream
from tests.gateway.support import serve_app

CHAT = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
CONFIG = ("reload: {watch: false}\nresilience:\n  health: {interval_s: 0}\n"
          "observability:\n  logs: {requests: false}\n"
          "models:\n  - name: m1\nbackends:\n  up:\n    type: openai\n    base_url: URL\n"
          "routes:\n  main:\n    targets: [{backend: up}]\npolicy:\n  default_route: main\n")


@pytest.fixture
def watchers(monkeypatch) -> list[list[bool]]:
    """Each watch task the transport starts, as [ended]: ``_until_disconnect`` wrapped to count and to mark its end
    (returned or cancelled)."""
    started: list[list[bool]] = []
    real = transport._until_disconnect

    async def counted(receive) -> None:
        state = [False]
        started.append(state)
        try:
            await real(receive)
        finally:
            state[0] = True

    monkeypatch.setattr(transport, "_until_disconnect", counted)
    return started


async def _ended(watchers: list[list[bool]]) -> bool:
    for _ in range(100):
        if all(s[0] for s in watchers):
            return True
        await asyncio.sleep(0.01)
    return False


@pytest.mark.parametrize("hot", [True, False], ids=["hot-path", "litestar"])
async def test_one_watch_task_per_request_whole_or_streamed(watchers, hot):
    up = FaultUpstream("up").start()
    gw = Gateway(None, load_config_text(CONFIG.replace("URL", up.base_url)))
    server, task, url = await serve_app(create_app(gw, hot_path=hot))
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            for body, path in ((CHAT, "/v1/chat/completions"), ({**CHAT, "stream": True}, "/v1/chat/completions"),
                               ({"model": "m1", "input": "hi", "stream": True}, "/v1/responses")):
                watchers.clear()
                r = await client.post(url + path, json=body)
                assert r.status_code == 200, r.text
                assert len(watchers) == 1, (path, body)
                assert await _ended(watchers)
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 30)
        up.stop()


@pytest.mark.parametrize("hot", [True, False], ids=["hot-path", "litestar"])
@pytest.mark.parametrize("fault", [{"stall_first": 30}, {"stall_after": 1, "stall_s": 30}],
                         ids=["before-the-answer", "mid-stream"])
async def test_a_client_that_leaves_a_stream_cancels_its_upstream(watchers, hot, fault):
    up = FaultUpstream("up").start()
    gw = Gateway(None, load_config_text(CONFIG.replace("URL", up.base_url)))
    server, task, url = await serve_app(create_app(gw, hot_path=hot))
    try:
        up.push(fault)
        async with httpx.AsyncClient(timeout=30) as client:
            if "stall_first" in fault:           # the gateway answers at the first chunk: the client gives up first
                with pytest.raises(httpx.ReadTimeout):
                    await client.post(url + "/v1/chat/completions", json={**CHAT, "stream": True}, timeout=1.0)
            else:
                async with client.stream("POST", url + "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            break                    # one chunk read, then the client leaves
        for _ in range(500):
            if up.disconnects and gw.in_flight == 0:
                break
            await asyncio.sleep(0.02)
        assert up.disconnects == 1 and gw.in_flight == 0
        assert len(watchers) == 1 and await _ended(watchers)
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 30)
        up.stop()
