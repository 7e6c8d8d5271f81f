"""``system_fingerprint``: which model, engine build and numerics produced an answer.

OpenAI sends ``system_fingerprint`` so that a client relying on ``seed`` can
tell when the backend changed; here outputs are bitwise reproducible (docs/app-teams/
reproducibility.md), so the fingerprint says exactly when the same request
may answer differently: it changes with

- the model: its file (or directory's files) by path, size and a hash of its
  first MiB and of ``config.json``;
- the engine build: the package version and a hash of the engine's and the
  kernels' sources (``engine/``, ``kernels/``: ``.py``, ``.c``, ``.h``);
- the numerics: device type, dtype, quantization, attention backend, batch
  invariance, torch's version, and on CPU the kernels' body (AVX512-BF16,
  AVX2 or portable: ``kernels.cpu_linear.isa``: the bfloat16 linear layers
  and attention give other bits on each) and the quantized copies'
  arithmetic (integer dots on every x86 build, the same bits on AVX2 and
  AVX-512; the dequantized bfloat16 values on the portable one:
  ``kernels.cpu_linear.integer_copies``).

Computed once by the engine core at start-up (``EngineCore.system_fingerprint``).
"""

from __future__ import annotations

import hashlib
import os
from importlib import metadata
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
_SOURCE_DIRS = ("engine", "kernels")
_SOURCE_SUFFIXES = (".py", ".c", ".h", ".cu")
_HEAD_BYTES = 1 << 20


def system_fingerprint(model_path: str, numerics: dict[str, object]) -> str:
    """``fp_`` and 16 hex digits of sha256 over the model, the build and ``numerics``.

    Args:
        model_path: the model file or Hugging Face directory.
        numerics: what decides the arithmetic (device type, dtype, ...), as
            plain values.
    """
    h = hashlib.sha256()
    h.update(_model_identity(model_path))
    h.update(build_identity())
    h.update(repr(sorted((k, str(v)) for k, v in numerics.items())).encode())
    return "fp_" + h.hexdigest()[:16]


def build_identity() -> bytes:
    """The package version and a hash of the engine's and kernels' sources."""
    h = hashlib.sha256()
    try:
        h.update(metadata.version("tandem").encode())
    except metadata.PackageNotFoundError:
        h.update(b"unversioned")
    for top in _SOURCE_DIRS:
        for path in sorted((_ROOT / top).rglob("*")):
            if path.suffix in _SOURCE_SUFFIXES and path.is_file():
                h.update(str(path.relative_to(_ROOT)).encode())
                h.update(path.read_bytes())
    return h.digest()


def _model_identity(model_path: str) -> bytes:
    h = hashlib.sha256()
    files = [model_path] if os.path.isfile(model_path) else sorted(
        os.path.join(model_path, f) for f in os.listdir(model_path)
        if f.endswith((".gguf", ".safetensors", ".json", ".bin")))
    for path in files:
        h.update(os.path.basename(path).encode())
        h.update(str(os.path.getsize(path)).encode())
        with open(path, "rb") as f:
            h.update(f.read(_HEAD_BYTES))
    return h.digest()


def numerics_of(args, device, dtype) -> dict[str, object]:
    """What decides an engine's arithmetic, for :func:`system_fingerprint`.

    Args:
        args: the ``EngineArgs`` (quantization, attention backend, batch
            invariance, load format).
        device, dtype: the resolved ``torch.device`` and ``torch.dtype``.
    """
    import torch  # loaded already by whoever resolved the device

    from kernels import cpu_linear
    # a HF checkpoint's method named (gptq, awq, compressed-tensors) is the checkpoint's own, which "none" follows
    # anyway (a mismatch is refused at load): the same numerics, the same fingerprint (a trial's differed); gguf
    # (4-bit kept) is other arithmetic than none (dequantized)
    quantization = args.quantization if args.quantization in ("none", "gguf") else "none"
    return {"device": device.type, "dtype": dtype, "quantization": quantization,
            "attention_backend": args.attention_backend, "batch_invariant": args.batch_invariant,
            "load_format": args.load_format, "torch": torch.__version__,
            # the row-parallel sums are cut by the rank count: other N, other bits
            **({"tensor_parallel_size": args.tensor_parallel_size} if args.tensor_parallel_size > 1 else {}),
            # the CPU kernels' body: its bfloat16 linear layers and attention give their own bits
            "cpu_isa": cpu_linear.isa() if device.type == "cpu" else None,
            # the quantized copies' arithmetic: integer dots (one rule, the same bits on AVX2 and AVX-512) or
            # the dequantized weights' bfloat16 bits (portable)
            "cpu_quant": ("integer-dots" if cpu_linear.integer_copies() else "dequantized")
            if device.type == "cpu" else None,
            # the model's generation config: what a request that leaves a sampling field unset is sampled with
            **({"sampling_defaults": defaults} if (defaults := args.sampling_defaults) else {})}
