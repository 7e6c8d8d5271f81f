"""``tandem bench engine --compare-speculative ROUNDS``: the engine with its ``--speculative-config`` against
the same engine without it, interleaved (off, on, off, on...), on an input-grounded workload (``edit``: edit
a given 350-450-token text and write it out, an output that copies spans of its prompt) or any other.

Both halves run on one engine (same weights, same KV pool): speculation is switched by giving the engine its
``SpecDecoder`` or none. Each run's prompts start with a different token so that no run reads another's prefix
cache. Single stream: the prompts run one after another, each alone, each without and with speculation back to
back."""

from __future__ import annotations

import json
import os
import time

from engine.sampling_params import SamplingParams
from loadtests.bench.peer_engines import median
from loadtests.workloads import EDIT_TEXTS_PATH



def edit_workload(tokenizer, num_prompts: int) -> list[list[int]]:
    """Chat prompts asking to edit a given text of 350-450 tokens and write it out whole (spelling corrections
    of prose, a rename and added docstrings in Python code: ``loadtests/data/edit_texts.json``), cycling through
    the texts: outputs that copy long spans of their prompt."""
    items = json.loads(EDIT_TEXTS_PATH.read_text())
    prompts = []
    for i in range(num_prompts):
        item = items[i % len(items)]
        chat = [{"role": "user", "content": item["instruction"] + item["text"]}]
        prompts.append(tokenizer.encode(tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False),
                                        add_special_tokens=False))
    return prompts


def run_prompts(engine, prompts: list[list[int]], params: SamplingParams, single_stream: bool,
                tag: str) -> tuple[int, float]:
    """(output tokens, seconds) of ``prompts`` run one at a time (``single_stream``) or all at once."""
    tokens = seconds = 0
    for g, group in enumerate([[p] for p in prompts] if single_stream else [prompts]):
        n, dt = _run(engine, group, params, f"{tag}-{g}")
        tokens, seconds = tokens + n, seconds + dt
    return tokens, seconds


def _run(engine, prompts: list[list[int]], params: SamplingParams, tag: str) -> tuple[int, float]:
    """(output tokens, seconds) of ``prompts`` submitted at once and run to the end."""
    tokens, start = 0, time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, params)
    while engine.has_unfinished_requests():
        for o in engine.step():  # each output holds its choices' new tokens
            tokens += sum(len(c.token_ids) for c in o.outputs)
    return tokens, time.perf_counter() - start


def compare_speculative(engine, prompts: list[list[int]], params: SamplingParams, rounds: int,
                        single_stream: bool = True) -> dict:
    """Output tok/s without and with speculation, interleaved for ``rounds`` rounds: each prompt alone
    (``single_stream``; else all prompts at once) runs without then with speculation back to back (with then
    without in odd rounds), so that the box's load drifts alike on both; a round's figure is its tokens over
    its seconds.

    Returns:
        {"off": [tok/s per round], "on": [...], "ratio_on_off": median(on) / median(off), "round_ratios",
        "acceptance_rate", "mean_acceptance_length" (1 + accepted per verified proposal), "num_drafts",
        "accepted_per_draft" (verified proposals by accepted tokens, 0..k), "load_avg" (1-minute load average
        at each round's end)}.

    Raises:
        ValueError: the engine was built without a speculative config.
    """
    core = engine.core
    decoder = core.spec_decoder
    if decoder is None:
        raise ValueError("--compare-speculative needs --speculative-config")
    runs: dict[str, list[float]] = {"off": [], "on": []}
    load: list[float] = []
    s0 = (decoder.stats.num_drafts, decoder.stats.num_draft_tokens, decoder.stats.num_accepted_tokens)
    hist0 = list(decoder.stats.accepted_per_draft)
    vocab = core.model_config.vocab_size
    groups = [[p] for p in prompts] if single_stream else [prompts]
    for r in range(rounds):
        totals = {"off": [0, 0.0], "on": [0, 0.0]}
        for g, group in enumerate(groups):
            for label in ("off", "on") if r % 2 == 0 else ("on", "off"):
                core.spec_decoder = decoder if label == "on" else None
                salt = 2 * r + (label == "on")   # no run reads another's prefix cache
                n, dt = _run(engine, [[(p[0] + 1 + salt) % vocab] + p[1:] for p in group], params,
                             f"spec-{label}-{r}-{g}")
                totals[label][0] += n
                totals[label][1] += dt
        for label, (n, dt) in totals.items():
            runs[label].append(n / dt)
        load.append(os.getloadavg()[0])
    core.spec_decoder = decoder
    drafts = decoder.stats.num_drafts - s0[0]
    proposed = decoder.stats.num_draft_tokens - s0[1]
    accepted = decoder.stats.num_accepted_tokens - s0[2]
    return {**runs, "ratio_on_off": median(runs["on"]) / median(runs["off"]),
            "round_ratios": [on / off for on, off in zip(runs["on"], runs["off"])],
            "acceptance_rate": accepted / proposed if proposed else 0.0,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else 0.0, "num_drafts": drafts,
            "accepted_per_draft": [b - a for a, b in zip(hist0, decoder.stats.accepted_per_draft)],
            "load_avg": load}
