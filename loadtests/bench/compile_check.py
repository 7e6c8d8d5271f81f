"""Compile the Triton kernels for a CUDA target without a GPU.

    python -m loadtests.bench.compile_check [--arch 90] [--jobs N]

Runs Triton's full compiler pipeline (TTIR, TTGIR, LLVM IR, PTX and, with the
ptxas bundled in the triton wheel, a cubin) for the configurations the engine
and loadtests/bench/kernels_gpu.py launch, so that errors the interpreter cannot see (types
of loop-carried variables, layouts, unsupported ops) show up on a CPU-only
machine. Must run with TRITON_INTERPRET unset (before triton is imported).
"""

from __future__ import annotations

import argparse
import inspect
import multiprocessing
import os
import sys
from concurrent.futures import ProcessPoolExecutor

from kernels import triton_attention, triton_batch_invariant, triton_jit


def _signature(fn, pointer_types: dict[str, str]) -> dict[str, str]:
    """Triton signature: pointers as given, UPPERCASE arguments constexpr, other scalars i32/fp32."""
    sig = {}
    for name in inspect.signature(fn).parameters:
        if name.isupper():
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = pointer_types[name]
        elif name in ("scale_log2", "eps"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def _linear_pointers(dtype: str, weight: str, scales: str | None = None) -> dict[str, str]:
    """The pointer types of ``triton_batch_invariant._linear_kernel``: activations, bias, residual and output in
    ``dtype``; the weight (dense or packed codes) as ``weight``; scales and offsets float32 when packed (a dense
    call passes x in their place)."""
    return dict(x_ptr=f"*{dtype}", q_ptr=weight, s_ptr=scales or f"*{dtype}", m_ptr=scales or f"*{dtype}",
                bias_ptr=f"*{dtype}", res_ptr=f"*{dtype}", out_ptr=f"*{dtype}")


def configurations():
    """(kernel function, pointer types, constexprs) for each variant to compile."""
    out = []
    for dtype in ("bf16", "fp32"):  # fp16 takes the bf16 path
        for heads, kv_heads, head_dim in ((32, 8, 128), (9, 3, 64)):
            for splits in (1, 4):
                group = heads // kv_heads
                group_pad = 1 << (group - 1).bit_length()
                block_m = max(16, group_pad)
                ptrs = dict(
                    q_ptr=f"*{dtype}",
                    k_cache_ptr=f"*{dtype}",
                    v_cache_ptr=f"*{dtype}",
                    out_ptr=f"*{dtype}" if splits == 1 else "*fp32",
                    lse_ptr="*fp32",
                    block_tables_ptr="*i32",
                    seq_lens_ptr="*i32",
                    query_start_loc_ptr="*i32",
                )
                consts = dict(
                    NUM_QUERIES_PER_KV=group,
                    GROUP_PAD=group_pad,
                    BLOCK_Q=block_m // group_pad,
                    BLOCK_M=block_m,
                    HEAD_DIM=head_dim,
                    BLOCK_SIZE=16,
                    TILE_N=triton_attention.DEFAULT_TILE_N,
                    NUM_SPLITS=splits,
                    DOT_PRECISION="ieee" if dtype == "fp32" else "tf32",
                )
                out.append((triton_attention._unified_attention_kernel, ptrs, consts))
        out.append((
            triton_attention._merge_splits_kernel,
            dict(partial_ptr="*fp32", lse_ptr="*fp32", out_ptr=f"*{dtype}"),
            dict(NUM_SPLITS=4, HEAD_DIM=128, BLOCK_R=16),
        ))
        out.append((
            triton_attention._reshape_and_cache_kernel,
            dict(key_ptr=f"*{dtype}", value_ptr=f"*{dtype}", key_cache_ptr=f"*{dtype}", value_cache_ptr=f"*{dtype}",
                 slot_mapping_ptr="*i64"),
            dict(NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_T=8, BLOCK_HD=1024),
        ))
    bi = triton_batch_invariant
    for dtype in ("bf16", "fp16", "fp32"):
        for has_bias, has_res in ((False, False), (True, True)):
            out.append((bi._linear_kernel, _linear_pointers(dtype, f"*{dtype}"),
                        dict(KIND=bi.DENSE, HAS_BIAS=has_bias, HAS_RES=has_res, BLOCK_M=bi.BLOCK_M, BLOCK_N=bi.BLOCK_N,
                             BLOCK_K=bi.BLOCK_K, DOT_PRECISION="ieee" if dtype == "fp32" else "tf32")))
        out.append((bi._rms_norm_kernel, dict(x_ptr=f"*{dtype}", w_ptr=f"*{dtype}", out_ptr=f"*{dtype}"),
                    dict(BLOCK_N=1024)))
    for kind, codes in ((bi.INT4, "*u8"), (bi.INT8, "*i8"), (bi.FP8, "*u8")):  # packed weights, bf16 activations
        out.append((bi._linear_kernel, _linear_pointers("bf16", codes, scales="*fp32"),
                    dict(KIND=kind, HAS_BIAS=True, HAS_RES=True, BLOCK_M=bi.BLOCK_M, BLOCK_N=bi.BLOCK_N,
                         BLOCK_K=bi.BLOCK_K, DOT_PRECISION="tf32")))
    return out


def compile_one(index: int, arch: int) -> str:
    """Compile ``configurations()[index]`` for ``sm_<arch>``; its report line (the stages produced)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn, ptrs, consts = configurations()[index]
    src = ASTSource(fn=triton_jit.jit(fn, False), signature=_signature(fn, ptrs), constexprs=consts)
    kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32))
    return f"{fn.__name__} {next(iter(ptrs.values()))} {consts}: {', '.join(kernel.asm)}"


def main(argv: list[str] | None = None) -> int:
    """Compile every configuration; print one line each, in order; a failure raises (exit 1)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 80, 90")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                   help="compile in this many processes (default: one per CPU; each compile is single-threaded)")
    args = p.parse_args(argv)
    if triton_jit.interpreter_active():
        print("TRITON_INTERPRET must be unset to compile", file=sys.stderr)
        return 2
    n = len(configurations())
    if args.jobs <= 1:
        for i in range(n):
            print(compile_one(i, args.arch), flush=True)
        return 0
    # spawn: a fork would copy this process's Triton state and threads into the workers.
    with ProcessPoolExecutor(min(args.jobs, n), mp_context=multiprocessing.get_context("spawn")) as pool:
        for line in pool.map(compile_one, range(n), [args.arch] * n):
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
