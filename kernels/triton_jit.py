"""Wrapping this package's Triton kernels for the compiler or the interpreter.

Triton's interpreter (TRITON_INTERPRET=1) runs kernels on CPU tensors, but
only when the variable is set before ``triton`` is first imported: triton
wraps its own standard library (tl.max, tl.sum, ...) for the compiler or the
interpreter at import. The kernels in ``kernels/`` are therefore plain
functions, wrapped on first launch in the mode triton's standard library is
in; a launch on CPU tensors without the interpreter raises a RuntimeError
that says what to do.
"""

from __future__ import annotations

import functools
import os

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
