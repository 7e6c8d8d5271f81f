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


def test_an_engine_that_can_withdraw_gets_a_hand_over_to_the_next_target_meeting_the_slo():
    """The co-located engine (its estimate has a ``scale``) first: a checkpoint at the SLO less the next target's
    checked TTFT and the margin; none when nothing else meets the SLO, when the first cannot withdraw, or when the
    next target leaves no time."""
    from policies.slo import HANDOVER_MARGIN_S

    local = TTFTEstimate(0.8, high=1.0, scale=1.25)
    d = decide(Policy((), {"chat": SLO_ROUTE}, "chat"), F, signals(local=local, deepseek=0.9, holysheep=0.3))
    h = d.pick.handover
    assert [t.id for t in d.attempts][:2] == ["local", "deepseek"] and h is not None
    assert (h.to, h.by_s, h.scale) == ("deepseek", 1.5, 1.25)
    assert h.after_s == pytest.approx(1.5 - 0.9 - HANDOVER_MARGIN_S)
    assert "cheapest predicted to meet it: local (hand over to deepseek at 0.25 s if then predicted late)" \
        in d.pick.reason
    slow = decide(Policy((), {"chat": SLO_ROUTE}, "chat"), F, signals(local=local, deepseek=2.0, holysheep=1.6))
    assert slow.pick.handover is None                       # nothing else meets the SLO
    plain = decide(Policy((), {"chat": SLO_ROUTE}, "chat"), F, signals(local=0.8, deepseek=0.9, holysheep=0.3))
    assert plain.pick.handover is None                      # a replica's estimate: it cannot withdraw
    late = decide(Policy((), {"chat": SLO_ROUTE}, "chat"), F, signals(local=local, deepseek=1.4, holysheep=1.45))
    assert late.pick.handover is None                       # 1.5 - 1.4 - margin <= 0
    unknown = decide(Policy((), {"chat": SLO_ROUTE}, "chat"), F,
                     signals(local=local, deepseek=TTFTEstimate(None), holysheep=0.3))
    assert [t.id for t in unknown.attempts][:2] == ["local", "deepseek"] and unknown.pick.handover is None
    upstream_first = decide(Policy((), {"chat": SLO_ROUTE}, "chat"), F,
                            signals(local=TTFTEstimate(2.0, high=2.4, scale=1.2), deepseek=0.9, holysheep=0.3))
    assert upstream_first.pick.handover is None


def test_the_slo_is_checked_against_the_predictions_high_figure():
    """The engine's prediction is a median; its high figure (plus its own recent p90 error) decides."""
    near = TTFTEstimate(1.3, high=1.7)
    d = decide(Policy((), {"chat": SLO_ROUTE}, "chat"), F, signals(local=near, deepseek=0.8), explain=True)
    assert d.pick.target.id == "deepseek"
    assert "local predicted 1.30 s (p90 1.70 s) > SLO 1.5 s" in d.pick.reason
    d = decide(Policy((), {"chat": SLO_ROUTE}, "chat"), F, signals(local=TTFTEstimate(1.3, high=1.45), deepseek=0.8))
    assert d.pick.target.id == "local"


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


# ------------------------------------------------------------------ sticky (prompt-cache affinity)
A, B, C = (Target(n, input_price=1.0, output_price=2.0, cached_input_price=0.1) for n in ("a", "b", "c"))


def conv(first: str, turns: int) -> str:
    from policies import prefix_text
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": first}]
    for i in range(turns):
        msgs += [{"role": "assistant", "content": f"answer {i}"}, {"role": "user", "content": f"more {i}"}]
    return prefix_text({"messages": msgs})


