"""``python -m loadtests.bench.collective_latency``: what one of the engine's tensor-parallel all-reduces costs
between processes of this host (``TensorParallelGroup.all_reduce``, gloo on CPU), the number that decides
whether splitting a model over ranks of one host pays (a decode step makes two a layer).

Starts ``--world-size`` processes (one ``--threads`` thread each), joins them over loopback as the engine's
ranks do, and times ``--iters`` all-reduces in a row of a bfloat16 ``[rows, --hidden]`` tensor for each of
``--rows``, after 50 unmeasured ones. Prints (and with ``--output-json`` writes) µs per all-reduce on rank 0,
with the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def _rank(rank: int, args: argparse.Namespace, port: int, results) -> None:
    """One rank: join, time each size's all-reduces, rank 0 puts {rows: µs per all-reduce} on ``results``."""
    import torch

    from engine.distributed.parallel_state import TensorParallelGroup

    torch.set_num_threads(args.threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    group = TensorParallelGroup.join(rank, args.world_size, rank, torch.device("cpu"))
    out = {}
    for rows in args.rows:
        x = torch.randn(rows, args.hidden).to(torch.bfloat16)
        for _ in range(50):
            group.all_reduce(x)
        t0 = time.perf_counter()
        for _ in range(args.iters):
            group.all_reduce(x)
        out[rows] = (time.perf_counter() - t0) / args.iters * 1e6
    if rank == 0:
        results.put(out)
    group.close()


def measure(args: argparse.Namespace) -> dict:
    """{"us_per_all_reduce": {rows: µs}, "load_before", "load_after": 1-minute load averages, and the
    arguments}."""
    import multiprocessing

    from loadtests.procs import free_port

    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    load_before = os.getloadavg()[0]
    procs = [ctx.Process(target=_rank, args=(r, args, port, results)) for r in range(args.world_size)]
    for p in procs:
        p.start()
    us = results.get(timeout=600)
    for p in procs:
        p.join(60)
    return {"world_size": args.world_size, "hidden": args.hidden, "threads": args.threads, "iters": args.iters,
            "dtype": "bfloat16", "us_per_all_reduce": us, "load_before": load_before,
            "load_after": os.getloadavg()[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=2, help="ranks (processes)")
    p.add_argument("--hidden", type=int, default=576, help="row width (SmolLM2-135M's hidden size)")
    p.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 64],
                   help="rows of the reduced tensor, comma-separated (a decode step's: its sequences)")
    p.add_argument("--iters", type=int, default=2000, help="timed all-reduces per size")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--output-json", default=None, help="also write the result here")
    args = p.parse_args()
    result = measure(args)
    for rows, us in result["us_per_all_reduce"].items():
        print(f"{args.world_size} ranks, bf16 [{rows}, {args.hidden}]: {us:.1f} µs per all-reduce")
    print(f"load average (1 min): {result['load_before']:.2f} before, {result['load_after']:.2f} after")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
