"""Spill to aggregators by predicted TTFT: the same arrivals under three policies.

``tandem serve`` with the local engine (the embedded SmolLM2 unless ``--model``) and two fake aggregators
(``loadtests.upstream`` with a fixed TTFT and prices: ``cheap`` slower, ``fast`` dearer). Open-loop Poisson
arrivals whose rate ramps from ``--low`` to ``--high`` times the local engine's capacity (measured first, on an
SLO-free local-only gateway of its own) and back; mixed prompt lengths and multi-turn conversations (each turn
repeats the conversation so far: the prefix cache serves it when the engine still holds it). Policies:

* ``local``: everything to the engine;
* ``threshold``: the spill-over rule of ``config.example.yaml`` (``local.waiting > 32`` or ``local.kv_usage >=
  90``: the aggregators, cheapest first);
* ``slo``: ``slo: {ttft_ms: --slo-ms}`` over [local, cheap, fast].

Reported per policy: % of requests whose TTFT met the SLO (a failed request does not), cost per 1,000 requests
(usage x the backends' prices), share sent upstream, and for requests the engine served the prediction error
(``local`` and the threshold rules carry ``slo`` on their one-target local route only to make it visible) |predicted - measured| / measured (p50, p90; the prediction from ``x-tandem-slo``: the gateway's
figure, and the engine's own before the gateway's correction by the engine's recent measured / predicted ratio).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import msgspec

from loadtests.report import write_report
from loadtests.scenarios.common import (fmt, gateway_config, logs_dir, md_table, start_gateway, start_upstream,
                                        upstream_backend)
from loadtests.stats import percentiles

MODEL = "bench"
WORDS = ("the cat sat on a mat while it rained over hills and rivers near old towns where people "
         "read books about ships stars trains music gardens and the history of small machines").split()
AGGREGATORS = {"cheap": {"ttft": 0.9, "input": 0.27, "output": 1.10},
               "fast": {"ttft": 0.3, "input": 0.60, "output": 2.00}}
LOCAL_PRICES = {"input": 0.02, "output": 0.02}
PRICES = {"local": LOCAL_PRICES, **AGGREGATORS}   # backend -> USD per million tokens (input, output)
# the threshold rule's settings a sweep runs: queue depth (local.waiting > N), KV-cache usage (local.kv_usage >= P %)
SLO_MS = 2500.0   # the TTFT SLO a run uses unless --slo-ms
SWEEP_POLICIES = ("waiting>1", "waiting>2", "waiting>4", "waiting>8", "waiting>16", "waiting>32",
                  "kv>=30", "kv>=50", "kv>=70", "slo")


def register(sub) -> None:
    p = sub.add_parser("spill", help="spill to aggregators: local only vs threshold vs TTFT SLO",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help=".gguf or HF directory (default: the embedded SmolLM2)")
    p.add_argument("--slo-ms", type=float, default=None, help=f"the TTFT SLO, milliseconds (default {SLO_MS:g})")
    p.add_argument("--duration", "--duration-s", dest="duration", type=float, default=None,
                   help="seconds of arrivals per policy (ramp up and down; default 60, with --sweep 180)")
    p.add_argument("--low", type=float, default=0.3, help="arrival rate at start and end, x capacity")
    p.add_argument("--high", type=float, default=3.0, help="arrival rate at the peak, x capacity")
    p.add_argument("--max-tokens", type=int, default=16, help="completion tokens per request")
    p.add_argument("--policies", default=None,
                   help="comma-separated: local, slo, threshold (config.example.yaml's rule), waiting>N (local.waiting"
                        " > N), kv>=P (local.kv_usage >= P %%); default local,threshold,slo, with --sweep "
                        + ",".join(SWEEP_POLICIES))
    p.add_argument("--sweep", action="store_true",
                   help="the threshold rule at each setting, the SLO route and the offline oracle: attainment vs "
                        "cost (loadtests/scenarios/spill_sweep.py; attainment_vs_cost.png, summary.md)")
    p.add_argument("--from-results", default=None, metavar="RESULTS_JSON",
                   help="with --sweep: serve nothing; recompute the oracle, verdict, plot and summary from an earlier "
                        "sweep's results.json (into --out)")
    p.add_argument("--capacity", type=float, default=None,
                   help="the engine's capacity, requests/s, that the arrivals scale with (default: measured)")
    p.add_argument("--seed", type=int, default=None, help="seeds the arrivals and prompts (default 0)")
    p.add_argument("--out", default="loadtest-results/spill", help="output directory (results.json, summary.md)")
    p.set_defaults(func=run)


# ------------------------------------------------------------------ workload
@dataclass
class Arrival:
    """One request: when it is sent (seconds from the start), its chat messages, its conversation."""

    at: float
    messages: list[dict]
    conversation: int

    @property
    def turn(self) -> int:
        """Which turn of its conversation this request is (1: the first), from its user messages."""
        return sum(m["role"] == "user" for m in self.messages)


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def ramp_rate(t: float, duration: float, low: float, high: float) -> float:
    """Arrival rate (x capacity) at ``t``: linear from ``low`` to ``high`` at mid-run and back to ``low``."""
    x = min(max(t / duration, 0.0), 1.0)
    return low + (high - low) * (1.0 - abs(2.0 * x - 1.0))


def arrivals(capacity: float, duration: float, low: float, high: float, seed: int) -> list[Arrival]:
    """Poisson arrivals of rate ``ramp_rate * capacity`` (requests/s) by thinning; each either starts a
    conversation (a system prompt of 60-600 words and a question) or continues an open one (the turns so far, a
    canned answer, a new question)."""
    rng = random.Random(seed)
    peak = max(low, high) * capacity
    convs: list[list[dict]] = []
    out: list[Arrival] = []
    t = 0.0
    while True:
        t += rng.expovariate(peak)
        if t >= duration:
            return out
        if rng.random() > ramp_rate(t, duration, low, high) * capacity / peak:
            continue
        if convs and rng.random() < 0.5:
            i = rng.randrange(len(convs))
            convs[i] += [{"role": "assistant", "content": _text(rng, 12)}, {"role": "user", "content": _text(rng, 15)}]
        else:
            convs.append([{"role": "system", "content": _text(rng, rng.choice([60, 150, 300, 600]))},
                          {"role": "user", "content": _text(rng, 20)}])
            i = len(convs) - 1
        out.append(Arrival(t, [dict(m) for m in convs[i]], i))


# ------------------------------------------------------------------ one request
@dataclass
class Outcome:
    ok: bool
    ttft: float | None = None
    backend: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    predicted_local: float | None = None
    predicted_engine: float | None = None
    at: float = 0.0
    explain: str = ""
    turn: int = 1
    attempts: int = 1
    cached_tokens: int = 0   # of the prompt, the backend's prefix cache held (usage.prompt_tokens_details)


# "local predicted 1.20 s <= SLO 2.5 s at ... USD [1.00 s (...) x 1.20 (p90 ...)]": the gateway's figure (the
# engine's own, corrected by what the engine delivered lately), then the engine's own.
_PREDICTED = re.compile(r"(?:^|; )local predicted ([0-9.]+) s[^\[;]*(?:\[([0-9.]+) s \()?")


async def one(session: aiohttp.ClientSession, url: str, a: Arrival, max_tokens: int) -> Outcome:
    """Send ``a`` streamed (usage asked for); its TTFT (first content chunk), backend, usage, local prediction."""
    body = {"model": MODEL, "messages": a.messages, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    out = Outcome(False)
    try:
        async with session.post(url + "/v1/chat/completions", json=body) as r:
            out.backend = r.headers.get("x-tandem-backend", "")
            m = _PREDICTED.search(r.headers.get("x-tandem-slo", ""))
            out.predicted_local = float(m.group(1)) if m else None
            out.predicted_engine = float(m.group(2)) if m and m.group(2) else None
            out.explain = r.headers.get("x-tandem-slo", "")
            out.attempts = int(r.headers.get("x-tandem-attempts") or 1)
            if r.status != 200:
                return out
            async for line in r.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                ev = msgspec.json.decode(line[6:])
                if out.ttft is None and any((c.get("delta") or {}).get("content") for c in ev.get("choices") or ()):
                    out.ttft = time.perf_counter() - start
                if ev.get("usage"):
                    out.prompt_tokens = ev["usage"].get("prompt_tokens", 0)
                    out.completion_tokens = ev["usage"].get("completion_tokens", 0)
                    out.cached_tokens = int((ev["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
                                            or 0)
            out.ok = out.ttft is not None
    except (aiohttp.ClientError, asyncio.TimeoutError):
        pass
    return out


async def drive(url: str, schedule: list[Arrival], max_tokens: int) -> list[Outcome]:
    """Send every arrival at its time (open loop); their outcomes in order."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=300)) as session:
        t0 = time.perf_counter()

        async def at(a: Arrival) -> Outcome:
            await asyncio.sleep(max(0.0, t0 + a.at - time.perf_counter()))
            o = await one(session, url, a, max_tokens)
            o.at, o.turn = a.at, a.turn
            return o

        return list(await asyncio.gather(*(at(a) for a in schedule)))


