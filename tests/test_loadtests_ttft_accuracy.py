"""``python -m loadtests.bench.ttft_accuracy``'s pure parts: the workload it draws and the error figures."""

from __future__ import annotations

import random

import pytest

from loadtests.bench.ttft_accuracy import draw_generation, error_figures


def test_generations_span_the_prompt_range_log_uniformly_and_are_seeded():
    rng = random.Random(3)
    drawn = [draw_generation(rng, 0.25, 10, 6000) for _ in range(400)]
    lengths = [len(d["ids"]) for d in drawn]
    assert min(lengths) >= 10 and max(lengths) <= 6000
    assert sum(n < 245 for n in lengths) / 400 > 0.35   # log-uniform: under half the range's log midpoint ~half
    assert sum(n > 2000 for n in lengths) / 400 > 0.1
    long = [d for d in drawn if d["max_tokens"] >= 64]
    assert 0.15 < len(long) / 400 < 0.35 and all(d["max_tokens"] <= 160 for d in long)
    assert draw_generation(random.Random(3), 0.25, 10, 6000) == drawn[0]


def test_error_figures_are_nearest_rank_percentiles_of_the_relative_errors():
    records = [{"predicted_s": p, "measured_s": 1.0} for p in (1.1, 0.9, 1.3, 2.0, 0.5, 1.05, 1.0, 0.8, 1.2, 3.0)]
    records.append({"predicted_s": None, "measured_s": 1.0})   # no prediction (before the core's first state)
    f = error_figures(records)
    # |errors| sorted: 0, .05, .1, .1, .2, .2, .3, .5, 1.0, 2.0
    assert f["n"] == 10 and f["p50_abs_error"] == 0.2 and f["p90_abs_error"] == 1.0
    assert f["signed_median"] == 0.05 and f["max_abs_error"] == 2.0
    assert error_figures([]) == {"n": 0}


def test_speed_drift_is_set_apart_by_scaling_each_prediction_by_the_hosts_pace_over_its_wait():
    """A prediction of 1 s made at speed 1.0 whose wait ran at speed 2.0 (the host twice as slow) measured 2 s:
    off by 50 %, none of it the model's."""
    records = [{"predicted_s": 1.0, "measured_s": 2.0, "speed_at": 1.0, "speed_during": 2.0},
               {"predicted_s": 1.0, "measured_s": 1.2, "speed_at": 1.5, "speed_during": 1.5}]
    assert error_figures(records)["max_abs_error"] == 0.5
    drift = error_figures(records, speed_drift=True)
    assert drift["p50_abs_error"] == 0.0 and drift["max_abs_error"] == pytest.approx(0.1667, abs=1e-4)
