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


def error_body(status: int, message: str, param: str | None = None, code: str | None = None,
               type_: str | None = None) -> bytes:
    """OpenAI's error JSON: ``{"error": {"message", "type", "param", "code"}}`` as bytes."""
    return msgspec.json.encode({"error": {"message": message, "type": type_ or _TYPES.get(status, "server_error"),
                                          "param": param, "code": code}})


# Anthropic's error types by status (https://docs.anthropic.com/en/api/errors); 529 is its "overloaded".
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                    422: "invalid_request_error", 429: "rate_limit_error", 503: "overloaded_error",
                    529: "overloaded_error"}


def anthropic_status(status: int) -> int:
    """The HTTP status ``/v1/messages`` answers for the gateway's ``status``: 529 (Anthropic's ``overloaded_error``)
    for 503 (engine loading, draining, no backend available), which Anthropic's API never sends; else ``status``."""
    return 529 if status == 503 else status


def anthropic_error_body(status: int, message: str, type_: str | None = None) -> bytes:
    """Anthropic's error JSON (``/v1/messages``): ``{"type": "error", "error": {"type", "message"}}`` as bytes."""
    return msgspec.json.encode({"type": "error", "error": {"type": type_ or _ANTHROPIC_TYPES.get(status, "api_error"),
                                                           "message": message}})


class ClientError(Exception):
    """A request the gateway refuses; becomes an OpenAI error response."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}


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
