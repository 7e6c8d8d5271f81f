"""A small OpenAI-compatible fault injector for resilience tests (aiohttp server in a background thread).

It answers ``POST /v1/chat/completions`` and ``/v1/completions`` (streaming or not) and ``GET /v1/models``;
``POST /v1/responses`` (whole answers only: a Responses object with the text ``native from <name>``) for the
tests of a backend that declares the Responses API (``apis: [responses]``).
What each request gets is a *fault* dict, taken (in this order) from the ``x-fault`` request header (JSON),
the queue filled by ``push()`` / ``POST /_fault/push`` (one fault per request), or the default set by
``set_default()`` / ``POST /_fault/default``. ``{}`` is a healthy answer. Keys (all optional):

    delay: float           seconds before the response headers
    status: int            answer this HTTP status with an OpenAI error body (429, 500, 503, 400, 404, ...);
                           with ``plain`` (embeddings): a text/plain body instead
    retry_after: str|num   Retry-After header for that status
    error_code: str        error.code in that body (e.g. "context_length_exceeded"); message: str; param: str
    reset: bool            reset the TCP connection (RST) instead of answering
    hang: bool             accept the request and never answer
    malformed: bool        invalid JSON body (non-streaming) or a first SSE event that is not JSON
    chunks: int            content chunks of a stream (default 3)
    chunk_delay: float     seconds between chunks
    stall_first: float     seconds between the 200 headers and the first chunk
    stall_after: int, stall_s: float   after that many content chunks, stall that long
    cut_after: int         after that many content chunks, close the connection mid-body (no [DONE])
    end_after: int         after that many content chunks, end the body cleanly without [DONE]
    error_first: bool      the first SSE event is an error event (then the stream ends)
    error_after: int       after that many content chunks, send an error event and end
    error_hold_s: float    with ``error_after``: keep the connection open that long after the error event
    usage: dict            the usage reported (answer, or the stream's usage chunk when asked for)
    no_usage: bool         report no usage at all (an upstream that never counts)
    usage_on_finish: bool  a stream's usage comes on its finish_reason chunk (Mistral's, DeepSeek's), no usage chunk
    tool_call: bool        a stream's content chunks are tool-call deltas (name, then argument pieces); a whole
                           answer calls ``get_weather`` with {"city": "Paris"} (finish_reason tool_calls)
    content: str           a whole answer's text (default "hello from <name>")
    stamp: bool            a stream's chunks carry ``id`` ``chatcmpl-<the request's x-request-id>`` (tell streams apart)
    token_ids: bool        a stream's content chunks carry vLLM's ``token_ids`` (``[i]`` for chunk i)
    Request ``n`` > 1: each chunk of a stream is sent once per choice index.

Counters: ``sent`` (the data of every SSE event written on a stream, in order), ``calls`` (chat/completions requests received), ``calls_by_path``, ``disconnects`` (times a client
went away before the response finished) with ``disconnect_times`` (``time.monotonic()``), ``requests``
(path, headers, JSON body of each call). ``GET /_fault/stats`` returns them as JSON.
"""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import struct
import threading
import time
from collections import deque

from aiohttp import web

from tests.conftest import free_port


