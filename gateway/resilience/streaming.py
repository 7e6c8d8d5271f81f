"""A streamed answer in the attempt loop, read as ``ChatEvent`` values (``gateway/values.py``: decoded once by the
backend): ``peek_stream`` holds events back until the first content (before it, any failure is a transparent
retry), ``relay`` streams the committed answer, ending a failure after content with one error event (and no
``[DONE]``: an upstream's own error event after content included, its message quoted); ``Watchdog`` is the
inter-chunk deadline without a timer per chunk.

A stream is complete at ``[DONE]``, or when every choice it opened has a ``finish_reason`` (``Choices``): an
upstream that then ends (or stalls) without ``[DONE]`` has done its part, and the client gets ``[DONE]`` from
the gateway. A drain's deadline ends a stream still open with the same ``stream_interrupted`` event
(``GATEWAY_SHUTDOWN``), not counted against the backend. Every read from the backend re-arms the inter-chunk
deadline, one that carried no event (an SSE comment, ``: keep-alive``) too; such reads are not relayed.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable

import msgspec

from gateway.errors import error_body
from gateway.resilience.outcomes import (Failure, PassThrough, Result, UpstreamResponse, classify_error_object,
                                         close_response, quoted_message)
from gateway.values import DONE, ChatEvent, ChatStream, error_event


class Choices:
    """The choices a stream has opened and those that finished (a ``finish_reason``): ``complete`` when every
    choice opened has finished."""

    __slots__ = ("opened", "finished")

    def __init__(self) -> None:
        self.opened: set = set()
        self.finished: set = set()

    def note(self, ev: ChatEvent) -> None:
        """Count the choices of one event (content or meta)."""
        for c in ev.choices:
            self.opened.add(c.index)
            if c.finish_reason:
                self.finished.add(c.index)

    @property
    def complete(self) -> bool:
        return bool(self.opened) and self.opened <= self.finished


GATEWAY_SHUTDOWN = "the gateway is shutting down"   # why a drain ended a stream (not the upstream's fault)
# the error type of a stream the gateway's shutdown ended: that of the 503 ``draining`` new requests get then, so a
# client does not read an upstream failure into it
SHUTDOWN_TYPE = "service_unavailable"


def ended_by_shutdown(error) -> bool:
    """Whether an error event's object (``ChatEvent.error``) is the ``stream_interrupted`` a drain wrote (the
    gateway's shutdown ended the stream; neither the backend nor the client did)."""
    return isinstance(error, dict) and error.get("code") == "stream_interrupted" and error.get("type") == SHUTDOWN_TYPE


@dataclass
class Held:
    """The events read before the commit (``events``, the first content last), the rest of the read that
    committed (``pending``, not yet looked at), the live event iterator and the upstream response to close."""

    events: list[ChatEvent]
    pending: list[ChatEvent]
    rest: AsyncIterator[list[ChatEvent]]
    resp: UpstreamResponse
    done: bool
    choices: Choices = field(default_factory=Choices)


class Watchdog:
    """The inter-chunk timeout of a committed stream without a timer per chunk: ``arm`` sets a deadline
    (``timeout_s`` from now, event-loop time) that ``disarm`` clears; one ``loop.call_at`` handle, re-armed only
    when it fires before the current deadline, cancels the waiting task once a deadline passes (``fired``)."""

    __slots__ = ("loop", "timeout_s", "deadline", "handle", "task", "fired", "interrupted")

    def __init__(self, timeout_s: float):
        self.loop = asyncio.get_running_loop()
        self.timeout_s = max(0.0, timeout_s)
        self.deadline: float | None = None
        self.handle: asyncio.TimerHandle | None = None
        self.task: asyncio.Task | None = None
        self.fired = False
        self.interrupted: str | None = None

    def interrupt(self, reason: str) -> None:
        """End the stream now (a drain's deadline): the read in progress, or the next one, fails with ``reason``.
        Only a task waiting in the read is cancelled (armed), never one writing to its client."""
        self.interrupted = reason
        if self.deadline is not None and self.task is not None:
            self.deadline = None
            self.fired = True
            self.task.cancel()

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


