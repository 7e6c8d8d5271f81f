"""The parity arithmetic (``gateway/rollouts/parity.py``) and the gates on it (``gateway/rollouts/gates.py``):
exact comparisons see a logprob change as a divergence, statistical ones measure agreement, KL and length; a
report aggregates both sides' errors and timings; gates judge only with enough pairs."""

from __future__ import annotations

import math

import pytest

from gateway.config.schema import GatesConfig
from gateway.rollouts.gates import all_hold, failing, judge
from gateway.rollouts.parity import Side, compare, first_divergence, report


def side(tokens, lps=None, ids=True, top=None, ttft=0.01, tpot=0.002):
    return Side(True, list(tokens), ids, list(lps if lps is not None else [-0.5] * len(tokens)), top or [],
                ttft, tpot)


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 9, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2


def test_exact_pairs_compare_token_ids_and_their_logprobs_bitwise():
    a = side([5, 6, 7], [-0.1, -0.2, -0.3])
    assert compare(a, side([5, 6, 7], [-0.1, -0.2, -0.3]))["identical"] is True
    r = compare(a, side([5, 6, 7], [-0.1, -0.2000001, -0.3]))        # same tokens, other numerics
    assert (r["kind"], r["identical"], r["first_div"]) == ("exact", False, 1)
    assert r["lp_delta"] == pytest.approx(1e-7)
    r = compare(a, side([5, 8, 7], [-0.1, -0.9, -0.3]))
    assert (r["first_div"], r["lp_delta"], r["agree"]) == (1, pytest.approx(0.7), pytest.approx(2 / 3))


def test_statistical_pairs_measure_agreement_kl_and_length():
    top_a = [{"x": math.log(0.5), "y": math.log(0.5)}] * 2
    top_b = [{"x": math.log(0.9), "y": math.log(0.1)}] * 2
    r = compare(side(["x", "x"], ids=False, top=top_a), side(["x", "x", "z"], ids=False, top=top_b))
    assert r["kind"] == "statistical" and r["first_div"] == 2 and r["len_ratio"] == 1.5
    assert r["agree"] == pytest.approx(2 / 3)
    kl = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    assert r["kl"] == pytest.approx(kl)


def test_report_and_gates():
    good = compare(side([1, 2]), side([1, 2], ttft=0.3))
    bad = compare(side([1, 2]), Side(False, error="HTTP 500"))
    p = report([good, good, bad], dropped=4)
    assert (p["kind"], p["requests"], p["compared"], p["exact_share"], p["shadow_dropped"]) == ("exact", 3, 2, 1.0, 4)
    assert p["candidate"]["error_rate"] == pytest.approx(1 / 3) and p["primary"]["error_rate"] == 0
    assert p["candidate"]["ttft_p95_ms"] == pytest.approx(300) and p["primary"]["tpot_p50_ms"] == pytest.approx(2)
    g = judge(GatesConfig(parity_min=0.99, error_rate_max=0.5, ttft_p95_max_ms=100, min_compared=2), p)
    assert g["parity_min"]["ok"] and g["error_rate_max"]["ok"] and g["ttft_p95_max_ms"]["ok"] is False
    assert "gate ttft_p95_max_ms: 300 against limit 100" in failing(g) and not all_hold(g)
    ratio = judge(GatesConfig(ttft_p50_ratio_max=20, min_compared=2), p)["ttft_p50_ratio_max"]
    assert ratio["value"] == pytest.approx(30) and ratio["ok"] is False          # 300 ms against 10 ms
    early = judge(GatesConfig(parity_min=0.99, min_compared=3), p)      # 2 pairs: not judged yet
    assert early["parity_min"]["ok"] is None and not failing(early) and not all_hold(early)
    assert report([])["exact_share"] is None


def test_config_refuses_wrong_shadow_and_rollout_references_and_the_shadow_tenant():
    from gateway.config.compile import load_config_text
    from gateway.config.schema import ConfigError

    base = ("models:\n  - name: m1\nbackends:\n  a: {type: openai, base_url: 'http://127.0.0.1:9/v1'}\n"
            "  b: {type: openai, base_url: 'http://127.0.0.1:9/v1'}\n"
            "routes:\n  main:\n    targets: [{backend: a, weight: 100}, {backend: b, weight: 0}]\n{shadow}"
            "policy: {default_route: main}\n{extra}")

    def text(shadow: str, extra: str) -> str:
        return base.replace("{shadow}", shadow).replace("{extra}", extra)

    ok = load_config_text(text("    shadow: {target: b}\n", "rollouts:\n  r: {route: main, candidate: b}\n"))
    assert ok.config.rollouts["r"].steps == [5.0, 25.0, 100.0]
    cases = [("    shadow: {target: ghost}\n", "", "routes.main.shadow.target"),
             ("", "rollouts:\n  r: {route: nope, candidate: b}\n", "rollouts.r.route"),
             ("", "rollouts:\n  r: {route: main, candidate: c}\n", "rollouts.r.candidate"),
             ("", "rollouts:\n  r: {route: main, candidate: b, steps: [50, 25]}\n", "rollouts.r.steps"),
             ("", "auth:\n  keys: [{tenant: shadow, sha256: '" + "0" * 64 + "'}]\n", "auth.keys[0].tenant"),
             # one rollout steers a route at a time; a name is one URL path segment, never a shadow's report key
             ("", "rollouts:\n  r: {route: main, candidate: b}\n  s: {route: main, candidate: b}\n",
              "rollouts.s.route"),
             ("", "rollouts:\n  shadow/main: {route: main, candidate: b}\n", "rollouts.shadow/main")]
    for shadow, extra, path in cases:
        with pytest.raises(ConfigError) as e:
            load_config_text(text(shadow, extra))
        assert path in str(e.value), (path, str(e.value))


def test_the_rollout_weight_series_is_the_routes_only_while_the_rollout_holds_it():
    """An operator trial promoted a rollout, released it and set the route's weights by hand: the gauge still said
    the candidate had 100 %. A rollout that no longer holds its route (released, aborted, rolled back) has its state
    series and no weight series."""
    from gateway.rollouts.metrics import ParityCollector

    c = ParityCollector()
    c.rollouts = [{"name": n, "route": "r", "candidate": "cand", "state": state, "weight": w}
                  for n, state, w in (("a", "running", 25.0), ("b", "promoted", 100.0), ("c", "released", 100.0),
                                      ("d", "rolled_back", 5.0), ("e", "paused", 25.0))]
    fams = {f.name: f for f in c.collect()}
    assert {s.labels["rollout"]: s.value for s in fams["tandem_rollout_weight"].samples} == {
        "a": 25.0, "b": 100.0, "e": 25.0}
    assert {s.labels["rollout"]: s.labels["state"] for s in fams["tandem_rollout_state"].samples} == {
        "a": "running", "b": "promoted", "c": "released", "d": "rolled_back", "e": "paused"}
