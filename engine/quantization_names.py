"""The ``--quantization`` values (vLLM's names) and why one is refused: kept out of ``engine/quantization/`` so that
reading the settings (``engine/config.py``, the gateway's config check) imports no torch;
``tests/engine/test_quantization.py`` pins ``QUANTIZATION_CHOICES`` to ``engine.quantization.QUANTIZATION_METHODS``."""

from __future__ import annotations

# "none", "gguf" and engine.quantization.QUANTIZATION_METHODS
QUANTIZATION_CHOICES = ("none", "gguf", "gptq", "awq", "compressed-tensors")
# vLLM's values that pick a kernel for checkpoints this engine reads as another method: taken as that method
QUANTIZATION_ALIASES = {"gptq_marlin": "gptq", "awq_marlin": "awq"}
# quant_method values vLLM reads that this engine does not (yet): refused by name, never loaded as dense
KNOWN_UNSUPPORTED_QUANTIZATION = ("fp8", "bitsandbytes", "gptq_marlin", "awq_marlin", "marlin", "hqq", "aqlm",
                                  "exl2", "quark", "modelopt", "torchao")


def quantization_problem(value: str) -> str:
    """Why ``--quantization value`` is refused (after ``QUANTIZATION_ALIASES``), in one line."""
    if value in KNOWN_UNSUPPORTED_QUANTIZATION:
        return (f"{value!r} is vLLM's and not implemented here (supported: {', '.join(QUANTIZATION_CHOICES)}; "
                "FP8 checkpoints of the compressed-tensors format load as compressed-tensors or with none)")
    return f"must be one of {', '.join(QUANTIZATION_CHOICES)}, got {value!r}"
