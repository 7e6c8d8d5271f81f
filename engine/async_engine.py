"""The asynchronous engine: the engine core runs in its own process (or a thread), and each request's delta
outputs reach its asyncio consumer through a queue.

    generate() ─ tokenize ─► AddRequest ──(pipe, msgpack)──► engine core process: run_core_loop
        ▲                                                          │ one CoreStep per step
        └── per-request asyncio.Queue ◄── OutputProcessor ◄── reader thread
                                         (detokenize, stop strings; a stop string ─► FinishSequences)

As vLLM v1's ``AsyncLLM`` + ``EngineCoreProc``: the front end (this object, on the event loop, plus one reader
thread) keeps tokenization and output processing; the core (scheduler, model runner, KV cache) runs the model in
another process, so a step never holds the event loop's GIL. With ``engine_core_process=False`` the same core loop
runs in a thread of this process (tests that patch the core use it). A consumer that stops iterating (client gone,
task cancelled) aborts its request, which frees its KV blocks before the core's next step.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from engine.config import EngineArgs, served_model_names
from engine.core.core_client import ProcessCoreClient, ThreadCoreClient
from engine.core.core_messages import (AbortRequests, AddRequest, CoreStep, EngineCoreError, EngineStats,
                                  FinishSequences, params_to_wire, rebuild_error)
from engine.input_checks import with_vocab_logprobs
from engine.output_listeners import Listeners, OutputListener, PoolingListener
from engine.output_processor import OutputProcessor
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.core import ttft_log
from engine.core.ttft import PendingAdds, PrefixMirror, TTFTPrediction, predict_ttft
from engine.core.ttft_sim import POOLING

logger = logging.getLogger("tandem.async_engine")


class EngineDrainingError(RuntimeError):
    """The engine is shutting down and admits no new requests (HTTP 503)."""


class EngineDeadError(RuntimeError):
    """The engine core stopped (failed to load, crashed, its process died, or shut down) (HTTP 503)."""


class RequestWithdrawn(RuntimeError):
    """The request was withdrawn before anything of it was computed (``AsyncEngine.withdraw``): its caller sends
    it elsewhere (HTTP 503 ``withdrawn``; nothing was generated or billed)."""


@dataclass
class _Stream:
    """Loop-side end of one request: its queue and the loop that reads it."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class AsyncEngine:
    """The engine behind an asyncio API.

    Args:
        args: engine configuration; nothing is loaded until ``start()``.
            ``args.engine_core_process`` picks the core's home (process or thread).

    Attributes:
        ready: True once the model is loaded and the core loop runs.
        tokenizer, max_model_len, served_model_name, num_blocks: the loaded engine's (after ``start()``).
        served_model_names: every name a request may use (``served_model_name`` first, then the aliases).
        system_fingerprint: the core's ``engine/fingerprint.py`` value (model, engine build, numerics), sent with
            every answer.
        engine: the ``EngineCore`` in the thread mode (None in the process mode).
        core_pid: the core process's pid (None in the thread mode).
    """

    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        self.engine = None
        self.ready = False
        self.tokenizer = None
        self.max_model_len = 0
        self.num_blocks = 0
        self.served_model_names: tuple[str, ...] = tuple(served_model_names(args.served_model_name, args.model))
        self.system_fingerprint = ""
        self._client: ProcessCoreClient | ThreadCoreClient | None = None
        self._processor: OutputProcessor | None = None
        self._lock = threading.Lock()  # guards _processor, _streams and the listeners' calls
        self._streams: dict[str, _Stream] = {}
        self._listeners = Listeners()
        self._accepting = True
        self._stopping: asyncio.Future | None = None   # the shutdown under way (``shutdown``)
        self._dead: EngineDeadError | None = None
        self._stats: EngineStats | None = None
        # Finished structured answers the serving layer's second line caught (engine/serving/answer_check.py)
        self.structured_output_invalid = 0
        self._prefix_mirror = PrefixMirror()   # the core's prefix cache, from its events (TTFT predictions)
        self._pending = PendingAdds()          # sent, not yet in the core's last state (TTFT predictions)
        self._ttft_log = ttft_log.from_env()   # predictions made, for replays ($TANDEM_TTFT_LOG_DIR; None: off)
        self._stats_at = 0.0                   # monotonic seconds the last step's stats came (its successor began)
        self._acks: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._ack_ids = itertools.count()
        self._drain_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []

    # --------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        """Load the model (in the core process, or in a worker thread), then start the core loop.

        Raises:
            whatever loading raises (FileNotFoundError for a bad model path,
            ValueError, MemoryError, with the core's message); the engine
            stays not ready.
        """
        if self.ready:
            return
        if self.args.engine_core_process:
            from engine.worker.device import configure_frontend_threads
            from engine.tokenizer import load_tokenizer

            configure_frontend_threads()
            client = ProcessCoreClient(self.args)
            try:
                started, tokenizer = await asyncio.gather(
                    asyncio.to_thread(client.start, self._on_step, self._on_dead),
                    asyncio.to_thread(load_tokenizer, self.args.model, self.args.chat_template_source),
                    return_exceptions=True)
            except asyncio.CancelledError:   # the server stops while the model loads: its thread goes on
                client.abandon()             # and ends the core, which would otherwise outlive this process's exit
                raise
            for result in (started, tokenizer):
                if isinstance(result, BaseException):
                    if not isinstance(started, BaseException):
                        await asyncio.to_thread(client.shutdown)
                    raise result
            ready = started
        else:
            client = ThreadCoreClient(self.args)
            ready = await asyncio.to_thread(client.start, self._on_step, self._on_dead)
            self.engine = client.core
            tokenizer = client.core.tokenizer
        self._client = client
        self.tokenizer = tokenizer
        self._processor = OutputProcessor(tokenizer)
        self.max_model_len, self.num_blocks = ready.max_model_len, ready.num_blocks
        self.served_model_names = (ready.served_model_name,
                                   *served_model_names(self.args.served_model_name, self.args.model)[1:])
        self.system_fingerprint = ready.system_fingerprint
        self._stats = ready.stats
        self.ready = True

    @property
    def core_pid(self) -> int | None:
        return getattr(self._client, "pid", None)

    async def shutdown(self, drain: bool = True, timeout: float = 30.0) -> None:
        """Stop admitting requests, let the running ones finish (``drain``, at most ``timeout`` seconds), abort the
        rest (their streams end with ``finish_reason="abort"``), then stop the core. A call while one runs (or
        after) waits for that one (``tandem engine serve`` starts the drain at the stop signal and its app's shutdown
        calls this again); one with ``drain=False`` ends that one's drain now (an operator's second signal)."""
        self._accepting = False   # at once: a request after this call is refused
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._shutdown(drain, timeout))
        elif not drain and self._processor is not None:
            with self._lock:
                self._check_drained(now=True)
        await asyncio.shield(self._stopping)

    async def _shutdown(self, drain: bool, timeout: float) -> None:
        if self._client is None or not self._client.is_alive():
            self.ready = False
            return
        if drain:
            try:
                await asyncio.wait_for(self._drained(), timeout)
            except asyncio.TimeoutError:
                logger.warning("drain timed out after %.1f s; aborting the remaining requests", timeout)
        with self._lock:
            rids = self._processor.request_ids()
        for rid in rids:
            self._abort_here(rid)
        await asyncio.to_thread(self._client.shutdown)
        self.ready = False

    def _drained(self) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            if self._processor.num_requests == 0 or self._dead is not None:
                future.set_result(None)
            else:
                self._drain_waiters.append((loop, future))
        return future

    @property
    def served_model_name(self) -> str:
        """The name answers report and metrics carry: the first of ``served_model_names`` ("" before ``start()``
        when none was configured)."""
        return self.served_model_names[0] if self.served_model_names else ""

    @property
    def is_alive(self) -> bool:
        """True while the core loop runs and has not crashed."""
        return self.ready and self._dead is None and self._client is not None and self._client.is_alive()

    @property
    def dead_reason(self) -> str | None:
        """Why the core stopped (crashed, its process died), once it has; None while it runs."""
        return None if self._dead is None else str(self._dead)

    @property
    def accepting(self) -> bool:
        """False once a shutdown (drain) began."""
        return self._accepting

    def add_output_listener(self, listener: OutputListener) -> None:
        """Call ``listener(outputs, now)`` after every step (metrics), in the
        thread that processes outputs. It must be quick and must not raise."""
        self._listeners.outputs.append(listener)

    def add_pooling_listener(self, listener: PoolingListener) -> None:
        """Call ``listener(prompt_lens, arrival, now, reason)`` when an ``embed`` call ends ("stop" answered, "abort"
        its caller left; metrics: vLLM counts pooling requests as generation). Quick; it must not raise."""
        self._listeners.pooling.append(listener)

    # ---------------------------------------------------------------- requests
    async def compile_grammar(self, params) -> str:
        """Validate and compile a structured-output grammar
        (``StructuredOutputsParams``) in the core's grammar pool, off its step
        loop and this event loop, so that the core finds it in its cache; the
        grammar's digest (``dataclasses.replace(params, digest=...)`` spares
        the core hashing the spec again).

        Raises:
            GrammarRefused: (a ValueError) the spec is invalid, unsupported or
                too large (``status`` 400), or its compile timed out (408).
            EngineDeadError: not started.
        """
        if self._client is None:
            raise EngineDeadError("the engine is not running")
        return await self._client.compile_grammar(params)

    async def embed(self, prompts: list[list[int]], pooling_type: str | None = None,
                    normalize: bool | None = None) -> list[list[float]]:
        """Embeddings of tokenized prompts: their final hidden states pooled where the core runs, as pooling
        requests prefilled in chunks in steps shared with the running streams (``EngineCore.add_embed``,
        ``engine/pooling.py``); one float32 vector per prompt.

        Raises:
            ValueError: an empty prompt, one over ``max_model_len``, a bad token id or pooling type.
            EngineDrainingError: shutting down. EngineDeadError: not started, crashed or its process died.
        """
        if self._dead is not None or not self.ready or self._client is None:
            raise EngineDeadError("the engine is not running")
        if not self._accepting:
            raise EngineDrainingError("the engine is shutting down and admits no new requests")
        arrival = time.monotonic()
        with self._lock:   # queued prefill for TTFT predictions until the core's state counts the call
            state = self._stats.ttft if self._stats is not None else None
            if state is not None:
                cached = [self._prefix_mirror.cached_tokens(ids, state.block_size) for ids in prompts]
                self._pending.note_sent_many([(0, i, c, len(ids) - c, 0, POOLING)
                                              for i, (ids, c) in enumerate(zip(prompts, cached))], time.monotonic())
        try:
            vectors = await self._client.embed(prompts, pooling_type, normalize)
        except asyncio.CancelledError:   # its caller left: the core aborts the call's requests
            self._listeners.pooled([len(ids) for ids in prompts], arrival, time.monotonic(), "abort")
            raise
        self._listeners.pooled([len(ids) for ids in prompts], arrival, time.monotonic())
        return vectors

    async def withdraw(self, request_id: str, by: float, scale: float = 1.0) -> tuple[bool, float | None]:
        """Withdraw ``request_id`` if it still waits with nothing computed and its first token, re-predicted by
        the core from its place in the queue (``EngineCore.withdraw``; x ``scale``, the caller's correction of
        this engine's predictions), would come after ``by`` (``time.monotonic()`` seconds). A withdrawn request's
        ``generate`` raises ``RequestWithdrawn``. Returns (withdrawn, the core's prediction in seconds or None
        when the request is not waiting so); (False, None) without asking the core when the engine is not running
        or the request has an output already (a gateway's checkpoint often finds it decoding)."""
        with self._lock:
            asks = self._dead is None and self._client is not None and self._processor.awaits_first_token(request_id)
        if not asks:
            return False, None
        withdrawn, seconds = await self._client.withdraw(request_id, by, scale,
                                                         self._pending.arrival_tok_s(time.monotonic()))
        if withdrawn:
            with self._lock:
                self._processor.forget(request_id)
                self._deliver([(request_id, RequestWithdrawn(
                    f"withdrawn before its first token: predicted {scale * seconds:.2f} s, too late"))])
                self._check_drained()
        return withdrawn, seconds

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                       priority: int = 0, resume: dict[int, list[int]] | None = None,
                       cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its outputs until it finishes: deltas, or what ``params.output_kind`` asks.

        Args:
            prompt: text (tokenized with the model's special tokens) or token ids.
            params: sampling parameters (``n`` choices share the prompt's blocks).
            request_id: unique among in-flight requests.
            priority: lower = served first under ``scheduling_policy="priority"``.
            resume: continue the request from the tokens each of these choices had generated elsewhere
                (``EngineCore.add_request``); the outputs then hold only what follows them.
            cache_salt: vLLM's: the request shares prefix-cache blocks only with requests of the same salt.

        Yields:
            ``RequestOutput`` deltas (new text/tokens per choice; CUMULATIVE: each choice whole so far;
            FINAL_ONLY: one output, every choice whole); the last has ``finished=True``.

        Raises:
            ValueError: duplicate id, logprobs over ``max_logprobs`` (not ``priority``: the gateway passes its
                tenants' to any engine), or the engine rejected the request (empty prompt, over ``max_model_len``).
            EngineDrainingError: shutting down. EngineDeadError: not started, crashed or its process died.
            EngineCoreError: a step failed while this request ran (the core survives).

        Stopping the iteration early (``break``, ``aclose()``, cancellation)
        aborts the request and frees its KV blocks.
        """
        if self._dead is not None or not self.ready:
            raise EngineDeadError("the engine is not running")
        if not self._accepting:
            raise EngineDrainingError("the engine is shutting down and admits no new requests")
        params = with_vocab_logprobs(params, self.tokenizer.vocab_size, self.args.max_logprobs)
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.tokenizer.encode(prompt, add_special_tokens=True) if text is not None else list(prompt)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            self._processor.add_request(request_id, text, token_ids, params, resume)  # ValueError: id in use
            self._streams[request_id] = stream
            state = self._stats.ttft if self._stats is not None else None
            if state is not None:   # counted as queued by TTFT predictions until the core's state counts it
                cached = self._prefix_mirror.cached_tokens(token_ids, state.block_size, cache_salt)
                left = params.max_tokens if params.max_tokens is not None else self.max_model_len - len(token_ids)
                self._pending.note_sent(priority, len(token_ids) - cached, time.monotonic(), cached, left)
        finished = False
        try:
            if self._dead is not None:  # died while we registered: _on_dead may have missed us
                finished = True
                raise self._dead
            self._client.send(AddRequest(request_id, token_ids, params_to_wire(params), priority, time.monotonic(),
                                         resume, cache_salt))
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True  # the core already dropped it
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished:
                self._abort_here(request_id)
                if self._dead is None:
                    self._client.send(AbortRequests([request_id]))

    async def abort(self, request_id: str) -> None:
        """Abort a request; its blocks are free when this returns. Its stream
        (if still read) ends with ``finish_reason="abort"``."""
        if self._client is None or self._dead is not None:
            return
        self._abort_here(request_id)
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        ack = next(self._ack_ids)
        self._acks[ack] = (loop, future)
        self._client.send(AbortRequests([request_id], ack=ack))
        await future

    def get_stats(self) -> EngineStats:
        """The latest ``EngineStats`` snapshot (refreshed after every core
        step and every command; never blocks): num_running, num_waiting,
        kv_cache_usage (0..1), prefix_cache_hit_rate, tokens_in_flight, ...

        Raises:
            EngineDeadError: ``start()`` has not completed.
        """
        if self._stats is None:
            raise EngineDeadError("the engine is not started")
        return self._stats

    def count_invalid_structured_output(self) -> None:
        """One more finished structured answer that broke its schema (``tandem_structured_output_invalid``)."""
        self.structured_output_invalid += 1

    def predict_ttft(self, prompt_token_ids: list[int], priority: int = 0,
                     cache_salt: str | None = None) -> TTFTPrediction | None:
        """Predicted seconds to the first token of this prompt if it were added now (``engine/core/ttft.py``):
        the core's state after its last step and its prefix cache as mirrored here (what it holds for
        ``cache_salt``). None before the core published a state."""
        state = self._stats.ttft if self._stats is not None else None
        if state is None:
            return None
        cached = self._prefix_mirror.cached_tokens(prompt_token_ids, state.block_size, cache_salt)
        now = time.monotonic()
        state, elapsed, arrivals = self._pending.with_pending(state), max(now - self._stats_at, 0.0), \
            self._pending.arrival_tok_s(now)
        p = predict_ttft(state, len(prompt_token_ids), cached, priority, elapsed_s=elapsed, arrival_tok_s=arrivals)
        if self._ttft_log is not None:
            self._ttft_log.prediction(state, len(prompt_token_ids), cached, priority, elapsed, arrivals, p.seconds,
                                      now)
        return p

    # ------------------------------------------------- core side (one thread)
    def _abort_here(self, rid: str) -> None:
        """Forget ``rid`` in the front end; its stream (if any) and the
        listeners get its final "abort" output."""
        with self._lock:
            out = self._processor.abort_request(rid)
            if out is None:
                return
            self._listeners.stepped([out], time.monotonic())
            self._deliver([(rid, o) for o in self._processor.as_asked([out])])
            self._check_drained()

    def _on_step(self, step: CoreStep) -> None:
        """One core iteration: process its outputs and hand them to their streams."""
        deliveries: list[tuple[str, object]] = []
        with self._lock:
            proc = self._processor
            for rid, type_name, message in step.rejected:
                proc.forget(rid)
                deliveries.append((rid, rebuild_error(type_name, message)))
            if step.error is not None:
                error = EngineCoreError(step.error)
                failed = [out for rid in step.failed if (out := proc.fail_request(rid)) is not None]
                deliveries += [(rid, error) for rid in step.failed]
                if failed:
                    self._listeners.stepped(failed, step.timestamp)
            processed = proc.process_outputs(step.outputs, step.timestamp)
            deliveries += [(out.request_id, out) for out in proc.as_asked(processed.request_outputs)]
            self._stats = step.stats
            self._stats_at = time.monotonic()
            if step.stats.ttft is not None:
                self._prefix_mirror.apply(step.stats.ttft)
                self._pending.seen(step.stats.ttft.added)
            if processed.request_outputs:
                self._listeners.stepped(processed.request_outputs, step.timestamp)
            self._deliver(deliveries)
            self._check_drained()
        if processed.stops:
            self._client.send(FinishSequences(processed.stops))
        for ack in step.acks:
            loop, future = self._acks.pop(ack, (None, None))
            if future is not None:
                _call_soon(loop, _set_result, future)

    def _on_dead(self, reason: str) -> None:
        """The core loop ended: every in-flight request fails with one error."""
        self._dead = EngineDeadError(reason)
        with self._lock:
            streams = list(self._streams.items())
            failed = [out for rid, _ in streams if (out := self._processor.fail_request(rid)) is not None]
            if failed:     # vllm:request_success_total{finished_reason="error"}, as the streams' errors say
                self._listeners.stepped(failed, time.monotonic())
            self._check_drained()
        for _, stream in streams:
            _call_soon(stream.loop, stream.queue.put_nowait, self._dead)
        for loop, future in list(self._acks.values()):
            _call_soon(loop, _set_result, future)
        self._acks.clear()

    def _deliver(self, deliveries: list[tuple[str, object]]) -> None:
        """Put each item into its request's queue, one callback per event loop (under the lock)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]] = {}
        for rid, item in deliveries:
            stream = self._streams.get(rid)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream.queue, item))
        for loop, items in by_loop.items():
            _call_soon(loop, _put_all, items)

    def _check_drained(self, now: bool = False) -> None:
        """Resolve the drain's waiters once nothing runs (or the core died), or ``now`` (under ``_lock``)."""
        if self._drain_waiters and (now or self._processor.num_requests == 0 or self._dead is not None):
            for loop, future in self._drain_waiters:
                _call_soon(loop, _set_result, future)
            self._drain_waiters.clear()


def _call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # that loop is closed: its consumers are gone
        pass


def _set_result(future: asyncio.Future, value=None) -> None:
    if not future.done():
        future.set_result(value)


def _put_all(items: list[tuple[asyncio.Queue, object]]) -> None:
    for q, item in items:
        q.put_nowait(item)
