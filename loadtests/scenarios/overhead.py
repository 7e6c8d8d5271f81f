"""Scenario 1: gateway overhead.

The minimal fast upstream (:mod:`loadtests.upstream`) is loaded directly, then
through ``tandem serve`` configured with one ``openai`` backend pointing at it
(one route, weight 100, no rules), non-streaming and streaming:

* added p50 / p99 end-to-end latency at concurrency 1 (gateway - direct, ms);
* max requests/s at concurrency 32 (gateway / direct);
* gateway CPU milliseconds per request: utime + stime of the gateway process
  tree (``/proc/<pid>/stat``) over the c=1 and c=32 runs, divided by their
  requests; 1000 / that is what one gateway worker could serve with a core
  to itself (CPU-bound estimate).

Targets from issue 8: added p50 <= 1 ms, >= 1,000 non-streaming requests/s for
one gateway worker. Client, upstream and gateway share the machine's cores, so
the c=32 figures are a lower bound of what the gateway alone can do.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from loadtests.report import write_report
from loadtests.scenarios.common import (fmt, gateway_config, md_table, measure, pct, small_workload,
                                        start_gateway, start_upstream, summary, upstream_backend)
from loadtests.stats import ratio

MODEL = "bench"


def register(sub) -> None:
    p = sub.add_parser("overhead", help="scenario 1: gateway overhead vs the upstream direct",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests-c1", type=int, default=1000, help="requests per run at concurrency 1")
    p.add_argument("--requests-c32", type=int, default=10000, help="requests per run at concurrency 32")
    p.add_argument("--concurrency", type=int, default=32, help="the max-throughput concurrency")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per answer (streamed chunks)")
    p.add_argument("--modes", default="non-stream,stream", help="non-stream, stream or both")
    p.add_argument("--out", default="loadtest-results/overhead",
                   help="output directory (results.json, summary.md, plots)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    logs = Path(tempfile.mkdtemp(prefix="lt-overhead-"))
    workload = small_workload(max_tokens=args.max_tokens)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    prog = not args.no_progress
    up = start_upstream("upstream", logs)
    runs, figures = [], {}
    try:
        port = int(up.base_url.rsplit(":", 1)[1])
        cfg = gateway_config(logs / "gateway.yaml", {"upstream": upstream_backend(port, MODEL)},
                             {"direct": {"targets": [{"backend": "upstream", "weight": 100}]}}, "direct", MODEL)
        gw, _ = start_gateway(cfg, logs)
        try:
            for mode in modes:
                stream = mode == "stream"
                res = {}
                for where, base in (("direct", up.base_url), ("gateway", gw.base_url)):
                    for c, n in ((1, args.requests_c1), (args.concurrency, args.requests_c32)):
                        measure("warmup", base + "/v1", MODEL, workload, stream=stream, concurrency=c,
                                num_requests=min(200, n), progress=False)
                        cpu0 = gw.cpu_seconds()
                        r = measure(f"{where} {mode} c={c}", base + "/v1", MODEL, workload, stream=stream,
                                    concurrency=c, num_requests=n, progress=prog)
                        cpu = gw.cpu_seconds() - cpu0
                        runs.append(r)
                        res[(where, c)] = (summary(r), cpu)
                d1, g1 = res[("direct", 1)][0], res[("gateway", 1)][0]
                dN, gN = res[("direct", args.concurrency)][0], res[("gateway", args.concurrency)][0]
                g_cpu = res[("gateway", 1)][1] + res[("gateway", args.concurrency)][1]
                g_req = g1["num_requests"] + gN["num_requests"]
                figures[mode] = {
                    "added_p50_ms": (pct(g1["e2e_s"], "p50") - pct(d1["e2e_s"], "p50")) * 1e3,
                    "added_p99_ms": (pct(g1["e2e_s"], "p99") - pct(d1["e2e_s"], "p99")) * 1e3,
                    "p50_ratio": ratio(pct(g1["e2e_s"], "p50"), pct(d1["e2e_s"], "p50")),
                    "direct_rps": dN["requests_per_s"], "gateway_rps": gN["requests_per_s"],
                    "rps_ratio": ratio(gN["requests_per_s"], dN["requests_per_s"]),
                    "gateway_cpu_ms_per_request": g_cpu * 1e3 / max(1, g_req),
                    # What one gateway worker could serve with a core to itself (CPU-bound).
                    "gateway_rps_per_core_est": g_req / g_cpu if g_cpu > 0 else None,
                    "errors": {"direct": d1["num_errors"] + dN["num_errors"],
                               "gateway": g1["num_errors"] + gN["num_errors"]},
                }
        finally:
            gw.stop()
    finally:
        up.stop()
    rows = [[m, fmt(f["added_p50_ms"], ".3f"), fmt(f["added_p99_ms"], ".3f"), fmt(f["p50_ratio"], ".2f", "x"),
             f"{f['direct_rps']:,.0f}", f"{f['gateway_rps']:,.0f}", fmt(f["rps_ratio"], ".2f", "x"),
             fmt(f["gateway_cpu_ms_per_request"], ".3f"), fmt(f["gateway_rps_per_core_est"], ",.0f"),
             f"{f['errors']['direct']}/{f['errors']['gateway']}"]
            for m, f in figures.items()]
    table = md_table(["mode", "added p50 ms (c=1)", "added p99 ms (c=1)", "p50 gateway/direct",
                      f"direct req/s (c={args.concurrency})", f"gateway req/s (c={args.concurrency})",
                      "req/s gateway/direct", "gateway CPU ms/req", "req/s per gateway core (1000 / CPU ms)",
                      "errors direct/gateway"], rows)
    files = write_report(out, "Scenario 1: gateway overhead", runs, {"figures": figures}, table)
    print(table)
    print(f"\nfiles: {', '.join(str(p) for p in files.values())}")
    return 0
