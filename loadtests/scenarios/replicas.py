"""Scenario 7: several engine replicas, round-robin vs ``select: prefix_affinity``.

``--replicas`` ``tandem engine serve`` processes of one model (``--num-threads`` each) behind one ``tandem
serve`` with two routes over the same replicas: ``rr`` (weighted, equal weights, canary key = request id: each
request lands on a random replica, i.e. round-robin in expectation) and ``pa`` (prefix affinity). The same request
stream runs under each, in alternating phases (``--rounds``): ``--users`` users at once, each holding one
MT-Bench conversation of three turns (turn 2 = turn 1 + the answer + MT-Bench's second question, turn 3 = all of
that + a follow-up), streamed, greedy. Each conversation opens with its user's own system message naming the
phase, so no KV block is shared between users or phases: the hit rate counts conversation reuse only.
Reported per policy (same run): prefix-cache hit rate (the replicas' ``vllm:prefix_cache_hits / queries`` over
the phase), TTFT p50/p99 (and p50 per turn), output tok/s, load imbalance (each
replica's ``vllm:num_requests_running`` sampled every 0.25 s, averaged; max / mean over the replicas), the
gateway's per-replica routed / affinity / spill-over counters; the ratios pa / rr against the issue's targets.
Then a kill phase: ``prefix_affinity``, non-streamed, one replica SIGKILLed after a third of the requests:
failed requests (target: 0). Then a resume phase (``loadtests/scenarios/resume_phase.py``): streams on a
``resume: true`` route whose serving replica is SIGKILLed mid-stream: streams identical to a no-failure run
(target: all) and the resume gap p50/p99.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import time
import urllib.request
from pathlib import Path

import yaml

from loadtests.client import endpoint_url, make_session, send
from loadtests.report import write_report
from loadtests.runner import LoadConfig, RunResult, run_async
from loadtests.procs import Server, free_port, tandem_cmd
from loadtests.scenarios.common import fmt, logs_dir, md_table, pct, start_gateway, summary
from loadtests.scenarios.prefix import scrape_prefix_cache
from loadtests.scenarios.resume_phase import resume_phase
from loadtests.stats import percentiles, ratio
from loadtests.workloads import load_mt_bench

FOLLOW_UP = "Now summarize your previous answer in one sentence."
TARGETS = {"hit_rate_ratio": 1.8, "ttft_p50_ratio": 0.6, "imbalance": 1.3}


def register(sub) -> None:
    p = sub.add_parser("replicas", help="scenario 7: engine replicas, round-robin vs prefix_affinity",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help=".gguf or HF directory (default: the embedded SmolLM2)")
    p.add_argument("--replicas", type=int, default=3, help="tandem engine serve processes")
    p.add_argument("--num-threads", type=int, default=1, help="torch threads per replica")
    p.add_argument("--users", type=int, default=12, help="concurrent users, one conversation each")
    p.add_argument("--max-tokens", type=int, default=96, help="max_tokens of every turn (answers become the "
                   "next turns' prompt)")
    p.add_argument("--rounds", type=int, default=2, help="rr/pa phase pairs, alternating (machine noise)")
    p.add_argument("--kill-users", type=int, default=12, help="users of the kill phase (0: no kill phase)")
    p.add_argument("--resume-streams", type=int, default=20, help="streams of the resume phase, each with its "
                   "replica SIGKILLed mid-stream (0: no resume phase)")
    p.add_argument("--kv-cache-memory", default="256MiB", help="KV-cache pool of each replica")
    p.add_argument("--max-num-batched-tokens", type=int, default=128,
                   help="step budget of each replica, tokens (chunked prefill): a short step bounds how long a "
                        "request whose prompt is cached waits behind another's prefill (shared box, TTFT p50 "
                        "pa/rr: 0.78x at the engine default 2048, 0.53-0.67x at 256, 0.56x at 128)")
    p.add_argument("--engine-arg", action="append", default=[], help="extra `tandem engine serve` argument")
    p.add_argument("--out", default="loadtest-results/replicas", help="directory of the results and summary.md")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (default: shown)")
    p.set_defaults(func=run)


def replica_server(logs: Path, engine_args: list[str], i: int, port: int) -> Server:
    """Replica ``i`` (not started waiting yet) on ``port``. Its OpenMP threads are left unbound: the replicas
    share this box's cores, and each would bind its model's threads to the same ones
    (``engine.worker.device.choose_omp_binding``)."""
    return Server(tandem_cmd("engine", "serve", "--host", "127.0.0.1", "--port", str(port),
                             "--uvicorn-log-level", "warning", *engine_args),
                  f"http://127.0.0.1:{port}/health", f"http://127.0.0.1:{port}", log_dir=logs, name=f"replica-{i}",
                  env={"TANDEM_CPU_OMP_THREADS_BIND": "nobind"})


def start_replicas(logs: Path, engine_args: list[str], n: int) -> list[Server]:
    """``n`` ``tandem engine serve`` processes started together, each ready at ``/health``."""
    servers = []
    try:
        for i in range(n):
            servers.append(replica_server(logs, engine_args, i, free_port()))
        for s in servers:
            s.wait_ready(600)
    except BaseException:
        for s in servers:
            s.stop()
        raise
    return servers


def gateway_yaml(path: Path, replicas: list) -> Path:
    """Both routes over the same replicas; model ``rr`` -> round-robin, ``pa`` -> prefix affinity."""
    names = [f"r{i}" for i in range(len(replicas))]
    backends = {n: {"type": "openai", "base_url": s.base_url + "/v1",
                    "models": {"rr": "bench", "pa": "bench", "resume": "bench"},
                    "max_model_len": 2048, "timeouts": {"connect_s": 2, "read_s": 300, "first_token_s": 300}}
                for n, s in zip(names, replicas)}
    cfg = {"server": {"log_level": "warning"}, "reload": {"watch": False},
           "resilience": {"retry": {"deadline_s": 300}, "health": {"interval_s": 0}},
           "models": [{"name": "rr"}, {"name": "pa"}, {"name": "resume"}], "backends": backends,
           "routes": {"rr": {"targets": [{"backend": n, "weight": 1} for n in names]},
                      "pa": {"select": "prefix_affinity", "targets": [{"backend": n} for n in names]},
                      "resume": {"select": "prefix_affinity", "resume": True, "resume_attempts": 2,
                                 "targets": [{"backend": n} for n in names]}},
           "policy": {"canary_key": "request_id", "default_route": "rr",
                      "rules": [{"name": "pa", "match": {"model": "pa"}, "route": "pa"},
                                {"name": "resume", "match": {"model": "resume"}, "route": "resume"}]}}
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


async def _user(session, url: str, model: str, user: int, q: dict, nonce: str, max_tokens: int, stream: bool,
                out: list, on_result=None):
    """One user's three turns, each after the previous answer (``on_result(out)`` after each). The user's own
    system message opens the conversation: no KV block is shared between users or phases."""
    msgs = [{"role": "system", "content": f"User {user}, session {nonce}. Answer briefly."}]
    for k, turn in enumerate((q["turns"][0], q["turns"][1], FOLLOW_UP)):
        msgs.append({"role": "user", "content": turn})
        body = {"model": model, "messages": msgs, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        r = await send(session, url, body, keep_text=True, index=k)      # index: the turn, 0..2
        out.append(r)
        if on_result is not None:
            on_result(out)
        if not r.ok:
            return
        msgs = msgs + [{"role": "assistant", "content": r.text or ""}]


def _running(base_url: str) -> float:
    try:
        with urllib.request.urlopen(base_url + "/metrics", timeout=2) as r:  # noqa: S310 (loopback)
            text = r.read().decode()
    except OSError:
        return 0.0
    return sum(float(v) for v in re.findall(r"^vllm:num_requests_running(?:\{[^}]*\})?\s+(\S+)", text, re.M))


async def phase(gw_url: str, replicas: list, model: str, questions: list[dict], nonce: str, max_tokens: int,
                stream: bool = True, on_result=None) -> tuple[RunResult, list[float]]:
    """All users' conversations at once; returns the run and each replica's mean running requests.
    ``on_result(results)`` runs after each finished request."""
    url = endpoint_url(gw_url + "/v1", "chat")
    results: list = []
    samples: list[list[float]] = []
    stop = asyncio.Event()

    async def sample() -> None:
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            samples.append(await asyncio.gather(*(loop.run_in_executor(None, _running, s.base_url) for s in replicas)))
            await asyncio.sleep(0.25)

    t0 = time.perf_counter()
    async with make_session(len(questions), timeout_s=900) as session:
        sampler = asyncio.create_task(sample())
        await asyncio.gather(*(_user(session, url, model, i, q, nonce, max_tokens, stream, results, on_result)
                               for i, q in enumerate(questions)))
        stop.set()
        await sampler
    cfg = LoadConfig(gw_url + "/v1", model, "chat", stream, len(questions), num_requests=len(results), label=nonce,
                     progress=False)
    means = [sum(col) / len(samples) for col in zip(*samples)] if samples else [0.0] * len(replicas)
    return RunResult(cfg, results, t0, time.perf_counter()), means


def _gateway_counters(gw_url: str) -> dict:
    """The gateway's tandem_replica_* counters: {metric: {label string: value}}."""
    with urllib.request.urlopen(gw_url + "/metrics", timeout=5) as r:  # noqa: S310 (loopback)
        text = r.read().decode()
    out: dict = {}
    for name, labels, v in re.findall(r"^tandem_replica_(\w+)_total\{([^}]*)\}\s+(\S+)", text, re.M):
        out.setdefault(name, {})[labels] = float(v)
    return out


