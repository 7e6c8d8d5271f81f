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
- ``tandem engine serve`` replicas (openai backends with ``predicts_ttft: true``): the same prediction, asked of
  each replica per request (``POST /v1/ttft`` with the request's body, ``engine/entrypoints/ttft.py``) and
  corrected by that replica's own ratios; one that does not answer within ``REPLICA_TIMEOUT_S`` is ranked by its
  rolling estimate (below) for this request.
- An upstream: a rolling estimate from this gateway's own calls to it (``UpstreamLatency.track`` wraps the
  attempt loop's calls): the 90th percentile TTFT of its last ``WINDOW`` answers within ``RATIO_WINDOW_S``
  (time to the first streamed chunk, or to the whole body), and the share of those calls that failed (transport
  error, 429, 5xx). A high percentile, not the mean: an SLO is met per request. A window in time too: an
  upstream seen slow once, then no longer sent anything, would be kept away for good (a policy trial's cheapest
  upstream after one cold start); once its samples expire it has no estimate and is tried again. Its TPOT
  likewise: the 90th percentile of its last streamed answers' seconds per content event after the first (an
  event carries a token, or a few).
- TPOT of the engines (``slo.tpot_ms``): their own prediction (``engine/core/ttft.py`` ``predict_tpot``: the step
  cost at the batch the request would decode in), not corrected.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import deque

import httpx
import msgspec

from gateway.backends.local import tenant_cache_salt
from gateway.resilience.outcomes import UpstreamResponse, Withdrawn
from gateway.values import ChatEvent
from policies import TTFTEstimate

# Calls remembered per backend: enough for a stable 90th percentile, few enough to follow a provider that slows.
WINDOW = 50
PERCENTILE = 0.9
# Answers of the local engine before its measured / predicted ratio corrects its predictions, and how long
# one counts (seconds); an upstream's calls count as long.
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
# Seconds an idle co-located engine may go without a request before an SLO route sends it the next one whatever
# its prediction says (once, then again after as long): its step costs are fitted from the steps it runs, so a
# fit gone wrong (learnt while the host swapped: 44.8 s predicted for a 651-token prompt on an idle engine, the
# spill sweep) would otherwise keep every request away and never be corrected. An idle engine answers one
# request at its real speed; a busy one refreshes its fit with every step and is never probed.
LOCAL_PROBE_AFTER_S = 30.0
# Seconds a decision waits for the replicas' predictions (they answer from their last published state: ~1 ms
# on an idle box); a replica that has not answered by then is ranked by its rolling estimate.
REPLICA_TIMEOUT_S = 0.25


def _now(now: float | None) -> float:
    return time.monotonic() if now is None else now


