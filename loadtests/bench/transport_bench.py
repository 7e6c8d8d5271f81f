"""Measure upstream-client throughput: httpx's default transport vs the
aiohttp transport (``httpx_aiohttp.AiohttpTransport``), at C concurrent
requests against a fast local aiohttp server in another process.

    python -m loadtests.bench.transport_bench --requests 4000 --concurrency 32

Prints requests/s for each; the gateway uses the aiohttp transport.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import socket
import time

import aiohttp
import httpx
from aiohttp import web

from gateway.backends.upstream import UpstreamBackend, make_client
from gateway.config.backend_schema import OpenAIBackendConfig

_BODY = b'{"id":"x","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"ok"}}]}'


def _server(port: int) -> None:
    async def handle(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=_BODY, content_type="application/json")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handle)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


async def _run(client: httpx.AsyncClient, n: int, concurrency: int) -> float:
    payload = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'
    left = n

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            r = await client.post("/v1/chat/completions", content=payload)
            r.raise_for_status()

    for _ in range(concurrency):   # warm-up: open the pool
        await client.post("/v1/chat/completions", content=payload)
    t = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return n / (time.perf_counter() - t)


async def bench(port: int, n: int, concurrency: int) -> dict[str, float]:
    """requests/s per transport."""

    out = {}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", limits=limits) as c:
        out["httpx default transport"] = await _run(c, n, concurrency)
    c = make_client(f"http://127.0.0.1:{port}", concurrency, 5.0, 30.0)
    async with c:
        out["httpx + AiohttpTransport"] = await _run(c, n, concurrency)
    # The gateway's hot path: UpstreamBackend.send (prebuilt URL/headers straight to the pooled transport).

    b = UpstreamBackend("bench", OpenAIBackendConfig(type="openai", base_url=f"http://127.0.0.1:{port}/v1",
                                               max_connections=concurrency))

    class _Adapter:   # _run's client.post(...) -> UpstreamBackend.send(...)
        async def post(self, path: str, content: bytes):
            return _Reply(await b.send("chat/completions", content, "bench"))

    class _Reply:
        def __init__(self, r):
            self.r = r

        def raise_for_status(self) -> None:
            assert self.r.status == 200

    out["gateway UpstreamBackend.send"] = await _run(_Adapter(), n, concurrency)
    await b.aclose()

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency),
                                     base_url=f"http://127.0.0.1:{port}") as s:
        class _Raw:   # the ceiling: aiohttp alone
            async def post(self, path: str, content: bytes):
                async with s.post(path, data=content) as r:
                    await r.read()
                    return _Status(r.status)

        class _Status:
            def __init__(self, status: int):
                self.status = status

            def raise_for_status(self) -> None:
                assert self.status == 200

        out["aiohttp alone (ceiling)"] = await _run(_Raw(), n, concurrency)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--concurrency", type=int, default=32)
    a = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = multiprocessing.Process(target=_server, args=(port,), daemon=True)
    proc.start()
    try:
        for _ in range(100):
            try:
                httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", content=b"{}")
                break
            except httpx.HTTPError:
                time.sleep(0.05)
        try:
            import uvloop
            uvloop.install()
        except ImportError:
            pass
        for name, rps in asyncio.run(bench(port, a.requests, a.concurrency)).items():
            print(f"{name:28s} {rps:8.0f} requests/s  ({a.concurrency} concurrent, {a.requests} requests)")
    finally:
        proc.terminate()


if __name__ == "__main__":
    main()
