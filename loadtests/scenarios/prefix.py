"""Scenario 5: prefix caching, MT-Bench turn 2 after turn 1.

``tandem engine serve`` runs twice, with ``--enable-prefix-caching`` and
with ``--no-enable-prefix-caching``. For each of ``--num-prompts`` MT-Bench
questions, one at a time: turn 1 (greedy, non-streamed, ``--turn1-tokens``),
then at once turn 2 = turn 1 + the server's own answer + the second question
(streamed, ``--turn2-tokens``), whose TTFT is measured. With caching on, turn
2's prompt reuses turn 1's KV blocks (its prompt and, where the answer
re-tokenizes identically, the answer). Reported: turn-2 TTFT p50/p99 with
caching on and off, the ratio off/on (the speed-up), and the server's
prefix-cache hit rate (``vllm:prefix_cache_hits / vllm:prefix_cache_queries``
from ``/metrics``).
"""

from __future__ import annotations

import argparse
import re
import time
import urllib.request
from pathlib import Path

from loadtests.client import endpoint_url, make_session, send
from loadtests.report import write_report
from loadtests.runner import LoadConfig, RunResult, run_async
from loadtests.scenarios.common import fmt, logs_dir, md_table, pct, start_engine_server, summary
from loadtests.stats import ratio
from loadtests.workloads import load_mt_bench

MODEL = "bench"


def register(sub) -> None:
    p = sub.add_parser("prefix", help="scenario 5: turn-2 TTFT with prefix caching on vs off",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help=".gguf or HF directory (default: the embedded SmolLM2)")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                   help="engine dtype (auto: bfloat16 on CPU)")
    p.add_argument("--num-prompts", type=int, default=16, help="MT-Bench conversations (up to 80)")
    p.add_argument("--turn1-tokens", type=int, default=64, help="max_tokens of the first turn, tokens")
    p.add_argument("--turn2-tokens", type=int, default=8, help="max_tokens of the second turn (TTFT measured), tokens")
    p.add_argument("--engine-arg", action="append", default=[], help="extra `tandem engine serve` argument")
    p.add_argument("--out", default="loadtest-results/prefix",
                   help="output directory (results.json, summary.md, plots)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def scrape_prefix_cache(base_url: str) -> tuple[float, float]:
    """(queries, hits) summed over ``vllm:prefix_cache_queries*`` / ``vllm:prefix_cache_hits*`` samples."""
    try:
        with urllib.request.urlopen(base_url + "/metrics", timeout=5) as r:  # noqa: S310 (loopback)
            text = r.read().decode()
    except OSError:
        return 0.0, 0.0
    totals = {"queries": 0.0, "hits": 0.0}
    for line in text.splitlines():
        m = re.match(r"^vllm:prefix_cache_(queries|hits)(_total)?(\{[^}]*\})?\s+([0-9.eE+-]+)", line)
        if m:
            totals[m.group(1)] += float(m.group(4))
    return totals["queries"], totals["hits"]


async def two_turns(base_url: str, questions: list[dict], turn1_tokens: int, turn2_tokens: int,
                    label: str) -> RunResult:
    """Turn 1 then turn 2 of each question, one at a time; the result holds the turn-2 requests."""
    cfg = LoadConfig(base_url, MODEL, "chat", True, 1, num_requests=len(questions), label=label, progress=False)
    url = endpoint_url(base_url, "chat")
    results = []
    t_start = time.perf_counter()
    async with make_session(1) as session:
        for i, q in enumerate(questions):
            first = [{"role": "user", "content": q["turns"][0]}]
            r1 = await send(session, url, {"model": MODEL, "messages": first, "max_tokens": turn1_tokens,
                                           "temperature": 0}, keep_text=True)
            if not r1.ok:
                results.append(r1)
                continue
            msgs = first + [{"role": "assistant", "content": r1.text or ""}, {"role": "user", "content": q["turns"][1]}]
            r2 = await send(session, url, {"model": MODEL, "messages": msgs, "max_tokens": turn2_tokens,
                                           "temperature": 0, "stream": True,
                                           "stream_options": {"include_usage": True}}, index=i)
            results.append(r2)
    return RunResult(cfg, results, t_start, time.perf_counter())


def run(args: argparse.Namespace) -> int:
    from engine.config import default_model_path

    model_path = args.model or default_model_path()
    questions = load_mt_bench()[:args.num_prompts]
    logs = logs_dir(args.out)
    runs, cache = {}, {}
    for mode, flag in (("on", "--enable-prefix-caching"), ("off", "--no-enable-prefix-caching")):
        srv = start_engine_server(logs, ["--model", model_path, "--served-model-name", MODEL, "--dtype", args.dtype,
                                         flag, *args.engine_arg], name=f"engine-prefix-{mode}")
        try:
            run_async(two_turns(srv.base_url + "/v1", questions[:1], 4, 1, "warmup"))
            q0, h0 = scrape_prefix_cache(srv.base_url)
            runs[mode] = run_async(two_turns(srv.base_url + "/v1", questions, args.turn1_tokens, args.turn2_tokens,
                                             f"turn 2, prefix caching {mode}"))
            q1, h1 = scrape_prefix_cache(srv.base_url)
            cache[mode] = {"queries": q1 - q0, "hits": h1 - h0,
                           "hit_rate": (h1 - h0) / (q1 - q0) if q1 > q0 else None}
        finally:
            srv.stop()
    s_on, s_off = summary(runs["on"]), summary(runs["off"])
    figures = {
        "ttft_p50_on_s": pct(s_on["ttft_s"], "p50"), "ttft_p99_on_s": pct(s_on["ttft_s"], "p99"),
        "ttft_p50_off_s": pct(s_off["ttft_s"], "p50"), "ttft_p99_off_s": pct(s_off["ttft_s"], "p99"),
        "ttft_p50_speedup": ratio(pct(s_off["ttft_s"], "p50"), pct(s_on["ttft_s"], "p50")),
        "ttft_p99_speedup": ratio(pct(s_off["ttft_s"], "p99"), pct(s_on["ttft_s"], "p99")),
        "prefix_cache": cache, "errors": {"on": s_on["num_errors"], "off": s_off["num_errors"]},
    }

    def ms(x):
        return fmt(None if x is None else x * 1e3, ".1f")

    table = md_table(["prefix caching", "turn-2 requests", "TTFT p50 ms", "TTFT p99 ms", "cache hit rate", "errors"],
                     [[m, s["num_requests"], ms(pct(s["ttft_s"], "p50")), ms(pct(s["ttft_s"], "p99")),
                       fmt(None if cache[m]["hit_rate"] is None else cache[m]["hit_rate"] * 100, ".1f", " %"),
                       s["num_errors"]] for m, s in (("on", s_on), ("off", s_off))])
    verdict = (f"TTFT speed-up off/on: p50 {fmt(figures['ttft_p50_speedup'], '.2f', 'x')}, "
               f"p99 {fmt(figures['ttft_p99_speedup'], '.2f', 'x')}")
    write_report(Path(args.out), "Scenario 5: prefix caching (MT-Bench turn 2)", [runs["on"], runs["off"]],
                 {"figures": figures, "model": model_path}, table + "\n\n" + verdict)
    print(table)
    print(f"\n{verdict}\nfiles: {Path(args.out) / 'results.json'}, {Path(args.out) / 'summary.md'}")
    return 0
