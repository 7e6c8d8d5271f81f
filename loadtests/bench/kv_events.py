"""Does publishing KV-cache events slow a step? ``python -m loadtests.bench.kv_events``.

Three engine set-ups on the embedded SmolLM2 Q4_1 (unless ``--model``): ``off`` (no events), ``read`` (events
on, a subscriber draining them in a thread) and ``stalled`` (events on, a subscriber with a receive
high-water mark of 1 that never reads). Each round runs each set-up alone in a fresh process, in an order that
rotates (engines sharing one process disturbed each other: their C thread pools and torch threads compete,
and the first-built ran 6x slower than the last). Each serves the same batch: ``--num-prompts`` prompts sharing
a 256-token stem (so blocks are stored, hit and, in the small pool, evicted), ``--output-len`` new tokens,
``ignore_eos``. Reported per set-up: the median over rounds of its median step time, its ratio to ``off``,
batches published and dropped. The acceptance line of issue 53: a stalled subscriber leaves the step time
unchanged.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from engine.llm import LLM
from engine.sampling_params import SamplingParams


def _drain(endpoint: str, stop: threading.Event, counter: list[int]) -> None:
    import zmq

    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(endpoint)
    sub.setsockopt_string(zmq.SUBSCRIBE, "")
    while not stop.is_set():
        if sub.poll(50):
            sub.recv_multipart()
            counter[0] += 1
    ctx.destroy(linger=0)


def _timed_steps(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[float]:
    """Seconds of each engine step while ``prompts`` run to the end."""
    for i, p in enumerate(prompts):
        llm.engine.add_request(f"b-{time.monotonic_ns()}-{i}", p, params)
    steps = []
    while llm.engine.has_unfinished_requests():
        t = time.perf_counter()
        llm.engine.step()
        steps.append(time.perf_counter() - t)
    return steps


def run_one(name: str, model: str | None, prompts: list[list[int]], output_len: int,
            num_threads: int | None) -> dict:
    """One set-up (``off`` | ``read`` | ``stalled``) in this process: {"median_step_s", "dropped", "received"}."""
    tmp = tempfile.mkdtemp(prefix="kv-events-bench-")
    endpoint = f"ipc://{tmp}/{name}.pub"
    events = None if name == "off" else {"enable_kv_cache_events": True, "endpoint": endpoint, "buffer_steps": 1000}
    llm = LLM(model, num_threads=num_threads, block_size=16, num_gpu_blocks_override=256, kv_events_config=events)
    stop, received = threading.Event(), [0]
    import zmq

    ctx = zmq.Context()
    if name == "read":
        threading.Thread(target=_drain, args=(endpoint, stop, received), daemon=True).start()
    elif name == "stalled":
        stalled = ctx.socket(zmq.SUB)
        stalled.set_hwm(1)
        stalled.connect(endpoint)
        stalled.setsockopt_string(zmq.SUBSCRIBE, "")
    time.sleep(0.5)
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    _timed_steps(llm, [p[:64] for p in prompts[:2]], SamplingParams(max_tokens=4, temperature=0))   # warm-up
    median = statistics.median(_timed_steps(llm, prompts, params))
    stop.set()
    pub = llm.engine.core.kv_event_publisher
    llm.engine.core.close()
    ctx.destroy(linger=0)
    return {"median_step_s": median, "dropped": None if pub is None else pub.dropped, "received": received[0]}


def main(argv: list[str] | None = None) -> None:
    """Run the comparison and print one line per set-up."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--one", choices=["off", "read", "stalled"], help=argparse.SUPPRESS)  # a round's child process
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    stem = [rng.randrange(100, 20000) for _ in range(256)]
    prompts = [stem + [rng.randrange(100, 20000) for _ in range(rng.randrange(16, 128))]
               for _ in range(args.num_prompts)]
    if args.one:
        print(json.dumps(run_one(args.one, args.model, prompts, args.output_len, args.num_threads)))
        return
    names = ["off", "read", "stalled"]
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(args.rounds):
        for name in names[r % 3:] + names[:r % 3]:
            cmd = [sys.executable, "-m", "loadtests.bench.kv_events", "--one", name, "--seed", str(r),
                   "--num-prompts", str(args.num_prompts), "--output-len", str(args.output_len)]
            cmd += ["--model", args.model] if args.model else []
            cmd += ["--num-threads", str(args.num_threads)] if args.num_threads else []
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            runs[name].append(json.loads(out.strip().splitlines()[-1]))
    base = statistics.median(x["median_step_s"] for x in runs["off"])
    for name in names:
        m = statistics.median(x["median_step_s"] for x in runs[name])
        per_round = ", ".join(f"{x['median_step_s'] * 1e3:.1f}" for x in runs[name])
        extra = "" if name == "off" else f", dropped by the publisher {sum(x['dropped'] for x in runs[name])}"
        paired = ", ".join(f"{x['median_step_s'] / o['median_step_s']:.3f}" for x, o in zip(runs[name], runs["off"]))
        print(f"{name:8s} median step {m * 1e3:7.2f} ms  ({m / base:.3f}x off; rounds {per_round} ms; "
              f"each round over its off: {paired}){extra}")
    print(f"subscriber 'read' received {sum(x['received'] for x in runs['read'])} batches; rounds {args.rounds}; "
          f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