def measure_policy(gw_url, replicas, model, questions, nonce, max_tokens) -> dict:
    """One phase with its prefix-cache and imbalance figures."""
    before = [scrape_prefix_cache(s.base_url) for s in replicas]
    run, means = run_async(phase(gw_url, replicas, model, questions, nonce, max_tokens))
    after = [scrape_prefix_cache(s.base_url) for s in replicas]
    queries = sum(a[0] - b[0] for a, b in zip(after, before))
    hits = sum(a[1] - b[1] for a, b in zip(after, before))
    s = summary(run)
    mean_running = sum(means) / len(means) if means else 0.0
    return {"run": run, "summary": s, "ttft_p50_by_turn": _by_turn(run.results),
            "hit_rate": hits / queries if queries else None, "prefix_hits": hits,
            "prefix_queries": queries, "mean_running": means,
            "imbalance": max(means) / mean_running if mean_running else None}


def _by_turn(results) -> list[float | None]:
    """TTFT p50 (seconds) of turns 1, 2, 3."""
    return [pct(percentiles(r.ttft for r in results if r.ok and r.index == k and r.ttft is not None), "p50")
            for k in range(3)]


def kill_phase(gw_url: str, replicas: list, questions: list[dict], max_tokens: int) -> dict:
    """prefix_affinity, non-streamed; the last replica is SIGKILLed once a third of the requests finished."""
    total = 3 * len(questions)
    state = {"killed_at": None}

    def progress(results) -> None:
        if state["killed_at"] is None and len(results) >= total // 3:
            victim = replicas[-1]
            os.killpg(os.getpgid(victim.pid), signal.SIGKILL)   # the engine and any child it started
            state["killed_at"] = len(results)

    run, _ = run_async(phase(gw_url, replicas, "pa", questions, "kill", max_tokens, stream=False,
                             on_result=progress))
    s = summary(run)
    return {"run": run, "requests": s["num_requests"], "failed": s["num_errors"], "errors": s["errors_by_kind"],
            "killed_after_requests": state["killed_at"], "backends": s["backends"]}


