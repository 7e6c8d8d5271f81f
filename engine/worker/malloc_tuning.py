"""glibc malloc's trim and mmap thresholds, and NumPy's huge pages, for a process that runs an engine core.

Why (issue #34, measured on the 2-core AVX512-BF16 KVM guest): with glibc's defaults, compiling the
isolation benchmark's 400 KB JSON schema (``loadtests.bench.structured_isolation.big_schema``) in a thread,
as the core's grammar pool does, took 1,399,722 minor page faults and 2.5-3.0 s of system time in 6.0-7.0 s
while its peak RSS never grew: the compile thread's arena kept growing past its top and giving the memory
back (``heap_trim``: ``madvise(MADV_DONTNEED)``, or a whole 64 MiB heap unmapped), then faulting it in again.
Every such unmap takes the process's memory-map lock for writing and flushes the TLB of each CPU running a
thread of the process, the engine step's included (earlier traces of the isolation benchmark had the engine's
threads in uninterruptible sleep, woken by the idle compile thread: docs/benchmarks/structured-isolation.md). With
the thresholds below (``tune_malloc``; 3 runs interleaved with 3 without, each in a new process): 15,448
faults, 0.04-0.05 s of system time, 3.6-4.0 s, peak RSS +1 MB.

Thresholds (``mallopt``, glibc's ``malloc/malloc.c``): ``M_MMAP_THRESHOLD`` 32 MiB (``DEFAULT_MMAP_THRESHOLD_MAX``
on 64-bit: the most glibc's own dynamic threshold ever reaches) and ``M_TRIM_THRESHOLD`` 64 MiB (twice
that, as the dynamic rule sets it). Setting either freezes the dynamic rule, so both are set. The cost: up
to 64 MiB freed at the top of each arena stays mapped instead of going back to the system (the served core's
RSS after the isolation benchmark: 1,379-1,380 MiB against 1,366-1,380).

NumPy's huge pages off in the same process (``NUMPY_MADVISE_HUGEPAGE=0``), or the thresholds do harm: NumPy
``madvise``s each buffer of 4 MB or more with ``MADV_HUGEPAGE``; one such buffer of the GGUF load lies in the
main heap, whose mapping keeps the flag after it is freed, and with the thresholds raised the engine's own
tensors are allocated there, so ``khugepaged`` (THP mode ``madvise``) collapses them into huge pages under the
process's memory-map lock: traced, it ran 100-127 ms inside the largest gaps of an unrelated stream (isolation
benchmark with the thresholds alone: 2.81x, 4.97x, 2.25x, 1.29x, 5.44x, 6.14x its p99 alone, against 1.77x,
2.69x, 3.47x, 1.24x, 1.26x, 1.62x with neither). With both: ``khugepaged`` never ran (2 traced runs). No anonymous
huge page was in use by the engine before (``AnonHugePages`` 0 in every mapping after the model loaded and
answered a request), so no speed is lost.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

M_TRIM_THRESHOLD = -1   # mallopt parameters, glibc's malloc.h
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20   # bytes
TRIM_THRESHOLD = 64 << 20   # bytes


def tune_malloc(environ: dict | None = None, libc=None) -> str:
    """Raise glibc malloc's mmap and trim thresholds in this process and turn NumPy's huge-page ``madvise`` off
    (module doc), once, before the engine core loads its model (``engine.core.core_loop.start_engine_core``). A
    ``glibc.malloc`` tunable the user set in ``GLIBC_TUNABLES`` wins (nothing is changed); so does a C library
    other than glibc (no ``mallopt``, or an allocator such as jemalloc or tcmalloc preloaded: glibc's thresholds
    then govern nothing), and a ``NUMPY_MADVISE_HUGEPAGE`` the user set. The result is written to ``environ``
    (default ``os.environ``) as ``TANDEM_MALLOC_CHOSEN`` for the ``engine ready`` log line (``malloc_tuning``).

    Args:
        environ: environment to read and write (tests).
        libc: the C library (tests; default this process's).

    Returns:
        "trim=64MiB,mmap=32MiB" when set; "user" (the user's tunables), "preload" (another allocator
        preloaded) or "unavailable" (no glibc ``mallopt``, or it refused).
    """
    env = os.environ if environ is None else environ
    if "glibc.malloc." in env.get("GLIBC_TUNABLES", ""):
        chosen = "user"
    elif any(name in env.get("LD_PRELOAD", "") for name in ("jemalloc", "tcmalloc", "mimalloc")):
        chosen = "preload"
    else:
        chosen = _mallopt(libc)
        if chosen != "unavailable" and "NUMPY_MADVISE_HUGEPAGE" not in env:
            _numpy_hugepages_off(env)
    env["TANDEM_MALLOC_CHOSEN"] = chosen
    return chosen


def _numpy_hugepages_off(env) -> None:
    """``NUMPY_MADVISE_HUGEPAGE=0`` for a NumPy imported from now on (and the processes started later); the same
    switch of a NumPy already imported (its ``_set_madvise_hugepage``, what its ``__init__`` calls with that
    variable)."""
    env["NUMPY_MADVISE_HUGEPAGE"] = "0"
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        setter = getattr(getattr(getattr(numpy, "_core", None), "multiarray", None), "_set_madvise_hugepage", None)
        if setter is not None:
            setter(False)


def _mallopt(libc) -> str:
    try:
        libc = libc if libc is not None else ctypes.CDLL(ctypes.util.find_library("c") or None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return "unavailable"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mallopt returns 1 on success; the mmap threshold first (setting it checks it against the maximum)
    if mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) != 1 or mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) != 1:
        return "unavailable"
    return f"trim={TRIM_THRESHOLD >> 20}MiB,mmap={MMAP_THRESHOLD >> 20}MiB"


def malloc_tuning(environ: dict | None = None) -> str:
    """What ``tune_malloc`` chose in this process, or "default" when it was not called."""
    env = os.environ if environ is None else environ
    return env.get("TANDEM_MALLOC_CHOSEN", "default")
