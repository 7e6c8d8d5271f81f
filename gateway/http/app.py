"""The Litestar app: module-level handlers on ``request.app.state.gw`` (the ``gateway.runtime.Gateway``), one
exception table (``gateway/http/exceptions.py``: OpenAI's error JSON, Anthropic's under ``/v1/messages``),
in-flight accounting in one middleware; the client APIs' POST endpoints also on the hot path (``HOT_ROUTES``, ``gateway/http/hot_path.py``), past Litestar's router. The request path itself is
``gateway/request/pipeline.py``; operator endpoints are ``gateway/http/admin.py``.

Endpoints: POST /v1/chat/completions, POST /v1/completions, POST /v1/embeddings, POST /v1/messages (Anthropic's,
with ``gateway/http/anthropic.py``), the Responses API (``gateway/http/responses.py``), GET /v1/models,
GET /v1/models/{model}, vLLM's POST /tokenize and /detokenize (``gateway/http/tokenization.py``),
GET /health/live and /health/ready (with LiteLLM's and vLLM's names for them), GET /version; the admin API and
GET /metrics from ``admin.py`` (and ``admin_limits.py``); the ops console at GET /admin/ui from ``console.py``.
Every response carries ``x-request-id``; ``server.cors`` adds CORS.
"""

from __future__ import annotations

import time
from functools import partial

import msgspec
from litestar import HttpMethod, Litestar, Request, Response, post, route
from litestar.config.cors import CORSConfig
from litestar.datastructures import State

from engine.protocol.request_ids import stamp_request_id
from engine.protocol.version import tandem_version
from gateway.config.schema import CorsConfig
from gateway.errors import model_not_found
from gateway.http.admin import ADMIN_HANDLERS, operator_view
from gateway.http.admin_limits import admin_limits
from gateway.http.console import CONSOLE_HANDLERS
from gateway.http.hot_path import HotPathApp, HotRoute
from gateway.http.responses import RESPONSES_HANDLERS
from gateway.http.rollouts_admin import ROLLOUT_HANDLERS
from gateway.http.anthropic import (anthropic_headers, anthropic_model, anthropic_model_page, anthropic_request_id,
                                    count_tokens, wants_anthropic)
from gateway.http.exceptions import EXCEPTION_HANDLERS
from gateway.http.serving import GATEWAY_ID_PREFIX, serve_observed, streamed
from gateway.http.tokenization import TOKENIZATION_HANDLERS
from gateway.http.transport import EventStream, unless_disconnected
from gateway.request.pipeline import handle
from gateway.runtime import Gateway
from gateway.stored_responses import ResponseStore

_JSON = "application/json"


def in_flight(app):
    """ASGI middleware: ``gw.in_flight`` counts the OpenAI requests being served, from arrival until the last
    byte of the answer (a stream until its end) or the client's disconnect. Drain waits for it to reach 0."""

    async def middleware(scope, receive, send) -> None:
        gw = scope["app"].state.gw
        if scope["type"] != "http" or scope["method"] != "POST" or not scope["path"].startswith("/v1/") \
                or gw.draining:          # refused at once (503): a drain never waits for it
            await app(scope, receive, send)
            return
        gw.in_flight += 1
        try:
            await app(scope, receive, send)
        finally:
            gw.in_flight -= 1

    return middleware


async def _serve(request: Request, endpoint: str, headers=None) -> Response:
    headers = request.headers if headers is None else headers

    async def answer_(gw: Gateway, rec, rid: str, raw: bytes) -> Response:
        answer = await unless_disconnected(request, handle(gw, endpoint, raw, headers, rid, rec.tenant), streamed)
        if answer is None:                  # the client left: its upstream call was cancelled
            return Response(b"", status_code=499)
        render = answer.render               # the client API's codec (OpenAI's, Anthropic's), after observability
        if answer.stream is not None:        # observability's stream wrapper completes the record at its end
            stream = gw.obs.stream(rec, answer.backend, answer.stream)
            return EventStream(render.stream(stream), status_code=200, media_type="text/event-stream",
                               headers={**answer.headers, "cache-control": "no-cache"})
        content = await gw.obs.finish(rec, answer.backend, answer.status, answer.content)   # secrets redacted
        status, content, media_type = render.content(answer.status, content, answer.content_type)
        sent = answer.headers
        if "charset=" in media_type:         # an upstream's own type, kept whole (Litestar would add another)
            sent = {**sent, "content-type": media_type}
        return Response(content, status_code=status, media_type=media_type, headers=sent)

    return await serve_observed(request, endpoint, headers, answer_)


