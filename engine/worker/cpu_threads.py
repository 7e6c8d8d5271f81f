"""The engine core's torch threads on CPU, step by step: one per core while
nothing else runs on its cores, fewer while other processes do.

A step's kernels split their work over the threads and meet at barriers
(the decoder stack's one-region decode step: 6 a layer), so a thread that
another process deschedules stalls the others: on the 2-core machine of
``docs/benchmarks/decode-roofline.md``, with other work running, a decode step
took 83-190 ms on two threads and 19-29 ms on one. Every CPU kernel gives the
same bits on any number of threads (``tests/engine/test_cpu_threads.py`` pins
the engine's outputs), so the count may change from one step to the next.

The load is the CPU time the other processes took on this process's CPUs
since the last sample (at least ``SAMPLE_S`` seconds back): the busy time
``/proc/stat`` counts on those CPUs (everything but idle and iowait; a
hypervisor's steal counts as busy) minus this process's own CPU time, in
cores. The step then gets the cores they left, rounded, at least one
(:func:`threads_for`).
"""

from __future__ import annotations

import os
import time
from typing import Callable

from engine.worker.device import process_cpus

SAMPLE_S = 0.25  # the shortest window of a load sample: ~25 clock ticks per core at Linux's 100 Hz
# The longest: a window since a sample older than this (the engine idle between steps) averages what ran while
# it waited, not what runs now (a benchmark's peer that has just exited took the next round's first 0.25 s
# to one thread: TPOT 3.8 ms against 3.3 with the count fixed), so it only starts a new window.
STALE_S = 1.0


def busy_seconds(stat_text: str, cpus: set[int], tick_s: float) -> float:
    """The busy time of ``cpus`` since boot, seconds, from ``/proc/stat``'s text: per ``cpuN`` line, the sum of
    its fields but idle and iowait (user, nice, system, irq, softirq, steal; guest is inside user), in ticks of
    ``tick_s`` seconds."""
    total = 0
    for line in stat_text.splitlines():
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
            continue
        fields = [int(v) for v in rest.split()]
        total += sum(fields[:8]) - fields[3] - fields[4]  # user nice system idle iowait irq softirq steal
    return total * tick_s


def threads_for(cores: int, others: float) -> int:
    """A step's threads: the ``cores`` that ``others`` (the cores' worth of CPU time other processes take)
    leave, rounded half up, at least one."""
    return max(1, min(cores, cores - int(others + 0.5)))


def follow_load(device_type: str, num_threads: int | None) -> LoadFollowingThreads | None:
    """The engine core's :class:`LoadFollowingThreads` (its torch threads now as the most), or None where the
    threads stay as set: not on CPU, a ``num_threads`` the user gave, or no ``/proc/stat`` or CPU affinity to
    read (not Linux)."""
    if device_type != "cpu" or num_threads:
        return None
    try:
        import torch

        return LoadFollowingThreads(torch.get_num_threads())
    except (OSError, AttributeError, ValueError):
        return None


def _read_stat() -> str:
    with open("/proc/stat") as f:
        return f.read()


class LoadFollowingThreads:
    """Sets the torch intra-op threads before each step (:meth:`apply`): at most ``max_threads``, fewer
    while other processes use this process's CPUs (see the top of this module).

    Args:
        max_threads: the threads of a quiet machine (the engine core's torch threads when it starts).
        cpus: the CPUs this process runs on (default ``device.process_cpus``).
        read_stat, cpu_time, clock, set_threads: ``/proc/stat``'s text, this process's CPU seconds,
            a monotonic clock, the setter (tests replace them).
    """

    def __init__(self, max_threads: int, cpus: set[int] | None = None,
                 read_stat: Callable[[], str] = _read_stat, cpu_time: Callable[[], float] = time.process_time,
                 clock: Callable[[], float] = time.monotonic, set_threads: Callable[[int], None] | None = None):
        self.max_threads = max_threads
        # the process's CPUs, not this thread's: once OpenMP binds the model's threads, the initial one has one
        self.cpus = set(process_cpus() if cpus is None else cpus)
        self.threads = max_threads
        self._read_stat, self._cpu_time, self._clock = read_stat, cpu_time, clock
        if set_threads is None:
            import torch

            set_threads = torch.set_num_threads
        self._set_threads = set_threads
        self._tick_s = 1.0 / os.sysconf("SC_CLK_TCK")
        self._last = self._sample()

    def _sample(self) -> tuple[float, float, float]:
        return self._clock(), busy_seconds(self._read_stat(), self.cpus, self._tick_s), self._cpu_time()

    def apply(self) -> int:
        """The threads for the next step, set when they change (a new load sample at most every
        ``SAMPLE_S`` seconds; unchanged in between, and after a window longer than ``STALE_S``, which only
        starts the next one). Returns them."""
        if self._clock() - self._last[0] < SAMPLE_S:
            return self.threads
        try:
            now = self._sample()
        except (OSError, ValueError):  # /proc/stat unreadable for a moment: keep the count
            return self.threads
        wall, busy, own = (b - a for a, b in zip(self._last, now))
        self._last = now
        if wall > STALE_S:  # the engine was idle: the window is the past's, keep the count until a fresh one
            return self.threads
        threads = min(self.max_threads, threads_for(len(self.cpus), max(0.0, busy - own) / wall))
        if threads != self.threads:
            self.threads = threads
            self._set_threads(threads)
        return self.threads
