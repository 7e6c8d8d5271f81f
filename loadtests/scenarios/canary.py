"""Scenario 3: canary under load.

Two upstreams (``stable`` and ``canary``, both :mod:`loadtests.upstream`)
behind ``tandem serve`` with one route ``canary-route``: targets stable and
canary weighted 100 - p and p. Closed-loop load runs (every request with its
own ``user``, the gateway's canary key) while the canary share is moved
5 -> 25 -> 100 % through the admin API (``POST /admin/weights``, what
``tandem ctl weights`` does) or, with ``--via reload``, by rewriting the config
file and calling ``POST /admin/reload``.

A request belongs to a phase when it was sent after that phase's change was
acknowledged (plus ``--settle`` seconds) and finished before the next change
was asked for; requests in flight across a change are counted as
"transition" and excluded from the split. The split is read from each
response's ``x-tandem-backend`` header. Pass: every phase within
``--tolerance-pp`` (1.5) percentage points of its target and zero errors.
Each user is hashed once, so the observed share carries binomial sampling
noise (sd = sqrt(p (1 - p) / n), shown per phase): at 25 % the default 10 s
phases need about 2,000 requests per phase for a +-1.5 pp check that
rarely fails by chance.

With ``--gated`` the gateway's rollout controller moves the weights itself (``loadtests/scenarios/canary_gated.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import time
from pathlib import Path

import yaml

from loadtests.procs import post_json
from loadtests.report import write_report
from loadtests.runner import LoadConfig, run_async, run_load
from loadtests.scenarios.canary_gated import add_arguments as add_gated_arguments
from loadtests.scenarios.canary_gated import run_gated
from loadtests.scenarios.common import (gateway_config, logs_dir, md_table, small_workload, start_gateway,
                                        start_upstream, summary, upstream_backend)

MODEL = "bench"
ROUTE = "canary-route"


def register(sub) -> None:
    p = sub.add_parser("canary", help="scenario 3: canary 5 -> 25 -> 100 %% under load",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--phases", default="5,25,100", help="canary percentages, in order")
    p.add_argument("--phase-duration", type=float, default=10.0, help="seconds of load per phase")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight")
    p.add_argument("--settle", type=float, default=0.2, help="seconds after a change before counting a phase")
    p.add_argument("--via", choices=("weights", "reload"), default="weights",
                   help="admin weights API, or rewrite the file + POST /admin/reload")
    p.add_argument("--tolerance-pp", type=float, default=1.5,
                   help="allowed gap between the observed and the set split, percentage points")
    p.add_argument("--stream", action="store_true", help="streamed requests")
    p.add_argument("--out", default="loadtest-results/canary",
                   help="output directory (results.json, summary.md, plots)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_gated_arguments(p)
    p.set_defaults(func=run)


def _routes(pct: float) -> dict:
    return {ROUTE: {"targets": [{"backend": "stable", "weight": 100 - pct}, {"backend": "canary", "weight": pct}]}}


def set_canary(gw_url: str, token: str, pct: float, via: str, config_path: Path) -> None:
    """Move the canary to ``pct`` percent.

    Raises:
        RuntimeError: the gateway refused.
    """
    auth = {"Authorization": f"Bearer {token}"}
    if via == "weights":
        status, body = post_json(f"{gw_url}/admin/weights", {"route": ROUTE,
                                                              "weights": {"stable": 100 - pct, "canary": pct}}, auth)
    else:
        cfg = yaml.safe_load(config_path.read_text())
        cfg["routes"] = _routes(pct)
        config_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        status, body = post_json(f"{gw_url}/admin/reload", {}, auth)
    if status >= 300:
        raise RuntimeError(f"canary change to {pct} % refused: {status} {body}")


def split_by_phase(results, phases: list[tuple[float, float, float]]) -> tuple[list[dict], int]:
    """Assign results to phases by time.

    Args:
        results: RequestResults.
        phases: (target pct, counted-from, counted-until) perf_counter seconds.

    Returns:
        (one dict per phase: target_pct, requests, canary, stable, other,
        observed_pct, errors), number of requests in no phase.
    """
    out = [{"target_pct": p, "requests": 0, "canary": 0, "stable": 0, "other": 0, "errors": 0} for p, _, _ in phases]
    unassigned = 0
    for r in results:
        for row, (_, t0, t1) in zip(out, phases):
            if r.start >= t0 and r.start + r.e2e <= t1:
                row["requests"] += 1
                if not r.ok:
                    row["errors"] += 1
                elif r.backend in ("canary", "stable"):
                    row[r.backend] += 1
                else:
                    row["other"] += 1
                break
        else:
            unassigned += 1
    for row in out:
        served = row["canary"] + row["stable"] + row["other"]
        row["observed_pct"] = 100.0 * row["canary"] / served if served else None
        p = row["target_pct"] / 100.0
        # Sampling noise of the observed share with `served` distinct users.
        row["binomial_sd_pp"] = 100.0 * math.sqrt(p * (1 - p) / served) if served else 0.0
    return out, unassigned


async def _load_with_phases(cfg: LoadConfig, workload, gw_url: str, token: str, pcts: list[float], phase_s: float,
                            settle: float, via: str, config_path: Path):
    load = asyncio.ensure_future(run_load(cfg, workload))
    phases = []
    t_from = time.perf_counter() + settle
    for i, pct in enumerate(pcts):
        if i > 0:
            t_ask = time.perf_counter()
            phases.append((pcts[i - 1], t_from, t_ask))
            await asyncio.to_thread(set_canary, gw_url, token, pct, via, config_path)
            t_from = time.perf_counter() + settle
        await asyncio.sleep(phase_s)
    run = await load
    phases.append((pcts[-1], t_from, run.t_end + 1.0))
    return run, phases


def run(args: argparse.Namespace) -> int:
    if args.gated:
        return run_gated(args)
    pcts = [float(x) for x in args.phases.split(",")]
    logs = logs_dir(args.out)
    stable = start_upstream("stable", logs)
    canary = start_upstream("canary", logs)
    try:
        ports = {n: int(s.base_url.rsplit(":", 1)[1]) for n, s in (("stable", stable), ("canary", canary))}
        cfg_path = gateway_config(logs / "gateway.yaml", {n: upstream_backend(p, MODEL) for n, p in ports.items()},
                                  _routes(pcts[0]), ROUTE, MODEL)
        gw, token = start_gateway(cfg_path, logs)
        try:
            cfg = LoadConfig(gw.base_url + "/v1", MODEL, "chat", args.stream, args.concurrency,
                             duration=args.phase_duration * len(pcts), user_prefix=f"lt-{int(time.time())}-",
                             progress=not args.no_progress, label="canary load")
            run_, phases = run_async(_load_with_phases(cfg, small_workload(), gw.base_url, token, pcts,
                                                       args.phase_duration, args.settle, args.via, cfg_path))
        finally:
            gw.stop()
    finally:
        stable.stop()
        canary.stop()
    rows, unassigned = split_by_phase(run_.results, phases)
    s = summary(run_)
    for row in rows:
        row["within_tolerance"] = (row["observed_pct"] is not None
                                   and abs(row["observed_pct"] - row["target_pct"]) <= args.tolerance_pp)
    passed = s["num_errors"] == 0 and all(r["within_tolerance"] for r in rows)
    table = md_table(["phase target %", "requests", "stable", "canary", "observed canary %", "deviation pp",
                      "binomial sd pp", "errors", f"within ±{args.tolerance_pp} pp"],
                     [[r["target_pct"], r["requests"], r["stable"], r["canary"],
                       "-" if r["observed_pct"] is None else f"{r['observed_pct']:.2f}",
                       "-" if r["observed_pct"] is None else f"{r['observed_pct'] - r['target_pct']:+.2f}",
                       f"{r['binomial_sd_pp']:.2f}", r["errors"], "yes" if r["within_tolerance"] else "NO"] for r in rows])
    verdict = (f"{s['num_requests']} requests, {s['num_errors']} errors, {unassigned} in transitions; "
               f"{'PASS' if passed else 'FAIL'}")
    write_report(Path(args.out), "Scenario 3: canary under load", [run_],
                 {"phases": rows, "unassigned": unassigned, "passed": passed, "via": args.via},
                 table + "\n\n" + verdict)
    print(table)
    print(f"\n{verdict}\nfiles: {Path(args.out) / 'results.json'}, {Path(args.out) / 'summary.md'}")
    return 0 if passed else 1
