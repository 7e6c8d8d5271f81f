"""``tandem loadtest spill --sweep``: the SLO route judged against every setting of the threshold rule.

One seeded arrival trace (:func:`spill.arrivals`: multi-turn conversations, a ramp from ``--low`` to ``--high``
times the engine's capacity and back; 180 s by default) is served, each on a gateway of its own and one after
the other, by the threshold rule at each setting of its knob (``waiting>N``: ``local.waiting > N`` for N = 1, 2,
4, 8, 16, 32; ``kv>=P``: ``local.kv_usage >= P`` for P = 30, 50, 70 %; both send to the cheapest aggregator) and
by the SLO route (``slo: {ttft_ms}`` over [local, cheap, fast]). Then the **offline oracle** is computed from the
runs' per-request logs, under what the engine was seen to do:

* **Candidates.** A request may be served locally iff some run of the sweep served it locally with a TTFT
  within the SLO; it then costs that run's local usage and takes that run's uncached prompt tokens of engine
  work (the least of both over such runs). Every other request goes to the cheapest aggregator whose TTFT
  (the fake upstream's fixed one) is within the SLO (its usage: the prompt's words, as the fake counts, and
  ``max_tokens``).
* **The engine's capacity.** Each request's best run alone would count the engine several times over: a run
  that spilled much served its few local requests fast, the SLO route served others, and both cannot happen
  at once (on the first quiet Intel sweeps, seed 0, the per-request best needed 1,230-1,370 uncached tokens/s
  of prefill over 40-120 s windows of the peak; no run ever needed more than 930). So the oracle's local set
  must also fit the fastest rate any run showed: :func:`engine_rate`, the most uncached prompt tokens of
  in-time local requests arriving within any window of arrivals [a_j, a_k], over ``a_k - a_j + SLO`` (their
  prefill had to be done in that time), maximised over windows and runs. Every run's own in-time local set
  meets it, so each is a possible choice of the oracle.
* **The choice.** The local set saving the most against the aggregator (in USD; when no aggregator is fast
  enough, attainment first), subject to the fluid queue of its work at that rate never holding more than
  ``rate x SLO`` (the same window condition, Lindley's recursion), solved as a linear program (HiGHS through
  ``scipy.optimize.linprog``). Its relaxation lets a request be split between local and upstream, which
  only lowers the cost, so it stays a lower bound.
* Why it is a lower bound on the cost of 100 % attainment, for the policies measured: a run's in-time local
  requests are a feasible local set, so the oracle costs no more than those at their local price plus the
  cheapest fast-enough aggregator for all the rest (``run_bound_usd``, checked per run); a policy that met
  the SLO on every request cannot cost less than that.
* What it is not: a proof that no policy can do better (a schedule no run tried might serve a request
  locally in time, or reach a rate no run did), nor a plan any router could follow (it knows every arrival
  and every TTFT in advance).

Reported per point: SLO attainment (% of requests with TTFT <= SLO; a failed request misses), USD per 1,000
requests (usage x :data:`spill.PRICES`), upstream share, and for the SLO route its prediction error; the
frontier of the threshold settings (those no other setting beats on both cost and attainment); the issue's
check (the SLO route's cost against the cheapest threshold setting at >= 99 % and against the oracle). Files:
``results.json`` (every run's per-request log), ``summary.md``, ``attainment_vs_cost.png``.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from loadtests.report import _save, write_report
from loadtests.scenarios.common import fmt, md_table
from loadtests.scenarios.spill import (AGGREGATORS, PRICES, SWEEP_POLICIES, Arrival, arrivals, request_cost,
                                       scenario_note, serve_policies, threshold_match, with_defaults)
from loadtests.stats import percentiles
from loadtests.upstream import prompt_words

# requests_log columns (spill.analyse)
_BACKEND, _TTFT, _PREDICTED, _ENGINE_PREDICTED, _PROMPT, _EXPLAIN, _COMPLETION, _CACHED = 1, 2, 3, 4, 5, 7, 8, 9
_UNCACHED = re.compile(r"(\d+) uncached of (\d+)")   # the engine's prediction in x-tandem-slo
TARGET_PCT = 99.0   # the issue's attainment target


def _in_time_local(row: list, slo_s: float) -> bool:
    return row[_BACKEND] == "local" and row[_TTFT] is not None and row[_TTFT] <= slo_s


def _uncached(row: list) -> int:
    """Prompt tokens the engine had to prefill for a local row: the prompt minus what its prefix cache held
    (the usage's ``cached_tokens``); in logs older than that column, the prediction's "N uncached of M" (what
    the cache held when the gateway asked, just before admission), else the whole prompt."""
    if len(row) > _CACHED:
        return max(row[_PROMPT] - row[_CACHED], 0)
    m = _UNCACHED.search(row[_EXPLAIN] or "")
    return int(m.group(1)) if m else row[_PROMPT]


def engine_rate(at: list[float], work: list[float], slo_s: float) -> float:
    """The least rate at which a server must work for ``work[i]`` (arriving at ``at[i]``, non-decreasing) to be
    done by ``at[i] + slo_s`` each: max over windows of arrivals [at[j], at[k]] of
    ``sum(work[j..k]) / (at[k] - at[j] + slo_s)`` (the deadline condition of one preemptive server, e.g.
    Horn 1974, for equal relative deadlines). Units: work's per second; 0.0 for no work."""
    import numpy as np

    t = np.asarray(at, dtype=np.float64)
    c = np.concatenate([[0.0], np.cumsum(np.asarray(work, dtype=np.float64))])
    best = 0.0
    for j in np.flatnonzero(np.asarray(work) > 0):   # a window worth checking starts at a job
        best = max(best, float(((c[j + 1:] - c[j]) / (t[j:] - t[j] + slo_s)).max()))
    return best


def max_local_gain(gain: list[float], work: list[float], at: list[float], rate: float, cap: float) -> list[float]:
    """The fractions x_i in [0, 1] (0 where ``work`` is None: not a candidate) maximising sum(gain_i x_i)
    subject to the fluid queue Q_k = max(Q_{k-1} - rate (at_k - at_{k-1}), 0) + x_k work_k <= cap at every
    arrival, as the linear program (variables x, Q) Q_k >= x_k work_k, Q_k >= Q_{k-1} - rate gap_k + x_k work_k,
    0 <= Q_k <= cap: HiGHS through ``scipy.optimize.linprog``."""
    import numpy as np
    from scipy.optimize import linprog
    from scipy.sparse import coo_matrix

    n = len(gain)
    w = np.array([0.0 if x is None else x for x in work])
    rows, cols, vals, b = [], [], [], []
    for k in range(n):   # x_k w_k - Q_k <= 0
        rows += [len(b), len(b)]; cols += [k, n + k]; vals += [w[k], -1.0]; b.append(0.0)
        if k:            # Q_{k-1} - Q_k + x_k w_k <= rate gap_k
            rows += [len(b)] * 3; cols += [n + k - 1, n + k, k]; vals += [1.0, -1.0, w[k]]
            b.append(rate * (at[k] - at[k - 1]))
    a_ub = coo_matrix((vals, (rows, cols)), shape=(len(b), 2 * n)).tocsr()
    bounds = [(0.0, 0.0 if x is None else 1.0) for x in work] + [(0.0, cap)] * n
    g = np.asarray(gain, dtype=np.float64)
    scale = float(np.abs(g).max()) or 1.0   # USD gains are ~1e-5: to ~1 for the solver's tolerances
    res = linprog(np.concatenate([-g / scale, np.zeros(n)]), A_ub=a_ub, b_ub=b, bounds=bounds, method="highs")
    if res.status != 0:
        raise RuntimeError(f"the oracle's linear program failed: {res.message}")
    return [min(max(float(x), 0.0), 1.0) for x in res.x[:n]]


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
        ``requests``, ``slo_met_pct``, ``usd_per_1000``, ``upstream_share_pct`` (a split request counts by its
        fractions), ``engine_rate_tok_s`` and ``engine_rate_run`` (:func:`engine_rate`'s best and whose),
        ``run_rates_tok_s`` (policy -> its rate), ``unlimited_usd_per_1000`` (each request's best run alone,
        without the capacity limit: no more than the oracle's cost when an aggregator meets the SLO),
        ``local_from`` (policy -> local requests the oracle took at
        that run's figures) and ``per_request``: ``[backend, USD, run, local fraction, aggregator USD]`` (backend
        "local" when the fraction is >= 0.5; ``run``: of the runs that served it locally in time, the one with
        the cheapest local usage, whose usage it took (its work: the least uncached tokens of those runs), or
        None; the last: what the cheapest fast-enough aggregator would charge). ``aggregator_in_time``: whether
        some aggregator meets the SLO (if none does, the oracle maximises attainment first, and its cost
        bounds nothing).
    Raises:
        ValueError: if the schedule's arrival times decrease somewhere.
    """
    at = [a.at for a in schedule]
    if any(b < a for a, b in zip(at, at[1:])):
        raise ValueError("the schedule's arrival times must not decrease")
    in_time = [name for name, a in aggregators.items() if a["ttft"] <= slo_s]
    upstreams = in_time or [min(aggregators, key=lambda n: aggregators[n]["ttft"])]
    rates = {p: engine_rate(at, [_uncached(r) if _in_time_local(r, slo_s) else 0 for r in log], slo_s)
             for p, log in logs.items()}
    rate_run = max(rates, key=rates.get) if rates else None
    rate = rates[rate_run] if rates else 0.0
    up, local, gain, work = [], [], [], []
    for i, a in enumerate(schedule):
        up.append(min((request_cost(prices, n, prompt_words(a.messages), max_tokens), n) for n in upstreams))
        runs = [(request_cost(prices, "local", row[_PROMPT], row[_COMPLETION]), _uncached(row), policy)
                for policy, log in logs.items() for row in [log[i]] if _in_time_local(row, slo_s)]
        local.append(min(runs) if runs else None)
        work.append(min(r[1] for r in runs) if runs else None)
        # saving against the aggregator; with none in time, attainment first (1 per request, USD are ~1e-4)
        gain.append(0.0 if not runs else (up[i][0] - local[i][0]) + (0.0 if in_time else 1.0))
    x = max_local_gain(gain, work, at, rate, rate * slo_s)   # rate 0: only work-free requests fit
    per_request, local_from = [], {}
    for i, xi in enumerate(x):
        usd = up[i][0] if local[i] is None else xi * local[i][0] + (1.0 - xi) * up[i][0]
        run = local[i][2] if local[i] is not None and xi > 1e-9 else None
        per_request.append(["local" if xi >= 0.5 else up[i][1], usd, run, xi, up[i][0]])
        if run:
            local_from[run] = local_from.get(run, 0.0) + xi
    n = len(schedule)
    met = sum(x) + (n - sum(x) if in_time else 0.0)
    # each request's best run alone, no capacity limit (the oracle before b013080), for comparison
    unlimited = sum(up[i][0] if local[i] is None or gain[i] <= 0 else local[i][0] for i in range(n))
    return {"requests": n, "slo_met_pct": 100.0 * met / n if n else None,
            "usd_per_1000": 1000.0 * sum(r[1] for r in per_request) / n if n else None,
            "upstream_share_pct": 100.0 * (n - sum(x)) / n if n else None,
            "aggregator_in_time": bool(in_time), "engine_rate_tok_s": rate, "engine_rate_run": rate_run,
            "run_rates_tok_s": rates,
            "unlimited_usd_per_1000": 1000.0 * unlimited / n if n else None,
            "local_from": {p: round(v, 1) for p, v in local_from.items()}, "per_request": per_request}


def run_bound_usd(log: list[list], orc: dict, slo_s: float, prices: dict[str, dict] = PRICES) -> float:
    """What one run's choice would cost the oracle (USD, summed over the schedule): its in-time local requests
    at their local usage, every other request at the oracle's aggregator price. That choice is feasible for
    the oracle, so the oracle's lower-bound property is: the sum of ``orc``'s per-request USD <= this."""
    return sum(request_cost(prices, "local", row[_PROMPT], row[_COMPLETION]) if _in_time_local(row, slo_s)
               else upstream_usd for row, (*_, upstream_usd) in zip(log, orc["per_request"]))


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
    ax.legend(fontsize=8, loc="best")
    return _save(fig, path)


def _table(figures: dict[str, dict], orc: dict, slo_s: float) -> str:
    rows, total = [], sum(r[1] for r in orc["per_request"])   # the oracle's USD over the schedule
    front = set(frontier({p: (f["usd_per_1000"], f["slo_met_pct"]) for p, f in figures.items()
                          if threshold_match(p)}))
    for p, f in figures.items():
        bound = run_bound_usd(f["requests_log"], orc, slo_s)
        rows.append([p + (" (frontier)" if p in front else ""), f["requests"], f["failed"],
                     fmt(f["slo_met_pct"], ".1f"), fmt(f["usd_per_1000"], ".4f"), fmt(f["upstream_share_pct"], ".1f"),
                     fmt(f["handed_over_pct"], ".1f"), fmt(f["ttft_p50_s"], ".2f"),
                     fmt(f["prediction_error_p50_pct"], ".0f") + " / " + fmt(f["prediction_error_p90_pct"], ".0f"),
                     fmt(orc["run_rates_tok_s"].get(p), ".0f"),
                     fmt(total / bound if bound and orc["aggregator_in_time"]
                         else None, ".2f")])
    rows.append(["oracle", orc["requests"], 0, fmt(orc["slo_met_pct"], ".1f"), fmt(orc["usd_per_1000"], ".4f"),
                 fmt(orc["upstream_share_pct"], ".1f"), "-", "-", "-", fmt(orc["engine_rate_tok_s"], ".0f"), "1.00"])
    return md_table(["policy", "requests", "failed", "TTFT <= SLO %", "USD / 1,000", "upstream %", "handed over %",
                     "TTFT p50 s", "pred. err p50 / p90 %", "engine rate tok/s",
                     "oracle / (its in-time local set + aggregator for the rest) USD"], rows)


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


def _earlier(args: argparse.Namespace) -> tuple[float, list[Arrival], dict[str, dict], list[str]]:
    """An earlier sweep's capacity, arrivals (regenerated from its seed: checked against its logs), figures
    and policies from ``args.from_results`` (its results.json); its SLO, seed, duration, rates and
    max_tokens replace ``args``' (files older than the rates and max_tokens keep ``args``')."""
    given = [f for f, v in (("--slo-ms", args.slo_ms), ("--seed", args.seed), ("--duration-s", args.duration),
                            ("--policies", args.policies), ("--capacity", args.capacity)) if v is not None]
    if given:
        raise SystemExit(f"--from-results takes the SLO, seed, duration, policies and capacity from the results: "
                         f"drop {', '.join(given)}")
    path = Path(args.from_results)
    try:
        d = json.loads(path.read_text())
        figures = d["figures"]
        args.slo_ms, args.seed, args.duration = float(d["slo_ms"]), int(d["seed"]), float(d["duration_s"])
        capacity = float(d["capacity_rps"])
        if not figures or any("requests_log" not in f for f in figures.values()):
            raise KeyError("figures")
    except (OSError, UnicodeDecodeError, ValueError) as e:   # json's errors are ValueErrors
        raise SystemExit(f"--from-results {path}: cannot read it ({e})") from None
    except (KeyError, TypeError, AttributeError) as e:
        raise SystemExit(f"--from-results {path}: not the results.json of a `tandem loadtest spill --sweep` "
                         f"({f'no {e} in it' if isinstance(e, KeyError) else 'not shaped like one'})") from None
    args.low, args.high, args.max_tokens = (d.get(k, getattr(args, k)) for k in ("low", "high", "max_tokens"))
    schedule = arrivals(capacity, args.duration, args.low, args.high, args.seed)
    for policy, f in figures.items():
        if [row[0] if isinstance(row, list) and len(row) > _COMPLETION else None for row in f["requests_log"]] != [
                round(a.at, 3) for a in schedule]:
            raise SystemExit(f"--from-results {path}: {policy}'s requests are not the arrivals its seed gives "
                             f"(--low/--high as in that run?)")
    return capacity, schedule, figures, list(figures)


def run_sweep(args: argparse.Namespace) -> int:
    """``tandem loadtest spill --sweep`` (arguments of :func:`spill.register`)."""
    if args.from_results:
        capacity, schedule, figures, policies = _earlier(args)
    else:
        policies = with_defaults(args, 180.0, SWEEP_POLICIES)
        capacity, schedule, figures = serve_policies(args, policies)
    slo_s = args.slo_ms / 1000.0
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
                      "Oracle: the cheapest choice of local requests among those some run served locally within "
                      "the SLO whose uncached prompt tokens the engine could prefill in time at the fastest rate "
                      f"any run showed ({orc['engine_rate_tok_s']:.0f} tok/s, {orc['engine_rate_run']}: the 'engine "
                      "rate' column), the cheapest aggregator fast enough for the rest; see "
                      "loadtests/scenarios/spill_sweep.py. Local requests taken from each run (fractional where "
                      "the linear program split a request): "
                      f"{orc['local_from']}. Each request's best run alone, without the capacity limit, would "
                      f"cost {fmt(orc['unlimited_usd_per_1000'], '.4f')} USD / 1,000.",
                      f"![attainment vs cost]({png.name})"])
    write_report(out, "Spill sweep: SLO attainment vs cost", [],
                 {"figures": figures, "oracle": orc, "verdict": v, "prediction_error": err, "capacity_rps": capacity, "slo_ms": args.slo_ms,
                  "seed": args.seed, "duration_s": args.duration, "low": args.low, "high": args.high,
                  "max_tokens": args.max_tokens, "policies": policies}, md)
    print(md)
    return 0
