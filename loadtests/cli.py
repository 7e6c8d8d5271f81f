"""``tandem loadtest ...`` and ``tandem parity`` (also ``python -m loadtests ...``).

Sub-commands of ``loadtest``:
  run       load any OpenAI-compatible server (open or closed loop, a concurrency sweep)
  upstream  serve the minimal fast upstream (``loadtests/upstream.py``)
  overhead  scenario 1: gateway overhead vs the upstream direct
  engine    scenario 2: ``tandem engine serve`` vs HF transformers on MT-Bench
  core-modes  the engine core in its own process vs in a thread of the server (interleaved)
  canary    scenario 3: canary 5 -> 25 -> 100 % under load
  failover  scenario 4: kill the primary upstream under load
  prefix    scenario 5: MT-Bench turn 2 TTFT with prefix caching on vs off
  replicas  scenario 7: engine replicas, round-robin vs prefix_affinity routing (+ a replica killed)
  ledger    scenario 8: the usage ledger under Redis pauses, stalls and restarts (two replicas)
  spill     spill to aggregators: local only vs a threshold rule vs a TTFT SLO
            (--sweep: every threshold setting, the SLO route and the offline oracle: attainment vs cost)
  prompt-cache  prompt-cache affinity on aggregators: cached share of input tokens with vs without sticky
  slo-replicas  an SLO route over two engine replicas with different loads: a replica that meets the SLO?
``parity`` is scenario 6: greedy outputs and logprobs of two targets compared.
"""

from __future__ import annotations

import argparse
import functools
import sys

from engine.arg_values import flag_type, positive_count, positive_seconds
from loadtests import upstream
from loadtests.procs import exit_on_sigterm