# ------------------------------------------------------------------ analysis
def analyse(outcomes: list[Outcome], slo_s: float, prices: dict[str, dict]) -> dict:
    """Figures of one policy's run (see the module docstring)."""
    n = len(outcomes)
    met = sum(o.ok and o.ttft <= slo_s for o in outcomes)
    cost = sum(request_cost(prices, o.backend, o.prompt_tokens, o.completion_tokens) for o in outcomes)
    upstream = sum(o.backend not in ("", "none", "local") for o in outcomes)   # "none": refused, nothing called
    # sent to the engine, withdrawn by it at the hand-over's checkpoint, answered upstream
    handed = sum(o.backend not in ("", "none", "local") and o.attempts > 1 and "hand over" in o.explain
                 for o in outcomes)
    pairs = [(o.predicted_local, o.ttft) for o in outcomes
             if o.ok and o.backend == "local" and o.predicted_local is not None]
    errors = [abs(p - m) / m for p, m in pairs]
    engine = percentiles(abs(o.predicted_engine - o.ttft) / o.ttft for o in outcomes
                         if o.ok and o.backend == "local" and o.predicted_engine is not None) or {}
    err = percentiles(errors) or {}
    ttft = percentiles(o.ttft for o in outcomes if o.ok) or {}
    return {"requests": n, "failed": sum(not o.ok for o in outcomes),
            "slo_met_pct": 100.0 * met / n if n else None, "usd_per_1000": 1000.0 * cost / n if n else None,
            "upstream_share_pct": 100.0 * upstream / n if n else None,
            "handed_over_pct": 100.0 * handed / n if n else None,
            "prediction_error_p50_pct": 100 * err["p50"] if err else None,
            "prediction_error_p90_pct": 100 * err["p90"] if err else None, "predictions": len(errors),
            "engine_prediction_error_p50_pct": 100 * engine["p50"] if engine else None,
            "engine_prediction_error_p90_pct": 100 * engine["p90"] if engine else None,
            "ttft_p50_s": ttft.get("p50"), "ttft_p99_s": ttft.get("p99"),
            "local_predicted_vs_measured_s": [[round(p, 3), round(m, 3)] for p, m in pairs],
            # per request: sent at (s), backend, TTFT (s), predicted (gateway's, engine's own), prompt tokens,
            # turn in its conversation, x-tandem-slo, completion tokens, prompt tokens the prefix cache held
            "requests_log": [[round(o.at, 3), o.backend, o.ttft and round(o.ttft, 3), o.predicted_local,
                              o.predicted_engine, o.prompt_tokens, o.turn, o.explain, o.completion_tokens,
                              o.cached_tokens]
                             for o in outcomes]}


