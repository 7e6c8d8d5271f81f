"""The spill scenario's arrivals and figures (pure functions; the scenario itself runs as ``tandem loadtest
spill``)."""

from __future__ import annotations

import pytest

from loadtests.scenarios.prompt_cache import figures
from loadtests.scenarios.spill import Arrival, Outcome, analyse, arrivals, fluid_upstream_share, ramp_rate


def test_arrivals_ramp_up_to_the_peak_and_back_with_returning_conversations():
    a = arrivals(capacity=2.0, duration=300.0, low=0.3, high=3.0, seed=1)
    assert a == arrivals(capacity=2.0, duration=300.0, low=0.3, high=3.0, seed=1)   # the same for every policy
    start, peak, end = (sum(lo <= x.at < lo + 60 for x in a) for lo in (0, 120, 240))   # expected 1 : 3.3 : 1
    assert peak > 2 * start and peak > 2 * end
    assert len(a) == pytest.approx(2.0 * 300 * (0.3 + 3.0) / 2, rel=0.15)
    turns = {}
    for x in a:
        assert x.messages[-1]["role"] == "user"
        turns.setdefault(x.conversation, []).append(x.messages)
    multi = [ms for ms in turns.values() if len(ms) > 1]
    assert multi and all(later[:len(earlier)] == earlier for ms in multi for earlier, later in zip(ms, ms[1:]))
    seen: dict[int, int] = {}
    for x in a:   # the n-th request of a conversation is its n-th turn
        seen[x.conversation] = seen.get(x.conversation, 0) + 1
        assert x.turn == seen[x.conversation]
    assert ramp_rate(150, 300, 0.3, 3.0) == pytest.approx(3.0) and ramp_rate(0, 300, 0.3, 3.0) == pytest.approx(0.3)


def test_analyse_counts_the_slo_cost_upstream_share_and_prediction_error():
    prices = {"local": {"input": 0.0, "output": 0.0}, "agg": {"input": 1.0, "output": 2.0}}
    out = [Outcome(True, 0.5, "local", 100, 10, 0.4), Outcome(True, 2.0, "local", 100, 10, 1.0),
           Outcome(True, 0.3, "agg", 1000, 100), Outcome(False, None, "")]
    f = analyse(out, slo_s=1.0, prices=prices)
    assert f["slo_met_pct"] == 50.0 and f["failed"] == 1 and f["upstream_share_pct"] == 25.0
    assert f["usd_per_1000"] == pytest.approx(1000 * (1000 * 1.0 + 100 * 2.0) / 1e6 / 4)
    assert f["prediction_error_p50_pct"] == pytest.approx(35.0)   # errors 20 % and 50 %
    handed = Outcome(True, 0.3, "agg", 10, 1, explain="local (hand over to agg at 1.35 s ...)", attempts=2)
    retried = Outcome(True, 0.3, "agg", 10, 1, attempts=2)   # a failed first attempt, no hand-over
    assert analyse([handed, retried], slo_s=1.0, prices=prices)["handed_over_pct"] == 50.0


def test_prompt_cache_figures_price_cached_tokens_at_the_cached_rate():
    f = figures({"requests": 2, "failed": 0, "prompt": 1000, "cached": 800, "completion": 20})
    assert f["cached_share_pct"] == 80.0
    assert f["usd_per_1000"] == pytest.approx(1000 * (200 * 0.30 + 800 * 0.03 + 20 * 1.20) / 1e6 / 2)


def test_fluid_upstream_share_sends_what_an_engine_of_that_capacity_would_serve_late():
    burst = [Arrival(0.0, [], i) for i in range(4)] + [Arrival(10.0, [], 4)]
    # capacity 1 req/s, SLO 2.5 s: two of the burst are served in time, two wait past it; the engine is idle by 10 s
    assert fluid_upstream_share(burst, capacity=1.0, slo_s=2.5) == pytest.approx(40.0)
    assert fluid_upstream_share(burst, capacity=10.0, slo_s=2.5) == 0.0


def test_slo_replicas_judges_each_request_against_the_replicas_probed_then():
    from loadtests.scenarios.slo_replicas import Probe, Sent, judge

    probes = [Probe("r0", 0.0, 5.0), Probe("r1", 0.0, 0.2),       # t=0: r0 busy, r1 meets
              Probe("r0", 10.0, 5.0), Probe("r1", 10.0, None),    # t=10: neither (r1's probe failed)
              Probe("r0", 20.0, 0.3), Probe("r1", 20.0, 0.4)]     # t=20: both meet
    prices = {"r0": {"input": 0.0, "output": 0.0}, "r1": {"input": 0.0, "output": 0.0},
              "cheap": {"input": 1.0, "output": 1.0}}
    sent = [Sent("a", Outcome(True, 0.3, "r1", 10, 1, at=0.4)),     # right: r1 met it
            Sent("a", Outcome(True, 4.0, "r0", 10, 1, at=1.0)),     # wrong: r0 missed, r1 met
            Sent("a", Outcome(True, 0.9, "cheap", 10, 1, at=0.2)),  # a missed saving
            Sent("b", Outcome(True, 0.9, "cheap", 10, 1, at=9.0)),  # right: no replica met then
            Sent("b", Outcome(True, 3.0, "r0", 10, 1, at=11.0)),    # none met: not counted either way
            Sent("c", Outcome(False, None, "", at=19.0))]           # failed while both met: wrong
    f = judge(sent, probes, slo_s=1.0, prices=prices)
    assert f["a"]["a_replica_met"] == 3 and f["a"]["right_replica"] == 1 and f["a"]["missed_saving"] == 1
    assert f["b"]["a_replica_met"] == 0 and f["b"]["right_replica_pct"] is None
    assert f["all"]["requests"] == 6 and f["all"]["a_replica_met"] == 4 and f["all"]["right_replica"] == 1
    assert f["all"]["right_replica_pct"] == 25.0 and f["all"]["to"] == {"r0": 2, "r1": 1, "cheap": 2, "failed": 1}
    assert [w["at_s"] for w in f["all"]["wrong"]] == [1.0, 0.2, 19.0] and f["all"]["wrong"][0]["replicas_met"] == ["r1"]
    assert f["a"]["slo_met_pct"] == pytest.approx(200 / 3)
    assert f["b"]["usd_per_1000"] == pytest.approx(1000 * 11 / 1e6 / 2)
