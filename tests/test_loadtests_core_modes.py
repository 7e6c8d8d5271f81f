"""``tandem loadtest core-modes`` on the tiny random Llama: both servers
answer, every request succeeds, and the ratios table is printed."""

from __future__ import annotations

import pytest

from loadtests import cli
from tests.tiny_models import save_byte_level_llama


@pytest.mark.slow
def test_core_modes_tiny(tmp_path, capsys):
    model = save_byte_level_llama(tmp_path, printable_only=True)
    rc = cli.main(["core-modes", "--model", model, "--concurrency", "1,2", "--rounds", "2", "--num-prompts", "4",
                   "--max-tokens", "4", "--engine-arg=--kv-cache-memory=64MiB"])
    assert rc == 0
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[1:-1]]
            for line in out.splitlines() if line.startswith("| 1 ") or line.startswith("| 2 ")}
    assert sorted(rows) == ["1", "2"]
    for row in rows.values():
        assert row[3].endswith("x") and row[-1] == "0"  # a tok/s ratio, no errors
