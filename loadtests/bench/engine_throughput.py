"""``tandem bench engine``: offline throughput in the style of vLLM's
``benchmark_throughput.py``, with HF transformers measured in the same run as
the baseline.

Workloads:
    mtbench: the 80 MT-Bench turn-1 prompts (chat template), 128 new tokens.
    synthetic: random prompt token ids of ``--input-len``, ``--output-len``
        new tokens (``--ignore-eos`` makes every request generate them all).

Reports output tok/s, total tok/s, TTFT and TPOT percentiles, peak KV-cache
usage and KV waste at peak (allocated-but-unused slots / allocated slots), and
the ratio of Tandem's output tok/s to HF ``generate``'s.

``--peer vllm`` / ``--peer llamacpp`` also runs vLLM or llama.cpp
(llama-cpp-python) on the same prompt token ids, in the same run, from its own
virtual environment (``--peer-python``; nothing is installed; see
``loadtests/bench/peer_engines.py``), ``--peer-rounds`` times interleaved with
as many fresh Tandem runs, then the ratios of Tandem's output tok/s to the
peer's. Without that interpreter the peer is reported as skipped.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import time
from pathlib import Path

from engine.arg_values import flag_type, non_negative_count, positive_count
from engine.config import engine_args_from_cli
from engine.sampling_params import SamplingParams
from loadtests.bench.peer_engines import (DEFAULT_VLLM_MODEL, PEERS, peer_missing, peer_model, peer_python,
                                          peer_workload, run_peer)
from loadtests.bench.peer_engines import salted, summarize
from loadtests.bench.model_compare import add_compare_args, compare_models
from engine.models.c_stack import decode_weight_bytes
from loadtests.bench.roofline import READ_MIB, read_bandwidth, roofline_ms, weights_mib
from loadtests.workloads import MT_BENCH_PATH



COUNT, OFF_OR_COUNT = flag_type(positive_count), flag_type(non_negative_count)   # argparse types of counts


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    """Flags of ``tandem bench engine``."""
    parser.add_argument("--workload", choices=["mtbench", "synthetic", "edit"], default="synthetic",
                        help="mtbench (MT-Bench turn 1), synthetic (random tokens of --input-len) or edit "
                             "(edit a given 350-450-token text or code and write it out whole: outputs that "
                             "copy their prompt; loadtests/data/edit_texts.json)")
    parser.add_argument("--num-prompts", type=COUNT, default=64, help="requests, submitted at once")
    parser.add_argument("--input-len", type=COUNT, default=100, help="synthetic prompt length, tokens")
    parser.add_argument("--output-len", type=COUNT, default=128, help="new tokens per request")
    parser.add_argument("--ignore-eos", action="store_true", help="generate exactly --output-len tokens")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="Tandem's sampling temperature (0: greedy); above 0 each request is seeded (seed 0, "
                             "draws keyed by output position), so runs with and without speculation sample the "
                             "same tokens; the HF baseline and the peers stay greedy")
    parser.add_argument("--hf-batch-size", type=COUNT, default=8, help="batch size of the HF generate baseline")
    parser.add_argument("--no-baseline", action="store_true", help="skip the HF transformers baseline")
    parser.add_argument("--output-json", default=None, help="write the results to this file (None: print only)")
    parser.add_argument("--compare-batch-invariant", type=OFF_OR_COUNT, default=0, metavar="ROUNDS",
                        help="also run the workload ROUNDS times each with batch-invariant linears on and off, "
                             "interleaved, and print the throughput ratio (0: skip)")
    parser.add_argument("--kv-pool-cycle-tokens", type=OFF_OR_COUNT, default=0,
                        help="instead: decode tok/s of an engine whose KV pool first served this many distinct "
                             "prompt tokens vs a fresh one, same process, tokens (e.g. 60000; 0: off; see "
                             "loadtests/bench/kv_pool.py)")
    parser.add_argument("--compare-speculative", type=OFF_OR_COUNT, default=0, metavar="ROUNDS",
                        help="also run the engine without its --speculative-config and with it, interleaved for "
                             "ROUNDS rounds, the prompts one at a time (single stream; --spec-concurrent: all at "
                             "once); reports the ratio, acceptance rate and mean accepted length")
    parser.add_argument("--spec-concurrent", action="store_true",
                        help="--compare-speculative submits all prompts at once instead of one at a time")
    parser.add_argument("--compare-tensor-parallel", type=OFF_OR_COUNT, default=0, metavar="SIZE",
                        help="also build the engine over SIZE tensor-parallel ranks (the cores split between them) "
                             "and run both interleaved for --tp-rounds rounds; reports the ratio and each rank's "
                             "memory (0: skip; the engine itself must be --tensor-parallel-size 1)")
    parser.add_argument("--tp-rounds", type=COUNT, default=3, help="rounds of --compare-tensor-parallel")
    parser.add_argument("--rounds", type=COUNT, default=6, help="fresh/cycled rounds with --kv-pool-cycle-tokens")
    parser.add_argument("--peer", choices=sorted(PEERS), default=None,
                        help="also run this peer engine on the same prompts (None: no peer)")
    parser.add_argument("--peer-python", default=None,
                        help="the peer's virtual environment's python (None: env TANDEM_VLLM_PYTHON / "
                             "TANDEM_LLAMACPP_PYTHON, else .venv-vllm/bin/python / .venv-llamacpp/bin/python)")
    parser.add_argument("--peer-model", default=None,
                        help=f"model the peer loads (None: vLLM {DEFAULT_VLLM_MODEL} for the embedded model, "
                             "else --model; llama.cpp: Tandem's .gguf)")
    parser.add_argument("--peer-rounds", type=COUNT, default=1,
                        help="rounds of (fresh Tandem run, peer run), interleaved, on the same prompts")
    add_compare_args(parser)


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile, ``q`` in [0, 100] (numpy's default)."""
    if not values:
        return float("nan")
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def build_workload(args, tokenizer, vocab_size: int) -> list[list[int]]:
    """Prompt token ids for the chosen workload."""
    if args.workload == "edit":
        from loadtests.bench.spec_decode import edit_workload

        return edit_workload(tokenizer, args.num_prompts)
    if args.workload == "mtbench":
        questions = [json.loads(line) for line in MT_BENCH_PATH.read_text().splitlines() if line.strip()]
        questions = questions[: args.num_prompts] if args.num_prompts < len(questions) else questions
        return [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q["turns"][0]}],
                                                                  tokenize=False),
                                 add_special_tokens=False) for q in questions]
    rng = random.Random(0)
    special = set(tokenizer.all_special_ids)
    ids = [i for i in range(vocab_size) if i not in special]
    return [[rng.choice(ids) for _ in range(args.input_len)] for _ in range(args.num_prompts)]


