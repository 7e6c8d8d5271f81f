"""The attempt loop of one request: retries, fallback along the route, breakers, and streaming failures.

The gateway calls ``call_with_fallback`` once per request with the route's ordered ``Candidate`` targets and an
``attempt`` coroutine that performs ONE upstream call against one target (the HTTP client's own retries must be
off: this is the only retry layer). The loop is tenacity's ``AsyncRetrying``; each tenacity attempt is one
upstream call:

- Target choice: the first candidate, in route order, not yet tried in this round, not too small for the request
  (``max_model_len < required_len``), not excluded by a context-length error, whose breaker lets a request
  through and whose backend rate limit admits it. A round ends when every candidate was tried or skipped; the
  next round starts after an exponential backoff with jitter (at least the upstream's ``Retry-After`` when it
  is within ``max_retry_after_s``). Falling back to an untried target waits nothing.
- Transient failures (connection errors, timeouts, HTTP 408/429/500/502/503/504, a malformed body, an error event
  or a cut before any content) are retried / fall back; 400/401/403/404/422 and every other status are passed
  through unchanged after one upstream call. A context-length error moves on to a target with a larger
  ``max_model_len`` and never retries the same target.
- Stops at ``max_attempts`` upstream calls or when the next wait would pass the overall ``deadline_s`` (which
  also bounds a stream's wait for its first token; a non-streamed answer in progress is bounded by the
  backend's own read timeout, not cut by the deadline).
  Then: 503 + Retry-After (soonest half-open) when every target's breaker is open, 429 when backend limits refuse,
  504 after a timeout, 503 after 429/503 upstream answers, 502 otherwise; never a 500.
- Streaming: the response is committed (status 200 and SSE headers) only when the first content delta arrives
  within ``first_token_timeout_s`` of the attempt's start; earlier events are held back. Before that, failures
  are transparent retries. After it, a failure (cut, malformed event, error event, no event within
  ``inter_chunk_timeout_s``) ends the stream with one ``data: {"error": ...}`` event and no ``[DONE]``.
  Closing the returned iterator (client disconnect) closes the upstream response at once.
  Hot path: events are split from the raw bytes once per read and relayed as the upstream's own bytes (typed
  msgspec decoding to classify them), the inter-chunk deadline is one re-armed ``loop.call_at`` handle per
  stream, and with ``batch_events`` every event already read goes downstream as one chunk (nothing waits).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from dataclasses import dataclass, field
from email.utils import parsedate_to_datetime
from typing import Any, AsyncIterator, Awaitable, Callable, Mapping

from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, wait_exponential_jitter

from gateway.errors import error_body, transport_error_kind
from gateway.resilience.ratelimit import Limit, RateReservation, retry_after_header
from gateway.sse import DONE, EventReader, classify, error_event, event

log = logging.getLogger("tandem.retry")

TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_CONTEXT_RE = re.compile(r"context[ _-]?length|maximum context|context window|max_model_len|too many tokens|"
                         r"prompt is too long|reduce the length", re.I)


@dataclass
class Candidate:
    """One target of a route as the loop sees it.

    name: breaker/health key, e.g. ``"deepseek/deepseek-chat"``. target: the gateway's own object, handed back
    to ``attempt``. max_model_len: tokens (None: unknown). Timeouts in seconds (None: the policy's default).
    limits: the backend's RPM/TPM limits (checked with ``limiter`` before each call).
    """

    name: str
    target: Any = None
    max_model_len: int | None = None
    first_token_timeout_s: float | None = None
    inter_chunk_timeout_s: float | None = None
    limits: list[Limit] = field(default_factory=list)


@dataclass
class UpstreamResponse:
    """What one attempt returns: any HTTP status.

    body: the whole body (non-streaming responses and every error). chunks: the raw SSE bytes of a streaming
    2xx (any split). aclose: releases the upstream response/connection (called when the loop abandons it).
    """

    status: int
    headers: Mapping[str, str] = field(default_factory=dict)
    body: bytes = b""
    chunks: AsyncIterator[bytes] | None = None
    aclose: Callable[[], Awaitable[None]] | None = None


@dataclass
class RetryPolicy:
    """Retry/fallback limits (seconds). ``deadline_s`` bounds everything before the response is committed."""

    max_attempts: int = 4
    deadline_s: float = 60.0
    backoff_initial_s: float = 0.2
    backoff_max_s: float = 5.0
    jitter_s: float = 0.2
    max_retry_after_s: float = 10.0
    first_token_timeout_s: float = 30.0
    inter_chunk_timeout_s: float = 60.0


@dataclass
class Attempt:
    """One step of the loop: an upstream call (``called``) or a skipped candidate, and its outcome."""

    target: str
    outcome: str
    status: int | None = None
    called: bool = True
    duration_s: float = 0.0


@dataclass
class Result:
    """The loop's answer.

    status/headers: what the client gets (headers: content-type, Retry-After when relevant).
    body: the response body when not streaming (or an error). stream: SSE event bytes when committed to a stream.
    candidate: the target that answered. usage: the upstream's ``usage`` (filled when known; for a stream at
    its end). error: the failure that ended a stream after content (None when it finished cleanly).
    backend_reservation: the backend-limit reservation of the answering target, to reconcile.
    """

    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes | None = None
    stream: AsyncIterator[bytes] | None = None
    candidate: Candidate | None = None
    attempts: list[Attempt] = field(default_factory=list)
    usage: dict | None = None
    ttft_s: float | None = None
    error: str | None = None
    backend_reservation: RateReservation | None = None

    @property
    def num_calls(self) -> int:
        """Upstream calls made (the ``x-tandem-attempts`` header)."""
        return sum(1 for a in self.attempts if a.called)


class _Failure(Exception):
    """A failed attempt: ``kind`` (timeout, connect_error, status, error_event, ...), whether it may be retried."""

    def __init__(self, kind: str, message: str, *, status: int | None = None, retry_after: float | None = None,
                 transient: bool = True, response: UpstreamResponse | None = None):
        super().__init__(message)
        self.kind, self.message, self.status = kind, message, status
        self.retry_after, self.transient, self.response = retry_after, transient, response
        self.candidate: Candidate | None = None


class _NoCandidate(Exception):
    """No candidate may be called now; ``retry_after`` seconds until one may (None: never).

    round_over: every candidate was tried or skipped in this round and no backoff preceded: back off, then
    start the next round.
    """

    def __init__(self, retry_after: float | None, round_over: bool = False):
        super().__init__("no candidate available")
        self.retry_after, self.round_over = retry_after, round_over


class _PassThrough(Exception):
    """A final upstream answer that is not retried (4xx): returned to the client as is."""

    def __init__(self, response: UpstreamResponse):
        super().__init__(f"status {response.status}")
        self.response = response
        self.candidate: Candidate | None = None


def parse_retry_after(headers: Mapping[str, str]) -> float | None:
    """Seconds from a ``Retry-After`` (delta-seconds or HTTP date) or ``retry-after-ms`` header; None if absent."""
    lower = {k.lower(): v for k, v in headers.items()}
    ms = lower.get("retry-after-ms")
    if ms:
        try:
            return max(0.0, float(ms) / 1000)
        except ValueError:
            pass
    v = lower.get("retry-after")
    if not v:
        return None
    try:
        return max(0.0, float(v))
    except ValueError:
        try:
            return max(0.0, parsedate_to_datetime(v).timestamp() - time.time())
        except (TypeError, ValueError):
            return None


def _is_context_length_error(status: int, body: bytes) -> bool:
    if status not in (400, 413, 422):
        return False
    try:
        err = json.loads(body).get("error") or {}
    except (ValueError, AttributeError):
        return bool(_CONTEXT_RE.search(body[:2000].decode("utf-8", "replace")))
    if not isinstance(err, dict):
        err = {"message": str(err)}
    return err.get("code") == "context_length_exceeded" or bool(_CONTEXT_RE.search(str(err.get("message", ""))))


_FAILURE_MESSAGES = {"timeout": "upstream timed out", "connect_error": "cannot connect to upstream",
                     "connection_error": "upstream connection failed", "error": "upstream call failed"}


def _classify_exception(exc: BaseException) -> _Failure:
    """A transport exception as a transient failure (``gateway.errors.transport_error_kind``)."""
    kind = transport_error_kind(exc)
    return _Failure(kind, f"{_FAILURE_MESSAGES[kind]} ({type(exc).__name__})")



class _Watchdog:
    """The inter-chunk timeout of a committed stream without a timer per chunk: ``arm`` sets a deadline
    (``timeout_s`` from now, event-loop time) that ``disarm`` clears; one ``loop.call_at`` handle, re-armed only
    when it fires before the current deadline, cancels the waiting task once a deadline passes (``fired``)."""

    __slots__ = ("loop", "timeout_s", "deadline", "handle", "task", "fired")

    def __init__(self, timeout_s: float):
        self.loop = asyncio.get_running_loop()
        self.timeout_s = max(0.0, timeout_s)
        self.deadline: float | None = None
        self.handle: asyncio.TimerHandle | None = None
        self.task: asyncio.Task | None = None
        self.fired = False

    def arm(self) -> None:
        self.deadline = self.loop.time() + self.timeout_s
        self.task = asyncio.current_task()
        if self.handle is None:
            self.handle = self.loop.call_at(self.deadline, self._check)

    def disarm(self) -> None:
        self.deadline = None

    def _check(self) -> None:
        self.handle = None
        if self.deadline is None or self.task is None:
            return
        if self.loop.time() >= self.deadline - 1e-3:   # the loop may run a timer up to its clock resolution early
            self.deadline = None
            self.fired = True
            self.task.cancel()
        else:
            self.handle = self.loop.call_at(self.deadline, self._check)

    def expired(self) -> bool:
        """After a CancelledError while armed: True when it was this deadline's (the cancel is then consumed)."""
        if not self.fired:
            return False
        self.fired = False
        task = self.task
        return task is not None and task.uncancel() == 0

    def close(self) -> None:
        self.deadline = None
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None


