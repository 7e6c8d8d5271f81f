"""A rollout's gates judged on a parity report (``gateway/rollouts/parity.py``'s ``P`` of the pairs compared
since the current step began): each gate's limit, the measured value and whether it holds (None: not enough
pairs yet, ``min_compared``; or no value, e.g. no TTFT because every candidate call failed)."""

from __future__ import annotations

from gateway.config.schema import GatesConfig
from gateway.rollouts.parity import parity_value


def judge(gates: GatesConfig, p: dict) -> dict[str, dict]:
    """``{gate: {"limit", "value", "ok"}}`` for every set gate of ``gates`` on report ``p``."""
    enough_pairs = p["compared"] >= gates.min_compared
    enough_calls = p["requests"] >= gates.min_compared
    cand, prim = p["candidate"], p["primary"]
    ratio = cand["ttft_p95_ms"] / prim["ttft_p95_ms"] if cand["ttft_p95_ms"] and prim["ttft_p95_ms"] else None
    rows = [("parity_min", gates.parity_min, parity_value(p), enough_pairs, lambda v, lim: v >= lim),
            ("error_rate_max", gates.error_rate_max, cand["error_rate"], enough_calls, lambda v, lim: v <= lim),
            ("ttft_p95_max_ms", gates.ttft_p95_max_ms, cand["ttft_p95_ms"], enough_calls, lambda v, lim: v <= lim),
            ("ttft_p95_ratio_max", gates.ttft_p95_ratio_max, ratio, enough_calls, lambda v, lim: v <= lim),
            ("tpot_p50_max_ms", gates.tpot_p50_max_ms, cand["tpot_p50_ms"], enough_calls, lambda v, lim: v <= lim)]
    out = {}
    for name, limit, value, enough, holds in rows:
        if limit is None:
            continue
        ok = None if not enough or value is None else bool(holds(value, limit))
        out[name] = {"limit": float(limit), "value": value, "ok": ok}
    return out


def failing(result: dict[str, dict]) -> str:
    """Why the gates fail, one line ("" when none does)."""
    return "; ".join(f"gate {n}: {g['value']:.4g} against limit {g['limit']:g}" for n, g in result.items()
                     if g["ok"] is False)


def all_hold(result: dict[str, dict]) -> bool:
    """True when every gate holds (none unjudged)."""
    return all(g["ok"] is True for g in result.values())