def request_cost(prices: dict[str, dict], backend: str, prompt_tokens: int, completion_tokens: int) -> float:
    """USD of one request: its usage at ``backend``'s prices (USD per million tokens, ``input``/``output``; a
    backend without prices, or none, costs nothing)."""
    p = prices.get(backend, {})
    return (prompt_tokens * p.get("input", 0) + completion_tokens * p.get("output", 0)) / 1e6


def fluid_upstream_share(schedule: list[Arrival], capacity: float, slo_s: float) -> float:
    """% of ``schedule`` a policy must send upstream to meet ``slo_s`` if the engine served ``capacity``
    requests/s first come first served (a request's TTFT: the work queued ahead, in seconds, plus its own
    1 / capacity): a reference for the upstream share (hence the cost) that meeting the SLO takes; a rule that
    queues more serves more locally, late."""
    backlog, last, sent = 0.0, 0.0, 0
    for a in schedule:
        backlog = max(backlog - (a.at - last), 0.0)
        last = a.at
        if backlog + 1.0 / capacity <= slo_s:
            backlog += 1.0 / capacity
        else:
            sent += 1
    return 100.0 * sent / len(schedule) if schedule else 0.0


# ------------------------------------------------------------------ the run
def _config(path: Path, policy: str, ports: dict[str, int], model: str | None, slo_ms: float) -> Path:
    engine = {"served_model_name": MODEL, "max_model_len": 2048, "max_num_seqs": 8, "kv_cache_memory": "256MiB"}
    if model:
        engine["model"] = model
    backends = {"local": {"type": "local", "engine": engine, "prices": dict(LOCAL_PRICES)}}
    for name, port in ports.items():
        b = upstream_backend(port, MODEL)
        b["prices"] = {"input": AGGREGATORS[name]["input"], "output": AGGREGATORS[name]["output"]}
        backends[name] = b
    match = threshold_match(policy)
    aggs = [{"backend": "cheap"}, {"backend": "fast"}]
    routes = {"local": {"targets": [{"backend": "local"}]},
              "aggregator": {"targets": aggs, "select": "cheapest"}}
    if policy == "slo":
        routes["local"] = {"targets": [{"backend": "local"}, *aggs], "slo": {"ttft_ms": slo_ms}}
    elif policy == "local" or match is not None:
        # local only, or the threshold rule's local route: the SLO (one target) only makes the engine's
        # prediction visible (x-tandem-slo), so every run's local requests measure it
        routes["local"]["slo"] = {"ttft_ms": slo_ms}
    path = gateway_config(path, backends, routes, "local", MODEL)
    if match is not None:
        import yaml
        cfg = yaml.safe_load(path.read_text())
        cfg["policy"]["rules"] = [{"name": "spill-over", "route": "aggregator", "match": match}]
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def threshold_match(policy: str) -> dict | None:
    """The spill-over rule's ``match`` for a threshold ``policy``: ``threshold`` (config.example.yaml's rule:
    ``local.waiting > 32`` or ``local.kv_usage >= 90``), ``waiting>N`` (``local.waiting > N``, requests queued
    in the engine beyond its seats), ``kv>=P`` (``local.kv_usage >= P``, percent of KV blocks held); None for
    ``local``, ``slo`` and ``capacity`` (no rule)."""
    if policy in ("local", "slo", "capacity"):
        return None
    if policy == "threshold":
        return {"any": [{"local.waiting": {"gt": 32}}, {"local.kv_usage": {"gte": 90}}]}
    m = re.fullmatch(r"(waiting>|kv>=)([0-9]+(?:\.[0-9]+)?)", policy)
    if not m:
        raise ValueError(f"unknown spill policy {policy!r}: local, slo, threshold, waiting>N or kv>=P")
    if m.group(1) == "kv>=" and not 0 < float(m.group(2)) <= 100:
        raise ValueError(f"spill policy {policy!r}: kv>=P takes a percent of KV blocks, 0 < P <= 100")
    if m.group(1) == "waiting>":
        return {"local.waiting": {"gt": int(m.group(2))}}
    return {"local.kv_usage": {"gte": float(m.group(2))}}


