"""The one owner of device, dtype and thread resolution.

``EngineArgs.device`` / ``dtype`` / ``num_threads`` are strings and optional
ints; everything that needs the torch objects (the model loader, the engine
core, the model runner) asks here, so that "auto" means the same thing
everywhere. Threads are set by role: the engine core (the process or thread
that runs the model) gets ``num_threads`` torch intra-op threads (None: all
cores, torch's default); a front end that runs no model keeps one.
"""

from __future__ import annotations

import os
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

SPIN_COUNT = 300_000   # libgomp's own default when OMP_WAIT_POLICY is unset: a few ms of spinning, then sleep
_POLICIES = ("auto", "spin", "passive")


def choose_omp_wait_policy(environ: dict | None = None, others_running: int | None = None,
                           cores: int | None = None) -> str:
    """Choose OpenMP's wait policy for the process that will run the model, before torch loads libgomp.

    * ``spin``: ``GOMP_SPINCOUNT=300000`` (a worker spins a few ms for the next parallel region, then sleeps:
      an idle engine burns nothing). Measured on the 2-core box, SmolLM2 bf16, interleaved: 1.29-1.42x
      output tok/s on 64 x (100 in, 128 out) and 1.07-1.27x single stream, vs ``passive``.
    * ``passive``: ``GOMP_SPINCOUNT=0``, sleep at once. Spinning on cores something else needs is much worse:
      0.51x of ``passive`` with one busy process beside it, and ~20x slower under a load average of ~10.
    * ``auto`` (default): ``spin`` when the machine is the engine's (fewer other processes runnable now
      than half the usable cores, ``others_running``), else ``passive``. Not the load average: that still
      counts a previous engine run for minutes.

    ``TANDEM_CPU_WAIT_POLICY`` (auto | spin | passive) picks; an ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT``
    the user set wins over all. The choice is written into ``environ`` (default ``os.environ``), where a
    process spawned later finds it. No effect once libgomp is loaded (torch imported), so whoever starts an
    engine core calls it before importing torch (``engine.core.core_loop.start_engine_core``: the core process's
    entry, ``ThreadCoreClient.start`` and ``LLMEngine``); importing ``engine`` never does.

    Args:
        environ: environment to read and write (tests).
        others_running: processes runnable now besides this one (default ``others_running()``).
        cores: usable cores (default this process's CPU affinity).

    Returns:
        the policy in effect: "spin", "passive" or "user" (OpenMP variables set by the user).

    Raises:
        ValueError: ``TANDEM_CPU_WAIT_POLICY`` not one of auto, spin, passive.
    """
    env = os.environ if environ is None else environ
    if "OMP_WAIT_POLICY" in env or "GOMP_SPINCOUNT" in env:     # the user's, or a parent process's choice
        return omp_wait_policy(env)
    policy = env.get("TANDEM_CPU_WAIT_POLICY", "auto").strip().lower()
    if policy not in _POLICIES:
        raise ValueError(f"TANDEM_CPU_WAIT_POLICY must be one of {', '.join(_POLICIES)}, got {policy!r}")
    if policy == "auto":
        cores = cores or len(os.sched_getaffinity(0))
        busy = count_others_running() if others_running is None else others_running
        policy = "spin" if busy < cores / 2 else "passive"
    env["OMP_WAIT_POLICY"] = "PASSIVE"
    env["GOMP_SPINCOUNT"] = str(SPIN_COUNT if policy == "spin" else 0)
    env["TANDEM_OMP_WAIT_CHOSEN"] = policy
    return policy


