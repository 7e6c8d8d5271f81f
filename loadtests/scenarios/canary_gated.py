"""Scenario 3, gated (``tandem loadtest canary --gated``): a rollout the gateway runs by itself under load.

Two upstreams (:mod:`loadtests.upstream`): ``stable``, and ``canary`` as chosen by ``--candidate``: ``healthy``
(answers identical to stable's), ``diverging`` (its answers differ from token 4 on), ``slow`` (``--slow-ttft``
seconds before its first token). The gateway's config declares rollout ``gated`` (``rollouts:``): the canary
target's weight on ``canary-route`` goes through ``--phases`` when every gate (parity, candidate error rate, median
TTFT against the stable side's on the same pairs) held for ``--hold-s`` at a step, and goes back to the last good step when one fails. Closed-loop streamed load
runs ``--duration`` seconds while ``GET /admin/rollouts`` is read every ``--poll-s`` seconds.

Config-change phases (issue 47, on by default; ``--no-config-phases`` leaves them out): once the rollout has moved past
its first step, the candidate (and the rollout's declaration) is edited out of the file and ``POST /admin/reload`` sent (the gateway must refuse it,
409 naming the rollout; the file is put back); once it is promoted, an unrelated route is added to the file and the
gateway reloaded (the promoted split must stand). Each decision is reported with its HTTP status and reason.

Report (``--out``): ``results.json`` and ``summary.md`` (the rollout's history with the reason of each change, the
gates at the end, the parity report, the config-change decisions, the canary share the requests saw per second), ``weight_timeline.png`` (the set
weight, and the share of answers the canary served, against time) and the latency CDF. Pass: a healthy candidate
is promoted, any other is rolled back.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

from loadtests.procs import get_json, post_json
from loadtests.report import _save, write_report
from loadtests.runner import LoadConfig, run_async, run_load
from loadtests.scenarios.common import (gateway_config, logs_dir, md_table, small_workload, start_gateway,
                                        start_upstream, summary, upstream_backend)

MODEL = "bench"
ROUTE = "canary-route"
NAME = "gated"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The gated mode's own options (``--phases``, ``--concurrency``, ``--out`` are the canary scenario's)."""
    p.add_argument("--gated", action="store_true", help="let the gateway's rollout controller move the weights")
    p.add_argument("--candidate", choices=("healthy", "diverging", "slow"), default="healthy",
                   help="--gated: how the canary upstream answers")
    p.add_argument("--hold-s", type=float, default=4.0, help="--gated: seconds every gate must hold at a step")
    p.add_argument("--duration", type=float, default=30.0, help="--gated: seconds of load")
    p.add_argument("--poll-s", type=float, default=0.25, help="--gated: seconds between reads of the rollout")
    p.add_argument("--slow-ttft", type=float, default=0.6, help="--gated, slow candidate: its TTFT, seconds")
    p.add_argument("--sample-percent", type=float, default=25.0,
                   help="--gated: percent of requests compared on both sides")
    p.add_argument("--no-config-phases", dest="config_phases", action="store_false",
                   help="--gated: leave out the reloads (candidate removed mid-rollout, unrelated edit after promotion)")


def _config(path: Path, ports: dict, steps: list[float], args) -> Path:
    gateway_config(path, {n: upstream_backend(p, MODEL) for n, p in ports.items()},
                   {ROUTE: {"targets": [{"backend": "stable", "weight": 100}, {"backend": "canary", "weight": 0}]}},
                   ROUTE, MODEL)
    import yaml

    cfg = yaml.safe_load(path.read_text())
    cfg["rollouts"] = {NAME: {"route": ROUTE, "candidate": "canary", "steps": steps, "hold_s": args.hold_s,
                              "sample_percent": args.sample_percent, "max_concurrency": 8,
                              "check_interval_s": 0.25,
                              "gates": {"parity_min": 0.95, "error_rate_max": 0.02, "ttft_p50_ratio_max": 2.0,
                                        "min_compared": 50}}}
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


async def _reload(gw_url: str, auth: dict, path: Path, text: str, restore: str | None) -> tuple[int, str]:
    """Write ``text`` to the config file, ``POST /admin/reload``; put ``restore`` back after. (status, reason:
    the error's message, or the answer's per-route layer notes)."""
    path.write_text(text)
    try:
        status, body = await asyncio.to_thread(post_json, f"{gw_url}/admin/reload", {}, auth)
    finally:
        if restore is not None:
            path.write_text(restore)
    if status != 200:
        return status, (body.get("error") or {}).get("message", str(body))
    notes = [f"{n}: {v['decided_by']}" + (f" ({v['note']})" if v.get("note") else "")
             for n, v in (body.get("layers") or {}).items()]
    return status, "; ".join(notes) or "applied"