def kv_waste(engine) -> tuple[int, int]:
    """(allocated slots, used slots) over the running requests right now."""
    sched = engine.scheduler
    block_size = engine.args.block_size
    allocated = used = 0
    for req in sched.running:
        allocated += len(sched.kv_cache_manager.get_block_ids(req.request_id)) * block_size
        used += req.num_computed_tokens
    return allocated, used


def bench_tandem(engine, prompts: list[list[int]], params: SamplingParams, single_stream: bool = False) -> dict:
    """Submit every prompt at once (``single_stream``: one after another, each alone) and step until done;
    returns the figures (TTFT from the prompt's submission)."""
    start = time.perf_counter()
    submitted: dict[str, float] = {}
    first_token: dict[str, float] = {}
    finished: dict[str, float] = {}
    num_out: dict[str, int] = {}
    peak_usage = 0.0
    peak = (0, 0)
    for group in ([[i] for i in range(len(prompts))] if single_stream else [range(len(prompts))]):
        for i in group:
            engine.add_request(f"bench-{i}", prompts[i], params)
            submitted[f"bench-{i}"] = time.perf_counter()
        while engine.has_unfinished_requests():
            outs = engine.step()
            now = time.perf_counter()
            usage = engine.scheduler.kv_cache_usage
            if usage >= peak_usage:
                peak_usage, peak = usage, kv_waste(engine)
            for o in outs:
                first_token.setdefault(o.request_id, now)
                num_out[o.request_id] = sum(c.num_generated_tokens for c in o.outputs)
                if o.finished:
                    finished[o.request_id] = now
    elapsed = time.perf_counter() - start
    out_tokens = sum(num_out.values())
    ttft = [first_token[r] - submitted[r] for r in first_token]
    tpot = [(finished[r] - first_token[r]) / (num_out[r] - 1) for r in finished if num_out[r] > 1]
    allocated, used = peak
    return {
        "requests": len(prompts),
        "elapsed_s": elapsed,
        "output_tokens": out_tokens,
        "output_tok_per_s": out_tokens / elapsed,
        "total_tok_per_s": (out_tokens + sum(map(len, prompts))) / elapsed,
        "ttft_s": {q: percentile(ttft, q) for q in (50, 90, 99)},
        "tpot_s": {q: percentile(tpot, q) for q in (50, 90, 99)},
        "peak_kv_usage": peak_usage,
        "kv_waste_at_peak": (allocated - used) / allocated if allocated else 0.0,
        "num_preemptions": engine.scheduler.num_preemptions,
    }


