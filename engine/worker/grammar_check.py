"""Spec checks in worker processes: the pure-Python part of a grammar compile
(the JSON parse and the supported-subset check, ``engine/worker/json_schema_subset.py``)
runs outside the engine core process.

Why a process (issue #34, measured): Python code in any thread of the core
holds the GIL, and every torch op of the engine step releases and retakes
it, so a check of a 400 KB schema (tens of ms of Python) delays the step
many times over (the GIL convoy). The xgrammar compile itself stays in the
core's threads (``engine/worker/grammar_compiler.py``): it releases the GIL (py-spy
``--gil`` on the core during a 28 s compile: 2 of 372 GIL-holding samples in
the compile thread), and a grammar compiled elsewhere cannot be shipped
back: ``CompiledGrammar.serialize_json`` (xgrammar 0.2.9) grows
superlinearly (a 40 KB schema's 2.7 MB grammar: 184 MB of JSON, 22 s to
write, 12 s to read back).

``CheckWorkers.check`` sends the spec (its JSON schema as text: a string
crosses the pipe as one copy, no Python work per node) to an idle worker
(``python -m engine.worker.grammar_check``, in ``SCHED_IDLE`` as the compile
threads are, else at a higher niceness: ``lower_priority``) and waits for
its answer with the GIL released. While it waits, the spec's ``CpuMeter``
reads the worker's CPU time (``process_cpu_seconds``), so the compile pool
can hold the spec to a CPU budget and kill a worker that overruns it; the
next check starts a new one.

Wire (``multiprocessing.connection`` framing over the worker's stdin and
stdout): the worker, started with the check's ``module:name`` and a
niceness as arguments, imports the check and sends ``b"ready"`` (its
start-up is not counted against a spec), then pickled ``params`` in,
pickled ``(status, message)`` out; status 0 (passed), 400 (``ValueError``:
the spec's fault) or 500 (anything else).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

import msgspec

from engine.sampling_params import StructuredOutputsParams
from engine.worker.idle_cgroup import join_idle_cgroup


class CheckFailed(Exception):
    """The check failed for a reason that is not the spec's (``status`` 500):
    a bug in the check, or its worker died."""


def as_text(params: StructuredOutputsParams) -> StructuredOutputsParams:
    """``params`` with its JSON schema as JSON text (key order kept), as the
    workers and xgrammar take it; unchanged when it is text already.
    One msgspec encode (C, ~1 ms per 400 KB)."""
    if isinstance(params.json, (dict, bool)):
        return dataclasses.replace(params, json=msgspec.json.encode(params.json).decode())
    return params


class _Worker:
    """One ``python -m engine.worker.grammar_check`` process and its two pipe ends."""

    def __init__(self, ref: str, nice: int) -> None:
        child_in, to_child = os.pipe()
        from_child, child_out = os.pipe()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        # absolute: a child inherits the niceness of the thread that starts it (a lowered compile thread)
        niceness = os.getpriority(os.PRIO_PROCESS, os.getpid()) + nice
        self.proc = subprocess.Popen([sys.executable, "-m", "engine.worker.grammar_check", ref, str(niceness)], stdin=child_in,
                                     stdout=child_out, env=env, close_fds=True)
        os.close(child_in)
        os.close(child_out)
        self.send = Connection(to_child, readable=False)
        self.recv = Connection(from_child, writable=False)
        self.ready = False

    def wait_ready(self) -> None:
        """Block (GIL released) until the worker has imported what it needs.

        Raises:
            EOFError: it died first.
        """
        if not self.ready:
            if self.recv.recv_bytes() != b"ready":
                raise EOFError("the check worker did not start")
            self.ready = True

    def cpu_seconds(self) -> float:
        """CPU seconds the worker has used (user + system)."""
        return process_cpu_seconds(self.proc.pid)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.send.close()
        self.recv.close()


class CheckWorkers:
    """Worker processes that run ``validate_fn`` on specs; one per
    concurrent caller (the compile pool's threads bound them), started on
    first use and kept.

    Args:
        validate_fn: a module-level function ``validate_fn(params)`` that
            raises ``ValueError`` naming the part at fault (the workers
            import it by name).
        nice: added to the workers' niceness where ``SCHED_IDLE`` is refused.
    """

    def __init__(self, validate_fn: Callable[[StructuredOutputsParams], None], nice: int) -> None:
        self._ref = f"{validate_fn.__module__}:{validate_fn.__qualname__}"
        self._nice = nice
        self._idle: list[_Worker] = []
        self._busy: set[_Worker] = set()
        self._lock = threading.Lock()
        self._closed = False

    def check(self, params: StructuredOutputsParams, meter: CpuMeter | None = None) -> None:
        """Run the check of ``params`` (``as_text`` it first) in a worker.

        Args:
            meter: the spec's CPU meter; while the check runs it reads the
                worker's CPU seconds, and its ``cancel`` kills the worker
                (the check then raises ``CheckFailed``).

        Raises:
            ValueError: the spec's fault (the check's message).
            CheckFailed: the check crashed, its worker died or was killed.
        """
        worker = self._take()
        try:
            worker.wait_ready()
            if meter is not None:
                start = worker.cpu_seconds()
                meter.begin(lambda: worker.cpu_seconds() - start, worker.proc.kill)
            try:
                worker.send.send_bytes(pickle.dumps(params, protocol=pickle.HIGHEST_PROTOCOL))
                status, message = pickle.loads(worker.recv.recv_bytes())
            finally:
                if meter is not None:
                    meter.end()
        except (OSError, EOFError) as exc:
            self._drop(worker)
            raise CheckFailed(f"the spec's check worker died: {type(exc).__name__}") from None
        self._give_back(worker)
        if status == 400:
            raise ValueError(message)
        if status != 0:
            raise CheckFailed(message)

    def pids(self) -> list[int]:
        """Process ids of the live workers."""
        with self._lock:
            return [w.proc.pid for w in [*self._idle, *self._busy]]

    def shutdown(self) -> None:
        """Kill every worker (a check in progress fails with ``CheckFailed``)."""
        with self._lock:
            self._closed = True
            workers, self._idle = [*self._idle, *self._busy], []
        for w in workers:
            w.proc.kill()

    def _take(self) -> _Worker:
        with self._lock:
            if self._closed:
                raise CheckFailed("the compile pool is shut down")
            worker = self._idle.pop() if self._idle else None
        if worker is None or worker.proc.poll() is not None:
            worker = _Worker(self._ref, self._nice)
        with self._lock:
            self._busy.add(worker)
        return worker

    def _give_back(self, worker: _Worker) -> None:
        with self._lock:
            self._busy.discard(worker)
            if not self._closed:
                self._idle.append(worker)
                return
        worker.kill()

    def _drop(self, worker: _Worker) -> None:
        with self._lock:
            self._busy.discard(worker)
        worker.kill()


class CpuMeter:
    """CPU seconds one spec's check and compile have used so far: the phases
    that ended plus the running one's clock. Thread safe: the compiling thread
    begins and ends phases, the compile pool's watcher reads ``used`` and may
    ``cancel`` the running phase."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spent = 0.0
        self._clock: Callable[[], float] | None = None
        self._cancel: Callable[[], None] | None = None
        self.cancelled = False

    def begin(self, clock: Callable[[], float], cancel: Callable[[], None] | None = None) -> None:
        """A phase starts: ``clock()`` is its CPU seconds since it started;
        ``cancel()`` stops it (None: it cannot be stopped)."""
        with self._lock:
            self._clock, self._cancel = clock, cancel
            if self.cancelled and cancel is not None:
                cancel()

    def end(self) -> None:
        """The running phase ended: its seconds join the spent ones."""
        with self._lock:
            if self._clock is not None:
                self._spent += _read(self._clock)
            self._clock = self._cancel = None

    def used(self) -> float:
        """CPU seconds used in all, the running phase included."""
        with self._lock:
            return self._spent + (_read(self._clock) if self._clock is not None else 0.0)

    def cancel(self) -> None:
        """Stop the running phase where it can be stopped, and any later one that can."""
        with self._lock:
            self.cancelled = True
            if self._cancel is not None:
                self._cancel()