async def _close(resp: UpstreamResponse | None) -> None:
    if resp is not None and resp.aclose is not None:
        try:
            await resp.aclose()
        except Exception:
            pass


class _Run:
    """State of one request's attempt loop (see the module docstring)."""

    def __init__(self, candidates, attempt, stream, policy, breakers, health, limiter, required_len, request_id,
                 tokens, on_finish, batch_events=False):
        self.candidates: list[Candidate] = list(candidates)
        self.attempt_fn = attempt
        self.stream = stream
        self.policy = policy
        self.breakers, self.health, self.limiter = breakers, health, limiter
        self.required_len, self.request_id, self.tokens = required_len, request_id, tokens
        self.on_finish = on_finish
        self.batch = batch_events
        self.start = time.monotonic()
        self.deadline = self.start + policy.deadline_s
        self.attempts: list[Attempt] = []
        self.tried_round: set[str] = set()     # called or skipped in this round
        self.called_round = False
        self.last_wait = 0.0                   # the wait tenacity slept before this attempt
        self.excluded: set[str] = set()       # too small / context-length: never again in this request
        self.calls = 0
        self.failures: list[_Failure] = []
        self.skips: dict[str, tuple[str, float | None]] = {}   # name -> (reason, retry_after) in the last pick

    # -- target choice -------------------------------------------------------------------------------------
    async def _pick(self) -> tuple[Candidate, bool, RateReservation | None]:
        """The next candidate to call, whether it is a half-open probe, and its backend-limit reservation."""
        for new_round in (False, True):
            if new_round:
                if not self.called_round:  # a round of skips only: starting another changes nothing
                    break
                if self.last_wait <= 0:  # a new round only after a backoff
                    raise _NoCandidate(None, round_over=True)
                self.tried_round, self.called_round, self.skips = set(), False, {}
            for c in self.candidates:
                if c.name in self.excluded or c.name in self.tried_round:
                    continue
                if self.required_len is not None and c.max_model_len is not None and c.max_model_len < self.required_len:
                    self.excluded.add(c.name)
                    self.skips[c.name] = ("too_small", None)
                    self.attempts.append(Attempt(c.name, f"skipped: max_model_len {c.max_model_len} < "
                                                         f"{self.required_len} tokens", called=False))
                    continue
                probe = False
                if self.breakers is not None:
                    d = await self.breakers.allow(c.name)
                    if not d.allowed:
                        self.tried_round.add(c.name)
                        self.skips[c.name] = ("breaker_open", d.retry_after_s)
                        self.attempts.append(Attempt(c.name, f"skipped: breaker {d.state}", called=False))
                        continue
                    probe = d.probe
                reservation = None
                if self.limiter is not None and c.limits:
                    rl = await self.limiter.acquire(c.limits, self.tokens, f"{self.request_id}:{self.calls}")
                    if not rl.allowed:
                        if probe:
                            await self.breakers.record(c.name, True, probe=True, reason="probe not used")
                        self.tried_round.add(c.name)
                        self.skips[c.name] = ("rate_limited", rl.retry_after_s)
                        self.attempts.append(Attempt(c.name, "skipped: backend rate limit", called=False))
                        continue
                    reservation = rl.reservation
                return c, probe, reservation
        waits = [ra for name, (why, ra) in self.skips.items() if why != "too_small" and ra is not None
                 and name not in self.excluded]
        raise _NoCandidate(min(waits) if waits else None)

    # -- one attempt -----------------------------------------------------------------------------------------
    async def _once(self) -> Result:
        c, probe, reservation = await self._pick()
        self.tried_round.add(c.name)
        self.called_round = True
        self.calls += 1
        t0 = time.monotonic()
        remaining = self.deadline - t0
        try:
            result = await self._call(c, remaining)
        except _Failure as f:
            f.candidate = c
            dt = time.monotonic() - t0
            self.failures.append(f)
            self.attempts.append(Attempt(c.name, f.kind, f.status, duration_s=dt))
            if f.kind == "context_length":
                self.excluded.add(c.name)
                self._exclude_not_larger(c)
                await self._record(c, True, None, None, probe, dt, None)
                if reservation is not None:
                    await self.limiter.release(reservation)
                raise
            await self._record(c, False, f.status, f.retry_after, probe, dt, None, reason=f.kind)
            if reservation is not None:
                await self.limiter.release(reservation)
            raise
        except _PassThrough as p:
            p.candidate = c
            dt = time.monotonic() - t0
            self.attempts.append(Attempt(c.name, f"status {p.response.status}", p.response.status, duration_s=dt))
            await self._record(c, True, None, None, probe, dt, None)
            raise
        except BaseException:  # cancelled (client gone): give the probe slot and the reservation back
            if probe:
                await asyncio.shield(self.breakers.record(c.name, True, probe=True, reason="cancelled"))
            if reservation is not None:
                await asyncio.shield(self.limiter.release(reservation))
            raise
        dt = time.monotonic() - t0
        result.candidate, result.backend_reservation = c, reservation
        self.attempts.append(Attempt(c.name, "ok", result.status, duration_s=dt))
        result.attempts = self.attempts
        if not self.stream or result.stream is None:
            await self._record(c, True, None, None, probe, dt, None)
        else:
            result.stream = self._relay(result, result.stream, c, probe, t0)  # type: ignore[arg-type]
        return result

    def _exclude_not_larger(self, failed: Candidate) -> None:
        """After a context-length error: drop candidates that are not known to be larger than ``failed``."""
        if failed.max_model_len is None:
            return
        for c in self.candidates:
            if c.max_model_len is not None and c.max_model_len <= failed.max_model_len:
                self.excluded.add(c.name)

    async def _call(self, c: Candidate, remaining: float) -> Result:
        """One upstream call; returns a committed Result or raises _Failure / _PassThrough."""
        first_token = c.first_token_timeout_s or self.policy.first_token_timeout_s
        # streams: the first token within the first-token timeout and the deadline; a whole (non-streamed)
        # answer may take as long as it needs (the backend's read timeout catches a hung upstream; the deadline
        # bounds starting further attempts, not one in progress)
        limit = max(0.001, min(remaining, first_token)) if self.stream else None
        t0 = time.monotonic()
        resp: UpstreamResponse | None = None
        try:
            async with asyncio.timeout(limit):
                resp = await self.attempt_fn(c)
                if self.stream and resp.status < 300 and resp.chunks is not None:
                    return await self._peek_stream(c, resp, t0)
        except (_Failure, _PassThrough):
            if resp is not None and resp.chunks is not None:
                await _close(resp)
            raise
        except asyncio.CancelledError:
            await asyncio.shield(_close(resp))
            raise
        except Exception as exc:
            await _close(resp)
            status = getattr(exc, "status_code", None)
            if isinstance(status, int) and hasattr(exc, "to_dict"):  # engine.serving.ServingError (local backend)
                resp = UpstreamResponse(status, {"content-type": "application/json"},
                                        json.dumps(exc.to_dict()).encode())
            else:
                f = _classify_exception(exc)
                if f.kind == "timeout" and self.stream and time.monotonic() - t0 >= limit:
                    f = _Failure("timeout", f"no first token within {limit:.1f}s")
                if f.kind == "error":
                    log.warning("attempt on %s raised", c.name, exc_info=exc)
                raise f from exc
        return self._finish_plain(c, resp)

    def _finish_plain(self, c: Candidate, resp: UpstreamResponse) -> Result:
        """A whole (non-streamed) upstream response: success, pass-through, or a _Failure."""
        status, body = resp.status, resp.body or b""
        ct = {"content-type": resp.headers.get("content-type", "application/json")}
        if 200 <= status < 300:
            try:
                obj = json.loads(body)
                if not isinstance(obj, dict):
                    raise ValueError("not an object")
            except ValueError:
                raise _Failure("malformed", "upstream returned malformed JSON", status=502)
            if obj.get("error"):
                raise _Failure("error_event", "upstream returned an error object", status=502)
            return Result(status, ct, body=body, usage=obj.get("usage"))
        ra = parse_retry_after(resp.headers)
        if status in TRANSIENT_STATUS or 520 <= status <= 529:
            raise _Failure("status", f"upstream status {status}", status=status, retry_after=ra, response=resp)
        if _is_context_length_error(status, body):
            raise _Failure("context_length", "prompt too long for this target", status=status, response=resp)
        raise _PassThrough(resp)

    async def _peek_stream(self, c: Candidate, resp: UpstreamResponse, t0: float) -> Result:
        """Read events until the first content; hold them back. Raises _Failure on anything before content."""
        events = EventReader(resp.chunks)
        held: list[bytes] = []
        while True:
            item = events.pop()
            if item is None:
                if await events.fill():
                    continue
                item = events.tail()
                if item is None:
                    raise _Failure("stream_cut", "upstream stream ended before any content", status=502)
            raw, data = item
            kind, usage, error, fixed = classify(data)
            if kind == "malformed":
                raise _Failure("malformed", "upstream sent a malformed event", status=502)
            if kind == "error":
                st = error.get("code") if isinstance(error, dict) else None
                raise _Failure("error_event", "upstream sent an error event before content",
                               status=st if isinstance(st, int) else 502)
            held.append(raw if fixed is None else event(fixed))
            if kind in ("content", "done"):
                res = Result(200, {"content-type": "text/event-stream"}, ttft_s=time.monotonic() - t0)
                res.stream = _Held(held, events, resp, kind == "done")  # type: ignore[assignment]
                if usage:
                    res.usage = usage
                return res

    async def _relay(self, res: Result, held: "_Held", c: Candidate, probe: bool, t0: float) -> AsyncIterator[bytes]:
        """The committed stream: held events, then the rest; a failure after content ends with an error event.

        Every complete event already read is relayed in one chunk with the events before it (the bytes of an
        event unchanged), so a read of several events costs one write downstream; nothing waits for more."""
        inter = c.inter_chunk_timeout_s or self.policy.inter_chunk_timeout_s
        ok, err = False, None
        events, out = held.rest, held.events
        batch = self.batch
        watchdog: _Watchdog | None = None
        try:
            if not batch:
                for ev in out:
                    yield ev
                out = []
            elif held.done:
                yield b"".join(out)
            if held.done:
                ok = True
                return
            at_end = False
            while True:
                item = events.pop()
                if item is None:
                    if at_end:
                        err = "upstream stream ended without [DONE]"
                        break
                    if out:                          # (the watchdog is disarmed: an event arrived)
                        yield out[0] if len(out) == 1 else b"".join(out)
                        out = []
                    if watchdog is None:
                        watchdog = _Watchdog(inter)
                    if watchdog.deadline is None:    # one deadline per event awaited, not per read
                        watchdog.arm()
                    try:
                        more = await events.fill()
                    except asyncio.CancelledError:
                        if watchdog.expired():
                            err = f"upstream sent nothing for {inter:.0f}s"
                            break
                        raise
                    except (TimeoutError, asyncio.TimeoutError):
                        err = f"upstream sent nothing for {inter:.0f}s"
                        break
                    except Exception as exc:
                        err = f"upstream connection failed ({type(exc).__name__})"
                        break
                    if not more:
                        at_end = True
                        item = events.tail()
                        if item is None:
                            continue
                    else:
                        continue
                if watchdog is not None:
                    watchdog.disarm()                # the event awaited arrived
                raw, data = item
                kind, usage, _, fixed = classify(data)
                if kind == "done":
                    out.append(DONE)
                    ok = True
                    yield b"".join(out)
                    return
                if kind == "malformed":
                    err = "upstream sent a malformed event"
                    break
                if usage:
                    res.usage = usage
                out.append(raw if fixed is None else event(fixed))
                if kind == "error":  # relayed as the final event, no [DONE]
                    res.error = "upstream sent an error event"
                    yield b"".join(out)
                    return
                if not batch:
                    yield out[0]
                    out = []
            res.error = err
            if watchdog is not None:
                watchdog.disarm()
            out.append(error_event(f"stream interrupted: {err}", code="stream_interrupted"))
            yield b"".join(out)
        finally:
            if watchdog is not None:
                watchdog.close()
            await asyncio.shield(self._end_stream(res, c, probe, t0, ok, held))

    async def _end_stream(self, res: Result, c: Candidate, probe: bool, t0: float, ok: bool, held: "_Held") -> None:
        await _close(held.resp)
        dt = time.monotonic() - t0
        if res.error is None:  # finished, or the client went away: the upstream did its part
            await self._record(c, True, None, None, probe, dt, res.ttft_s)
        else:
            await self._record(c, False, None, None, probe, dt, res.ttft_s, reason="stream_interrupted")
        if self.on_finish is not None:
            try:
                out = self.on_finish(res)
                if asyncio.iscoroutine(out):
                    await out
            except Exception:
                log.exception("on_finish hook failed")

    async def _record(self, c: Candidate, ok: bool, status, retry_after, probe: bool, latency: float, ttft,
                      reason: str = "") -> None:
        if self.breakers is not None:
            await self.breakers.record(c.name, ok, status=status, retry_after_s=retry_after, probe=probe,
                                       reason=reason)
        if self.health is not None:
            await self.health.record(c.name, ok, latency_s=latency, ttft_s=ttft)

    # -- tenacity glue -----------------------------------------------------------------------------------------
    def _untried_left(self) -> bool:
        return any(c.name not in self.excluded and c.name not in self.tried_round for c in self.candidates)

    def _wait(self, rs: RetryCallState) -> float:
        self.last_wait = self._wait_for(rs)
        return self.last_wait

    def _wait_for(self, rs: RetryCallState) -> float:
        exc = rs.outcome.exception() if rs.outcome else None
        if isinstance(exc, _Failure) and self._untried_left():
            return 0.0  # fall back to the next target at once
        if isinstance(exc, _NoCandidate) and not exc.round_over and exc.retry_after is None:
            return 0.0  # _stop ends the loop
        backoff = wait_exponential_jitter(multiplier=self.policy.backoff_initial_s, max=self.policy.backoff_max_s,
                                          jitter=self.policy.jitter_s)(rs)
        if isinstance(exc, _NoCandidate) and exc.round_over:
            hint = self.failures[-1].retry_after if self.failures else None
        else:
            hint = exc.retry_after if isinstance(exc, (_Failure, _NoCandidate)) else None
        if hint is not None and hint <= self.policy.max_retry_after_s:
            backoff = max(backoff, hint)
        return backoff

    def _stop(self, rs: RetryCallState) -> bool:
        exc = rs.outcome.exception() if rs.outcome else None
        if isinstance(exc, _NoCandidate) and not exc.round_over:
            if exc.retry_after is None or exc.retry_after > self.policy.max_retry_after_s:
                return True
        elif isinstance(exc, _Failure) and not exc.transient:
            return True
        if self.calls >= self.policy.max_attempts:
            return True
        if not any(c.name not in self.excluded for c in self.candidates):
            return True
        return time.monotonic() + (rs.upcoming_sleep or 0.0) >= self.deadline

    async def execute(self) -> Result:
        retrying = AsyncRetrying(stop=self._stop, wait=self._wait, reraise=True,
                                 retry=retry_if_exception_type((_Failure, _NoCandidate)))
        try:
            async for attempt in retrying:
                with attempt:
                    return await self._once()
        except _PassThrough as p:
            return self._passthrough(p.response, p.candidate)
        except (_Failure, _NoCandidate) as exc:
            return await self._exhausted(exc)
        raise AssertionError("unreachable")

    def _passthrough(self, resp: UpstreamResponse, candidate: Candidate | None) -> Result:
        """An upstream's own error answer, unchanged (``candidate``: who gave it)."""
        headers = {"content-type": resp.headers.get("content-type", "application/json")}
        ra = parse_retry_after(resp.headers)
        if ra is not None:
            headers["retry-after"] = str(retry_after_header(ra))
        return Result(resp.status, headers, body=resp.body, candidate=candidate, attempts=self.attempts)

    async def _exhausted(self, last: Exception) -> Result:
        """The final error after every candidate failed or was skipped."""
        res = Result(503, {"content-type": "application/json"}, attempts=self.attempts)
        called = [f for f in self.failures]
        ctx = [f for f in called if f.kind == "context_length"]
        if ctx and not [f for f in called if f.kind != "context_length"]:
            return self._passthrough(ctx[-1].response, ctx[-1].candidate) if ctx[-1].response else res
        if not self.candidates:
            res.body = error_body(503, "No backend of this route is available.", code="no_backend_available")
            res.headers["retry-after"] = "1"
            return res
        if not called and self.skips and all(why == "too_small" for why, _ in self.skips.values()):
            res.status = 400
            res.body = error_body(400, f"The request needs {self.required_len} tokens (prompt + max_tokens); no "
                                  f"available target of this route has a context that large (max_model_len).",
                                  code="context_length_exceeded")
            return res
        if (isinstance(last, _NoCandidate) and not last.round_over) or not called:
            why = [w for w, _ in self.skips.values()]
            ra = last.retry_after if isinstance(last, _NoCandidate) else None
            if self.breakers is not None and "breaker_open" in why:
                ra = await self.breakers.soonest_half_open([c.name for c in self.candidates
                                                            if self.skips.get(c.name, ("",))[0] == "breaker_open"])
                ra = ra or 1.0
            if why and all(w == "rate_limited" for w in why):
                res.status = 429
                res.body = error_body(429, "Every backend of this route is at its rate limit.",
                                      code="rate_limit_exceeded")
            else:
                res.body = error_body(503, "Every backend of this route is unavailable (circuit open); retry later.",
                                      code="backends_unavailable")
            res.headers["retry-after"] = str(retry_after_header(ra or 1.0))
            return res
        f = called[-1]
        if f.kind == "timeout":
            res.status, msg = 504, "The upstream timed out"
        elif f.status in (429, 503):
            res.status, msg = 503, "The upstream is overloaded or rate limited"
            ras = [x.retry_after for x in called if x.retry_after is not None]
            res.headers["retry-after"] = str(retry_after_header(min(ras) if ras else 1.0))
        else:
            res.status, msg = 502, "The upstream failed"
        kinds = ", ".join(f"{a.target}: {a.outcome}" for a in self.attempts)
        res.body = error_body(res.status, f"{msg} after {self.calls} attempt(s) ({kinds}).", code="upstream_failed",
                              type_="upstream_error")
        return res


