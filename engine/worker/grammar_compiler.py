"""Grammar compiles off the step loop: a bounded worker pool, a compile
timeout, a size limit, a cache of refusals and one memory bound.

A spec (``StructuredOutputsParams``) goes through ``GrammarCompilePool.submit``:

1. In the submitting thread (a worker thread: never an event loop, never
   the engine step): the spec's canonical text (msgspec, C), refused when
   over ``max_bytes``; its digest (sha256, the GIL released) is the key of
   everything below. No Python work per schema node here.
2. A digest seen before is answered at once: compiled (``GrammarCache``) or
   refused (the refusal cache: a 400 or the 408 of a timeout, again).
   A digest being compiled gets the same answer as that compile (a schema
   sent twice is compiled once).
3. Otherwise a pool thread has the spec checked (``validate_fn``: JSON
   parse and the supported subset, pure Python) in a worker PROCESS
   (``engine/worker/grammar_check.py``: the GIL of the core is never held for it),
   then compiles it (xgrammar, which releases the GIL). Several threads
   and check workers: a slow schema never holds up a quick one. Threads and
   workers run in ``SCHED_IDLE`` (Linux; else at ``WORKER_NICE`` more
   niceness): a long compile takes the cores the engine step leaves, not the
   step's; and in an idle cgroup where the process may make one
   (``engine/worker/idle_cgroup.py``): idle against other sessions' tasks too.
4. A watcher thread holds each spec to a budget of CPU seconds
   (``timeout_s``), counted by ``CpuMeter`` over the check worker's and the
   compile thread's CPU clocks: past it, 408, and the refusal is remembered
   (a spec's cost, not the host's load, decides: wall time would refuse a
   good schema forever whenever a busy engine starved its idle-class
   compile; seen in CI). A check worker past it is killed (and replaced on
   the next check); a compile cannot be interrupted (xgrammar has no
   cancellation), so its result is dropped when it ends, and its slot is
   given back at once: ``workers`` slots bound the specs being compiled,
   and as many more threads carry compiles past their budget to their end
   (a trial's four slow schemas held all four threads ~18 s past their 408,
   and every new schema waited 38-50 s). A request that has
   waited ``wait_s`` (wall) for a compile still within its budget gets 503,
   not remembered: the compile goes on, and the request sent again finds it
   compiling or compiled.

``GrammarCache`` is the only place compiled grammars are kept (xgrammar's
own compiler cache is disabled by the manager): an LRU bounded in entries
and in bytes (``CompiledGrammar.memory_size_bytes``). Live matchers keep
their grammar alive; those are bounded by ``max_num_seqs``. A grammar just
compiled for a request is also held for ``HANDOFF_S`` seconds (at most
``HANDOFF_ENTRIES``), so that its request finds it even when the LRU dropped
it meanwhile (or it alone is over the byte bound): a request that arrives
within that time never has its spec compiled again in the engine step. A
request reaches the engine core with its spec as a reference (the digest
alone, ``StructuredOutputsParams.is_reference``): its grammar is found in
the cache or the hand-off, else the request is refused (503, never expected
within ``HANDOFF_ENTRIES`` compiles).

Sources: vLLM v1 ``structured_output/__init__.py`` (compiles in a thread
pool, futures per request); its GHSA-389x-67px-mjg3 fix (bounded grammar
memory).
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from engine.worker.device import unbind_thread
from engine.worker.grammar_check import CheckFailed, CheckWorkers, CpuMeter, as_text, lower_priority, thread_cpu_clock
from engine.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

HANDOFF_S = 60.0  # a compiled grammar waits this long, seconds, for its request
HANDOFF_ENTRIES = 64
COMPILE_TIMES_KEPT = 1024  # compile wall times kept for benchmarks
WORKER_NICE = 10  # added to the compile threads' niceness (Linux: per thread)
WATCH_S = 0.05  # how often the watcher reads the CPU meters of specs in flight, seconds


@dataclass(frozen=True)
class GrammarLimits:
    """Bounds of grammar compilation (``EngineArgs.structured_outputs_*``).

    Attributes:
        workers: compile threads, and at most as many check processes (> 1:
            a slow schema does not hold up others).
        timeout_s: most CPU seconds one spec's check + compile may use; past
            it its requests get 408 and the spec is refused from then on.
        max_bytes: largest spec (its canonical JSON text), bytes; over: 400.
        cache_bytes: compiled grammars kept, bytes (LRU).
        cache_entries: compiled grammars kept, entries (LRU).
        refusal_entries: refused digests remembered (LRU).
        wait_s: longest wall time a request waits for a compile within its
            CPU budget (starved by a busy engine); past it, 503.
    """

    workers: int = 4
    timeout_s: float = 10.0
    max_bytes: int = 1 << 20
    cache_bytes: int = 256 << 20
    cache_entries: int = 256
    refusal_entries: int = 4096
    wait_s: float = 60.0


def grammar_limits(args) -> GrammarLimits:
    """The ``GrammarLimits`` of an ``EngineArgs`` (its ``structured_outputs_*``
    fields); a request waits for a compile at most 6x its CPU budget, and at
    least 60 s, of wall time."""
    return GrammarLimits(workers=args.structured_outputs_workers,
                         timeout_s=args.structured_outputs_compile_timeout_s,
                         wait_s=max(60.0, 6 * args.structured_outputs_compile_timeout_s),
                         max_bytes=args.structured_outputs_max_bytes,
                         cache_bytes=args.structured_outputs_cache_memory,
                         cache_entries=args.structured_outputs_cache_entries)


class GrammarRefused(ValueError):
    """A spec the pool will not compile; ``status`` 400 (invalid, unsupported,
    too large), 408 (the compile ran out of CPU budget) or 503 (the request
    waited too long for a compile starved by a busy engine; not remembered)."""

    def __init__(self, message: str, status: int = 400, where: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.where = where   # the spec's path the message begins with (its first sender's ``params.where[0]``)

    def for_sender(self, where: tuple[str, ...]) -> "GrammarRefused":
        """This refusal as told to a sender whose spec is at ``where`` (its ``params.where``): one spec, one
        digest, may come from several fields (a schema as ``response_format`` and as ``structured_outputs.json``),
        and is refused once and remembered with its first sender's path."""
        text = str(self)
        if self.where is None or not where or where[0] == self.where or not text.startswith(self.where):
            return self
        return GrammarRefused(where[0] + text[len(self.where):], self.status, where[0])


