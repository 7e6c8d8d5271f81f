"""The HTTP edges of Anthropic's API: the ``x-api-key`` header as a virtual key,
``POST /v1/messages/count_tokens`` (refusals on ``/v1/messages*`` are Anthropic's error JSON:
``gateway/http/exceptions.py``), and Anthropic's model objects, which ``app.py``'s ``GET /v1/models`` answers the
``anthropic`` SDK. ``POST /v1/messages`` itself is served by ``app.py``'s request path."""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from dataclasses import replace
from datetime import datetime, timezone

import msgspec
from litestar import Request, Response, post

from gateway.errors import ClientError, model_not_found
from gateway.http.transport import read_json_body
from gateway.offload import off_loop
from gateway.request.auth import bearer
from gateway.request.pipeline import served_by_engine
from gateway.request.validate import check_request, estimate_prompt_tokens, parse_json
from gateway.translate.anthropic import messages_to_chat
from gateway.translate.anthropic_render import messages_paths

_JSON = "application/json"


def anthropic_headers(request: Request) -> Mapping[str, str]:
    """The request's headers with Anthropic's ``x-api-key`` read as the bearer key (a virtual key), when the client
    sent no ``Authorization`` header (the ``anthropic`` SDK sends only ``x-api-key``).

    Raises:
        ClientError: 401 when virtual keys are configured and ``x-api-key`` and ``Authorization: Bearer`` name
            different keys (a security trial's bad ``x-api-key`` beside another tenant's good bearer key was
            served, billed to the bearer's tenant: neither may be picked silently)."""
    headers = request.headers
    key = headers.get("x-api-key")
    auth = headers.get("authorization")
    if not key:
        return headers
    if not auth:
        return {**headers, "authorization": f"Bearer {key}"}
    if request.app.state.gw.snapshot.compiled.key_hashes and bearer(auth) != key.strip():
        raise ClientError(401, "x-api-key and Authorization: Bearer name different keys: send one of them",
                          code="invalid_api_key")
    return headers


def wants_anthropic(request: Request) -> bool:
    """Whether a request off ``/v1/messages`` is Anthropic's API (the ``anthropic`` SDK sends ``anthropic-version``
    with every request): ``GET /v1/models`` answers it Anthropic's model objects (an SDK trial's ``created_at`` and
    ``display_name`` were None in OpenAI's list)."""
    return "anthropic-version" in request.headers


def anthropic_model(name: str) -> dict:
    """Anthropic's model object for a public model (``created_at``: the answer's time, as OpenAI's ``created``:
    a gateway's public model has no creation date of its own)."""
    return {"type": "model", "id": name, "display_name": name, "created_at": _rfc3339(time.time())}


def anthropic_model_page(names: list[str], query: Mapping[str, str]) -> dict:
    """Anthropic's ``GET /v1/models`` page of ``names`` (in order): ``limit`` of them (1-1000, default 20) after
    ``after_id`` or before ``before_id``, with ``has_more``, ``first_id`` and ``last_id``.

    Raises:
        ClientError: 400 naming a ``limit`` out of range or not an integer."""
    try:
        limit = int(query.get("limit", 20))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 1000:
        raise ClientError(400, "limit: Input should be an integer from 1 to 1000", param="limit")
    after, before = query.get("after_id"), query.get("before_id")
    lo = 0 if after is None else names.index(after) + 1 if after in names else len(names)
    hi = len(names) if before is None else names.index(before) if before in names else 0
    window = names[lo:hi]
    page = window[-limit:] if before is not None and after is None else window[:limit]   # the ones next to it
    more = len(window) > len(page)
    return {"data": [anthropic_model(n) for n in page], "has_more": more,
            "first_id": page[0] if page else None, "last_id": page[-1] if page else None}


_DURATION = re.compile(r"(?:(\d+)h)?(?:(\d+)m(?!s))?(?:(\d+)s)?(?:(\d+)ms)?$")


