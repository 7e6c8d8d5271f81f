"""Support for the gateway tests (no tests here).

``FaultInjectorUpstream`` is a minimal OpenAI-compatible aiohttp server used
ONLY as a fault injector and latency source (error statuses, delays, a
counter of calls and the headers it received). Correctness of answers is
tested against the real engine (``tandem engine serve``) elsewhere.

``GatewayProcess`` runs ``tandem serve`` as a real subprocess on a free port.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
from aiohttp import web

from tests.conftest import free_port  # noqa: F401 -- re-exported for the gateway tests

ROOT = Path(__file__).resolve().parents[2]
PYTHON = sys.executable


def sha(key: str) -> str:
    """A virtual key's sha256 (hex), as the config names it."""
    return hashlib.sha256(key.encode()).hexdigest()


def wait_until(pred, timeout: float = 15.0):
    """Poll ``pred`` every 20 ms until it returns a true value (returned); AssertionError after ``timeout`` s
    (a liveness bound, not a performance threshold)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if value := pred():
            return value
        time.sleep(0.02)
    raise AssertionError("condition not reached")


async def serve_app(app):
    """Serve the ASGI ``app`` under uvicorn on a free port in this event loop (lifespan on); returns (server, its
    task, base url) once it listens. Stop it with ``server.should_exit = True; await task``."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.02)
    return server, task, f"http://127.0.0.1:{port}"


async def serve_ready(gw, timeout: float = 120.0):
    """``serve_app`` of a ``gateway.runtime.Gateway`` ``gw``, returned once its ``/health/ready`` answers 200 (its
    local engine loaded); (server, its task, base url). Fails when it is not ready within ``timeout`` seconds."""
    from gateway.http.app import create_app

    server, task, url = await serve_app(create_app(gw))
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=10) as c:
        while (await c.get(url + "/health/ready")).status_code != 200:
            assert time.monotonic() < deadline, f"the gateway was not ready within {timeout:g} s"
            await asyncio.sleep(0.1)
    return server, task, url