async def _config_phase(r: dict, gw_url: str, auth: dict, path: Path, done: set, t: float) -> list:
    """The config-change phases due at rollout state ``r`` (see the module docstring): [(t, phase, status,
    reason)]."""
    import yaml

    out = []
    if "remove" not in done and r["state"] == "running" and r["step_index"] >= 1:
        done.add("remove")
        text = path.read_text()
        cfg = yaml.safe_load(text)
        cfg["routes"][ROUTE]["targets"] = [x for x in cfg["routes"][ROUTE]["targets"] if x["backend"] != "canary"]
        cfg.pop("rollouts", None)        # its declaration too (else the file alone is invalid: a 400)
        status, why = await _reload(gw_url, auth, path, yaml.safe_dump(cfg, sort_keys=False), text)
        out.append((t, "reload removing the candidate mid-rollout", status, why))
    if "unrelated" not in done and r["state"] == "promoted":
        done.add("unrelated")
        cfg = yaml.safe_load(path.read_text())
        cfg["routes"]["unrelated"] = {"targets": [{"backend": "stable", "weight": 100}]}
        status, why = await _reload(gw_url, auth, path, yaml.safe_dump(cfg, sort_keys=False), None)
        out.append((t, "unrelated reload after promotion", status, why))
    return out


async def _load_and_watch(cfg: LoadConfig, gw_url: str, token: str, poll_s: float, path: Path | None = None):
    load = asyncio.ensure_future(run_load(cfg, small_workload()))
    t0 = time.perf_counter()
    timeline, decisions, done = [], [], set()
    auth = {"Authorization": f"Bearer {token}"}
    while not load.done():
        _, body = await asyncio.to_thread(get_json, f"{gw_url}/admin/rollouts", auth)
        r = next((x for x in (body or {}).get("rollouts", []) if x["name"] == NAME), None)
        if r is not None:
            timeline.append((time.perf_counter() - t0, r["weight"], r["state"], r["gates"]))
            if path is not None:
                decisions += await _config_phase(r, gw_url, auth, path, done, time.perf_counter() - t0)
        await asyncio.sleep(poll_s)
    run = await load
    _, rollouts = await asyncio.to_thread(get_json, f"{gw_url}/admin/rollouts", auth)
    _, parity = await asyncio.to_thread(get_json, f"{gw_url}/admin/parity", auth)
    return (run, t0, timeline, next(x for x in rollouts["rollouts"] if x["name"] == NAME), parity["reports"],
            decisions)