def test_sticky_prefix_keeps_every_turn_of_a_conversation_on_one_target():
    sticky = Policy((), {"r": Route("r", (A, B, C), sticky="prefix")}, "r")
    plain = Policy((), {"r": Route("r", (A, B, C))}, "r")
    homes, plain_picks = set(), set()
    for turn in range(6):
        f = RequestFeatures(model="m", request_id=f"req-{turn}", prefix_text=conv("question one", turn))
        homes.add(decide(sticky, f, Signals()).pick.target.id)
        plain_picks.add(decide(plain, f, Signals()).pick.target.id)
    assert len(homes) == 1 and len(plain_picks) > 1   # without it each request id lands anywhere
    spread = {decide(sticky, RequestFeatures(model="m", prefix_text=conv(f"topic {i}", 0)), Signals()).pick.target.id
              for i in range(30)}
    assert spread == {"a", "b", "c"}   # conversations still spread over the targets by weight


def test_sticky_home_breaks_on_an_open_breaker_and_comes_back():
    p = Policy((), {"r": Route("r", (A, B, C), sticky="user")}, "r")
    f = RequestFeatures(model="m", user="alice")
    home = decide(p, f, Signals()).pick.target.id
    moved = decide(p, f, Signals(unavailable={home: "circuit open"})).pick.target.id
    assert moved != home
    assert decide(p, f, Signals()).pick.target.id == home


def test_sticky_slo_route_prices_the_home_at_its_cached_rate_but_not_past_the_slo():
    route = Route("r", (A, B, C), slo=Slo(1000), sticky="user")
    p = Policy((), {"r": route}, "r")
    f = RequestFeatures(model="m", user="bob", prompt_tokens=2000, max_tokens=10)
    home = decide(p, f, Signals()).pick.home
    d = decide(p, f, Signals(), explain=True)
    assert d.pick.target.id == home and f"{home} no estimate yet at 0.00022 USD (prompt cache home)" in d.pick.reason
    slow = decide(p, f, signals(**{home: 3.0}))   # the home is under load: predicted past the SLO
    assert slow.pick.target.id != home and slow.attempts[-1].id == home


def test_a_tpot_target_passes_over_a_target_predicted_to_decode_too_slowly():
    """``slo: {ttft_ms, tpot_ms}``: the local engine meets the TTFT but its predicted TPOT at its batch does not
    meet the TPOT target; the cheapest aggregator meeting both wins and the explanation quotes each TPOT. A
    target without a TPOT figure is assumed to meet it."""
    route = Route("chat", (LOCAL, DEEPSEEK, HOLYSHEEP), slo=Slo(1500, tpot_ms=50))
    est = signals(local=TTFTEstimate(0.4, tpot=0.080), deepseek=TTFTEstimate(0.8, tpot=0.060),
                  holysheep=TTFTEstimate(1.1))
    d = decide(Policy((), {"chat": route}, "chat"), F, est, explain=True)
    assert [t.id for t in d.attempts] == ["holysheep", "local", "deepseek"]
    reason = d.pick.reason
    assert reason.startswith("SLO ttft 1500 ms, tpot 50 ms: cheapest predicted to meet it: holysheep")
    assert "local predicted 0.40 s <= SLO 1.5 s, TPOT 80 ms > 50 ms" in reason
    est = signals(local=TTFTEstimate(0.4, tpot=0.030), deepseek=TTFTEstimate(0.8, tpot=0.060))
    assert decide(Policy((), {"chat": route}, "chat"), F, est).attempts[0].id == "local"
    assert decide(Policy((), {"chat": SLO_ROUTE}, "chat"), F, signals(
        local=TTFTEstimate(0.4, tpot=0.080))).attempts[0].id == "local"   # no TPOT target: TPOT ignored


def test_tpot_ms_in_config_reaches_the_policy():
    cfg = load_config_text(CONFIG_WITH_TPOT)
    assert cfg.policy.routes["chat"].slo == Slo(1500, tpot_ms=40)
    with pytest.raises(ConfigError, match="tpot_ms"):
        load_config_text(CONFIG_WITH_TPOT.replace("tpot_ms: 40", "tpot_ms: 0"))


CONFIG_WITH_TPOT = CONFIG.replace("slo: {ttft_ms: %s}", "slo: {ttft_ms: 1500, tpot_ms: 40}")