class OpenStreams:
    """The gateway's streams, for a shutdown to end: the committed ones (their ``Watchdog``s), which ``interrupt``
    ends with ``stream_interrupted``, those open now and from then on each committed later at its first read; and
    those still waiting for their first token (their attempt's ``asyncio.Timeout``), which it ends at once, the
    attempt loop then answering the shutdown's 503 (``shutdown_answer``). A load trial's drain swept the committed
    streams once: requests queued in the engine under preemption got their first token after it and ran on, or
    none before the exit, until the server's exit cancelled them (no event, no usage record, or a 499)."""

    __slots__ = ("_open", "_waiting", "reason")

    def __init__(self) -> None:
        self._open: set[Watchdog] = set()
        self._waiting: set[asyncio.Timeout] = set()
        self.reason: str | None = None

    def add(self, watchdog: Watchdog) -> None:
        self._open.add(watchdog)
        if self.reason is not None:
            watchdog.interrupt(self.reason)

    def discard(self, watchdog: Watchdog) -> None:
        self._open.discard(watchdog)

    def waiting(self, timeout: asyncio.Timeout) -> None:
        """``timeout`` bounds a stream's wait for its first token: a shutdown ends it now (``wait_over``)."""
        self._waiting.add(timeout)
        if self.reason is not None:
            timeout.reschedule(asyncio.get_running_loop().time())

    def wait_over(self, timeout: asyncio.Timeout) -> None:
        self._waiting.discard(timeout)

    def interrupt(self, reason: str) -> int:
        """End every open stream, and each committed from now on, naming ``reason``, and every wait for a first
        token; how many streams are open now."""
        self.reason = reason
        for watchdog in list(self._open):
            watchdog.interrupt(reason)
        now = asyncio.get_running_loop().time()
        for timeout in list(self._waiting):
            with contextlib.suppress(RuntimeError):   # one whose attempt just left it (it is dropped next)
                timeout.reschedule(now)
        return len(self._open)


def shutdown_answer() -> Result:
    """The answer to a request whose stream a shutdown ended before its first token: the 503 ``draining`` a new
    request gets then (with ``Retry-After``: another replica may serve it)."""
    return Result(503, {"content-type": "application/json", "retry-after": "1"},
                  body=error_body(503, f"{GATEWAY_SHUTDOWN} before this stream's first token; send the request "
                                       "again (to another replica)", code="draining", type_=SHUTDOWN_TYPE))


async def peek_stream(resp: UpstreamResponse, t0: float) -> Result | Failure | PassThrough:
    """Read events until the first content; hold them back. Returns a ``Failure`` on anything before content,
    or a ``PassThrough`` for an error event naming a request-specific 4xx."""
    it = resp.events.__aiter__()
    held: list[ChatEvent] = []
    choices = Choices()
    while True:
        try:
            batch = await it.__anext__()
        except StopAsyncIteration:
            return Failure("stream_cut", "upstream stream ended before any content", status=502)
        for i, ev in enumerate(batch):
            kind = ev.kind
            if kind == "malformed":
                return Failure("malformed", "upstream sent a malformed event", status=502)
            if kind == "error":   # before content: classified by its status like a non-streamed answer
                return classify_error_object(ev.error, _error_json(ev.error), "event before content")
            held.append(ev)
            if kind != "done":
                choices.note(ev)
            if kind in ("content", "done"):
                res = Result(200, {"content-type": "text/event-stream"}, ttft_s=time.monotonic() - t0)
                res.stream = Held(held, batch[i + 1:], it, resp, kind == "done", choices)  # type: ignore[assignment]
                if ev.usage:
                    res.usage = ev.usage
                return res


def _error_json(error) -> bytes:
    """An error event's object as OpenAI's error JSON body (how an error event before content is passed on)."""
    return msgspec.json.encode({"error": error})


class StreamEnd:
    """The end of one committed stream (``relay``'s ``on_done`` and ``on_end``), in two steps. ``settle``, before
    ``[DONE]`` goes downstream: what the client's next request must find done (``finished(res)``: its token
    reservations reconciled; a probe's outcome, which frees the half-open breaker's probe slot). ``end(ok)``, once
    the stream has ended (after the client has its whole answer, when it ended in ``[DONE]``): the upstream
    response ``resp`` closed, the outcome recorded (``record(ok, status, retry_after, probe, latency_s, ttft_s,
    reason)``), and what ``settle`` did not do."""

    __slots__ = ("resp", "res", "probe", "t0", "record", "finished", "settled")

    def __init__(self, resp: UpstreamResponse, res: Result, probe: bool, t0: float,
                 record: Callable[..., Awaitable[None]], finished: Callable[[Result], Awaitable[None]]) -> None:
        self.resp, self.res, self.probe, self.t0 = resp, res, probe, t0
        self.record, self.finished = record, finished
        self.settled = False

    async def settle(self) -> None:
        self.settled = True
        if self.probe:
            await self.record(True, None, None, True, time.monotonic() - self.t0, self.res.ttft_s)
        await self.finished(self.res)

    async def end(self, ok: bool) -> None:
        res = self.res
        await close_response(self.resp)
        dt = time.monotonic() - self.t0
        if self.settled and self.probe:
            pass                                       # recorded by ``settle``
        elif res.error in (None, GATEWAY_SHUTDOWN):    # finished, the client went away, or a drain ended it
            await self.record(True, None, None, self.probe, dt, res.ttft_s)
        else:
            await self.record(False, None, None, self.probe, dt, res.ttft_s, reason="stream_interrupted")
        if not self.settled:
            await self.finished(res)


