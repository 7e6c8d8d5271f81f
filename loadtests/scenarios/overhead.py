"""Scenario 1: gateway overhead, side by side with LiteLLM's proxy.

The minimal fast upstream (:mod:`loadtests.upstream`) is loaded directly, then
through ``tandem serve`` configured with one ``openai`` backend pointing at it
(one route, weight 100, no rules), and, with ``--peer-litellm PYTHON``, through
LiteLLM's proxy (``litellm --config``: one ``openai/`` model on the same
upstream, its defaults otherwise, a master key as it requires), non-streaming
and streaming:

* added p50 / p99 end-to-end latency at concurrency 1 (proxy - direct, ms);
  streamed: added TTFT p50 too;
* max requests/s at concurrency 32 (proxy / direct);
* proxy CPU milliseconds per request: utime + stime of the proxy process
  tree (``/proc/<pid>/stat``) over the c=1 and c=32 runs, divided by their
  requests; 1000 / that is what one proxy worker could serve with a core to
  itself (CPU-bound estimate).

``--rounds N`` measures every target N times, interleaved (round 1: direct,
gateway, LiteLLM; round 2: the same again, ...), so that a shared machine's
load weighs on each alike; the figures are the medians over the rounds, each
round's are kept in ``results.json`` with the load average it ran under.
Client, upstream and proxy share the machine's cores, so the c=32 figures are
a lower bound of what a proxy alone can do. ``--pin`` gives each proxy (the
gateway, LiteLLM) CPU 0 and the upstream and the load client the others (2+
CPUs): a proxy's figures are then those of one process with a core, not
crowded by its own load generator (other jobs on the machine still share it).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import yaml

from loadtests.procs import Server, cpu_set, free_port
from loadtests.report import write_report
from loadtests.scenarios.common import (fmt, gateway_config, logs_dir, md_table, measure, pct, small_workload,
                                        start_gateway, start_upstream, summary, upstream_backend)
from loadtests.stats import ratio

MODEL = "bench"
LITELLM_KEY = "sk-loadtests-overhead-0123456789"   # LiteLLM's proxy refuses to start without a master key
LITELLM_PYTHON_ENV = "TANDEM_LITELLM_PYTHON"


def register(sub) -> None:
    p = sub.add_parser("overhead", help="scenario 1: gateway overhead vs the upstream direct (and LiteLLM)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests-c1", type=int, default=1000, help="requests per run at concurrency 1")
    p.add_argument("--requests-c32", type=int, default=10000, help="requests per run at concurrency 32")
    p.add_argument("--concurrency", type=int, default=32, help="the max-throughput concurrency")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per answer (streamed chunks)")
    p.add_argument("--modes", default="non-stream,stream", help="non-stream, stream or both")
    p.add_argument("--rounds", type=int, default=1, help="interleaved rounds over the targets (figures: medians)")
    p.add_argument("--peer-litellm", default=os.environ.get(LITELLM_PYTHON_ENV),
                   help=f"a Python with litellm[proxy] installed (or ${LITELLM_PYTHON_ENV}): LiteLLM's proxy is "
                        "measured beside the gateway, on the same upstream")
    p.add_argument("--pin", action="store_true",
                   help="proxies on CPU 0, the upstream and the load client on the other CPUs")
    p.add_argument("--out", default="loadtest-results/overhead",
                   help="output directory (results.json, summary.md, plots)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def start_litellm(python: str, upstream_port: int, log_dir: Path, timeout: float = 600.0,
                  cpus: str | None = None) -> Server:
    """LiteLLM's proxy (``python -m litellm.proxy.proxy_cli``) serving ``MODEL`` from the upstream on
    ``upstream_port``, on 127.0.0.1, ready at ``/health/liveliness`` (on ``cpus``: ``Server``'s)."""
    cfg = {"model_list": [{"model_name": MODEL, "litellm_params": {
               "model": f"openai/{MODEL}", "api_base": f"http://127.0.0.1:{upstream_port}/v1", "api_key": "dummy"}}],
           "general_settings": {"master_key": LITELLM_KEY}}
    path = log_dir / "litellm.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    port = free_port()
    srv = Server([python, "-m", "litellm.proxy.proxy_cli", "--config", str(path), "--host", "127.0.0.1",
                  "--port", str(port)], f"http://127.0.0.1:{port}/health/liveliness", f"http://127.0.0.1:{port}",
                 log_dir=log_dir, name="litellm", cpus=cpus)
    return srv.wait_ready(timeout)


def _measure_target(args, label: str, base: str, proc: Server | None, mode: str, workload, runs: list,
                    headers: dict | None) -> dict:
    """c=1 then c=``args.concurrency`` against ``base`` (each after a warm-up): summaries and the CPU seconds
    of ``proc`` (None: not measured) over them."""
    stream = mode == "stream"
    res = {}
    for c, n in ((1, args.requests_c1), (args.concurrency, args.requests_c32)):
        measure("warmup", base + "/v1", MODEL, workload, stream=stream, concurrency=c,
                num_requests=min(200, n), progress=False, headers=headers or {})
        cpu0 = proc.cpu_seconds() if proc is not None else 0.0
        r = measure(f"{label} {mode} c={c}", base + "/v1", MODEL, workload, stream=stream, concurrency=c,
                    num_requests=n, progress=not args.no_progress, headers=headers or {})
        res[c] = (summary(r), (proc.cpu_seconds() - cpu0) if proc is not None else 0.0)
        runs.append(r)
    return res


def _figures(direct: dict, proxy: dict, c: int) -> dict:
    """A proxy's figures against the direct runs of the same round."""
    d1, p1, dN, pN = direct[1][0], proxy[1][0], direct[c][0], proxy[c][0]
    cpu = proxy[1][1] + proxy[c][1]
    num = p1["num_requests"] + pN["num_requests"]
    ttft_d, ttft_p = pct(d1["ttft_s"], "p50"), pct(p1["ttft_s"], "p50")
    return {
        "added_p50_ms": (pct(p1["e2e_s"], "p50") - pct(d1["e2e_s"], "p50")) * 1e3,
        "added_p99_ms": (pct(p1["e2e_s"], "p99") - pct(d1["e2e_s"], "p99")) * 1e3,
        "added_ttft_p50_ms": (ttft_p - ttft_d) * 1e3 if ttft_p is not None and ttft_d is not None else None,
        "p50_ratio": ratio(pct(p1["e2e_s"], "p50"), pct(d1["e2e_s"], "p50")),
        "direct_p50_ms": pct(d1["e2e_s"], "p50") * 1e3,
        "direct_rps": dN["requests_per_s"], "rps": pN["requests_per_s"],
        "rps_ratio": ratio(pN["requests_per_s"], dN["requests_per_s"]),
        "cpu_ms_per_request": cpu * 1e3 / max(1, num),
        # What one proxy worker could serve with a core to itself (CPU-bound).
        "rps_per_core_est": num / cpu if cpu > 0 else None,
        "errors": {"direct": d1["num_errors"] + dN["num_errors"], "proxy": p1["num_errors"] + pN["num_errors"]},
    }


def _median(rounds: list[dict]) -> dict:
    """Per figure, the median over the rounds (errors: summed)."""
    out = {}
    for key, value in rounds[0].items():
        if key == "errors":
            out[key] = {k: sum(r[key][k] for r in rounds) for k in value}
        else:
            vals = [r[key] for r in rounds if r[key] is not None]
            out[key] = statistics.median(vals) if vals else None
    return out


def _gateway_view(f: dict) -> dict:
    """The gateway's figures under the names the report has always used."""
    return {**{k: v for k, v in f.items() if k not in ("rps", "cpu_ms_per_request", "rps_per_core_est", "errors")},
            "gateway_rps": f["rps"], "gateway_cpu_ms_per_request": f["cpu_ms_per_request"],
            "gateway_rps_per_core_est": f["rps_per_core_est"],
            "errors": {"direct": f["errors"]["direct"], "gateway": f["errors"]["proxy"]}}


def run(args: argparse.Namespace) -> int:
    if args.peer_litellm and not Path(args.peer_litellm).exists():   # said before anything starts (a trial's traceback)
        print(f"--peer-litellm: no Python at {args.peer_litellm} (create a venv with litellm[proxy] as "
              "loadtests/peers/README.md says, or set it to one)", file=sys.stderr)
        return 2
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in ("non-stream", "stream") for m in modes):
        print(f"--modes: non-stream, stream or both, got {args.modes!r}", file=sys.stderr)
        return 2
    out = Path(args.out)
    logs = logs_dir(args.out)
    workload = small_workload(max_tokens=args.max_tokens)
    proxy_cpus, rest = _pinning(args.pin)
    if rest is not None:
        os.sched_setaffinity(0, cpu_set(rest))      # the load client
    up = start_upstream("upstream", logs, cpus=rest)
    runs, per_round = [], {m: [] for m in modes}
    gw = peer = None
    try:
        port = int(up.base_url.rsplit(":", 1)[1])
        cfg = gateway_config(logs / "gateway.yaml", {"upstream": upstream_backend(port, MODEL)},
                             {"direct": {"targets": [{"backend": "upstream", "weight": 100}]}}, "direct", MODEL)
        gw, _ = start_gateway(cfg, logs, cpus=proxy_cpus)
        if args.peer_litellm:
            peer = start_litellm(args.peer_litellm, port, logs, cpus=proxy_cpus)
        targets = [("direct", up.base_url, None, None), ("gateway", gw.base_url, gw, None)]
        if peer is not None:
            targets.append(("litellm", peer.base_url, peer, {"Authorization": f"Bearer {LITELLM_KEY}"}))
        for rnd in range(args.rounds):
            for mode in modes:
                load = os.getloadavg()[0]
                res = {name: _measure_target(args, name, base, proc, mode, workload, runs, headers)
                       for name, base, proc, headers in targets}
                per_round[mode].append({"round": rnd + 1, "load_average": load, **{
                    name: _figures(res["direct"], res[name], args.concurrency) for name in res if name != "direct"}})
    finally:
        for srv in (peer, gw, up):
            if srv is not None:
                srv.stop()
    figures = {}
    for mode, rounds in per_round.items():
        figures[mode] = _gateway_view(_median([r["gateway"] for r in rounds]))
        if peer is not None:
            figures[mode]["litellm"] = _median([r["litellm"] for r in rounds])
    table = _table(figures, args.concurrency)
    loads = [r["load_average"] for rounds in per_round.values() for r in rounds]
    note = (f"{args.rounds} interleaved round(s); medians. Load average {min(loads):.1f}-{max(loads):.1f} "
            f"(1 min, at the start of each mode's round)."
            + (f" Proxies on CPU {proxy_cpus}, upstream and load client on CPUs {rest}." if rest else ""))
    cpus = {"proxies": proxy_cpus, "upstream_and_client": rest}
    files = write_report(out, "Scenario 1: gateway overhead", runs,
                         {"figures": figures, "rounds": per_round, "cpus": cpus}, table + "\n\n" + note)
    print(table)
    print(note)
    print(f"\nfiles: {', '.join(str(p) for p in files.values())}")
    return 0