@dataclass
class _Held:
    """Events read before the commit, the live event iterator, and the upstream response to close."""

    events: list[bytes]      # the relay bytes of the held events
    rest: EventReader
    resp: UpstreamResponse
    done: bool


async def call_with_fallback(candidates: list[Candidate],
                             attempt: Callable[[Candidate], Awaitable[UpstreamResponse]], *,
                             stream: bool = False, policy: RetryPolicy | None = None, breakers=None, health=None,
                             limiter=None, required_len: int | None = None, request_id: str = "", tokens: int = 0,
                             on_finish: Callable[[Result], Any] | None = None,
                             batch_events: bool = False) -> Result:
    """Run one request across ``candidates`` (route order) and return what the client should get.

    attempt(candidate) performs one upstream call and returns an ``UpstreamResponse`` for ANY status (raising only
    for transport errors; an exception with ``status_code`` and ``to_dict()``, like ``engine.serving.ServingError``,
    counts as that HTTP answer). breakers: ``gateway.resilience.breaker.Breakers``; health: ``gateway.resilience.health.HealthTracker``;
    limiter: ``gateway.resilience.ratelimit.RateLimiter`` for ``Candidate.limits`` (tokens reserved: ``tokens``).
    required_len: prompt tokens + max_tokens, to skip candidates with a smaller ``max_model_len``.
    on_finish(result): called once a committed stream has ended (cleanly, with an error, or by a disconnect).
    batch_events: a committed stream yields every complete event read so far as one item (one write downstream
    per upstream read) instead of one item per event; the bytes are the same.
    Never raises for upstream failures; a cancelled caller cancels the upstream call.
    """
    run = _Run(candidates, attempt, stream, policy or RetryPolicy(), breakers, health, limiter, required_len,
               request_id, tokens, on_finish, batch_events)
    return await run.execute()
