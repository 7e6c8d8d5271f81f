"""``anthropic`` backends: an upstream that speaks Anthropic's Messages API. The client's Messages body goes to
``POST base_url/messages`` as it came (``gateway/backends/dispatch.py`` hands it over, ``model`` rewritten), with
Anthropic's auth headers (``x-api-key``, ``anthropic-version``) and the client's ``anthropic-beta``; the answer comes back as chat completions
(``gateway/translate/anthropic_answer.py``) so the attempt loop, the ledger and observability read one format, and
the HTTP layer renders it as Anthropic's again. Only ``/v1/messages`` requests are sent to it."""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from gateway.backends.upstream import UpstreamBackend
from gateway.errors import BackendError
from gateway.resilience.outcomes import UpstreamResponse
from gateway.translate.anthropic_answer import chat_events, message_to_chat
from gateway.values import ChatStream


class AnthropicBackend(UpstreamBackend):
    """An upstream of ``type: anthropic`` (``gateway.config.backend_schema.AnthropicBackendConfig``)."""

    kind = "anthropic"
    endpoints = ("messages",)
    client_headers = ("anthropic-beta",)     # the client's beta features, which the Messages body relies on

    def endpoint(self) -> None:
        """Anthropic's API is not the client's: a data plane cannot be handed its address."""
        return None

    def api_headers(self) -> dict[str, str]:
        """The API version, required on every request."""
        return {"anthropic-version": self.cfg.anthropic_version}

    def auth_headers(self, key: str) -> dict[str, str]:
        """Anthropic's key header."""
        return {"x-api-key": key}

    async def send(self, endpoint: str, payload: bytes, request_id: str,
                   extra_headers: Mapping[str, str] | None = None) -> UpstreamResponse:
        """POST the Messages body ``payload``; the answer as a chat completion (JSON bytes).

        Raises:
            BackendError: as ``UpstreamBackend.send`` (an error body passes as Anthropic wrote it)."""
        r = await super().send("messages", payload, request_id, extra_headers)
        try:
            chat = message_to_chat(msgspec.json.decode(r.body))
        except (msgspec.DecodeError, AttributeError, TypeError):
            raise BackendError("http", f"{self.name}: the Messages answer is not a Message object", 502) from None
        return UpstreamResponse(r.status, {"content-type": "application/json"}, body=msgspec.json.encode(chat))

    async def open_stream(self, endpoint: str, payload: bytes, request_id: str,
                          extra_headers: Mapping[str, str] | None = None) -> ChatStream:
        """Start a streamed Messages call; its events, each decoded once, as a chat stream's ``ChatEvent``s."""
        return chat_events(await self.open_sse("messages", payload, request_id, extra_headers))
