"""``tandem engine serve``: the engine alone behind an OpenAI-compatible HTTP server.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (SSE when
``stream``), ``POST /v1/embeddings``, ``GET /v1/models``, ``GET /health`` (200 while the engine loop
runs, else 503 with ``{"status": "loading" | "failed" | "unavailable"}``; ``GET|POST /ping`` the same, as
vLLM's), ``GET /metrics`` (Prometheus text, vLLM's metric names), and vLLM's ``POST /tokenize``,
``POST /detokenize``, ``GET /version`` (``utility.py``). With ``--api-key`` every ``/v1`` path needs
``Authorization: Bearer <key>`` (401 in OpenAI's form otherwise), as vLLM's.

The server listens at once; the model loads in the background (its core
process logs what it loads, MB and seconds). Until it is loaded every API
request gets 503 ``engine_loading`` with ``Retry-After``; a load that fails
is logged as one clear line and ends the server with exit code 1. A body
over ``--max-request-body-bytes`` gets 413.

Errors are OpenAI's JSON (``{"error": {"message", "type", "param", "code"}}``)
with the right status. Every response carries ``x-request-id``
(``engine/protocol/request_ids.py``, the gateway's rule), which is also
in the answer's ``id`` (``chatcmpl-<x-request-id>``, with a random suffix
when the client chose it). A client that disconnects (mid-stream or while
waiting for a non-streamed answer) aborts its request, which frees its KV
blocks. The HTTP layer only parses JSON and maps errors: everything else is
``engine/serving/chat.py`` and ``completion.py``, which the gateway's
local backend also calls in-process.

SIGINT (Ctrl-C) or SIGTERM stops it after the requests in flight are answered (uvicorn's graceful shutdown): up to
``--drain-timeout``, then the engine aborts those still running, whose streams end with an error event
(``aborted``, "shutting down") and ``[DONE]``, a non-streamed one with that error; a second signal within
:data:`SIGNAL_ECHO_S` of the first is the same stop (a terminal's Ctrl-C reaches the whole process group, and a
wrapper may forward it again), a later one quits at once. The exit is quiet either way (no ``KeyboardInterrupt``
traceback); its status is ``stop_exit_status``'s (0 after SIGTERM, 130 after SIGINT).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Callable

import msgspec
import uvicorn
from litestar import Litestar, Request, Response, get, post, route
from litestar.background_tasks import BackgroundTask
from litestar.exceptions import HTTPException
from litestar.response import Stream
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from engine.async_engine import AsyncEngine
from engine.entrypoints.request_state import json_body, serving_of
from engine.entrypoints.ttft import ttft
from engine.entrypoints.vllm_flags import add_vllm_flags, kv_cache_from_vllm_env, vllm_env_notes, vllm_flag_notes
from engine.entrypoints.utility import detokenize, server_version, tokenize
from engine.metrics import EngineMetrics
from engine.protocol.errors import ServingError
from engine.protocol.heap import freeze_heap
from engine.protocol.request_ids import stamp_request_id, unique_request_id
from engine.protocol.signals import SIGNAL_ECHO_S, stop_exit_status
from engine.serving.protocol import ChatCompletionRequest, CompletionRequest, ignored_fields
from engine.serving.chat import OpenAIServingChat
from engine.serving.chunks import sse_stream
from engine.serving.completion import OpenAIServingCompletion
from engine.serving.embeddings import OpenAIServingEmbedding
from engine.serving.tokenization import OpenAIServingTokenization

logger = logging.getLogger("tandem.server")


# seconds an idle client connection is kept open: longer than the clients' own idle expiry (httpx and so the
# openai SDK: 5 s; uvicorn's default is also 5), so that a client never sends a request on a connection the
# server is closing at that moment (a "connection reset" the SDK retries and a client without retries sees)
KEEP_ALIVE_S = 30


class EngineServer(uvicorn.Server):
    """uvicorn's ``Server`` with the echo window of :data:`SIGNAL_ECHO_S` on its stop signals; ``stop_signal``:
    the signal it stopped on (None: none yet). ``on_stop``: a coroutine function started on the server's loop at
    the first stop signal (the engine's drain: uvicorn waits for open connections and only then runs the app's
    shutdown, so streams still running at its deadline were cut mid-body, each with an ASGI traceback);
    ``on_insist``: one started at each later signal past the echo window (the drain's end)."""

    first_signal: float | None = None
    stop_signal: int | None = None
    on_stop = None
    on_insist = None
    _loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig, frame) -> None:
        now = time.monotonic()
        if self.first_signal is not None:
            # a later signal quits at once: the drain ends now (what still runs is aborted, its streams end with
            # their error event) and the server stops as after it. Not uvicorn's force_exit, which cancels the
            # app's shutdown mid-drain: a trial's server hung for good, its engine core alive
            if now - self.first_signal >= SIGNAL_ECHO_S and self.on_insist is not None and self._loop is not None:
                self._loop.call_soon_threadsafe(lambda: self._loop.create_task(self.on_insist()))
            return
        if self.on_stop is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(lambda: self._loop.create_task(self.on_stop()))
        self.first_signal = self.first_signal or now
        self.stop_signal = self.stop_signal or sig
        if sig == signal.SIGTERM:   # an orchestrator's normal stop: exit 0 (stop_exit_status), not re-raised by
            self.should_exit = True  # uvicorn once the server stopped (the process then died by it: status -15)
            return
        super().handle_exit(sig, frame)

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class _ClientGone(Exception):
    """The client disconnected before the (non-streamed) answer was ready."""