def with_defaults(args: argparse.Namespace, duration: float, policies: tuple[str, ...]) -> list[str]:
    """Fill the arguments a run left unset (--duration-s: ``duration``, --slo-ms: :data:`SLO_MS`, --seed: 0;
    they default to None so that ``--sweep --from-results`` can refuse them) and return its policies
    (:func:`parse_policies`, ``policies`` when not given)."""
    args.duration = duration if args.duration is None else args.duration
    args.slo_ms = SLO_MS if args.slo_ms is None else args.slo_ms
    args.seed = 0 if args.seed is None else args.seed
    return parse_policies(args.policies, policies)


def parse_policies(text: str | None, default: tuple[str, ...]) -> list[str]:
    """``--policies``' comma-separated names (``default`` when not given), each checked before anything starts:
    a name :func:`threshold_match` does not know, an empty one or a repeated one ends the command with a
    message."""
    if text is None:
        return list(default)
    names = [n.strip() for n in text.split(",")]
    for n in names:
        if not n:
            raise SystemExit(f"--policies {text!r}: an empty name (names are separated by commas)")
        try:
            threshold_match(n)
        except ValueError as e:
            raise SystemExit(f"--policies: {e}") from None
    if len(set(names)) < len(names):
        raise SystemExit(f"--policies {text!r}: a policy named twice")
    return names