def _csv_ints(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def _common_out(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument("--out", default=default, help="output directory (results.json, summary.md, PNG plots)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _add_run(sub) -> None:
    p = sub.add_parser("run", help="load an OpenAI-compatible server",
                       description="Load an OpenAI-compatible server and report throughput and latency percentiles.")
    p.add_argument("--url", required=True, help="base URL, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--model", required=True, help="the model field sent")
    p.add_argument("--endpoint", choices=("chat", "completions"), default="chat",
                   help="/v1/chat/completions or /v1/completions")
    p.add_argument("--stream", action="store_true", help="streamed responses (TTFT, TPOT, ITL)")
    p.add_argument("--workload", choices=("mtbench", "mtbench-turn2", "synthetic"), default="mtbench",
                   help="prompts: MT-Bench turn 1, turn 2 (with turn 1's answer), or synthetic lengths")
    p.add_argument("--num-prompts", type=int, default=None, help="distinct prompts (mtbench: up to 80)")
    p.add_argument("--max-tokens", type=int, default=128, help="max_tokens of each request, tokens")
    p.add_argument("--input-len", default="fixed:128",
                   help="synthetic prompt length in words ~ tokens: fixed:N, uniform:LO,HI, normal:MEAN,STD, exponential:MEAN")
    p.add_argument("--output-len", default=None, help="synthetic max_tokens distribution (default fixed:--max-tokens)")
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (vLLM extension) for exact output lengths")
    p.add_argument("--concurrency", type=_csv_ints, default=None,
                   help="closed loop: requests in flight (default 1); a list (1,8,32) sweeps and plots. "
                        "Open loop: the cap on requests in flight and the pool size (default 256)")
    p.add_argument("--rate", type=float, default=None, help="open loop: Poisson arrivals, requests/s")
    p.add_argument("--num-requests", type=flag_type(positive_count), default=None,
                   help="stop after this many requests")
    p.add_argument("--duration", type=flag_type(positive_seconds), default=None,
                   help="stop issuing after this many seconds")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")
    p.add_argument("--api-key", default=None, help="sent as Authorization: Bearer")
    p.add_argument("--header", action="append", default=[], metavar="NAME:VALUE", help="extra header (repeatable)")
    p.add_argument("--user-prefix", default=None, help="send user=<prefix><i> (distinct users)")
    p.add_argument("--seed", type=int, default=0, help="workload and arrival-time random seed")
    p.add_argument("--allow-remote", action="store_true", help="allow a non-loopback target")
    _common_out(p, "loadtest-results")
    p.set_defaults(func=_cmd_run)


def _cmd_run(args: argparse.Namespace) -> int:
    from loadtests.client import check_loopback
    from loadtests.report import write_report
    from loadtests.runner import LoadConfig, run_load_sync
    from loadtests.stats import summarize
    from loadtests.workloads import build_workload

    try:
        check_loopback(args.url, args.allow_remote)
        workload = build_workload(args.workload, num_prompts=args.num_prompts, max_tokens=args.max_tokens,
                                  input_len=args.input_len, output_len=args.output_len, seed=args.seed,
                                  ignore_eos=args.ignore_eos)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    headers = {}
    for h in args.header:
        name, _, value = h.partition(":")
        headers[name.strip()] = value.strip()
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
    num_requests = args.num_requests
    if num_requests is None and args.duration is None:
        num_requests = len(workload)
    concurrencies = args.concurrency or ([256] if args.rate else [1])
    runs, sweep = [], []
    for c in concurrencies:
        cfg = LoadConfig(base_url=args.url, model=args.model, endpoint=args.endpoint, stream=args.stream,
                         concurrency=c, rate=args.rate, num_requests=num_requests, duration=args.duration,
                         timeout=args.timeout, headers=headers, user_prefix=args.user_prefix, seed=args.seed,
                         progress=not args.no_progress, label=f"c={c}" + (f" rate={args.rate}" if args.rate else ""))
        run = run_load_sync(cfg, workload)
        runs.append(run)
        sweep.append((c, summarize(run.results, run.t_start, run.t_end)))
    files = write_report(args.out, f"Load test: {args.url} ({args.endpoint}, {'stream' if args.stream else 'non-stream'})",
                         runs, sweep={args.model: sweep} if len(sweep) > 1 else None)
    print((files["markdown"]).read_text())
    print("files: " + ", ".join(str(p) for p in files.values()))
    if not any(s["num_ok"] for _, s in sweep):      # a run with no answer is no measurement (a trial's exit 0)
        print("error: no request was answered (see errors_by_kind above)", file=sys.stderr)
        return 1
    return 0


def _add_upstream(sub) -> None:
    p = sub.add_parser("upstream", help="serve the minimal fast upstream (canned OpenAI answers)")
    upstream.add_arguments(p)
    p.set_defaults(func=upstream.serve)


def add_commands(sub) -> None:
    """Add the ``loadtest`` sub-commands to ``sub`` (an argparse subparsers object)."""
    from loadtests.scenarios import (canary, core_modes, engine, failover, ledger, overhead, prefix, prompt_cache,
                                     replicas, routers, slo_replicas, spill)
    _add_run(sub)
    _add_upstream(sub)
    for mod in (overhead, engine, core_modes, canary, failover, prefix, replicas, ledger, spill, prompt_cache, routers,
                slo_replicas):
        mod.register(sub)
    for parser in sub.choices.values():  # `tandem loadtest X` and `python -m loadtests X` alike
        parser.set_defaults(func=functools.partial(_stopping_servers_on_sigterm, parser.get_default("func")))


def _stopping_servers_on_sigterm(run, args: argparse.Namespace) -> int | None:
    """``run(args)`` with SIGTERM ending it through its ``finally`` blocks: a scenario stopped by ``timeout``
    stops the servers it started (``procs.exit_on_sigterm``)."""
    exit_on_sigterm()
    return run(args)


def register(subparsers) -> None:
    """Register ``loadtest`` (with its sub-commands) and ``parity`` on the ``tandem`` parser."""
    from loadtests.scenarios import parity
    p = subparsers.add_parser("loadtest", help="load tests and the benchmark scenarios",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_commands(p.add_subparsers(dest="loadtest_command", required=True, metavar="SCENARIO"))
    parity.register(subparsers)


def main(argv: list[str] | None = None) -> int:
    """``python -m loadtests``: the ``loadtest`` sub-commands plus ``parity`` at top level."""
    from loadtests.scenarios import parity
    parser = argparse.ArgumentParser(prog="python -m loadtests", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_commands(sub)
    parity.register(sub)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)
