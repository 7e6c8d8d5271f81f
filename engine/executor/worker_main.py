"""A tensor-parallel rank other than the driver: join the group, load this
rank's part of the model and of the KV cache, then run each step whose
inputs the driver broadcasts, until it says stop.

Forked by its host's zygote for ``MultiprocExecutor`` (``serve``, its place
in ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``,
``TANDEM_TP_DEVICE``), or run in the serving process of a host other than
the first (``run_node``, from ``tandem engine serve --node-rank k``). The
driver sends its ``EngineArgs``: every rank loads the same model the same
way. A rank whose driver is gone exits: its zygote ends with the engine
that started it (and the kernel kills its ranks), or its next collective
fails (another host's driver).
"""

from __future__ import annotations

import logging
import os
import signal

logger = logging.getLogger("tandem.worker")


def run_worker(rank: int, world_size: int, local_rank: int, device_type: str) -> None:
    """Serve as ``rank`` until the driver says stop (torch is imported here: the caller pinned the threads)."""
    import torch

    from engine.distributed.parallel_state import TensorParallelGroup
    from engine.model_loader import import_loader_modules, load_model
    from engine.worker.device import resolve_dtype
    from engine.worker.model_runner import ModelRunner, resident_bytes
    from engine.worker.step_inputs import STOP, StepInputs

    device = torch.device(f"cuda:{local_rank}" if device_type == "cuda" else "cpu")
    tp = TensorParallelGroup.join(rank, world_size, local_rank, device)
    try:
        args = tp.broadcast_object()
        dtype = resolve_dtype(args.dtype)
        import_loader_modules()
        rss = resident_bytes()
        try:
            model, _, config = load_model(args, tp)
        except Exception as e:
            tp.check_loaded(f"{type(e).__name__}: {e}")   # the driver fails on this reason
            raise
        tp.check_loaded(None)
        blocks, cpu_blocks = ModelRunner.determine_num_blocks(args, config, device, dtype, model.shard.num_kv_heads)
        blocks, cpu_blocks = tp.min_int(blocks), tp.min_int(cpu_blocks)
        runner = ModelRunner(args, model, config, device, dtype, blocks, cpu_blocks, tp=tp)
        tp.gather_object(runner.memory_report(rss))
        while True:
            kind, sizes, payload = tp.broadcast_ints(0)
            if kind == STOP:
                break
            runner.run(StepInputs.from_wire(sizes, payload))
    finally:
        tp.close()


def run_node(args) -> int:
    """Serve a host other than the first (``tandem engine serve --node-rank k``, ``k > 0``): its first rank in
    this process, the others as children (``MultiprocExecutor``), until the driver says stop or is gone.

    Returns:
        0 once the driver said stop; 1 when a rank failed (logged).
    """
    from engine.executor.multiproc_executor import MultiprocExecutor
    from engine.worker.device import choose_omp_wait_policy, pin_rank_cpus

    choose_omp_wait_policy()
    cpus = pin_rank_cpus(args, 0)
    import torch

    from engine.worker.device import resolve_device

    torch.set_num_threads(args.num_threads or (len(cpus) if cpus else 1))
    device_type = resolve_device(args.device).type
    executor = MultiprocExecutor(args, device_type)
    try:
        run_worker(executor.first_rank, args.tensor_parallel_size, 0, device_type)
    except Exception as e:  # noqa: BLE001 - a lost driver or rank ends this host's part
        log_rank_failure(executor.first_rank, e)
        executor.kill()
        return 1                 # it did not end by being stopped: a host's supervisor sees that
    executor.shutdown()
    return 0


def log_rank_failure(rank: int, e: Exception) -> None:
    """Log why tensor-parallel rank ``rank`` ended on ``e``, once: the driver gone (its process ended or was killed
    without stopping the ranks: the collective's peer closed) one warning line; the model or its settings refused
    (a ValueError, a missing file: rank 0 says the same to the user) one error line; anything else its traceback.
    The rank then exits 1 whatever the cause (it did not end by being stopped)."""
    if isinstance(e, RuntimeError) and "Connection closed by peer" in str(e):
        logger.warning("tensor-parallel rank %d: its driver is gone (it ended without stopping the ranks); "
                       "stopping", rank)
    elif isinstance(e, (ValueError, FileNotFoundError)):
        logger.error("tensor-parallel rank %d failed: %s", rank, e)
    else:
        logger.exception("tensor-parallel rank %d failed", rank)


def serve() -> None:
    """A rank forked by the zygote (``os.environ`` holds its place): pin its CPUs, serve, exit. Its OpenMP
    runtime was loaded by the zygote, so its threads are pinned by affinity (inherited), not by places."""
    from types import SimpleNamespace

    from engine.worker.device import pin_rank_cpus

    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the engine stops its ranks; a Ctrl-C reaches the group
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    shape = SimpleNamespace(tensor_parallel_size=world, nnodes=int(os.environ.get("TANDEM_TP_NNODES", "1")))
    cpus = pin_rank_cpus(shape, local)
    import torch

    torch.set_num_threads(len(cpus) if cpus else 1)
    try:
        run_worker(rank, world, local, os.environ.get("TANDEM_TP_DEVICE", "cpu"))
    except Exception as e:  # noqa: BLE001 - logged; the driver sees this rank end
        log_rank_failure(rank, e)
        os._exit(1)
    os._exit(0)   # at once: the interpreter's own teardown of torch takes seconds