def _warm_up(url: str, max_tokens: int, seed: int) -> None:
    """8 requests one after the other: the engine's step costs are measured before the run."""
    for a in arrivals(1.0, 40.0, 1.0, 1.0, seed + 2)[:8]:
        asyncio.run(drive(url, [Arrival(0.0, a.messages, a.conversation)], max_tokens))


def _capacity(url: str, max_tokens: int, seed: int) -> float:
    """Requests/s the engine completes when 20 of this workload's requests arrive at once (it runs
    ``max_num_seqs`` of them at a time), after the warm-up. On a gateway of its own: a burst decided before
    the engine counts it would skew the SLO gateway's correction of the engine's predictions."""
    _warm_up(url, max_tokens, seed)
    sample = [Arrival(0.0, a.messages, a.conversation) for a in arrivals(1.0, 40.0, 1.0, 1.0, seed + 1)[:20]]
    t = time.perf_counter()
    res = asyncio.run(drive(url, sample, max_tokens))
    return len(res) / (time.perf_counter() - t)


def serve_policies(args: argparse.Namespace, policies: list[str]) -> tuple[float, list[Arrival], dict[str, dict]]:
    """The scenario's servers and runs: the two aggregators, the engine's capacity (measured unless
    ``args.capacity``), the arrivals (the same for every policy), then each policy on a gateway of its own.

    Returns:
        (capacity in requests/s, the arrivals, policy -> :func:`analyse` figures).
    """
    logs = logs_dir(args.out)
    ups = {name: start_upstream(name, logs, "--ttft", str(a["ttft"])) for name, a in AGGREGATORS.items()}
    figures: dict[str, dict] = {}
    try:
        ports = {n: int(s.base_url.rsplit(":", 1)[1]) for n, s in ups.items()}
        capacity = args.capacity
        if capacity is None:
            gw, _ = start_gateway(_config(logs / "capacity.yaml", "capacity", ports, args.model, args.slo_ms), logs,
                                  timeout=600)
            try:
                capacity = _capacity(gw.base_url, args.max_tokens, args.seed)
            finally:
                gw.stop()
        schedule = arrivals(capacity, args.duration, args.low, args.high, args.seed)   # the same for every policy
        for policy in policies:
            config = _config(logs / (re.sub(r"[^a-z0-9]+", "-", policy) + ".yaml"), policy, ports, args.model,
                             args.slo_ms)
            gw, _ = start_gateway(config, logs, timeout=600)
            try:
                _warm_up(gw.base_url, args.max_tokens, args.seed)
                load = os.getloadavg()[0]
                print(f"{policy}: capacity {capacity:.2f} req/s, {len(schedule)} arrivals over {args.duration:g} s",
                      flush=True)
                figures[policy] = analyse(asyncio.run(drive(gw.base_url, schedule, args.max_tokens)),
                                          args.slo_ms / 1000.0, PRICES)
                figures[policy]["load_average_1m"] = [load, os.getloadavg()[0]]
            finally:
                gw.stop()
    finally:
        for u in ups.values():
            u.stop()
    return capacity, schedule, figures