class UpstreamLatency:
    """Rolling TTFT and error share per upstream backend name (state of the ``Gateway`` object)."""

    def __init__(self) -> None:
        self._calls: dict[str, deque] = {}    # backend -> (monotonic s, ttft seconds or None on failure)
        self._tpots: dict[str, deque] = {}    # backend -> (monotonic s, seconds per output token of a stream)
        self._ratios: dict[str, deque] = {}   # predicting backend -> (monotonic s, measured / predicted TTFT)
        self._predicted: dict[str, dict[str, float]] = {}   # request id -> backend -> its own prediction, s
        self._local = ""
        self._local_probed_at = time.monotonic()   # the last answer of the local engine, or probe sent to it

    def observe(self, backend: str, ttft_s: float | None, now: float | None = None) -> None:
        """One call to ``backend`` (at monotonic ``now``): its TTFT in seconds, or None when it failed."""
        self._calls.setdefault(backend, deque(maxlen=WINDOW)).append((_now(now), ttft_s))

    def estimate(self, backend: str, now: float | None = None) -> TTFTEstimate:
        """The backend's rolling estimate (seconds None: no successful call in the window)."""
        since = _now(now) - RATIO_WINDOW_S
        calls = [c for t, c in self._calls.get(backend, ()) if t >= since]
        if not calls:
            return TTFTEstimate(None, "no calls yet" if backend not in self._calls else
                                f"no calls in the last {RATIO_WINDOW_S:g} s")
        ok = sorted(c for c in calls if c is not None)
        errors = (len(calls) - len(ok)) / len(calls)
        if not ok:
            return TTFTEstimate(None, f"{len(calls)} calls, all failed", errors)
        p = ok[min(int(PERCENTILE * len(ok)), len(ok) - 1)]
        tpots = sorted(x for t, x in self._tpots.get(backend, ()) if t >= since)
        tpot = tpots[min(int(PERCENTILE * len(tpots)), len(tpots) - 1)] if tpots else None
        return TTFTEstimate(p, f"p90 of its last {len(ok)} answers", errors, tpot=tpot)

    def observe_tpot(self, backend: str, tpot_s: float, now: float | None = None) -> None:
        """One streamed answer of ``backend`` (at monotonic ``now``): its seconds per output token after the
        first."""
        self._tpots.setdefault(backend, deque(maxlen=WINDOW)).append((_now(now), tpot_s))

    async def ask_replicas(self, snap, req, skip=()) -> dict[str, tuple[float, str, float | None]]:
        """Backend name -> (predicted seconds, the replica's explanation, its predicted TPOT or None) of ``req``
        (a ``GatewayRequest``) from each ``predicts_ttft`` backend of config generation ``snap`` but those in
        ``skip`` (open breakers), asked at once; those that did not answer a prediction within
        ``REPLICA_TIMEOUT_S`` are left out."""
        asked = {name: b for name, b in snap.backends.items()
                 if b.kind == "openai" and b.cfg.predicts_ttft and b.available and name not in skip}
        if not asked or req.endpoint not in ("chat/completions", "completions"):
            return {}
        body = {k: v for k, v in req.body.items() if k not in ("stream", "stream_options")}

        async def one(name: str, b) -> tuple[str, tuple[float, str, float | None] | None]:
            payload = msgspec.json.encode({**body, "model": b.upstream_model(req.public_model, "")})
            try:
                r = await b.client.post("ttft", content=payload, timeout=REPLICA_TIMEOUT_S)
                if r.status_code != 200:
                    return name, None
                got = msgspec.json.decode(r.content)
                tpot = got.get("tpot_s")
                return name, (float(got["ttft_s"]), str(got.get("explanation", "")),
                              float(tpot) if tpot is not None else None)
            except (httpx.HTTPError, OSError, msgspec.DecodeError, KeyError, TypeError, ValueError):
                return name, None

        answers = await asyncio.gather(*(one(n, b) for n, b in asked.items()))
        return {name: p for name, p in answers if p is not None}

    def estimates(self, snap, req, replicas: dict | None = None) -> dict[str, TTFTEstimate]:
        """Backend name -> ``TTFTEstimate`` of ``req`` (a ``GatewayRequest``) on config generation ``snap``;
        ``replicas``: the replicas' own predictions (``ask_replicas``), used in place of their rolling estimates."""
        out = {name: self.estimate(name) for name, b in snap.backends.items() if b.kind != "local"}
        for name, (seconds, why, tpot) in (replicas or {}).items():   # failing calls still count against it
            e = self._predicted_estimate(req.request_id, name, seconds, why, tpot)
            out[name] = dataclasses.replace(e, error_rate=out[name].error_rate)
        local = snap.local
        if local is not None and local.engine is not None and req.rendered is not None:
            token_ids = req.rendered.prompts[0][1]
            p = local.engine.predict_ttft(token_ids, req.priority, tenant_cache_salt(req))
            if p is not None:
                self._local = local.name
                e = self._predicted_estimate(req.request_id, local.name, p.seconds, p.describe(),
                                             p.parts.get("tpot_s"), withdraws=True)
                out[local.name] = self._probe(local.engine, e)
        return out

    def _probe(self, engine, e: TTFTEstimate, now: float | None = None) -> TTFTEstimate:
        """``e``, the local engine's estimate, or a probe: no estimate (so the request is ranked as meeting the
        SLO, by cost) when the engine is idle (nothing running or waiting) and has had no answer or probe for
        ``LOCAL_PROBE_AFTER_S``."""
        now = time.monotonic() if now is None else now
        if now - self._local_probed_at < LOCAL_PROBE_AFTER_S:
            return e
        stats = engine.get_stats()
        if stats.num_running or stats.num_waiting:
            return e
        self._local_probed_at = now
        return TTFTEstimate(None, f"probe: idle and no answer for {LOCAL_PROBE_AFTER_S:g} s (predicted "
                                  f"{e.seconds:.2f} s from costs its next steps refit)", tpot=e.tpot)

    def _predicted_estimate(self, request_id: str, backend: str, seconds: float, why: str,
                            tpot: float | None = None, withdraws: bool = False) -> TTFTEstimate:
        """An engine's own prediction for ``request_id`` as an estimate: remembered (its answer's TTFT is compared
        with it) and corrected by that engine's recent measured / predicted ratios. ``withdraws``: the engine can
        take the request back while it waits (the co-located one): the estimate's ``scale`` is the factor from its
        own predictions to the checked figure, which its re-prediction at a hand-over is scaled by."""
        if len(self._predicted) >= _PREDICTED_MAX and request_id not in self._predicted:
            self._predicted.pop(next(iter(self._predicted)))
        self._predicted.setdefault(request_id, {})[backend] = seconds
        factor, margin, note = self.correction(backend)
        return TTFTEstimate(seconds * factor, f"{why}{note}", high=seconds * factor * margin, tpot=tpot,
                            scale=factor * margin if withdraws else None)

    def correction(self, backend: str = "", now: float | None = None) -> tuple[float, float, str]:
        """(factor on ``backend``'s predictions (default: the local engine's), margin on the corrected prediction
        for the SLO check, their explanation): the median of measured / predicted TTFT of its answers in the
        last ``RATIO_WINDOW_S`` seconds before ``now`` (monotonic) and their 90th percentile over that median (at
        least 1); (1, ``DEFAULT_MARGIN``, "") with fewer than ``MIN_RATIOS``."""
        now = time.monotonic() if now is None else now
        ratios = self._ratios.get(backend or self._local)
        while ratios and ratios[0][0] < now - RATIO_WINDOW_S:
            ratios.popleft()
        if not ratios or len(ratios) < MIN_RATIOS:
            return 1.0, DEFAULT_MARGIN, ""
        r = sorted(x for _, x in ratios)
        f = r[len(r) // 2]
        margin = max(r[min(int(PERCENTILE * len(r)), len(r) - 1)] / f, 1.0)
        return f, margin, (f" x {f:.2f} (median of measured/predicted, last {len(r)} answers; p90 x {margin:.2f} "
                           f"more)")

    def observe_predicted(self, request_id: str, backend: str, ttft_s: float) -> bool:
        """``backend`` answered ``request_id`` after ``ttft_s`` seconds: its ratio to that backend's own
        prediction, if it made one (returns whether it did)."""
        if backend and backend == self._local:
            self._local_probed_at = time.monotonic()   # answered: its costs were refitted on real steps
        predicted = self._predicted.pop(request_id, {}).get(backend)
        if predicted is None:
            return False
        self._ratios.setdefault(backend, deque(maxlen=WINDOW)).append(
            (time.monotonic(), max(ttft_s, RATIO_FLOOR_S) / max(predicted, RATIO_FLOOR_S)))
        return True

    def observe_local(self, request_id: str, ttft_s: float) -> None:
        """The local engine answered ``request_id`` after ``ttft_s`` seconds: its ratio to the prediction."""
        self.observe_predicted(request_id, self._local, ttft_s)

    def track(self, request_id: str):
        """An attempt hook for ``request_id``: ``attempt`` (one call of the attempt loop) timing each call to its
        first byte of answer."""
        return lambda attempt: self._timed(attempt, request_id)

    def _timed(self, attempt, request_id: str):
        def seen(backend: str, ttft_s: float) -> None:
            if not self.observe_predicted(request_id, backend, ttft_s) or backend != self._local:
                self.observe(backend, ttft_s)   # a replica's rolling figure too: its fallback

        async def timed(c) -> UpstreamResponse:
            backend = c.target.backend
            started = time.monotonic()
            try:
                resp = await attempt(c)
            except Withdrawn:   # taken back before it started: no answer to time, no failure
                raise
            except Exception:
                self.observe(backend, None)
                raise
            if resp.status == 429 or resp.status >= 500:
                self.observe(backend, None)
            elif resp.events is None or resp.status >= 400:
                seen(backend, time.monotonic() - started)
            else:
                resp.events = self._first_chunk(resp.events, lambda t: seen(backend, t), started,
                                                lambda t: self.observe_tpot(backend, t))
            return resp

        return timed

    async def _first_chunk(self, events, seen, started: float, seen_tpot=None):
        # The first content event, not the first read: engines (ours included) and providers send a role-only
        # event at once. Until content for the TTFT, then counted to the end for the TPOT (``seen_tpot``).
        it = events.__aiter__()
        first = last = 0.0
        count = 0
        try:
            async for batch in it:
                n, answered = _content_events(batch)
                if answered and not first:
                    first = time.monotonic()
                    seen(first - started)
                if n:
                    count += n
                    last = time.monotonic()
                yield batch
            if seen_tpot is not None and count > 1:
                seen_tpot((last - first) / (count - 1))
        finally:   # closed early (client gone, failover): close the upstream's iterator too
            aclose = getattr(it, "aclose", None)
            if aclose is not None:
                await aclose()


def _content_events(batch: list[ChatEvent]) -> tuple[int, bool]:
    """(how many of the events of one read are content events, whether any is a content or end event: the
    answer has begun)."""
    n, answered = 0, False
    for ev in batch:
        kind = ev.kind
        n += kind == "content"
        answered = answered or kind in ("content", "done", "error")
    return n, answered
