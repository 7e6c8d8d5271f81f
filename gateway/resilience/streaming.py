"""A streamed answer in the attempt loop: ``peek_stream`` holds events back until the first content (before it,
any failure is a transparent retry), ``relay`` streams the committed answer, ending a failure after content with
one error event (and no ``[DONE]``); ``Watchdog`` is the inter-chunk deadline without a timer per chunk.

A stream is complete at ``[DONE]``, or when every choice it opened has a ``finish_reason`` (``Choices``): an
upstream that then ends (or stalls) without ``[DONE]`` has done its part, and the client gets ``[DONE]`` from
the gateway. A drain's deadline ends a stream still open with the same ``stream_interrupted`` event
(``GATEWAY_SHUTDOWN``), not counted against the backend. Any bytes from the upstream re-arm the inter-chunk
deadline, an SSE comment (``: keep-alive``) too; comments themselves are not relayed (``gateway/sse.py``).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable

from gateway.resilience.outcomes import Failure, PassThrough, Result, UpstreamResponse, classify_error_object
from gateway.sse import DONE, EventReader, classify, error_event, event


class Choices:
    """The choices a stream has opened and those that finished (a ``finish_reason``): ``complete`` when every
    choice opened has finished."""

    __slots__ = ("opened", "finished")

    def __init__(self) -> None:
        self.opened: set = set()
        self.finished: set = set()

    def note(self, finishes: list[tuple[Any, bool]]) -> None:
        """Count the choices of one event (content or meta): ``classify``'s (index, finished) pairs."""
        for index, finished in finishes:
            self.opened.add(index)
            if finished:
                self.finished.add(index)

    @property
    def complete(self) -> bool:
        return bool(self.opened) and self.opened <= self.finished


GATEWAY_SHUTDOWN = "the gateway is shutting down"   # why a drain ended a stream (not the upstream's fault)
# the error type of a stream the gateway's shutdown ended: that of the 503 ``draining`` new requests get then, so a
# client does not read an upstream failure into it
SHUTDOWN_TYPE = "service_unavailable"


@dataclass
class Held:
    """Events read before the commit, the live event iterator, and the upstream response to close."""

    events: list[bytes]      # the relay bytes of the held events
    rest: EventReader
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


async def peek_stream(resp: UpstreamResponse, t0: float) -> Result | Failure | PassThrough:
    """Read events until the first content; hold them back. Returns a ``Failure`` on anything before content,
    or a ``PassThrough`` for an error event naming a request-specific 4xx."""
    events = EventReader(resp.chunks)
    held: list[bytes] = []
    choices = Choices()
    while True:
        item = events.pop()
        if item is None:
            if await events.fill():
                continue
            item = events.tail()
            if item is None:
                return Failure("stream_cut", "upstream stream ended before any content", status=502)
        raw, data = item
        kind, usage, error, fixed, finishes = classify(data)
        if kind == "malformed":
            return Failure("malformed", "upstream sent a malformed event", status=502)
        if kind == "error":   # before content: classified by its status like a non-streamed answer
            return classify_error_object(error, data if fixed is None else fixed, "event before content")
        held.append(raw if fixed is None else event(fixed))
        if kind != "done":
            choices.note(finishes)
        if kind in ("content", "done"):
            res = Result(200, {"content-type": "text/event-stream"}, ttft_s=time.monotonic() - t0)
            res.stream = Held(held, events, resp, kind == "done", choices)  # type: ignore[assignment]
            if usage:
                res.usage = usage
            return res


async def relay(res: Result, held: Held, inter_s: float, batch: bool,
                on_end: Callable[[bool], Awaitable[None]], streams: set | None = None) -> AsyncIterator[bytes]:
    """The committed stream: held events, then the rest; a failure after content ends with an error event.
    ``on_end(ok)`` runs once it ends (cleanly, with an error, or closed by the client). ``streams``: the
    gateway's open streams, as their ``Watchdog``s, for a drain to interrupt (``Watchdog.interrupt``).

    Every complete event already read is relayed in one chunk with the events before it (the bytes of an
    event unchanged), so a read of several events costs one write downstream; nothing waits for more."""
    ok, err = False, None
    events, out = held.rest, held.events
    watchdog: Watchdog | None = None
    if streams is not None and not held.done:
        watchdog = Watchdog(inter_s)
        streams.add(watchdog)
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
                watchdog = watchdog or Watchdog(inter_s)
                more, err = await _read(events, watchdog)
                if err is not None:
                    break
                if more:
                    continue
                at_end, item = True, events.tail()
                if item is None:
                    continue
            if watchdog is not None:
                watchdog.disarm()                # the event awaited arrived
            raw, data = item
            kind, usage, _, fixed, finishes = classify(data)
            if kind == "done":
                out.append(DONE)
                ok = True
                yield b"".join(out)
                return
            if kind == "malformed":
                err = "upstream sent a malformed event"
                break
            if kind != "error":
                held.choices.note(finishes)
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
        if watchdog is not None:
            watchdog.disarm()
        ok, last = _last_event(res, held.choices, err)    # ok set before the yield: the client may leave during it
        out.append(last)
        yield b"".join(out)
    finally:
        if watchdog is not None:
            watchdog.close()
            if streams is not None:
                streams.discard(watchdog)
        await asyncio.shield(on_end(ok))


def _last_event(res: Result, choices: Choices, err: str | None) -> tuple[bool, bytes]:
    """How a stream that stopped without ``[DONE]`` or an error event ends (once per stream, off the per-event
    path): (ok, the last event). Every choice finished: the upstream's part is done, ``[DONE]`` or not, so the
    gateway sends it. Otherwise one ``stream_interrupted`` error event naming ``err``, also recorded on ``res``."""
    if choices.complete:
        return True, DONE
    res.error = err
    type_ = SHUTDOWN_TYPE if err == GATEWAY_SHUTDOWN else "upstream_error"
    return False, error_event(f"stream interrupted: {err}", type_=type_, code="stream_interrupted")


async def _read(events: EventReader, watchdog: Watchdog) -> tuple[bool, str | None]:
    """Read more bytes under the inter-chunk deadline: (more bytes came, why the stream failed or None). Every
    read re-arms it: any bytes (a comment, part of an event) show the upstream is alive."""
    if watchdog.interrupted:
        return False, watchdog.interrupted
    watchdog.arm()
    try:
        return await events.fill(), None
    except asyncio.CancelledError:
        if watchdog.expired():
            return False, watchdog.interrupted or f"upstream sent nothing for {watchdog.timeout_s:.0f}s"
        raise
    except (TimeoutError, asyncio.TimeoutError):
        return False, f"upstream sent nothing for {watchdog.timeout_s:.0f}s"
    except Exception as exc:
        return False, f"upstream connection failed ({type(exc).__name__})"
