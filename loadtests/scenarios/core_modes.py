"""Engine core in its own process vs in a thread of the server, same run.

``tandem engine serve`` with ``--engine-core-process`` (the default) and
with ``--no-engine-core-process`` (both started once; the idle one waits
without using a core) answer MT-Bench turn-1 prompts (chat, streamed, greedy,
``ignore_eos``) at each concurrency, in interleaved rounds (process then
thread, then thread then process, ...). Reported per concurrency: the medians
over rounds of total output tok/s, TTFT p50 and TPOT p50 of both, and the
median of the per-round ratios process / thread (each ratio from two
back-to-back runs, so a load change on a shared machine hits both).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from loadtests.scenarios.common import fmt, md_table, measure, pct, spawn_engine_server, summary
from loadtests.workloads import mt_bench_turn1

MODEL = "bench"
MODES = {"process": "--engine-core-process", "thread": "--no-engine-core-process"}


def register(sub) -> None:
    p = sub.add_parser("core-modes", help="engine core in its own process vs a thread, interleaved",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help=".gguf or HF directory (default: the embedded SmolLM2)")
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated concurrencies (default: 1,8,32)")
    p.add_argument("--rounds", type=int, default=4, help="rounds per mode, interleaved (default: 4)")
    p.add_argument("--num-prompts", type=int, default=32, help="MT-Bench prompts per concurrency (default: 32)")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (default: 64)")
    p.add_argument("--engine-arg", action="append", default=[],
                   help="extra `tandem engine serve` argument for both modes, e.g. --engine-arg=--dtype=bfloat16")
    p.set_defaults(func=run)


def _measure(srv, mode: str, c: int, workload) -> dict:
    num = 4 if c == 1 else max(c, min(len(workload), 2 * c))
    return summary(measure(f"{mode} c={c}", srv.base_url + "/v1", MODEL, workload, stream=True, concurrency=c,
                           num_requests=num, progress=False))


def run(args: argparse.Namespace) -> int:
    concurrencies = [int(x) for x in args.concurrency.split(",") if x.strip()]
    logs = Path(tempfile.mkdtemp(prefix="lt-core-modes-"))
    workload = mt_bench_turn1(args.max_tokens, args.num_prompts, extra={"temperature": 0, "ignore_eos": True})
    results: dict[str, list[dict[int, dict]]] = {m: [] for m in MODES}
    extra = ["--model", args.model] if args.model else []
    servers = {m: spawn_engine_server(logs, [*extra, "--served-model-name", MODEL, flag, *args.engine_arg],
                                      name=f"engine-{m}") for m, flag in MODES.items()}   # they load at once
    try:
        for srv in servers.values():
            srv.wait_ready(300)
        for srv in servers.values():
            measure("warmup", srv.base_url + "/v1", MODEL, workload[:2], stream=True, concurrency=1,
                    num_requests=2, progress=False)
        for i in range(args.rounds):
            order = list(MODES) if i % 2 == 0 else list(reversed(MODES))
            for m in MODES:
                results[m].append({})
            for c in concurrencies:
                for m in order:
                    results[m][-1][c] = _measure(servers[m], m, c, workload)
            print(f"round {i + 1}: " + ", ".join(
                f"c={c} {results['process'][-1][c]['output_tokens_per_s']:.1f}/"
                f"{results['thread'][-1][c]['output_tokens_per_s']:.1f} tok/s" for c in concurrencies), flush=True)
    finally:
        for srv in servers.values():
            srv.stop()

    def med(mode: str, c: int, key: str, p: str | None = None) -> float | None:
        vals = [r[c][key] if p is None else pct(r[c][key], p) for r in results[mode]]
        vals = [v for v in vals if v is not None]
        return statistics.median(vals) if vals else None

    def ratio(c: int, key: str, p: str | None = None) -> float | None:
        vals = []
        for a, b in zip(results["process"], results["thread"]):
            x, y = (a[c][key], b[c][key]) if p is None else (pct(a[c][key], p), pct(b[c][key], p))
            if x and y:
                vals.append(x / y)
        return statistics.median(vals) if vals else None

    rows = []
    for c in concurrencies:
        tp, tt = med("process", c, "output_tokens_per_s"), med("thread", c, "output_tokens_per_s")
        fp, ft = med("process", c, "ttft_s", "p50"), med("thread", c, "ttft_s", "p50")
        pp, pt = med("process", c, "tpot_s", "p50"), med("thread", c, "tpot_s", "p50")
        errors = sum(r[c]["num_errors"] for m in MODES for r in results[m])
        rows.append([c, fmt(tp, ".1f"), fmt(tt, ".1f"), fmt(ratio(c, "output_tokens_per_s"), ".2f", "x"),
                     fmt(fp and fp * 1e3, ".1f"), fmt(ft and ft * 1e3, ".1f"), fmt(ratio(c, "ttft_s", "p50"), ".2f", "x"),
                     fmt(pp and pp * 1e3, ".1f"), fmt(pt and pt * 1e3, ".1f"), fmt(ratio(c, "tpot_s", "p50"), ".2f", "x"),
                     errors])
    print(md_table(["concurrency", "process tok/s", "thread tok/s", "tok/s process/thread", "process TTFT p50 ms",
                    "thread TTFT p50 ms", "TTFT p50 process/thread", "process TPOT p50 ms", "thread TPOT p50 ms",
                    "TPOT p50 process/thread", "errors"], rows))
    print(f"\n{args.rounds} interleaved rounds (medians; ratios: median of per-round ratios), {args.max_tokens} output tokens "
          "(greedy, ignore_eos), MT-Bench turn 1, streamed chat.")
    return 0
