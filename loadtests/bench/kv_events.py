"""Does publishing KV-cache events slow a step? ``python -m loadtests.bench.kv_events``.

Three engines with the same arguments in one process (the embedded SmolLM2 Q4_1 unless ``--model``): ``off``
(no events), ``read`` (events on, a subscriber draining them in a thread) and ``stalled`` (events on, a
subscriber with a receive high-water mark of 1 that never reads). In rounds whose order rotates, each serves
the same batch: ``--num-prompts`` prompts sharing a 256-token stem (so blocks are stored, hit and, in the small
pool, evicted), ``--output-len`` new tokens, ``ignore_eos``. Reported per engine: the median step time over
rounds and its ratio to ``off``, batches published and dropped. The acceptance line of issue 53: a stalled
subscriber leaves the step time unchanged.
"""

from __future__ import annotations

import argparse
import random
import statistics
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


def main(argv: list[str] | None = None) -> None:
    """Run the comparison and print one line per engine."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-threads", type=int, default=None)
    args = p.parse_args(argv)
    tmp = tempfile.mkdtemp(prefix="kv-events-bench-")
    common = dict(num_threads=args.num_threads, block_size=16, num_gpu_blocks_override=256)
    engines = {"off": LLM(args.model, **common)}
    for name in ("read", "stalled"):
        engines[name] = LLM(args.model, **common, kv_events_config={
            "enable_kv_cache_events": True, "endpoint": f"ipc://{tmp}/{name}.pub", "buffer_steps": 1000})
    stop, received = threading.Event(), [0]
    reader = threading.Thread(target=_drain, args=(f"ipc://{tmp}/read.pub", stop, received), daemon=True)
    reader.start()
    import zmq

    ctx = zmq.Context()
    stalled = ctx.socket(zmq.SUB)
    stalled.set_hwm(1)
    stalled.connect(f"ipc://{tmp}/stalled.pub")
    stalled.setsockopt_string(zmq.SUBSCRIBE, "")
    time.sleep(0.5)
    rng = random.Random(0)
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    medians: dict[str, list[float]] = {n: [] for n in engines}
    names = list(engines)
    for r in range(args.rounds):
        stem = [rng.randrange(100, 20000) for _ in range(256)]
        prompts = [stem + [rng.randrange(100, 20000) for _ in range(rng.randrange(16, 128))]
                   for _ in range(args.num_prompts)]
        for name in names[r % 3:] + names[:r % 3]:
            medians[name].append(statistics.median(_timed_steps(engines[name], prompts, params)))
    stop.set()
    base = statistics.median(medians["off"])
    for name, llm in engines.items():
        m = statistics.median(medians[name])
        pub = llm.engine.core.kv_event_publisher
        extra = "" if pub is None else f", dropped by the publisher {pub.dropped}"
        print(f"{name:8s} median step {m * 1e3:7.2f} ms  ({m / base:.3f}x off){extra}")
    print(f"subscriber 'read' received {received[0]} batches; rounds {args.rounds}")
    for llm in engines.values():
        llm.engine.core.close()
    ctx.destroy(linger=0)


if __name__ == "__main__":
    main()
