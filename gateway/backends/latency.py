"""Predicted TTFT per backend for ``slo`` routing (``policies/slo.py``).

- The co-located engine: its own prediction for this request at admission (``AsyncEngine.predict_ttft``, from
  the core's state after its last step; ``engine/core/ttft.py``), read in-process: no scrape, no lag.
  Corrected by the median of measured / predicted over the engine's answers of the last ``RATIO_WINDOW_S``
  (once there are ``MIN_RATIOS``): what the engine cannot see (the front end's and the gateway's share of the
  CPU, other processes on the box) shows up there. The median, not a high percentile, and a window in time: a
  burst decided before the engine counted it (its predictions far too low) must not hold every later
  prediction high, and a factor that stops the engine getting traffic expires with its samples. The SLO is
  checked against the corrected prediction times the spread of those ratios (their 90th percentile over their
  median, ``TTFTEstimate.high``): a margin as wide as the prediction's own recent error, so a request predicted
  just under the SLO does not miss it half of the time; ``DEFAULT_MARGIN`` until there are ``MIN_RATIOS``.
- An upstream: a rolling estimate from this gateway's own calls to it (``UpstreamLatency.track`` wraps the
  attempt loop's calls): the 90th percentile TTFT of its last ``WINDOW`` answers (time to the first streamed
  chunk, or to the whole body), and the share of those calls that failed (transport error, 429, 5xx). A high
  percentile, not the mean: an SLO is met per request.
"""

from __future__ import annotations

import time
from collections import deque

from gateway.resilience.outcomes import UpstreamResponse
from gateway.sse import EventReader, classify
from policies import TTFTEstimate

# Calls remembered per backend: enough for a stable 90th percentile, few enough to follow a provider that slows.
WINDOW = 50
PERCENTILE = 0.9
# Answers of the local engine before its measured / predicted ratio corrects its predictions, and how long
# one counts (seconds).
MIN_RATIOS = 10
RATIO_WINDOW_S = 60.0
# Local predictions remembered until their request's attempt reads them back (requests explained, never sent).
_PREDICTED_MAX = 4096
# Below this many seconds a prediction and a measured TTFT are compared as if they were this: a fixed overhead
# of a few tens of ms would otherwise make an idle engine's ratios huge and scale every later prediction by them.
# Both sides: flooring the prediction alone made every short answer's ratio < 1 (0.1 s measured / 0.25 s), and
# an SLO route serving mostly short queues locally then scaled its predictions by ~0.5 (spill run).
RATIO_FLOOR_S = 0.25
# The local engine's margin before its answers measured one: its prediction's target accuracy (20 %).
DEFAULT_MARGIN = 1.2


class UpstreamLatency:
    """Rolling TTFT and error share per upstream backend name (state of the ``Gateway`` object)."""

    def __init__(self) -> None:
        self._calls: dict[str, deque] = {}   # backend -> (ttft seconds or None on failure)
        self._ratios: deque = deque(maxlen=WINDOW)   # local engine: (monotonic s, measured / predicted TTFT)
        self._predicted: dict[str, float] = {}      # request id -> the engine's own prediction, seconds
        self._local = ""

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
                self._local = local.name
                if len(self._predicted) >= _PREDICTED_MAX:
                    self._predicted.pop(next(iter(self._predicted)))
                self._predicted[req.request_id] = p.seconds
                factor, margin, why = self.correction()
                out[local.name] = TTFTEstimate(p.seconds * factor, f"{p.describe()}{why}",
                                               high=p.seconds * factor * margin)
        return out

    def correction(self, now: float | None = None) -> tuple[float, float, str]:
        """(factor on the engine's predictions, margin on the corrected prediction for the SLO check, their
        explanation): the median of measured / predicted TTFT of its answers in the last ``RATIO_WINDOW_S``
        seconds before ``now`` (monotonic) and their 90th percentile over that median (at least 1); (1,
        ``DEFAULT_MARGIN``, "") with fewer than ``MIN_RATIOS``."""
        now = time.monotonic() if now is None else now
        while self._ratios and self._ratios[0][0] < now - RATIO_WINDOW_S:
            self._ratios.popleft()
        if len(self._ratios) < MIN_RATIOS:
            return 1.0, DEFAULT_MARGIN, ""
        r = sorted(x for _, x in self._ratios)
        f = r[len(r) // 2]
        margin = max(r[min(int(PERCENTILE * len(r)), len(r) - 1)] / f, 1.0)
        return f, margin, (f" x {f:.2f} (median of measured/predicted, last {len(r)} answers; p90 x {margin:.2f} "
                           f"more)")

    def observe_local(self, request_id: str, ttft_s: float) -> None:
        """The local engine answered ``request_id`` after ``ttft_s`` seconds: its ratio to the prediction."""
        predicted = self._predicted.pop(request_id, None)
        if predicted is not None:
            self._ratios.append((time.monotonic(), max(ttft_s, RATIO_FLOOR_S) / max(predicted, RATIO_FLOOR_S)))

    def track(self, request_id: str):
        """An attempt hook for ``request_id``: ``attempt`` (one call of the attempt loop) timing each call to its
        first byte of answer."""
        return lambda attempt: self._timed(attempt, request_id)

    def _timed(self, attempt, request_id: str):
        def seen(backend: str, ttft_s: float) -> None:
            if backend == self._local:
                self.observe_local(request_id, ttft_s)
            else:
                self.observe(backend, ttft_s)

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
                seen(backend, time.monotonic() - started)
            else:
                resp.chunks = self._first_chunk(resp.chunks, lambda t: seen(backend, t), started)
            return resp

        return timed

    async def _first_chunk(self, chunks, seen, started: float):
        # The first content event, not the first bytes: engines (ours included) and providers send a role-only
        # event at once. The events before it are parsed here a second time (the attempt loop's peek parses
        # them too), only until content.
        it = chunks.__aiter__()
        reader: EventReader | None = EventReader()
        try:
            async for chunk in it:
                if reader is not None:
                    reader.feed(chunk)
                    if _has_content(reader):
                        reader = None
                        seen(time.monotonic() - started)
                yield chunk
        finally:   # closed early (client gone, failover): close the upstream's iterator too
            aclose = getattr(it, "aclose", None)
            if aclose is not None:
                await aclose()


def _has_content(reader: EventReader) -> bool:
    """Whether the complete events in ``reader`` include a content or end event (``gateway.sse.classify``)."""
    while (ev := reader.pop()) is not None:
        if classify(ev[1])[0] in ("content", "done", "error"):
            return True
    return False