def _figures(rr: dict, pa: dict) -> dict:
    f = {
        "hit_rate_rr": rr["hit_rate"], "hit_rate_pa": pa["hit_rate"],
        "hit_rate_ratio": ratio(pa["hit_rate"], rr["hit_rate"]),
        "ttft_p50_ratio": ratio(pct(pa["summary"]["ttft_s"], "p50"), pct(rr["summary"]["ttft_s"], "p50")),
        "ttft_p99_ratio": ratio(pct(pa["summary"]["ttft_s"], "p99"), pct(rr["summary"]["ttft_s"], "p99")),
        "output_tok_s_ratio": ratio(pa["summary"]["output_tokens_per_s"], rr["summary"]["output_tokens_per_s"]),
        "imbalance_rr": rr["imbalance"], "imbalance_pa": pa["imbalance"],
    }
    f["targets_met"] = {
        "hit_rate_ratio >= 1.8": f["hit_rate_ratio"] is not None and f["hit_rate_ratio"] >= TARGETS["hit_rate_ratio"],
        "ttft_p50_ratio <= 0.6": f["ttft_p50_ratio"] is not None and f["ttft_p50_ratio"] <= TARGETS["ttft_p50_ratio"],
        "imbalance_pa <= 1.3": f["imbalance_pa"] is not None and f["imbalance_pa"] <= TARGETS["imbalance"]}
    return f


