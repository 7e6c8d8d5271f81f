"""The attempt loop of one request: retries, fallback along the route, breakers, and streaming failures.

The gateway calls ``call_with_fallback`` once per request with the route's ordered ``Candidate`` targets and an
``attempt`` coroutine that performs ONE upstream call against one target (the HTTP client's own retries must be
off: this is the only retry layer). The loop (``_Run.execute``) is a plain loop; each step is one upstream
call, or one round of skipped candidates:

- Target choice: the first candidate, in route order, not yet tried in this round, not too small for the request
  (``max_model_len < required_len``), not excluded by a context-length error, whose breaker lets a request
  through and whose backend rate limit admits it. A round ends when every candidate was tried or skipped; the
  next round starts after an exponential backoff with jitter (tenacity's strategies, ``backoff.py``; at least
  the upstream's ``Retry-After`` when it is within ``max_retry_after_s``). Falling back to an untried target
  waits nothing.
- Transient failures (connection errors, timeouts, HTTP 408/429/500/502/503/504, a malformed body, an error event
  or a cut before any content) are retried / fall back; so is a request an engine withdrew at a hand-over's
  checkpoint (``Withdrawn``: not counted against that engine); 400/401/403/404/422 and every other status are passed
  through unchanged after one upstream call, and never count against the target's breaker; so is an error
  object inside a 2xx (a stream's error event before content, a JSON body's ``error``) naming such a status in
  its ``code`` (``outcomes.classify_error_object``). A context-length error moves on to a target with a larger
  ``max_model_len`` and never retries the same target; each larger one is tried once, at once (no backoff, no
  wait for a cooldown), and when none answers the refusal is the answer (the client's 400), not their failures.
- Nothing callable now (every remaining target cooling down, breaker-open or at its backend limit): when the
  soonest of them may be called within ``max_retry_after_s`` and before the deadline, the loop waits for it and
  asks those targets again (a cooled-down one is then called as the half-open probe), once per request: when
  those calls fail, their failure is the answer; otherwise it answers at once, with no upstream call, 503 (429
  for limits) and ``Retry-After`` = the soonest end of a cooldown. A backoff set by an upstream's
  ``Retry-After`` is such a wait too: one per request, the next failure asking for another is the answer.
- Stops at ``max_attempts`` upstream calls or when the next wait would pass the overall ``deadline_s`` (which
  also bounds a stream's wait for its first token; a non-streamed answer in progress is bounded by the
  backend's own read timeout, not cut by the deadline).
  Then: 503 + Retry-After (soonest half-open) when every target's breaker is open, 429 when backend limits refuse,
  504 after a timeout, 429 when every call was refused with 429, 503 after a mix of 429/503/529 (Anthropic's
  overloaded) upstream answers, 502 otherwise; never a 500. Every error answer carries ``x-should-retry: false``
  (a ``Retry-After`` stays, for the application): the SDKs' own retries would multiply the calls, most of all
  when upstreams are overloaded.
- Streaming: the response is committed (status 200 and SSE headers) only when the first content delta arrives
  within ``first_token_timeout_s`` of the attempt's start; earlier events are held back. Before that, failures
  are transparent retries. After it, a failure (cut, malformed event, error event, no event within
  ``inter_chunk_timeout_s``) ends the stream with one ``data: {"error": ...}`` event and no ``[DONE]``.
  Closing the returned iterator (client disconnect) closes the upstream response at once. A shutdown ends the
  committed streams and the waits for a first token (``streaming.OpenStreams``: the latter answered 503).
  Hot path: the loop reads the backend's ``ChatEvent`` values (decoded once, by the backend; it decodes
  nothing), the inter-chunk deadline is one re-armed ``loop.call_at`` handle per stream, and with
  ``batch_events`` every event already read goes downstream as one chunk (nothing waits).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Awaitable, Callable

from gateway.config.schema import RetrySettings
from gateway.errors import error_body
from gateway.resilience.outcomes import (ATTEMPT_TIMEOUT, TRANSIENT_STATUS, Attempt, Failure, NoCandidate,
                                         PassThrough, Result, UpstreamResponse, Withdrawn, answer_head,
                                         breaker_reason, classify_error_object, classify_exception, close_response,
                                         is_context_length_error, is_request_error, no_client_retry, not_larger,
                                         parse_retry_after, settle_outcome, too_long_body, upstream_message)
from gateway.resilience.backoff import RetryPolicy
from gateway.resilience.ratelimit import Limit, RateReservation, retry_after_header
from gateway.resilience.streaming import Held, OpenStreams, StreamEnd, peek_stream, relay, shutdown_answer

log = logging.getLogger("tandem.retry")
_CLOCK_MARGIN_S = 0.005   # breakers count whole ms: a wait ending on a cooldown's last one found it still open
_TOGETHER_S = 0.25


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


class _Run:
    """State of one request's attempt loop (see the module docstring)."""

    def __init__(self, candidates, attempt, *, stream, policy, breakers, health, limiter, required_len, request_id,
                 tokens, on_finish, batch_events, prompt_param=None, streams=None, answer_len: int | None = 0):
        self.candidates: list[Candidate] = list(candidates)
        self.attempt_fn, self.stream, self.policy = attempt, stream, policy
        self.breakers, self.health, self.limiter = breakers, health, limiter
        self.required_len, self.request_id, self.tokens = required_len, request_id, tokens
        self.prompt_param, self.on_finish, self.batch, self.streams = prompt_param, on_finish, batch_events, streams
        self.answer_len = answer_len   # of required_len, the answer's max_tokens (None: unset, one token counted)
        self.start = time.monotonic()
        self.deadline = self.start + policy.deadline_s
        self._retry: RetryPolicy | None = None      # made by the first failure (``retry``)
        self.attempts: list[Attempt] = []
        self.tried_round: set[str] = set()     # called or skipped in this round
        self.called_round = False
        self.last_wait = 0.0                   # the wait slept before this attempt
        self.cooled = False                    # waited once for a cooldown / limit: never again in this request
        self.excluded: set[str] = set()       # too small / context-length: never again in this request
        self.calls = 0
        self.failures: list[Failure] = []
        self.skips: dict[str, tuple[str, float | None]] = {}   # name -> (reason, retry_after) in the last pick

    @property
    def retry(self) -> RetryPolicy:
        """tenacity's wait and stop strategies from the loop's start, built when a call first fails (most requests
        succeed at once: building them was 2 % of the gateway's CPU per request)."""
        if self._retry is None:
            self._retry = RetryPolicy(self.policy, self.start)
        return self._retry

    # -- target choice -------------------------------------------------------------------------------------
    async def _pick(self) -> tuple[Candidate, bool, RateReservation | None] | NoCandidate:
        """The next candidate to call, whether it is a half-open probe, and its backend-limit reservation; or why
        none may be called now."""
        for new_round in (False, True):
            if new_round:
                if not self.called_round:  # a round of skips only: starting another changes nothing
                    break
                if self.last_wait <= 0:  # a new round only after a backoff
                    return NoCandidate(None, round_over=True)
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
        # the soonest cooldown, and those ending within _TOGETHER_S of it: one request's failed round opens its
        # targets' breakers a call apart, and its one wait should let each be probed (under load one was not)
        return NoCandidate(max(w for w in waits if w <= min(waits) + _TOGETHER_S) if waits else None)

    # -- one attempt -----------------------------------------------------------------------------------------
    async def _once(self) -> Result | Failure | NoCandidate | PassThrough:
        """One step: pick a candidate and call it. Returns the committed ``Result``, or why the step did not
        answer (the failure is recorded in breakers, health and ``attempts`` first)."""
        picked = await self._pick()
        if isinstance(picked, NoCandidate):
            return picked
        c, probe, reservation = picked
        self.tried_round.add(c.name)
        self.called_round = True
        self.calls += 1
        t0 = time.monotonic()
        remaining = self.deadline - t0
        try:
            result = await self._call(c, remaining)
        except BaseException:  # cancelled (client gone): give the probe slot and the reservation back
            if probe:
                await asyncio.shield(self.breakers.record(c.name, True, probe=True, reason="cancelled"))
            if reservation is not None:
                await asyncio.shield(self.limiter.release(reservation))
            raise
        dt = time.monotonic() - t0
        if isinstance(result, Failure):
            f = result
            f.candidate = c
            self.failures.append(f)
            self.attempts.append(Attempt(c.name, breaker_reason(f) if f.kind == "status" else f.kind, f.status,
                                         duration_s=dt))   # "status 500": which status, in logs and the 502
            if f.kind == "context_length":
                self.excluded.add(c.name)
                self._exclude_not_larger(c)
                await self._record(c, True, None, None, probe, dt, None)
            elif f.kind == "withdrawn":   # not the engine's failure: nothing to record but a probe's slot
                if probe:
                    await self.breakers.record(c.name, True, probe=True, reason="probe not used")
            else:
                await self._record(c, False, f.status, f.retry_after, probe, dt, None, reason=breaker_reason(f))
            if reservation is not None:
                await self.limiter.release(reservation)
            return f
        if isinstance(result, PassThrough):
            result.candidate = c
            self.attempts.append(Attempt(c.name, f"status {result.response.status}", result.response.status,
                                         duration_s=dt))
            await self._record(c, True, None, None, probe, dt, None)
            return result
        result.candidate, result.backend_reservation = c, reservation
        self.attempts.append(Attempt(c.name, "ok", result.status, duration_s=dt))
        result.attempts = self.attempts
        if not self.stream or result.stream is None:
            await self._record(c, True, None, None, probe, dt, None)
        else:
            held: Held = result.stream  # type: ignore[assignment]
            inter = c.inter_chunk_timeout_s or self.policy.inter_chunk_timeout_s
            end = StreamEnd(held.resp, result, probe, t0, partial(self._record, c), self._finished)
            result.stream = relay(result, held, inter, self.batch, end.end, self.streams, end.settle)
        return result

    def _exclude_not_larger(self, failed: Candidate) -> None:
        """After a context-length error: drop candidates that are not known to be larger than ``failed``."""
        self.excluded.update(c.name for c in self.candidates if not_larger(c, failed))

    async def _call(self, c: Candidate, remaining: float) -> Result | Failure | PassThrough:
        """One upstream call: a committed Result, or why it does not answer the client."""
        first_token = c.first_token_timeout_s or self.policy.first_token_timeout_s
        # streams: the first token within the first-token timeout and the deadline; a whole (non-streamed)
        # answer may take as long as it needs (the backend's read timeout catches a hung upstream; the deadline
        # bounds starting further attempts, not one in progress)
        limit = max(0.001, min(remaining, first_token)) if self.stream else None
        t0 = time.monotonic()
        resp: UpstreamResponse | None = None
        timeout = None
        try:
            async with asyncio.timeout(limit) as timeout:
                if self.stream and self.streams is not None:   # a shutdown ends the wait for the first token
                    self.streams.waiting(timeout)
                bound = ATTEMPT_TIMEOUT.set(timeout)   # the observer's "timeout", not "cancelled"
                try:
                    resp = await self.attempt_fn(c)
                finally:
                    ATTEMPT_TIMEOUT.reset(bound)
                if self.stream and resp.status < 300 and resp.events is not None:
                    out = await peek_stream(resp, t0)
                    if isinstance(out, Result):
                        settle_outcome(resp, "ok")
                        return out
                    if isinstance(out, PassThrough):   # an error event naming the request's own 4xx
                        settle_outcome(resp, "error_status", out.response.status)
                    else:
                        settle_outcome(resp, "error_status" if out.kind == "status" else out.kind, out.status)
                    await close_response(resp)
                    return out
        except asyncio.CancelledError:
            settle_outcome(resp, "cancelled")
            await asyncio.shield(close_response(resp))
            raise
        except Withdrawn as exc:
            settle_outcome(resp, "withdrawn")
            await close_response(resp)
            return Failure("withdrawn", str(exc))
        except Exception as exc:
            await close_response(resp)
            status = getattr(exc, "status_code", None)
            if isinstance(status, int) and hasattr(exc, "to_dict"):  # engine.protocol.errors.ServingError (local backend)
                settle_outcome(resp, "error_status", status)
                resp = UpstreamResponse(status, {"content-type": "application/json"},
                                        json.dumps(exc.to_dict()).encode())
            else:
                f = classify_exception(exc)
                if f.kind == "timeout" and self.stream and time.monotonic() - t0 >= limit:
                    f = Failure("timeout", f"no first token within {limit:.1f}s")
                if f.kind == "error":
                    log.warning("attempt on %s raised", c.name, exc_info=exc)
                settle_outcome(resp, f.kind)   # a stream that failed before its first content
                return f
        finally:
            if timeout is not None and self.streams is not None:
                self.streams.wait_over(timeout)
        return self._finish_plain(c, resp)

    def _finish_plain(self, c: Candidate, resp: UpstreamResponse) -> Result | Failure | PassThrough:
        """A whole (non-streamed) upstream response: success, pass-through, or a Failure; a 2xx one's outcome
        told to its observer (``settle_outcome``: an observability trial's malformed 200 was metered ``ok``)."""
        status, body = resp.status, resp.body or b""
        ct = {"content-type": resp.headers.get("content-type", "application/json")}
        if 200 <= status < 300:
            try:
                head = answer_head(body)
            except ValueError:
                settle_outcome(resp, "malformed")
                return Failure("malformed", "upstream returned malformed JSON", status=502)
            if head.error:
                out = classify_error_object(head.error, body, "object in a 2xx body")
                failed = isinstance(out, Failure) and out.kind != "status"
                settle_outcome(resp, out.kind if failed else "error_status",
                               out.status if isinstance(out, Failure) else out.response.status)
                return out
            settle_outcome(resp, "ok")
            return Result(status, ct, body=body, usage=head.usage)
        ra = parse_retry_after(resp.headers)
        if (status in TRANSIENT_STATUS and not is_request_error(body)) or 520 <= status <= 529:
            return Failure("status", f"upstream status {status}", status=status, retry_after=ra, response=resp)
        if is_context_length_error(status, body):
            return Failure("context_length", "prompt too long for this target", status=status, response=resp)
        return PassThrough(resp)

    async def _finished(self, res: Result) -> None:
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

    # -- the loop ----------------------------------------------------------------------------------------------
    def _untried_left(self) -> bool:
        return any(c.name not in self.excluded and c.name not in self.tried_round for c in self.candidates)

    def _wait_for(self, exc: Failure | NoCandidate, step: int) -> float:
        """Seconds to wait after loop step ``step`` (1-based) ended in ``exc``: none before an untried target,
        else an exponential backoff with jitter, at least the upstream's ``Retry-After`` when acceptable."""
        if isinstance(exc, Failure) and self._untried_left():
            return 0.0  # fall back to the next target at once
        if isinstance(exc, NoCandidate) and not exc.round_over and exc.retry_after is None:
            return 0.0  # _stop ends the loop
        p = self.policy
        backoff = self.retry.backoff(step)
        if isinstance(exc, NoCandidate) and exc.round_over:
            hint = self.failures[-1].retry_after if self.failures else None
        else:
            hint = exc.retry_after
        if hint is not None and hint <= p.max_retry_after_s:
            backoff = max(backoff, hint + _CLOCK_MARGIN_S)
        return backoff

    def _waits_retry_after(self, exc: Failure | NoCandidate, wait: float) -> bool:
        """Whether ``wait`` (``_wait_for``'s) is an upstream's ``Retry-After``: a cooldown, as a breaker's is."""
        if isinstance(exc, NoCandidate):
            hint = self.failures[-1].retry_after if exc.round_over and self.failures else None
        else:
            hint = exc.retry_after
        return hint is not None and wait >= hint > 0

    def _stop(self, exc: Failure | NoCandidate, wait: float) -> bool:
        if wait > 0 and any(f.kind == "context_length" for f in self.failures):
            # a target refused the prompt as too long: each larger one is tried once, at once; waiting for one
            # cooling down or retrying one that failed held a capacity trial's requests ~9 s for a 502 where the
            # refusal (a 400 the client can act on, as vLLM's and OpenAI's) is the answer
            return True
        if self.cooled and (isinstance(exc, NoCandidate) or self._waits_retry_after(exc, wait)):
            # one cooldown per request: after it, failures are the answer (waiting again held a trial's requests
            # 16 s through two more cooldowns, and an SRE trial's 429s one 14 s)
            return True
        if isinstance(exc, NoCandidate) and not exc.round_over:
            if exc.retry_after is None or exc.retry_after > self.policy.max_retry_after_s:
                return True
        elif isinstance(exc, Failure) and not exc.transient:
            return True
        return all(c.name in self.excluded for c in self.candidates) or self.retry.exhausted(self.calls, wait)

    async def execute(self) -> Result:
        """The loop: call the next candidate; after a failure wait (``_wait_for``: nothing before an untried
        target, a backoff before a new round) and go on unless a limit stops it (``_stop``)."""
        step = 0
        while True:
            step += 1
            out = await self._once()
            if isinstance(out, Result):
                return no_client_retry(out)
            if isinstance(out, PassThrough):
                return no_client_retry(self._passthrough(out.response, out.candidate))
            if self.stream and self.streams is not None and self.streams.reason is not None:
                return no_client_retry(shutdown_answer())     # ended by the shutdown before its first token
            self.last_wait = self._wait_for(out, step)    # _pick starts a new round only after a backoff
            if self._stop(out, self.last_wait):
                return no_client_retry(await self._exhausted(out))
            await asyncio.sleep(self.last_wait)
            self.cooled = self.cooled or self._waits_retry_after(out, self.last_wait)
            if isinstance(out, NoCandidate) and not out.round_over:
                # waited for a cooldown / limit to pass: the candidates skipped for it are asked again
                self.tried_round -= set(self.skips)
                self.skips = {}
                self.cooled = True

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
        called = self.failures
        ctx = [f for f in called if f.kind == "context_length"]
        if ctx and ctx[-1].response:   # no larger target answered: the refusal is the answer, not their failures
            return self._passthrough(ctx[-1].response, ctx[-1].candidate)
        if not self.candidates:
            res.body = error_body(503, "No backend of this route is available: each is down, unconfigured (an API "
                                  "key unset) or cannot take this request; /health/ready tells operators which.",
                                  code="no_backend_available")   # which is theirs: key names, addresses
            res.headers["retry-after"] = "1"
            return res
        if not called and self.skips and all(why == "too_small" for why, _ in self.skips.values()):
            res.status = 400
            largest = max((c.max_model_len for c in self.candidates if c.max_model_len is not None), default=None)
            res.body = too_long_body(largest, self.required_len, self.answer_len, self.prompt_param)
            return res
        why = [w for w, _ in self.skips.values()]
        # every target skipped for an open breaker after calls were made (a cooldown waited for, the half-open
        # probes failed): the calls' failure is the answer, as when every target fails, not "unavailable"
        failed_then_opened = bool(called) and bool(why) and all(w == "breaker_open" for w in why)
        if ((isinstance(last, NoCandidate) and not last.round_over) or not called) and not failed_then_opened:
            ra = last.retry_after if isinstance(last, NoCandidate) else None
            if self.breakers is not None and "breaker_open" in why:
                ra = await self.breakers.soonest_half_open([c.name for c in self.candidates
                                                            if self.skips.get(c.name, ("",))[0] == "breaker_open"])
                ra = ra or 1.0
            if why and all(w == "rate_limited" for w in why):
                res.status = 429
                res.body = error_body(429, "Every backend of this route is at its rate limit.",
                                      code="rate_limit_exceeded")
            else:
                steps = "; ".join(f"{a.target}: {a.outcome}" for a in self.attempts) or "none could be called"
                res.body = error_body(503, f"Every backend of this route is unavailable ({steps}); retry later.",
                                      code="backends_unavailable")
            res.headers["retry-after"] = str(retry_after_header(ra or 1.0))
            return res
        f = called[-1]
        code, type_ = "upstream_failed", "upstream_error"
        if f.kind == "timeout":
            res.status, msg = 504, "The upstream timed out"
        elif f.status in (429, 503, 529):   # 529: Anthropic's overloaded_error
            if all(x.status == 429 for x in called):   # rate limits alone: their 429, as LiteLLM answers (a 503
                # told the app's dashboards "down"); /v1/messages says rate_limit_error, not 529 overloaded_error
                res.status, msg, code, type_ = 429, "The upstream is rate limited", "rate_limit_exceeded", None
            else:
                res.status, msg = 503, "The upstream is overloaded or rate limited"
            ras = [x.retry_after for x in called if x.retry_after is not None]
            res.headers["retry-after"] = str(retry_after_header(min(ras) if ras else 1.0))
        else:
            res.status, msg = 502, "The upstream failed"
        kinds = ", ".join(f"{a.target}: {a.outcome}" for a in self.attempts)
        said = upstream_message(f)
        res.body = error_body(res.status, f"{msg} after {self.calls} attempt(s) ({kinds})."
                              + (f" The last one said: {said}" if said else ""), code=code, type_=type_)
        if failed_then_opened and self.breakers is not None:   # when a target is tried again
            ra = await self.breakers.soonest_half_open([c.name for c in self.candidates if c.name in self.skips])
            res.headers["retry-after"] = str(retry_after_header(ra or 1.0))
        return res


