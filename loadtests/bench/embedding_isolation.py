"""The embeddings phase of ``python -m loadtests.bench.structured_isolation`` (issue 49): can a long embedding
hold the others?

While a streamed chat request runs back to back (the phase's stream, as in the schema phases), another client
sends ``embeds`` embeddings of ``embed_tokens`` token ids each, one after the other, and a third sends a short
prompt (1 token to generate) ``short_after_s`` after each embedding was sent: the stream's largest gap meanwhile
(target: at most 2x its p99 alone, measured in the same run), and the short prompt's time to its first token.
One embedding is also sent alone first, nothing else running: its seconds, against the phase's (each input has
its own token ids, so no prefix is cached). The engine prefills an embedding in chunks beside the running streams,
sized by their cost while streams run (``engine/core/step_cost.py``); before, one 8,000-token input held every
stream for its whole forward pass (47 s).
"""

from __future__ import annotations

import concurrent.futures
import math
import random
import sys
import threading
import time

import httpx


def embed_ids(tokens: int, seed: int) -> list[int]:
    """``tokens`` token ids drawn in SmolLM2's ordinary-text range (exactly that many tokens, no tokenizer)."""
    rng = random.Random(seed)
    return [rng.randrange(300, 40000) for _ in range(tokens)]


def send_embedding(client: httpx.Client, base: str, model: str, ids: list[int]) -> tuple[int, float]:
    """POST one embedding of token ids; (status, seconds)."""
    start = time.perf_counter()
    r = client.post(f"{base}/v1/embeddings", json={"model": model, "input": [ids]}, timeout=7200)
    return r.status_code, time.perf_counter() - start


def short_ttft(client: httpx.Client, base: str, model: str) -> float:
    """Seconds from sending a short streamed prompt (one token to generate) to its first content event."""
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "temperature": 0,
            "ignore_eos": True, "stream": True}
    start = time.perf_counter()
    with client.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=900) as r:
        for line in r.iter_lines():
            compact = line.replace(" ", "")
            if line.startswith("data: {") and '"content":"' in compact and '"content":""' not in compact:
                return time.perf_counter() - start
    return float("nan")


def measure_embeddings_phase(streams_until, base: str, model: str, embed_tokens: int, embeds: int,
                             short_after_s: float) -> dict:
    """Run the phase; ``streams_until(done)`` runs the measured stream back to back until ``done()`` and returns
    its gaps (``structured_isolation.Gap``). Returns the gaps, the sends' (status, seconds), the short
    prompts' TTFTs (seconds) and the (status, seconds) of one embedding sent alone before."""
    done = threading.Event()
    sender, prober = httpx.Client(), httpx.Client()
    sends, ttfts = [], []
    try:
        alone = send_embedding(sender, base, model, embed_ids(embed_tokens, embeds))
        print(f"embedding alone: {alone}", file=sys.stderr, flush=True)   # progress: the phase takes minutes
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            gaps_f = pool.submit(streams_until, done.is_set)
            time.sleep(1.0)
            t0 = time.perf_counter()
            for i in range(embeds):
                send_f = pool.submit(send_embedding, sender, base, model, embed_ids(embed_tokens, i))
                time.sleep(short_after_s)
                ttfts.append(short_ttft(prober, base, model))
                sends.append(send_f.result())
                print(f"embedding {i} beside the stream: {sends[-1]}", file=sys.stderr, flush=True)
            t1 = time.perf_counter()
            done.set()
            gaps = gaps_f.result()
    finally:
        done.set()
        sender.close()
        prober.close()
    return {"gaps": gaps, "window": (t0, t1), "sends": sends, "ttfts": ttfts, "alone": alone}


def measure_embedding_queue(base: str, model: str, inputs: int, tokens: int, rounds: int) -> dict:
    """A short request behind another's batch: ``rounds`` times, a 2-token embedding sent alone, then a call of
    ``inputs`` inputs of ``tokens`` token ids each (fresh ids: nothing cached) and, 1 s after it, the same short
    embedding. Returns each round's seconds: the short one alone, behind the batch, and the batch's."""
    batcher, short = httpx.Client(), httpx.Client()
    out: dict[str, list[float]] = {"short_alone_s": [], "short_behind_batch_s": [], "batch_s": []}
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            for r in range(rounds):
                out["short_alone_s"].append(send_embedding(short, base, model, embed_ids(2, -1))[1])
                batch = [embed_ids(tokens, 1000 * (r + 1) + i) for i in range(inputs)]
                start = time.perf_counter()
                batch_f = pool.submit(lambda: batcher.post(f"{base}/v1/embeddings", json={
                    "model": model, "input": batch}, timeout=7200).raise_for_status())
                time.sleep(1.0)
                status, seconds = send_embedding(short, base, model, embed_ids(2, -1))
                batch_f.result()
                out["batch_s"].append(time.perf_counter() - start)
                out["short_behind_batch_s"].append(seconds if status == 200 else math.nan)
                print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.3f}" for k, v in out.items()), file=sys.stderr,
                      flush=True)
    finally:
        batcher.close()
        short.close()
    return {k: [round(v, 3) for v in vs] for k, vs in out.items()} | {"inputs": inputs, "tokens": tokens}


def _rank(values: list[float], q: float) -> float:
    """The ``q`` quantile of sorted ``values`` (nearest rank)."""
    return values[min(max(math.ceil(q * len(values)) - 1, 0), len(values) - 1)]


def embeddings_figures(phase: dict, baseline_p99_ms: float, baseline_less_steal_p99_ms: float) -> dict:
    """The phase's figures: the stream's largest gap that ended while the embeddings were in flight, over its
    p99 alone (as read and less the host's steal), and the short prompts' TTFT."""
    t0, t1 = phase["window"]
    during = [g for g in phase["gaps"] if t0 <= g.end <= t1 + 0.5] or phase["gaps"]
    worst = max(during, key=lambda g: g.seconds)
    return {
        "embed_tokens_sends": [{"status": s, "seconds": round(t, 3)} for s, t in phase["sends"]],
        "embed_alone": {"status": phase["alone"][0], "seconds": round(phase["alone"][1], 3)},
        "stream_gaps_during": len(during),
        "max_gap_ms": worst.seconds * 1e3,
        "max_gap_at_s": round(worst.end - t0, 3),   # when it ended, seconds after the first embedding was sent
        "gap_p50_p99_ms_during": [round(_rank(sorted(g.seconds for g in during), q) * 1e3, 1) for q in (0.5, 0.99)],
        "max_gap_over_baseline_p99": worst.seconds * 1e3 / baseline_p99_ms,
        "less_steal_max_gap_over_baseline_p99": max(g.seconds - g.steal for g in during) * 1e3
        / baseline_less_steal_p99_ms,
        "short_prompt_ttft_s": [round(t, 3) for t in phase["ttfts"]],
    }