def _error_response(err: ServingError) -> Response:
    return Response(content=err.to_dict(), status_code=err.status_code, media_type="application/json",
                    headers=err.headers)


async def _until_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _cancel_on_disconnect(request: Request, coro):
    """Await ``coro`` unless the client disconnects first (then cancel it,
    which aborts the engine request). As vLLM's ``with_cancellation``."""
    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            raise _ClientGone()
        watcher.cancel()
    return task.result()


def _respond(result: dict | AsyncIterator[list]) -> Response:
    """A whole answer as JSON, a stream of typed chunks (``engine/serving/chunks.py``) as SSE."""
    if isinstance(result, dict):
        return Response(content=msgspec.json.encode(result), media_type="application/json")
    # The background task closes the iterator after the body was sent or the
    # client went away: closing it aborts the engine request at once.
    events = sse_stream(result)
    return Stream(events, media_type="text/event-stream", headers=_SSE_HEADERS,
                  background=BackgroundTask(events.aclose))


def _log_request(request: Request, rid: str, body: dict) -> None:
    """``--enable-log-requests`` (vLLM's): one INFO line per request, its id and body (cut at
    ``--max-log-len`` characters)."""
    if not request.app.state.log_requests:
        return
    text = msgspec.json.encode(body).decode()
    limit = request.app.state.max_log_len
    logger.info("Received request %s: %s %s", rid, request.url.path, text if limit is None else text[:limit])


async def _generate(request: Request, kind: str) -> Response:
    serving = serving_of(request, kind)
    body = await json_body(request)
    rid = unique_request_id(request.scope, body_id=body.get("request_id"))   # the header's, else the body's
    _log_request(request, rid, body)
    if isinstance(body, dict) and (ignored := ignored_fields(body, ChatCompletionRequest if kind == "chat"
                                                              else CompletionRequest)):
        logger.warning("The following fields were present in the request but ignored: %s", ignored)   # vLLM's words
    if kind == "chat":
        call = serving.create_chat_completion(body, request_id=f"chatcmpl-{rid}")
    else:
        call = serving.create_completion(body, request_id=f"cmpl-{rid}")
    if body.get("stream"):
        return _respond(await call)
    try:
        return _respond(await _cancel_on_disconnect(request, call))
    except _ClientGone:
        return Response(content=b"", status_code=499)


@post("/v1/chat/completions", status_code=200)
async def chat_completions(request: Request) -> Response:
    """OpenAI chat completions (SSE when ``stream``)."""
    return await _generate(request, "chat")


@post("/v1/completions", status_code=200)
async def completions(request: Request) -> Response:
    """OpenAI (legacy) completions (SSE when ``stream``)."""
    return await _generate(request, "completion")


@post("/v1/embeddings", status_code=200)
async def embeddings(request: Request) -> Response:
    """OpenAI embeddings: the model's final hidden states pooled (``engine/serving/embeddings.py``)."""
    serving = serving_of(request, "embedding")
    body = await json_body(request)
    rid = unique_request_id(request.scope)
    _log_request(request, rid, body)
    try:
        return _respond(await _cancel_on_disconnect(request, serving.create_embedding(body, rid)))
    except _ClientGone:
        return Response(content=b"", status_code=499)