class GrammarCache:
    """Compiled grammars by digest: an LRU bounded in entries and bytes; thread safe.

    Args:
        max_entries: most grammars kept.
        max_bytes: most ``memory_size_bytes`` kept in all; a grammar larger
            than this alone is not kept (its requests still run with it).
    """

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, tuple[object, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def get(self, digest: str):
        """The grammar of ``digest`` (now most recently used), or None."""
        with self._lock:
            item = self._items.get(digest)
            if item is None:
                return None
            self._items.move_to_end(digest)
            return item[0]

    def put(self, digest: str, grammar, nbytes: int) -> None:
        """Keep ``grammar`` (``nbytes`` large), evicting the least recently used."""
        with self._lock:
            old = self._items.pop(digest, None)
            if old is not None:
                self.nbytes -= old[1]
            if nbytes > self.max_bytes:
                return
            self._items[digest] = (grammar, nbytes)
            self.nbytes += nbytes
            while len(self._items) > self.max_entries or self.nbytes > self.max_bytes:
                _, (_, size) = self._items.popitem(last=False)
                self.nbytes -= size


@dataclass
class _InFlight:
    """One spec being checked and compiled; each waiter with the
    ``time.monotonic()`` past which it is answered 503."""

    waiters: list[tuple[Callable[[str, GrammarRefused | None], None], float]] = field(default_factory=list)
    meter: CpuMeter = field(default_factory=CpuMeter)
    done: bool = False
    slot_freed: bool = False    # its compile slot was given back (``GrammarCompilePool._free_slot``)


Done = Callable[[str, "GrammarRefused | None"], None]


class GrammarCompilePool:
    """Compiles specs in a bounded thread pool (see the module doc).

    Args:
        compile_fn: ``compile_fn(params) -> (grammar, nbytes)`` of a
            validated spec; raises ``ValueError`` naming the part at fault.
        limits: the bounds.
        validate_fn: ``validate_fn(params)`` raises ``ValueError`` naming the
            part outside the supported subset (None: no check); a
            module-level function: ``submit`` runs it in a worker process
            (``engine/worker/grammar_check.py``), ``compile_now`` in its caller.
    """

    def __init__(self, compile_fn: Callable[[StructuredOutputsParams], tuple[object, int]],
                 limits: GrammarLimits, validate_fn: Callable[[StructuredOutputsParams], None] | None = None) -> None:
        self._compile_fn = compile_fn
        self._validate_fn = validate_fn or (lambda params: None)
        self.checks = CheckWorkers(validate_fn, WORKER_NICE) if validate_fn is not None else None
        self.limits = limits
        self.cache = GrammarCache(limits.cache_entries, limits.cache_bytes)
        self._refusals: OrderedDict[str, GrammarRefused] = OrderedDict()
        self._in_flight: dict[str, _InFlight] = {}
        self._handoff: OrderedDict[str, tuple[object, float]] = OrderedDict()  # digest -> (grammar, deadline)
        self._lock = threading.Lock()
        self._watch = threading.Condition(self._lock)  # notified when a flight starts or the pool shuts down
        self._watcher: threading.Thread | None = None
        self._closed = False
        # ``workers`` slots for specs within their budget; as many more threads for compiles past it, which
        # cannot be stopped (their slots are given back at the 408)
        self._slots = threading.Semaphore(limits.workers)
        self._executor = ThreadPoolExecutor(2 * limits.workers, thread_name_prefix="tandem-grammar",
                                            initializer=_lower_priority)
        # the latest compiles' wall times (a benchmark reads them); bounded, as a serving engine compiles forever
        self.compile_seconds: deque[float] = deque(maxlen=COMPILE_TIMES_KEPT)

    def submit(self, params: StructuredOutputsParams, done: Done) -> None:
        """Validate ``params`` here, compile it in a pool worker; ``done(digest, None)``
        once its grammar is in the cache, ``done(digest or '', GrammarRefused)`` when
        refused, timed out or waited too long. ``done`` runs in this, a worker or the watcher thread and
        must be quick.

        Call it from a worker thread, never an event loop: the size check, the
        digest and the caches run in the caller's thread (C code and dict
        look-ups: msgspec encodes the spec, sha256 hashes it with the GIL
        released); the check (a worker process) and the compile (xgrammar,
        the GIL released) run in the lowered-priority pool.
        """
        told = done

        def done(digest: str, error: GrammarRefused | None) -> None:   # each sender told its own path
            told(digest, error.for_sender(params.where) if error is not None else None)

        try:
            digest = self.digest(params)
        except GrammarRefused as exc:
            done("", exc)
            return
        with self._lock:
            refused = self._refusals.get(digest)
            flight = self._in_flight.get(digest)
            owner = refused is None and flight is None and self.cache.get(digest) is None
            if owner:
                flight = self._in_flight[digest] = _InFlight()
                self._start_watcher()
            if flight is not None:
                flight.waiters.append((done, time.monotonic() + self.limits.wait_s))
        if not owner:
            if flight is None:
                done(digest, refused)  # answered from a cache: a refusal, or None for a compiled grammar
            return
        try:
            self._executor.submit(self._compile_job, params, digest, flight)
        except RuntimeError as exc:  # shut down: answer, never leave the digest in flight
            self._finish(digest, flight, None, 0, GrammarRefused(f"{params.kind}: {exc}", 500))

    def compile_now(self, params: StructuredOutputsParams):
        """The grammar of ``params``, validated and compiled in the caller's
        thread on a miss (the offline engine); a reference
        (``params.is_reference``: a request's spec in the engine core) is
        only looked up.

        Raises:
            GrammarRefused: as ``submit`` reports it; 503 for a reference whose grammar is gone.
        """
        digest = self.digest(params)
        grammar = self.cache.get(digest)
        if grammar is not None:
            return grammar
        with self._lock:
            held = self._handoff.get(digest)
            if held is not None:
                return held[0]
            refused = self._refusals.get(digest)
        if refused is not None:
            raise refused.for_sender(params.where)
        if params.is_reference:  # its text stayed in the front end: nothing to compile
            raise GrammarRefused(f"structured_outputs: the request's compiled grammar ({digest[:16]}) left the "
                                 f"engine's grammar cache before the request reached the engine core (over "
                                 f"{HANDOFF_ENTRIES} other grammars compiled meanwhile); send the request again", 503)
        try:
            self._validate_fn(params)
            grammar, nbytes = self._timed_compile(params)
        except ValueError as exc:
            raise self._refuse(digest, GrammarRefused(str(exc), where=_first(params.where))) from None
        self.cache.put(digest, grammar, nbytes)
        return grammar

    def digest(self, params: StructuredOutputsParams) -> str:
        """sha256 of the spec's canonical text (computed once per params).

        Raises:
            GrammarRefused: the spec is over ``max_bytes`` (named in the message).
        """
        if params.digest is not None:
            return params.digest
        text = params.key().encode()
        if len(text) > self.limits.max_bytes:
            raise GrammarRefused(f"{params.kind}: the spec is {len(text)} bytes, over the limit of "
                                 f"structured_outputs_max_bytes ({self.limits.max_bytes} bytes)")
        return hashlib.sha256(text).hexdigest()

    def shutdown(self) -> None:
        """Stop taking compiles; kill the check workers (a compile in progress ends in the background)."""
        with self._lock:
            self._closed = True
            self._watch.notify_all()
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self.checks is not None:
            self.checks.shutdown()

    # ------------------------------------------------------------------ worker
    def _compile_job(self, params: StructuredOutputsParams, digest: str, flight: _InFlight) -> None:
        self._slots.acquire()
        try:
            self._check_and_compile(params, digest, flight)
        finally:
            self._free_slot(flight)

    def _free_slot(self, flight: _InFlight) -> None:
        """Give ``flight``'s compile slot back, once: when its job ends, or at its 408 (its thread goes on past its
        budget; the next spec need not wait for it)."""
        with self._lock:
            freed, flight.slot_freed = flight.slot_freed, True
        if not freed:
            self._slots.release()

    def _check_and_compile(self, params: StructuredOutputsParams, digest: str, flight: _InFlight) -> None:
        grammar, nbytes, error = None, 0, None
        try:
            params = as_text(params)  # one text for the check worker and for xgrammar
            if self.checks is not None:
                self.checks.check(params, flight.meter)
            if flight.done:  # out of budget during the check: refused already
                return
            flight.meter.begin(thread_cpu_clock())
            try:
                grammar, nbytes = self._timed_compile(params)
            finally:
                flight.meter.end()
        except ValueError as exc:
            error = GrammarRefused(str(exc), getattr(exc, "status", 400), _first(params.where))
        except CheckFailed as exc:
            error = GrammarRefused(str(exc), 500)
        except Exception as exc:  # noqa: BLE001 - a bug or MemoryError: answered, never left waiting
            error = GrammarRefused(f"{params.kind}: the grammar failed to compile: {type(exc).__name__}: {exc}", 500)
        self._finish(digest, flight, grammar, nbytes, error)

    def _finish(self, digest: str, flight: _InFlight, grammar, nbytes: int, error: GrammarRefused | None) -> None:
        """Keep the grammar (or remember the refusal) and answer the waiters."""
        with self._lock:
            if flight.done:  # timed out meanwhile: already answered and refused
                return
            flight.done = True
            self._in_flight.pop(digest, None)
            if error is None:
                self.cache.put(digest, grammar, nbytes)
                self._hand_off(digest, grammar)
            elif error.status != 500:  # an internal failure may pass: not remembered
                self._remember(digest, error)
        for waiter, _ in flight.waiters:
            waiter(digest, error)

    def _timed_compile(self, params: StructuredOutputsParams):
        start = time.perf_counter()
        out = self._compile_fn(params)
        self.compile_seconds.append(time.perf_counter() - start)
        return out

    # ----------------------------------------------------------------- watcher
    def _start_watcher(self) -> None:
        """Wake the watcher, starting it on the first compile (caller holds the lock)."""
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._watch_loop, name="tandem-grammar-watch", daemon=True)
            self._watcher.start()
        self._watch.notify()

    def _watch_loop(self) -> None:
        """Every ``WATCH_S`` while specs are in flight (asleep otherwise): refuse
        a spec past its CPU budget (408), answer a waiter past its wait (503)."""
        unbind_thread()
        while True:
            with self._lock:
                while not self._in_flight and not self._closed:
                    self._watch.wait()
                if self._closed:
                    return
                flights = list(self._in_flight.items())
            now = time.monotonic()
            for digest, flight in flights:
                used = flight.meter.used()
                if used > self.limits.timeout_s:
                    self._time_out(digest, flight, used)
                else:
                    self._answer_starved(digest, flight, now, used)
            time.sleep(WATCH_S)

    def _time_out(self, digest: str, flight: _InFlight, used: float) -> None:
        error = GrammarRefused(f"compiling the grammar used {used:.1f} CPU seconds, more than "
                               f"structured_outputs_compile_timeout_s ({self.limits.timeout_s:g} s); "
                               f"this spec is refused from now on", status=408)
        with self._lock:
            if flight.done:
                return
            flight.done = True
            self._in_flight.pop(digest, None)
            self._remember(digest, error)
        self._free_slot(flight)
        flight.meter.cancel()  # a check worker is killed; a compile cannot be stopped, its grammar is dropped
        for waiter, _ in flight.waiters:
            waiter(digest, error)

    def _answer_starved(self, digest: str, flight: _InFlight, now: float, used: float) -> None:
        with self._lock:
            if flight.done:
                return
            late = [w for w, deadline in flight.waiters if deadline <= now]
            flight.waiters = [(w, d) for w, d in flight.waiters if d > now]
        if late:
            error = GrammarRefused(
                f"the grammar is still compiling after {self.limits.wait_s:g} s: the engine is busy (compiles run "
                f"on the CPU time its step leaves) and it has used {used:.1f} of its "
                f"structured_outputs_compile_timeout_s ({self.limits.timeout_s:g} CPU seconds); the compile goes "
                f"on: send the request again", status=503)
            for waiter in late:
                waiter(digest, error)

    def _refuse(self, digest: str, error: GrammarRefused) -> GrammarRefused:
        with self._lock:
            self._remember(digest, error)
        return error

    def _hand_off(self, digest: str, grammar) -> None:
        """Hold a fresh grammar for its request (caller holds the lock)."""
        now = time.monotonic()
        self._handoff[digest] = (grammar, now + HANDOFF_S)
        self._handoff.move_to_end(digest)
        while self._handoff and (len(self._handoff) > HANDOFF_ENTRIES or next(iter(self._handoff.values()))[1] < now):
            self._handoff.popitem(last=False)

    def _remember(self, digest: str, error: GrammarRefused) -> None:
        """Record a refusal (caller holds the lock)."""
        self._refusals[digest] = error
        self._refusals.move_to_end(digest)
        while len(self._refusals) > self.limits.refusal_entries:
            self._refusals.popitem(last=False)


def _lower_priority() -> None:
    """Lower this compile thread's CPU priority (``grammar_check.lower_priority``:
    ``SCHED_IDLE``, else niceness + ``WORKER_NICE``; Linux, per thread).

    Measured with ``loadtests.bench.structured_isolation`` (docs/benchmarks/
    structured-isolation.md): at niceness +10 a 400 KB schema's compile still
    stretched an unrelated stream's gaps several-fold on two cores."""
    unbind_thread()   # the core process's model thread is bound to one core (``choose_omp_binding``)
    try:
        niceness = os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) + WORKER_NICE
    except (AttributeError, OSError):
        niceness = WORKER_NICE
    why = lower_priority(niceness)
    if why is not None:
        logger.debug("grammar compile thread not in an idle cgroup (%s): SCHED_IDLE ranks it below the engine's "
                     "own threads only, not below other sessions' or services' tasks", why)


def _first(where: tuple[str, ...]) -> str | None:
    return where[0] if where else None