def choose_omp_binding(environ: dict | None = None, cpus: list[int] | None = None) -> str:
    """Bind the OpenMP threads of the process that runs the model one per core, before torch loads libgomp:
    ``OMP_PROC_BIND=true`` and ``OMP_PLACES`` one place per CPU of this process's affinity (libgomp then pins
    thread i, the initial thread being 0, to the i-th place). The CPUs the process had are kept in
    ``TANDEM_CPUS``: a thread it starts that runs no model calls ``unbind_thread`` (a thread inherits its
    creator's CPUs, and the initial thread is bound to one). As vLLM's CPU backend does
    (``VLLM_CPU_OMP_THREADS_BIND``, bound by default too); called by the engine core process's entry only
    (``start_engine_core``), where the initial thread is the model's. On a machine shared with other busy
    processes, ``TANDEM_CPU_OMP_THREADS_BIND=nobind`` (or ``--num-threads`` below the cores) may serve better:
    pinned, a thread cannot leave a core another process holds.

    Why (issue #34, measured on a 2-core KVM guest): unbound, libgomp's worker thread was woken on its master's
    CPU 150,000 times in 15 s (the guest's scheduler does not wake a task on a vCPU whose host thread is
    halted), so the two time-shared one core while the other idled; a grammar compile in the idle cgroup then
    shared that core too, and a client's stream reader woken there waited up to 68 ms. Bound, an unrelated
    stream's largest gap while a 400 KB schema compiled was 1.23-1.36x its p99 alone (3 runs; unbound,
    interleaved: 1.59-4.18x), and 32 x (100 in, 64 out) ran at 1.00-1.15x the output tok/s (3 pairs).

    Args:
        environ: environment to read and write (default ``os.environ``).
        cpus: usable CPUs (default this process's affinity).

    Returns:
        "bind"; "user" when ``OMP_PROC_BIND``, ``OMP_PLACES`` or ``GOMP_CPU_AFFINITY`` is set (left as set);
        "nobind" with fewer than two CPUs or ``TANDEM_CPU_OMP_THREADS_BIND=nobind``.
    """
    env = os.environ if environ is None else environ
    if any(k in env for k in ("OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY")):
        return "user"
    cpus = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    if env.get("TANDEM_CPU_OMP_THREADS_BIND", "auto").strip().lower() == "nobind" or len(cpus) < 2:
        return "nobind"
    env["OMP_PROC_BIND"] = "true"
    env["OMP_PLACES"] = ",".join(f"{{{c}}}" for c in cpus)
    env["TANDEM_CPUS"] = ",".join(map(str, cpus))
    return "bind"


