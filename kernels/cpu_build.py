"""Builds and loads the C kernels of ``kernels/csrc/`` (CPU attention,
bfloat16 and 4-bit GGUF linear layers, RMSNorm and SwiGLU, RoPE with the cache write, and
the whole decoder stack composed of them) as one shared library, called
through ctypes.

The library is compiled once per source, compiler, flags and CPU
(``gcc -O3 -march=native -fopenmp``, about two seconds) into
``$TANDEM_KERNEL_CACHE`` (default ``~/.cache/tandem/kernels``) and loaded from
there afterwards. It links the OpenMP runtime that torch already loaded (the
same ``libgomp.so.1``), so it shares torch's thread pool and wait policy.

``-march=native`` chooses each kernel's body from the CPU's flags when the
library is built (AVX512-BF16, else AVX2/FMA/F16C, else portable C; the C
files' ``#if`` say which). ``$TANDEM_CPU_MARCH`` replaces ``native`` for the
whole process (``x86-64-v3``: the AVX2 bodies on an AVX-512 machine, to test
or measure them); the functions that take a ``march`` use it when given none.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from kernels import c_header

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = [CSRC / "paged_attention_cpu.c", CSRC / "linear_cpu.c", CSRC / "linear_q4_cpu.c",
           CSRC / "linear_f32_cpu.c", CSRC / "linear_w8a8_cpu.c", CSRC / "norm_act_cpu.c",
           CSRC / "decoder_cpu.c", CSRC / "decode_steps_cpu.c"]
HEADERS = [CSRC / "common.h", CSRC / "kernels.h", CSRC / "bf16_panel.h", CSRC / "f32_panel.h", CSRC / "quant_f32.h",
           CSRC / "quant_int.h", CSRC / "quant_int512.h", CSRC / "quant_amx.h", CSRC / "attention_decode.h"]
CFLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC"]
LIBS = ["-lm"]  # after the sources: the portable bodies' fmaf where the CPU has no FMA
MARCH_ENV = "TANDEM_CPU_MARCH"

HEADER = CSRC / "kernels.h"
# Every exported function and struct, declared once in kernels.h (each .c file includes it, so the compiler
# checks each definition against it): function -> (ctypes argument types, return type); struct name ->
# its ctypes.Structure.
SIGNATURES = c_header.prototypes(HEADER.read_text())
STRUCTS = c_header.structs(HEADER.read_text())


class KernelBuildError(RuntimeError):
    """The C compiler is missing or failed; the message has its output."""


def _cpu_signature() -> str:
    """What ``-march=native`` depends on: the CPU model and its feature flags."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))][:2]
        return "".join(lines)
    except OSError:
        return platform.processor() or platform.machine()


def _cache_dir() -> Path:
    return Path(os.environ.get("TANDEM_KERNEL_CACHE", Path.home() / ".cache" / "tandem" / "kernels"))


def default_march() -> str:
    """gcc's ``-march`` for this process: ``$TANDEM_CPU_MARCH``, else "native"."""
    return os.environ.get(MARCH_ENV) or "native"


def load_library(march: str | None = None) -> ctypes.CDLL:
    """Build (once per source, compiler and CPU) and load the kernel library.

    Args:
        march: gcc's ``-march``: None (:func:`default_march`), "native"
            (each kernel's fastest body for this CPU), or an older target
            such as "x86-64-v3" (AVX2/FMA bodies) or "x86-64" (portable C).

    Returns:
        The loaded ``ctypes.CDLL`` with the functions of ``SIGNATURES`` (kernels.h) typed.

    Raises:
        KernelBuildError: no C compiler (``$CC``, else ``cc``/``gcc``) or the build failed.
    """
    return _load_library(march or default_march())


@functools.lru_cache(maxsize=8)
def _load_library(march: str, csrc: Path = CSRC) -> ctypes.CDLL:
    """:func:`load_library` from the sources under ``csrc`` (tests build an edited copy)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise KernelBuildError("no C compiler found (set CC, or install gcc)")
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelBuildError(f"{cc} --version failed: {e}") from e
    flags = [*CFLAGS, f"-march={march}"]
    sources = [csrc / src.name for src in SOURCES]
    key = hashlib.sha256(b"".join(src.read_bytes() for src in sources + [csrc / h.name for h in HEADERS]))
    key.update((" ".join(flags + LIBS) + version + _cpu_signature()).encode())
    path = _cache_dir() / f"tandem_kernels-{key.hexdigest()[:16]}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
        os.close(fd)
        try:
            proc = subprocess.run([cc, *flags, "-o", tmp, *map(str, sources), *LIBS], capture_output=True,
                                  text=True, timeout=300)
            if proc.returncode != 0:
                raise KernelBuildError(f"{cc} failed on {', '.join(s.name for s in sources)}:\n"
                                       f"{proc.stderr.strip()}")
            os.replace(tmp, path)  # atomic: concurrent builders each write their own file
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        logger.info("built %s", path)
    lib = ctypes.CDLL(str(path))
    signatures = SIGNATURES if csrc == CSRC else c_header.prototypes((csrc / HEADER.name).read_text())
    for name, (argtypes, restype) in signatures.items():
        fn = getattr(lib, name)  # AttributeError: declared in kernels.h but not defined
        fn.argtypes, fn.restype = argtypes, restype
    return lib


def rows_2d(t: "torch.Tensor") -> "torch.Tensor":
    """``t`` [..., n] as a 2-D tensor whose rows are contiguous, a view when
    it can be (the kernels take a row stride, not a contiguous tensor)."""
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def why_unavailable(march: str | None = None) -> str | None:
    """None when the library builds and loads here, else why not (one line)."""
    try:
        load_library(march)
    except (KernelBuildError, OSError) as e:
        return str(e).splitlines()[0]
    return None