async def relay(res: Result, held: Held, inter_s: float, batch: bool,
                on_end: Callable[[bool], Awaitable[None]], streams: OpenStreams | None = None,
                on_done: Callable[[], Awaitable[None]] | None = None) -> ChatStream:
    """The committed stream: held events, then the rest; a failure after content ends with an error event.
    ``on_done()`` runs before ``[DONE]`` goes downstream (what the client's next request must find done: the
    client API's codec ends the response with ``[DONE]``, ``gateway.sse.Last``); ``on_end(ok)`` once the stream
    has ended (cleanly, with an error, or closed by the client). ``streams``: the gateway's open streams, as their
    ``Watchdog``s, for a drain to interrupt (``OpenStreams.interrupt``).

    ``batch``: every event of a read goes downstream in one list with the events before it (one write
    downstream per read; nothing waits for more); else one list per event."""
    ok, err = False, None
    out = held.events
    watchdog: Watchdog | None = None
    if streams is not None and not held.done:
        watchdog = Watchdog(inter_s)
        streams.add(watchdog)
    try:
        if held.done:
            ok = True
            await _done(on_done)
            yield out
            return
        if not batch:
            for ev in out:
                yield [ev]
            out = []
        pending: list[ChatEvent] = held.pending
        while True:
            for ev in pending:
                kind = ev.kind
                if kind == "done":
                    out.append(DONE)
                    ok = True
                    await _done(on_done)
                    yield out
                    return
                if kind == "malformed":
                    err = "upstream sent a malformed event"
                    break
                if kind == "error":      # ends the stream as a cut does; its message is kept in the event's
                    err = _error_event_reason(ev.error)
                    break
                held.choices.note(ev)
                if ev.usage:
                    res.usage = ev.usage
                out.append(ev)
                if not batch:
                    yield out
                    out = []
            if err is not None:
                break
            if out:                          # (the watchdog is disarmed: a read arrived)
                yield out
                out = []
            watchdog = watchdog or Watchdog(inter_s)
            more, err = await _read(held.rest, watchdog)
            if err is not None:
                break
            if more is None:
                err = "upstream stream ended without [DONE]"
                break
            watchdog.disarm()                # the read awaited arrived
            pending = more
        if watchdog is not None:
            watchdog.disarm()
        ok, last = _last_event(res, held.choices, err)    # ok set before the yield: the client may leave during it
        out.append(last)
        if last is DONE:
            await _done(on_done)
        yield out
    finally:
        if watchdog is not None:
            watchdog.close()
            if streams is not None:
                streams.discard(watchdog)
        await asyncio.shield(on_end(ok))


def _error_event_reason(error) -> str:
    """Why a stream ended at an upstream's error event after content, its message quoted (``quoted_message``)."""
    said = quoted_message(error)
    return "upstream sent an error event" + (f": {said}" if said else "")


async def _done(on_done: Callable[[], Awaitable[None]] | None) -> None:
    if on_done is not None:
        await asyncio.shield(on_done())


def _last_event(res: Result, choices: Choices, err: str | None) -> tuple[bool, ChatEvent]:
    """How a stream that stopped without ``[DONE]`` ends (once per stream, off the per-event
    path): (ok, the last event). Every choice finished: the upstream's part is done, ``[DONE]`` or not, so the
    gateway sends it. Otherwise one ``stream_interrupted`` error event naming ``err``, also recorded on ``res``."""
    if choices.complete:
        return True, DONE
    res.error = err
    type_ = SHUTDOWN_TYPE if err == GATEWAY_SHUTDOWN else "upstream_error"
    return False, error_event(f"stream interrupted: {err}", type_=type_, code="stream_interrupted")


async def _read(it: AsyncIterator[list[ChatEvent]], watchdog: Watchdog) -> tuple[list[ChatEvent] | None, str | None]:
    """The next read under the inter-chunk deadline: (its events, None at the end; why the stream failed or
    None). Every read re-arms it: any bytes (a comment, part of an event) show the upstream is alive."""
    if watchdog.interrupted:
        return None, watchdog.interrupted
    watchdog.arm()
    try:
        return await it.__anext__(), None
    except StopAsyncIteration:
        return None, None
    except asyncio.CancelledError:
        if watchdog.expired():
            return None, watchdog.interrupted or f"upstream sent nothing for {watchdog.timeout_s:.0f}s"
        raise
    except (TimeoutError, asyncio.TimeoutError):
        return None, f"upstream sent nothing for {watchdog.timeout_s:.0f}s"
    except Exception as exc:
        return None, f"upstream connection failed ({type(exc).__name__})"
