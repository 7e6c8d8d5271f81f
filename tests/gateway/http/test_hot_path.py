"""The hot path (``gateway/http/hot_path.py``) against Litestar's route handlers: two gateways on one config and
one fault-injecting upstream, one app with the hot path and one without, each asked the same requests over real
HTTP. Status, every response header in its order, and the body (ids and timestamps masked) must be the same:
whole answers and streams, OpenAI's and Anthropic's endpoints, refusals from validation, from the upstream and from
a drain."""

from __future__ import annotations

import asyncio
import json
import re

import httpx

from gateway.config.compile import load_config_text
from gateway.http.app import create_app
from gateway.runtime import Gateway
from tests.gateway.fault_upstream import FaultUpstream
from tests.gateway.support import serve_app

CHAT = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
MESSAGES = {"model": "m1", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
# (path, body, extra headers, the upstream's fault)
CASES = [
    ("/v1/chat/completions", CHAT, {}, {}),
    ("/v1/chat/completions", {**CHAT, "stream": True, "stream_options": {"include_usage": True}}, {}, {}),
    ("/v1/chat/completions", {**CHAT, "stream": True}, {}, {"tool_call": True}),
    ("/v1/completions", {"model": "m1", "prompt": "hi", "max_tokens": 8}, {}, {}),
    ("/v1/completions", {"model": "m1", "prompt": "hi", "max_tokens": 8, "stream": True}, {}, {}),
    ("/v1/embeddings", {"model": "m1", "input": ["a", "b"]}, {}, {}),
    ("/v1/messages", MESSAGES, {"x-api-key": "none", "anthropic-version": "2023-06-01"}, {}),
    ("/v1/messages", {**MESSAGES, "stream": True}, {"anthropic-version": "2023-06-01"}, {}),
    ("/v1/messages", {**MESSAGES, "max_tokens": "x"}, {}, {}),                      # Anthropic's 400
    ("/v1/chat/completions", {**CHAT, "temperature": 9}, {}, {}),                   # OpenAI's 400, param named
    ("/v1/chat/completions", {**CHAT, "model": "nope"}, {}, {}),                    # 404 model_not_found
    ("/v1/chat/completions", b"{not json", {}, {}),
    ("/v1/chat/completions", CHAT, {"content-encoding": "br"}, {}),                 # 415 with accept-encoding
    ("/v1/chat/completions", CHAT, {}, {"status": 400, "error_code": "bad"}),      # the upstream's own 400
    ("/v1/chat/completions", CHAT, {}, {"status": 503}),                           # every target failed
    # an upstream's plain-text 404 passed through: its own content type, one charset (a trial saw it twice)
    ("/v1/embeddings", {"model": "m1", "input": "a"}, {}, {"status": 404, "plain": True}),
]

CONFIG = ("reload: {watch: false}\nresilience:\n  health: {interval_s: 0}\n"
          "observability:\n  logs: {requests: false}\n"
          "models:\n  - name: m1\nbackends:\n  up:\n    type: openai\n    base_url: URL\n"
          "routes:\n  main:\n    targets: [{backend: up}]\npolicy:\n  default_route: main\n")

_MASKS = [(re.compile(rb"hp-\d+-[0-9a-f]{8}"), b"RID"), (re.compile(rb'"created(_at)?": ?\d+'), b'"created":0'),
          (re.compile(rb"(msg|resp|toolu|call)_[0-9A-Za-z]{8,}"), rb"\1_ID")]


def _masked(data: bytes) -> bytes:
    for pattern, repl in _MASKS:
        data = pattern.sub(repl, data)
    return data


async def _ask(client: httpx.AsyncClient, url: str, i: int, path: str, body, headers: dict) -> tuple:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = await client.post(url + path, content=content,
                          headers={"content-type": "application/json", "x-request-id": f"hp-{i}", **headers})
    kept = [(k, _masked(v)) for k, v in r.headers.raw if k.lower() != b"date"]
    return r.status_code, kept, _masked(r.content)


async def test_the_hot_path_answers_byte_for_byte_as_litestars_handlers():
    up = FaultUpstream("up").start()
    apps = []
    try:
        for hot in (True, False):
            gw = Gateway(None, load_config_text(CONFIG.replace("URL", up.base_url)))
            app = create_app(gw, hot_path=hot)
            assert bool(app.hot_routes) is hot
            apps.append((gw, *await serve_app(app)))
        async with httpx.AsyncClient(timeout=30) as client:
            for i, (path, body, headers, fault) in enumerate(CASES):
                seen = []
                for _, _, _, url in apps:
                    up.reset()                   # a refusal before routing leaves its fault queued: not for the next
                    up.push(fault)
                    seen.append(await _ask(client, url, i, path, body, headers))
                assert seen[0] == seen[1], (path, body, fault)
                types = [v for k, v in seen[0][1] if k.lower() == b"content-type"]
                assert len(types) == 1 and types[0].count(b"charset") <= 1, types
                assert seen[0][0] in (200, 400, 404, 415, 503), seen[0]
            statuses = [s for s, _, _ in [await _ask(client, url, 99, *CASES[0][:3]) for *_, url in apps]]
            assert statuses == [200, 200]
            for gw, *_ in apps:                  # a draining gateway's 503, with retry-after and connection: close
                gw.draining = True
            seen = [await _ask(client, url, 100, *CASES[0][:3]) for *_, url in apps]
            assert seen[0] == seen[1] and seen[0][0] == 503
    finally:
        for gw, server, task, _ in apps:
            gw.draining = False
            server.should_exit = True
            await asyncio.wait_for(task, 30)
        up.stop()


async def test_the_hot_path_counts_in_flight_requests_and_leaves_other_routes_to_litestar():
    up = FaultUpstream("up").start()
    gw = Gateway(None, load_config_text(CONFIG.replace("URL", up.base_url)))
    server, task, url = await serve_app(create_app(gw))
    try:
        up.push({"delay": 0.5})
        async with httpx.AsyncClient(timeout=30) as client:
            pending = asyncio.ensure_future(client.post(url + "/v1/chat/completions", json=CHAT))
            while gw.in_flight == 0:
                assert not pending.done(), pending.result()
                await asyncio.sleep(0.01)
            assert gw.in_flight == 1
            assert (await pending).status_code == 200 and gw.in_flight == 0
            r = await client.get(url + "/v1/chat/completions")       # a GET: Litestar's 405, OpenAI's error JSON
            assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
            assert r.headers["x-request-id"].startswith("gw-")
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 30)
        up.stop()
