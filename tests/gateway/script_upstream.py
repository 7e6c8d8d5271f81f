"""An upstream that answers each call with a script of raw bytes, for tests of how the gateway reads what the
wire carries (SSE framing, comments, missing ``[DONE]``, error events): a fault injector, not a model.

``push(script)`` queues the answer of the next call (else ``default``); a script is a dict:

    status: int = 200        the HTTP status
    headers: dict            extra response headers
    body: bytes              a whole body (then ``parts`` is ignored)
    parts: list              the body in pieces: bytes are written, a float sleeps that many seconds

Every call is counted in ``calls`` (with its JSON body in ``bodies``).
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import deque

import pytest
from aiohttp import web

from tests.conftest import free_port


def chunk(content: str | None = None, finish: str | None = None, index: int = 0) -> dict:
    """A chat.completion.chunk object with one choice (content delta and/or finish_reason)."""
    delta = {} if content is None else {"content": content}
    return {"id": "up-1", "object": "chat.completion.chunk", "created": 0, "model": "up-model",
            "choices": [{"index": index, "delta": delta, "finish_reason": finish}]}


def data(obj) -> bytes:
    """One single-line SSE event carrying ``obj`` as JSON."""
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


class ScriptUpstream:
    """The scripted upstream on 127.0.0.1 in a background thread; ``base_url`` ends in ``/v1``."""

    def __init__(self, default: dict | None = None):
        self.port = free_port()
        self.default = default or {"body": json.dumps({"id": "up-1", "object": "chat.completion", "created": 0,
                                                       "model": "up-model", "choices": [{
                                                           "index": 0, "finish_reason": "stop",
                                                           "message": {"role": "assistant", "content": "ok"}}]
                                                       }).encode()}
        self.scripts: deque[dict] = deque()
        self.calls = 0
        self.bodies: list = []
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._ready = threading.Event()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def push(self, *scripts: dict) -> "ScriptUpstream":
        self.scripts.extend(scripts)
        return self

    def reset(self) -> None:
        with self._lock:
            self.scripts.clear()
            self.calls = 0
            self.bodies.clear()

    def start(self) -> "ScriptUpstream":
        threading.Thread(target=self._run, daemon=True).start()
        assert self._ready.wait(10)
        return self

    def stop(self) -> None:
        if self._loop is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)

    def _run(self) -> None:
        self._loop = asyncio.new_event_loop()
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._answer)
        app.router.add_post("/v1/completions", self._answer)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        self._loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", self.port).start())
        self._ready.set()
        self._loop.run_forever()

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        with self._lock:
            self.calls += 1
            self.bodies.append(json.loads(body or b"null"))
            script = self.scripts.popleft() if self.scripts else self.default
        status = script.get("status", 200)
        if "body" in script:
            return web.Response(status=status, body=script["body"], content_type="application/json",
                                headers=script.get("headers"))
        resp = web.StreamResponse(status=status, headers={"content-type": "text/event-stream",
                                                          **script.get("headers", {})})
        await resp.prepare(request)
        try:
            for part in script.get("parts", ()):
                if isinstance(part, (int, float)):
                    await asyncio.sleep(part)
                else:
                    await resp.write(part)
            await resp.write_eof()
        except ConnectionError:
            pass
        return resp


@pytest.fixture(scope="module")
def upstream():
    """One ScriptUpstream per test module (import this fixture into the module)."""
    u = ScriptUpstream().start()
    yield u
    u.stop()
