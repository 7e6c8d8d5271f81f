"""``slo`` routing: the cheapest target predicted to meet the TTFT SLO, else the fastest; thresholds still work;
the explanation quotes every target's prediction and cost; config paths."""

from __future__ import annotations

import pytest

from gateway.config.compile import load_config_text
from gateway.config.schema import ConfigError
from policies import (Condition, Match, Policy, RequestFeatures, Route, Rule, Signals, Slo, Target, TTFTEstimate,
                      decide)

LOCAL = Target("local", input_price=0.05, output_price=0.05)
DEEPSEEK = Target("deepseek", input_price=0.27, output_price=1.10)
HOLYSHEEP = Target("holysheep", input_price=0.40, output_price=1.50)
SLO_ROUTE = Route("chat", (LOCAL, DEEPSEEK, HOLYSHEEP), slo=Slo(1500))
F = RequestFeatures(model="m", prompt_tokens=1000, max_tokens=100)


def signals(**ttft) -> Signals:
    return Signals(ttft={k: v if isinstance(v, TTFTEstimate) else TTFTEstimate(v) for k, v in ttft.items()})


def test_cheapest_target_meeting_the_slo_wins():
    d = decide(Policy((), {"chat": SLO_ROUTE}, "chat"), F, signals(local=0.4, deepseek=0.8, holysheep=1.1))
    assert [t.id for t in d.attempts] == ["local", "deepseek", "holysheep"]
    d = decide(Policy((), {"chat": SLO_ROUTE}, "chat"), F, signals(local=2.4, deepseek=0.8, holysheep=1.1))
    assert [t.id for t in d.attempts] == ["deepseek", "holysheep", "local"]


def test_explanation_quotes_predictions_costs_and_the_slo():
    d = decide(Policy((), {"chat": SLO_ROUTE}, "chat"), F, signals(local=2.4, deepseek=0.8, holysheep=1.1),
               explain=True)
    reason = d.pick.reason
    assert reason.startswith("SLO ttft 1500 ms: cheapest predicted to meet it: deepseek")
    assert "local predicted 2.40 s > SLO 1.5 s" in reason
    assert "deepseek predicted 0.80 s <= SLO 1.5 s at 0.00038 USD" in reason   # 1000 x 0.27 + 100 x 1.10
    assert "holysheep predicted 1.10 s <= SLO 1.5 s at 0.00055 USD" in reason
    assert "chosen: deepseek" in d.explain()


def test_none_meets_the_slo_the_fastest_wins():
    d = decide(Policy((), {"chat": SLO_ROUTE}, "chat"), F, signals(local=2.4, deepseek=3.0, holysheep=1.9))
    assert d.pick.target.id == "holysheep"
    assert "none predicted to meet it; fastest: holysheep" in d.pick.reason
    assert [t.id for t in d.attempts] == ["holysheep", "local", "deepseek"]


def test_unknown_estimate_is_tried_and_failing_backend_is_not_counted_on():
    s = signals(local=2.4, holysheep=1.0, deepseek=TTFTEstimate(0.5, error_rate=0.6))
    d = decide(Policy((), {"chat": SLO_ROUTE}, "chat"), F, s)
    assert d.pick.target.id == "holysheep"
    assert "60 % errors" in d.pick.reason
    d = decide(Policy((), {"chat": SLO_ROUTE}, "chat"), F, signals(local=2.4))   # no estimate: assumed to meet
    assert d.pick.target.id == "deepseek" and "deepseek no estimate yet" in d.pick.reason


def test_unavailable_targets_are_skipped_and_the_rules_slo_replaces_the_routes():
    s = Signals(unavailable={"deepseek": "circuit open"}, ttft={"local": TTFTEstimate(1.0)})
    d = decide(Policy((), {"chat": SLO_ROUTE}, "chat"), F, s)
    assert d.pick.target.id == "local"
    tight = Rule("gold", "chat", Match((Condition("tenant", "eq", "gold"),)), slo=Slo(500))
    d = decide(Policy((tight,), {"chat": SLO_ROUTE}, "chat"), RequestFeatures(model="m", tenant="gold",
                                                                               prompt_tokens=1000), s)
    assert d.pick.target.id == "holysheep" and "SLO ttft 500 ms" in d.pick.reason
    assert "skipped" not in d.pick.reason and d.pick.skipped == {"deepseek": "circuit open"}


def test_thresholds_keep_working_beside_an_slo_route():
    routes = {"chat": SLO_ROUTE, "agg": Route("agg", (DEEPSEEK,))}
    busy = Rule("busy", "agg", Match((Condition("local.waiting", "gt", 8),)))
    p = Policy((busy,), routes, "chat")
    assert decide(p, F, Signals(local_waiting=9)).route == "agg"
    assert decide(p, F, signals(local=0.1)).pick.target.id == "local"
    assert "prompt_tokens" in p.fields() and p.has_slo()
    assert not Policy((busy,), {"agg": routes["agg"]}, "agg").has_slo()


CONFIG = """
models: [{name: m}]
backends:
  local: {type: local, prices: {input: 0.05, output: 0.05}}
  deepseek: {type: openai, base_url: "http://127.0.0.1:9/v1", prices: {input: 0.27, output: 1.10}}
routes:
  chat:
    targets: [{backend: local}, {backend: deepseek}]
    slo: {ttft_ms: %s}
policy:
  default_route: chat
  rules: [{name: gold, match: {tenant: gold}, route: chat, slo: {ttft_ms: 400}}]
"""


def test_config_compiles_slo_and_names_bad_values():
    compiled = load_config_text(CONFIG % 1500)
    assert compiled.policy.routes["chat"].slo == Slo(1500)
    assert compiled.policy.rules[0].slo == Slo(400)
    with pytest.raises(ConfigError, match=r"routes\.chat\.slo\.ttft_ms"):
        load_config_text(CONFIG % 0)
