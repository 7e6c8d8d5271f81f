"""The ``local`` backend: the co-located engine (``engine.async_engine.
AsyncEngine``, its core in a child process by default) behind
``engine/entrypoints/chat.py`` and ``completion.py``, the same OpenAI layer
as ``tandem engine serve``."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import msgspec

from gateway.config.schema import LocalBackendConfig
from gateway.errors import BackendError
from gateway.request.validate import count_prompt_tokens
from gateway.resilience.outcomes import UpstreamResponse

log = logging.getLogger("tandem.gateway.local")


class LocalBackend:
    """The co-located engine. Unavailable until ``start()`` has loaded the
    model (or for good when loading failed: ``unavailable_reason``)."""

    kind = "local"

    def __init__(self, name: str, cfg: LocalBackendConfig):
        self.name, self.cfg = name, cfg
        self.engine = None
        self.serving = None
        self.served_model_name = cfg.engine.served_model_name or ""
        self.max_model_len = cfg.engine.max_model_len
        self.available, self.unavailable_reason = False, "engine is loading"
        self.loading = True              # until start() ends (loaded or failed); requests get 503 engine_loading
        self.active = 0
        self._encode = msgspec.json.encode

    async def start(self) -> None:
        """Build and start the engine (loads the model in a worker thread).
        Never raises: a failure marks the backend unavailable and is logged."""
        try:   # lazy: the engine (and torch) load only when a local backend starts
            from engine.async_engine import AsyncEngine
            from engine.config import EngineArgs
            from engine.entrypoints.chat import OpenAIServingChat
            from engine.entrypoints.completion import OpenAIServingCompletion
            from engine.entrypoints.protocol import ServingError

            args = EngineArgs(**self.cfg.engine.engine_kwargs())
            engine = AsyncEngine(args)
            await engine.start()
            self.engine = engine
            self.served_model_name = engine.served_model_name
            self.max_model_len = engine.max_model_len
            self.serving = {"chat/completions": OpenAIServingChat(engine, engine.served_model_name).create_chat_completion,
                            "completions": OpenAIServingCompletion(engine, engine.served_model_name).create_completion}
            self.serving_error = ServingError
            self.available, self.unavailable_reason = True, ""
            log.info("local engine ready: %s (max_model_len %s)", self.served_model_name, self.max_model_len)
        except Exception as e:  # noqa: BLE001 -- reported, backend marked unavailable
            self.available, self.unavailable_reason = False, f"engine failed to start: {type(e).__name__}: {e}"
            log.error("local backend %s unavailable: %s", self.name, self.unavailable_reason)
        finally:
            self.loading = False

    def upstream_model(self, public_model: str, target_model: str) -> str:
        return target_model or self.served_model_name or public_model

    def stats(self) -> tuple[int, int, float]:
        """(waiting, running, KV-cache usage percent) of the engine; zeros before start."""
        if self.engine is None:
            return 0, 0, 0.0
        s = self.engine.get_stats()
        return int(s.num_waiting), int(s.num_running), float(s.kv_cache_usage) * 100.0

    def count_prompt_tokens(self, body: dict) -> int | None:
        """Prompt length in tokens as the engine will run it (``gateway.request.validate.count_prompt_tokens``
        with the engine's tokenizer); None when the engine is not loaded."""
        return None if self.engine is None else count_prompt_tokens(self.engine.tokenizer, body)

    async def _call(self, endpoint: str, body: dict, request_id: str, priority: int):
        if self.serving is None:
            raise BackendError("unavailable", f"{self.name}: {self.unavailable_reason}", 503)
        fn = self.serving["chat/completions" if endpoint == "chat/completions" else "completions"]
        try:
            return await fn(body, request_id, priority)
        except self.serving_error as e:
            raise BackendError("http", f"{self.name}: {e.message}", e.status_code, self._encode(e.to_dict())) from None

    async def send(self, endpoint: str, body: dict, request_id: str, priority: int) -> UpstreamResponse:
        """Run one non-streaming request; the OpenAI JSON answer.

        Raises:
            BackendError: "http" with the serving layer's status for bad input,
                "unavailable" before the engine is loaded."""
        self.active += 1
        try:
            result = await self._call(endpoint, body, request_id, priority)
            return UpstreamResponse(200, {"content-type": "application/json"}, body=self._encode(result))
        finally:
            self.active -= 1

    async def open_stream(self, endpoint: str, body: dict, request_id: str, priority: int) -> AsyncIterator[bytes]:
        """Start a streaming request; SSE byte lines (``data: ...\\n\\n``)."""
        self.active += 1
        try:
            result = await self._call(endpoint, body, request_id, priority)
        except BaseException:
            self.active -= 1
            raise
        return self._relay(result)

    async def _relay(self, it: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        try:
            async for chunk in it:
                yield chunk
        finally:
            self.active -= 1
            aclose = getattr(it, "aclose", None)
            if aclose is not None:
                await aclose()

    async def aclose(self) -> None:
        if self.engine is not None:
            try:
                await asyncio.wait_for(self.engine.shutdown(drain=False), 10.0)
            except Exception as e:  # noqa: BLE001
                log.warning("engine shutdown: %s", e)
