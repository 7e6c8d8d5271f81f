"""``tandem loadtest spill --sweep``: the offline oracle, the frontier, and the sweep end to end (the embedded
SmolLM2, the fake aggregators, a few seconds per point)."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from loadtests import cli
from loadtests.scenarios.spill import Arrival, request_cost, threshold_match
from loadtests.scenarios.spill_sweep import (_uncached, engine_rate, frontier, max_local_gain, oracle, run_bound_usd,
                                             sweep_prediction_error)

AGGS = {"cheap": {"ttft": 0.9}, "fast": {"ttft": 0.3}}
PRICES_T = {"local": {"input": 0.02, "output": 0.02}, "cheap": {"input": 0.27, "output": 1.1},
            "fast": {"input": 0.6, "output": 2.0}}


def _row(backend: str, ttft: float | None, prompt: int = 100, completion: int = 4, cached: int = 0) -> list:
    """A ``requests_log`` row (spill.analyse's columns)."""
    return [0.0, backend, ttft, None, None, prompt, 1, "", completion, cached]


def test_oracle_keeps_local_what_some_run_served_locally_in_time_and_sends_the_rest_to_the_cheapest_fast_enough():
    schedule = [Arrival(float(i), [{"role": "user", "content": "a b c d e"}], i) for i in range(4)]
    logs = {"waiting>1": [_row("local", 0.1, completion=3), _row("cheap", 1.0), _row("local", 3.0), _row("", None)],
            "slo": [_row("local", 2.0), _row("local", 1.0), _row("fast", 0.4), _row("local", 9.0)]}
    orc = oracle(schedule, logs, slo_s=2.5, max_tokens=4, prices=PRICES_T, aggregators=AGGS)
    assert [r[0] for r in orc["per_request"]] == ["local", "local", "cheap", "cheap"]
    assert orc["per_request"][1][2] == "slo"   # the run whose local TTFT was within the SLO
    assert orc["per_request"][2][1] == pytest.approx(request_cost(PRICES_T, "cheap", 5, 4))   # 5 words, max_tokens
    assert orc["slo_met_pct"] == 100.0 and orc["upstream_share_pct"] == 50.0
    assert orc["local_from"] == {"waiting>1": 1, "slo": 1}   # request 0: the cheaper of its two local runs
    for log in logs.values():   # on the requests each run met, the oracle pays no more than that run
        assert sum(r[1] for r in orc["per_request"]) <= run_bound_usd(log, orc, slo_s=2.5, prices=PRICES_T) + 1e-15
    # an SLO no aggregator meets: the fastest, counted as missed; local in time still counts
    tight = oracle(schedule, logs, slo_s=0.2, max_tokens=4, prices=PRICES_T, aggregators=AGGS)
    assert [r[0] for r in tight["per_request"]] == ["local", "fast", "fast", "fast"] and tight["slo_met_pct"] == 25.0
    assert orc["aggregator_in_time"] and not tight["aggregator_in_time"]


def test_engine_rate_is_the_densest_window_of_work_over_its_span_plus_the_slo():
    # windows [0, 0]: (50 + 150) / 1; [0, 4]: 240 / 5; [4, 4]: 40 / 1
    assert engine_rate([0.0, 0.0, 4.0], [50, 150, 40], slo_s=1.0) == pytest.approx(200.0)
    assert engine_rate([0.0, 10.0], [100, 100], slo_s=1.0) == pytest.approx(100.0)
    assert engine_rate([0.0, 1.0], [0, 0], slo_s=1.0) == 0.0


def test_oracle_serves_locally_no_more_than_the_fastest_run_could_and_keeps_the_cheapest_work():
    """Two runs each served half the requests locally in time, all arriving together: the best of each
    request's runs would serve all four locally, which needs twice the rate either run showed."""
    schedule = [Arrival(0.0, [{"role": "user", "content": "a b c d e"}], i) for i in range(4)]
    logs = {"waiting>1": [_row("local", 0.5), _row("local", 0.9), _row("cheap", 1.0), _row("cheap", 1.0)],
            # request 2's prompt is mostly cached here: 10 tokens of work
            "slo": [_row("fast", 0.4), _row("fast", 0.4), _row("local", 0.3, cached=90), _row("local", 0.8)]}
    orc = oracle(schedule, logs, slo_s=1.0, max_tokens=4, prices=PRICES_T, aggregators=AGGS)
    assert orc["run_rates_tok_s"] == pytest.approx({"waiting>1": 200.0, "slo": 110.0})
    assert orc["engine_rate_tok_s"] == pytest.approx(200.0) and orc["engine_rate_run"] == "waiting>1"
    x = [r[3] for r in orc["per_request"]]
    assert x[2] == pytest.approx(1.0) and sum(x) == pytest.approx(2.9)   # 10 + 190 of 300 tokens of work
    assert orc["upstream_share_pct"] == pytest.approx(27.5) and orc["slo_met_pct"] == pytest.approx(100.0)
    up, local = request_cost(PRICES_T, "cheap", 5, 4), request_cost(PRICES_T, "local", 100, 4)
    assert orc["usd_per_1000"] == pytest.approx(1000.0 * (2.9 * local + 1.1 * up) / 4)
    assert orc["unlimited_usd_per_1000"] == pytest.approx(1000.0 * local)   # all four local, the engine counted twice
    for log in logs.values():   # each run's in-time local set is a choice the oracle had
        bound = run_bound_usd(log, orc, slo_s=1.0, prices=PRICES_T)
        assert sum(r[1] for r in orc["per_request"]) <= bound + 1e-15
        assert bound == pytest.approx(2 * local + 2 * up)   # its two local requests, two at the aggregator
    # spread out, the queue drains between arrivals: the same work fits
    spread = [Arrival(float(10 * i), m.messages, i) for i, m in enumerate(schedule)]
    assert oracle(spread, logs, slo_s=1.0, max_tokens=4, prices=PRICES_T,
                  aggregators=AGGS)["upstream_share_pct"] == pytest.approx(0.0)


def _windows_hold(at, load, rate, slo_s, tol=1e-6):
    return all(sum(load[j:k + 1]) <= rate * (at[k] - at[j] + slo_s) + tol
               for j in range(len(at)) for k in range(j, len(at)))


@pytest.mark.parametrize("seed", range(12))
def test_the_choice_meets_every_window_and_beats_every_whole_choice_that_does(seed):
    """Small random instances against brute force: the linear program's fractions keep every window of
    arrivals within the rate (partly drained queues included), and save at least as much as the best 0/1 choice
    that does; engine_rate is the least rate at which a set meets its windows."""
    rng = random.Random(seed)
    n, slo_s = 7, 1.0
    at = sorted(round(rng.uniform(0, 4), 1) for _ in range(n))
    work = [rng.choice([None, 0, 50, 120, 300]) for _ in range(n)]
    gain = [rng.uniform(-1e-5, 1e-4) for _ in range(n)]
    rate = rng.uniform(50, 250)
    x = max_local_gain(gain, work, at, rate, rate * slo_s)
    w = [0 if v is None else v for v in work]
    assert all(0.0 <= xi <= 1.0 for xi in x) and all(xi == 0.0 for xi, v in zip(x, work) if v is None)
    assert _windows_hold(at, [xi * wi for xi, wi in zip(x, w)], rate, slo_s)
    best = max(sum(g for g, c in zip(gain, pick) if c) for pick in itertools.product((0, 1), repeat=n)
               if all(not c or v is not None for c, v in zip(pick, work))
               and _windows_hold(at, [c * wi for c, wi in zip(pick, w)], rate, slo_s))
    assert sum(g * xi for g, xi in zip(gain, x)) >= best - 1e-12
    need = engine_rate(at, w, slo_s)
    assert _windows_hold(at, w, need, slo_s) and (need == 0 or not _windows_hold(at, w, need * 0.999, slo_s))


def test_uncached_tokens_come_from_the_usage_else_from_an_older_logs_prediction():
    assert _uncached(_row("local", 1.0, prompt=100, cached=64)) == 36
    old = _row("local", 1.0, prompt=651)[:9]
    old[7] = "...local predicted 0.88 s [0.88 s (0 prefill tokens ahead + 587 uncached of 651: 2 steps...)]"
    assert _uncached(old) == 587
    old[7] = ""
    assert _uncached(old) == 651


def test_frontier_keeps_the_settings_no_other_beats_on_cost_and_attainment():
    pts = {"a": (1.0, 50.0), "b": (2.0, 40.0), "c": (2.0, 90.0), "d": (3.0, 90.0), "e": (0.5, 10.0)}
    assert frontier(pts) == ["e", "a", "c"]


def test_the_sweeps_prediction_error_pools_every_runs_local_requests():
    rows = {"waiting>4": [[0, "local", 1.0, 1.2, 1.1, 0, 1, "", 4], [0, "cheap", 1.0, 5.0, 5.0, 0, 1, "", 4]],
            "slo": [[0, "local", 2.0, 1.0, None, 0, 1, "", 4], [0, "local", None, 1.0, 1.0, 0, 1, "", 0]]}
    err = sweep_prediction_error({p: {"requests_log": r} for p, r in rows.items()})
    assert err["gateway"]["n"] == 2 and err["gateway"]["p50_pct"] == pytest.approx(35.0)   # 20 % and 50 %
    assert err["engine"]["n"] == 1 and err["engine"]["p50_pct"] == pytest.approx(10.0)


def test_threshold_policies_name_one_rule_each():
    assert threshold_match("waiting>4") == {"local.waiting": {"gt": 4}}
    assert threshold_match("kv>=50") == {"local.kv_usage": {"gte": 50.0}}
    assert threshold_match("slo") is None and "any" in threshold_match("threshold")
    with pytest.raises(ValueError):
        threshold_match("waiting<4")


@pytest.mark.parametrize("argv,words", [
    (["--sweep", "--policies", "bogus"], "unknown spill policy 'bogus'"),
    (["--sweep", "--policies", "kv>=150"], "0 < P <= 100"),
    (["--sweep", "--policies", "slo,slo"], "named twice"),
    (["--sweep", "--policies", ""], "an empty name"),
    (["--policies", "waiting>2,,slo"], "an empty name"),
    (["--from-results", "x.json"], "add --sweep"),
    (["--sweep", "--from-results", "/nonexistent/results.json"], "cannot read it"),
])
def test_bad_arguments_end_with_a_message_before_anything_starts(argv, words):
    with pytest.raises(SystemExit) as exc:
        cli.main(["spill", *argv, "--out", "/nonexistent/out"])
    assert words in str(exc.value.code)


@pytest.mark.parametrize("text,words", [("{x", "cannot read it"), ('{"a": 1}', "no 'figures' in it"),
                                        ("[1]", "not shaped like one")])
def test_from_results_names_a_file_that_is_no_sweeps_results(tmp_path, text, words):
    (tmp_path / "r.json").write_text(text)
    with pytest.raises(SystemExit) as exc:
        cli.main(["spill", "--sweep", "--from-results", str(tmp_path / "r.json"), "--out", str(tmp_path / "o")])
    assert words in str(exc.value.code)


@pytest.mark.slow
def test_sweep_end_to_end_reports_each_point_the_oracle_and_the_plot(tmp_path):
    rc = cli.main(["spill", "--sweep", "--duration-s", "2", "--capacity", "1.5", "--max-tokens", "4",
                   "--policies", "waiting>1,slo", "--out", str(tmp_path)])
    assert rc == 0
    res = json.loads((tmp_path / "results.json").read_text())
    figures, orc, slo_s = res["figures"], res["oracle"], res["slo_ms"] / 1000.0
    assert list(figures) == ["waiting>1", "slo"] and res["duration_s"] == 2.0
    n = orc["requests"]
    assert n > 0 and all(f["requests"] == n == len(f["requests_log"]) for f in figures.values())
    for f in figures.values():
        assert 0.0 <= f["slo_met_pct"] <= 100.0 and 0.0 <= f["upstream_share_pct"] <= 100.0
        assert f["usd_per_1000"] > 0
    assert orc["slo_met_pct"] == 100.0   # the cheap aggregator's 0.9 s is within the 2.5 s SLO
    for i, (backend, usd, run, x, upstream_usd) in enumerate(orc["per_request"]):
        in_time = {p for p, f in figures.items()
                   if f["requests_log"][i][1] == "local" and (f["requests_log"][i][2] or 1e9) <= slo_s}
        assert 0.0 <= x <= 1.0 and (x == 0.0 or run in in_time) and backend in ("local", "cheap")
        assert usd <= upstream_usd + 1e-12 or not in_time   # local only where it saves
    assert orc["engine_rate_tok_s"] == max(orc["run_rates_tok_s"].values()) > 0
    assert orc["unlimited_usd_per_1000"] <= orc["usd_per_1000"] + 1e-9
    for p, f in figures.items():
        assert sum(r[1] for r in orc["per_request"]) <= run_bound_usd(f["requests_log"], orc, slo_s) + 1e-12, p
        if f["slo_met_pct"] == 100.0:
            assert orc["usd_per_1000"] <= f["usd_per_1000"] + 1e-9, p
    # every run's local requests carry the engine's prediction (the threshold rules' local route too)
    local = sum(row[1] == "local" and row[2] is not None for f in figures.values() for row in f["requests_log"])
    assert 0 < res["prediction_error"]["engine"]["n"] <= local and res["prediction_error"]["engine"]["p50_pct"] >= 0
    v = res["verdict"]
    assert v["oracle_usd_per_1000"] == orc["usd_per_1000"] and v["slo_usd_per_1000"] == figures["slo"]["usd_per_1000"]
    summary = (tmp_path / "summary.md").read_text()
    for name in ("| waiting>1", "| slo", "| oracle", "attainment_vs_cost.png"):
        assert name in summary
    assert (tmp_path / "attainment_vs_cost.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # recomputed from its results.json, serving nothing: the same oracle and verdict
    again = tmp_path / "again"
    assert cli.main(["spill", "--sweep", "--from-results", str(tmp_path / "results.json"), "--out", str(again)]) == 0
    res2 = json.loads((again / "results.json").read_text())
    assert res2["oracle"] == orc and res2["verdict"] == v and res2["figures"] == figures
    with pytest.raises(SystemExit) as exc:   # its SLO is the results' own
        cli.main(["spill", "--sweep", "--from-results", str(tmp_path / "results.json"), "--slo-ms", "1000",
                  "--out", str(again)])
    assert "drop --slo-ms" in str(exc.value.code)
