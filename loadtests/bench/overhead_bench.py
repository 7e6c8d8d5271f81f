"""Measure what the gateway adds: latency p50 at 1 request in flight and
requests/s at C in flight, direct to a fast upstream vs through
``tandem serve`` (one worker) to the same upstream.

    python -m loadtests.bench.overhead_bench --requests 3000 --concurrency 32

The upstream is a minimal aiohttp server in another process that answers a
fixed chat completion; the gateway runs as a subprocess on a free port.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import aiohttp

from loadtests.bench.transport_bench import _server

_PAYLOAD = b'{"model":"m","messages":[{"role":"user","content":"hello"}],"max_tokens":8}'


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _latencies(url: str, n: int) -> list[float]:
    out = []
    async with aiohttp.ClientSession() as s:
        for i in range(n + 50):
            t = time.perf_counter()
            async with s.post(url, data=_PAYLOAD, headers={"content-type": "application/json"}) as r:
                await r.read()
                assert r.status == 200, r.status
            if i >= 50:
                out.append(time.perf_counter() - t)
    return out


async def _throughput(url: str, n: int, concurrency: int) -> float:
    left = n
    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=conn) as s:
        async def worker() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                async with s.post(url, data=_PAYLOAD, headers={"content-type": "application/json"}) as r:
                    await r.read()
                    assert r.status == 200, r.status
        await asyncio.gather(*(worker() for _ in range(concurrency)))    # warm-up
        left = n
        t = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return n / (time.perf_counter() - t)


def _cpu_seconds(pid: int) -> float:
    """user + system CPU seconds of process ``pid`` (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _wait(url: str) -> None:
    import httpx

    for _ in range(300):
        try:
            if httpx.get(url, timeout=1).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} not up")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--latency-requests", type=int, default=500)
    ap.add_argument("--concurrency", type=int, default=32)
    a = ap.parse_args()
    up_port, gw_port = _port(), _port()
    up = multiprocessing.Process(target=_server, args=(up_port,), daemon=True)
    up.start()
    cfg = tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False)
    cfg.write(f"""models: [{{name: m}}]
backends:
  fast: {{type: openai, base_url: "http://127.0.0.1:{up_port}/v1"}}
routes:
  main: {{targets: [{{backend: fast}}]}}
policy: {{default_route: main}}
reload: {{watch: false}}
server: {{log_level: warning}}
""")
    cfg.close()
    gw = subprocess.Popen([sys.executable, "-m", "gateway.commands", "serve", "--config", cfg.name, "--port",
                           str(gw_port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        direct = f"http://127.0.0.1:{up_port}/v1/chat/completions"
        via = f"http://127.0.0.1:{gw_port}/v1/chat/completions"
        _wait(f"http://127.0.0.1:{gw_port}/health/ready")
        try:
            import uvloop
            uvloop.install()
        except ImportError:
            pass
        d = asyncio.run(_latencies(direct, a.latency_requests))
        g = asyncio.run(_latencies(via, a.latency_requests))
        p50d, p50g = statistics.median(d) * 1e3, statistics.median(g) * 1e3
        print(f"latency p50 at 1 in flight: direct {p50d:.3f} ms, via gateway {p50g:.3f} ms, "
              f"gateway adds {p50g - p50d:.3f} ms")
        rd = asyncio.run(_throughput(direct, a.requests, a.concurrency))
        cpu0 = _cpu_seconds(gw.pid)
        rg = asyncio.run(_throughput(via, a.requests, a.concurrency))
        cpu = (_cpu_seconds(gw.pid) - cpu0) / (2 * a.requests)      # warm-up pass + measured pass
        print(f"throughput at {a.concurrency} in flight: direct {rd:.0f} req/s, via gateway {rg:.0f} req/s "
              "(one gateway worker; client, upstream and gateway share the machine's cores)")
        print(f"gateway CPU per request: {cpu * 1e3:.3f} ms -> at most {1 / cpu:.0f} req/s per worker on one "
              "free core")
    finally:
        gw.terminate()
        gw.wait(20)
        up.terminate()
        os.unlink(cfg.name)


if __name__ == "__main__":
    main()