def _pinning(pin: bool) -> tuple[str | None, str | None]:
    """(the proxies' CPUs, the upstream's and load client's), taskset's ``-c`` form; (None, None) unpinned.

    Raises:
        SystemExit: ``--pin`` on a machine where this process may use fewer than 2 CPUs."""
    if not pin:
        return None, None
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("--pin needs 2 CPUs or more")
    return str(cpus[0]), ",".join(str(c) for c in cpus[1:])


def _table(figures: dict, c: int) -> str:
    rows = []
    for mode, f in figures.items():
        views = [("tandem", {**f, "rps": f["gateway_rps"], "cpu_ms_per_request": f["gateway_cpu_ms_per_request"],
                             "rps_per_core_est": f["gateway_rps_per_core_est"], "err": f["errors"]["gateway"]})]
        if "litellm" in f:
            views.append(("litellm", {**f["litellm"], "err": f["litellm"]["errors"]["proxy"]}))
        for who, v in views:
            rows.append([mode, who, fmt(v["added_p50_ms"], ".3f"), fmt(v["added_p99_ms"], ".3f"),
                         fmt(v["added_ttft_p50_ms"], ".3f"), fmt(v["p50_ratio"], ".2f", "x"),
                         f"{v['direct_rps']:,.0f}", f"{v['rps']:,.0f}", fmt(v["rps_ratio"], ".2f", "x"),
                         fmt(v["cpu_ms_per_request"], ".3f"), fmt(v["rps_per_core_est"], ",.0f"),
                         f"{f['errors']['direct']}/{v['err']}"])
    return md_table(["mode", "proxy", "added p50 ms (c=1)", "added p99 ms (c=1)", "added TTFT p50 ms (c=1)",
                     "p50 proxy/direct", f"direct req/s (c={c})", f"proxy req/s (c={c})", "req/s proxy/direct",
                     "proxy CPU ms/req", "req/s per proxy core (1000 / CPU ms)", "errors direct/proxy"], rows)