async def call_with_fallback(candidates: list[Candidate],
                             attempt: Callable[[Candidate], Awaitable[UpstreamResponse]], *,
                             stream: bool = False, policy: RetrySettings | None = None, breakers=None, health=None,
                             limiter=None, required_len: int | None = None, request_id: str = "", tokens: int = 0,
                             on_finish: Callable[[Result], Any] | None = None,
                             batch_events: bool = False, prompt_param: str | None = None,
                             streams: OpenStreams | None = None, answer_len: int | None = 0) -> Result:
    """Run one request across ``candidates`` (route order) and return what the client should get.

    attempt(candidate) performs one upstream call and returns an ``UpstreamResponse`` for ANY status (raising only
    for transport errors; an exception with ``status_code`` and ``to_dict()``, like ``engine.protocol.errors.ServingError``,
    counts as that HTTP answer). breakers: ``gateway.resilience.breaker.Breakers``; health: ``gateway.resilience.health.HealthTracker``;
    limiter: ``gateway.resilience.ratelimit.RateLimiter`` for ``Candidate.limits`` (tokens reserved: ``tokens``).
    required_len: prompt tokens + max_tokens, to skip candidates with a smaller ``max_model_len``; answer_len:
    its max_tokens part (None: unset, one token counted; named by the 400 when no candidate takes it).
    on_finish(result): called once a committed stream has ended (cleanly, with an error, or by a disconnect).
    batch_events: a committed stream yields every event of a read as one list (one write downstream per read).
    prompt_param: the body field holding the prompt ("messages" or "prompt"), named by the 400 when no candidate
    fits ``required_len`` (OpenAI's ``context_length_exceeded``). streams: the gateway's ``OpenStreams``, which a
    shutdown ends. Never raises for upstream failures; a cancelled caller cancels the upstream call.
    """
    run = _Run(candidates, attempt, stream=stream, policy=policy or RetrySettings(), breakers=breakers, health=health,
               limiter=limiter, required_len=required_len, request_id=request_id, tokens=tokens, on_finish=on_finish,
               batch_events=batch_events, prompt_param=prompt_param, streams=streams, answer_len=answer_len)
    return await run.execute()
