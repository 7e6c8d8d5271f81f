"""``tandem bench engine --kv-pool-cycle-tokens N``: does decode slow down once
the KV pool has been used?

Two engines with the same arguments live in one process (same process age,
same allocator state, same machine noise): ``fresh`` never served anything
but the measured batches; ``cycled`` first serves ``N`` distinct prompt
tokens (prompts of 200-1000 tokens, 1-16 new tokens, 8 in flight, so that
requests finish in mixed order and the free-block queue ends up scattered
over the whole pool). Then, in rounds whose order alternates (fresh, cycled;
cycled, fresh; ...), both run the same decode batch (``--num-prompts``
random prompts of ``--input-len`` tokens, ``--output-len`` new tokens,
``ignore_eos``, new prompts every round so that no prefix cache hit helps).

Reported: decode tok/s of each (generated tokens / wall time of the steps
where every request decodes), the median over rounds of cycled / fresh, the
first request's block table in each engine, and the process RSS after
start-up, after cycling and at the end (the pool is committed at start-up,
so RSS should stay flat). On a shared machine use ``--num-threads 1``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from engine.sampling_params import SamplingParams

_CYCLE_IN_FLIGHT = 8


def rss_mib() -> float:
    """Resident set size of this process, MiB (Linux ``/proc/self/status``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _random_prompt(rng: random.Random, length: int, vocab: list[int]) -> list[int]:
    return [rng.choice(vocab) for _ in range(length)]


def cycle_pool(engine, num_tokens: int, vocab: list[int], seed: int = 1) -> int:
    """Serve ``num_tokens`` distinct prompt tokens (mixed lengths, mixed
    finish times, ``_CYCLE_IN_FLIGHT`` requests in flight); returns requests served."""
    rng = random.Random(seed)
    sent = served = 0
    in_flight: set[str] = set()
    while sent < num_tokens or in_flight:
        while sent < num_tokens and len(in_flight) < _CYCLE_IN_FLIGHT:
            rid = f"cycle-{served + len(in_flight)}"
            prompt = _random_prompt(rng, rng.randint(200, 1000), vocab)
            engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 16),
                                                           ignore_eos=True))
            in_flight.add(rid)
            sent += len(prompt)
        for out in engine.step():
            if out.finished:
                in_flight.discard(out.request_id)
                served += 1
    return served


def decode_tok_per_s(engine, prompts: list[list[int]], output_len: int, tag: str) -> tuple[float, list[int]]:
    """Run the batch to completion; (decode tok/s, the first request's block table)."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, params)
    tokens, seconds, table = 0, 0.0, []
    while engine.has_unfinished_requests():
        prefilled = engine.get_stats().prompt_tokens_total
        start = time.perf_counter()
        outs = engine.step()
        elapsed = time.perf_counter() - start
        if not table:
            table = engine.scheduler.kv_cache_manager.get_block_ids(f"{tag}-0")
        decoded = sum(len(c.token_ids) for o in outs for c in o.outputs)
        stepped = {o.request_id for o in outs if any(c.token_ids for c in o.outputs)}
        # a pure decode step of the whole batch: every request got tokens (several with --num-scheduler-steps > 1:
        # a trial's runs at the default 8 counted no step and printed nan) and no prompt token was prefilled
        if len(stepped) == len(prompts) and engine.get_stats().prompt_tokens_total == prefilled:
            tokens += decoded
            seconds += elapsed
    return tokens / seconds if seconds else float("nan"), table


def run_pool_bench(args: argparse.Namespace, engine_args) -> dict:
    """The fresh-vs-cycled comparison (see the module docstring); prints and returns the figures."""
    from engine.llm_engine import LLMEngine

    rss = {"start": rss_mib()}
    fresh = LLMEngine(engine_args)
    cycled = LLMEngine(engine_args)
    rss["after_startup"] = rss_mib()
    special = set(fresh.tokenizer.all_special_ids)
    vocab = [i for i in range(fresh.model_config.vocab_size) if i not in special]
    served = cycle_pool(cycled, args.kv_pool_cycle_tokens, vocab)
    rss["after_cycling"] = rss_mib()
    print(f"pool: {fresh.num_blocks} blocks; cycled engine served {served} requests, "
          f"{args.kv_pool_cycle_tokens} prompt tokens", flush=True)
    rows, ratios = [], []
    for r in range(args.rounds):
        rng = random.Random(100 + r)
        prompts = [_random_prompt(rng, args.input_len, vocab) for _ in range(args.num_prompts)]
        order = [("fresh", fresh), ("cycled", cycled)]
        result = {}
        for name, eng in (order if r % 2 == 0 else order[::-1]):
            result[name] = decode_tok_per_s(eng, prompts, args.output_len, f"r{r}-{name}")
        ratio = result["cycled"][0] / result["fresh"][0]
        ratios.append(ratio)
        rows.append({"round": r, "fresh_tok_per_s": result["fresh"][0], "cycled_tok_per_s": result["cycled"][0],
                     "ratio": ratio, "fresh_table": result["fresh"][1], "cycled_table": result["cycled"][1]})
        print(f"round {r}: fresh {result['fresh'][0]:.1f} tok/s, cycled {result['cycled'][0]:.1f} tok/s, "
              f"cycled/fresh {ratio:.3f}; first block tables {result['fresh'][1][:6]} / "
              f"{result['cycled'][1][:6]}", flush=True)
    rss["end"] = rss_mib()
    median = statistics.median(ratios)
    print(f"decode tok/s cycled/fresh: median {median:.3f} over {len(ratios)} rounds "
          f"(min {min(ratios):.3f}, max {max(ratios):.3f})")
    print("RSS MiB: " + ", ".join(f"{k} {v:.0f}" for k, v in rss.items()))
    return {"rounds": rows, "median_ratio_cycled_over_fresh": median, "rss_mib": rss,
            "kv_pool_cycle_tokens": args.kv_pool_cycle_tokens}
