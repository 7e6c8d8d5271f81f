"""``python -m loadtests.bench.ttft_accuracy``: how far is the engine's TTFT prediction from the TTFT it delivers?

Issue 49's target for ``/v1/ttft``: on a mixed workload (prompts of 10 to 6,000 tokens, embeddings, decoding
rows), the absolute relative error |predicted - measured| / measured at most 20 % at the median and 50 % at p90,
measured against the real TTFT in the same run.

The real engine (the embedded SmolLM2, its core in its own process, as ``tandem engine serve`` runs it) serves
``--users`` generation clients and ``--embed-users`` embedding clients, each seeded: a client thinks (an
exponential pause of mean ``--think-s``, ``--embed-think-s``), sends its next request and waits for its end, then
thinks again (a closed loop, so the queue stays within what the host can serve whatever its speed: on a shared
host an open-loop rate the host keeps up with when quiet builds a queue of minutes when it is not). An embedding
has 500 to 4,000 token ids; a generation's prompt length is log-uniform in [``--min-prompt``, ``--max-prompt``]
tokens, its ``max_tokens`` short (8 to 32) or, for ``--long-decode-share`` of them, long (64 to 160: rows that
decode beside the prefills); greedy, ``ignore_eos``. Just before each generation is sent, the engine's prediction
is asked with the very inputs ``POST /v1/ttft`` passes (``AsyncEngine.predict_ttft(token ids, priority)``; the
endpoint adds only validation); its TTFT is from then to its first token. The first ``--warmup`` generations are
not counted (the step-cost calibration starts from a guess).

Prints one JSON object: the error percentiles (p50, p90 and the signed median: > 0 is over-predicted), the
machine's load average before and after (the box is shared: other processes slow the steps), and each
request's prediction and TTFT. Also the same percentiles with each prediction scaled by how much slower or faster
the host ran the request's wait than when it was predicted (the engine's published speed, sampled every 0.25 s):
what no prediction from the engine's state can know, set apart from the model's own error. ``--output-json``
writes it too; ``--log-dir`` records the run's steps and predictions for ``loadtests/bench/ttft_replay.py``,
which replays calibrations on them (a same-run comparison: on a shared host two runs compare the host's load).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time

from engine.async_engine import AsyncEngine
from engine.config import EngineArgs
from engine.core import ttft_log
from engine.sampling_params import SamplingParams


def draw_generation(rng: random.Random, long_share: float, min_prompt: int, max_prompt: int) -> dict:
    """One generation: {"ids": token ids, "max_tokens": int}. Token ids are drawn in SmolLM2's ordinary-text
    range (exactly that many tokens, no tokenizer)."""
    length = round(math.exp(rng.uniform(math.log(min_prompt), math.log(max_prompt))))
    max_tokens = rng.randint(64, 160) if rng.random() < long_share else rng.randint(8, 32)
    return {"ids": [rng.randrange(300, 40000) for _ in range(length)], "max_tokens": max_tokens}


class SpeedLog:
    """The engine's published speed (``TTFTState.speed``: its recent steps' seconds over its fitted shape's) every
    ``period_s``: how much slower or faster the shared host ran a request's wait than when it was predicted."""

    def __init__(self, engine: AsyncEngine, period_s: float = 0.25) -> None:
        self.engine, self.period_s = engine, period_s
        self.samples: list[tuple[float, float]] = []   # (monotonic seconds, speed)

    def now(self) -> float:
        state = self.engine.get_stats().ttft
        return state.speed if state is not None else 1.0

    async def run(self) -> None:
        while True:
            self.samples.append((time.monotonic(), self.now()))
            await asyncio.sleep(self.period_s)

    def mean(self, t0: float, t1: float) -> float:
        """The time-weighted mean speed over [t0, t1] (the samples in it; the one at t0 when none)."""
        inside = [v for t, v in self.samples if t0 <= t <= t1]
        return sum(inside) / len(inside) if inside else self.now()


async def _generate(engine: AsyncEngine, rid: str, item: dict, speeds: SpeedLog) -> dict:
    """Predict, send, and time the first token: (prompt tokens, max_tokens, predicted s, measured s, the speed
    when predicted and over the wait)."""
    params = SamplingParams(max_tokens=item["max_tokens"], temperature=0.0, ignore_eos=True)
    t0 = time.monotonic()
    p = engine.predict_ttft(item["ids"])
    speed_at = speeds.now()
    first = None
    async for out in engine.generate(item["ids"], params, rid):
        if first is None and any(c.token_ids for c in out.outputs):
            first = time.monotonic() - t0
    return {"id": rid, "prompt": len(item["ids"]), "max_tokens": item["max_tokens"],
            "predicted_s": None if p is None else round(p.seconds, 4), "measured_s": round(first, 4),
            "speed_at": round(speed_at, 3), "speed_during": round(speeds.mean(t0, t0 + first), 3),
            "explained": None if p is None else p.describe()}


async def _embed(engine: AsyncEngine, ids: list[int]) -> dict:
    t0 = time.monotonic()
    await engine.embed([ids])
    return {"embed": len(ids), "seconds": round(time.monotonic() - t0, 3)}


