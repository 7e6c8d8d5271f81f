"""A fake Anthropic Messages upstream (aiohttp, in a background thread) for the ``type: anthropic`` backend tests:
``POST /v1/messages`` answers "hello from claude" (or, when the body has ``tools``, a ``get_weather`` tool_use), as a
Message or as Anthropic's event stream; ``GET /v1/models`` for the health probe. Each call is kept in ``requests``
(path, headers, JSON body); ``status`` makes the next answers that error, in Anthropic's error JSON."""

from __future__ import annotations

import asyncio
import json
import threading

from aiohttp import web

from tests.conftest import free_port

USAGE = {"input_tokens": 7, "output_tokens": 2}


class AnthropicUpstream:
    def __init__(self):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self.requests: list[tuple[str, dict, dict]] = []
        self.status = 200
        self.content: list[dict] | None = None   # a whole answer's blocks, when set (else text, or text + tool_use)
        self.usage: dict | None = None            # the answer's usage, when set ({}: none, as a proxy may drop it)
        self._loop = None

    def __enter__(self) -> "AnthropicUpstream":
        ready = threading.Event()

        def run() -> None:
            self._loop = asyncio.new_event_loop()
            app = web.Application()
            app.router.add_post("/v1/messages", self._messages)
            app.router.add_get("/v1/models", self._models)
            self._runner = web.AppRunner(app, access_log=None)
            self._loop.run_until_complete(self._runner.setup())
            self._loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", self.port).start())
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        assert ready.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def _content(self, body: dict) -> list[dict]:
        if self.content is not None:
            return self.content
        if body.get("tools"):
            return [{"type": "text", "text": "checking"},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]
        return [{"type": "text", "text": "hello from claude"}]

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": []})

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append((request.path, dict(request.headers), body))
        if self.status != 200:
            return web.json_response({"type": "error", "error": {"type": "overloaded_error",
                                                                 "message": "injected"}}, status=self.status)
        content = self._content(body)
        stop = "tool_use" if body.get("tools") else "end_turn"
        msg = {"id": "msg_up", "type": "message", "role": "assistant", "model": body["model"], "content": content,
               "stop_reason": stop, "stop_sequence": None, "usage": USAGE if self.usage is None else self.usage}
        if not body.get("stream"):
            return web.json_response(msg)
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)

        async def send(name: str, data: dict) -> None:
            await resp.write(f"event: {name}\ndata: {json.dumps(data)}\n\n".encode())

        # as Anthropic's: the input (and cache) counts in message_start, the output's in message_delta
        usage = msg["usage"]
        start = {**{k: v for k, v in usage.items() if k != "output_tokens"}, "output_tokens": 1} if usage else {}
        await send("message_start", {"type": "message_start", "message": {
            **msg, "content": [], "stop_reason": None, "usage": start}})
        await send("ping", {"type": "ping"})
        for i, block in enumerate(content):
            if block["type"] == "thinking":
                await send("content_block_start", {"type": "content_block_start", "index": i,
                                                   "content_block": {"type": "thinking", "thinking": "",
                                                                     "signature": ""}})
                await send("content_block_delta", {"type": "content_block_delta", "index": i,
                                                   "delta": {"type": "thinking_delta", "thinking": block["thinking"]}})
                await send("content_block_delta", {"type": "content_block_delta", "index": i, "delta": {
                    "type": "signature_delta", "signature": block["signature"]}})
            elif block["type"] == "redacted_thinking":
                await send("content_block_start", {"type": "content_block_start", "index": i,
                                                   "content_block": block})
            elif block["type"] == "text":
                await send("content_block_start", {"type": "content_block_start", "index": i,
                                                   "content_block": {"type": "text", "text": ""}})
                for piece in (block["text"][:5], block["text"][5:]):
                    await send("content_block_delta", {"type": "content_block_delta", "index": i,
                                                       "delta": {"type": "text_delta", "text": piece}})
            else:
                await send("content_block_start", {"type": "content_block_start", "index": i, "content_block": {
                    "type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}})
                # a call without input streams one empty piece, as Anthropic's does
                args = json.dumps(block["input"]) if block["input"] else ""
                for piece in (args[:len(args) // 2], args[len(args) // 2:]) if args else ("",):
                    await send("content_block_delta", {"type": "content_block_delta", "index": i,
                                                       "delta": {"type": "input_json_delta", "partial_json": piece}})
            await send("content_block_stop", {"type": "content_block_stop", "index": i})
        await send("message_delta", {"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": None},
                                     "usage": {"output_tokens": usage["output_tokens"]} if usage else {}})
        await send("message_stop", {"type": "message_stop"})
        await resp.write_eof()
        return resp
