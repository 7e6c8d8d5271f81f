"""Summary statistics of a run: throughput and latency percentiles.

Percentiles use linear interpolation between order statistics (numpy's
default, "type 7" of Hyndman & Fan 1996), so p50 <= p90 <= p95 <= p99 always.
All times are seconds.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable

import numpy as np

from loadtests.client import RequestResult

PERCENTILES = (50, 90, 95, 99)


def percentiles(values: Iterable[float], ps: tuple[int, ...] = PERCENTILES) -> dict | None:
    """``{"count", "mean", "min", "max", "p50", "p90", "p95", "p99"}`` of
    ``values``, or None when there are none."""
    arr = np.asarray(list(values), dtype=np.float64)
    if arr.size == 0:
        return None
    out = {"count": int(arr.size), "mean": float(arr.mean()), "min": float(arr.min()), "max": float(arr.max())}
    for p, v in zip(ps, np.percentile(arr, ps)):
        out[f"p{p}"] = float(v)
    return out


def summarize(results: list[RequestResult], t_start: float, t_end: float) -> dict:
    """Everything a report shows about one run.

    Args:
        results: every request's result.
        t_start, t_end: the run's bounds (perf_counter seconds).

    Returns:
        dict with ``num_requests``, ``num_ok``, ``num_errors``, ``errors_by_kind``,
        ``duration_s``, ``requests_per_s`` and ``output_tokens_per_s`` (successful
        requests only, over the run's duration), ``prompt_tokens``,
        ``output_tokens``, ``ttft_s``, ``tpot_s``, ``itl_s``, ``e2e_s`` (each a
        :func:`percentiles` dict or None) and ``backends`` (``x-tandem-backend``
        value -> count of successful requests).
    """
    ok = [r for r in results if r.ok]
    duration = max(1e-9, t_end - t_start)
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "num_requests": len(results),
        "num_ok": len(ok),
        "num_errors": len(results) - len(ok),
        "errors_by_kind": dict(Counter(r.error or "unknown" for r in results if not r.ok)),
        "duration_s": duration,
        "requests_per_s": len(ok) / duration,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / duration,
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "ttft_s": percentiles(r.ttft for r in ok if r.ttft is not None),
        "tpot_s": percentiles(t for t in (r.tpot for r in ok) if t is not None),
        "itl_s": percentiles(x for r in ok for x in r.itls),
        "e2e_s": percentiles(r.e2e for r in ok),
        "backends": dict(Counter(r.backend for r in ok if r.backend is not None)),
    }


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``, or None when either is missing or ``b`` is 0."""
    if a is None or b is None or b == 0:
        return None
    return a / b