def scenario_note(args: argparse.Namespace, capacity: float, schedule: list[Arrival]) -> str:
    """The run's setting in a sentence: capacity, arrivals, prices, the fluid upstream share."""
    return (f"capacity {fmt(capacity, '.2f')} req/s ({'given' if args.capacity else 'measured, local only'}); "
            f"{len(schedule)} arrivals {args.low:g}x -> {args.high:g}x -> {args.low:g}x over {args.duration:g} s "
            f"(seed {args.seed}); SLO TTFT {args.slo_ms:g} ms; aggregators: "
            + ", ".join(f"{n} TTFT {a['ttft']:g} s at {a['input']:g}/{a['output']:g} USD/M" for n, a in
                        AGGREGATORS.items()) + f"; local {LOCAL_PRICES['input']:g}/{LOCAL_PRICES['output']:g} USD/M"
            + f"; a rough reference: an engine serving every request at {fmt(capacity, '.2f')} req/s (the capacity "
            f"burst's rate: first turns, nothing cached) in arrival order would need "
            f"{fluid_upstream_share(schedule, capacity, args.slo_ms / 1000.0):.1f} % upstream to meet the SLO "
            f"(cached follow-up turns cost the engine less)")


def run(args: argparse.Namespace) -> int:
    if args.sweep:
        from loadtests.scenarios.spill_sweep import run_sweep
        return run_sweep(args)
    if args.from_results:
        raise SystemExit("--from-results recomputes a sweep: add --sweep")
    policies = with_defaults(args, 60.0, ("local", "threshold", "slo"))
    capacity, schedule, figures = serve_policies(args, policies)
    rows = [[p, f["requests"], f["failed"], fmt(f["slo_met_pct"], ".1f"), fmt(f["usd_per_1000"], ".4f"),
             fmt(f["upstream_share_pct"], ".1f"), fmt(f["handed_over_pct"], ".1f"),
             fmt(f["prediction_error_p50_pct"], ".0f"),
             fmt(f["prediction_error_p90_pct"], ".0f"), fmt(f["engine_prediction_error_p50_pct"], ".0f"),
             fmt(f["engine_prediction_error_p90_pct"], ".0f"), fmt(f["ttft_p50_s"], ".2f"), fmt(f["ttft_p99_s"], ".2f")]
            for p, f in figures.items()]
    table = md_table(["policy", "requests", "failed", f"TTFT <= {args.slo_ms:g} ms %", "USD / 1,000",
                      "upstream %", "handed over %", "pred. err p50 %", "pred. err p90 %", "engine's own err p50 %",
                      "engine's own err p90 %", "TTFT p50 s", "TTFT p99 s"], rows)
    note = scenario_note(args, capacity, schedule)
    write_report(Path(args.out), "Spill to aggregators by predicted TTFT", [],
                 {"figures": figures, "capacity_rps": capacity, "slo_ms": args.slo_ms,
                  "fluid_upstream_share_pct": fluid_upstream_share(schedule, capacity, args.slo_ms / 1000.0)},
                 table + "\n\n" + note)
    print(table + "\n\n" + note)
    return 0