def _reset_time(duration: bytes, now_s: float) -> bytes:
    """An ``x-ratelimit-reset-*`` duration (``"6m0s"``, ``"250ms"``) as Anthropic's reset: an RFC 3339 UTC time."""
    m = _DURATION.match(duration.decode("latin-1"))
    h, mi, s, ms = (int(x or 0) for x in m.groups()) if m else (0, 0, 0, 0)
    return _rfc3339(now_s + h * 3600 + mi * 60 + s + ms / 1000).encode()


def _rfc3339(at_s: float) -> str:
    """Unix seconds as Anthropic writes a time: RFC 3339, UTC, whole seconds (``2026-12-08T01:15:46Z``)."""
    return datetime.fromtimestamp(at_s, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


async def anthropic_request_id(message, scope) -> None:
    """A ``before_send`` hook after ``stamp_request_id``: responses on ``/v1/messages*`` carry the request id as
    Anthropic's ``request-id`` header too (the ``anthropic`` SDK reads it for ``_request_id``), and the rate limits
    as Anthropic's ``anthropic-ratelimit-{requests,tokens}-{limit,remaining,reset}`` beside OpenAI's
    ``x-ratelimit-*`` (an ops trial's clients read Anthropic's names)."""
    if message["type"] == "http.response.start" and scope.get("path", "").startswith("/v1/messages"):
        headers = list(message.get("headers", ()))
        extra = []
        for k, v in headers:
            name = k.lower()
            if name == b"x-request-id":
                extra.append((b"request-id", v))
            elif name.startswith(b"x-ratelimit-"):
                kind, _, unit = name[len(b"x-ratelimit-"):].partition(b"-")   # limit / remaining / reset
                if kind == b"reset":
                    v = _reset_time(v, time.time())
                extra.append((b"anthropic-ratelimit-" + unit + b"-" + kind, v))
        if extra:
            message["headers"] = headers + extra


@post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> Response:
    """Anthropic's token count of a Messages body (``{"input_tokens": n}``): the local engine's rendering (chat
    template, tools) when it is up, else the gateway's estimate. Authenticated and validated like
    ``/v1/messages``, and refused as it would be where the policy would send it to the local engine and the engine
    refuses it (an image on a text-only model: a trial's count was a 200 of 1605 tokens, its create a 400); not
    routed, limited or billed (no model is called)."""
    snap = request.app.state.gw.snapshot
    compiled = snap.compiled
    headers = anthropic_headers(request)
    tenant = snap.authenticate(headers, "anthropic")
    raw = await read_json_body(request, snap.max_body_size, compiled.config.server.body_timeout_s)
    n = await off_loop(len(raw), _count, snap, raw, tenant)   # a 4 MB body: seconds, off the loop
    return Response(msgspec.json.encode({"input_tokens": n}), status_code=200, media_type=_JSON)


def _count(snap, raw: bytes, tenant: str) -> int:
    """The input tokens of the Messages body ``raw`` (``count_tokens``'s answer)."""
    compiled = snap.compiled
    body = parse_json(raw)
    req = check_request(messages_to_chat(body, count_only=True), "chat/completions", None, compiled.local_serves,
                        tenant=tenant)
    if (public := compiled.model_names.get(req.model)) is None:
        raise model_not_found(req.model, compiled.public_models)
    rendered = None
    if snap.local is not None and snap.local.available:
        refuse = served_by_engine(snap, replace(req, public_model=public,
                                                prompt_tokens=estimate_prompt_tokens(req.body)))
        try:
            rendered = snap.local.render("chat/completions", req.body, refuse=refuse)
        except ClientError as e:    # in the Messages body's paths, as create's (anthropic_render.anthropic_error)
            raise ClientError(e.status, messages_paths(e.message, body), code=e.code, native=True) from None
    return rendered.prompt_tokens if rendered is not None else estimate_prompt_tokens(req.body)