class FaultUpstream:
    """The fault-injecting upstream. ``start()`` returns self; ``base_url`` ends in ``/v1``."""

    def __init__(self, name: str = "fault", model: str = "fault-model", port: int | None = None):
        self.name, self.model = name, model
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self._lock = threading.Lock()
        self._queue: deque[dict] = deque()
        self._default: dict = {}
        self.calls = 0
        self.calls_by_path: dict[str, int] = {}
        self.disconnects = 0
        self.disconnect_times: list[float] = []
        self.requests: list[tuple[str, dict, dict | None]] = []
        self.sent: list[bytes] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None

    # -- control (thread-safe) ------------------------------------------------------------------------------
    def push(self, *faults: dict) -> "FaultUpstream":
        """Queue faults: the next requests get them one each, in order."""
        with self._lock:
            self._queue.extend(dict(f) for f in faults)
        return self

    def set_default(self, fault: dict | None) -> "FaultUpstream":
        """The fault for requests when the queue is empty (``{}`` or None: healthy)."""
        with self._lock:
            self._default = dict(fault or {})
        return self

    def reset(self) -> None:
        """Clear faults and counters."""
        with self._lock:
            self._queue.clear()
            self._default = {}
            self.calls, self.disconnects = 0, 0
            self.calls_by_path, self.disconnect_times, self.requests, self.sent = {}, [], [], []

    def stats(self) -> dict:
        with self._lock:
            return {"calls": self.calls, "calls_by_path": dict(self.calls_by_path), "disconnects": self.disconnects,
                    "queued": len(self._queue)}

    def _take(self, request: web.Request) -> dict:
        hdr = request.headers.get("x-fault")
        if hdr:
            return json.loads(hdr)
        with self._lock:
            return self._queue.popleft() if self._queue else dict(self._default)

    def _disconnected(self) -> None:
        with self._lock:
            self.disconnects += 1
            self.disconnect_times.append(time.monotonic())

    # -- server ---------------------------------------------------------------------------------------------
    def start(self) -> "FaultUpstream":
        ready = threading.Event()

        def run() -> None:
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)
            app = web.Application()
            app.router.add_post("/v1/chat/completions", self._completion)
            app.router.add_post("/v1/completions", self._completion)
            app.router.add_post("/v1/responses", self._responses)
            app.router.add_post("/v1/embeddings", self._embeddings)
            app.router.add_get("/v1/models", self._models)
            app.router.add_post("/_fault/push", self._admin_push)
            app.router.add_post("/_fault/default", self._admin_default)
            app.router.add_get("/_fault/stats", self._admin_stats)
            self._runner = web.AppRunner(app, access_log=None)
            self._loop.run_until_complete(self._runner.setup())
            self._loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", self.port).start())
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name=f"fault-upstream-{self.name}", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("fault upstream did not start")
        return self

    def stop(self) -> None:
        if self._loop is None:
            return
        fut = asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop)
        try:
            fut.result(timeout=5)
        except Exception:
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop = None

    def __enter__(self) -> "FaultUpstream":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- handlers -------------------------------------------------------------------------------------------
    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model",
                                                              "owned_by": self.name}]})

    async def _embeddings(self, request: web.Request) -> web.Response:
        """Embeddings: item i of ``input`` is [i, 0.5, -1.0, 2.0] (cut to ``dimensions``), float or base64
        (little-endian float32, as OpenAI encodes it); usage counts one token per input item. Faults: ``status``."""
        body = await request.json()
        with self._lock:
            self.calls_by_path[request.path] = self.calls_by_path.get(request.path, 0) + 1
            self.requests.append((request.path, dict(request.headers), body))
        fault = self._take(request)
        if fault.get("status") and fault.get("plain"):   # a plain-text error page (a proxy's, a framework's)
            return web.Response(text=f"{fault['status']}: Not Found", status=int(fault["status"]))
        if fault.get("status"):
            return web.json_response({"error": {"message": "injected", "type": "server_error", "param": None,
                                                "code": None}}, status=int(fault["status"]))
        items = body["input"] if isinstance(body["input"], list) and not isinstance(body["input"][0], int) \
            else [body["input"]]
        data = []
        for i in range(len(items)):
            vec = [float(i), 0.5, -1.0, 2.0][:body.get("dimensions") or 4]
            if body.get("encoding_format") == "base64":
                vec = base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode()
            data.append({"object": "embedding", "index": i, "embedding": vec})
        return web.json_response({"object": "list", "data": data, "model": body.get("model"),
                                  "usage": {"prompt_tokens": len(items), "total_tokens": len(items)}})

    async def _admin_push(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.push(*(body if isinstance(body, list) else [body]))
        return web.json_response(self.stats())

    async def _admin_default(self, request: web.Request) -> web.Response:
        self.set_default(await request.json())
        return web.json_response(self.stats())

    async def _admin_stats(self, request: web.Request) -> web.Response:
        return web.json_response(self.stats())

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except ValueError:
            body = None
        with self._lock:
            self.calls += 1
            self.calls_by_path[request.path] = self.calls_by_path.get(request.path, 0) + 1
            self.requests.append((request.path, dict(request.headers), body))
        fault = self._take(request)
        chat = request.path.endswith("chat/completions")
        if fault.get("delay"):
            await asyncio.sleep(float(fault["delay"]))
        if fault.get("hang"):
            await self._wait_for_disconnect(request, forever=True)
            return web.Response(status=499)  # never reaches the (gone) client
        if fault.get("reset"):
            _reset(request)
            return web.Response()  # never sent
        if fault.get("status"):
            status = int(fault["status"])
            headers = {}
            if fault.get("retry_after") is not None:
                headers["Retry-After"] = str(fault["retry_after"])
            err = {"error": {"message": fault.get("message", f"injected {status} from {self.name}"),
                             "type": "invalid_request_error" if status < 500 else "server_error",
                             "param": fault.get("param"), "code": fault.get("error_code")}}
            return web.json_response(err, status=status, headers=headers)
        stream = bool((body or {}).get("stream"))
        if not stream:
            if fault.get("malformed"):
                return web.Response(text='{"id": "x", "choices": [', content_type="application/json")
            full = self._full(chat, body or {}, fault)
            if fault.get("no_usage"):
                full.pop("usage")
            elif "usage" in fault:
                full["usage"] = fault["usage"]
            return web.json_response(full)
        return await self._stream(request, fault, chat, body or {})

    async def _responses(self, request: web.Request) -> web.Response:
        body = await request.json()
        with self._lock:
            self.calls_by_path[request.path] = self.calls_by_path.get(request.path, 0) + 1
            self.requests.append((request.path, dict(request.headers), body))
        text = f"native from {self.name}"
        return web.json_response({
            "id": "resp_upstream", "object": "response", "created_at": int(time.time()), "status": "completed",
            "model": body.get("model", self.model), "output": [
                {"type": "message", "id": "msg_upstream", "status": "completed", "role": "assistant",
                 "content": [{"type": "output_text", "text": text, "annotations": []}]}],
            "parallel_tool_calls": True, "tool_choice": "auto", "tools": [], "error": None,
            "incomplete_details": None, "instructions": body.get("instructions"),
            "usage": {"input_tokens": 11, "input_tokens_details": {"cached_tokens": 2}, "output_tokens": 7,
                      "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 18}})

    def _full(self, chat: bool, body: dict, fault: dict | None = None) -> dict:
        fault = fault or {}
        text = fault.get("content", f"hello from {self.name}")
        usage = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
        if chat:
            message, finish = {"role": "assistant", "content": text}, "stop"
            if fault.get("tool_call"):
                message = {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
                finish = "tool_calls"
            return {"id": "chatcmpl-fault", "object": "chat.completion", "created": int(time.time()),
                    "model": body.get("model", self.model),
                    "choices": [{"index": 0, "message": message, "finish_reason": finish}], "usage": usage}
        return {"id": "cmpl-fault", "object": "text_completion", "created": int(time.time()),
                "model": body.get("model", self.model),
                "choices": [{"index": 0, "text": text, "finish_reason": "stop"}], "usage": usage}

    def _chunk(self, chat: bool, body: dict, i: int | None, finish: str | None = None, tool: bool = False) -> bytes:
        n = int(body.get("n") or 1)
        if n > 1:
            return b"".join(self._chunk(chat, {**body, "n": 1, "index": k}, i, finish, tool) for k in range(n))
        if chat:
            delta = {"role": "assistant", "content": ""} if i is None else ({} if finish else {"content": f"tok{i} "})
            if tool and i is not None and not finish:
                fn = {"name": "get_weather", "arguments": ""} if i == 0 else {"arguments": f'{{"city{i}": "Paris"}}'}
                delta = {"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": fn}]}
            choice = {"index": body.get("index", 0), "delta": delta, "finish_reason": finish}
            if body.get("_token_ids") and i is not None and not finish:
                choice["token_ids"] = [i]
            obj = {"id": body.get("_id", "chatcmpl-fault"), "object": "chat.completion.chunk", "created": 0,
                   "model": body.get("model", self.model), "choices": [choice]}
        else:
            choice = {"index": 0, "text": "" if i is None or finish else f"tok{i} ", "finish_reason": finish}
            obj = {"id": "cmpl-fault", "object": "text_completion", "created": 0,
                   "model": body.get("model", self.model), "choices": [choice]}
        return b"data: " + json.dumps(obj).encode() + b"\n\n"

    async def _stream(self, request: web.Request, fault: dict, chat: bool, body: dict) -> web.StreamResponse:
        resp = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream",
                                                        "Cache-Control": "no-cache"})
        await resp.prepare(request)
        if fault.get("stamp"):
            body = {**body, "_id": f"chatcmpl-{request.headers.get('x-request-id')}"}
        if fault.get("token_ids"):
            body = {**body, "_token_ids": True}
        write = resp.write

        async def sent(raw: bytes) -> None:      # every event written, recorded
            with self._lock:
                self.sent += [b[6:] for b in raw.split(b"\n\n") if b.startswith(b"data: ")]
            await write(raw)

        resp.write = sent
        try:
            if fault.get("stall_first"):
                if await self._wait_for_disconnect(request, seconds=float(fault["stall_first"])):
                    return resp
            if fault.get("error_first"):
                err = {"error": {"message": f"injected error event from {self.name}", "type": "server_error",
                                 "param": None, "code": None}}
                await resp.write(b"data: " + json.dumps(err).encode() + b"\n\n")
                await resp.write_eof()
                return resp
            if fault.get("malformed"):
                await resp.write(b"data: {not json\n\n")
                await resp.write_eof()
                return resp
            if chat:
                await resp.write(self._chunk(chat, body, None))
            n = int(fault.get("chunks", 3))
            for i in range(n):
                if i and fault.get("chunk_delay"):
                    if await self._wait_for_disconnect(request, seconds=float(fault["chunk_delay"])):
                        return resp
                if fault.get("stall_after") is not None and i == int(fault["stall_after"]):
                    if await self._wait_for_disconnect(request, seconds=float(fault.get("stall_s", 3600))):
                        return resp
                if fault.get("cut_after") is not None and i == int(fault["cut_after"]):
                    request.transport.close()  # FIN mid-body: what was sent arrives, then the body is incomplete
                    return resp
                if fault.get("end_after") is not None and i == int(fault["end_after"]):
                    await resp.write_eof()
                    return resp
                if fault.get("error_after") is not None and i == int(fault["error_after"]):
                    err = {"error": {"message": "injected mid-stream error", "type": "server_error"}}
                    await resp.write(b"data: " + json.dumps(err).encode() + b"\n\n")
                    if fault.get("error_hold_s") and await self._wait_for_disconnect(
                            request, seconds=float(fault["error_hold_s"])):
                        return resp
                    await resp.write_eof()
                    return resp
                await resp.write(self._chunk(chat, body, i, tool=bool(fault.get("tool_call"))))
            usage = fault.get("usage") or {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n}
            finish = self._chunk(chat, body, n, finish="stop")
            if fault.get("usage_on_finish"):
                finish = finish[:-3] + b', "usage": ' + json.dumps(usage).encode() + b"}\n\n"
            await resp.write(finish)
            if (body.get("stream_options") or {}).get("include_usage") and not fault.get("no_usage") \
                    and not fault.get("usage_on_finish"):
                await resp.write(b"data: " + json.dumps({"id": body.get("_id", "chatcmpl-fault"),
                                                         "object": "chat.completion.chunk",
                                                         "choices": [], "usage": usage}).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except (ConnectionResetError, ConnectionError, asyncio.CancelledError) as exc:
            self._disconnected()
            if isinstance(exc, asyncio.CancelledError):
                raise
        return resp

    async def _wait_for_disconnect(self, request: web.Request, seconds: float = 0.0, forever: bool = False) -> bool:
        """Sleep ``seconds`` (or forever) in 20 ms steps; True (and counted) as soon as the client disconnects."""
        end = time.monotonic() + seconds
        while forever or time.monotonic() < end:
            if request.transport is None or request.transport.is_closing():
                self._disconnected()
                return True
            await asyncio.sleep(0.02)
        return False


def _reset(request: web.Request) -> None:
    """Abort the connection with a TCP RST (SO_LINGER 0), like a crashed upstream."""
    transport = request.transport
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    transport.abort()
