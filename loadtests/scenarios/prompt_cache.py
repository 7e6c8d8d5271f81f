"""Prompt-cache affinity on aggregators: the share of input tokens a provider's prompt cache serves, with and
without ``sticky: prefix``.

``--targets`` fake aggregators (one per provider deployment or API key) behind ``tandem serve``, one weighted
route over all of them. Each fake keeps its own prompt cache: it reports ``prompt_tokens_details.cached_tokens``
= the longest earlier message-list prefix it has itself seen (tokens are words), so a conversation's turn is
cached only when it comes back to the same target. ``--conversations`` multi-turn conversations (a system prompt,
then ``--turns`` turns, each repeating the conversation so far) are sent turn by turn, ``--concurrency`` at once;
the client sends no ``user``, so without affinity the canary hash of each request id spreads the turns. Reported
per run: cached share of input tokens and cost per 1,000 requests at ``cached_input`` prices.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import random
from pathlib import Path

import aiohttp
import msgspec
from aiohttp import web

from loadtests.report import write_report
from loadtests.scenarios.common import fmt, gateway_config, logs_dir, md_table, start_gateway
from loadtests.scenarios.spill import WORDS

MODEL = "bench"
PRICES = {"input": 0.30, "output": 1.20, "cached_input": 0.03}


def register(sub) -> None:
    p = sub.add_parser("prompt-cache", help="cached share of input tokens on aggregators, with vs without affinity",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--targets", type=int, default=4, help="fake aggregators (deployments or keys)")
    p.add_argument("--conversations", type=int, default=40, help="multi-turn conversations")
    p.add_argument("--turns", type=int, default=6, help="turns per conversation")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    p.add_argument("--seed", type=int, default=0, help="seeds the prompts")
    p.add_argument("--out", default="loadtest-results/prompt-cache", help="output directory")
    p.set_defaults(func=run)


def _words(messages: list) -> int:
    return sum(len(str(m.get("content", "")).split()) for m in messages)


def _key(messages: list) -> bytes:
    return hashlib.sha256(msgspec.json.encode(messages)).digest()


class CachingAggregator:
    """A fake aggregator with its own prompt cache (message-list prefixes it has seen)."""

    def __init__(self) -> None:
        self.seen: set[bytes] = set()

    async def handle(self, request: web.Request) -> web.Response:
        body = msgspec.json.decode(await request.read())
        msgs = body.get("messages") or []
        cached = max((_words(msgs[:k]) for k in range(1, len(msgs)) if _key(msgs[:k]) in self.seen), default=0)
        self.seen.update(_key(msgs[:k]) for k in range(1, len(msgs) + 1))
        n = body.get("max_tokens") or 8
        prompt = _words(msgs)
        return web.json_response({
            "id": "x", "object": "chat.completion", "created": 0, "model": body.get("model"),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": " ok" * n},
                         "finish_reason": "length"}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n,
                      "prompt_tokens_details": {"cached_tokens": cached}}})


async def _serve(n: int) -> tuple[list[web.AppRunner], list[int]]:
    runners, ports = [], []
    for _ in range(n):
        app = web.Application()
        app.router.add_post("/v1/chat/completions", CachingAggregator().handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        ports.append(site._server.sockets[0].getsockname()[1])
    return runners, ports


def _conversations(n: int, seed: int) -> list[list[dict]]:
    rng = random.Random(seed)
    return [[{"role": "system", "content": " ".join(rng.choice(WORDS) for _ in range(rng.choice([200, 400, 800])))}]
            for _ in range(n)]


async def _drive(url: str, n: int, turns: int, concurrency: int, seed: int) -> dict:
    rng = random.Random(seed + 1)
    convs = _conversations(n, seed)
    totals = {"requests": 0, "failed": 0, "prompt": 0, "cached": 0, "completion": 0}
    sem = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession() as session:
        async def turn(conv: list[dict]) -> None:
            conv.append({"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(20))})
            async with sem, session.post(url + "/v1/chat/completions", json={
                    "model": MODEL, "messages": conv, "max_tokens": 8}) as r:
                totals["requests"] += 1
                if r.status != 200:
                    totals["failed"] += 1
                    return
                body = await r.json()
            u = body["usage"]
            totals["prompt"] += u["prompt_tokens"]
            totals["completion"] += u["completion_tokens"]
            totals["cached"] += (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            conv.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})

        for _ in range(turns):
            await asyncio.gather(*(turn(c) for c in convs))
    return totals


def figures(t: dict) -> dict:
    """Cached share (% of input tokens) and USD per 1,000 requests of a run's totals."""
    usd = ((t["prompt"] - t["cached"]) * PRICES["input"] + t["cached"] * PRICES["cached_input"]
           + t["completion"] * PRICES["output"]) / 1e6
    return {**t, "cached_share_pct": 100.0 * t["cached"] / t["prompt"] if t["prompt"] else None,
            "usd_per_1000": 1000.0 * usd / t["requests"] if t["requests"] else None}


def run(args: argparse.Namespace) -> int:
    logs = logs_dir(args.out)
    results = {}
    for sticky in ("", "prefix"):
        async def one() -> dict:
            runners, ports = await _serve(args.targets)
            backends = {}
            for i, port in enumerate(ports):
                backends[f"agg{i}"] = {"type": "openai", "base_url": f"http://127.0.0.1:{port}/v1",
                                       "models": {MODEL: MODEL}, "prices": dict(PRICES)}
            route = {"targets": [{"backend": b} for b in backends]}
            if sticky:
                route["sticky"] = sticky
            cfg = gateway_config(logs / f"gw-{sticky or 'none'}.yaml", backends, {"main": route}, "main", MODEL)
            gw, _ = await asyncio.to_thread(start_gateway, cfg, logs)
            try:
                return await _drive(gw.base_url, args.conversations, args.turns, args.concurrency, args.seed)
            finally:
                await asyncio.to_thread(gw.stop)
                for r in runners:
                    await r.cleanup()
        results[sticky or "none"] = figures(asyncio.run(one()))
    none, sticky = results["none"], results["prefix"]
    gain = (sticky["cached_share_pct"] / none["cached_share_pct"]) if none["cached_share_pct"] else None
    table = md_table(["affinity", "requests", "failed", "cached share of input %", "USD / 1,000"],
                     [[k, f["requests"], f["failed"], fmt(f["cached_share_pct"], ".1f"), fmt(f["usd_per_1000"], ".4f")]
                      for k, f in results.items()])
    note = (f"{args.targets} fake aggregators, {args.conversations} conversations x {args.turns} turns; "
            f"cached share with / without: {fmt(gain, '.1f', 'x')}")
    write_report(Path(args.out), "Prompt-cache affinity on aggregators", [], {"figures": results, "gain": gain},
                 table + "\n\n" + note)
    print(table + "\n\n" + note)
    return 0
