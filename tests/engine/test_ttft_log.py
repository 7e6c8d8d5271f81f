"""The TTFT log and its replay (``engine/core/ttft_log.py``, ``loadtests/bench/ttft_replay.py``): a calibration
replayed on a run's logged steps and predictions predicts what the run predicted."""

from __future__ import annotations

import random

import pytest

from engine.core import ttft_log
from engine.core.step_cost import PoolingBudget
from engine.core.ttft import predict_ttft
from engine.core.ttft_calibration import TTFTCalibration
from loadtests.bench.ttft_replay import errors, matched, replay
from tests.engine.test_ttft import ScriptedEngine, tokens
from tests.engine.test_ttft_sim import P, _te_cost


def test_a_replay_of_the_runs_own_calibration_gives_its_predictions(tmp_path, monkeypatch):
    """A scripted engine whose calibration learns from its steps (costs in token-equivalents, +-20 % noise), its
    steps and predictions logged: replaying a calibration built as the engine's on the log predicts every request
    as the run did, and one built otherwise (the attention priced apart) does not."""
    monkeypatch.setenv(ttft_log.LOG_DIR_ENV, str(tmp_path))
    log = ttft_log.from_env()
    rng = random.Random(4)
    eng = ScriptedEngine(chunk_cost=lambda d, c, rows: _te_cost(d, c, rows) * rng.uniform(0.8, 1.2),
                         max_num_batched_tokens=512, pooling_budget=PoolingBudget(P, 8.0))
    eng.cal = TTFTCalibration(pairs_per_token=P)
    observe = eng.cal.observe

    def logged(seconds, tokens_, rows, at=None, quad=0.0, chunks=0):
        log.step(seconds, tokens_, rows, at, quad, chunks, now=eng.now)
        observe(seconds, tokens_, rows, at=at, quad=quad, chunks=chunks)

    eng.cal.observe = logged
    eng.publish()
    records, lengths = [], rng.sample(range(20, 1500), 25)
    for i, n in enumerate(lengths):
        prompt = tokens(rng, n)
        p = predict_ttft(eng.state, n, 0).seconds
        log.prediction(eng.state, n, 0, 0, None, 0.0, p, now=eng.now)
        eng.add(f"r{i}", prompt, max_tokens=rng.choice([4, 40]))
        records.append({"id": f"r{i}", "prompt": n, "predicted_s": round(p, 4)})
        for _ in range(rng.randrange(1, 12)):
            eng.step()
    eng.run()
    for r in records:
        r["measured_s"] = eng.ttft(r["id"])
    steps, predictions = ttft_log.load(str(tmp_path))
    pairs = matched(predictions, records)
    assert len(pairs) == len(records) and len(steps) > 100
    as_run = [p["seconds"] for p, _ in sorted(pairs, key=lambda pr: pr[0]["t"])]
    assert replay(steps, pairs, TTFTCalibration(pairs_per_token=P)) == pytest.approx(as_run, rel=1e-9)
    assert replay(steps, pairs, TTFTCalibration()) != pytest.approx(as_run, rel=1e-3)
    assert errors(pairs, as_run)["n"] == len(records)