def _hf_baseline_missing(model_path: str) -> str:
    """Why the HF baseline cannot run here ("" when it can): transformers reads a GGUF only with ``accelerate``,
    which ``make serve``'s install (``pip install -e .``) leaves out."""
    import importlib.util

    if model_path.endswith(".gguf") and importlib.util.find_spec("accelerate") is None:
        return "transformers needs accelerate to load a GGUF (pip install accelerate, or pass --no-baseline)"
    return ""


def bench_hf(model_path: str, dtype, prompts: list[list[int]], args, pad_id: int) -> dict:
    """HF transformers ``generate`` in batches of ``--hf-batch-size``, left-padded."""
    import os

    import torch
    from transformers import AutoModelForCausalLM

    if model_path.endswith(".gguf"):
        model = AutoModelForCausalLM.from_pretrained(os.path.dirname(model_path), gguf_file=os.path.basename(model_path),
                                                     dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    model.eval()
    out_tokens = 0
    start = time.perf_counter()
    for b in range(0, len(prompts), args.hf_batch_size):
        batch = prompts[b:b + args.hf_batch_size]
        width = max(map(len, batch))
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.output_len,
                                 min_new_tokens=args.output_len if args.ignore_eos else None,
                                 do_sample=False, pad_token_id=pad_id)
        new = gen[:, width:]
        eos = model.generation_config.eos_token_id
        eos = set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()
        for row in new.tolist():
            n = len(row)
            if not args.ignore_eos:
                for i, t in enumerate(row):
                    if t in eos:
                        n = i + 1
                        break
            out_tokens += n
    elapsed = time.perf_counter() - start
    return {"elapsed_s": elapsed, "output_tokens": out_tokens, "output_tok_per_s": out_tokens / elapsed,
            "batch_size": args.hf_batch_size}


def compare_batch_invariant(engine, prompts: list[list[int]], params: SamplingParams, rounds: int) -> dict:
    """Output tok/s with the batch-invariant linear tiling on and off, runs
    interleaved (on, off, on, off...) on one engine. Each run's prompts start
    with a different token so that no run reads another's prefix cache.

    Returns:
        {"on": [tok/s per run], "off": [...], "ratio_on_off": median(on) / median(off)}.
    """
    model = engine.model_runner.model
    runs: dict[str, list[float]] = {"on": [], "off": []}
    for r in range(rounds):
        for label, flag in (("on", True), ("off", False)):
            salt = 2 * r + (label == "off")
            model.set_batch_invariant(flag)
            salted = [[(p[0] + 1 + salt) % engine.model_config.vocab_size] + p[1:] for p in prompts]
            runs[label].append(bench_tandem(engine, salted, params)["output_tok_per_s"])
    model.set_batch_invariant(engine.args.batch_invariant)
    return {**runs, "ratio_on_off": percentile(runs["on"], 50) / percentile(runs["off"], 50)}