async def run_clients(engine: AsyncEngine, args: argparse.Namespace) -> list[dict]:
    """``args.users`` generation clients and ``args.embed_users`` embedding clients, each in a closed loop,
    until ``args.warmup + args.requests`` generations have been sent or ``args.max_wall_s`` have passed; every
    request's record (the first ``args.warmup`` generations marked ``warmup``), each also printed to stderr as it
    ends."""
    records: list[dict] = []
    sent = 0
    speeds = SpeedLog(engine)
    sampler = asyncio.create_task(speeds.run())
    deadline = time.monotonic() + args.max_wall_s

    def going() -> bool:
        return sent < args.warmup + args.requests and time.monotonic() < deadline

    def keep(record: dict) -> None:
        records.append(record)
        print(json.dumps(record), file=sys.stderr, flush=True)   # progress, a line per request

    async def generator(u: int) -> None:
        nonlocal sent
        rng = random.Random(args.seed * 1000 + u)
        while going():
            await asyncio.sleep(rng.expovariate(1.0 / args.think_s))
            item = draw_generation(rng, args.long_decode_share, args.min_prompt, args.max_prompt)
            if not going():
                return
            sent += 1
            warm = sent <= args.warmup
            keep({**await _generate(engine, f"u{u}-{sent}", item, speeds), "warmup": warm})

    async def embedder(u: int) -> None:
        rng = random.Random(args.seed * 1000 + 500 + u)
        while going():
            await asyncio.sleep(rng.expovariate(1.0 / args.embed_think_s))
            ids = [rng.randrange(300, 40000) for _ in range(rng.randint(500, 4000))]
            if going():
                keep(await _embed(engine, ids))

    await asyncio.gather(*(generator(u) for u in range(args.users)),
                         *(embedder(u) for u in range(args.embed_users)))
    sampler.cancel()
    return records


def error_figures(records: list[dict], speed_drift: bool = False) -> dict:
    """Absolute relative errors |predicted - measured| / measured of the generations: p50, p90 (nearest rank),
    the signed median (> 0: over-predicted) and their count. ``speed_drift``: each prediction first scaled by
    the host's speed over its wait over its speed when predicted (``speed_during / speed_at``): the error left
    is the model's, not the shared host's changing its pace meanwhile."""
    scale = (lambda r: r["speed_during"] / r["speed_at"]) if speed_drift else (lambda r: 1.0)
    rel = sorted((r["predicted_s"] * scale(r) - r["measured_s"]) / r["measured_s"] for r in records
                 if r.get("predicted_s") is not None and r.get("measured_s"))
    if not rel:
        return {"n": 0}
    err = sorted(abs(e) for e in rel)

    def rank(values: list[float], q: float) -> float:
        return values[min(max(math.ceil(q * len(values)) - 1, 0), len(values) - 1)]

    return {"n": len(err), "p50_abs_error": round(rank(err, 0.5), 4), "p90_abs_error": round(rank(err, 0.9), 4),
            "signed_median": round(rank(rel, 0.5), 4), "max_abs_error": round(err[-1], 4)}


async def bench(args: argparse.Namespace) -> dict:
    if args.log_dir:   # the core process inherits it (engine/core/ttft_log.py)
        os.environ[ttft_log.LOG_DIR_ENV] = args.log_dir
    engine = AsyncEngine(EngineArgs(model=args.model, max_num_seqs=args.max_num_seqs, num_threads=args.num_threads))
    await engine.start()
    try:
        load_before = os.getloadavg()
        t0 = time.monotonic()
        records = await run_clients(engine, args)
        wall = time.monotonic() - t0
        load_after = os.getloadavg()
    finally:
        await engine.shutdown(drain=False)
    measured = [r for r in records if "prompt" in r and not r["warmup"]]
    return {"seed": args.seed, "users": args.users, "embed_users": args.embed_users, "think_s": args.think_s,
            "embed_think_s": args.embed_think_s,
            "num_threads": args.num_threads,
            "wall_s": round(wall, 1),
            "cpus": os.cpu_count(), "loadavg_before": load_before, "loadavg_after": load_after,
            "embeddings": sum("embed" in r for r in records), "errors": error_figures(measured),
            "errors_speed_drift_removed": error_figures(measured, speed_drift=True), "records": records}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--requests", type=int, default=30, help="generations measured")
    parser.add_argument("--warmup", type=int, default=4, help="generations before the measured ones, not counted")
    parser.add_argument("--users", type=int, default=3, help="clients, each in a closed loop")
    parser.add_argument("--think-s", type=float, default=4.0, help="mean pause of a client between requests, s")
    parser.add_argument("--embed-users", type=int, default=1, help="embedding clients, each in a closed loop")
    parser.add_argument("--embed-think-s", type=float, default=15.0, help="mean pause of an embedding client, s")
    parser.add_argument("--max-wall-s", type=float, default=1800.0,
                        help="send nothing more after this many seconds (what was sent finishes and is counted)")
    parser.add_argument("--long-decode-share", type=float, default=0.25,
                        help="share of generations with 64-160 tokens to generate (else 8-32)")
    parser.add_argument("--min-prompt", type=int, default=10, help="shortest prompt, tokens")
    parser.add_argument("--max-prompt", type=int, default=6000, help="longest prompt, tokens")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="the engine's max_num_seqs")
    parser.add_argument("--num-threads", type=int, default=None, help="the engine's torch threads (None: all cores)")
    parser.add_argument("--model", default=None, help="model path (None: the embedded SmolLM2)")
    parser.add_argument("--output-json", default=None, help="also write the result here")
    parser.add_argument("--log-dir", default=None,
                        help="record the steps timed and the predictions here, for python -m "
                             "loadtests.bench.ttft_replay (a same-run comparison of calibrations)")
    args = parser.parse_args(argv)
    result = asyncio.run(bench(args))
    text = json.dumps(result, indent=1)
    if args.output_json:
        with open(args.output_json, "w") as f:
            f.write(text)
    print(json.dumps({k: v for k, v in result.items() if k != "records"}, indent=1))


if __name__ == "__main__":
    main()
