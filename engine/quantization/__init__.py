"""Quantized Hugging Face checkpoints: one ``QuantizationConfig`` per format
(vLLM's ``model_executor/layers/quantization``), detected from config.json's
``quantization_config.quant_method`` as vLLM does; ``--quantization`` may
name the same method, and a method or option the engine does not implement is
refused at load, naming the field. See docs/quantization.md."""

from __future__ import annotations

import json
from pathlib import Path

from engine.quantization_names import KNOWN_UNSUPPORTED_QUANTIZATION
from engine.quantization.awq import AWQConfig
from engine.quantization.base import QuantizationConfig, UnsupportedQuantization
from engine.quantization.compressed_tensors import CompressedTensorsConfig
from engine.quantization.gptq import GPTQConfig

QUANTIZATION_METHODS: dict[str, type[QuantizationConfig]] = {
    "gptq": GPTQConfig, "awq": AWQConfig, "compressed-tensors": CompressedTensorsConfig}
# older GPTQ/AWQ repositories keep the settings in a file of their own (vLLM's get_quant_config looks there too)
_SIDE_FILES = ("quantize_config.json", "quant_config.json")


def _checkpoint_quantization(path: Path, hf_config: dict) -> dict | None:
    """The checkpoint's ``quantization_config`` (config.json, else a side file), or None."""
    qc = hf_config.get("quantization_config")
    if qc is not None:
        return qc
    for name in _SIDE_FILES:
        f = path / name
        if f.is_file():
            qc = json.loads(f.read_text())
            if "quant_method" not in qc:  # auto-gptq's quantize_config.json names no method
                qc = {**qc, "quant_method": "awq" if "w_bit" in qc or "zero_point" in qc else "gptq"}
            return qc
    return None


def get_quantization_config(path: str, requested: str = "none") -> QuantizationConfig | None:
    """The quantization of the HF checkpoint at ``path``, or None for full-precision weights.

    Args:
        path: the model directory (config.json, maybe a side file).
        requested: ``--quantization``: "none" (follow the checkpoint) or a
            method, which must then be the checkpoint's.

    Raises:
        UnsupportedQuantization: a method or option the engine does not implement, a requested
            method the checkpoint does not have.
        ValueError: an unreadable config.
    """
    root = Path(path)
    try:
        hf_config = json.loads((root / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{root / 'config.json'}: {e}") from None
    qc = _checkpoint_quantization(root, hf_config)
    if qc is None:
        if requested in QUANTIZATION_METHODS:
            raise UnsupportedQuantization(f"quantization {requested!r} was requested but {path} has no "
                                          "quantization_config (full-precision weights)")
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method not in QUANTIZATION_METHODS:
        known = " (known to vLLM, not implemented here)" if method in KNOWN_UNSUPPORTED_QUANTIZATION else ""
        raise UnsupportedQuantization(f"quantization_config.quant_method = {method!r} is not supported{known} "
                                      f"(supported: {', '.join(QUANTIZATION_METHODS)})")
    if requested not in ("none", method):
        raise UnsupportedQuantization(f"quantization {requested!r} was requested but the checkpoint's "
                                      f"quantization_config.quant_method is {method!r}")
    return QUANTIZATION_METHODS[method].from_config(qc)


__all__ = ["QUANTIZATION_METHODS", "QuantizationConfig", "UnsupportedQuantization", "get_quantization_config"]