def compare_peer(engine, args, prompts: list[list[int]], params: SamplingParams) -> dict:
    """``args.peer_rounds`` rounds of a fresh Tandem run then the peer's run, both on the round's prompts (the
    first token shifted by the round, so Tandem never reads an earlier round's prefix cache; the peer starts a
    new process each round). The peer gets Tandem's thread count, and Tandem's prompt-lookup config where it
    has one (llama.cpp's ``LlamaPromptLookupDecoding``); a peer that runs one sequence at a time (llama.cpp)
    is compared with Tandem running the prompts one at a time.

    Returns:
        {"tandem_output_tok_per_s": [per round], "tandem_runs": [Tandem's figures per round], "runs": [the
        peer's result per round], "threads", "read_gb_per_s": [the machine's read bandwidth measured after each
        round's Tandem run, GB/s], "read_at_weights_gb_per_s": [the same over a buffer the size of the weights,
        which a large last-level cache may hold], "round_ratios", "ratio": median Tandem / median peer}; ``{"skipped": why}`` or
        ``{"failed": why}`` (after one round) when the peer cannot run.
    """
    from engine.config import DEFAULT_MODEL

    peer = PEERS[args.peer]
    python = peer_python(peer, args.peer_python)
    try:
        model = peer_model(peer, args.peer_model, engine.args.model, engine.served_model_name == DEFAULT_MODEL)
    except ValueError as e:
        return {"skipped": str(e)}
    threads = engine_threads(engine, args)
    weight_bytes = _weight_bytes(engine)
    tandem_runs: list[dict] = []
    runs: list[dict] = []
    bandwidth: list[float] = []
    at_weights: list[float] = []
    for r in range(args.peer_rounds):
        round_prompts = salted(prompts, r + 1, engine.model_config.vocab_size)
        tandem_runs.append(bench_tandem(engine, round_prompts, params, single_stream=peer.single_stream))
        bandwidth.append(read_bandwidth(threads))
        if weight_bytes:
            at_weights.append(read_bandwidth(threads, mib=weights_mib(weight_bytes)))
        spec = engine.core.spec_decoder.config if engine.core.spec_decoder is not None else None
        runs.append(run_peer(peer, python, peer_workload(peer, model, round_prompts, args.output_len,
                                                         args.ignore_eos, threads, speculative=spec)))
        if "output_tok_per_s" not in runs[-1]:
            return runs[-1]
    tandem = [t["output_tok_per_s"] for t in tandem_runs]
    return {"tandem_output_tok_per_s": tandem, "tandem_runs": tandem_runs, "runs": runs, "threads": threads,
            "read_gb_per_s": bandwidth, "read_at_weights_gb_per_s": at_weights, **summarize(tandem, runs)}


def _roofline_rows(table, weight_bytes: int | None, bandwidth: list[float], tandem_runs: list[dict],
                   label: str, at_weights: list[float] = ()) -> None:
    """The roofline rows: the bandwidth measured (per round), weights / bandwidth, Tandem's TPOT p50 over it;
    the same for the read of a buffer the weights' size where measured (``at_weights``: on a host whose
    last-level cache holds the weights, the floor a step could reach, below the DRAM one)."""
    if weight_bytes is None or not bandwidth:
        return
    for name, bws in ((f"sum of {READ_MIB} MiB", bandwidth), (f"sum of {weights_mib(weight_bytes)} MiB, the "
                                                               "weights' size", list(at_weights))):
        if not bws:
            continue
        roof = [roofline_ms(weight_bytes, bw) for bw in bws]
        table.add_row(f"read GB/s ({name}) / roofline ms ({weight_bytes / 1e6:.1f} MB of weights), {label}",
                      ", ".join(f"{bw:.1f} / {r:.2f}" for bw, r in zip(bws, roof)))
        ratios = [t["tpot_s"][50] * 1e3 / r for t, r in zip(tandem_runs, roof)]
        table.add_row(f"Tandem TPOT p50 / roofline ({name}), {label}", ", ".join(f"{x:.2f}x" for x in ratios) + (
            " (below 1: faster than the floor, so the read was slowed by other load: rerun on a quiet machine)"
            if any(x < 1 for x in ratios) else ""))


