"""The tensor-parallel ranks of this host, other than the one in this
process: started, watched and stopped (vLLM's multiprocessing executor).

Each rank is a process of its own (``RankProcess``, forked by this
process's zygote) that joins the driver's torch.distributed group over
``env://`` and serves steps until told to stop
(``engine/executor/worker_main.py``). When this process ends, even by
SIGKILL, the zygote's stdin closes: it exits and the kernel kills the ranks
it forked, so no rank outlives its host's engine. A watcher thread
polls the ranks every 0.2 s: one that dies fails the engine (``failure``;
the others are killed, and ``on_failure`` is called, which the engine core
process answers by exiting, so the front end reports it dead).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable

from engine.executor.ports import free_port

logger = logging.getLogger("tandem.executor")

POLL_S = 0.2   # the watcher's period: a dead rank is seen within it


_ZYGOTE: list = []   # this process's zygote (engine/executor/zygote.py), started on first use
_ZYGOTE_LOCK = threading.Lock()


def _zygote():
    """This process's zygote, started now if there is none alive."""
    from engine.executor.zygote import Zygote

    with _ZYGOTE_LOCK:
        if not _ZYGOTE or not _ZYGOTE[0].alive():
            _ZYGOTE[:] = [Zygote()]
        return _ZYGOTE[0]


