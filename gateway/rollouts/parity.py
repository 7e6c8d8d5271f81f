"""Parity of two answers to one request, and the report over many (``GET /admin/parity``, ``tandem ctl rollout
status``, the rollout gates).

A side (``Side``) is one streamed chat answer with logprobs: its generated tokens (the engine's token ids when it
returned them, ``return_token_ids``; else the logprob entries' token strings), each token's logprob and top
logprobs, and its timing. ``compare`` pairs the primary's side with the candidate's:

- exact (both sides gave token ids: Tandem engines, local or ``tandem engine serve``, which are reproducible):
  bitwise identical or not, in token ids and in the logprobs of the chosen tokens (a candidate in another dtype
  often picks the same greedy tokens with other logprobs: that is a difference), the first divergent position
  (None when identical; the shorter length when one is a prefix of the other), and the absolute logprob delta of
  the two tokens chosen there;
- statistical (otherwise): token agreement (positions where both chose the same token, over the longer length),
  the first divergence, the mean KL(primary || candidate) over the positions up to and including the first
  divergence (where both saw the same context), each position's distributions being the two top-k sets restricted
  to the tokens both list, renormalised (an approximation: the tails beyond top-k are unknown), and the length
  ratio candidate / primary.

Both kinds carry every statistical figure as well; ``report`` aggregates comparisons into the admin API's ``P``
(docs/operators/rollouts-reference.md), with each side's error rate, TTFT (p50, p95) and TPOT (p50).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class Side:
    """One side's answer: ``ok`` (a whole answer), ``tokens`` (ids when ``ids``, else token strings), per-token
    ``logprobs`` and ``top`` (token -> logprob), ``ttft_s`` (request sent -> first token, seconds) and ``tpot_s``
    (mean seconds per output token after the first; None under two tokens)."""

    ok: bool
    tokens: list = field(default_factory=list)
    ids: bool = False
    logprobs: list[float] = field(default_factory=list)
    top: list[dict] = field(default_factory=list)
    ttft_s: float | None = None
    tpot_s: float | None = None
    error: str = ""


def first_divergence(a: list, b: list) -> int | None:
    """The first position where ``a`` and ``b`` differ (the shorter length when one is a prefix of the other);
    None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _kl(p: dict, q: dict) -> float | None:
    """KL(p || q) over the tokens both top-k sets list, each renormalised; None when they share none."""
    common = [t for t in p if t in q]
    if not common:
        return None
    pa = [math.exp(p[t]) for t in common]
    qa = [math.exp(q[t]) for t in common]
    sp, sq = sum(pa), sum(qa)
    return sum(x / sp * math.log((x / sp) / (y / sq)) for x, y in zip(pa, qa) if x > 0 and y > 0)


def compare(primary: Side, candidate: Side) -> dict:
    """One comparison record (JSON-able): ``ok`` per side and timings, and when both answered: ``kind``,
    ``identical``, ``first_div``, ``lp_delta``, ``agree``, ``kl``, ``len_ratio`` (see the module docstring)."""
    rec = {"p_ok": primary.ok, "c_ok": candidate.ok, "p_ttft": primary.ttft_s, "c_ttft": candidate.ttft_s,
           "p_tpot": primary.tpot_s, "c_tpot": candidate.tpot_s}
    if not (primary.ok and candidate.ok):
        return rec
    a, b = primary.tokens, candidate.tokens
    exact = primary.ids and candidate.ids
    div = tok_div = first_divergence(a, b)
    if exact and len(primary.logprobs) == len(a) and len(candidate.logprobs) == len(b):
        # bitwise: the chosen tokens' logprobs too, before the tokens diverge
        lp_div = first_divergence(primary.logprobs[:tok_div], candidate.logprobs[:tok_div])
        if lp_div is not None and (tok_div is None or lp_div < tok_div):
            div = lp_div
    rec["kind"] = "exact" if exact else "statistical"
    rec["identical"] = div is None
    rec["first_div"] = div
    rec["lp_delta"] = None
    if div is not None and div < len(primary.logprobs) and div < len(candidate.logprobs):
        rec["lp_delta"] = abs(primary.logprobs[div] - candidate.logprobs[div])
    longest = max(len(a), len(b))
    rec["agree"] = sum(x == y for x, y in zip(a, b)) / longest if longest else 1.0
    upto = len(a) if tok_div is None else tok_div + 1
    kls = [k for p, q in zip(primary.top[:upto], candidate.top[:upto]) if p and q and (k := _kl(p, q)) is not None]
    rec["kl"] = sum(kls) / len(kls) if kls else None
    rec["len_ratio"] = len(b) / len(a) if a else None
    return rec


def _pct(values: list[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) of ``values``, nearest rank; None when empty."""
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, max(0, math.ceil(q * len(v)) - 1))]


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _side(records: list[dict], p: str) -> dict:
    ttft = [r[f"{p}_ttft"] * 1000 for r in records if r.get(f"{p}_ok") and r.get(f"{p}_ttft") is not None]
    tpot = [r[f"{p}_tpot"] * 1000 for r in records if r.get(f"{p}_ok") and r.get(f"{p}_tpot") is not None]
    errors = sum(1 for r in records if not r.get(f"{p}_ok"))
    return {"error_rate": errors / len(records) if records else 0.0, "ttft_p50_ms": _pct(ttft, 0.5),
            "ttft_p95_ms": _pct(ttft, 0.95), "tpot_p50_ms": _pct(tpot, 0.5)}


def report(records: list[dict], dropped: int = 0) -> dict:
    """The parity report ``P`` of comparison records (``compare``'s, each possibly with an ``at`` time):
    ``kind`` is "exact" when every compared pair was, else "statistical"; figures are None without data."""
    both = [r for r in records if "kind" in r]
    divs = [float(r["first_div"]) for r in both if r["first_div"] is not None]
    lps = [r["lp_delta"] for r in both if r.get("lp_delta") is not None]
    kls = [r["kl"] for r in both if r.get("kl") is not None]
    ratios = [r["len_ratio"] for r in both if r.get("len_ratio") is not None]
    exact = bool(both) and all(r["kind"] == "exact" for r in both)
    return {"kind": "exact" if exact else "statistical", "requests": len(records), "compared": len(both),
            "exact_share": _mean([float(r["identical"]) for r in both]),
            "first_divergence": {"p50": _pct(divs, 0.5), "p90": _pct(divs, 0.9)},
            "token_agreement": _mean([r["agree"] for r in both]), "mean_kl": _mean(kls),
            "length_ratio": _mean(ratios), "logprob_delta_p50": _pct(lps, 0.5),
            "primary": _side(records, "p"), "candidate": _side(records, "c"), "shadow_dropped": dropped}


def parity_value(p: dict) -> float | None:
    """The one parity figure a gate reads: the exact share for an exact report, else the token agreement."""
    return p["exact_share"] if p["kind"] == "exact" else p["token_agreement"]
