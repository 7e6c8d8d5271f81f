"""``tandem bench engine --compare-tensor-parallel N``: the engine as configured (one rank) against the same
model split over N ranks, interleaved (1, N, 1, N...), on the same workload.

Both engines live in this process at once (the N-rank one's other ranks in processes of their own, idle
while the one-rank engine runs). Torch's thread count is per process: each run sets the driver's own (the
one-rank engine: its ``--num-threads`` or every core; the N-rank one: its share of the cores, each of its
other ranks has its own). Each run's prompts start with a different token, so no run reads another's prefix
cache. Reports output tok/s per run, the median ratio, and each engine's memory per rank (the loader's
weight bytes, resident growth while loading, the KV pool).
"""

from __future__ import annotations

import dataclasses

import torch

from engine.sampling_params import SamplingParams


def compare_tensor_parallel(engine, size: int, prompts: list[list[int]], params: SamplingParams,
                            rounds: int) -> dict:
    """Output tok/s of ``engine`` (one rank) and of a second engine with ``tensor_parallel_size=size``,
    ``rounds`` rounds interleaved.

    Returns:
        {"tp1": [tok/s per run], f"tp{size}": [...], "ratio": median tp{size} / median tp1, "threads":
        {engine: torch threads of its driver}, "memory": {engine: per-rank memory reports}}.

    Raises:
        ValueError: ``engine`` is itself split (its tensor_parallel_size is not 1).
    """
    from engine.llm_engine import LLMEngine
    from loadtests.bench.engine_throughput import bench_tandem, percentile

    if engine.args.tensor_parallel_size != 1:
        raise ValueError("--compare-tensor-parallel compares against one rank: leave --tensor-parallel-size at 1")
    threads_one = torch.get_num_threads()
    split = LLMEngine(dataclasses.replace(engine.args, tensor_parallel_size=size))
    threads_split = torch.get_num_threads()
    engines = {"tp1": (engine, threads_one), f"tp{size}": (split, threads_split)}
    runs: dict[str, list[float]] = {name: [] for name in engines}
    vocab = engine.model_config.vocab_size
    try:
        for r in range(rounds):
            for i, (name, (e, threads)) in enumerate(engines.items()):
                torch.set_num_threads(threads)
                salt = 2 * r + i
                salted = [[(p[0] + 1 + salt) % vocab] + p[1:] for p in prompts]
                runs[name].append(bench_tandem(e, salted, params)["output_tok_per_s"])
        memory = {name: e.core.rank_memory for name, (e, _) in engines.items()}
    finally:
        torch.set_num_threads(threads_one)
        split.core.close()
    key = f"tp{size}"
    return {**runs, "ratio": percentile(runs[key], 50) / percentile(runs["tp1"], 50),
            "threads": {name: t for name, (_, t) in engines.items()}, "memory": memory}


def table_rows(table, ab: dict, size: int) -> None:
    """The comparison's rows of ``tandem bench engine``'s result table."""
    key = f"tp{size}"
    table.add_row(f"1 rank ({ab['threads']['tp1']} threads), output tok/s (runs)",
                  ", ".join(f"{x:.1f}" for x in ab["tp1"]))
    table.add_row(f"{size} ranks ({ab['threads'][key]} thread(s) each), output tok/s (runs)",
                  ", ".join(f"{x:.1f}" for x in ab[key]))
    table.add_row(f"ratio {size} ranks / 1 (medians)", f"{ab['ratio']:.3f}x")
    whole = ab["memory"]["tp1"][0]
    for m in ab["memory"][key]:
        table.add_row(f"rank {m['rank']} of {size}: weights / resident / KV pool (MiB)",
                      f"{m['weight_bytes'] / 2**20:.0f} ({m['weight_bytes'] / whole['weight_bytes']:.2f}x) / "
                      f"{m['rss_weights_bytes'] / 2**20:.0f} ({m['rss_weights_bytes'] / whole['rss_weights_bytes']:.2f}x)"
                      f" / {m['kv_bytes'] / 2**20:.0f}")
    table.add_row("1 rank: weights / resident / KV pool (MiB)",
                  f"{whole['weight_bytes'] / 2**20:.0f} / {whole['rss_weights_bytes'] / 2**20:.0f} / "
                  f"{whole['kv_bytes'] / 2**20:.0f}")