class RankProcess:
    """One rank's process, forked by this process's zygote (``engine/executor/zygote.py``: torch and the
    engine imported once, a rank starts in milliseconds), killed with it.

    Args:
        env: the rank's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...).
    """

    def __init__(self, env: dict[str, str]) -> None:
        self.zygote = _zygote()
        self.pid = self.zygote.fork(env)

    def poll(self) -> int | None:
        """The exit code once ended (negative: killed by that signal), else None."""
        if not self.zygote.alive() and self.pid not in self.zygote.exit_codes:
            return -signal.SIGKILL   # its zygote is gone: so is it
        return self.zygote.exit_codes.get(self.pid)

    def kill(self) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def wait(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds (None: no limit) for the rank to end; whether it did."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
        return True


class MultiprocExecutor:
    """Starts this host's ranks ``node_rank * per_node + 1 ..`` (host 0: all but the driver's rank 0; another
    host: all but the one its serving process runs) as child processes.

    Args:
        args: the ``EngineArgs`` (tensor_parallel_size, nnodes, node_rank, master_addr, master_port, device).
        device_type: "cpu" or "cuda": the ranks' device (rank ``r`` of a host uses ``cuda:<local rank>``).
        on_failure: called once, from the watcher thread, with the reason a rank died.

    Attributes:
        master_port: the rendezvous port (``args.master_port``, or a free one).
        failure: why the ranks failed (a rank died, or a collective failed), or None.
        closed: the ranks were stopped or killed (a rank's exit is then no failure).
    """

    def __init__(self, args, device_type: str, on_failure: Callable[[str], None] | None = None) -> None:
        self.per_node = args.tensor_parallel_size // args.nnodes
        self.first_rank = args.node_rank * self.per_node
        self.master_addr = args.master_addr
        self.master_port = args.master_port or free_port(args.master_addr)
        self.on_failure = on_failure
        self.failure: str | None = None
        self.closed = False
        self._lock = threading.Lock()
        self.procs: dict[int, RankProcess] = {}
        from engine.worker.device import host_cpus

        env = {"MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port),
               "WORLD_SIZE": str(args.tensor_parallel_size), "TANDEM_TP_DEVICE": device_type,
               "TANDEM_TP_NNODES": str(args.nnodes), "TANDEM_HOST_CPUS": ",".join(map(str, host_cpus()))}
        for local in range(1, self.per_node):
            rank = self.first_rank + local
            self.procs[rank] = RankProcess({**env, "RANK": str(rank), "LOCAL_RANK": str(local)})
        os.environ.update(MASTER_ADDR=self.master_addr, MASTER_PORT=str(self.master_port))
        if self.procs:
            threading.Thread(target=self._watch, name="tandem-tp-watcher", daemon=True).start()
        logger.info("tensor parallelism: %d ranks on %d host(s), rendezvous %s:%d; started ranks %s here",
                    args.tensor_parallel_size, args.nnodes, self.master_addr, self.master_port,
                    sorted(self.procs) or "none")

    def _watch(self) -> None:
        while not self.closed:
            for rank, proc in self.procs.items():
                code = proc.poll()
                if code is not None and not self.closed:
                    self.fail(f"tensor-parallel rank {rank} died (exit code {code})")
                    return
            time.sleep(POLL_S)

    def fail(self, reason: str) -> None:
        """Record the ranks' failure (the first reason kept), kill the ranks still running, then call
        ``on_failure``."""
        with self._lock:
            if self.failure is not None:
                return
            self.failure = reason
        logger.error("%s: the engine stops", reason)
        self.kill()
        if self.on_failure is not None:
            self.on_failure(reason)

    def kill(self) -> None:
        """End every rank now (SIGKILL) and reap it."""
        self.closed = True
        for proc in self.procs.values():
            proc.kill()
        for proc in self.procs.values():
            proc.wait()

    def stop(self, tp) -> None:
        """Stop the ranks and leave the group ``tp`` (``TensorParallelGroup``; a no-op once left, so a new engine
        may form one): after clean steps they are told to stop and waited for (``shutdown``); failed ranks, or
        ranks a step was interrupted in (``tp.interrupted``), are killed at once: they wait in that step's
        collectives, never for the stop (an engine trial's Ctrl-C in a script hung 300 s, gloo's timeout)."""
        from engine.worker.step_inputs import STOP

        if not self.closed and self.failure is None and not tp.interrupted:
            try:
                tp.broadcast_ints(STOP)
            except Exception:  # noqa: BLE001 - a rank gone already: shutdown kills the rest
                pass
            self.shutdown()
        elif not self.closed:
            self.kill()
        tp.close()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Wait up to ``timeout_s`` for the ranks to leave (the driver told them to stop), then kill the rest."""
        self.closed = True
        deadline = time.monotonic() + timeout_s
        for proc in self.procs.values():
            proc.wait(max(0.0, deadline - time.monotonic()))
        self.kill()


def start_driver(args, device):
    """Start this host's other ranks and join the group as the driver (rank 0), then send the ranks the
    engine's arguments: (executor, ``TensorParallelGroup``). On CUDA the driver uses ``cuda:0``.

    Raises:
        RuntimeError, ValueError: the group could not be formed (the ranks started are killed).
    """
    import torch
    import torch.distributed as dist

    from engine.distributed.parallel_state import TensorParallelGroup

    if dist.is_initialized():     # torch.distributed's one world per process ("initialize ... twice" otherwise)
        raise RuntimeError("another tensor-parallel engine is alive in this process: shut it down first "
                           "(LLM.shutdown(), or drop every reference to that LLM)")
    if args.node_rank != 0:
        raise ValueError("only host 0 (node_rank 0) drives the engine; the others run `tandem engine serve "
                         "--node-rank k`, which serves no requests")
    device = torch.device("cuda:0") if device.type == "cuda" else device
    executor = MultiprocExecutor(args, device.type)
    try:
        tp = TensorParallelGroup.join(0, args.tensor_parallel_size, 0, device)
        tp.broadcast_object(args)
    except BaseException:
        executor.kill()
        raise
    return executor, tp


def rank_threads(args) -> int | None:
    """Torch threads of the driver rank on CPU: its share of the host's CPUs (``split_cpus``), or None
    (torch's default) with one rank."""
    from engine.worker.device import host_cpus, split_cpus

    if args.tensor_parallel_size == 1:
        return None
    return len(split_cpus(host_cpus(), args.tensor_parallel_size // args.nnodes)[0])