def _read(clock: Callable[[], float]) -> float:
    try:
        return clock()
    except OSError:  # the process or thread is gone: its last seconds are not known
        return 0.0


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (Linux ``/proc/<pid>/stat``,
    fields 14-15 in clock ticks; proc(5)).

    Raises:
        OSError: no such process, or no ``/proc``.
    """
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()  # after "pid (comm)": comm may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu_clock() -> Callable[[], float]:
    """A clock of the calling thread's CPU seconds since now (Linux: its
    ``pthread_getcpuclockid`` clock, readable from any thread; elsewhere
    wall seconds, an upper bound)."""
    try:
        clock_id = time.pthread_getcpuclockid(threading.get_ident())
        start = time.clock_gettime(clock_id)
        return lambda: time.clock_gettime(clock_id) - start
    except (AttributeError, OSError):
        start = time.monotonic()
        return lambda: time.monotonic() - start


def _resolve(ref: str) -> Callable:
    module, _, name = ref.partition(":")
    fn = importlib.import_module(module)
    for part in name.split("."):
        fn = getattr(fn, part)
    return fn


def lower_priority(niceness: int) -> str | None:
    """Put the calling thread (a process's main thread: the process) in
    Linux's ``SCHED_IDLE`` class: it runs only on what the engine step
    leaves of a core, and a step never waits for it to be preempted. Where
    that is refused or not Linux, raise its niceness to ``niceness`` (never
    lower it: that needs privileges); else leave it. Then move it into the
    process's idle cgroup (``idle_cgroup.join_idle_cgroup``: idle against
    other sessions' and services' tasks too, which ``SCHED_IDLE`` alone is
    not). Returns None, or why the thread is not in an idle cgroup."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # pid 0: the calling thread
    except (AttributeError, OSError):
        try:
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, max(niceness, os.getpriority(os.PRIO_PROCESS, tid)))
        except (AttributeError, OSError):
            pass
    return join_idle_cgroup()   # not Linux: no /proc, and it says so


def main() -> None:
    """A worker's loop: checks until its stdin closes (its engine core is gone)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the group: the core ends us by closing stdin
    lower_priority(int(sys.argv[2]))  # the niceness asked for, where SCHED_IDLE is refused
    check = _resolve(sys.argv[1])  # imported before "ready": its import is not a spec's cost
    inbox = Connection(os.dup(0), writable=False)
    outbox = Connection(os.dup(1), readable=False)
    os.dup2(2, 1)  # a stray print goes to stderr, never into the answers
    outbox.send_bytes(b"ready")
    while True:
        try:
            params = pickle.loads(inbox.recv_bytes())
        except EOFError:
            return
        try:
            check(params)
            answer = (0, None)
        except ValueError as exc:
            answer = (400, str(exc))
        except Exception as exc:  # noqa: BLE001 - a bug or a too-deep schema: answered, the worker lives on
            answer = (500, f"{params.kind}: the spec's check failed: {type(exc).__name__}: {exc}")
        outbox.send_bytes(pickle.dumps(answer))


if __name__ == "__main__":
    main()
