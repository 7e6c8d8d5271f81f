"""The ``local`` backend: the co-located engine (``engine.async_engine.
AsyncEngine``, its core in a child process by default) behind
``engine/serving/chat.py`` and ``completion.py``, the same OpenAI layer
as ``tandem engine serve``."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace

import msgspec

from gateway.backends.relabel import answer_id
from gateway.config.backend_schema import LocalBackendConfig
from gateway.errors import BackendError, ClientError
from gateway.resilience.outcomes import UpstreamResponse, Withdrawn
from gateway.translate.chat_events import event_from_object
from gateway.values import DONE, GATEWAY_ONLY_FIELDS, ChatStream, GatewayRequest
from policies import tenant_label
from policies.slo import Handover

log = logging.getLogger("tandem.gateway.local")


def _as_sent(rendered, body: dict, client_body: dict):
    """Routing's rendering (parsed from the client's body, ``client_body``) with the fields the gateway sends the
    engine instead in ``body``: ``stream_options`` (``include_usage``: the ledger bills the engine's own count)
    and ``cache_salt`` (the tenant's); one replace of its request."""
    from engine.serving.protocol import StreamOptions   # loaded already: a rendering needs the engine

    fields = {"cache_salt": body["cache_salt"]} if "cache_salt" in body else {}
    if body.get("stream_options") != client_body.get("stream_options"):
        fields["stream_options"] = msgspec.convert(body["stream_options"], StreamOptions)
    return replace(rendered, request=msgspec.structs.replace(rendered.request, **fields)) if fields else rendered


def tenant_cache_salt(req: GatewayRequest) -> str:
    """The engine's ``cache_salt`` for ``req``: a hash of its tenant's label ("anonymous" without a key) and of
    the client's own ``cache_salt`` if it sent one, so that two tenants never share prefix-cache blocks (a
    tenant's ``cached_tokens`` would tell it what another sent) and a client's salt only splits its own tenant's
    cache further: it can never name another tenant's."""
    client = req.body.get("cache_salt")
    key = msgspec.json.encode([tenant_label(req.tenant), client if isinstance(client, str) else ""])
    return "tenant-" + hashlib.sha256(key).hexdigest()


def render_prompt(tokenizer, endpoint: str, body: dict):
    """``body`` as the local engine runs it (``engine.serving.chat.render_chat``,
    ``embeddings.render_embeddings`` or ``completion.render_completion`` on ``endpoint``), without the
    gateway-only fields and ``model`` (rewritten per target). Used by ``LocalBackend.render`` and ``tandem route
    explain``.

    Raises:
        engine.protocol.errors.ServingError: 400, the engine refuses the body.
    """
    from engine.serving.chat import render_chat   # lazy: the engine loads only with a local backend or explain
    from engine.serving.completion import render_completion
    from engine.serving.embeddings import render_embeddings

    render = {"chat/completions": render_chat, "embeddings": render_embeddings}.get(endpoint, render_completion)
    return render(tokenizer, {k: v for k, v in body.items() if k not in GATEWAY_ONLY_FIELDS and k != "model"})


class Checkpoint:
    """A hand-over's checkpoint on one request in the engine (``policies.slo.Handover``): at ``admitted +
    after_s`` (monotonic seconds) the engine re-predicts the request's first token from its place in its queue
    and withdraws it, nothing of it computed, when ``scale`` x that comes after ``admitted + by_s``
    (``AsyncEngine.withdraw``). ``withdrawn`` is set before the request's stream sees the engine's error."""

    def __init__(self, engine, request_id: str, handover: Handover, admitted: float):
        self.withdrawn = False
        self.predicted_s: float | None = None
        self.handover = handover
        self._task = asyncio.ensure_future(self._run(engine, request_id, admitted))

    async def _run(self, engine, request_id: str, admitted: float) -> None:
        h = self.handover
        await asyncio.sleep(max(admitted + h.after_s - time.monotonic(), 0.0))
        try:
            self.withdrawn, self.predicted_s = await engine.withdraw(request_id, admitted + h.by_s, h.scale)
        except Exception:  # noqa: BLE001 - the engine died: its requests fail on their own
            log.debug("withdraw of %s failed", request_id, exc_info=True)

    def error(self) -> Withdrawn:
        return Withdrawn(f"withdrawn at {self.handover.after_s:.2f} s: first token predicted "
                         f"{self.handover.scale * (self.predicted_s or 0.0):.2f} s later, after the SLO's "
                         f"{self.handover.by_s:g} s; handed over to {self.handover.to}")

    def close(self) -> None:
        self._task.cancel()


class LocalBackend:
    """The co-located engine. Unavailable until ``start()`` has loaded the
    model (or for good when loading failed: ``unavailable_reason``). An engine whose core died (killed, out of
    memory) is restarted: the active probe (``probe``) or the first request to meet it finds it dead, marks the
    backend unavailable (routing takes the fallbacks, ``/health/ready`` names why) and loads a new one
    (``restarts`` counts them)."""

    kind = "local"
    endpoints = ("chat/completions", "completions", "embeddings")   # what its OpenAI layer serves
    continuous_usage = True    # takes vLLM's stream_options.continuous_usage_stats (usage on every chunk)

    def endpoint(self) -> None:
        """The co-located engine has no address an endpoint picker could hand a data plane."""
        return None

    def __init__(self, name: str, cfg: LocalBackendConfig):
        self.name, self.cfg = name, cfg
        self.engine = None
        self.serving = None
        self.tokenizing = None           # the engine's /tokenize and /detokenize (OpenAIServingTokenization)
        self.served_model_name = cfg.engine.served_model_name or ""
        self.max_model_len = cfg.engine.max_model_len
        self.available, self.unavailable_reason = False, "engine is loading"
        self.key_missing = False         # it needs no key (UpstreamBackend's)
        self.loading = True              # until start() ends (loaded or failed; a restart's too): 503 engine_loading
        self.active = 0
        self.restarts = 0                # engines started again after their core died
        self._restart: asyncio.Task | None = None
        # called once a restarted engine is loaded (the gateway closes its targets' breakers: their failures were
        # the dead engine's)
        self.on_restarted: Callable[[], Awaitable[None]] | None = None
        self._encode = msgspec.json.encode

    async def start(self) -> None:
        """Build and start the engine (loads the model in a worker thread).
        Never raises: a failure marks the backend unavailable and is logged."""
        try:   # lazy: the engine (and torch) load only when a local backend starts
            from engine.async_engine import AsyncEngine
            from engine.config import EngineArgs
            from engine.serving.chat import OpenAIServingChat
            from engine.serving.completion import OpenAIServingCompletion
            from engine.serving.embeddings import OpenAIServingEmbedding
            from engine.serving.tokenization import OpenAIServingTokenization
            from engine.protocol.errors import ServingError

            args = EngineArgs(**self.cfg.engine.engine_kwargs())
            engine = AsyncEngine(args)
            await engine.start()
            self.engine = engine
            self.served_model_name = engine.served_model_name
            self.max_model_len = engine.max_model_len
            self.serving = {"chat/completions": OpenAIServingChat(engine, engine.served_model_name).create_chat_completion,
                            "completions": OpenAIServingCompletion(engine, engine.served_model_name).create_completion,
                            "embeddings": OpenAIServingEmbedding(engine, engine.served_model_name).create_embedding}
            self.tokenizing = OpenAIServingTokenization(engine, engine.served_model_name)
            self.serving_error = ServingError
            self.available, self.unavailable_reason = True, ""
            log.info("local engine ready: %s (max_model_len %s)", self.served_model_name, self.max_model_len)
        except Exception as e:  # noqa: BLE001 -- reported, backend marked unavailable
            self.available, self.unavailable_reason = False, f"engine failed to start: {type(e).__name__}: {e}"
            log.error("local backend %s unavailable: %s", self.name, self.unavailable_reason)
        finally:
            self.loading = False

    def provider(self) -> str:
        """The provider label of records and metrics: ``tandem``, whatever the backend's name."""
        return "tandem"

    def refusal(self, req: GatewayRequest) -> tuple[str, str] | None:
        """None: the engine takes every endpoint; a field it does not serve (``serves``) is refused by
        ``pipeline.upstream_only_error``, which knows whether an upstream of the route would take it."""
        return None

    def serves(self, req: GatewayRequest) -> bool:
        """Whether the engine can serve ``req``: not when it carries a field the engine does not serve
        (``GatewayRequest.local_unsupported``)."""
        return req.local_unsupported is None

    def stream_timeouts(self, deadline_s: float) -> tuple[float | None, float | None]:
        """(first token, between chunks) timeouts: the engine queues under load, so its first token is bounded
        by the request's deadline ``deadline_s`` only, and its chunks by nothing (it is in this process)."""
        return deadline_s, None

    async def probe(self) -> None:
        """The active health probe: the engine is loaded and running. A loaded engine found dead is restarted
        (in the background; the backend is unavailable until it is loaded again).

        Raises:
            RuntimeError: it is not, with the reason."""
        self._restart_if_dead()
        if not self.available:
            raise RuntimeError(self.unavailable_reason or "engine not ready")

    def _restart_if_dead(self) -> None:
        """A loaded engine whose core died (not one shutting down) is replaced: the probe's check, and each
        request's, so that a gateway probing nothing (``resilience.health.interval_s: 0``) restarts it too."""
        if self.available and self.engine is not None and not self.engine.is_alive and self.engine.accepting:
            self._restart_dead_engine()

    def _restart_dead_engine(self) -> None:
        """Mark the backend unavailable and load a new engine in place of the dead one."""
        dead = self.engine
        why = dead.dead_reason or "the engine core stopped"
        self.engine, self.serving, self.tokenizing = None, None, None
        self.available, self.unavailable_reason = False, f"engine core died ({why}); restarting"
        self.loading = True              # as at start: not ready, and requests only it serves get engine_loading
        self.restarts += 1
        log.error("local backend %s: %s (restart %d)", self.name, self.unavailable_reason, self.restarts)

        async def restart() -> None:
            try:
                await asyncio.wait_for(dead.shutdown(drain=False), 10.0)   # what is left of it
            except Exception as e:  # noqa: BLE001 -- dead already: nothing to drain
                log.info("dead engine shutdown: %s", e)
            await self.start()
            if self.available and self.on_restarted is not None:
                await self.on_restarted()

        self._restart = asyncio.get_running_loop().create_task(restart())

    async def open_chat_stream(self, req: GatewayRequest, request_id: str, body: dict) -> ChatStream:
        """A stream of ``body`` for ``req`` (a ``chat/completions`` request) under ``request_id``: a shadow's side,
        which the engine renders itself (``req``'s rendering is of the client's body)."""
        return await self.open_stream(replace(req, request_id=request_id, stream=True, rendered=None), body)

    def upstream_model(self, public_model: str, target_model: str) -> str:
        return target_model or self.served_model_name or public_model

    def stats(self) -> tuple[int, int, float]:
        """(waiting, running, KV-cache usage percent) of the engine; zeros before start."""
        if self.engine is None:
            return 0, 0, 0.0
        s = self.engine.get_stats()
        return int(s.num_waiting), int(s.num_running), float(s.kv_cache_usage) * 100.0

    def render(self, endpoint: str, body: dict, refuse: bool = False):
        """The engine's rendering of ``body`` (``engine.serving.serving.RenderedPrompt``: parsed, chat
        template applied, tokenized): its ``prompt_tokens`` is the prompt length routing reads, and ``send`` /
        ``open_stream`` hand it to the engine, which then does not tokenize again. None before the engine is
        loaded, or when the engine refuses the body (it refuses it again, with its error, if the request
        reaches it). The gateway-only fields and ``model`` (rewritten per target) are left out.

        Raises:
            ClientError: with ``refuse``, the engine's refusal (its 4xx, naming the field), the one a request
                of ``body`` would get from it (``/v1/messages/count_tokens``, which calls no model)."""
        if self.serving is None:
            return None
        try:
            return render_prompt(self.engine.tokenizer, endpoint, body)
        except self.serving_error as e:
            if refuse:
                raise self._refusal(e) from None
            return None
        except Exception:  # noqa: BLE001 -- odd content: the estimate decides, the engine answers
            return None

    @staticmethod
    def _refusal(e) -> ClientError:
        """The engine's ``ServingError`` ``e`` as the gateway's client error."""
        return ClientError(e.status_code, e.message, param=e.param, code=e.code)

    def tokenization(self, path: str, body: dict) -> dict:
        """vLLM's ``/tokenize`` or ``/detokenize`` (``path``) of ``body`` (no ``model``) by the engine's own handler:
        its tokenizer only, nothing queued.

        Raises:
            ClientError: 503 when the engine is not loaded; the handler's 4xx (naming the field)."""
        if self.tokenizing is None:
            raise ClientError(503, f"{self.name}: {self.unavailable_reason}", code="engine_not_ready")
        try:
            if path == "/tokenize":
                return self.tokenizing.create_tokenize(body)
            return self.tokenizing.create_detokenize(body)
        except self.serving_error as e:
            raise self._refusal(e) from None

    async def _call(self, req: GatewayRequest, body: dict):
        self._restart_if_dead()
        if self.serving is None:
            raise BackendError("unavailable", f"{self.name}: {self.unavailable_reason}", 503)
        if req.endpoint != "embeddings":   # the tenant's prefix cache (the client's salt only splits it further)
            body = {**body, "cache_salt": tenant_cache_salt(req)}
        rendered = _as_sent(req.rendered, body, req.body) if req.rendered is not None else None
        try:   # the engine labels the answer as the gateway reports it: no relabelling pass over its events
            return await self.serving[req.endpoint](body, answer_id(req.endpoint, req.request_id), req.priority,
                                                    rendered, response_model=req.public_model or None)
        except self.serving_error as e:
            raise BackendError("http", f"{self.name}: {e.message}", e.status_code, self._encode(e.to_dict())) from None

    def _checkpoint(self, req: GatewayRequest, handover: tuple[Handover, float] | None) -> Checkpoint | None:
        if handover is None or self.engine is None:
            return None
        return Checkpoint(self.engine, answer_id(req.endpoint, req.request_id), *handover)

    async def send(self, req: GatewayRequest, body: dict,
                   handover: tuple[Handover, float] | None = None) -> UpstreamResponse:
        """Run one non-streaming request: ``req`` (its endpoint, id, priority, public model and, when routing
        rendered it, its ``rendered`` prompt) with ``body`` (the client's, ``model`` set to the served name,
        gateway-only fields removed); the OpenAI JSON answer, ``id`` and ``model`` as the gateway reports them.
        ``handover``: (``policies.slo.Handover``, the request's admission in monotonic seconds): a checkpoint at
        which the engine may withdraw the request (``Checkpoint``).

        Raises:
            BackendError: "http" with the serving layer's status for bad input,
                "unavailable" before the engine is loaded.
            Withdrawn: the checkpoint withdrew it."""
        self.active += 1
        checkpoint = self._checkpoint(req, handover)
        try:
            result = await self._call(req, body)
            return UpstreamResponse(200, {"content-type": "application/json"}, body=self._encode(result))
        except BackendError:
            if checkpoint is not None and checkpoint.withdrawn:
                raise checkpoint.error() from None
            raise
        finally:
            self.active -= 1
            if checkpoint is not None:
                checkpoint.close()

    async def open_stream(self, req: GatewayRequest, body: dict,
                          handover: tuple[Handover, float] | None = None) -> ChatStream:
        """Start a streaming request (arguments as ``send``'s); its events, converted from the serving layer's
        typed chunks in process (no SSE bytes between). A request the checkpoint withdrew raises ``Withdrawn``
        from the iterator, before any content."""
        self.active += 1
        try:
            result = await self._call(req, body)
        except BaseException:
            self.active -= 1
            raise
        return self._events(result, self._checkpoint(req, handover))

    async def _events(self, batches: AsyncIterator[list], checkpoint: Checkpoint | None) -> ChatStream:
        """The engine's batches of ``engine.serving.chunks`` items (one per engine output) as the events of each,
        then ``[DONE]``. Closing it closes ``batches`` (which aborts the engine request)."""
        try:
            async for batch in batches:
                if checkpoint is not None and checkpoint.withdrawn:   # the batch is the engine's error event
                    raise checkpoint.error()
                yield [event_from_object(item) for item in batch]
            yield [DONE]
        finally:
            self.active -= 1
            if checkpoint is not None:
                checkpoint.close()
            await batches.aclose()

    async def aclose(self) -> None:
        if self._restart is not None and not self._restart.done():
            self._restart.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._restart
        if self.engine is not None:
            try:
                await asyncio.wait_for(self.engine.shutdown(drain=False), 10.0)
            except TimeoutError:
                log.warning("engine shutdown: not done within 10 s; its process is left to end on its own")
            except Exception as e:  # noqa: BLE001
                log.warning("engine shutdown: %s: %s", type(e).__name__, e)
