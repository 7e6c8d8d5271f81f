"""``anthropic`` backends: an upstream that speaks Anthropic's Messages API. The client's Messages body goes to
``POST base_url/messages`` as it came (``gateway/backends/dispatch.py`` hands it over, ``model`` rewritten), with
Anthropic's auth headers (``x-api-key``, ``anthropic-version``) and the client's ``anthropic-beta``; a chat request
(and a Responses one, translated onto chat) is translated into a Messages body
(``gateway/translate/chat_to_anthropic.py``) unless it asks for what Anthropic's API cannot give (``refusal``). The
answer comes back as chat completions (``gateway/translate/anthropic_answer.py``) so the attempt loop, the ledger and
observability read one format, and the HTTP layer renders it as the client's API again."""

from __future__ import annotations

import time
from collections.abc import Mapping

import msgspec

from gateway.backends.upstream import UpstreamBackend
from gateway.errors import BackendError
from gateway.resilience.outcomes import UpstreamResponse
from gateway.translate.anthropic_answer import NATIVE, chat_events, message_to_chat
from gateway.translate.chat_to_anthropic import chat_to_messages, openai_error, untranslatable
from gateway.values import ChatStream


class AnthropicBackend(UpstreamBackend):
    """An upstream of ``type: anthropic`` (``gateway.config.backend_schema.AnthropicBackendConfig``)."""

    kind = "anthropic"
    endpoints = ("messages", "chat/completions")
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

    def refusal(self, req) -> tuple[str, str] | None:
        """Why this backend cannot serve ``req`` (a ``GatewayRequest``), as ``(param, reason)``; None when it can:
        a Messages request always can, a chat one unless it asks for what the Messages API cannot give
        (``chat_to_anthropic.untranslatable``), a request of another endpoint never."""
        if req.anthropic_body is not None:
            return None
        if req.endpoint != "chat/completions":
            return "model", (f"an anthropic backend serves chat completions and /v1/messages, not "
                             f"/v1/{req.endpoint}")
        return untranslatable(req.body)

    async def send(self, endpoint: str, payload: bytes, request_id: str,
                   extra_headers: Mapping[str, str] | None = None) -> UpstreamResponse:
        """POST the Messages body ``payload``; the answer as a chat completion (JSON bytes). ``endpoint``: the
        client's API (``payload``'s first item): a ``messages`` answer keeps the upstream's Message (``NATIVE``),
        a chat one is a chat completion alone, an error OpenAI's error JSON.

        Raises:
            BackendError: as ``UpstreamBackend.send`` (an error body passes as Anthropic wrote it to a Messages
                client)."""
        r = await self._messages(super().send, endpoint, payload, request_id, extra_headers)
        try:
            chat = message_to_chat(msgspec.json.decode(r.body))
        except (msgspec.DecodeError, AttributeError, TypeError):
            raise BackendError("http", f"{self.name}: the Messages answer is not a Message object", 502) from None
        if endpoint != "messages":
            del chat[NATIVE]
            chat["created"] = int(time.time())
        return UpstreamResponse(r.status, {"content-type": "application/json"}, body=msgspec.json.encode(chat))

    async def open_stream(self, endpoint: str, payload: bytes, request_id: str,
                          extra_headers: Mapping[str, str] | None = None) -> ChatStream:
        """Start a streamed Messages call; its events, each decoded once, as a chat stream's ``ChatEvent``s."""
        return chat_events(await self._messages(self.open_sse, endpoint, payload, request_id, extra_headers))

    async def open_chat_stream(self, req, request_id: str, body: dict) -> ChatStream:
        """A shadow's stream of the chat ``body`` under ``request_id``, translated (``req`` unused)."""
        payload = msgspec.json.encode(chat_to_messages(body, body.get("model") or ""))
        return await self.open_stream("chat/completions", payload, request_id)

    async def _messages(self, call, endpoint: str, payload: bytes, request_id: str, extra_headers):
        """``call`` (``send`` or ``open_sse``) on ``POST base_url/messages``; an HTTP error's Anthropic body given
        to a chat client as OpenAI's error JSON."""
        try:
            return await call("messages", payload, request_id, extra_headers)
        except BackendError as e:
            if endpoint != "messages" and e.kind == "http" and e.body:
                e.body, e.content_type = openai_error(e.status, e.body), "application/json"
            raise
