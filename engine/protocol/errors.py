"""The error a server returns to a client in OpenAI's format: raised by the engine's OpenAI layer and its
server, and read by the gateway (the local backend's refusals, ``tandem route explain``)."""

from __future__ import annotations

# Retry-After of a request that arrives while the engine loads its model, seconds: the engine server's 503 and
# the gateway's for its co-located engine (the default model loads in seconds)
ENGINE_LOADING_RETRY_AFTER_S = 5


class ServingError(Exception):
    """An error to return to the client in OpenAI's format.

    Attributes:
        status_code: HTTP status (400 bad input, 404 unknown model, 503
            draining or dead engine, 500 internal).
        message: human-readable, names the parameter at fault.
        type: OpenAI error type ("invalid_request_error", "server_error", ...).
        param: the request field at fault, or None.
        code: OpenAI error code (e.g. "model_not_found"), or None.
        headers: extra response headers (``Retry-After`` on a 503 while loading).
    """

    def __init__(self, status_code: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def to_dict(self) -> dict:
        """``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
