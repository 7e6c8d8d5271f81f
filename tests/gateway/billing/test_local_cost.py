"""The local engine's price from its machine's cost per hour and the tokens it served (scripted engine stats)."""

from __future__ import annotations

import pytest

from engine.core.core_messages import EngineStats
from engine.core.ttft import TTFTState
from gateway.billing.local_cost import LocalCost, token_prices
from gateway.billing.prices import Price
from policies import Policy, RequestFeatures, Route, Signals, Target, decide


def stats(prompt_total: int, generation_total: int, decode_rows: int = 4) -> EngineStats:
    state = TTFTState(block_size=16, budget=512, max_num_seqs=8, num_running=decode_rows, decode_rows=decode_rows,
                      queued_prefill=[], running_prefill=0, fcfs=True, free_blocks=100, typical_decode=0.0,
                      step_s=0.04, prefill_tok_s=2000.0)
    return EngineStats(num_running=decode_rows, num_waiting=0, kv_cache_usage=0.1, prefix_cache_queries=0,
                       prefix_cache_hits=0, num_preemptions=0, tokens_in_flight=0, prompt_tokens_total=prompt_total,
                       generation_tokens_total=generation_total, ttft=state)


def test_token_prices_spread_the_money_by_measured_time():
    # 1 USD over 1000 prefill tokens (0.5 ms each) and 100 decode tokens (10 ms each): 1.5 s of work
    inp, out = token_prices(1.0, 1000, 100, 0.0005, 0.010)
    assert inp == pytest.approx(1 / 1.5 * 0.0005 * 1e6)
    assert out == pytest.approx(1 / 1.5 * 0.010 * 1e6)
    assert (1000 * inp + 100 * out) / 1e6 == pytest.approx(1.0)   # the whole interval's cost, no more
    assert token_prices(1.0, 0, 0, 0.0005, 0.01) is None


def test_a_busy_engine_is_cheap_per_token_and_an_idle_one_dear():
    lc = LocalCost(usd_per_hour=3.6, interval_s=10, initial=Price(0.1, 0.1))
    assert lc.observe(stats(0, 0), 0.0) == Price(0.1, 0.1)        # configured prices until an interval ends
    busy = lc.observe(stats(200_000, 20_000), 10.0)                # 0.01 USD over many tokens
    quiet = lc.observe(stats(201_000, 20_100), 20.0)               # the same 0.01 USD over few
    assert quiet.input > 50 * busy.input and quiet.output > 50 * busy.output
    assert (200_000 * busy.input + 20_000 * busy.output) / 1e6 == pytest.approx(0.01)
    assert lc.observe(stats(201_000, 20_100), 30.0) == quiet       # nothing served: the last prices hold
    assert lc.observe(stats(201_000, 20_100), 35.0) == quiet       # mid-interval: unchanged


def test_cheapest_ranks_the_local_engine_by_its_price_now():
    route = Route("r", (Target("local", input_price=0.0, output_price=0.0), Target("agg", input_price=0.2,
                                                                                   output_price=0.8)),
                  select="cheapest")
    p = Policy((), {"r": route}, "r")
    f = RequestFeatures(model="m")
    assert decide(p, f, Signals()).pick.target.id == "local"
    assert decide(p, f, Signals(prices={"local": (5.0, 5.0)})).pick.target.id == "agg"
    assert decide(p, f, Signals(prices={"local": (0.01, 0.05)})).pick.target.id == "local"


def test_an_answer_is_billed_at_the_price_of_the_interval_it_was_computed_in():
    """A FinOps trial (36 USD/h, 5 s intervals): after 6 s idle with two tiny answers, a 211 + 64-token answer of
    1.64 s was billed at the idle interval's price, 1.21 USD for 0.016 USD of machine time (the ledger 3.7 times the
    machine's cost). An answer is billed at its own interval's price as it stands when it ends, and an interval
    closed late is charged ``interval_s``, not all the time since."""
    usd_per_s = 36 / 3600
    lc = LocalCost(usd_per_hour=36, interval_s=5, initial=Price(1, 2))
    lc.observe(stats(0, 0), 0.0)                                    # the first interval opens
    tiny = lc.billed(stats(2, 2), 0.2)                              # two "hi" answers, 0.2 s in
    assert (2 * tiny.input + 2 * tiny.output) / 1e6 == pytest.approx(0.2 * usd_per_s)
    idle = lc.observe(stats(2, 2), 6.0)                             # closed late: 5 s charged, not 6
    assert (2 * idle.input + 2 * idle.output) / 1e6 == pytest.approx(5 * usd_per_s)
    after = lc.billed(stats(2 + 211, 2 + 64), 7.64)                 # its own interval: 1.64 s over its tokens
    assert (211 * after.input + 64 * after.output) / 1e6 == pytest.approx(1.64 * usd_per_s)
    assert after.input < idle.input / 20
    late = lc.observe(stats(213, 66), 3600.0)                       # closed an hour later: charged 5 s
    assert (211 * late.input + 64 * late.output) / 1e6 == pytest.approx(5 * usd_per_s)


def test_a_budget_reserves_the_local_engine_at_the_price_it_bills_now():
    """A budget trial's local answers were reserved at the configured prices (0.000035 USD) while billed at the
    price from ``local.cost``: a 0.05 USD budget went to 0.063 in one request. The reservation takes the live one."""
    from types import SimpleNamespace

    from gateway.billing.prices import cost_nusd
    from gateway.request.admission import estimate_nusd

    configured = SimpleNamespace(input=1.0, output=2.0, cached_input=None)
    cfg = SimpleNamespace(backends={"local": SimpleNamespace(prices=configured),
                                    "agg": SimpleNamespace(prices=SimpleNamespace(input=3.0, output=4.0,
                                                                                  cached_input=None))})
    targets = [Target("local"), Target("agg")]
    assert estimate_nusd(cfg, targets, 100, 10) == cost_nusd(Price(3.0, 4.0), 100, 10)
    live = {"local": Price(500.0, 900.0)}
    assert estimate_nusd(cfg, targets, 100, 10, live) == cost_nusd(Price(500.0, 900.0), 100, 10)