def split_cpus(cpus: list[int], parts: int) -> list[list[int]]:
    """``cpus`` cut into ``parts`` contiguous groups of sizes differing by at most one, one per tensor-parallel
    rank of a host (more ranks than CPUs: one CPU each, shared in turn)."""
    n = len(cpus)
    if parts > n:
        return [[cpus[i * n // parts]] for i in range(parts)]
    base, extra = divmod(n, parts)
    starts = [i * base + min(i, extra) for i in range(parts + 1)]
    return [cpus[starts[i]:starts[i + 1]] for i in range(parts)]


def host_cpus(environ: dict | None = None) -> list[int]:
    """The CPUs this host's tensor-parallel ranks share: ``TANDEM_HOST_CPUS`` (set by the driver before it
    bound its own threads to its part), else this process's affinity."""
    env = os.environ if environ is None else environ
    listed = env.get("TANDEM_HOST_CPUS")
    return [int(c) for c in listed.split(",")] if listed else sorted(os.sched_getaffinity(0))


def pin_rank_cpus(args, local_rank: int, environ: dict | None = None) -> list[int] | None:
    """Give this process tensor-parallel rank ``local_rank``'s part of the host's CPUs (``split_cpus`` over
    ``tensor_parallel_size // nnodes`` ranks): its affinity, and OpenMP's places when it binds
    (``choose_omp_binding``); before torch loads libgomp. None (nothing done) with one rank.

    Returns:
        the rank's CPUs, or None.
    """
    env = os.environ if environ is None else environ
    if args.tensor_parallel_size == 1:
        return None
    cpus = host_cpus(env)
    env["TANDEM_HOST_CPUS"] = ",".join(map(str, cpus))
    mine = split_cpus(cpus, args.tensor_parallel_size // args.nnodes)[local_rank]
    if env.get("TANDEM_CPUS"):   # the binding a parent rank chose for itself, not ours
        for key in ("OMP_PROC_BIND", "OMP_PLACES", "TANDEM_CPUS"):
            env.pop(key, None)
    try:
        os.sched_setaffinity(0, mine)
    except OSError:
        pass
    choose_omp_binding(env, mine)
    return mine


def omp_places(environ: dict | None = None) -> str:
    """Where OpenMP's threads are bound in this process (``OMP_PLACES``, as ``choose_omp_binding`` or the user
    set it), or "unbound"."""
    env = os.environ if environ is None else environ
    return env.get("OMP_PLACES", "unbound")


def process_cpus() -> list[int]:
    """The CPUs this process was given: those ``choose_omp_binding`` recorded before OpenMP pinned each model
    thread to one of them (``TANDEM_CPUS``; the initial thread's own affinity is then one CPU), else the
    calling thread's affinity."""
    listed = os.environ.get("TANDEM_CPUS")
    return [int(c) for c in listed.split(",")] if listed else sorted(os.sched_getaffinity(0))


def unbind_thread() -> None:
    """Let the calling thread run on every CPU its process was given before ``choose_omp_binding`` pinned the
    model's threads (``TANDEM_CPUS``); nothing where nothing was bound. Called first by each thread of the
    engine core process that runs no model: the command reader, the grammar pool and its watcher."""
    if os.environ.get("TANDEM_CPUS"):
        try:
            os.sched_setaffinity(0, process_cpus())
        except (OSError, ValueError):   # CPUs taken away since (a cgroup's cpuset): stay where it is
            pass


def omp_wait_policy(environ: dict | None = None) -> str:
    """The OpenMP wait policy chosen for this process, as ``choose_omp_wait_policy`` returned it ("spin",
    "passive" or "user"), or "default" when nothing chose (libgomp's own: spin a few ms). Reads ``environ``
    (default ``os.environ``); sets nothing."""
    env = os.environ if environ is None else environ
    if "OMP_WAIT_POLICY" in env or "GOMP_SPINCOUNT" in env:
        return env.get("TANDEM_OMP_WAIT_CHOSEN", "user")
    return "default"


def count_others_running(reads: int = 5, gap_s: float = 0.002) -> float:
    """Processes runnable right now besides this one: the running count of ``/proc/loadavg`` (field 4,
    which counts the reader too), the least of ``reads`` reads ``gap_s`` seconds apart (~10 ms), so a
    process that only woke for a moment does not count; the 1-minute load average where unreadable."""
    try:
        least = None
        for i in range(reads):
            with open("/proc/loadavg") as f:
                n = int(f.read().split()[3].split("/")[0]) - 1
            least = n if least is None else min(least, n)
            if i + 1 < reads:
                time.sleep(gap_s)
        return float(least)
    except (OSError, ValueError, IndexError):
        return os.getloadavg()[0]


_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16", "auto": "bfloat16"}


def resolve_dtype(name: str) -> torch.dtype:
    """torch dtype for ``EngineArgs.dtype`` ("auto" = bfloat16: 2-3x faster
    than float32 on this CPU, native on GPUs).

    Raises:
        ValueError: unknown name.
    """
    import torch

    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {name!r}")
    return getattr(torch, _DTYPES[name])


def resolve_device(name: str) -> torch.device:
    """torch device for ``EngineArgs.device`` ("auto" = cuda if available, else cpu).

    Raises:
        ValueError: "cuda" requested but CUDA is not available.
    """
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available; use --device cpu")
    return device


def configure_core_threads(num_threads: int | None) -> None:
    """The engine core's torch intra-op threads: ``num_threads`` when given
    (None keeps torch's default, one per core)."""
    if num_threads:
        import torch

        torch.set_num_threads(num_threads)


def configure_frontend_threads() -> None:
    """A front end that runs no model (the engine core is in another
    process) keeps one torch thread, so it never competes with the core for
    cores. Only when torch is already imported: the front end never needs it."""
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)
