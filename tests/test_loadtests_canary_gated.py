"""``tandem loadtest canary --gated`` (issue 31, item 5): the report's arithmetic, and one short run end to end
(real processes: two loadtests upstreams and ``tandem serve``) whose healthy candidate is promoted and whose
report carries the history, the parity and the weight timeline PNG."""

from __future__ import annotations

import json

import pytest

from loadtests import cli
from loadtests.client import RequestResult
from loadtests.scenarios.canary_gated import last_gates, observed_share

pytestmark = pytest.mark.slow   # a large workload: tests/conftest.py runs these files first


def test_observed_share_and_last_gates():
    rs = [RequestResult(ok=True, start=10.0 + 0.25 * i, e2e=0.01, backend="canary" if i % 4 == 0 else "stable")
          for i in range(8)] + [RequestResult(ok=False, start=10.1, e2e=0.01)]
    assert observed_share(rs, 10.0) == [(0.0, 25.0, 4), (1.0, 25.0, 4)]
    g1, g2 = {"parity_min": {"ok": None}}, {"parity_min": {"ok": True}}
    tl = [(0.0, 5.0, "running", g1), (0.5, 5.0, "running", g2), (1.0, 25.0, "running", g1)]
    assert last_gates(tl) == [(5.0, "running", g2), (25.0, "running", g1)]


def test_a_short_gated_run_promotes_a_healthy_candidate(tmp_path):
    rc = cli.main(["canary", "--gated", "--phases", "50,100", "--hold-s", "1", "--duration", "10",
                   "--concurrency", "4", "--no-progress", "--out", str(tmp_path)])
    res = json.loads((tmp_path / "results.json").read_text())
    r = res["rollout"]
    assert rc == 0 and r["state"] == "promoted", r["history"]
    assert [h["weight"] for h in r["history"]][:2] == [50, 100]
    assert res["observed_share"][-1][1] == 100.0                 # after the unrelated reload, still the canary
    assert r["parity"]["compared"] > 0 and r["parity"]["token_agreement"] == pytest.approx(1.0)
    assert (tmp_path / "weight_timeline.png").stat().st_size > 0
    assert "## History" in (tmp_path / "summary.md").read_text()
    # the config-change phases (issue 47): the candidate's removal mid-rollout refused naming the rollout, an
    # unrelated reload after the promotion applied with the rollout still deciding the route
    phases = {p: (status, why) for _, p, status, why in res["decisions"]}
    assert phases["reload removing the candidate mid-rollout"][0] == 409, phases
    assert "rollout gated (running)" in phases["reload removing the candidate mid-rollout"][1]
    assert phases["unrelated reload after promotion"][0] == 200
    assert "rollout gated (promoted)" in phases["unrelated reload after promotion"][1]
    assert "## Weights the requests saw (per second)" in (tmp_path / "summary.md").read_text()
