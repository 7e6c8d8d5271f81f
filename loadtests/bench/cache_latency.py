"""The response cache's latency (docs/operators/response-cache.md): MT-Bench first-turn questions, greedy, streamed, through
a gateway whose local engine (SmolLM2 by default) sits behind a ``cache: {mode: exact}`` route. Each question is
asked once (a miss: the engine computes it) and again (a hit); TTFT and the full answer's time, p50 of each.

    python -m loadtests.bench.cache_latency [--questions 16] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import httpx

from loadtests.workloads import load_mt_bench


def _config(model: str | None) -> str:
    engine = f"model: '{model}', " if model else ""
    return ("reload: {watch: false}\nresilience:\n  health: {interval_s: 0}\n"
            "observability:\n  logs: {requests: false}\n"
            "models:\n  - name: m\nbackends:\n  local:\n    type: local\n"
            f"    engine: {{{engine}served_model_name: m, max_model_len: 2048, kv_cache_memory: 256MiB}}\n"
            "routes:\n  main:\n    targets: [{backend: local}]\n    cache: {mode: exact}\n"
            "policy:\n  default_route: main\n")


async def _timed(client: httpx.AsyncClient, body: dict) -> tuple[float, float, str]:
    """(TTFT, full answer, x-tandem-cache) of one streamed request, seconds."""
    t0 = time.perf_counter()
    ttft = None
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        async for line in r.aiter_lines():
            if ttft is None and '"content":"' in line and '"content":""' not in line:
                ttft = time.perf_counter() - t0
        return ttft or 0.0, time.perf_counter() - t0, r.headers.get("x-tandem-cache", "")


async def main(args: argparse.Namespace) -> None:
    from gateway.config.compile import load_config_text
    from gateway.http.app import create_app
    from gateway.runtime import Gateway
    import uvicorn

    from loadtests.procs import free_port

    gw = Gateway(None, load_config_text(_config(args.model)), start_engine=True)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(gw), host="127.0.0.1", port=port, log_level="warning"))
    task = asyncio.create_task(server.serve())
    figures: dict[str, list[tuple[float, float]]] = {"miss": [], "hit": []}
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600) as c:
            while not server.started:
                await asyncio.sleep(0.05)
            while (await c.get("/health/ready")).status_code != 200:
                await asyncio.sleep(0.2)
            for q in load_mt_bench()[:args.questions]:
                body = {"model": "m", "messages": [{"role": "user", "content": q["turns"][0]}], "stream": True,
                        "max_tokens": args.max_tokens, "temperature": 0}
                for expected in ("miss", "hit"):
                    ttft, full, outcome = await _timed(c, body)
                    await gw.cache.drain()
                    assert outcome == expected, (outcome, expected)
                    figures[expected].append((ttft, full))
    finally:
        server.should_exit = True
        await task
    for k, rows in figures.items():
        print(f"{k}: TTFT p50 {statistics.median(r[0] for r in rows) * 1e3:.1f} ms, full answer p50 "
              f"{statistics.median(r[1] for r in rows) * 1e3:.1f} ms over {len(rows)} requests")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="engine model (default: the embedded SmolLM2)")
    p.add_argument("--questions", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    asyncio.run(main(p.parse_args()))
