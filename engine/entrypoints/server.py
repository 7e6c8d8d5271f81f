"""``tandem engine serve``: the engine alone behind an OpenAI-compatible HTTP server.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (SSE when
``stream``), ``GET /v1/models``, ``GET /health`` (200 while the engine loop
runs, else 503), ``GET /metrics`` (Prometheus text, vLLM's metric names).

Errors are OpenAI's JSON (``{"error": {"message", "type", "param", "code"}}``)
with the right status; a client that disconnects (mid-stream or while
waiting for a non-streamed answer) aborts its request, which frees its KV
blocks. The HTTP layer only parses JSON and maps errors: everything else is
``engine/entrypoints/chat.py`` and ``completion.py``, which the gateway's
local backend also calls in-process.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator

import msgspec
from litestar import Litestar, Request, Response, get, post
from litestar.background_tasks import BackgroundTask
from litestar.exceptions import HTTPException
from litestar.response import Stream
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from engine.async_engine import AsyncEngine
from engine.metrics import EngineMetrics
from engine.entrypoints.chat import OpenAIServingChat
from engine.entrypoints.completion import OpenAIServingCompletion
from engine.entrypoints.protocol import ServingError

logger = logging.getLogger("tandem.server")

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class _ClientGone(Exception):
    """The client disconnected before the (non-streamed) answer was ready."""


def _error_response(err: ServingError) -> Response:
    return Response(content=err.to_dict(), status_code=err.status_code, media_type="application/json")


async def _json_body(request: Request) -> dict:
    raw = await request.body()
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise ServingError(400, f"malformed JSON body: {exc}", param=None, code="invalid_json") from None
    if not isinstance(body, dict):
        raise ServingError(400, "the request body must be a JSON object", code="invalid_json")
    return body


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


def _respond(result: dict | AsyncIterator[bytes]) -> Response:
    if isinstance(result, dict):
        return Response(content=msgspec.json.encode(result), media_type="application/json")
    # The background task closes the iterator after the body was sent or the
    # client went away: closing it aborts the engine request at once.
    return Stream(result, media_type="text/event-stream", headers=_SSE_HEADERS,
                  background=BackgroundTask(result.aclose))


def _serving(request: Request, kind: str) -> OpenAIServingChat | OpenAIServingCompletion:
    """The app's serving object of ``kind`` ("chat" or "completion"; 503 until startup created it)."""
    serving = request.app.state.get(kind)
    if serving is None:
        raise ServingError(503, "the engine is not ready", type="server_error", code="engine_not_ready")
    return serving


async def _generate(request: Request, kind: str) -> Response:
    serving = _serving(request, kind)
    body = await _json_body(request)
    if kind == "chat":
        call = serving.create_chat_completion(body, request_id=f"chatcmpl-{uuid.uuid4().hex}")
    else:
        call = serving.create_completion(body, request_id=f"cmpl-{uuid.uuid4().hex}")
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


@get("/v1/models")
async def models(request: Request) -> Response:
    """The served model."""
    return Response(content=_serving(request, "chat").models(), media_type="application/json")


@get("/health")
async def health(request: Request) -> Response:
    """200 while the engine loop runs; 503 before start, after a crash or while draining."""
    engine: AsyncEngine = request.app.state.engine
    if engine.is_alive and engine.accepting:
        return Response(content=b"", status_code=200)
    return Response(content={"status": "unavailable"}, status_code=503)


@get("/metrics")
async def metrics(request: Request) -> Response:
    """Prometheus exposition of this app's registry."""
    registry: CollectorRegistry = request.app.state.registry
    return Response(content=generate_latest(registry), media_type=CONTENT_TYPE_LATEST.split(";")[0],
                    headers={"Content-Type": CONTENT_TYPE_LATEST})


def _serving_error_handler(_: Request, exc: ServingError) -> Response:
    return _error_response(exc)


def _http_error_handler(_: Request, exc: HTTPException) -> Response:
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return _error_response(ServingError(exc.status_code, str(exc.detail), type=kind))


def _internal_error_handler(_: Request, exc: Exception) -> Response:
    logger.error("unhandled error", exc_info=exc)
    return _error_response(ServingError(500, f"internal server error ({type(exc).__name__})", type="server_error"))


def build_app(engine: AsyncEngine, *, drain_timeout: float = 30.0) -> Litestar:
    """The Litestar app serving ``engine`` (started on app startup if needed,
    drained on shutdown).

    Args:
        engine: an ``AsyncEngine`` (started or not).
        drain_timeout: seconds to let running requests finish on shutdown.

    ``app.state``: ``engine``, ``chat`` and ``completion`` (after startup), ``registry``
    (this app's own ``CollectorRegistry``).
    """
    registry = CollectorRegistry()

    async def on_startup(app: Litestar) -> None:
        await engine.start()
        app.state.chat = OpenAIServingChat(engine, engine.served_model_name)
        app.state.completion = OpenAIServingCompletion(engine, engine.served_model_name)
        EngineMetrics(registry, engine, engine.served_model_name).attach()

    async def on_shutdown(app: Litestar) -> None:
        await engine.shutdown(drain=True, timeout=drain_timeout)

    app = Litestar(
        route_handlers=[chat_completions, completions, models, health, metrics],
        on_startup=[on_startup],
        on_shutdown=[on_shutdown],
        exception_handlers={ServingError: _serving_error_handler, HTTPException: _http_error_handler,
                            Exception: _internal_error_handler},
        debug=False,
        logging_config=None,
    )
    app.state.engine = engine
    app.state.registry = registry
    return app


# ------------------------------------------------------------------------- CLI
def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """Flags of ``tandem engine serve``: the engine's (vLLM names, from
    ``engine.config.add_engine_cli_args``) plus ``--host``, ``--port``,
    ``--uvicorn-log-level``, ``--drain-timeout``."""
    from engine.config import add_engine_cli_args

    add_engine_cli_args(parser)
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 for all interfaces)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    g.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds to let running requests finish on shutdown (SIGTERM/SIGINT)")


def run_server(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM, then drain: uvicorn stops accepting, lets
    open requests finish (``--drain-timeout``), and the engine stops.

    Returns:
        0 after a clean shutdown (uvicorn then re-raises the captured signal,
        so the process may end by it), 1 when the engine failed to start.
    """
    import uvicorn

    from engine.config import engine_args_from_cli

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        engine_args = engine_args_from_cli(args)
    except (ValueError, FileNotFoundError) as exc:
        logger.error("%s", exc)
        return 1
    app = build_app(AsyncEngine(engine_args), drain_timeout=args.drain_timeout)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                            timeout_graceful_shutdown=int(args.drain_timeout) + 5, lifespan="on")
    server = uvicorn.Server(config)
    server.run()
    return 0 if server.started else 1


if __name__ == "__main__":
    import sys

    p = argparse.ArgumentParser(prog="tandem engine serve")
    add_serve_args(p)
    sys.exit(run_server(p.parse_args()))
