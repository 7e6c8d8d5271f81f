"""``tandem bench engine`` and ``tandem bench structured``: the engine's offline benchmarks.

Registered by the load tests, not by the engine: the engine package never imports ``loadtests``.
"""

from __future__ import annotations

import argparse

from engine.config import add_engine_cli_args


def register(subparsers) -> None:
    """Add ``bench`` with its ``engine`` and ``structured`` sub-commands to the ``tandem`` CLI."""
    from loadtests.bench.engine_throughput import add_bench_args, run_bench
    from loadtests.bench.structured import add_structured_bench_args, run_structured_bench

    fmt = argparse.ArgumentDefaultsHelpFormatter
    bench = subparsers.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True, metavar="COMMAND")
    be = bench_sub.add_parser("engine", formatter_class=fmt,
                              help="offline engine throughput vs HF transformers (vLLM's benchmark_throughput style)")
    add_bench_args(be)
    add_engine_cli_args(be)
    be.set_defaults(func=run_bench)

    bs = bench_sub.add_parser("structured", formatter_class=fmt,
                              help="json_schema-constrained vs unconstrained output tok/s, grammar compile time")
    add_structured_bench_args(bs)
    add_engine_cli_args(bs)
    bs.set_defaults(func=run_structured_bench)
