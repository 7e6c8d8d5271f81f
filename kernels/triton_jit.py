"""Wrapping this package's Triton kernels for the compiler or the interpreter.

Triton's interpreter (TRITON_INTERPRET=1) runs kernels on CPU tensors, but
only when the variable is set before ``triton`` is first imported: triton
wraps its own standard library (tl.max, tl.sum, ...) for the compiler or the
interpreter at import. The kernels in ``kernels/`` are therefore plain
functions, wrapped on first launch in the mode triton's standard library is
in; a launch on CPU tensors without the interpreter raises a RuntimeError
that says what to do.

The interpreter runs ``tl.dot`` as ``np.matmul``, i.e. numpy's BLAS, whose
kernel is chosen for the CPU: OpenBLAS's Haswell (AVX2) SGEMM kernel rounds a
row differently by its position in the tile (rows 6-11 of every 12 differ from
rows 0-5 in the last bit), so a row computed alone (tile row 0) and in a batch
(tile row 6) differ there, and not on AVX-512 machines. A compiled kernel runs
the same instructions for every row. :func:`k_order_interpreter_dot` is a
``tl.dot`` for the interpreter whose bits do not depend on the row's position,
the CPU or the BLAS; the tests install it (``tests/conftest.py``).
"""

from __future__ import annotations

import functools
import os

import numpy as np
import torch
import triton.language as tl


def interpreter_active() -> bool:
    """True when triton was imported in interpreter mode (TRITON_INTERPRET=1 set before import)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.standard.max, InterpretedFunction)


@functools.cache
def jit(fn, interpret: bool):
    """``fn`` wrapped for the compiler (``interpret`` False) or the interpreter.

    Sizes named ``num_seqs``, ``num_tokens``, ``num_rows`` or ``num_heads``
    are not specialised on their value (1, multiples of 16): one
    compiled kernel serves every batch size, and a binary search's
    loop-carried variables stay int32 tensors.
    """
    no_spec = [a for a in ("num_seqs", "num_tokens", "num_rows", "num_heads") if a in fn.__code__.co_varnames]
    if interpret:
        from triton.runtime.interpreter import InterpretedFunction

        return InterpretedFunction(fn, do_not_specialize=no_spec)
    from triton.runtime.jit import JITFunction

    return JITFunction(fn, do_not_specialize=no_spec)


def launchable(fn, device: torch.device):
    """``fn`` ready to launch on tensors of ``device``.

    Raises:
        RuntimeError: ``device`` is not CUDA and the interpreter is not active.
    """
    interpret = interpreter_active()
    if device.type != "cuda" and not interpret:
        hint = (
            "TRITON_INTERPRET=1 is set but triton was imported before it was"
            if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
            else "set TRITON_INTERPRET=1 before triton is imported"
        )
        raise RuntimeError(
            f"Triton kernels need a CUDA device; tensors are on {device}. To run them in Triton's "
            f"interpreter, {hint}; or use the 'torch' backend."
        )
    return jit(fn, interpret)


def k_order_interpreter_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    """``InterpreterBuilder.create_dot`` for float accumulators without BLAS:
    ``d + a @ b`` summed over K in order, one correctly rounded multiply and
    one add per step (numpy ufuncs), so every output element's bits depend on
    its own row and column only, on any CPU.

    Args (triton 3.x interpreter ``TensorHandle``s):
        a: [..., M, K], b: [..., K, N], d: [..., M, N] accumulator (its dtype
            is the result's). Integer or fp8 operands keep triton's own dot.
        input_precision, max_num_imprecise_acc: ignored, as triton's own
            interpreter ignores them.

    Returns:
        TensorHandle [..., M, N] of d's dtype.
    """
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    acc = d.data
    fp8 = any(t.dtype.primitive_bitwidth == 8 and t.dtype.is_floating() for t in (a, b))
    if fp8 or not np.issubdtype(acc.dtype, np.floating):
        return InterpreterBuilder.create_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
    a_data = a.data.astype(acc.dtype, copy=False)
    b_data = b.data.astype(acc.dtype, copy=False)
    acc = acc.copy()
    for k in range(a_data.shape[-1]):
        acc += a_data[..., :, k:k + 1] * b_data[..., k:k + 1, :]
    return TensorHandle(acc, d.dtype.scalar)
