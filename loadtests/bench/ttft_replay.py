"""Replay TTFT calibrations on one run's own steps and predictions: a same-run comparison on a shared host.

``python -m loadtests.bench.ttft_accuracy --log-dir DIR --output-json RUN.json`` records the steps the engine
timed and each prediction's inputs (``engine/core/ttft_log.py``); ``python -m loadtests.bench.ttft_replay DIR
RUN.json`` then feeds each calibration below the run's steps up to the moment each prediction's state was
published, predicts that request again with the calibration's costs, and compares it with the TTFT the run
measured: p50 and p90 of |predicted - measured| / measured, each calibration on the same steps and the same
requests. The first line replays the engine's own calibration and must give the run's own errors (a check of
the replay). Add a calibration to ``CALIBRATIONS`` to judge a change to ``engine/core/ttft_calibration.py``
before running it.
"""

from __future__ import annotations

import argparse
import json
import sys

import msgspec

from engine.core import ttft_log
from engine.core.ttft import predict_ttft
from engine.core.ttft_calibration import TTFTCalibration

# name -> calibration given the model's pairs_per_token (``TTFTState.pooling_budget``'s); the first: the engine's
CALIBRATIONS = {
    "engine (tied attention price)": lambda ppt: TTFTCalibration(pairs_per_token=ppt),
    "attention priced apart": lambda ppt: TTFTCalibration(),
}


def matched(predictions: list[dict], records: list[dict]) -> list[tuple[dict, dict]]:
    """(logged prediction, the run's record of that request) for each measured generation: the record whose
    prompt length and predicted seconds (as the run rounded them) are the prediction's."""
    out = []
    for r in records:
        if r.get("warmup") or r.get("predicted_s") is None:
            continue
        same = [p for p in predictions if p["prompt"] == r["prompt"] and round(p["seconds"], 4) == r["predicted_s"]]
        if same:
            out.append((same[0], r))
    return out


def replay(steps: list[list], pairs: list[tuple[dict, dict]], calibration: TTFTCalibration) -> list[float]:
    """Each request's prediction again with ``calibration`` fed the steps logged before its state was published
    (the prediction's time less its ``elapsed_s``), in the order of ``pairs``' predictions: seconds."""
    out, i = [], 0
    for p, _ in sorted(pairs, key=lambda pr: pr[0]["t"]):
        published = p["t"] - (p["elapsed_s"] or 0.0)
        while i < len(steps) and steps[i][6] <= published:
            s = steps[i]
            calibration.observe(s[0], s[1], s[2], at=s[3], quad=s[4], chunks=s[5])
            i += 1
        c = calibration
        state = msgspec.structs.replace(p["state"], fixed_s=c.fixed_s, row_s=c.row_s, prefill_tok_s=c.prefill_tok_s,
                                        quad_s=c.quad_s, chunk_s=c.chunk_s, speed=c.speed)
        out.append(predict_ttft(state, p["prompt"], p["cached"], p["priority"], p["elapsed_s"],
                                p["arrival_tok_s"]).seconds)
    return out


def errors(pairs: list[tuple[dict, dict]], predicted: list[float]) -> dict:
    """p50 and p90 of |predicted - measured| / measured (``pairs`` in prediction order)."""
    ordered = sorted(pairs, key=lambda pr: pr[0]["t"])
    err = sorted(abs(s - r["measured_s"]) / r["measured_s"] for s, (_, r) in zip(predicted, ordered))
    rank = lambda q: err[min(int(q * len(err)), len(err) - 1)] if err else float("nan")   # noqa: E731
    return {"n": len(err), "p50": round(rank(0.5), 4), "p90": round(rank(0.9), 4)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log_dir", help="the run's --log-dir")
    parser.add_argument("run_json", help="the run's --output-json")
    args = parser.parse_args(argv)
    steps, predictions = ttft_log.load(args.log_dir)
    with open(args.run_json) as f:
        pairs = matched(predictions, json.load(f)["records"])
    if not pairs:
        raise SystemExit("no prediction of the log matches a measured request of the run")
    budget = pairs[0][0]["state"].pooling_budget
    ppt = budget[0] if budget else 0.0
    result = {"steps": len(steps), "requests": len(pairs),
              "as run": errors(pairs, [p["seconds"] for p, _ in sorted(pairs, key=lambda pr: pr[0]["t"])])}
    for name, make in CALIBRATIONS.items():
        result[name] = errors(pairs, replay(steps, pairs, make(ppt)))
    json.dump(result, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