def observed_share(results, t0: float, bin_s: float = 1.0) -> list[tuple[float, float, int]]:
    """(bin start s, percent of answers the canary served, answers) per ``bin_s`` of send time."""
    bins: dict[int, list[int]] = {}
    for r in results:
        if r.ok:
            b = bins.setdefault(int((r.start - t0) // bin_s), [0, 0])
            b[0] += r.backend == "canary"
            b[1] += 1
    return [(k * bin_s, 100.0 * c / n, n) for k, (c, n) in sorted(bins.items())]


def plot_timeline(timeline, share, path: Path) -> Path:
    """The rollout's set weight (step line) and the canary's observed share (dots) against time."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    ax.step([t for t, *_ in timeline], [w for _, w, *_ in timeline], where="post", label="candidate weight (set)")
    ax.plot([t for t, _, _ in share], [s for _, s, _ in share], "o", ms=3, alpha=0.7,
            label="answers served by the canary (per second)")
    for (t, w, st, _), prev in zip(timeline[1:], timeline):
        if st != prev[2] or w != prev[1]:
            ax.annotate(st, (t, w), fontsize=7, textcoords="offset points", xytext=(3, 4))
    ax.set_xlabel("time since the load began (s)")
    ax.set_ylabel("percent")
    ax.set_ylim(-5, 105)
    ax.set_title("Gated rollout: weight timeline")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="center right")
    return _save(fig, path)


def run_gated(args: argparse.Namespace) -> int:
    steps = [float(x) for x in args.phases.split(",")]
    logs = logs_dir(args.out)
    extra = {"healthy": (), "diverging": ("--diverge-at", "4"), "slow": ("--ttft", str(args.slow_ttft))}
    stable = start_upstream("stable", logs)
    canary = start_upstream("canary", logs, *extra[args.candidate])
    try:
        ports = {n: int(s.base_url.rsplit(":", 1)[1]) for n, s in (("stable", stable), ("canary", canary))}
        path = _config(logs / "gateway.yaml", ports, steps, args)
        gw, token = start_gateway(path, logs)
        try:
            cfg = LoadConfig(gw.base_url + "/v1", MODEL, "chat", True, args.concurrency, duration=args.duration,
                             user_prefix=f"lt-{int(time.time())}-", progress=not args.no_progress,
                             label="gated canary load")
            run_, t0, timeline, rollout, reports, decisions = run_async(_load_and_watch(
                cfg, gw.base_url, token, args.poll_s, path if args.config_phases else None))
        finally:
            gw.stop()
    finally:
        stable.stop()
        canary.stop()
    share = observed_share(run_.results, t0)
    out = Path(args.out)
    files = write_report(out, f"Scenario 3, gated: a {args.candidate} candidate", [run_],
                         {"rollout": rollout, "parity": reports, "timeline": timeline, "observed_share": share,
                          "decisions": decisions},
                         _markdown(args, rollout, timeline, run_, decisions, share))
    plot_timeline(timeline, share, out / "weight_timeline.png")
    want = "promoted" if args.candidate == "healthy" else "rolled_back"
    passed = rollout["state"] == want and all(ok for *_, ok in phase_checks(decisions))
    print((out / "summary.md").read_text())
    print(f"{'PASS' if passed else 'FAIL'}: the rollout is {rollout['state']} (want {want}); files: "
          f"{files['json']}, {files['markdown']}, {out / 'weight_timeline.png'}")
    return 0 if passed else 1


def last_gates(timeline) -> list[tuple[float, str, dict]]:
    """(weight, state, gates) as last read before each change of weight or state: what each step was judged on."""
    out = []
    for (_, w, st, g), nxt in zip(timeline, [*timeline[1:], None]):
        if nxt is None or (nxt[1], nxt[2]) != (w, st):
            out.append((w, st, g))
    return out


def phase_checks(decisions) -> list[tuple[str, bool]]:
    """(phase, as wanted) of each config-change decision: the candidate's removal refused (409), the unrelated
    reload applied with the promoted rollout still deciding the route."""
    out = []
    for _, phase, status, why in decisions:
        if phase.startswith("reload removing"):
            out.append((phase, status == 409 and NAME in why))
        else:
            out.append((phase, status == 200 and f"rollout {NAME} (promoted)" in why))
    return out


def _markdown(args, r: dict, timeline, run_, decisions=(), share=()) -> str:
    from gateway.rollouts.commands import format_parity

    s = summary(run_)
    hist = md_table(["t (s from start)", "weight %", "state", "reason"],
                    [[f"{h['at'] - r['history'][0]['at']:.1f}", f"{h['weight']:g}", h["state"], h["reason"]]
                     for h in r["history"]])
    gates = md_table(["step weight %", "state", "gate", "limit", "value", "holds"],
                     [[f"{w:g}", st, n, g["limit"], "-" if g["value"] is None else f"{g['value']:.4g}", g["ok"]]
                      for w, st, gs in last_gates(timeline) for n, g in gs.items()])
    return (f"Candidate: {args.candidate}; steps {r['steps']}, hold {r['hold_s']:g} s; {s['num_requests']} "
            f"requests, {s['num_errors']} errors, concurrency {args.concurrency}.\n\n"
            f"Final state: **{r['state']}** at {r['weight']:g} %.\n\n## History\n\n{hist}\n\n"
            f"## Gates as last read at each step (its window of pairs)\n\n{gates}\n\n"
            f"## Config changes during the rollout\n\n{md_table(['t (s)', 'change', 'HTTP', 'decision and reason'], [[f'{t:.1f}', p, st, why] for t, p, st, why in decisions]) if decisions else 'none'}\n\n"
            f"## Weights the requests saw (per second)\n\n{md_table(['t (s)', 'canary %', 'answers'], [[f'{t:g}', f'{pct:.1f}', n] for t, pct, n in share])}\n\n"
            f"## Parity (whole rollout)\n\n```\n"
            f"{format_parity(r['parity'])}\n```\n\n![weight timeline](weight_timeline.png)\n")
