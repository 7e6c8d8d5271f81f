"""SLO routing over engine replicas with different loads (issue 55): does the route pick a replica that meets
the SLO whenever one does?

Two ``tandem engine serve`` replicas of one model (``r0``, ``r1``: the embedded SmolLM2 unless ``--model``,
``--num-threads`` each, ``predicts_ttft: true``, the same local price) and a fake aggregator (``cheap``: TTFT
0.9 s, dearer) behind one ``tandem serve`` whose route is ``slo: {ttft_ms}`` over [r0, r1, cheap]. Four phases of
``--phase-s`` each: r0 busy, r1 busy, both busy, neither. A busy replica is held by ``--busy`` streams sent to it
directly (more than its ``max_num_seqs`` seats, so new requests queue there: another gateway's traffic, as the
gateway sees it only through the replica's own ``/v1/ttft``). Meanwhile open-loop Poisson requests (``--rate``
per second, ``--words`` random words each, so no prefix is shared) go through the gateway, and every
``--probe-interval-s`` a probe of the same shape goes to each replica directly: the replicas' measured TTFT over
time.

Judged per gateway request (``judge``): the replicas that met the SLO at its send time are those whose probe
nearest in time did; a request sent to a replica is **right** when that replica met the SLO for it (its own
measured TTFT), or none did at that time (then it was due upstream: counted as a miss of the SLO route too);
sent upstream, it is **right** when no replica met it, else a **missed saving**. The issue's check: the share of
requests that went to a replica meeting the SLO among those for which one did.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from loadtests.report import write_report
from loadtests.scenarios.common import (fmt, gateway_config, logs_dir, md_table, spawn_engine_server, start_gateway,
                                        start_upstream, upstream_backend)
from loadtests.scenarios.spill import AGGREGATORS, LOCAL_PRICES, MODEL, WORDS, Arrival, Outcome, one, request_cost

REPLICAS = ("r0", "r1")
PHASES = (("r0 busy", ("r0",)), ("r1 busy", ("r1",)), ("both busy", REPLICAS), ("neither busy", ()))
MAX_NUM_SEQS = 4


def register(sub) -> None:
    p = sub.add_parser("slo-replicas", help="an SLO route over two engine replicas with different loads",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help=".gguf or HF directory (default: the embedded SmolLM2)")
    p.add_argument("--slo-ms", type=float, default=2000.0, help="the TTFT SLO, milliseconds")
    p.add_argument("--phase-s", type=float, default=30.0, help="seconds of each of the four phases")
    p.add_argument("--rate", type=float, default=0.5, help="gateway requests per second")
    p.add_argument("--words", type=int, default=60, help="random words per gateway request and probe")
    p.add_argument("--busy", type=int, default=MAX_NUM_SEQS + 6,
                   help=f"streams held on a busy replica (its seats: {MAX_NUM_SEQS})")
    p.add_argument("--busy-words", type=int, default=200, help="words per busy stream's prompt")
    p.add_argument("--busy-tokens", type=int, default=96, help="tokens each busy stream generates")
    p.add_argument("--max-tokens", type=int, default=8, help="completion tokens per gateway request and probe")
    p.add_argument("--probe-interval-s", type=float, default=1.0, help="seconds between probes of each replica")
    p.add_argument("--num-threads", type=int, default=1, help="CPU threads of each replica")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts, arrivals and busy streams")
    p.add_argument("--out", default="loadtest-results/slo-replicas", help="report directory")
    p.set_defaults(func=run)


@dataclass
class Probe:
    """One direct request to a replica: which, when sent (seconds from the run's start), its TTFT (None:
    failed)."""

    replica: str
    at: float
    ttft: float | None


@dataclass
class Sent:
    """One gateway request: its phase and outcome (``Outcome.at``: when it was sent)."""

    phase: str
    outcome: Outcome


def met_at(probes: list[Probe], replica: str, at: float, slo_s: float) -> bool:
    """Whether ``replica`` met the SLO at ``at``: its probe sent nearest in time did (False without probes)."""
    mine = [p for p in probes if p.replica == replica]
    if not mine:
        return False
    near = min(mine, key=lambda p: abs(p.at - at))
    return near.ttft is not None and near.ttft <= slo_s


def judge(sent: list[Sent], probes: list[Probe], slo_s: float, prices: dict[str, dict]) -> dict[str, dict]:
    """phase (and "all") -> ``{"requests", "to": {backend: n}, "slo_met_pct", "usd_per_1000", "a_replica_met",
    "right_replica", "right_replica_pct", "missed_saving", "wrong"}``: ``a_replica_met`` counts requests for which
    some replica met the SLO at their send time (``met_at``), ``right_replica`` those of them sent to a replica
    that met it (its own TTFT), ``missed_saving`` those of them sent upstream; ``wrong`` lists the requests judged
    wrong (phase, send time, backend, TTFT, which replicas met)."""
    out: dict[str, dict] = {}
    for s in sent:
        o = s.outcome
        for key in (s.phase, "all"):
            f = out.setdefault(key, {"requests": 0, "to": {}, "met": 0, "usd": 0.0, "a_replica_met": 0,
                                     "right_replica": 0, "missed_saving": 0, "wrong": []})
            f["requests"] += 1
            f["to"][o.backend or "failed"] = f["to"].get(o.backend or "failed", 0) + 1
            f["met"] += bool(o.ok and o.ttft <= slo_s)
            f["usd"] += request_cost(prices, o.backend, o.prompt_tokens, o.completion_tokens)
            able = [r for r in REPLICAS if met_at(probes, r, o.at, slo_s)]
            if not able:
                continue
            f["a_replica_met"] += 1
            if o.backend in REPLICAS and o.ok and o.ttft <= slo_s:
                f["right_replica"] += 1
                continue
            f["missed_saving"] += o.backend not in REPLICAS
            if key == "all":
                f["wrong"].append({"phase": s.phase, "at_s": round(o.at, 2), "backend": o.backend,
                                   "ttft_s": None if o.ttft is None else round(o.ttft, 3), "replicas_met": able})
    for f in out.values():
        f["slo_met_pct"] = 100.0 * f.pop("met") / f["requests"]
        f["usd_per_1000"] = 1000.0 * f.pop("usd") / f["requests"]
        f["right_replica_pct"] = 100.0 * f["right_replica"] / f["a_replica_met"] if f["a_replica_met"] else None
    return out


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


async def _direct(session: aiohttp.ClientSession, url: str, text: str, max_tokens: int) -> float | None:
    """A streamed request straight to a replica; its TTFT (first content chunk), None when it failed."""
    a = Arrival(0.0, [{"role": "user", "content": text}], 0)
    o = await one(session, url, a, max_tokens)
    return o.ttft if o.ok else None


async def _hold(session, url: str, rng: random.Random, args, until: float) -> None:
    """One busy stream after another on replica ``url`` until ``until`` (perf_counter seconds)."""
    while time.perf_counter() < until:
        await _direct(session, url, _text(rng, args.busy_words), args.busy_tokens)


async def _probe(session, urls: dict[str, str], rng: random.Random, args, t0: float, until: float,
                 probes: list[Probe]) -> None:
    async def once(name: str, url: str) -> None:
        at = time.perf_counter() - t0
        probes.append(Probe(name, at, await _direct(session, url, _text(rng, args.words), args.max_tokens)))

    pending = set()
    while time.perf_counter() < until:
        pending |= {asyncio.create_task(once(n, u)) for n, u in urls.items()}
        await asyncio.sleep(args.probe_interval_s)
    await asyncio.gather(*pending)


async def drive(gateway: str, urls: dict[str, str], args) -> tuple[list[Sent], list[Probe]]:
    """The four phases; every gateway request and probe."""
    rng = random.Random(args.seed)
    sent: list[Sent] = []
    probes: list[Probe] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=600)) as session:
        t0 = time.perf_counter()
        for phase, busy in PHASES:
            until = time.perf_counter() + args.phase_s
            tasks = [asyncio.create_task(_hold(session, urls[r], random.Random(rng.random()), args, until))
                     for r in busy for _ in range(args.busy)]
            tasks.append(asyncio.create_task(_probe(session, urls, random.Random(rng.random()), args, t0, until,
                                                    probes)))
            requests = []
            next_at = time.perf_counter() + rng.expovariate(args.rate)
            while next_at < until:
                await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
                a = Arrival(time.perf_counter() - t0, [{"role": "user", "content": _text(rng, args.words)}], 0)
                requests.append((phase, a.at, asyncio.create_task(one(session, gateway, a, args.max_tokens))))
                next_at += rng.expovariate(args.rate)
            await asyncio.gather(*tasks)
            for name, at, task in requests:
                o = await task
                o.at = at
                sent.append(Sent(name, o))
            print(f"{phase}: {len(requests)} requests through the gateway", flush=True)
    return sent, probes


def _servers(args, logs: Path):
    """The two replicas (loaded at once) and the aggregator."""
    engine = ["--served-model-name", MODEL, "--max-model-len", "2048", "--max-num-seqs", str(MAX_NUM_SEQS),
              "--kv-cache-memory", "256MiB", "--num-threads", str(args.num_threads)]
    if args.model:
        engine = ["--model", args.model, *engine]
    reps = {r: spawn_engine_server(logs, engine, name=r) for r in REPLICAS}
    for s in reps.values():
        s.wait_ready(600)
    agg = start_upstream("cheap", logs, "--ttft", str(AGGREGATORS["cheap"]["ttft"]))
    return reps, agg


def _config(path: Path, reps: dict, agg, slo_ms: float) -> Path:
    backends = {r: {"type": "openai", "base_url": f"{s.base_url}/v1", "models": {MODEL: MODEL},
                    "max_model_len": 2048, "predicts_ttft": True, "prices": dict(LOCAL_PRICES),
                    "timeouts": {"connect_s": 2, "read_s": 120, "first_token_s": 60}} for r, s in reps.items()}
    cheap = upstream_backend(int(agg.base_url.rsplit(":", 1)[1]), MODEL)
    cheap["prices"] = {"input": AGGREGATORS["cheap"]["input"], "output": AGGREGATORS["cheap"]["output"]}
    backends["cheap"] = cheap
    routes = {"main": {"targets": [{"backend": r} for r in (*REPLICAS, "cheap")], "slo": {"ttft_ms": slo_ms}}}
    return gateway_config(path, backends, routes, "main", MODEL)


def run(args: argparse.Namespace) -> int:
    logs = logs_dir(args.out)
    reps, agg = _servers(args, logs)
    gw = None
    try:
        gw, _ = start_gateway(_config(logs / "gateway.yaml", reps, agg, args.slo_ms), logs, timeout=120)
        urls = {r: s.base_url for r, s in reps.items()}
        for url in urls.values():    # each replica's step costs measured before the run
            asyncio.run(_warm(url, random.Random(args.seed), args))
        sent, probes = asyncio.run(drive(gw.base_url, urls, args))
    finally:
        if gw is not None:
            gw.stop()
        for s in (*reps.values(), agg):
            s.stop()
    prices = {**{r: LOCAL_PRICES for r in REPLICAS}, "cheap": AGGREGATORS["cheap"]}
    figures = judge(sent, probes, args.slo_ms / 1000.0, prices)
    rows = [[k, f["requests"], ", ".join(f"{b} {n}" for b, n in sorted(f["to"].items())), fmt(f["slo_met_pct"], ".1f"),
             fmt(f["usd_per_1000"], ".4f"), f["a_replica_met"], f["right_replica"], fmt(f["right_replica_pct"], ".1f"),
             f["missed_saving"]] for k, f in sorted(figures.items(), key=lambda kv: kv[0] == "all")]
    table = md_table(["phase", "requests", "sent to", f"TTFT <= {args.slo_ms:g} ms %", "USD / 1,000",
                      "a replica met it", "sent to one that did", "%", "upstream although one met"], rows)
    note = (f"{len(probes)} probes ({sum(p.ttft is not None and p.ttft <= args.slo_ms / 1000 for p in probes)} "
            f"met the SLO); busy: {args.busy} streams of {args.busy_words} words x {args.busy_tokens} tokens on "
            f"{MAX_NUM_SEQS} seats; {args.rate:g} req/s of {args.words} words; {args.phase_s:g} s a phase")
    write_report(Path(args.out), "SLO route over two engine replicas", [],
                 {"figures": figures, "slo_ms": args.slo_ms, "probes": [vars(p) for p in probes],
                  "requests": [{"phase": s.phase, "at_s": round(s.outcome.at, 3), "backend": s.outcome.backend,
                                "ttft_s": s.outcome.ttft, "x_tandem_slo": s.outcome.explain} for s in sent]},
                 table + "\n\n" + note)
    print(table + "\n\n" + note)
    for w in figures.get("all", {}).get("wrong", []):
        print("judged wrong:", w)
    return 0


async def _warm(url: str, rng: random.Random, args) -> None:
    """Four requests one after the other, of the busy streams' and the probes' shapes."""
    async with aiohttp.ClientSession() as session:
        for words in (args.busy_words, args.words, args.busy_words, args.words):
            await _direct(session, url, _text(rng, words), args.max_tokens)
