"""A record of the steps the TTFT calibration observes and of the predictions made from them, for replaying other
calibrations on the same run (``loadtests/bench/ttft_replay.py``).

On a shared host two runs of two builds compare the host's load more than the builds (the ttft_accuracy runs of
2026-12-04: one build's p50 error 18 % in one run and 61 % in the next). With ``TANDEM_TTFT_LOG_DIR`` set, the core
appends each step it times (``steps-<pid>.jsonl``: seconds, prefill tokens, decode rows, clock, ``quad_of``,
chunks, then ``time.monotonic()``) and the front end each prediction (``predictions-<pid>.jsonl``: the state it
read, the request, the answer, ``time.monotonic()``); a replay feeds a calibration that run's steps up to each
prediction and predicts again. Off (no files, no cost) unless the variable is set.
"""

from __future__ import annotations

import glob
import json
import os
import time

import msgspec

from engine.core.ttft import TTFTState

LOG_DIR_ENV = "TANDEM_TTFT_LOG_DIR"


class TTFTLog:
    """Appends steps and predictions as JSON lines under ``directory`` (one file of each per process)."""

    def __init__(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        self.directory = directory
        self._files: dict[str, object] = {}

    def _write(self, kind: str, record) -> None:
        f = self._files.get(kind)
        if f is None:
            f = self._files[kind] = open(os.path.join(self.directory, f"{kind}-{os.getpid()}.jsonl"), "a",
                                         buffering=1)
        f.write(json.dumps(record) + "\n")

    def step(self, seconds: float, prefill_tokens: int, decode_rows: int, at: float | None, quad: float,
             chunks: int, now: float | None = None) -> None:
        """One step as ``TTFTCalibration.observe`` takes it, observed at ``now`` (``time.monotonic()`` seconds;
        None: now)."""
        self._write("steps", [seconds, prefill_tokens, decode_rows, at, quad, chunks,
                              time.monotonic() if now is None else now])

    def prediction(self, state, prompt_tokens: int, cached_tokens: int, priority: int, elapsed_s: float | None,
                   arrival_tok_s: float, seconds: float, now: float | None = None) -> None:
        """One ``predict_ttft`` call (its arguments, ``state`` a ``TTFTState``) and its answer in ``seconds``, made
        at ``now`` (``time.monotonic()`` seconds; None: now)."""
        state = msgspec.structs.replace(state, stored=[], removed=[], resync=None)   # the prefix cache's events
        self._write("predictions", {   # JSON keeps an infinite cost (a PoolingBudget's alone_cost); msgspec's null
            "t": time.monotonic() if now is None else now, "state": msgspec.to_builtins(state),
            "prompt": prompt_tokens, "cached": cached_tokens, "priority": priority, "elapsed_s": elapsed_s,
            "arrival_tok_s": arrival_tok_s, "seconds": seconds})


def from_env() -> TTFTLog | None:
    """The log ``TANDEM_TTFT_LOG_DIR`` names, or None when it is unset or empty."""
    directory = os.environ.get(LOG_DIR_ENV)
    return TTFTLog(directory) if directory else None


def load(directory: str) -> tuple[list[list], list[dict]]:
    """(steps in the order they were observed, predictions in the order they were made) under ``directory``;
    a prediction's ``state`` as a ``TTFTState`` again."""
    def lines(kind: str) -> list:
        return [json.loads(line) for path in glob.glob(os.path.join(directory, f"{kind}-*.jsonl"))
                for line in open(path)]
    predictions = sorted(lines("predictions"), key=lambda p: p["t"])
    for p in predictions:
        p["state"] = msgspec.convert(p["state"], TTFTState)
    return sorted(lines("steps"), key=lambda s: s[6]), predictions