@get("/v1/models")
async def models(request: Request) -> Response:
    """The served model's names (one entry per ``--served-model-name``, as vLLM's)."""
    return Response(content=serving_of(request, "chat").models(), media_type="application/json")


@get("/v1/models/{model:path}")
async def model(request: Request) -> Response:
    """One served model (OpenAI's retrieve); 404 ``model_not_found`` for any other name."""
    model = request.path_params["model"].lstrip("/")   # names may hold "/" (HF ids)
    serving = serving_of(request, "chat")
    serving.check_model(model)
    return Response(content=next(m for m in serving.models()["data"] if m["id"] == model),
                    media_type="application/json")


@get("/health")
async def health(request: Request) -> Response:
    """200 while the engine loop runs; 503 while loading (``{"status": "loading"}``),
    after a failed load (``"failed"``), a crash or while draining (``"unavailable"``)."""
    return _health(request)


@route("/ping", http_method=["GET", "POST"])
async def ping(request: Request) -> Response:
    """vLLM's ``/ping`` (SageMaker's health check): ``/health``'s answer."""
    return _health(request)


def _health(request: Request) -> Response:
    engine: AsyncEngine = request.app.state.engine
    if engine.is_alive and engine.accepting and request.app.state.get("chat") is not None:
        return Response(content=b"", status_code=200, media_type="text/plain")   # vLLM: an empty 200, no JSON
    if request.app.state.get("load_error") is not None:
        status = "failed"
    elif request.app.state.get("chat") is None:
        status = "loading"
    else:
        status = "unavailable"
    return Response(content={"status": status}, status_code=503)


@get("/metrics")
async def metrics(request: Request) -> Response:
    """Prometheus exposition of this app's registry."""
    registry: CollectorRegistry = request.app.state.registry
    return Response(content=generate_latest(registry), media_type=CONTENT_TYPE_LATEST.split(";")[0],
                    headers={"Content-Type": CONTENT_TYPE_LATEST})


def _serving_error_handler(_: Request, exc: ServingError) -> Response:
    return _error_response(exc)


def _http_error_handler(request: Request, exc: HTTPException) -> Response:
    if exc.status_code == 413:
        limit = request.app.state.max_request_body_bytes
        return _error_response(ServingError(413, f"the request body is larger than {limit} bytes "
                                                 "(--max-request-body-bytes)", code="request_too_large"))
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return _error_response(ServingError(exc.status_code, str(exc.detail), type=kind))


def _internal_error_handler(_: Request, exc: Exception) -> Response:
    logger.error("unhandled error", exc_info=exc)
    return _error_response(ServingError(500, f"internal server error ({type(exc).__name__})", type="server_error"))