async def _serve_messages(request: Request) -> Response:
    return await _serve(request, "messages", anthropic_headers(request))


@post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    return await _serve(request, "chat/completions")


@post("/v1/completions")
async def completions(request: Request) -> Response:
    return await _serve(request, "completions")


@post("/v1/embeddings")
async def embeddings(request: Request) -> Response:
    return await _serve(request, "embeddings")


@post("/v1/messages")
async def messages(request: Request) -> Response:
    """Anthropic Messages, served as its chat translation (``gateway/translate/anthropic.py``)."""
    return await _serve_messages(request)


# The same four endpoints on the hot path (``gateway/http/hot_path.py``): the handlers' bodies and the exception
# table (it answers each path in its API's error format).
HOT_ROUTES = {
    "/v1/chat/completions": HotRoute(partial(_serve, endpoint="chat/completions"), EXCEPTION_HANDLERS),
    "/v1/completions": HotRoute(partial(_serve, endpoint="completions"), EXCEPTION_HANDLERS),
    "/v1/embeddings": HotRoute(partial(_serve, endpoint="embeddings"), EXCEPTION_HANDLERS),
    "/v1/messages": HotRoute(_serve_messages, EXCEPTION_HANDLERS),
}


# The endpoints a public model is served on (``GET /v1/models`` lists them per model, one table: add a row per
# endpoint): a backend that does not speak one natively gets it translated, or is skipped for it.
MODEL_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/v1/embeddings")


def _model_object(name: str) -> dict:
    """A model as OpenAI lists it, with vLLM's ``root`` (its name here) and ``created`` the time of the answer
    (vLLM's ``ModelCard``; a gateway's public model has no creation date of its own)."""
    return {"id": name, "object": "model", "created": int(time.time()), "owned_by": "tandem", "root": name,
            "parent": None, "endpoints": list(MODEL_ENDPOINTS)}


def _authenticated(request: Request, snap) -> bool:
    """Authenticate a model listing's caller; whether it is the ``anthropic`` SDK (``wants_anthropic``: its
    ``x-api-key`` is its key, its 401 names that header, and it gets Anthropic's model objects)."""
    anthropic = wants_anthropic(request)
    snap.authenticate(anthropic_headers(request) if anthropic else request.headers,
                      "anthropic" if anthropic else "openai")
    return anthropic


@route("/v1/models", http_method=[HttpMethod.GET, HttpMethod.HEAD])   # HEAD wherever GET (RFC 9110)
async def models(request: Request) -> Response:
    """OpenAI's model list, or Anthropic's page of model objects for the ``anthropic`` SDK (``wants_anthropic``)."""
    snap = request.app.state.gw.snapshot
    compiled = snap.compiled
    if _authenticated(request, snap):
        page = anthropic_model_page(list(compiled.public_models), request.query_params)
        return Response(msgspec.json.encode(page), media_type=_JSON)
    data = [_model_object(m) for m in compiled.public_models]
    return Response(msgspec.json.encode({"object": "list", "data": data}), media_type=_JSON)