def _table(phases: list[tuple[str, dict]]) -> str:
    def ms(x):
        return fmt(None if x is None else x * 1e3, ".0f")

    rows = [[label, m["summary"]["num_requests"], m["summary"]["num_errors"],
             fmt(None if m["hit_rate"] is None else 100 * m["hit_rate"], ".1f", " %"),
             ms(pct(m["summary"]["ttft_s"], "p50")), ms(pct(m["summary"]["ttft_s"], "p99")),
             " / ".join(ms(x) for x in m["ttft_p50_by_turn"]),
             fmt(m["summary"]["output_tokens_per_s"], ".1f"), fmt(m["imbalance"], ".2f"),
             " / ".join(f"{x:.2f}" for x in m["mean_running"])] for label, m in phases]
    return md_table(["phase", "requests", "errors", "prefix-cache hit rate", "TTFT p50 ms", "TTFT p99 ms",
                     "TTFT p50 ms turn 1/2/3", "output tok/s", "imbalance max/mean", "mean running per replica"], rows)


def _merge(ms: list[dict]) -> dict:
    """Several phases of one policy as one: hit rate over all tokens, percentiles over all requests."""
    from loadtests.stats import summarize

    results = [r for m in ms for r in m["run"].results]
    span = sum(m["run"].t_end - m["run"].t_start for m in ms)
    queries, hits = sum(m["prefix_queries"] for m in ms), sum(m["prefix_hits"] for m in ms)
    means = [sum(col) / len(ms) for col in zip(*(m["mean_running"] for m in ms))]
    mean = sum(means) / len(means) if means else 0.0
    return {"summary": summarize(results, 0.0, span), "ttft_p50_by_turn": _by_turn(results),
            "hit_rate": hits / queries if queries else None,
            "prefix_hits": hits, "prefix_queries": queries, "mean_running": means,
            "imbalance": max(means) / mean if mean else None, "run": ms[0]["run"]}


def run(args: argparse.Namespace) -> int:
    from engine.config import default_model_path

    model_path = args.model or default_model_path()
    questions = load_mt_bench()
    users = questions[:args.users]
    logs = logs_dir(args.out)
    engine_args = ["--model", model_path, "--served-model-name", "bench", "--num-threads", str(args.num_threads),
                   "--kv-cache-memory", args.kv_cache_memory,
                   "--max-num-batched-tokens", str(args.max_num_batched_tokens), *args.engine_arg]
    replicas = []
    gw = None
    try:
        replicas = start_replicas(logs, engine_args, args.replicas)
        gw, _ = start_gateway(gateway_yaml(logs / "gateway.yaml", replicas), logs)
        run_async(phase(gw.base_url, replicas, "rr", questions[-2:], "warmup", 4))   # load, compile, first blocks
        phases: list[tuple[str, dict]] = []
        for k in range(args.rounds):
            for model in ("rr", "pa"):
                phases.append((f"{model} round {k + 1}", measure_policy(gw.base_url, replicas, model, users,
                                                                        f"{model}-{k}", args.max_tokens)))
                print(_table(phases[-1:]).splitlines()[-1], flush=True)
        counters = _gateway_counters(gw.base_url)
        kill = kill_phase(gw.base_url, replicas, questions[args.users:args.users + args.kill_users],
                          args.max_tokens) if args.kill_users else None
        resumed = None
        if args.resume_streams:
            if kill is not None:          # the kill phase's victim serves the resume phase again
                restart(logs, engine_args, replicas, len(replicas) - 1)
            resumed = resume_phase(gw.base_url, replicas, questions[:args.resume_streams], args.max_tokens,
                                   lambda i: restart(logs, engine_args, replicas, i))
    finally:
        if gw is not None:
            gw.stop()
        for s in replicas:
            s.stop()
    figures = {}
    if phases:
        rr = _merge([m for label, m in phases if label.startswith("rr")])
        pa = _merge([m for label, m in phases if label.startswith("pa")])
        figures = _figures(rr, pa)
    report(args, phases, figures, counters, kill, model_path, resumed)
    return 0


