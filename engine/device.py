"""The one owner of device, dtype and thread resolution.

``EngineArgs.device`` / ``dtype`` / ``num_threads`` are strings and optional
ints; everything that needs the torch objects (the model loader, the engine
core, the model runner) asks here, so that "auto" means the same thing
everywhere. Threads are set by role: the engine core (the process or thread
that runs the model) gets ``num_threads`` torch intra-op threads (None: all
cores, torch's default); a front end that runs no model keeps one.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

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