class FaultInjectorUpstream:
    """An OpenAI-compatible upstream for fault injection (NOT a model).

    Behaviour per request, from the body's ``metadata`` (or the server-wide
    ``mode`` dict set with ``set_mode``): ``status`` (int: answer with that
    error status), ``delay`` (seconds before answering), ``chunks`` (number
    of SSE chunks when streaming). Every request is recorded in ``calls``
    (path, headers, body).
    """

    def __init__(self, name: str = "fault"):
        self.name = name
        self.port = free_port()
        self.calls: list[dict] = []
        self.abandoned = 0          # requests whose client (the gateway) hung up before the answer
        self.mode: dict = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner = None
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def set_mode(self, **mode) -> None:
        self.mode = mode

    def start(self) -> "FaultInjectorUpstream":
        self._thread.start()
        self._started.wait(10)
        return self

    def stop(self) -> None:
        if self._loop is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    def _run(self) -> None:
        self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._handle)
        app.router.add_post("/v1/completions", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        self._loop.run_until_complete(self._runner.setup())
        self._loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", self.port).start())
        self._started.set()
        self._loop.run_forever()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.calls.append({"path": request.path, "headers": dict(request.headers), "body": body})
        opts = {**self.mode, **(body.get("metadata") or {})}
        if opts.get("delay"):
            await asyncio.sleep(float(opts["delay"]))
            if request.transport is None or request.transport.is_closing():
                self.abandoned += 1
        status = int(opts.get("status", 200))
        if status != 200:
            err = {"error": {"message": f"injected {status}", "type": "server_error", "param": None, "code": None}}
            return web.json_response(err, status=status)
        chat = request.path.endswith("chat/completions")
        text = f"hello from {self.name}"
        if not body.get("stream"):
            choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
                      if chat else {"index": 0, "text": text, "finish_reason": "stop"})
            return web.json_response({
                "id": "cmpl-fault", "object": "chat.completion" if chat else "text_completion", "created": 0,
                "model": body.get("model"), "choices": [choice],
                "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}})
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        n = int(opts.get("chunks", 3))
        for i in range(n):
            piece = f"tok{i} "
            delta = {"index": 0, "delta": {"content": piece}, "finish_reason": None} if chat else \
                {"index": 0, "text": piece, "finish_reason": None}
            obj = {"id": "cmpl-fault", "object": "chat.completion.chunk" if chat else "text_completion",
                   "created": 0, "model": body.get("model"), "choices": [delta]}
            await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
            if opts.get("chunk_delay"):
                await asyncio.sleep(float(opts["chunk_delay"]))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


class GatewayProcess:
    """``tandem serve --config PATH --port P`` as a subprocess."""

    def __init__(self, config_path: str | Path, env: dict | None = None, extra_args: list[str] | None = None,
                 port: int | None = None):
        self.port = port or free_port()
        self.config_path = str(config_path)
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.args = [PYTHON, "-m", "gateway.commands", "serve", "--config", self.config_path, "--port", str(self.port),
                     *(extra_args or [])]
        self.proc: subprocess.Popen | None = None
        self.log_path = Path(tempfile.mkdtemp(prefix="tandem-gw-")) / f"gateway-{self.port}.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, wait_ready: bool = True, timeout: float = 60) -> "GatewayProcess":
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.args, cwd=ROOT, env=self.env, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited with {self.proc.returncode}:\n{self.log()}")
            try:
                r = httpx.get(self.url + ("/health/ready" if wait_ready else "/health/live"), timeout=1)
                if r.status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"gateway not ready after {timeout}s:\n{self.log()}")

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if getattr(self, "_log", None):
            self._log.close()


def upstream_config(upstreams: dict[str, FaultInjectorUpstream], routes_yaml: str, extra: str = "",
                    key_env: str = "TEST_UPSTREAM_KEY", rules_yaml: str = "", default_route: str = "main") -> str:
    """A gateway config whose backends are the given upstreams."""
    backends = "\n".join(
        f"  {name}:\n    type: openai\n    base_url: {u.base_url}\n    api_key_env: {key_env}\n"
        f"    models: {{m1: {name}-model}}\n    prices: {{input: {i + 1}, output: {2 * (i + 1)}}}\n"
        f"    timeouts: {{connect_s: 2, read_s: 10, first_token_s: 5}}\n    headers: {{x-extra: from-{name}}}\n"
        for i, (name, u) in enumerate(upstreams.items()))
    return (f"reload: {{watch: true, poll_interval_s: 0.2, keep_versions: 5}}\n{extra}\n"
            f"models:\n  - name: m1\n    aliases: [alias1]\n"
            f"backends:\n{backends}routes:\n{routes_yaml}\n"
            f"policy:\n  default_route: {default_route}\n  rules:\n{rules_yaml or '    []'}\n")


def one_upstream_config(url: str, extra: str = "", resilience: str = "health: {interval_s: 0}") -> str:
    """The smallest gateway config: public model m1 on route main, over one OpenAI-compatible upstream ``up`` at
    ``url``; ``extra``: more top-level YAML; ``resilience``: the body of its ``resilience: {...}`` mapping."""
    return (f"{extra}models:\n  - name: m1\nbackends:\n  up: {{type: openai, base_url: '{url}'}}\n"
            f"routes:\n  main: {{targets: [{{backend: up}}]}}\npolicy: {{default_route: main}}\n"
            f"resilience: {{{resilience}}}\n")


def gateway_on(tmp_path_factory, name: str, config_text: str, env: dict | None = None):
    """A ``tandem serve`` process on ``config_text`` (written in a fresh temp dir ``name``), for a fixture to
    ``yield from``: yields the started GatewayProcess, stops it at the end."""
    path = tmp_path_factory.mktemp(name) / "config.yaml"
    path.write_text(config_text)
    g = GatewayProcess(path, env=env).start()
    try:
        yield g
    finally:
        g.stop()


def engine_replicas(tmp_path_factory, names):
    """``tandem engine serve`` replicas (named ``names``) of one tiny random Llama (byte-level tokenizer: one
    character = one token, served as ``bench``, 4096 positions), for a module fixture to ``yield from``: yields
    {name: server}, stops them all at the end."""
    from loadtests.scenarios.common import spawn_engine_server
    from tests.tiny_models import save_byte_level_llama

    model = save_byte_level_llama(tmp_path_factory.mktemp("tiny"), max_position_embeddings=4096, printable_only=True)
    logs = tmp_path_factory.mktemp("replica-logs")
    args = ["--model", model, "--served-model-name", "bench", "--dtype", "float32", "--kv-cache-memory", "32MiB",
            "--max-model-len", "4096", "--num-threads", "1"]
    servers = {}
    try:
        for n in names:     # all spawned first: they load at once (a 2-core box overlaps the imports and waits)
            servers[n] = spawn_engine_server(logs, args, name=n)
        for srv in servers.values():
            srv.wait_ready(300)
        yield servers
    finally:
        for s in servers.values():
            s.stop()


@contextmanager
def engine_serve(args: list[str], log_dir: Path, timeout_s: float = 180.0) -> Iterator[str]:
    """``tandem engine serve`` with ``args`` on a free port, its output in ``log_dir/engine.log``; yields its base
    URL once ``/health`` answers 200 (the log is shown if it exits first), terminated on exit."""
    port = free_port()
    log = open(log_dir / "engine.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "engine", "serve", *args, "--port", str(port),
                             "--uvicorn-log-level", "warning"], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert proc.poll() is None, open(log.name).read()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
