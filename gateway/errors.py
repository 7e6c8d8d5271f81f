"""OpenAI-format errors (the one builder of their JSON), the backend failure type, and the one taxonomy of
transport errors."""

from __future__ import annotations

import asyncio

import httpx
import msgspec

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "invalid_request_error", 405: "invalid_request_error", 409: "invalid_request_error",
          413: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error",
          502: "upstream_error", 503: "service_unavailable", 504: "timeout_error"}


# An error echoes parts of the request (a model name, a parameter, an id): at most this many characters of its
# message and its param, so that a megabyte sent is not a megabyte answered (and logged).
MESSAGE_CHARS, PARAM_CHARS = 4096, 256


def clip(text: str | None, limit: int) -> str | None:
    """``text`` cut to ``limit`` characters, saying how many were left out; None stays None."""
    if text is None or len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more characters)"


def _error_type(status: int, types: dict[int, str], client: str, server: str) -> str:
    """The error ``type`` of ``status``: its entry in ``types``, else ``client`` for any other 4xx (408, 415,
    431...: the client's request) and ``server`` for the rest."""
    return types.get(status) or (client if 400 <= status < 500 else server)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None,
               type_: str | None = None) -> bytes:
    """OpenAI's error JSON: ``{"error": {"message", "type", "param", "code"}}`` as bytes (message and param
    ``clip``-ped)."""
    return msgspec.json.encode({"error": {
        "message": clip(message, MESSAGE_CHARS), "param": clip(param, PARAM_CHARS), "code": code,
        "type": type_ or _error_type(status, _TYPES, "invalid_request_error", "server_error")}})


# Anthropic's error types and the HTTP status each is sent with (https://docs.anthropic.com/en/api/errors; 529 is
# its "overloaded"): an error event in its stream, which carries no status, is judged as that status (an
# overloaded_error event before content is the 529 a whole answer would have been).
ANTHROPIC_TYPE_STATUS = {"invalid_request_error": 400, "authentication_error": 401, "permission_error": 403,
                         "not_found_error": 404, "request_too_large": 413, "rate_limit_error": 429,
                         "api_error": 500, "overloaded_error": 529}
# The type /v1/messages answers for the gateway's status: Anthropic's own pairs, and the gateway's statuses its API
# has none for (405, 422: the request's; 503: the gateway's overloaded, answered 529 by ``anthropic_status``).
_ANTHROPIC_TYPES = {**{s: t for t, s in ANTHROPIC_TYPE_STATUS.items() if s < 500}, 405: "invalid_request_error",
                    422: "invalid_request_error", 503: "overloaded_error", 529: "overloaded_error"}


def anthropic_status(status: int) -> int:
    """The HTTP status ``/v1/messages`` answers for the gateway's ``status``: 529 (Anthropic's ``overloaded_error``)
    for 503 (engine loading, draining, no backend available), which Anthropic's API never sends; else ``status``."""
    return 529 if status == 503 else status


def anthropic_error_body(status: int, message: str, type_: str | None = None, details: dict | None = None) -> bytes:
    """Anthropic's error JSON (``/v1/messages``): ``{"type": "error", "error": {"type", "message"}}`` as bytes
    (the message ``clip``-ped), with ``error.details`` when given (its ``error_code`` is what the SDK branches on,
    e.g. ``thread_unsupported_request``)."""
    error = {"type": type_ or _error_type(status, _ANTHROPIC_TYPES, "invalid_request_error", "api_error"),
             "message": clip(message, MESSAGE_CHARS)}
    if details:
        error["details"] = details
    return msgspec.json.encode({"type": "error", "error": error})


class ClientError(Exception):
    """A request the gateway refuses; becomes an OpenAI error response. Its message and param are ``clip``-ped
    where they are made, so the log line and the answer carry the same bounded text."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None, native: bool = False, details: dict | None = None):
        message, param = clip(message, MESSAGE_CHARS), clip(param, PARAM_CHARS)
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}
        self.native = native   # the message names the client API's own paths (not the chat translation's)
        self.details = details  # Anthropic's ``error.details`` (the Messages API's answer only)


def model_not_found(name: str, available) -> ClientError:
    """The 404 (``model_not_found``, param ``model``) for a model name that is neither a public model nor an alias;
    ``available``: the public model names, listed in the message. Anthropic's endpoints render it as their
    ``not_found_error``."""
    return ClientError(404, f"The model '{name}' does not exist; available: {', '.join(available)}",
                       param="model", code="model_not_found")


class BackendError(Exception):
    """One failed attempt at one backend.

    Attributes:
        kind: "connect" (refused/reset/DNS), "timeout" (connect/read/first
            token), "http" (the backend answered with an error status),
            "unavailable" (not started, key unset), "stream" (broken stream).
        status: the HTTP status to report (the backend's for "http").
        body: the backend's error body (OpenAI JSON), passed through for
            non-retryable errors.
        retry_after: the backend's Retry-After header, seconds, if any.
    """

    def __init__(self, kind: str, message: str, status: int = 502, body: bytes | None = None,
                 retry_after: float | None = None, content_type: str = "application/json"):
        super().__init__(message)
        self.kind, self.message, self.status = kind, message, status
        self.body, self.retry_after, self.content_type = body, retry_after, content_type

def transport_error_kind(exc: BaseException) -> str:
    """``timeout`` | ``connect_error`` | ``connection_error`` | ``error`` for a transport exception of httpx,
    aiohttp or asyncio (aiohttp by class name: it is not imported here)."""
    name = type(exc).__name__
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError, httpx.TimeoutException)) or "Timeout" in name:
        return "timeout"
    if isinstance(exc, (httpx.ConnectError, ConnectionRefusedError)) or "Connector" in name:
        return "connect_error"
    if isinstance(exc, (httpx.TransportError, ConnectionError, OSError)) or name.startswith(("Client", "Server")):
        return "connection_error"
    return "error"
