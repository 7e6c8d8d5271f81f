"""The CPU attention backend: ``csrc/paged_attention_cpu.c``, built at run time
with the machine's C compiler (:mod:`kernels.cpu_build`) and called through
ctypes.

It reads each sequence's keys and values in place through its block table
(no gather into a scratch buffer, no block-diagonal matmul) and gives every
query row the same arithmetic whatever else shares the step, so it is
batch-invariant by construction (the C file says how). Shapes and semantics
are those of :func:`kernels.torch_attention.paged_attention`; the cache
writes are :func:`kernels.torch_attention.reshape_and_cache`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.cpu_build import load_library, why_unavailable

_DTYPES = {torch.bfloat16: "paged_attention_bf16", torch.float32: "paged_attention_f32"}


def available() -> str | None:
    """None when the kernel can be built and loaded here, else why not (one line)."""
    return why_unavailable()


def supports(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether the kernel takes these shapes: bfloat16 or float32, head_dim a
    multiple of 16, num_heads a multiple of num_kv_heads."""
    return dtype in _DTYPES and head_dim % 16 == 0 and num_kv_heads > 0 and num_heads % num_kv_heads == 0


@dataclass
class CpuAttentionPlan:
    """One step's metadata as the kernel reads it, shared by every layer.

    Attributes:
        block_tables: [num_seqs, max_blocks] int32, contiguous.
        seq_lens: [num_seqs] int32; query_start_loc: [num_seqs + 1] int32.
    """

    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor


def _int32(x: list[int] | torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(x).to("cpu", torch.int32).contiguous()


def plan_attention(key_cache: torch.Tensor, num_heads: int, query_start_loc: list[int] | torch.Tensor,
                   seq_lens: list[int] | torch.Tensor, block_tables: torch.Tensor) -> CpuAttentionPlan:
    """The int32, contiguous copies of one step's metadata (arguments as
    :func:`kernels.torch_attention.plan_attention`)."""
    return CpuAttentionPlan(_int32(block_tables).reshape(len(block_tables), -1), _int32(seq_lens),
                            _int32(query_start_loc))


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_start_loc: list[int] | torch.Tensor,
    seq_lens: list[int] | torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    plan: CpuAttentionPlan | None = None,
    march: str | None = None,
) -> torch.Tensor:
    """Causal paged attention on the CPU (arguments, shapes and semantics as
    :func:`kernels.torch_attention.paged_attention`; ``march`` picks the
    build, :func:`kernels.cpu_build.load_library`).

    Returns:
        [num_query_tokens, num_heads, head_dim], query's dtype.

    Raises:
        ValueError: tensors not on the CPU, dtypes differ, or shapes the
            kernel does not take (:func:`supports`).
        kernels.cpu_build.KernelBuildError: the library could not be built.
    """
    num_heads, head_dim = query.shape[1], query.shape[2]
    _, block_size, num_kv_heads, _ = key_cache.shape
    if query.device.type != "cpu" or key_cache.device.type != "cpu":
        raise ValueError("the cpu attention backend takes CPU tensors")
    if not (query.dtype == key_cache.dtype == value_cache.dtype) or not supports(
            query.dtype, num_heads, num_kv_heads, head_dim):
        raise ValueError(f"the cpu attention kernel does not take {query.dtype} query / {key_cache.dtype} cache "
                         f"with {num_heads} heads, {num_kv_heads} KV heads, head_dim {head_dim}")
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("the cpu attention kernel reads contiguous key and value caches")
    if plan is None:
        plan = plan_attention(key_cache, num_heads, query_start_loc, seq_lens, block_tables)
    if query.stride(2) != 1 or query.stride(1) != head_dim:  # rows may be apart (a slice of q/k/v), heads not
        query = query.contiguous()
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype)
    elif not out.is_contiguous() or out.shape != query.shape or out.dtype != query.dtype:
        raise ValueError("out must be a contiguous tensor of the query's shape and dtype")
    fn = getattr(load_library(march), _DTYPES[query.dtype])
    bt = plan.block_tables
    rc = fn(query.data_ptr(), query.stride(0), key_cache.data_ptr(), value_cache.data_ptr(), out.data_ptr(), bt.data_ptr(),
            bt.shape[1], plan.seq_lens.data_ptr(), plan.query_start_loc.data_ptr(), plan.seq_lens.numel(),
            num_heads, num_kv_heads, head_dim, block_size, scale, torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"paged_attention_cpu returned {rc}")
    return out
