"""Predicted TTFT per backend for ``slo`` routing (``policies/slo.py``).

- The co-located engine: its own prediction for this request at admission (``AsyncEngine.predict_ttft``, from
  the core's state after its last step; ``engine/ttft.py``), read in-process: no scrape, no lag.
- An upstream: a rolling estimate from this gateway's own calls to it (``UpstreamLatency.track`` wraps the
  attempt loop's calls): the 90th percentile TTFT of its last ``WINDOW`` answers (time to the first streamed
  chunk, or to the whole body), and the share of those calls that failed (transport error, 429, 5xx). A high
  percentile, not the mean: an SLO is met per request.
"""

from __future__ import annotations

import time
from collections import deque

from gateway.resilience.outcomes import UpstreamResponse
from policies import TTFTEstimate

# Calls remembered per backend: enough for a stable 90th percentile, few enough to follow a provider that slows.
WINDOW = 50
PERCENTILE = 0.9


class UpstreamLatency:
    """Rolling TTFT and error share per upstream backend name (state of the ``Gateway`` object)."""

    def __init__(self) -> None:
        self._calls: dict[str, deque] = {}   # backend -> (ttft seconds or None on failure)

    def observe(self, backend: str, ttft_s: float | None) -> None:
        """One call to ``backend``: its TTFT in seconds, or None when it failed."""
        self._calls.setdefault(backend, deque(maxlen=WINDOW)).append(ttft_s)

    def estimate(self, backend: str) -> TTFTEstimate:
        """The backend's rolling estimate (seconds None: no successful call yet)."""
        calls = self._calls.get(backend)
        if not calls:
            return TTFTEstimate(None, "no calls yet")
        ok = sorted(c for c in calls if c is not None)
        errors = (len(calls) - len(ok)) / len(calls)
        if not ok:
            return TTFTEstimate(None, f"{len(calls)} calls, all failed", errors)
        p = ok[min(int(PERCENTILE * len(ok)), len(ok) - 1)]
        return TTFTEstimate(p, f"p90 of its last {len(ok)} answers", errors)

    def estimates(self, snap, req) -> dict[str, TTFTEstimate]:
        """Backend name -> ``TTFTEstimate`` of ``req`` (a ``GatewayRequest``) on config generation ``snap``."""
        out = {name: self.estimate(name) for name, b in snap.backends.items() if b.kind != "local"}
        local = snap.local
        if local is not None and local.engine is not None and req.rendered is not None:
            token_ids = req.rendered.prompts[0][1]
            p = local.engine.predict_ttft(token_ids, req.priority)
            if p is not None:
                out[local.name] = TTFTEstimate(p.seconds, p.describe())
        return out

    def track(self, attempt):
        """``attempt`` (one call of the attempt loop) timing each upstream call to its first byte of answer."""

        async def timed(c) -> UpstreamResponse:
            backend = c.target.backend
            started = time.monotonic()
            try:
                resp = await attempt(c)
            except Exception:
                self.observe(backend, None)
                raise
            if resp.status == 429 or resp.status >= 500:
                self.observe(backend, None)
            elif resp.chunks is None or resp.status >= 400:
                self.observe(backend, time.monotonic() - started)
            else:
                resp.chunks = self._first_chunk(resp.chunks, backend, started)
            return resp

        return timed

    async def _first_chunk(self, chunks, backend: str, started: float):
        it = chunks.__aiter__()
        first = True
        try:
            async for chunk in it:
                if first:
                    first = False
                    self.observe(backend, time.monotonic() - started)
                yield chunk
        finally:   # closed early (client gone, failover): close the upstream's iterator too
            aclose = getattr(it, "aclose", None)
            if aclose is not None:
                await aclose()
