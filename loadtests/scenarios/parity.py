"""Scenario 6: ``tandem parity``: the same prompts, greedy with logprobs,
against two targets (the local engine vs a reference server, or the current
gateway config vs a candidate), compared before a canary moves past 5 %.

For each prompt both targets answer with ``temperature=0`` and the top-k
logprobs of every generated position. Reported:

* exact-match rate: prompts whose generated token sequences are equal;
* first divergence: per prompt, the first position whose tokens differ
  (None when equal; the shorter length when one is a prefix of the other);
* mean cosine similarity of the top-logprob vectors, over every position up
  to and including the first divergence (the positions where both saw the
  same context). At one position the vector is indexed by the union of both
  top-k token sets, its values are probabilities ``exp(logprob)``, and a
  token missing from one side's top-k counts as 0 there;
* pass when the mean cosine >= ``--threshold`` (0.9985 by default, the
  seeds' figure).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from loadtests.client import check_loopback, endpoint_url
from loadtests.report import write_json
from loadtests.runner import run_async
from loadtests.scenarios.common import fmt, md_table
from loadtests.workloads import mt_bench_turn1

DEFAULT_THRESHOLD = 0.9985


@dataclass
class Answer:
    """One target's greedy answer: its tokens and, per position, top-k
    token -> logprob (natural log)."""

    tokens: list[str]
    top: list[dict[str, float]]
    text: str


def parse_answer(data: dict, chat: bool) -> Answer:
    """Tokens and top logprobs from an OpenAI response (chat or completions).

    Raises:
        ValueError: no logprobs in the response.
    """
    choice = data["choices"][0]
    lp = choice.get("logprobs")
    if not lp:
        raise ValueError("response carries no logprobs")
    if chat:
        content = lp.get("content") or []
        tokens = [c["token"] for c in content]
        top = [{t["token"]: float(t["logprob"]) for t in (c.get("top_logprobs") or [])} for c in content]
        text = (choice.get("message") or {}).get("content") or ""
    else:
        tokens = list(lp.get("tokens") or [])
        top = [{k: float(v) for k, v in (d or {}).items()} for d in (lp.get("top_logprobs") or [])]
        text = choice.get("text") or ""
    return Answer(tokens, top, text)


def cosine(a: dict[str, float], b: dict[str, float]) -> float:
    """Cosine similarity of two top-logprob dicts as probability vectors over
    the union of their tokens (missing = probability 0). 1.0 when both empty."""
    keys = set(a) | set(b)
    if not keys:
        return 1.0
    va = [math.exp(a[k]) if k in a else 0.0 for k in keys]
    vb = [math.exp(b[k]) if k in b else 0.0 for k in keys]
    dot = sum(x * y for x, y in zip(va, vb))
    na = math.sqrt(sum(x * x for x in va))
    nb = math.sqrt(sum(y * y for y in vb))
    return dot / (na * nb) if na and nb else 0.0


def compare(a: Answer, b: Answer) -> dict:
    """``{"exact_match", "first_divergence", "cosines"}`` of two answers."""
    n = min(len(a.tokens), len(b.tokens))
    first = next((i for i in range(n) if a.tokens[i] != b.tokens[i]), None)
    if first is None and len(a.tokens) != len(b.tokens):
        first = n
    last = n if first is None else min(first + 1, n)
    cos = [cosine(a.top[i], b.top[i]) for i in range(min(last, len(a.top), len(b.top)))]
    return {"exact_match": first is None, "first_divergence": first, "cosines": cos,
            "len_a": len(a.tokens), "len_b": len(b.tokens)}


def summarize_parity(per_prompt: list[dict], threshold: float) -> dict:
    """Totals over prompts: exact-match rate, mean cosine, pass/fail."""
    cos = [c for p in per_prompt for c in p["cosines"]]
    mean_cos = sum(cos) / len(cos) if cos else None
    return {"num_prompts": len(per_prompt),
            "exact_match_rate": sum(p["exact_match"] for p in per_prompt) / max(1, len(per_prompt)),
            "mean_cosine": mean_cos, "num_positions": len(cos), "threshold": threshold,
            "passed": mean_cos is not None and mean_cos >= threshold}


async def _ask(session: aiohttp.ClientSession, url: str, body: dict, headers: dict, chat: bool) -> Answer:
    async with session.post(url, json=body, headers=headers) as resp:
        data = await resp.json(content_type=None)
        if resp.status >= 400:
            raise RuntimeError(f"{url} answered {resp.status}: {data}")
        return parse_answer(data, chat)


async def run_parity(a_url: str, b_url: str, a_model: str, b_model: str, prompts: list, *, endpoint: str,
                     max_tokens: int, top_logprobs: int, a_headers: dict | None = None,
                     b_headers: dict | None = None, concurrency: int = 4) -> list[dict]:
    """Ask both targets every prompt (greedy, with logprobs) and compare.

    Returns:
        one dict per prompt: tag, exact_match, first_divergence, cosines,
        len_a, len_b, text_a, text_b; or tag + error when a target failed.
    """
    chat = endpoint == "chat"
    sem = asyncio.Semaphore(concurrency)

    def body(spec, model: str) -> dict:
        b = {"model": model, "max_tokens": max_tokens, "temperature": 0}
        if chat:
            b.update(messages=spec.messages, logprobs=True, top_logprobs=top_logprobs)
        else:
            b.update(prompt=spec.prompt, logprobs=top_logprobs)
        return b

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        async def one(spec) -> dict:
            async with sem:
                try:
                    a, b = await asyncio.gather(
                        _ask(session, endpoint_url(a_url, endpoint), body(spec, a_model), a_headers or {}, chat),
                        _ask(session, endpoint_url(b_url, endpoint), body(spec, b_model), b_headers or {}, chat))
                except (RuntimeError, ValueError, KeyError, aiohttp.ClientError, asyncio.TimeoutError) as e:
                    return {"tag": spec.tag, "error": f"{type(e).__name__}: {e}"[:500]}
                return {"tag": spec.tag, **compare(a, b), "text_a": a.text, "text_b": b.text}

        return list(await asyncio.gather(*(one(s) for s in prompts)))


def register(sub) -> None:
    p = sub.add_parser("parity", help="scenario 6: greedy outputs and logprobs of two targets compared",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--a", required=True, metavar="URL", help="target A (e.g. the local engine), base URL .../v1")
    p.add_argument("--b", required=True, metavar="URL", help="target B (e.g. the reference server or the candidate)")
    p.add_argument("--model", default=None, help="model name sent to both")
    p.add_argument("--model-a", default=None)
    p.add_argument("--model-b", default=None)
    p.add_argument("--api-key-env-a", default=None, help="environment variable holding A's API key")
    p.add_argument("--api-key-env-b", default=None, help="environment variable holding B's API key")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--num-prompts", type=int, default=16, help="MT-Bench turn-1 prompts (up to 80)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--top-logprobs", type=int, default=5)
    p.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD, help="pass when mean cosine >= this")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--allow-remote", action="store_true")
    p.add_argument("--out", default="loadtest-results/parity")
    p.set_defaults(func=run)


def _headers(env: str | None) -> dict:
    if not env:
        return {}
    key = os.environ.get(env)
    if not key:
        raise ValueError(f"environment variable {env} is not set")
    return {"Authorization": f"Bearer {key}"}


def run(args: argparse.Namespace) -> int:
    """Exit 0 on pass, 1 on fail, 2 on a usage error."""
    try:
        for url in (args.a, args.b):
            check_loopback(url, args.allow_remote)
        a_model = args.model_a or args.model
        b_model = args.model_b or args.model
        if not a_model or not b_model:
            raise ValueError("give --model (or --model-a and --model-b)")
        ha, hb = _headers(args.api_key_env_a), _headers(args.api_key_env_b)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    prompts = mt_bench_turn1(args.max_tokens, args.num_prompts)
    per_prompt = run_async(run_parity(args.a, args.b, a_model, b_model, prompts, endpoint=args.endpoint,
                                      max_tokens=args.max_tokens, top_logprobs=args.top_logprobs,
                                      a_headers=ha, b_headers=hb, concurrency=args.concurrency))
    ok = [p for p in per_prompt if "error" not in p]
    result = summarize_parity(ok, args.threshold)
    result["num_failed_prompts"] = len(per_prompt) - len(ok)
    if result["num_failed_prompts"]:
        result["passed"] = False
    out = Path(args.out)
    write_json(out / "results.json", {"title": "Scenario 6: parity", "a": args.a, "b": args.b, "summary": result,
                                      "prompts": per_prompt})
    rows = [[p["tag"], "error" if "error" in p else ("yes" if p["exact_match"] else "no"),
             "-" if "error" in p or p["first_divergence"] is None else p["first_divergence"],
             "-" if "error" in p or not p["cosines"] else f"{sum(p['cosines']) / len(p['cosines']):.5f}"]
            for p in per_prompt]
    table = md_table(["prompt", "exact match", "first divergence (token)", "mean cosine"], rows)
    verdict = (f"exact match {result['exact_match_rate'] * 100:.1f} %, mean cosine "
               f"{fmt(result['mean_cosine'], '.6f')} over {result['num_positions']} positions, threshold "
               f"{args.threshold}: {'PASS' if result['passed'] else 'FAIL'}"
               + (f" ({result['num_failed_prompts']} prompts failed)" if result["num_failed_prompts"] else ""))
    (out / "summary.md").write_text(f"# Scenario 6: parity\n\nA: {args.a}\nB: {args.b}\n\n{verdict}\n\n{table}\n")
    print(table)
    print(f"\n{verdict}\nfiles: {out / 'results.json'}, {out / 'summary.md'}")
    return 0 if result["passed"] else 1
