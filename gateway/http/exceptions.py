"""The one exception table of the HTTP layer (Litestar's and the hot path's): every refusal, a handler's or the
router's (404 unknown path, 405 wrong method), becomes the error JSON of the API its path belongs to. One rule
decides by path (``anthropic_path``): Anthropic's ``{"type": "error", "error": {"type", "message"}}`` for
``/v1/messages`` and every path under it (``/v1/messages/count_tokens``, an unknown ``/v1/messages/...``);
OpenAI's ``{"error": {"message", "type", "param", "code"}}`` everywhere else (bodies: ``gateway/errors.py``)."""

from __future__ import annotations

import logging

from litestar import Request, Response
from litestar.exceptions import HTTPException

from gateway.config.schema import ConfigError
from gateway.errors import ClientError, anthropic_error_body, anthropic_status, error_body
from gateway.state import StateUnavailable
from gateway.translate.anthropic_render import messages_paths

log = logging.getLogger("tandem.gateway.app")
_JSON = "application/json"
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
ANTHROPIC_PREFIX = "/v1/messages"
# The official SDKs wait out a 429's Retry-After only up to a minute; without one, or with a longer one, they retry
# after their own backoff of a second or two, which cannot pass (openai-python's ``_calculate_retry_timeout``).
SDK_RETRY_AFTER_CAP_S = 60


def anthropic_path(path: str) -> bool:
    """Whether ``path`` belongs to Anthropic's API (``/v1/messages`` or under it), whose errors are Anthropic's."""
    return path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/")


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict | None = None) -> Response:
    """OpenAI's error response (body: ``gateway.errors.error_body``)."""
    return Response(error_body(status, message, param, code), status_code=status, media_type=_JSON,
                    headers=headers or None)


def anthropic_error_response(status: int, message: str, headers: dict | None = None,
                             native: bool = False, details: dict | None = None) -> Response:
    """Anthropic's error response (body: ``gateway.errors.anthropic_error_body``; status:
    ``gateway.errors.anthropic_status``); the chat translation's field paths in ``message`` are written as the
    Messages body's (``messages_paths``), unless ``native`` (a Messages check named the Messages body's own)."""
    text = message if native else messages_paths(message)
    return Response(anthropic_error_body(status, text, details=details), status_code=anthropic_status(status),
                    media_type=_JSON, headers=headers or None)


def _refusal(request: Request, status: int, message: str, param: str | None = None, code: str | None = None,
             headers: dict | None = None, native: bool = False, details: dict | None = None) -> Response:
    if anthropic_path(request.scope["path"]):
        return anthropic_error_response(status, message, headers, native, details)
    return error_response(status, message, param, code, headers)


def _on_client_error(request: Request, e: ClientError) -> Response:
    return _refusal(request, e.status, e.message, e.param, e.code, _with_retry_advice(e.status, e.headers),
                    e.native, e.details)


def _with_retry_advice(status: int, headers: dict[str, str]) -> dict[str, str]:
    """``headers`` of a refusal, with ``x-should-retry: false`` on a 429 that an SDK's own retries cannot pass: one
    without ``Retry-After`` (a request larger than a TPM limit) or with one beyond ``SDK_RETRY_AFTER_CAP_S`` (a
    spent budget, a long rate-limit window). A shorter ``Retry-After`` is left to the SDK, which waits it out."""
    if status != 429 or any(k.lower() == "x-should-retry" for k in headers):
        return headers
    retry_after = next((v for k, v in headers.items() if k.lower() == "retry-after"), None)
    try:
        waits = retry_after is not None and float(retry_after) <= SDK_RETRY_AFTER_CAP_S
    except ValueError:
        waits = False
    return headers if waits else {**headers, "x-should-retry": "false"}


def _on_config_error(request: Request, e: ConfigError) -> Response:
    return _refusal(request, 400, str(e), param=e.errors[0][0] if e.errors else None, code="invalid_config")


def _on_state_unavailable(request: Request, e: StateUnavailable) -> Response:
    return _refusal(request, 503, str(e), code="redis_unavailable")


def _on_http_error(request: Request, e: Exception) -> Response:
    if isinstance(e, HTTPException):      # the router's 404 / 405 (with its ``Allow`` header) among them
        message = str(e.detail)
        if e.status_code in (404, 405) and message in ("Not Found", "Method Not Allowed"):   # the router's own
            # OpenAI's words, naming what was asked (a new user's /v1/chat/completion got a bare "Not Found")
            message = f"Invalid URL ({request.method} {request.scope['path']})" if e.status_code == 404 else \
                f"Method {request.method} is not allowed on {request.scope['path']}"
        return _refusal(request, e.status_code, message, code=_HTTP_CODES.get(e.status_code), headers=e.headers)
    log.exception("unhandled error on %s", request.scope["path"])
    return _refusal(request, 500, "internal error", code="internal_error")


# exception -> error response, for every handler and the router (the app's table; the hot path's too)
EXCEPTION_HANDLERS = {ClientError: _on_client_error, ConfigError: _on_config_error, HTTPException: _on_http_error,
                      StateUnavailable: _on_state_unavailable, Exception: _on_http_error}
