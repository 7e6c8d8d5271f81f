"""``openai`` backends: any OpenAI-compatible upstream.

Requests and streams go through the lean HTTP/1.1 client of ``gateway/backends/h1.py`` (one pool of kept-alive
connections per upstream, request heads built once per endpoint); the cold calls (the health probe, a replica's
``/v1/ttft``) through an ``httpx.AsyncClient`` on aiohttp's transport (``httpx_aiohttp.AiohttpTransport``), a pool
of its own. At 32 concurrent requests against a fast local server on the 2-core dev machine (``python -m
loadtests.bench.transport_bench``): httpx's default transport ~330 requests/s, httpx + AiohttpTransport ~1,200,
a prebuilt httpx request straight to that transport ~2,300, aiohttp alone ~3,000: httpx's request, response and
header objects were a fifth of the gateway's CPU per request, and aiohttp's afterwards still as much (issue 48's
profiles). Retries are off (one retry layer only: ``gateway/backends/dispatch.py``).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Mapping
from urllib.parse import urlsplit

import httpx
import msgspec
from httpx_aiohttp import AiohttpTransport

from gateway.backends.h1 import Pool, Response
from gateway.config.backend_schema import OpenAIBackendConfig
from gateway.errors import BackendError, transport_error_kind
from gateway.observability.tracing import current_traceparent
from gateway.resilience.outcomes import UpstreamResponse, parse_retry_after
from gateway.translate.chat_events import decode_stream
from gateway.values import ChatStream

log = logging.getLogger("tandem.gateway.upstream")
logging.getLogger("httpx").setLevel(logging.WARNING)   # one INFO line per request is hot-path cost

# Never forwarded from the client (ours replace them) -- hop-by-hop or secret.
_SSE_HEADERS = {"accept": "text/event-stream"}


def make_client(base_url: str, max_connections: int, connect_s: float, read_s: float,
                headers: dict[str, str] | None = None) -> httpx.AsyncClient:
    """A pooled, kept-alive httpx client on the aiohttp transport.

    Timeouts in seconds; ``max_connections`` pooled connections."""
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections,
                          keepalive_expiry=60.0)
    transport = AiohttpTransport(limits=limits, retries=0)
    timeout = httpx.Timeout(connect=connect_s, read=read_s, write=read_s, pool=connect_s)
    return httpx.AsyncClient(base_url=base_url, transport=transport, timeout=timeout, headers=headers or {},
                             follow_redirects=False)


_PER_REQUEST = ("x-request-id", "traceparent")     # set per request (``_traced``), never in a request head


def _traced(headers: Mapping[str, str], request_id: str) -> dict[str, str]:
    """The per-request headers: the gateway's ``x-request-id`` and the W3C ``traceparent`` of the current
    request/attempt (gateway/observability/telemetry.py; else one configured in ``headers``)."""
    out = {"x-request-id": request_id}
    tp = current_traceparent() or headers.get("traceparent")
    if tp is not None:
        out["traceparent"] = tp
    return out


# What the client raises for a failed connect, send or read (``TimeoutError`` for its timeouts is an OSError).
_TRANSPORT_ERRORS = (asyncio.TimeoutError, OSError)


class UpstreamBackend:
    """An OpenAI-compatible upstream.

    ``available`` is False (with ``unavailable_reason``) when its API key
    variable is unset; it is then never called.
    """

    kind = "openai"
    endpoints = ("chat/completions", "completions", "embeddings")   # the paths under base_url it is sent requests on
    client_headers: tuple[str, ...] = ()   # the client's request headers it is sent along (lower-case names)
    continuous_usage = False   # vLLM's stream_options.continuous_usage_stats: OpenAI's API refuses it, not asked

    def __init__(self, name: str, cfg: OpenAIBackendConfig, environ: dict[str, str] | None = None):
        env = os.environ if environ is None else environ
        self.name, self.cfg = name, cfg
        self.max_model_len = cfg.max_model_len
        self.available, self.unavailable_reason = True, ""
        self.key_missing = False         # its API key variable is unset: never callable in this config generation
        headers = {"content-type": "application/json", **self.api_headers(), **cfg.headers}
        if cfg.api_key_env:
            key = env.get(cfg.api_key_env)
            if not key:
                self.available, self.key_missing = False, True
                self.unavailable_reason = f"environment variable {cfg.api_key_env} is unset"
            else:
                headers.update(self.auth_headers(key))
        self.client = make_client(cfg.base_url, cfg.max_connections, cfg.timeouts.connect_s,
                                  cfg.timeouts.read_s, headers)
        # Hot path: each endpoint's request head (request line and fixed headers) built once
        t = cfg.timeouts
        self._h1 = Pool(cfg.base_url, cfg.max_connections, t.connect_s, t.read_s,
                        ssl_context=httpx.create_ssl_context() if cfg.base_url.startswith("https") else None)
        self._headers = headers
        self._sse_headers = {**headers, **_SSE_HEADERS}
        paths = (*self.endpoints, *getattr(cfg, "apis", ()))
        self._heads = {(ep, sse): self._head(ep, self._sse_headers if sse else headers)
                       for ep in paths for sse in (False, True)}
        self.active = 0  # requests in flight (to close a retired client safely)

    def api_headers(self) -> dict[str, str]:
        """Headers the upstream's API requires on every request (none for OpenAI's)."""
        return {}

    def auth_headers(self, key: str) -> dict[str, str]:
        """The headers that carry the API key (OpenAI's bearer token)."""
        return {"authorization": f"Bearer {key}"}

    def endpoint(self) -> tuple[str, int] | None:
        """Where an endpoint picker sends this backend's requests for the data plane (``gateway/picker/``): the
        host and port of ``base_url`` (the scheme's default port when none is written), which must speak the
        client's OpenAI API as it is (a subclass translating another API returns None)."""
        u = urlsplit(self.cfg.base_url)
        return (u.hostname, u.port or (443 if u.scheme == "https" else 80)) if u.hostname else None

    def request_headers(self) -> dict[str, str]:
        """The headers every call to this backend carries (content type, API headers, its key, ``headers``)."""
        return dict(self._headers)

    def upstream_model(self, public_model: str, target_model: str) -> str:
        """The model name to send: the target's, else the mapping's, else the public one."""
        return target_model or self.cfg.models.get(public_model, public_model)

    async def send(self, endpoint: str, payload: bytes, request_id: str,
                   extra_headers: Mapping[str, str] | None = None) -> UpstreamResponse:
        """POST ``payload`` (JSON bytes) to ``base_url/endpoint`` with ``x-request-id: request_id`` (and
        ``extra_headers``: the client's ``client_headers``); the whole answer.

        Raises:
            BackendError: connection failure, timeout, or an error status."""
        self.active += 1
        try:
            r = await self._post(endpoint, False, extra_headers, payload, request_id)
            try:
                body = await r.read()
            except _TRANSPORT_ERRORS as e:
                raise self._transport_error(e) from None
            finally:
                r.release()
            if not 200 <= r.status < 300:
                raise self._http_error(r, body)
            return UpstreamResponse(r.status, {"content-type": r.headers.get("content-type", "application/json")},
                                    body=body)
        finally:
            self.active -= 1

    async def open_stream(self, endpoint: str, payload: bytes, request_id: str,
                          extra_headers: Mapping[str, str] | None = None) -> ChatStream:
        """Start a streaming POST (``extra_headers`` as ``send``'s); the answer's events as they arrive, each SSE
        event decoded once (``gateway.translate.chat_events.decode_stream``).

        Raises:
            BackendError: before any byte of the body (connect, timeout, error status); the iterator raises it
                for a stream that breaks or stalls."""
        return decode_stream(await self.open_sse(endpoint, payload, request_id, extra_headers))

    async def open_sse(self, endpoint: str, payload: bytes, request_id: str,
                       extra_headers: Mapping[str, str] | None = None) -> AsyncIterator[bytes]:
        """Start a streaming POST; the raw SSE byte chunks as they arrive (closes the upstream response when
        exhausted or closed).

        Raises:
            BackendError: before any byte of the body (connect, timeout,
                error status)."""
        self.active += 1
        try:
            r = await self._post(endpoint, True, extra_headers, payload, request_id)
            if not 200 <= r.status < 300:
                try:
                    body = await r.read()
                except _TRANSPORT_ERRORS:
                    body = b""
                r.release()
                raise self._http_error(r, body)
        except BaseException:
            self.active -= 1
            raise
        return self._relay(r)

    def _head(self, endpoint: str, headers: Mapping[str, str]) -> bytes:
        return self._h1.head(endpoint, {k: v for k, v in headers.items() if k not in _PER_REQUEST})

    async def _post(self, endpoint: str, sse: bool, extra_headers: Mapping[str, str] | None, payload: bytes,
                    request_id: str) -> Response:
        """Send the POST (``sse``: asking for an event stream; ``extra_headers`` over the backend's own); the
        response once its head arrived (the caller reads and releases it).

        Raises:
            BackendError: connection failure or timeout."""
        base = self._sse_headers if sse else self._headers
        if extra_headers:
            head = self._head(endpoint, {**base, **extra_headers})
            base = {**base, **extra_headers}
        else:
            head = self._heads[endpoint, sse]
        try:
            return await self._h1.post(head, _traced(base, request_id), payload)
        except _TRANSPORT_ERRORS as e:
            raise self._transport_error(e) from None

    def _transport_error(self, e: BaseException) -> BackendError:
        """A failed connect/send as ``timeout`` or ``connect`` (for the probe's httpx errors, whose aiohttp cause
        httpx_aiohttp maps to ``httpx.ConnectTimeout``, refused connections included, the cause decides)."""
        cause = e.__cause__ or e
        kind = transport_error_kind(cause)
        if kind == "timeout":
            return BackendError("timeout", f"{self.name}: timed out ({type(cause).__name__})", 504)
        if kind == "connect_error":
            return BackendError("connect", f"{self.name}: cannot connect ({type(cause).__name__}: {cause})", 502)
        return BackendError("stream", f"{self.name}: connection failed ({type(cause).__name__})", 502)

    # What the layers above ask of a backend, answered by the backend (no layer branches on ``kind``).
    loading = False    # an upstream has nothing to load (the local engine: until its model is loaded)

    def provider(self) -> str:
        """The provider label of records and metrics: the backend's name."""
        return self.name

    def serves(self, req) -> bool:
        """Whether this backend can serve ``req`` (a ``GatewayRequest``): it has no ``refusal`` of it."""
        return self.refusal(req) is None

    def refusal(self, req) -> tuple[str, str] | None:
        """Why this backend cannot take ``req`` at all, as ``(param, reason)`` (None: it can; an OpenAI-compatible
        upstream takes every endpoint and field)."""
        return None

    def stream_timeouts(self, deadline_s: float) -> tuple[float | None, float | None]:
        """(first token, between chunks) timeouts in seconds: the configured ones (``deadline_s`` unused)."""
        t = self.cfg.timeouts
        return t.first_token_s, t.inter_chunk_s or t.read_s

    async def open_chat_stream(self, req, request_id: str, body: dict) -> ChatStream:
        """A ``chat/completions`` stream of ``body`` under ``request_id`` (a shadow's side; ``req`` unused)."""
        return await self.open_stream("chat/completions", msgspec.json.encode(body), request_id)

    async def probe(self) -> None:
        """The active health probe: ``GET base_url/models``.

        Raises:
            BackendError: ``connect`` / ``timeout`` (named as such), or ``http`` for a 5xx answer."""
        if not self.available:
            raise BackendError("connect", self.unavailable_reason, 502)
        try:
            r = await self.client.get("models")
        except (httpx.HTTPError, OSError) as e:
            raise self._transport_error(e) from None
        if r.status_code >= 500:
            raise BackendError("http", f"{self.name}: GET /models: HTTP {r.status_code}", r.status_code)

    def _http_error(self, r: Response, body: bytes) -> BackendError:
        """An error status's BackendError; a redirect (3xx, never followed: the client's body and the key would
        go where the upstream says) is the backend's failure, a 502, as any answer that is not the API's (a
        security trial's 307 reached the client as an empty success, billed)."""
        if r.status < 400:
            said = (f"HTTP {r.status} redirect, not followed: set the backend's base_url to the address it "
                    "redirects to")
            return BackendError("http", f"{self.name}: {said} ({r.headers.get('location')!r})", 502,
                                msgspec.json.encode({"error": {"message": said, "type": "upstream_error"}}))
        return BackendError("http", f"{self.name}: HTTP {r.status}", r.status, body,
                            parse_retry_after(r.headers),
                            r.headers.get("content-type", "application/json"))

    async def _relay(self, r: Response) -> AsyncIterator[bytes]:
        # whatever has arrived, straight from the connection's buffer
        try:
            while chunk := await r.readany():
                yield chunk
        except asyncio.TimeoutError:
            raise BackendError("timeout", f"{self.name}: stream stalled", 504) from None
        except _TRANSPORT_ERRORS as e:
            raise BackendError("stream", f"{self.name}: stream broken ({type(e).__name__})", 502) from None
        finally:
            self.active -= 1
            r.release()   # a response not read to its end closes its connection instead of pooling it

    async def aclose(self) -> None:
        await self._h1.aclose()
        await self.client.aclose()
