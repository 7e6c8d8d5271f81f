"""One OpenAI request over aiohttp, timed: TTFT, inter-token latencies, end-to-end.

aiohttp with one shared session (connection pool sized to the concurrency)
keeps the client off the critical path: measured on a 2-core machine,
httpx 0.28's default transport tops out near 300 requests/s at 32 concurrent
requests, aiohttp near 5-8k (see ``loadtests/README.md`` for this tool's
figure against ``loadtests.upstream``).
"""

from __future__ import annotations

import asyncio
import ipaddress
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import aiohttp
import msgspec

_decode = msgspec.json.decode
_encode = msgspec.json.encode


@dataclass
class RequestResult:
    """What one request did. Times are ``time.perf_counter()`` seconds.

    Attributes:
        ok: a complete 2xx response (and, streamed, a ``[DONE]``).
        start: when it was sent (perf_counter, seconds).
        e2e: end-to-end latency, seconds.
        ttft: time to the first content token, seconds (streaming only).
        itls: inter-token latencies, seconds: gaps between content chunks.
        output_tokens: ``usage.completion_tokens`` if present, else the number
            of content chunks (one token each, as vLLM's benchmark counts).
        prompt_tokens: ``usage.prompt_tokens`` (0 when absent).
        error: error kind (``http_503``, ``timeout``, ``connect``,
            ``disconnected``, ``incomplete_stream``, ``stream_error``,
            ``bad_response``) or None.
        status: HTTP status (0 when none came back).
        backend: the ``x-tandem-backend`` response header, if any.
        text: the generated text (only when asked to keep it).
        index: the request's index in the run.
    """

    ok: bool
    start: float
    e2e: float = 0.0
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str | None = None
    status: int = 0
    backend: str | None = None
    text: str | None = None
    index: int = -1

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first, seconds (streaming, >= 2 tokens)."""
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def check_loopback(url: str, allow_remote: bool = False) -> None:
    """Refuse a non-loopback target unless ``allow_remote``.

    Loopback: ``localhost``, 127.0.0.0/8, ``::1``.

    Raises:
        ValueError: the URL is not http(s) or its host is not loopback.
    """
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"target must be an http(s) URL, got {url!r}")
    if allow_remote:
        return
    host = parts.hostname
    if host == "localhost":
        return
    try:
        if ipaddress.ip_address(host).is_loopback:
            return
    except ValueError:
        pass
    raise ValueError(f"refusing non-loopback target {host!r}: load tests only hit 127.0.0.1/localhost/::1 "
                     "unless --allow-remote is given")


def make_session(concurrency: int, timeout_s: float = 600.0, headers: dict | None = None) -> aiohttp.ClientSession:
    """One pooled session: up to ``concurrency`` keep-alive connections."""
    connector = aiohttp.TCPConnector(limit=max(1, concurrency), limit_per_host=0, ttl_dns_cache=300)
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout_s),
                                 headers=headers or {}, auto_decompress=False)


def endpoint_url(base_url: str, endpoint: str) -> str:
    """``http://h:p/v1`` + "chat" -> ``.../v1/chat/completions`` (or ``/completions``)."""
    base = base_url.rstrip("/")
    if not base.endswith("/v1"):
        base += "/v1"
    return base + ("/chat/completions" if endpoint == "chat" else "/completions")


def _chunk_text(chunk: dict) -> str:
    choices = chunk.get("choices") or ()
    out = []
    for c in choices:
        delta = c.get("delta")
        if delta is not None:
            out.append(delta.get("content") or "")
        else:
            out.append(c.get("text") or "")
    return "".join(out)


async def send(session: aiohttp.ClientSession, url: str, body: dict, *, keep_text: bool = False,
               headers: dict | None = None, index: int = -1) -> RequestResult:
    """POST ``body`` to ``url`` and time it; never raises for request failures
    (they come back as ``ok=False`` with an ``error`` kind)."""
    stream = bool(body.get("stream"))
    payload = _encode(body)
    hdrs = {"content-type": "application/json"}
    if headers:
        hdrs.update(headers)
    start = time.perf_counter()
    res = RequestResult(ok=False, start=start, index=index)
    try:
        async with session.post(url, data=payload, headers=hdrs) as resp:
            res.status = resp.status
            res.backend = resp.headers.get("x-tandem-backend")
            if resp.status >= 400:
                await resp.read()
                res.error = f"http_{resp.status}"
            elif not stream:
                data = _decode(await resp.read())
                usage = data.get("usage") or {}
                res.output_tokens = int(usage.get("completion_tokens") or 0)
                res.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                if keep_text:
                    res.text = _chunk_text_full(data)
                res.ok = "choices" in data
                if not res.ok:
                    res.error = "bad_response"
            else:
                await _read_stream(resp, res, start, keep_text)
    except asyncio.TimeoutError:
        res.error = "timeout"
    except aiohttp.ClientConnectorError:
        res.error = "connect"
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError, aiohttp.ClientOSError):
        res.error = "disconnected"
    except (msgspec.DecodeError, ValueError, TypeError, AttributeError):
        res.error = "bad_response"
    except aiohttp.ClientError:
        res.error = "client_error"
    res.e2e = time.perf_counter() - start
    if res.error is not None:
        res.ok = False
    return res


def _chunk_text_full(data: dict) -> str:
    choices = data.get("choices") or ()
    if not choices:
        return ""
    c = choices[0]
    if "message" in c:
        return (c["message"] or {}).get("content") or ""
    return c.get("text") or ""


async def _read_stream(resp: aiohttp.ClientResponse, res: RequestResult, start: float, keep_text: bool) -> None:
    last = None
    chunks = 0
    done = False
    texts: list[str] = []
    async for line in resp.content:
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            done = True
            await resp.read()    # the rest (the chunked body's end), as the openai SDK reads it: the connection is reused
            break
        chunk = _decode(data)
        if "error" in chunk:
            res.error = "stream_error"
            return
        usage = chunk.get("usage")
        if usage:
            res.output_tokens = int(usage.get("completion_tokens") or 0)
            res.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        text = _chunk_text(chunk)
        if text:
            now = time.perf_counter()
            if last is None:
                res.ttft = now - start
            else:
                res.itls.append(now - last)
            last = now
            chunks += 1
            if keep_text:
                texts.append(text)
    if not done:
        res.error = "incomplete_stream"
        return
    if res.output_tokens == 0:
        res.output_tokens = chunks
    if keep_text:
        res.text = "".join(texts)
    res.ok = True