def _tail(why: str, chars: int) -> str:
    """The end of a peer's ``why`` (its stderr's last lines hold the exception: a trial's vLLM failure was cut
    before it), at most ``chars`` characters."""
    return why if len(why) <= chars else "..." + why[-chars:]


def _peer_rows(table, peer_name: str, p: dict, weight_bytes: int | None) -> None:
    """The peer comparison's rows of the result table."""
    peer = PEERS[peer_name]
    if "ratio" not in p:
        table.add_row(peer.label, next(iter(p.items()))[0] + ": " + _tail(next(iter(p.values())), 200))
        return
    runs = p["runs"]
    table.add_row(f"Tandem output tok/s, {len(runs)} rounds",
                  ", ".join(f"{x:.1f}" for x in p["tandem_output_tok_per_s"]))
    table.add_row(f"{peer.label} {runs[0].get(peer.version_key, '')} output tok/s, interleaved",
                  ", ".join(f"{r['output_tok_per_s']:.1f}" for r in runs))
    table.add_row("Tandem TTFT p50 s / TPOT p50 ms, per round",
                  ", ".join(f"{t['ttft_s'][50]:.3f} / {t['tpot_s'][50] * 1e3:.1f}" for t in p["tandem_runs"]))
    _roofline_rows(table, weight_bytes, p.get("read_gb_per_s", []), p["tandem_runs"], "per round",
                   p.get("read_at_weights_gb_per_s", []))
    if "prefill_s" in runs[0]:
        table.add_row(f"{peer.label} prefill s / decode tok/s, per round",
                      ", ".join(f"{r['prefill_s']:.3f} / {r['decode_tok_per_s']:.1f}" for r in runs))
        table.add_row(f"Tandem decode tok/s (1 / TPOT p50) / {peer.label}'s, per round",
                      ", ".join(f"{1 / t['tpot_s'][50] / r['decode_tok_per_s']:.2f}x"
                                for t, r in zip(p["tandem_runs"], runs)))
    table.add_row(f"ratio tandem / {peer.label} per round", ", ".join(f"{x:.2f}x" for x in p["round_ratios"]))
    table.add_row(f"ratio tandem / {peer.label} (medians, {p['threads']} threads)", f"{p['ratio']:.2f}x")


