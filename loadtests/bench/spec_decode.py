"""``tandem bench engine --compare-speculative ROUNDS``: the engine with its ``--speculative-config`` against
the same engine without it, interleaved (off, on, off, on...), on an input-grounded workload (``rewrite``: edit
a given 300-500-token text, an output that copies spans of its prompt) or any other.

Both halves run on one engine (same weights, same KV pool): speculation is switched by giving the engine its
``SpecDecoder`` or none. Each run's prompts start with a different token so that no run reads another's prefix
cache. Single stream: the prompts run one after another, each alone."""

from __future__ import annotations

import json
import time
from pathlib import Path

from engine.sampling_params import SamplingParams

MT_BENCH = Path(__file__).resolve().parents[2] / "tests" / "data" / "mt_bench_questions.jsonl"
_REWRITE = "Rewrite the following text with every spelling and grammar mistake corrected; change nothing else:\n\n"


def rewrite_workload(tokenizer, num_prompts: int, min_tokens: int = 300, max_tokens: int = 500) -> list[list[int]]:
    """Chat prompts asking to rewrite a text of 300-500 tokens: MT-Bench questions joined, a different window
    of them per prompt."""
    questions = [json.loads(line)["turns"][0] for line in MT_BENCH.read_text().splitlines() if line.strip()]
    prompts = []
    start = 0
    while len(prompts) < num_prompts:
        text, i = "", start
        while len(tokenizer.encode(text, add_special_tokens=False)) < min_tokens:
            text += questions[i % len(questions)] + "\n"
            i += 1
        ids = tokenizer.encode(text, add_special_tokens=False)[:max_tokens]
        chat = [{"role": "user", "content": _REWRITE + tokenizer.decode(ids)}]
        prompts.append(tokenizer.encode(tokenizer.apply_chat_template(chat, add_generation_prompt=True),
                                        add_special_tokens=False))
        start = i
    return prompts


def _run(engine, prompts: list[list[int]], params: SamplingParams, single_stream: bool, tag: str) -> tuple[int, float]:
    """(output tokens, seconds) of the prompts, one at a time or all at once."""
    groups = [[p] for p in prompts] if single_stream else [prompts]
    tokens, start = 0, time.perf_counter()
    for g, group in enumerate(groups):
        for i, p in enumerate(group):
            engine.add_request(f"{tag}-{g}-{i}", p, params)
        while engine.has_unfinished_requests():
            for o in engine.step():  # each output holds its choices' new tokens
                tokens += sum(len(c.token_ids) for c in o.outputs)
    return tokens, time.perf_counter() - start


def compare_speculative(engine, prompts: list[list[int]], params: SamplingParams, rounds: int,
                        single_stream: bool = True) -> dict:
    """Output tok/s without and with speculation, interleaved for ``rounds`` rounds.

    Returns:
        {"off": [tok/s per run], "on": [...], "ratio_on_off": median(on) / median(off), "acceptance_rate",
        "mean_acceptance_length" (1 + accepted per verified proposal), "num_drafts"}.

    Raises:
        ValueError: the engine was built without a speculative config.
    """
    core = engine.core
    decoder = core.spec_decoder
    if decoder is None:
        raise ValueError("--compare-speculative needs --speculative-config")
    runs: dict[str, list[float]] = {"off": [], "on": []}
    s0 = (decoder.stats.num_drafts, decoder.stats.num_draft_tokens, decoder.stats.num_accepted_tokens)
    vocab = core.model_config.vocab_size
    for r in range(rounds):
        for label in ("off", "on"):
            core.spec_decoder = decoder if label == "on" else None
            salt = 2 * r + (label == "on")
            salted = [[(p[0] + 1 + salt) % vocab] + p[1:] for p in prompts]
            n, dt = _run(engine, salted, params, single_stream, f"spec-{label}-{r}")
            runs[label].append(n / dt)
    core.spec_decoder = decoder
    drafts = decoder.stats.num_drafts - s0[0]
    proposed = decoder.stats.num_draft_tokens - s0[1]
    accepted = decoder.stats.num_accepted_tokens - s0[2]
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    return {**runs, "ratio_on_off": med(runs["on"]) / med(runs["off"]),
            "acceptance_rate": accepted / proposed if proposed else 0.0,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else 0.0, "num_drafts": drafts}
