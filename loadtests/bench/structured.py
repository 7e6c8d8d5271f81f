"""``tandem bench structured``: the cost of grammar-constrained decoding.

Same run, same engine, interleaved rounds (constrained, unconstrained,
constrained, ...):

- constrained: ``--concurrency`` json_schema requests at once (the 20 schemas
  of ``loadtests/data/json_schemas.json``, cycled), greedy;
- unconstrained: the same prompts, each generating exactly as many tokens as
  its constrained twin did in that round (``ignore_eos`` + ``max_tokens``), so
  both sides run the same batch shapes and only the grammar differs.

Reports output tok/s of each round, the ratio constrained / unconstrained
(mean over rounds), the share of the constrained rounds' wall time spent in
the grammar's host work (bitmask fill + matcher advance: a figure that a
shared, noisy machine disturbs less than tok/s), and the grammar compile time
per new schema (p50/p99 over ``--compile-schemas`` distinct schemas: the 20
shapes with varied bounds).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

from loadtests.bench.engine_throughput import percentile
from engine.config import engine_args_from_cli
from engine.sampling_params import SamplingParams, StructuredOutputsParams
from loadtests.workloads import JSON_SCHEMAS_PATH



def add_structured_bench_args(parser: argparse.ArgumentParser) -> None:
    """Flags of ``tandem bench structured``."""
    parser.add_argument("--concurrency", type=int, default=32, help="requests submitted at once per round")
    parser.add_argument("--rounds", type=int, default=2, help="constrained/unconstrained round pairs")
    parser.add_argument("--max-tokens", type=int, default=200, help="output tokens per request")
    parser.add_argument("--compile-schemas", type=int, default=100, help="distinct schemas compiled for timing")
    parser.add_argument("--output-json", default=None, help="write the results to this file (None: print only)")


def _variants(schemas: dict, count: int) -> list[dict]:
    """``count`` distinct schemas: the shapes with a varied ``maxProperties``
    bound on the root (a different grammar, so a compile-cache miss)."""
    shapes = list(schemas.values())
    out = []
    for i in range(count):
        s = dict(shapes[i % len(shapes)])
        if s.get("type") == "object":
            s["maxProperties"] = 10 + i
        else:
            s["maxItems"] = 3 + i
        out.append(s)
    return out


def _timed(fn, total: list[float]):
    """``fn`` that adds its wall time, seconds, to ``total[0]``."""
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            total[0] += time.perf_counter() - start
    return wrapper


def _run_round(engine, prompts: list[list[int]], params: list[SamplingParams], tag: str) -> tuple[float, list[int]]:
    """Submit all, step until done: (output tok/s, tokens per request)."""
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, p, sp in zip(ids, prompts, params):
        engine.add_request(rid, p, sp)
    counts = dict.fromkeys(ids, 0)
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            counts[out.request_id] = out.outputs[0].num_generated_tokens if out.outputs else counts[out.request_id]
    elapsed = time.perf_counter() - start
    return sum(counts.values()) / elapsed, [counts[r] for r in ids]


def run_structured_bench(args: argparse.Namespace) -> int:
    """Run the benchmark and print the figures with same-run ratios."""
    from engine.llm_engine import LLMEngine

    logging.basicConfig(level=logging.WARNING)
    engine = LLMEngine(engine_args_from_cli(args))
    tok = engine.tokenizer
    schemas = json.loads(JSON_SCHEMAS_PATH.read_text())
    names = list(schemas)

    manager = engine.structured_outputs
    manager.compile_seconds.clear()
    for schema in _variants(schemas, args.compile_schemas):
        manager.compile(StructuredOutputsParams(json=schema))
    compile_ms = [s * 1e3 for s in manager.compile_seconds]

    picks = [names[i % len(names)] for i in range(args.concurrency)]
    prompts = [tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": f"Give an example of a {n.replace('_', ' ')} as JSON."}], tokenize=False),
        add_special_tokens=False) for n in picks]
    constrained = [SamplingParams(temperature=0, max_tokens=args.max_tokens,
                                  structured_outputs=StructuredOutputsParams(json=schemas[n])) for n in picks]
    _run_round(engine, prompts[:2], constrained[:2], "warmup")
    grammar_s = [0.0]
    manager.grammar_bitmask = _timed(manager.grammar_bitmask, grammar_s)
    manager.accept = _timed(manager.accept, grammar_s)
    rounds = []
    constrained_s = 0.0
    for r in range(args.rounds):
        c_tps, lengths = _run_round(engine, prompts, constrained, f"c{r}")
        constrained_s += sum(lengths) / c_tps
        plain = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
        u_tps, _ = _run_round(engine, prompts, plain, f"u{r}")
        rounds.append({"constrained_tok_per_s": c_tps, "unconstrained_tok_per_s": u_tps,
                       "output_tokens": sum(lengths)})
    ratio = sum(r["constrained_tok_per_s"] for r in rounds) / sum(r["unconstrained_tok_per_s"] for r in rounds)
    result = {"dtype": str(engine.dtype), "device": str(engine.device), "concurrency": args.concurrency,
              "rounds": rounds, "ratio_constrained_over_unconstrained": ratio,
              "grammar_host_share": grammar_s[0] / constrained_s,
              "compile_ms": {"count": len(compile_ms), "p50": percentile(compile_ms, 50),
                             "p99": percentile(compile_ms, 99)}}
    for i, r in enumerate(rounds):
        print(f"round {i}: constrained {r['constrained_tok_per_s']:.1f} tok/s, unconstrained "
              f"{r['unconstrained_tok_per_s']:.1f} tok/s, ratio {r['constrained_tok_per_s'] / r['unconstrained_tok_per_s']:.3f}"
              f" ({r['output_tokens']} output tokens each)")
    print(f"constrained / unconstrained output tok/s ({args.concurrency} concurrent, {engine.device}, "
          f"{engine.dtype}): {ratio:.3f}x")
    print(f"grammar host work (bitmask fill + matcher advance): {result['grammar_host_share']:.1%} of the "
          "constrained rounds' wall time")
    print(f"grammar compile per new schema ({len(compile_ms)} schemas): p50 {result['compile_ms']['p50']:.1f} ms, "
          f"p99 {result['compile_ms']['p99']:.1f} ms")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2))
    return 0