def api_key_middleware(api_key: str):
    """vLLM's ``--api-key`` as an ASGI middleware factory: a request to a ``/v1`` endpoint without
    ``Authorization: Bearer <api_key>`` gets 401 in OpenAI's error form (``invalid_api_key``); other paths
    (``/health``, ``/metrics``, ``/tokenize``...) and CORS preflights pass, as in vLLM. Litestar runs it for
    routed paths only: an unknown ``/v1`` path is a 404 (vLLM's app-wide middleware answers 401)."""
    expected = f"Bearer {api_key}".encode()
    body = msgspec.json.encode(ServingError(401, "Incorrect API key provided (send Authorization: Bearer <key>, "
                                                 "the server's --api-key).", code="invalid_api_key").to_dict())

    def factory(app):
        async def guard(scope, receive, send) -> None:
            if scope["type"] == "http" and scope["method"] != "OPTIONS" and scope["path"].startswith("/v1"):
                given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
                if not hmac.compare_digest(given, expected):
                    await send({"type": "http.response.start", "status": 401, "headers": [
                        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
                    await send({"type": "http.response.body", "body": body})
                    return
            await app(scope, receive, send)
        return guard
    return factory


def build_app(engine: AsyncEngine, *, drain_timeout: float = 30.0, max_request_body_bytes: int = 4 * 2**20,
              on_load_failed: Callable[[], None] | None = None, api_key: str | None = None,
              log_requests: bool = False, max_log_len: int | None = None,
              return_tokens_as_token_ids: bool = False) -> Litestar:
    """The Litestar app serving ``engine``: it listens at once, loads the
    engine in the background on startup (if not started yet) and drains it on shutdown.

    Args:
        engine: an ``AsyncEngine`` (started or not).
        drain_timeout: seconds to let running requests finish on shutdown.
        max_request_body_bytes: larger bodies get 413 (OpenAI error form).
        on_load_failed: called (on the event loop) when loading failed, after
            the error was logged; ``run_server`` stops the server with it.
        api_key: required on ``/v1`` paths as ``Authorization: Bearer <key>`` (``api_key_middleware``); None: open.
        log_requests: log each generation and embedding request (``--enable-log-requests``), its body cut at
            ``max_log_len`` characters (None: whole).
        return_tokens_as_token_ids: the requests' default of that field (``--return-tokens-as-token-ids``).

    ``app.state``: ``engine``, ``chat`` and ``completion`` (once loaded),
    ``load_error`` (a failed load's message), ``registry`` (this app's own
    ``CollectorRegistry``), ``max_request_body_bytes``.
    """
    registry = CollectorRegistry()

    async def load(app: Litestar) -> None:
        try:   # the front end too: a failure building it after the engine started also stops the server (a
            # trial's server said healthy and answered every request 503 "loading", its error lost in a task)
            await engine.start()
            EngineMetrics(registry, engine, engine.served_model_name).attach()
            names = engine.served_model_names
            as_ids = return_tokens_as_token_ids
            handlers = {"completion": OpenAIServingCompletion(engine, names, as_ids),
                        "chat": OpenAIServingChat(engine, names, as_ids),
                        "embedding": OpenAIServingEmbedding(engine, names),
                        "tokenization": OpenAIServingTokenization(engine, names)}
        except Exception as exc:  # noqa: BLE001 - one clear line, then the server stops
            app.state.load_error = f"{type(exc).__name__}: {exc}"
            logger.error("the engine failed to load: %s", app.state.load_error)
            if on_load_failed is not None:
                on_load_failed()
            return
        for name, handler in handlers.items():   # all at once: /health's 200 says every one is there
            setattr(app.state, name, handler)
        freeze_heap()

    async def on_startup(app: Litestar) -> None:
        app.state.load_task = asyncio.ensure_future(load(app))

    async def on_shutdown(app: Litestar) -> None:
        task = app.state.get("load_task")
        if task is not None and not task.done():
            task.cancel()
        await engine.shutdown(drain=True, timeout=drain_timeout)

    app = Litestar(
        route_handlers=[chat_completions, completions, embeddings, models, model, health, ping, metrics, ttft,
                        tokenize, detokenize, server_version],
        middleware=[api_key_middleware(api_key)] if api_key else [],
        on_startup=[on_startup],
        on_shutdown=[on_shutdown],
        exception_handlers={ServingError: _serving_error_handler, HTTPException: _http_error_handler,
                            Exception: _internal_error_handler},
        request_max_body_size=max_request_body_bytes,
        before_send=[stamp_request_id()],
        debug=False,
        logging_config=None,
    )
    app.state.engine = engine
    app.state.registry = registry
    app.state.max_request_body_bytes = max_request_body_bytes
    app.state.log_requests, app.state.max_log_len = log_requests, max_log_len
    return app


# ------------------------------------------------------------------------- CLI
def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """Flags of ``tandem engine serve``: the engine's (vLLM names, from
    ``engine.config.add_engine_cli_args``), vLLM's positional ``MODEL``, plus ``--host``, ``--port``,
    ``--uvicorn-log-level``, ``--drain-timeout``, ``--max-request-body-bytes`` and vLLM's ``--api-key``,
    ``--enable-log-requests`` / ``--disable-log-requests``, ``--max-log-len``, ``--trust-remote-code``."""
    from engine.arg_values import flag_type, non_negative_seconds, parse_size, tcp_port
    from engine.config import add_engine_cli_args

    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="the model, as `vllm serve MODEL` takes it: the same as --model")
    add_engine_cli_args(parser)
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 for all interfaces)")
    g.add_argument("--port", type=flag_type(tcp_port), default=8000, help="TCP port to listen on (0-65535)")
    g.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"], help="uvicorn's log level")
    g.add_argument("--drain-timeout", type=flag_type(non_negative_seconds), default=30.0,
                   help="seconds to let running requests finish on shutdown (SIGTERM/SIGINT)")
    g.add_argument("--max-request-body-bytes", type=parse_size, default=4 * 2**20,
                   help="largest request body, bytes (or 4MiB, 512KiB); larger ones get 413")
    _add_vllm_server_args(g)
    add_vllm_flags(parser.add_argument_group("vLLM flags without a setting here"))


def _add_vllm_server_args(g) -> None:
    """vLLM's server flags: the API key, request logging, the answers' token names (``--trust-remote-code`` is one
    of ``VLLM_FLAGS``)."""
    g.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer <key>` on /v1 paths (401 otherwise), as vLLM's; default: "
                        "$VLLM_API_KEY, else none")
    g.add_argument("--disable-uvicorn-access-log", action="store_true", default=False,
                   help="no access line per HTTP request (uvicorn's), as vLLM's")
    g.add_argument("--enable-log-requests", dest="log_requests", action="store_true", default=False,
                   help="log each generation and embedding request (its id and body) at INFO")
    g.add_argument("--disable-log-requests", dest="log_requests", action="store_false",
                   help="do not log requests (the default; vLLM's older flag)")
    g.add_argument("--max-log-len", type=int, default=None,
                   help="characters of a logged request body at most (default: all)")
    g.add_argument("--return-tokens-as-token-ids", action="store_true", default=False,
                   help="logprobs name tokens 'token_id:<id>' unless a request's return_tokens_as_token_ids says no")


def run_server(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM, then drain: uvicorn stops accepting, lets
    open requests finish (``--drain-timeout``), and the engine stops.

    Returns:
        0 after a clean shutdown, 130 after one a SIGINT started (as a shell
        reports Ctrl-C; ``EngineServer.stop_signal``), 1 when the engine
        failed to load (the error is logged in one line).
    """
    from engine.config import KV_CACHE_MEMORY_DEFAULT, engine_args_from_cli

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    tag = getattr(args, "model_tag", None)
    if tag is not None:   # vLLM's `serve MODEL`
        if args.model is not None and args.model != tag:
            logger.error("the positional MODEL %r and --model %r differ: give one", tag, args.model)
            return 1
        args.model = tag
    try:
        notes = vllm_flag_notes(args, args.model)
    except ValueError as e:
        logger.error("%s", e)
        return 2
    for note in notes:
        logger.info("%s", note)
    for note in vllm_env_notes(os.environ):
        logger.warning("%s", note)
    args.kv_cache_memory, note = kv_cache_from_vllm_env(args.kv_cache_memory, KV_CACHE_MEMORY_DEFAULT, os.environ)
    if note is not None:
        logger.info("%s", note)
    try:
        engine_args = engine_args_from_cli(args)
    except (ValueError, FileNotFoundError) as exc:
        logger.error("%s", exc)
        return 1
    if engine_args.node_rank > 0:   # another host's ranks of a tensor-parallel engine: no HTTP server
        from engine.executor.worker_main import run_node

        return run_node(engine_args)
    failed = []

    def stop_on_load_failure() -> None:
        failed.append(True)
        server.should_exit = True

    engine = AsyncEngine(engine_args)
    app = build_app(engine, drain_timeout=args.drain_timeout,
                    max_request_body_bytes=args.max_request_body_bytes, on_load_failed=stop_on_load_failure,
                    api_key=args.api_key or os.environ.get("VLLM_API_KEY") or None,
                    log_requests=args.log_requests, max_log_len=args.max_log_len,
                    return_tokens_as_token_ids=args.return_tokens_as_token_ids)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                            access_log=not args.disable_uvicorn_access_log,
                            timeout_graceful_shutdown=int(args.drain_timeout) + 5, lifespan="on",
                            timeout_keep_alive=KEEP_ALIVE_S)
    server = EngineServer(config)
    # the drain starts at the signal: requests still running after --drain-timeout are aborted, so their streams
    # end (an error event, [DONE]) before uvicorn's deadline (+5 s) cuts the connections
    server.on_stop = lambda: engine.shutdown(drain=True, timeout=args.drain_timeout)
    server.on_insist = lambda: engine.shutdown(drain=False)
    try:
        server.run()
    except KeyboardInterrupt:   # uvicorn re-raises the SIGINT it handled once the server has stopped
        return stop_exit_status(signal.SIGINT)
    if status := stop_exit_status(server.stop_signal):   # the re-raise can land in asyncio's own handler and be lost
        return status
    return 0 if server.started and not failed else 1


if __name__ == "__main__":
    import sys

    p = argparse.ArgumentParser(prog="tandem engine serve")
    add_serve_args(p)
    sys.exit(run_server(p.parse_args()))