def _result_table(args: argparse.Namespace, result: dict, num_prompts: int, dtype, baseline_skipped: str):
    """``run_bench``'s result as a rich table: Tandem's figures, then each comparison asked for."""
    from rich.table import Table

    t = result["tandem"]
    table = Table(title=f"tandem bench engine: {args.workload}, {num_prompts} prompts, {dtype}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("output tok/s", f"{t['output_tok_per_s']:.1f}")
    table.add_row("total tok/s", f"{t['total_tok_per_s']:.1f}")
    for q in (50, 90, 99):
        table.add_row(f"TTFT p{q} (s)", f"{t['ttft_s'][q]:.3f}")
    for q in (50, 90, 99):
        table.add_row(f"TPOT p{q} (ms)", f"{t['tpot_s'][q] * 1e3:.1f}")
    roof = result.get("roofline", {})
    _roofline_rows(table, roof.get("weight_bytes"), roof.get("read_gb_per_s", []), [t], "after the run",
                   roof.get("read_at_weights_gb_per_s", []))
    table.add_row("peak KV usage", f"{t['peak_kv_usage']:.1%}")
    table.add_row("KV waste at peak", f"{t['kv_waste_at_peak']:.2%}")
    table.add_row("preemptions", str(t["num_preemptions"]))
    if baseline_skipped:
        table.add_row("HF generate baseline", f"skipped: {baseline_skipped}")
    if "hf_transformers" in result:
        h = result["hf_transformers"]
        table.add_row(f"HF generate output tok/s (batch {h['batch_size']})", f"{h['output_tok_per_s']:.1f}")
        table.add_row("ratio tandem / HF", f"{result['ratio_output_tok_per_s']:.2f}x")
    if "batch_invariant_ab" in result:
        ab = result["batch_invariant_ab"]
        table.add_row("batch-invariant on, output tok/s (runs)", ", ".join(f"{x:.1f}" for x in ab["on"]))
        table.add_row("batch-invariant off, output tok/s (runs)", ", ".join(f"{x:.1f}" for x in ab["off"]))
        table.add_row("ratio invariant on / off (medians)", f"{ab['ratio_on_off']:.3f}x")
    if "speculative_ab" in result:
        ab = result["speculative_ab"]
        table.add_row("speculation off, output tok/s (rounds)", ", ".join(f"{x:.1f}" for x in ab["off"]))
        table.add_row("speculation on, output tok/s (rounds)", ", ".join(f"{x:.1f}" for x in ab["on"]))
        table.add_row("ratio on / off per round", ", ".join(f"{x:.3f}x" for x in ab["round_ratios"]))
        table.add_row("ratio on / off (medians)", f"{ab['ratio_on_off']:.3f}x")
        table.add_row("load average (1 min) at each round's end", ", ".join(f"{x:.1f}" for x in ab["load_avg"]))
        table.add_row("acceptance rate", f"{ab['acceptance_rate']:.1%}")
        table.add_row("mean acceptance length", f"{ab['mean_acceptance_length']:.2f}")
        table.add_row("drafts by accepted tokens (0..k)", ", ".join(map(str, ab["accepted_per_draft"])))
    if "model_ab" in result:
        ab = result["model_ab"]
        stream = "single stream" if ab["single_stream"] else f"{num_prompts} at once"
        table.add_row(f"this model, output tok/s ({stream}, rounds)", ", ".join(f"{x:.1f}" for x in ab["this"]))
        table.add_row(f"{ab['other_model']}, output tok/s", ", ".join(f"{x:.1f}" for x in ab["other"]))
        table.add_row("ratio this / other per round", ", ".join(f"{x:.2f}x" for x in ab["round_ratios"]))
        table.add_row("ratio this / other (medians)", f"{ab['ratio_this_other']:.3f}x")
    if "tensor_parallel_ab" in result:
        from loadtests.bench.tensor_parallel import table_rows

        table_rows(table, result["tensor_parallel_ab"], args.compare_tensor_parallel)
    if args.peer:
        _peer_rows(table, args.peer, result[args.peer], roof.get("weight_bytes"))
    return table


def _weight_bytes(engine) -> int | None:
    """The bytes of weights a one-row decode step reads (None off the C decoder stack, or with the model in
    other processes)."""
    runner = getattr(engine, "model_runner", None)
    model = getattr(runner, "model", None)
    return decode_weight_bytes(model, runner.kv_caches) if hasattr(model, "_c_decoder_weights") else None


def _roofline(engine, args: argparse.Namespace) -> dict:
    """The bytes of weights a one-row decode step reads and the read bandwidth measured now, over
    :data:`READ_MIB` and over a buffer the weights' size."""
    weight_bytes, threads = _weight_bytes(engine), engine_threads(engine, args)
    return {"weight_bytes": weight_bytes, "read_gb_per_s": [read_bandwidth(threads)],
            "read_at_weights_gb_per_s": [read_bandwidth(threads, mib=weights_mib(weight_bytes))] if weight_bytes
            else []}


def engine_threads(engine, args: argparse.Namespace) -> int:
    """The threads the engine runs with on a quiet machine (what the peer and the bandwidth measure get):
    ``--num-threads``, else the most its steps take (``engine/worker/cpu_threads.py`` gives a step fewer
    while other processes run), else torch's."""
    import torch

    following = getattr(getattr(engine, "model_runner", None), "cpu_threads", None)
    return args.num_threads or (following.max_threads if following is not None else torch.get_num_threads())


def run_bench(args: argparse.Namespace) -> int:
    """Run the benchmark and print a table with ratios to the HF baseline; exit status 1 when ``--peer`` was
    asked for and gave no figure (skipped or failed: the table and stderr say why)."""
    from rich.console import Console

    from engine.llm_engine import LLMEngine

    logging.basicConfig(level=logging.WARNING)
    if args.peer and (why := peer_missing(PEERS[args.peer], peer_python(PEERS[args.peer], args.peer_python))):
        print(f"--peer {args.peer}: {why}", file=sys.stderr)   # before the Tandem run, not after it (a trial)
        return 1
    if args.kv_pool_cycle_tokens:
        from loadtests.bench.kv_pool import run_pool_bench

        result = run_pool_bench(args, engine_args_from_cli(args))
        if args.output_json:
            Path(args.output_json).write_text(json.dumps(result, indent=2, default=str))
        return 0
    engine = LLMEngine(engine_args_from_cli(args))
    prompts = build_workload(args, engine.tokenizer, engine.model_config.vocab_size)
    params = SamplingParams(temperature=args.temperature, seed=0 if args.temperature else None,
                            max_tokens=args.output_len, ignore_eos=args.ignore_eos)
    result = {"workload": args.workload, "dtype": str(engine.dtype), "tandem": bench_tandem(engine, prompts, params)}
    result["roofline"] = _roofline(engine, args)
    baseline_skipped = _hf_baseline_missing(engine.args.model) if not args.no_baseline else ""
    if not args.no_baseline and not baseline_skipped:
        pad = engine.tokenizer.eos_token_id or 0
        try:
            result["hf_transformers"] = bench_hf(engine.args.model, engine.dtype, prompts, args, pad)
        except ImportError as e:   # a quantized checkpoint's package transformers needs (optimum, autoawq, ...)
            baseline_skipped = f"transformers cannot load this checkpoint here ({e}); pass --no-baseline"
        else:
            result["ratio_output_tok_per_s"] = (result["tandem"]["output_tok_per_s"]
                                                / result["hf_transformers"]["output_tok_per_s"])
    if args.compare_batch_invariant:
        result["batch_invariant_ab"] = compare_batch_invariant(engine, prompts, params, args.compare_batch_invariant)
    if args.compare_speculative:
        from loadtests.bench.spec_decode import compare_speculative

        result["speculative_ab"] = compare_speculative(engine, prompts, params, args.compare_speculative,
                                                       single_stream=not args.spec_concurrent)
    if args.compare_model:
        result["model_ab"] = compare_models(engine, args, prompts, params)
    if args.compare_tensor_parallel:
        from loadtests.bench.tensor_parallel import compare_tensor_parallel

        result["tensor_parallel_ab"] = compare_tensor_parallel(engine, args.compare_tensor_parallel, prompts, params,
                                                               args.tp_rounds)
    if args.peer:
        result[args.peer] = compare_peer(engine, args, prompts, params)
        if "ratio" in result[args.peer]:
            result[f"ratio_vs_{args.peer}"] = result[args.peer]["ratio"]
    table = _result_table(args, result, len(prompts), engine.dtype, baseline_skipped)
    Console().print(table)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2, default=str))
    if args.peer and "ratio" not in result[args.peer]:
        # Asked for a comparison and got none: say so and fail, so no script takes the run for a comparison.
        print(f"--peer {args.peer} gave no figure: {_tail(next(iter(result[args.peer].values())), 1000)}",
              file=sys.stderr)
        return 1
    return 0