@route("/v1/models/{model:path}", http_method=[HttpMethod.GET, HttpMethod.HEAD])
async def model(request: Request) -> Response:
    """One model object (OpenAI's ``GET /v1/models/{model}``; Anthropic's for the ``anthropic`` SDK), for a public
    name or an alias (its ``id`` is the name asked for). Raises ClientError 404 ``model_not_found`` for any other
    name."""
    snap = request.app.state.gw.snapshot
    compiled = snap.compiled
    anthropic = _authenticated(request, snap)
    name = request.path_params["model"].lstrip("/")   # a path parameter keeps its leading slash; names may hold /
    if name not in compiled.model_names:
        raise model_not_found(name, compiled.public_models)
    body = anthropic_model(name) if anthropic else _model_object(name)
    return Response(msgspec.json.encode(body), media_type=_JSON)


# HEAD: uptime checkers; LiteLLM's /health/liveliness and /health/readiness and vLLM's /health and /ping (GET or
# POST, SageMaker's; both 503 while its engine cannot serve) name the same two probes
@route(["/health/live", "/health/liveliness"], http_method=[HttpMethod.GET, HttpMethod.HEAD])
async def live() -> Response:
    return Response(b'{"status":"ok"}', media_type=_JSON)


@route("/version", http_method=[HttpMethod.GET])
async def server_version() -> Response:
    """``{"version"}``: the ``tandem`` package's (vLLM's route, as ``tandem engine serve`` answers it)."""
    return Response(msgspec.json.encode({"version": tandem_version()}), media_type=_JSON)


@route(["/health/ready", "/health/readiness", "/health", "/ping"],
       http_method=[HttpMethod.GET, HttpMethod.HEAD, HttpMethod.POST])
async def ready(request: Request) -> Response:
    """Readiness: 200 ``ready``; 503 ``not_ready`` (config or local engine loading), ``draining``, or
    ``degraded`` (no route has a target that can serve now: every backend unavailable, a local engine that failed
    to start among them, or breaker-open), with
    the backends' and targets' states where the caller may see them (``operator_view``: names, addresses and
    unset keys are the operators'; a probe reads the status)."""
    gw = request.app.state.gw
    snap = gw.snapshot
    routes = snap.compiled.policy.routes if snap else {}
    backends, targets = await gw.resilience.status(routes, snap.backends) if snap else ({}, {})
    serving = gw.resilience.routes_serving(routes, backends, targets)
    status = "draining" if gw.draining else "not_ready" if not gw.ready else "ready" if serving else "degraded"
    body = {"status": status, "ready": status == "ready", "draining": gw.draining}
    if snap is None or operator_view(request):
        body.update({"config_version": snap.version if snap else None, "routes_serving": serving,
                     "redis_degraded": gw.redis_degraded or gw.resilience.degraded, "backends": backends,
                     "targets": targets})
    return Response(msgspec.json.encode(body), status_code=200 if status == "ready" else 503, media_type=_JSON)


def create_app(gw: Gateway, cors: CorsConfig | None = None, hot_path: bool = True) -> Litestar:
    """The ASGI app for one ``Gateway`` (its start/stop run in the lifespan); ``cors``: the ``server.cors``
    setting (None: no CORS headers, preflights refused); ``hot_path``: the client APIs' POST endpoints served past
    Litestar's router (``HOT_ROUTES``; always off with CORS)."""
    return HotPathApp(
        hot_routes=HOT_ROUTES if hot_path and cors is None else {},
        cors_config=CORSConfig(**cors.model_dump()) if cors is not None else None,
        route_handlers=[chat_completions, completions, models, model, live, ready, server_version, messages,
                        count_tokens, embeddings, *RESPONSES_HANDLERS, *TOKENIZATION_HANDLERS, *ADMIN_HANDLERS,
                        *ROLLOUT_HANDLERS, admin_limits, *CONSOLE_HANDLERS],
        state=State({"gw": gw, "responses": ResponseStore(gw.resilience.state)}),   # stored Responses
        middleware=[in_flight], before_send=[stamp_request_id(GATEWAY_ID_PREFIX), anthropic_request_id],
        on_startup=[gw.start, gw.obs.start], on_shutdown=[gw.obs.stop, gw.stop],
        exception_handlers=EXCEPTION_HANDLERS, openapi_config=None, request_max_body_size=None, logging_config=None,
    )
