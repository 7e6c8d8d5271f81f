"""glibc malloc's thresholds in a process that runs an engine core (``engine.worker.malloc_tuning``)."""

from __future__ import annotations

import ctypes.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.worker.malloc_tuning import malloc_tuning, tune_malloc

ROOT = Path(__file__).resolve().parents[2]

# A thread that, 50 times, takes 8 MiB in 64 KiB pieces (below glibc's mmap threshold: from the thread's
# arena), writes them and frees them all, as a grammar compile's working set comes and goes; it prints
# the minor page faults of its rounds after the first (RUSAGE_THREAD). argv[1] == "tuned": tune_malloc first.
CHURN = """
import ctypes, resource, sys, threading
from engine.worker.malloc_tuning import tune_malloc
if sys.argv[1] == "tuned":
    print("CHOSEN", tune_malloc())
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
PIECE, PIECES = 64 << 10, 128

def churn():
    faults = 0
    for round_ in range(50):
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        ptrs = [libc.malloc(PIECE) for _ in range(PIECES)]
        for p in ptrs:
            ctypes.memset(p, 1, PIECE)
        for p in ptrs:
            libc.free(p)
        if round_:
            faults += resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before
    print("FAULTS", faults)

t = threading.Thread(target=churn)
t.start()
t.join()
"""


def _run(script: str, variant: str) -> dict[str, str]:
    """``script`` run in a new Python with ``variant`` as argv[1] and none of the user's malloc or NumPy
    settings: its output lines "NAME value" as a dict."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("GLIBC_TUNABLES", "LD_PRELOAD", "TANDEM_MALLOC_CHOSEN", "NUMPY_MADVISE_HUGEPAGE")}
    out = subprocess.run([sys.executable, "-c", script, variant], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return dict(line.split(" ", 1) for line in out.stdout.splitlines())


def _churn_faults(variant: str) -> tuple[int, str]:
    lines = _run(CHURN, variant)
    return int(lines["FAULTS"]), lines.get("CHOSEN", "")


@pytest.mark.skipif(not sys.platform.startswith("linux") or not ctypes.util.find_library("c"),
                    reason="glibc's mallopt")
def test_a_tuned_process_keeps_a_threads_freed_heap_instead_of_faulting_it_back():
    """With glibc's defaults the memory each round frees is given back (the arena's top is trimmed) and faulted
    in again (14,162 faults in the 49 rounds on the AVX512-BF16 box); tuned, it stays (17 faults)."""
    default, _ = _churn_faults("default")
    tuned, chosen = _churn_faults("tuned")
    if chosen == "unavailable":
        pytest.skip("not glibc")
    assert chosen == "trim=64MiB,mmap=32MiB"
    assert default > 5000, default
    assert tuned * 20 < default, (tuned, default)


class _NoMallopt:
    @property
    def mallopt(self):
        raise AssertionError("mallopt called although the user chose")


def test_the_users_malloc_tunables_and_preloaded_allocators_win():
    env = {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}
    assert tune_malloc(env, libc=_NoMallopt()) == "user" and malloc_tuning(env) == "user"
    env = {"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}
    assert tune_malloc(env, libc=_NoMallopt()) == "preload"
    assert malloc_tuning({}) == "default"


def test_a_refused_mallopt_is_reported_not_raised():
    class Refusing:
        @staticmethod
        def mallopt(param, value):
            return 0

    env: dict = {}
    assert tune_malloc(env, libc=Refusing()) == "unavailable" and env["TANDEM_MALLOC_CHOSEN"] == "unavailable"


# An 8 MB NumPy buffer (NumPy madvises buffers of 4 MB and more with MADV_HUGEPAGE): whether the mapping that
# holds it carries the kernel's "hg" flag (/proc/self/smaps VmFlags). argv[1] == "tuned": tune_malloc first.
HUGEPAGE = """
import re, sys
import numpy as np
from engine.worker.malloc_tuning import tune_malloc
if sys.argv[1] == "tuned":
    tune_malloc()
a = np.ones(8 << 20, dtype=np.uint8)
addr = a.ctypes.data + (4 << 20)   # inside the page-aligned part NumPy madvised
flagged = None
for line in open("/proc/self/smaps"):
    m = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
    if m:
        inside = int(m[1], 16) <= addr < int(m[2], 16)
    elif inside and line.startswith("VmFlags"):
        flagged = " hg" in line
print("FLAGGED", flagged)
"""


@pytest.mark.skipif(not os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"), reason="no THP")
def test_a_tuned_process_keeps_numpy_from_asking_for_huge_pages():
    """With the thresholds raised the engine's tensors land where NumPy's freed buffers were; a region NumPy
    flagged for huge pages would then be collapsed by ``khugepaged`` under the memory-map lock (module doc):
    tuned, NumPy flags nothing, even when it was imported first."""
    seen = {variant: _run(HUGEPAGE, variant)["FLAGGED"] for variant in ("default", "tuned")}
    if seen["default"] != "True":
        pytest.skip(f"this NumPy or kernel does not madvise huge pages ({seen})")
    assert seen["tuned"] == "False", seen
