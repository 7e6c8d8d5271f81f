"""One process's place in a tensor-parallel group, and the collectives the
model and the executor use (vLLM's ``distributed/parallel_state.py``,
``GroupCoordinator``): torch.distributed, gloo on CPU and NCCL on CUDA,
rendezvous by ``env://`` (``MASTER_ADDR`` / ``MASTER_PORT``), so ranks may
run on one host or several.

Reductions are bitwise reproducible: a sum of two ranks' values is the same
whichever order a backend adds them in (IEEE addition commutes), so two
ranks use the backend's all-reduce; from three ranks on, the backend's order
may depend on the tensor's size (gloo's ring reduces chunk by chunk, and
which chunk a row falls in depends on the batch), so the partial sums are
all-gathered and added in rank order, in float32, then rounded once.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

HEADER = 16  # int64 words of a broadcast's header (kind + sizes)
# The model's collectives wait this long for a rank: past it a rank hangs, and the step fails (the engine with
# it). Generous: ranks meet several times per layer, and no layer of a step takes minutes.
COLLECTIVE_TIMEOUT_S = 300.0
# The step inputs' broadcast: the other ranks wait there while the engine is idle, for as long as it is.
IDLE_TIMEOUT = timedelta(days=3650)


class RankFailure(RuntimeError):
    """A step failed after its inputs were sent to the other ranks (a collective failed: a rank died or the
    group broke): the ranks may be out of step, so the engine cannot go on."""


@dataclass
class TensorParallelGroup:
    """This process's rank in the tensor-parallel world.

    Attributes:
        rank, world_size: global rank and world size (rank 0: the driver, which schedules and samples).
        local_rank: rank on this host (the CUDA device index).
        device: where this rank's weights, KV cache and activations live.
        device_group: the group the model's collectives run on (NCCL on CUDA, gloo on CPU), which
            waits ``COLLECTIVE_TIMEOUT_S`` for a rank.
        cpu_group: a gloo group for the step inputs the driver broadcasts, which waits as long as the
            engine idles (a group's timeout bounds every wait in it, a rank's wait for the next step too).
        interrupted: the driver left a step's collectives in the middle (a KeyboardInterrupt, Ctrl-C in a
            script): the other ranks wait in them, never for another broadcast, so the group cannot step again.
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    device_group: object
    cpu_group: object
    interrupted: bool = False     # the driver left a step in the middle (KeyboardInterrupt): ``MultiprocExecutor.stop``
    left: bool = False            # ``close`` done

    @classmethod
    def join(cls, rank: int, world_size: int, local_rank: int, device: torch.device,
             timeout_s: float = 600.0) -> "TensorParallelGroup":
        """Join the world (``init_process_group`` over ``env://``: ``MASTER_ADDR`` and ``MASTER_PORT`` must be
        set); blocks until every rank has joined or ``timeout_s`` passes (then RuntimeError: another host's
        ranks may be started minutes after this one)."""
        if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
            raise ValueError("tensor parallelism needs MASTER_ADDR and MASTER_PORT (env:// rendezvous)")
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s),
                                **({"device_id": device} if device.type == "cuda" else {}))
        group = dist.new_group(backend=backend, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        cpu = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        return cls(rank, world_size, local_rank, device, group, cpu)

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of ``x`` (every rank's same-shaped partial result), in a fixed order (see the
        module's docstring); ``x``'s dtype and shape. ``x`` may be overwritten."""
        if self.world_size == 2:
            dist.all_reduce(x, group=self.device_group)
            return x
        parts = torch.empty((self.world_size, *x.shape), dtype=x.dtype, device=x.device)
        dist.all_gather(list(parts.unbind(0)), x.contiguous(), group=self.device_group)
        total = parts[0].float()
        for part in parts[1:]:
            total += part
        return total.to(x.dtype)

    def gather_to_driver(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's ``x`` (same shape) stacked on the driver, ``[world_size, *x.shape]``; None elsewhere."""
        x = x.contiguous()
        out = torch.empty((self.world_size, *x.shape), dtype=x.dtype, device=x.device) if self.is_driver else None
        dist.gather(x, list(out.unbind(0)) if out is not None else None, dst=0, group=self.device_group)
        return out

    def broadcast_ints(self, kind: int, sizes: list[int] | None = None,
                       payload: np.ndarray | None = None) -> tuple[int, list[int], np.ndarray]:
        """The driver sends ``kind``, up to ``HEADER - 1`` ``sizes`` and an int64 ``payload`` (of ``sum(sizes)``
        words) to every rank, over the CPU group; every rank returns them (the others pass nothing)."""
        header = torch.zeros(HEADER, dtype=torch.int64)
        if self.is_driver:
            sizes = list(sizes or [])
            header[0] = kind
            header[1:1 + len(sizes)] = torch.tensor(sizes, dtype=torch.int64)
        dist.broadcast(header, src=0, group=self.cpu_group)
        words = header.tolist()
        sizes = words[1:]
        n = sum(sizes)
        buf = torch.from_numpy(np.ascontiguousarray(payload, dtype=np.int64)) if self.is_driver and n else \
            torch.empty(n, dtype=torch.int64)
        if n:
            dist.broadcast(buf, src=0, group=self.cpu_group)
        return words[0], sizes, buf.numpy()

    def broadcast_object(self, obj=None):
        """The driver's ``obj`` (picklable) on every rank."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]

    def gather_object(self, obj) -> list | None:
        """Every rank's ``obj`` (picklable), in rank order, on the driver; None elsewhere."""
        out = [None] * self.world_size if self.is_driver else None
        dist.gather_object(obj, out, dst=0, group=self.cpu_group)
        return out

    def check_loaded(self, problem: str | None) -> None:
        """Every rank says whether its part of the model loaded (``problem``: why not, else None), so that the
        driver fails on the rank's own reason, not on a later collective's "Connection closed by peer" (a trial's
        rank 2 refused its shard and the driver said only that gloo's peer had closed).

        Raises:
            ValueError: on the driver, naming the first rank that failed and its reason."""
        said = self.gather_object(problem)
        if said is not None and (failed := next(((r, p) for r, p in enumerate(said) if p), None)) is not None:
            raise ValueError(f"tensor-parallel rank {failed[0]} could not load its part: {failed[1]}")

    def min_int(self, value: int) -> int:
        """The smallest of every rank's ``value``."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())

    def close(self) -> None:
        """Leave the world (a no-op once left: a dropped engine's finalizer must not end the world a newer engine
        of this process formed since)."""
        if not self.left and dist.is_initialized():
            dist.destroy_process_group()
        self.left = True