def restart(logs: Path, engine_args: list[str], replicas: list, i: int) -> None:
    """Start replica ``i`` again on its port (after a SIGKILL), ready at ``/health``."""
    old = replicas[i]
    old.stop()
    replicas[i] = replica_server(logs, engine_args, i, int(old.base_url.rsplit(":", 1)[1])).wait_ready(600)


def report(args, phases, figures, counters, kill, model_path, resumed=None) -> None:
    """Print and write the same-run table, the ratios against the targets, the gateway counters, the kill phase."""
    table = _table(phases)
    lines = [f"Same run, shared machine ({os.cpu_count()} cores, other processes running): ratios only."]
    if figures:
        lines += [
             f"prefix_affinity / round-robin: hit rate {fmt(figures['hit_rate_ratio'], '.2f', 'x')} (target >= 1.8x), "
             f"TTFT p50 {fmt(figures['ttft_p50_ratio'], '.2f', 'x')} (target <= 0.6x), "
             f"p99 {fmt(figures['ttft_p99_ratio'], '.2f', 'x')}, "
             f"output tok/s {fmt(figures['output_tok_s_ratio'], '.2f', 'x')}; "
             f"imbalance max/mean running: pa {fmt(figures['imbalance_pa'], '.2f')} (target <= 1.3), "
             f"rr {fmt(figures['imbalance_rr'], '.2f')}",
             "targets: " + ", ".join(f"{k}: {'met' if v else 'NOT met'}" for k, v in figures["targets_met"].items()),
             "gateway counters (prefix_affinity route): " + "; ".join(
                 f"{name} " + ", ".join(f"{{{lab}}}={v:g}" for lab, v in sorted(vals.items()))
                 for name, vals in counters.items())]
    if resumed is not None:
        lines.append(f"resume phase: {resumed['identical']}/{resumed['streams']} streams identical to a no-failure "
                     f"run with their replica SIGKILLed mid-stream ({resumed['failed']} failed "
                     f"{resumed['errors'] or ''}); resume gap (kill -> next content chunk) p50 "
                     f"{fmt(resumed['gap_p50_s'] and resumed['gap_p50_s'] * 1e3, '.0f', ' ms')}, p99 "
                     f"{fmt(resumed['gap_p99_s'] and resumed['gap_p99_s'] * 1e3, '.0f', ' ms')} "
                     f"over {resumed['resumed']} resumed streams")
    if kill is not None:
        lines.append(f"kill phase: {kill['requests']} requests, {kill['failed']} failed {kill['errors'] or ''} "
                     f"(replica r{args.replicas - 1} SIGKILLed after {kill['killed_after_requests']}); "
                     f"served by {kill['backends']}")
    text = table + "\n\n" + "\n\n".join(lines)
    runs = [m["run"] for _, m in phases] + ([kill["run"]] if kill else [])
    extra = {"figures": figures, "counters": counters, "model": model_path,
             "phases": {label: {k: v for k, v in m.items() if k != "run"} for label, m in phases},
             "kill": {k: v for k, v in (kill or {}).items() if k != "run"}, "resume": resumed}
    write_report(Path(args.out), "Scenario 7: engine replicas, round-robin vs prefix_affinity", runs, extra, text)
    print(text)
    print(f"\nfiles: {Path(args.out) / 'results.json'}, {Path(args.out) / 'summary.md'}")
