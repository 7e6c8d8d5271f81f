"""Attention kernels: Triton on CUDA, a C kernel (or PyTorch) on CPU.

    backend = get_attention_backend("auto", device)   # "triton" on CUDA, "cpu" (else "torch") elsewhere
    plan = backend.plan(key_cache, num_heads, query_start_loc, seq_lens, block_tables) if backend.plan else None
    backend.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    backend.paged_attention(query, key_cache, value_cache, query_start_loc, seq_lens, block_tables, scale,
                            **({"plan": plan} if plan is not None else {}))

Modules: cpu_attention (the C kernel of csrc/, built at run time; CPU
default), torch_attention (PyTorch path: the fallback where no C compiler is
found, and the cache writes of both), triton_attention (Triton kernels; on CPU
only in Triton's interpreter, TRITON_INTERPRET=1 set before triton is
imported), reference (float64 references for tests), triton_batch_invariant
(fixed-tile linear and RMSNorm), triton_jit (the shared Triton wrapper). Their
benchmarks and the sm_90 compile check live in ``loadtests/bench/``.
triton is imported only when the "triton" backend is asked for.

Importing it sets nothing: OpenMP's wait policy is chosen by whoever starts the
process that runs the kernels, before torch is imported (an engine core:
``engine.worker.device.choose_omp_wait_policy``; the CPU kernel benchmark sets
``OMP_WAIT_POLICY=PASSIVE`` when run as a program).
"""

import functools
import logging
import os
from dataclasses import dataclass
from typing import Callable

import torch

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "cpu", "torch", "triton")


@dataclass(frozen=True)
class AttentionBackend:
    """The attention kernels of one implementation.

    reshape_and_cache(key, value, key_cache, value_cache, slot_mapping) -> None
    paged_attention(query, key_cache, value_cache, query_start_loc, seq_lens,
                    block_tables, scale, out=None[, plan=...]) -> Tensor
    plan(key_cache, num_heads, query_start_loc, seq_lens, block_tables) -> the
        backend's per-step index work, built once per step by the model and
        passed as ``plan=`` to every layer's paged_attention; None when the
        backend has none (Triton).
    Shapes and semantics: kernels/torch_attention.py.
    """

    name: str
    reshape_and_cache: Callable[..., None]
    paged_attention: Callable[..., torch.Tensor]
    plan: Callable[..., object] | None = None


def get_attention_backend(name: str, device: torch.device | str, batch_invariant: bool = False,
                          dtype: torch.dtype | None = None,
                          heads: tuple[int, int, int] | None = None) -> AttentionBackend:
    """Pick the attention kernels for ``device``.

    Args:
        name: "auto" (Triton on CUDA; elsewhere "cpu" when it can be built
            and takes ``dtype`` and ``heads``, else "torch"), "cpu", "torch"
            or "triton".
        device: where the caches and activations live.
        batch_invariant: each query's output must not depend on the batch.
            The CPU and PyTorch paths always are; the Triton path then never
            splits the keys (split-KV is chosen from the batch's shape).
        dtype: the model's dtype, if known (the C kernel takes bfloat16 and float32).
        heads: (num_heads, num_kv_heads, head_dim) of the model, if known.

    Raises:
        ValueError: unknown name, or "cpu" for a device, dtype or shape it does not take.
        RuntimeError: "cpu" where the C kernel cannot be built (no compiler);
            "triton" on a non-CUDA device without TRITON_INTERPRET=1
            (Triton's interpreter), or Triton not installed.
    """
    device = torch.device(device)
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; expected one of {', '.join(BACKENDS)}")
    if name in ("auto", "cpu") and device.type == "cpu":
        from kernels import cpu_attention

        takes = (dtype is None or heads is None) or cpu_attention.supports(dtype, *heads)
        why_not = cpu_attention.available() if takes else f"it does not take {dtype} with (heads, KV heads, " \
            f"head_dim) {heads}"
        if why_not is None:
            from kernels import torch_attention

            return AttentionBackend("cpu", torch_attention.reshape_and_cache, cpu_attention.paged_attention,
                                    cpu_attention.plan_attention)
        if name == "cpu":
            raise (ValueError if not takes else RuntimeError)(f"the 'cpu' attention backend: {why_not}")
        logger.warning("attention on the PyTorch path (slower): the C kernel is not available: %s%s", why_not,
                       "" if not takes else " (the linear layers, RMSNorm and SwiGLU then run on oneDNN/PyTorch too)")
        name = "torch"
    if name == "cpu":
        raise ValueError(f"the 'cpu' attention backend runs on the CPU, not {device}")
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        from kernels import torch_attention

        return AttentionBackend("torch", torch_attention.reshape_and_cache, torch_attention.paged_attention,
                                torch_attention.plan_attention)
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0").lower() not in ("1", "true", "on", "yes"):
        raise RuntimeError(
            f"the 'triton' attention backend needs a CUDA device (got {device}); "
            "set TRITON_INTERPRET=1 to run it in Triton's interpreter, or use 'torch'"
        )
    try:
        from kernels import triton_attention, triton_jit
    except ImportError as e:  # pragma: no cover - triton is a dependency on linux x86_64
        raise RuntimeError(f"the 'triton' attention backend needs the triton package: {e}") from e
    if device.type != "cuda" and not triton_jit.interpreter_active():
        raise RuntimeError(
            "the 'triton' attention backend on CPU needs Triton's interpreter, but triton was imported "
            "before TRITON_INTERPRET=1 was set; set it before anything imports triton"
        )
    attention = triton_attention.paged_attention
    if batch_invariant:
        attention = functools.partial(attention, num_splits=1)
    return AttentionBackend("triton", triton_attention.reshape_and_cache, attention)
