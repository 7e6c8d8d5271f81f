"""Scenario 4: failover under load.

Two upstreams (``primary`` and ``fallback``) behind ``tandem serve``: one
route with primary as its only target and fallback as its fallback.
Non-streaming closed-loop load runs for ``--duration`` seconds; at
``--kill-at`` seconds the primary is SIGKILLed. With ``--primary-tp N`` the
primary is a ``tandem engine serve --tensor-parallel-size N`` (``--model``,
default the embedded one) and what is killed is one of its ranks: the engine
fails (its ``/health`` turns 503) and the gateway serves from the fallback.
Reported (from each response's ``x-tandem-backend``):

* failed requests (target: zero);
* the share served by the fallback, overall and after the kill;
* p99 end-to-end latency before the kill (the baseline) and in the failover
  window (requests sent in ``[kill, kill + --window]`` seconds), and their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import time
from pathlib import Path

from loadtests.procs import descendants, http_ok, tensor_parallel_ranks, wait_gone
from loadtests.report import write_report
from loadtests.runner import LoadConfig, run_async, run_load
from loadtests.scenarios.common import (fmt, gateway_config, logs_dir, md_table, small_workload, start_engine_server,
                                        start_gateway, start_upstream, summary, upstream_backend)
from loadtests.stats import percentiles, ratio

MODEL = "bench"
UNHEALTHY_WITHIN_S = 5.0   # issue 50: a dead rank makes the engine unhealthy within this


def register(sub) -> None:
    p = sub.add_parser("failover", help="scenario 4: kill the primary upstream under load",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=15.0, help="seconds of load")
    p.add_argument("--kill-at", type=float, default=5.0, help="seconds into the load when the primary is killed")
    p.add_argument("--window", type=float, default=2.0, help="failover window after the kill, seconds")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight")
    p.add_argument("--primary-tp", type=int, default=0, metavar="N",
                   help="the primary is a tandem engine over N tensor-parallel ranks, one of which is killed "
                        "(0: a fake upstream, killed whole)")
    p.add_argument("--model", default=None, help="the --primary-tp engine's model (None: the embedded SmolLM2)")
    p.add_argument("--engine-arg", action="append", default=[],
                   help="an extra flag of the --primary-tp engine's tandem engine serve (repeatable)")
    p.add_argument("--out", default="loadtest-results/failover",
                   help="output directory (results.json, summary.md, plots)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def analyse(results, t_kill: float, window: float) -> dict:
    """Counts, fallback shares and p99s around the kill (perf_counter ``t_kill``)."""
    before = [r for r in results if r.start + r.e2e <= t_kill]
    after = [r for r in results if r.start >= t_kill]
    in_window = [r for r in results if t_kill <= r.start <= t_kill + window]
    ok = [r for r in results if r.ok]

    def share(rs) -> float | None:
        rs = [r for r in rs if r.ok]
        return 100.0 * sum(r.backend == "fallback" for r in rs) / len(rs) if rs else None

    p99_before = (percentiles(r.e2e for r in before if r.ok) or {}).get("p99")
    p99_window = (percentiles(r.e2e for r in in_window if r.ok) or {}).get("p99")
    return {
        "requests": len(results), "failed": len(results) - len(ok),
        "fallback_share_pct": share(results), "fallback_share_after_kill_pct": share(after),
        "requests_before_kill": len(before), "requests_in_window": len(in_window),
        "p99_before_ms": None if p99_before is None else p99_before * 1e3,
        "p99_window_ms": None if p99_window is None else p99_window * 1e3,
        "p99_window_ratio": ratio(p99_window, p99_before),
    }


async def _load_and_kill(cfg: LoadConfig, workload, kill, kill_at: float):
    load = asyncio.ensure_future(run_load(cfg, workload))
    await asyncio.sleep(kill_at)
    killed = await asyncio.to_thread(kill)
    # the moment the kill landed, not when the thread was asked for it: a request started in between could still
    # be answered by the primary (a non-streamed answer takes ~0.5 ms through the gateway)
    return (await load, killed.pop("t_kill")), killed


def _kill_a_rank(server) -> dict:
    """SIGKILL the last tensor-parallel rank of the engine ``server`` started, then poll its ``/health``
    every 50 ms until it stops answering 2xx (at most 30 s).

    Returns:
        {"unhealthy_after_s": seconds from the kill to the first non-2xx /health (None: still healthy after
        30 s), "engine_pids": the server's descendants before the kill (core, zygote, ranks), "t_kill": the
        perf_counter of the SIGKILL}.
    """
    engine = descendants(server.pid)
    ranks = tensor_parallel_ranks(server.pid)
    if not ranks:
        raise RuntimeError(f"no tensor-parallel rank under the engine server (pid {server.pid})")
    os.kill(max(ranks), signal.SIGKILL)
    t_kill = time.perf_counter()
    t0 = time.monotonic()
    unhealthy = None
    while time.monotonic() - t0 < 30:
        if not http_ok(server.base_url + "/health", timeout=1.0):
            unhealthy = time.monotonic() - t0
            break
        time.sleep(0.05)
    return {"unhealthy_after_s": unhealthy, "engine_pids": engine, "t_kill": t_kill}


def _start_primary(args, logs: Path):
    """(the primary, how to kill it): a fake upstream killed whole, or a tensor-parallel engine one of whose
    ranks is killed (the kill returns what it measured: ``_kill_a_rank``)."""
    if not args.primary_tp:
        primary = start_upstream("primary", logs)
        return primary, lambda: primary.kill() or {"t_kill": time.perf_counter()}   # dead when kill() returns
    model = ["--model", args.model] if args.model else []
    primary = start_engine_server(logs, [*model, "--served-model-name", MODEL, "--tensor-parallel-size",
                                         str(args.primary_tp), *args.engine_arg], name="primary")
    return primary, lambda: _kill_a_rank(primary)


def run(args: argparse.Namespace) -> int:
    logs = logs_dir(args.out)
    primary, kill = _start_primary(args, logs)
    fallback = start_upstream("fallback", logs)
    try:
        ports = {n: int(s.base_url.rsplit(":", 1)[1]) for n, s in (("primary", primary), ("fallback", fallback))}
        cfg_path = gateway_config(logs / "gateway.yaml", {n: upstream_backend(p, MODEL) for n, p in ports.items()},
                                  {"main": {"targets": [{"backend": "primary", "weight": 100}],
                                            "fallbacks": [{"backend": "fallback"}]}}, "main", MODEL)
        gw, _ = start_gateway(cfg_path, logs)
        try:
            cfg = LoadConfig(gw.base_url + "/v1", MODEL, "chat", False, args.concurrency, duration=args.duration,
                             progress=not args.no_progress, label="failover load")
            (run_, t_kill), killed = run_async(_load_and_kill(cfg, small_workload(), kill, args.kill_at))
        finally:
            gw.stop()
    finally:
        primary.stop()
        fallback.stop()
    f = analyse(run_.results, t_kill, args.window)
    s = summary(run_)
    f["errors_by_kind"] = s["errors_by_kind"]
    passed = f["failed"] == 0
    if args.primary_tp:   # the engine's processes 10 s after its server was stopped: none may be left
        f["unhealthy_after_s"] = killed["unhealthy_after_s"]
        f["orphans"] = wait_gone(killed["engine_pids"], 10)
        passed = (passed and f["orphans"] == [] and f["unhealthy_after_s"] is not None
                  and f["unhealthy_after_s"] <= UNHEALTHY_WITHIN_S)
    table = md_table(["requests", "failed", "fallback share %", "fallback share after kill %", "p99 before kill ms",
                      f"p99 in {args.window:g} s window ms", "window/before"],
                     [[f["requests"], f["failed"], fmt(f["fallback_share_pct"], ".1f"),
                       fmt(f["fallback_share_after_kill_pct"], ".1f"), fmt(f["p99_before_ms"], ".2f"),
                       fmt(f["p99_window_ms"], ".2f"), fmt(f["p99_window_ratio"], ".2f", "x")]])
    verdict = f"{'PASS' if passed else 'FAIL'}: {f['failed']} failed non-streaming requests {s['errors_by_kind'] or ''}"
    if args.primary_tp:
        verdict += (f"; /health non-2xx {fmt(f['unhealthy_after_s'], '.2f')} s after the rank's SIGKILL (bound "
                    f"{UNHEALTHY_WITHIN_S:g} s); engine processes left after stop: {len(f['orphans'])}")
    write_report(Path(args.out), "Scenario 4: failover under load", [run_], {"figures": f, "passed": passed},
                 table + "\n\n" + verdict)
    print(table)
    print(f"\n{verdict}\nfiles: {Path(args.out) / 'results.json'}, {Path(args.out) / 'summary.md'}")
    return 0 if passed else 1
