"""Tandem's engines behind the routers people already run: ``tandem loadtest routers``.

Two ``tandem engine serve`` replicas (the embedded SmolLM2, KV events on: ``--kv-events-config``, vLLM's format)
behind each router from PyPI in turn, in a virtual environment of their own (``--routers-python``; once:
``python3 -m venv .venv-routers && .venv-routers/bin/pip install smg vllm-router``):

* SGLang's model gateway ``smg launch`` with ``--policy round_robin`` and ``--policy cache_aware`` (its radix
  tree of the request text, kept in the router);
* vLLM's production-stack router ``vllm-router`` with ``--policy round_robin``, ``cache_aware`` and
  ``kv_aware`` (its index fed by each engine's KV events over ZMQ: ``--kv-event-source``, replay sources too).

Each policy serves its own multi-turn conversations (MT-Bench questions, ``--turns`` turns, each turn carrying
the conversation so far: the prefix a cache-aware router should keep on one engine), ``--concurrency`` at a
time, greedy. Reported per policy: requests, failed requests (anything but a 2xx answer) and the prefix-cache
hit rate the engines saw (``vllm:prefix_cache_hits / queries`` from both engines' ``/metrics``, the policy's
own requests only). Loopback only; bounded by ``--conversations``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path

from loadtests.client import endpoint_url, make_session, send
from loadtests.procs import Server, free_port
from loadtests.report import write_report
from loadtests.runner import LoadConfig, RunResult
from loadtests.scenarios.common import fmt, logs_dir, md_table, spawn_engine_server
from loadtests.scenarios.prefix import scrape_prefix_cache
from loadtests.workloads import load_mt_bench

MODEL = "SmolLM2-135M-Instruct"
POLICIES = [("smg", "round_robin"), ("smg", "cache_aware"), ("vllm-router", "round_robin"),
            ("vllm-router", "cache_aware"), ("vllm-router", "kv_aware")]
FOLLOW_UP = "Now say the same in one sentence."


def register(sub) -> None:
    p = sub.add_parser("routers", help="two engines behind smg and vllm-router: failures, prefix-cache hit rate",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--routers-python", default=os.environ.get("TANDEM_ROUTERS_BIN", ".venv-routers/bin"),
                   help="folder holding the smg and vllm-router executables")
    p.add_argument("--policies", default=",".join(f"{r}:{pol}" for r, pol in POLICIES),
                   help="router:policy pairs, comma-separated")
    p.add_argument("--conversations", type=int, default=12, help="conversations per policy (MT-Bench has 80)")
    p.add_argument("--turns", type=int, default=3, help="turns per conversation")
    p.add_argument("--turn-tokens", type=int, default=24, help="max_tokens of each turn")
    p.add_argument("--concurrency", type=int, default=4, help="conversations in flight")
    p.add_argument("--engine-arg", action="append", default=[], help="extra `tandem engine serve` argument")
    p.add_argument("--out", default="loadtest-results/routers", help="output directory")
    p.set_defaults(func=run)


def router_cmd(bin_dir: str, router: str, policy: str, port: int, engines: list[Server],
               events: list[tuple[int, int]]) -> list[str]:
    """The router's command line; ``events``: each engine's (PUB port, replay port)."""
    urls = [e.base_url for e in engines]
    metrics = ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    if router == "smg":
        return [str(Path(bin_dir) / "smg"), "launch", "--host", "127.0.0.1", "--port", str(port),
                "--worker-urls", *urls, "--policy", policy, "--log-level", "warn", *metrics]
    cmd = [str(Path(bin_dir) / "vllm-router"), "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls,
           "--policy", policy, "--log-level", "warning", "--health-check-interval-secs", "5", *metrics]
    if policy == "kv_aware":
        for url, (pub, replay) in zip(urls, events):
            cmd += ["--kv-event-source", f"{url}=tcp://127.0.0.1:{pub}",
                    "--kv-event-replay-source", f"{url}=tcp://127.0.0.1:{replay}"]
        cmd += ["--kv-event-block-size", "16", "--kv-event-model", MODEL]
    return cmd


async def conversations(base_url: str, questions: list[dict], turns: int, max_tokens: int, concurrency: int,
                        label: str) -> RunResult:
    """Each question as a conversation of ``turns`` turns (its MT-Bench turns, then ``FOLLOW_UP``), each turn
    sent with the whole conversation so far; ``concurrency`` conversations at a time."""
    cfg = LoadConfig(base_url, MODEL, "chat", False, concurrency, num_requests=len(questions) * turns, label=label,
                     progress=False)
    url = endpoint_url(base_url, "chat")
    results, gate = [], asyncio.Semaphore(concurrency)

    async def one(q: dict, session) -> None:
        async with gate:
            msgs: list[dict] = []
            for t in range(turns):
                msgs.append({"role": "user", "content": q["turns"][t] if t < len(q["turns"]) else FOLLOW_UP})
                r = await send(session, url, {"model": MODEL, "messages": msgs, "max_tokens": max_tokens,
                                              "temperature": 0}, keep_text=True)
                results.append(r)
                if not r.ok:
                    return
                msgs.append({"role": "assistant", "content": r.text or ""})

    t_start = time.perf_counter()
    async with make_session(concurrency) as session:
        await asyncio.gather(*(one(q, session) for q in questions))
    return RunResult(cfg, results, t_start, time.perf_counter())


def _hit_rate(engines: list[Server], before: list[tuple[float, float]]) -> tuple[float, float, float | None]:
    after = [scrape_prefix_cache(e.base_url) for e in engines]
    q = sum(a[0] - b[0] for a, b in zip(after, before))
    h = sum(a[1] - b[1] for a, b in zip(after, before))
    return q, h, (h / q if q else None)


def run(args: argparse.Namespace) -> int:
    pairs = [tuple(p.split(":", 1)) for p in args.policies.split(",") if p]
    for router, _ in pairs:
        if not (Path(args.routers_python) / router).exists():
            print(f"{router} not found in {args.routers_python} (see --help: a venv with smg and vllm-router)")
            return 2
    questions = load_mt_bench()
    if len(pairs) * args.conversations > len(questions):
        print(f"at most {len(questions) // len(pairs)} conversations per policy with {len(pairs)} policies")
        return 2
    logs = logs_dir(args.out)
    events = [(free_port(), free_port()) for _ in range(2)]
    engines = [spawn_engine_server(logs, ["--served-model-name", MODEL, "--num-threads", "1", "--kv-events-config",
                                          json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                                      "endpoint": f"tcp://*:{pub}",
                                                      "replay_endpoint": f"tcp://*:{replay}",
                                                      "topic": "kv-events"}), *args.engine_arg],
                                   name=f"engine-{i}") for i, (pub, replay) in enumerate(events)]
    rows, runs, figures = [], [], {}
    try:
        for e in engines:
            e.wait_ready(600)
        for k, (router, policy) in enumerate(pairs):
            port = free_port()
            srv = Server(router_cmd(args.routers_python, router, policy, port, engines, events),
                         f"http://127.0.0.1:{port}/v1/models", f"http://127.0.0.1:{port}", log_dir=logs,
                         name=f"{router}-{policy}")
            try:
                srv.wait_ready(300)
                before = [scrape_prefix_cache(e.base_url) for e in engines]
                qs = questions[k * args.conversations:(k + 1) * args.conversations]
                r = asyncio.run(conversations(srv.base_url + "/v1", qs, args.turns, args.turn_tokens,
                                              args.concurrency, f"{router} {policy}"))
                q, h, rate = _hit_rate(engines, before)
            finally:
                srv.stop()
            failed = sum(not x.ok for x in r.results)
            runs.append(r)
            figures[f"{router}:{policy}"] = {"requests": len(r.results), "failed": failed, "queries": q, "hits": h,
                                             "hit_rate": rate, "seconds": r.t_end - r.t_start}
            rows.append([router, policy, len(r.results), failed, fmt(None if rate is None else rate * 100, ".1f", " %")])
            print(f"{router:12s} {policy:12s} requests {len(r.results):3d} failed {failed} "
                  f"prefix-cache hit rate {fmt(None if rate is None else rate * 100, '.1f', ' %')}", flush=True)
    finally:
        for e in engines:
            e.stop()
    table = md_table(["router", "policy", "requests", "failed", "prefix-cache hit rate"], rows)
    write_report(Path(args.out), "Tandem engines behind smg and vllm-router", runs, {"figures": figures}, table)
    print(table)
    return 1 if any(f["failed"] for f in figures.values()) else 0
