"""``python -m loadtests.bench.responses_chain`` end to end, small: two real gateways on SmolLM2, a chain of three
turns that passes the bounded one's ``server.max_body_size``; every turn answered by both (the bench raises on any
other status), one figure row per turn."""

from __future__ import annotations

import json

from loadtests.bench.responses_chain import main


def test_a_small_chain_runs_on_both_gateways_and_reports_each_turn(tmp_path):
    out = tmp_path / "chain.json"
    main(["--turns", "3", "--items", "6", "--words", "40", "--bound", "2KiB", "--json", str(out)])
    rows = json.loads(out.read_text())["turns"]
    assert [r["turn"] for r in rows] == [0, 1, 2]
    assert all(r["bounded_s"] > 0 and r["whole_s"] > 0 and r["bounded_rss_mib"] > 0 for r in rows)
