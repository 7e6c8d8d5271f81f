"""The asynchronous engine: ``LLMEngine.step()`` runs in a background thread,
and each request's delta outputs reach its asyncio consumer through a queue.

    generate() ──(thread-safe command queue: add / abort / drain / stop)──► engine thread
        ▲                                                                      │ step()
        └── per-request asyncio.Queue  ◄── loop.call_soon_threadsafe ◄─────────┘

The engine thread owns the ``LLMEngine`` (it is not thread-safe); the event
loop never touches it. PyTorch releases the GIL inside its kernels, so the
loop stays responsive while a step runs. As in vLLM's ``AsyncLLM``, a
consumer that stops iterating (client gone, task cancelled) aborts its
request, which frees its KV blocks before the next step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from engine.config import EngineArgs
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams

logger = logging.getLogger("tandem.async_engine")

# A listener sees every batch of outputs in the engine thread: (outputs, time.monotonic()).
OutputListener = Callable[[list[RequestOutput], float], None]


class EngineDrainingError(RuntimeError):
    """The engine is shutting down and admits no new requests (HTTP 503)."""


class EngineDeadError(RuntimeError):
    """The engine thread stopped (failed to load, crashed, or shut down) (HTTP 503)."""


@dataclass
class _Live:
    """Engine-thread bookkeeping of one client request."""

    n: int
    finished: set[int] = field(default_factory=set)


@dataclass
class _Stream:
    """Loop-side end of one request: its queue and the loop that reads it."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class AsyncEngine:
    """``LLMEngine`` behind an asyncio API.

    Args:
        args: engine configuration; nothing is loaded until ``start()``.

    Attributes:
        ready: True once the model is loaded and the step loop runs.
        tokenizer, max_model_len, served_model_name: the loaded engine's
            (available after ``start()``).
    """

    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        self.engine = None  # LLMEngine, owned by the engine thread after start()
        self.ready = False
        self.tokenizer = None
        self.max_model_len = 0
        self.served_model_name = args.served_model_name or ""
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._streams_lock = threading.Lock()
        self._listeners: list[OutputListener] = []
        self._thread: threading.Thread | None = None
        self._accepting = True
        self._dead: EngineDeadError | None = None
        self._stats = None

    # --------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        """Load the model in a worker thread, then start the step loop.

        Raises:
            whatever ``LLMEngine(args)`` raises (FileNotFoundError, ValueError,
            MemoryError); the engine stays not ready.
        """
        if self.ready:
            return
        from engine.llm_engine import LLMEngine  # heavy import (torch)

        self.engine = await asyncio.to_thread(LLMEngine, self.args)
        self.tokenizer = self.engine.tokenizer
        self.max_model_len = self.engine.max_model_len
        self.served_model_name = self.engine.served_model_name
        self._stats = self.engine.get_stats()
        self._thread = threading.Thread(target=self._run, name="tandem-engine", daemon=True)
        self._thread.start()
        self.ready = True

    async def shutdown(self, drain: bool = True, timeout: float = 30.0) -> None:
        """Stop admitting requests, let the running ones finish (``drain``, at
        most ``timeout`` seconds), abort the rest, then stop the thread.
        Aborted streams end with ``finish_reason="abort"``."""
        self._accepting = False
        if self._thread is None or not self._thread.is_alive():
            self.ready = False
            return
        if drain:
            done: concurrent.futures.Future = concurrent.futures.Future()
            self._commands.put(("drain", done))
            try:
                await asyncio.wait_for(asyncio.wrap_future(done), timeout)
            except asyncio.TimeoutError:
                logger.warning("drain timed out after %.1f s; aborting the remaining requests", timeout)
        stopped: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("stop", stopped))
        await asyncio.wrap_future(stopped)
        await asyncio.to_thread(self._thread.join)
        self.ready = False

    @property
    def is_alive(self) -> bool:
        """True while the step loop runs and has not crashed."""
        return self.ready and self._dead is None and self._thread is not None and self._thread.is_alive()

    @property
    def accepting(self) -> bool:
        """False once a shutdown (drain) began."""
        return self._accepting

    def add_output_listener(self, listener: OutputListener) -> None:
        """Call ``listener(outputs, now)`` in the engine thread after every
        step (metrics). It must be quick and must not raise."""
        self._listeners.append(listener)

    # ---------------------------------------------------------------- requests
    async def compile_grammar(self, params) -> None:
        """Compile a structured-output grammar (``StructuredOutputsParams``)
        in a worker thread, so that the engine thread finds it in its cache.

        Raises:
            ValueError: the spec is invalid or unsupported (names the part).
        """
        await asyncio.to_thread(self.engine.compile_grammar, params)

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its DELTA outputs until it finishes.

        Args:
            prompt: text (tokenized with the model's special tokens) or token ids.
            params: sampling parameters (``n`` choices share the prompt's blocks).
            request_id: unique among in-flight requests.
            priority: lower = served first under ``scheduling_policy="priority"``.

        Yields:
            ``RequestOutput`` deltas (new text/tokens per choice); the last
            has ``finished=True``.

        Raises:
            ValueError: duplicate id, or the engine rejected the request
                (empty prompt, over ``max_model_len``).
            EngineDrainingError: shutting down. EngineDeadError: not started or crashed.
            Exception: an engine failure while this request ran (the loop survives).

        Stopping the iteration early (``break``, ``aclose()``, cancellation)
        aborts the request and frees its KV blocks.
        """
        if self._dead is not None or not self.ready:
            raise EngineDeadError("the engine is not running")
        if not self._accepting:
            raise EngineDrainingError("the engine is shutting down and admits no new requests")
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, asyncio.Queue())
        with self._streams_lock:
            if request_id in self._streams:
                raise ValueError(f"request_id {request_id!r} is already in use")
            self._streams[request_id] = stream
        finished = False
        try:
            if self._dead is not None:  # died while we registered: _fail_all may have missed us
                finished = True
                raise EngineDeadError("the engine is not running")
            self._commands.put(("add", request_id, prompt, params, priority, time.monotonic()))
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True  # the engine already dropped it
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            with self._streams_lock:
                self._streams.pop(request_id, None)
            if not finished:
                self._commands.put(("abort", request_id, None))

    async def abort(self, request_id: str) -> None:
        """Abort a request; its blocks are free when this returns. Its stream
        (if still read) ends with ``finish_reason="abort"``."""
        if self._thread is None or not self._thread.is_alive():
            return
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("abort", request_id, done))
        await asyncio.wrap_future(done)

    def get_stats(self):
        """The latest ``EngineStats`` snapshot (refreshed after every step and
        every command; never blocks): num_running, num_waiting,
        kv_cache_usage (0..1), prefix_cache_hit_rate, tokens_in_flight, ...

        Raises:
            EngineDeadError: ``start()`` has not completed.
        """
        if self._stats is None:
            raise EngineDeadError("the engine is not started")
        return self._stats

    # ----------------------------------------------------------- engine thread
    def _run(self) -> None:
        eng = self.engine
        live: dict[str, _Live] = {}
        drain_waiters: list[concurrent.futures.Future] = []
        stop: concurrent.futures.Future | None = None
        try:
            while stop is None:
                deliveries: list[tuple[str, object]] = []
                outputs: list[RequestOutput] = []
                acks: list[concurrent.futures.Future] = []
                block = not eng.has_unfinished_requests()
                for cmd in self._take_commands(block):
                    kind = cmd[0]
                    if kind == "add":
                        _, rid, prompt, params, priority, arrival = cmd
                        try:
                            eng.add_request(rid, prompt, params, priority=priority, arrival_time=arrival)
                            live[rid] = _Live(params.n)
                        except Exception as exc:  # noqa: BLE001 - goes to that request only
                            deliveries.append((rid, exc))
                    elif kind == "abort":
                        _, rid, done = cmd
                        out = self._abort(eng, live, rid)
                        if out is not None:
                            outputs.append(out)
                            deliveries.append((rid, out))
                        if done is not None:
                            acks.append(done)
                    elif kind == "drain":
                        drain_waiters.append(cmd[1])
                    elif kind == "stop":
                        stop = cmd[1]
                if acks:  # abort() returns once the freed blocks show in get_stats()
                    self._refresh_stats(eng)
                    for done in acks:
                        done.set_result(None)
                if stop is None and eng.has_unfinished_requests():
                    try:
                        step_outputs = eng.step()
                    except Exception as exc:  # noqa: BLE001 - fail the in-flight requests, keep the loop
                        logger.exception("engine step failed; aborting %d in-flight request(s)", len(live))
                        for rid in list(live):
                            self._abort(eng, live, rid)
                            deliveries.append((rid, exc))
                        step_outputs = []
                    for out in step_outputs:
                        state = live.get(out.request_id)
                        if state is not None:
                            state.finished.update(o.index for o in out.outputs if o.finish_reason is not None)
                            if out.finished:
                                del live[out.request_id]
                        outputs.append(out)
                        deliveries.append((out.request_id, out))
                if stop is not None:  # abort whatever is left (drain timed out, or no drain)
                    for rid in list(live):
                        out = self._abort(eng, live, rid)
                        if out is not None:
                            outputs.append(out)
                            deliveries.append((rid, out))
                self._refresh_stats(eng)
                self._publish(outputs, deliveries)
                if not live and not eng.has_unfinished_requests():
                    for waiter in drain_waiters:
                        waiter.set_result(None)
                    drain_waiters.clear()
        except BaseException as exc:  # noqa: BLE001 - a bug here must not hang the clients
            logger.exception("the engine loop crashed")
            self._dead = EngineDeadError(f"the engine loop crashed: {type(exc).__name__}: {exc}")
            for waiter in drain_waiters:
                waiter.set_result(None)
        finally:
            self._dead = self._dead or EngineDeadError("the engine was shut down")
            self._fail_all(self._dead)
            # Nobody will process what is left: release every waiter.
            for cmd in self._take_commands(block=False):
                future = cmd[-1] if cmd[0] in ("abort", "drain", "stop") else None
                if future is not None and not future.done():
                    future.set_result(None)
            if stop is not None:
                stop.set_result(None)

    def _take_commands(self, block: bool) -> list[tuple]:
        cmds = []
        if block:
            cmds.append(self._commands.get())
        while True:
            try:
                cmds.append(self._commands.get_nowait())
            except queue.Empty:
                return cmds

    @staticmethod
    def _abort(eng, live: dict[str, _Live], rid: str) -> RequestOutput | None:
        """Abort ``rid`` in the engine; returns the final "abort" output for
        its unfinished choices (None when it was not running)."""
        state = live.pop(rid, None)
        eng.abort_request([rid])
        if state is None:
            return None
        return RequestOutput(
            request_id=rid, prompt=None, prompt_token_ids=[], finished=True,
            outputs=[CompletionOutput(index=i, finish_reason="abort") for i in range(state.n)
                     if i not in state.finished])

    def _refresh_stats(self, eng) -> None:
        try:
            self._stats = eng.get_stats()
        except Exception:  # noqa: BLE001 - keep the previous snapshot
            logger.exception("get_stats failed")

    def _publish(self, outputs: list[RequestOutput], deliveries: list[tuple[str, object]]) -> None:
        if outputs:
            now = time.monotonic()
            for listener in self._listeners:
                try:
                    listener(outputs, now)
                except Exception:  # noqa: BLE001
                    logger.exception("output listener failed")
        if not deliveries:
            return
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]] = {}
        with self._streams_lock:
            for rid, item in deliveries:
                stream = self._streams.get(rid)
                if stream is not None:
                    by_loop.setdefault(stream.loop, []).append((stream.queue, item))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that loop is closed: its consumers are gone
                pass

    def _fail_all(self, exc: BaseException) -> None:
        with self._streams_lock:
            streams = list(self._streams.values())
        for stream in streams:
            try:
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, exc)
            except RuntimeError:
                pass


def _put_all(items: list[tuple[asyncio.Queue, object]]) -> None:
    for q, item in items:
        q.put_nowait(item)
