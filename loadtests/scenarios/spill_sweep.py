"""``tandem loadtest spill --sweep``: the SLO route judged against every setting of the threshold rule.

One seeded arrival trace (:func:`spill.arrivals`: multi-turn conversations, a ramp from ``--low`` to ``--high``
times the engine's capacity and back; 180 s by default) is served, each on a gateway of its own and one after
the other, by the threshold rule at each setting of its knob (``waiting>N``: ``local.waiting > N`` for N = 1, 2,
4, 8, 16, 32; ``kv>=P``: ``local.kv_usage >= P`` for P = 30, 50, 70 %; both send to the cheapest aggregator) and
by the SLO route (``slo: {ttft_ms}`` over [local, cheap, fast]). Then the **offline oracle** is computed from the
runs' per-request logs:

* a request is served locally iff some run of the sweep served it locally with a TTFT within the SLO (that
  run's measured TTFT and usage; the cheapest such run if several) and that is no dearer than the cheapest
  aggregator whose TTFT (the fake upstream's fixed one) is within the SLO; else by that aggregator (its usage:
  the prompt's words, as the fake counts, and ``max_tokens``). Its attainment is 100 % whenever an aggregator
  is that fast.
* Why it is a lower bound on the cost of 100 % attainment, for the policies measured: every run met the SLO on
  each request either locally (the oracle then serves it locally too, at no more than that run's local
  usage) or upstream (the oracle pays at most the cheapest aggregator's price for it, or the local one), so on
  the requests any run met, the oracle costs no more than that run (``oracle_vs_policy``, checked per run);
  a policy that met the SLO on all of them cannot be cheaper than the oracle.
* What it is not: a proof that no policy can do better. It combines each request's best run, though the
  engine's TTFTs depend on which other requests it serves (optimistic: several requests may each have been
  fast locally in a different run, and a follow-up turn may have been fast because its conversation's earlier
  turns were served locally, which the oracle may have sent upstream); and it prices upstream a request no
  run served locally in time, which another schedule might have (pessimistic: few, since ``waiting>32``
  keeps nearly every request local).

Reported per point: SLO attainment (% of requests with TTFT <= SLO; a failed request misses), USD per 1,000
requests (usage x :data:`spill.PRICES`), upstream share, and for the SLO route its prediction error; the
frontier of the threshold settings (those no other setting beats on both cost and attainment); the issue's
check (the SLO route's cost against the cheapest threshold setting at >= 99 % and against the oracle). Files:
``results.json`` (every run's per-request log), ``summary.md``, ``attainment_vs_cost.png``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from loadtests.report import _save, write_report
from loadtests.scenarios.common import fmt, md_table
from loadtests.scenarios.spill import (AGGREGATORS, PRICES, SWEEP_POLICIES, Arrival, request_cost, scenario_note,
                                       serve_policies, threshold_match)
from loadtests.stats import percentiles
from loadtests.upstream import prompt_words

# requests_log columns (spill.analyse)
_BACKEND, _TTFT, _PREDICTED, _ENGINE_PREDICTED, _PROMPT, _COMPLETION = 1, 2, 3, 4, 5, 8
TARGET_PCT = 99.0   # the issue's attainment target


def oracle(schedule: list[Arrival], logs: dict[str, list[list]], slo_s: float, max_tokens: int,
           prices: dict[str, dict] = PRICES, aggregators: dict[str, dict] = AGGREGATORS) -> dict:
    """The offline oracle's assignment of ``schedule`` (see the module docstring).

    Args:
        schedule: the arrivals every run served, in order.
        logs: policy -> its run's ``requests_log`` (:func:`spill.analyse`; row i is ``schedule[i]``).
        slo_s: the TTFT SLO, seconds.
        max_tokens: completion tokens each request asked for (what the fake upstream returns).
        prices: backend -> USD per million tokens; aggregators: name -> ``{"ttft": s, ...}``.

    Returns:
        ``requests``, ``slo_met_pct``, ``usd_per_1000``, ``upstream_share_pct``, ``local_from`` (policy -> how
        many of the oracle's local requests it took from that run) and ``per_request``: ``[backend, USD, run]``
        (``run``: the policy whose local TTFT it used, or None).
    """
    in_time = [name for name, a in aggregators.items() if a["ttft"] <= slo_s]
    upstreams = in_time or [min(aggregators, key=lambda n: aggregators[n]["ttft"])]
    per_request, met, local_from = [], 0, {}
    for i, a in enumerate(schedule):
        words = prompt_words(a.messages)
        usd, name = min((request_cost(prices, n, words, max_tokens), n) for n in upstreams)
        local = [(request_cost(prices, "local", row[_PROMPT], row[_COMPLETION]), policy)
                 for policy, log in logs.items() for row in [log[i]]
                 if row[_BACKEND] == "local" and row[_TTFT] is not None and row[_TTFT] <= slo_s]
        if local and (min(local)[0] <= usd or not in_time):
            usd, policy = min(local)
            per_request.append(["local", usd, policy])
            local_from[policy] = local_from.get(policy, 0) + 1
            met += 1
            continue
        per_request.append([name, usd, None])
        met += bool(in_time)
    n = len(schedule)
    return {"requests": n, "slo_met_pct": 100.0 * met / n if n else None,
            "usd_per_1000": 1000.0 * sum(r[1] for r in per_request) / n if n else None,
            "upstream_share_pct": 100.0 * sum(r[0] != "local" for r in per_request) / n if n else None,
            "local_from": local_from, "per_request": per_request}


def oracle_vs_policy(log: list[list], orc: dict, slo_s: float, prices: dict[str, dict] = PRICES) -> dict:
    """The oracle's cost against one run's on the requests that run met the SLO for (USD, summed): the
    oracle's lower-bound property is ``oracle_usd <= policy_usd``."""
    met = [i for i, row in enumerate(log) if row[_TTFT] is not None and row[_TTFT] <= slo_s]
    return {"met": len(met),
            "policy_usd": sum(request_cost(prices, log[i][_BACKEND], log[i][_PROMPT], log[i][_COMPLETION])
                              for i in met),
            "oracle_usd": sum(orc["per_request"][i][1] for i in met)}


def sweep_prediction_error(figures: dict[str, dict]) -> dict:
    """The TTFT prediction's error |predicted - measured| / measured over every local request of the sweep
    (every run's: the threshold rules' deep queues and the SLO route's admitted requests), the gateway's
    corrected figure and the engine's own (``/v1/ttft``'s), p50 and p90 in %, and how many requests."""
    out = {}
    for key, col in (("gateway", _PREDICTED), ("engine", _ENGINE_PREDICTED)):
        errs = [abs(row[col] - row[_TTFT]) / row[_TTFT] for f in figures.values() for row in f["requests_log"]
                if row[_BACKEND] == "local" and row[_TTFT] and row[col] is not None]
        p = percentiles(errs) or {}
        out[key] = {"n": len(errs), "p50_pct": 100 * p["p50"] if p else None,
                    "p90_pct": 100 * p["p90"] if p else None}
    return out


def frontier(points: dict[str, tuple[float, float]]) -> list[str]:
    """The names of ``points`` (name -> (USD per 1,000, attainment %)) that no other point beats on both
    (as cheap or cheaper and as high or higher, one of them strictly), by cost."""
    def beaten(c: float, a: float) -> bool:
        return any((c2 <= c and a2 >= a) and (c2 < c or a2 > a) for c2, a2 in points.values())
    return sorted((n for n, (c, a) in points.items() if not beaten(c, a)), key=lambda n: points[n])


def verdict(figures: dict[str, dict], orc: dict) -> dict:
    """The issue's check: the SLO route's attainment and cost against the cheapest threshold setting reaching
    :data:`TARGET_PCT` and against the oracle."""
    slo = figures.get("slo")
    ok = [(f["usd_per_1000"], p) for p, f in figures.items()
          if threshold_match(p) is not None and f["slo_met_pct"] >= TARGET_PCT]
    cheapest = min(ok) if ok else None
    out = {"target_pct": TARGET_PCT, "cheapest_threshold_at_target": cheapest and cheapest[1],
           "cheapest_threshold_usd_per_1000": cheapest and cheapest[0], "oracle_usd_per_1000": orc["usd_per_1000"]}
    if slo:
        out["slo_met_pct"] = slo["slo_met_pct"]
        out["slo_usd_per_1000"] = slo["usd_per_1000"]
        out["slo_vs_oracle_cost"] = slo["usd_per_1000"] / orc["usd_per_1000"] if orc["usd_per_1000"] else None
        out["slo_vs_cheapest_threshold_cost"] = slo["usd_per_1000"] / cheapest[0] if cheapest else None
    return out


def plot(figures: dict[str, dict], orc: dict, path: Path) -> Path:
    """Attainment (%) against USD per 1,000 requests: each threshold setting, their frontier, the SLO route,
    the oracle; a dashed line at the target."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5))
    thresholds = {p: (f["usd_per_1000"], f["slo_met_pct"]) for p, f in figures.items() if threshold_match(p)}
    for prefix, marker, label in (("waiting>", "o", "local.waiting > N"), ("kv>=", "s", "local.kv_usage >= P %")):
        pts = {p: xy for p, xy in thresholds.items() if p.startswith(prefix)}
        if pts:
            ax.scatter([c for c, _ in pts.values()], [a for _, a in pts.values()], marker=marker, label=label)
            for p, (c, a) in pts.items():
                ax.annotate(p.removeprefix(prefix), (c, a), textcoords="offset points", xytext=(4, 4), fontsize=8)
    front = frontier(thresholds)
    if front:
        ax.step([thresholds[p][0] for p in front], [thresholds[p][1] for p in front], where="post", color="grey",
                alpha=0.6, label="threshold frontier")
    if "slo" in figures:
        ax.scatter([figures["slo"]["usd_per_1000"]], [figures["slo"]["slo_met_pct"]], marker="*", s=200,
                   color="red", label="SLO route", zorder=3)
    ax.scatter([orc["usd_per_1000"]], [orc["slo_met_pct"]], marker="D", color="black", label="oracle", zorder=3)
    ax.axhline(TARGET_PCT, linestyle="--", color="green", alpha=0.5, label=f"{TARGET_PCT:g} %")
    ax.set_xlabel("USD per 1,000 requests")
    ax.set_ylabel("TTFT within the SLO, % of requests")
    ax.set_title("Spill: attainment vs cost")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    return _save(fig, path)


def _table(figures: dict[str, dict], orc: dict, slo_s: float) -> str:
    rows = []
    front = set(frontier({p: (f["usd_per_1000"], f["slo_met_pct"]) for p, f in figures.items()
                          if threshold_match(p)}))
    for p, f in figures.items():
        vs = oracle_vs_policy(f["requests_log"], orc, slo_s)
        rows.append([p + (" (frontier)" if p in front else ""), f["requests"], f["failed"],
                     fmt(f["slo_met_pct"], ".1f"), fmt(f["usd_per_1000"], ".4f"), fmt(f["upstream_share_pct"], ".1f"),
                     fmt(f["handed_over_pct"], ".1f"), fmt(f["ttft_p50_s"], ".2f"),
                     fmt(f["prediction_error_p50_pct"], ".0f") + " / " + fmt(f["prediction_error_p90_pct"], ".0f"),
                     fmt(vs["oracle_usd"] / vs["policy_usd"] if vs["policy_usd"] else None, ".2f")])
    rows.append(["oracle", orc["requests"], 0, fmt(orc["slo_met_pct"], ".1f"), fmt(orc["usd_per_1000"], ".4f"),
                 fmt(orc["upstream_share_pct"], ".1f"), "-", "-", "-", "1.00"])
    return md_table(["policy", "requests", "failed", f"TTFT <= SLO %", "USD / 1,000", "upstream %", "handed over %",
                     "TTFT p50 s", "pred. err p50 / p90 %", "oracle / policy USD on the requests it met"], rows)


def _verdict_text(v: dict) -> str:
    if "slo_met_pct" not in v:
        return "No SLO route in this sweep."
    cheapest = (f"the cheapest threshold setting reaching {v['target_pct']:g} % is {v['cheapest_threshold_at_target']}"
                f" at {v['cheapest_threshold_usd_per_1000']:.4f} USD / 1,000 (SLO route: "
                f"{fmt(v['slo_vs_cheapest_threshold_cost'], '.2f')}x)" if v["cheapest_threshold_at_target"]
                else f"no threshold setting reaches {v['target_pct']:g} %")
    return (f"SLO route: {v['slo_met_pct']:.1f} % within the SLO at {v['slo_usd_per_1000']:.4f} USD / 1,000; "
            f"{cheapest}; the oracle costs {fmt(v['oracle_usd_per_1000'], '.4f')} (SLO route: "
            f"{fmt(v['slo_vs_oracle_cost'], '.2f')}x).")


def run_sweep(args: argparse.Namespace) -> int:
    """``tandem loadtest spill --sweep`` (arguments of :func:`spill.register`)."""
    args.duration = 180.0 if args.duration is None else args.duration
    policies = args.policies.split(",") if args.policies else list(SWEEP_POLICIES)
    for policy in policies:
        threshold_match(policy)   # an unknown name fails before anything starts
    slo_s = args.slo_ms / 1000.0
    capacity, schedule, figures = serve_policies(args, policies)
    orc = oracle(schedule, {p: f["requests_log"] for p, f in figures.items()}, slo_s, args.max_tokens)
    v = verdict(figures, orc)
    err = sweep_prediction_error(figures)
    out = Path(args.out)
    png = plot(figures, orc, out / "attainment_vs_cost.png")
    md = "\n\n".join([_table(figures, orc, slo_s), _verdict_text(v),
                      "TTFT prediction error over the sweep's local requests, p50 / p90: the gateway's "
                      f"{fmt(err['gateway']['p50_pct'], '.0f')} / {fmt(err['gateway']['p90_pct'], '.0f')} %, the "
                      f"engine's own {fmt(err['engine']['p50_pct'], '.0f')} / {fmt(err['engine']['p90_pct'], '.0f')} "
                      f"% ({err['engine']['n']} requests).", scenario_note(args, capacity, schedule),
                      f"Load average (1 min) before / after each run: " + "; ".join(
                          f"{p} {f['load_average_1m'][0]:.1f} / {f['load_average_1m'][1]:.1f}"
                          for p, f in figures.items()),
                      "Oracle: a request is local iff some run served it locally within the SLO (that run's "
                      "TTFT), else the cheapest aggregator fast enough; see loadtests/scenarios/spill_sweep.py. "
                      f"Local requests taken from each run: {orc['local_from']}.", f"![attainment vs cost]({png.name})"])
    write_report(out, "Spill sweep: SLO attainment vs cost", [],
                 {"figures": figures, "oracle": orc, "verdict": v, "prediction_error": err, "capacity_rps": capacity, "slo_ms": args.slo_ms,
                  "seed": args.seed, "duration_s": args.duration, "policies": policies}, md)
    print(md)
    return 0
