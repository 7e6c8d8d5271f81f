"""compressed-tensors checkpoints as llm-compressor writes them
(``quant_method: compressed-tensors``; vLLM's
``quantization/compressed_tensors/``): the ``pack-quantized`` format with
4-bit integer weights and no activation quantization (W4A16, from the GPTQ
or AWQ recipes).

Per quantized linear layer ``<prefix>`` (the ``compressed_tensors`` package's
``PackedQuantizationCompressor``):

* ``weight_packed`` int32 [out, in / 8]: signed codes q in -8..7 stored as
  q + 8, eight along the inputs, input 8j + i in bits 4i..4i+3 of word j;
* ``weight_scale`` [out, groups] (strategy "group"), [out, 1] ("channel");
* ``weight_zero_point`` (asymmetric only) int32 [out / 8, groups]: signed
  zero points + 8, packed the same way along the outputs;
* ``weight_shape`` [2]; ``weight_g_idx`` [in] with ``actorder``.

w[n, k] = (q - zp) * s. Layers without ``weight_packed`` (``ignore``) load
as full-precision weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.quantization.base import QuantizationConfig, UnsupportedQuantization, require
from engine.quantization.int4 import Int4Weight, grouped_int4, unpack_int32


def _check_group(name: str, group: dict) -> tuple[str, int | None]:
    """(strategy, group size) of one ``config_groups`` entry the engine implements.

    Raises:
        UnsupportedQuantization: anything else, naming the field.
    """
    where = f"quantization_config.config_groups.{name}"
    for key in ("input_activations", "output_activations"):
        if group.get(key):
            raise UnsupportedQuantization(f"{where}.{key} is not supported (weight-only W4A16 is)")
    if group.get("targets") != ["Linear"]:
        raise UnsupportedQuantization(f"{where}.targets = {group.get('targets')!r} is not supported "
                                      "(supported: ['Linear'])")
    w = group.get("weights") or {}
    for key, allowed, default in (("num_bits", (4,), None), ("type", ("int",), None),
                                  ("strategy", ("group", "channel"), None), ("dynamic", (False,), False),
                                  ("actorder", (None, "group", "weight", "static"), None)):
        try:
            require(w, key, allowed, default)
        except UnsupportedQuantization as e:
            raise UnsupportedQuantization(str(e).replace("quantization_config.", f"{where}.weights.")) from None
    return w["strategy"], w.get("group_size")


@dataclass
class CompressedTensorsConfig(QuantizationConfig):
    """compressed-tensors settings.

    Attributes:
        symmetric: no zero points are stored (zp = 0).
    """

    symmetric: bool

    name = "compressed-tensors"
    parts = frozenset({"weight_packed", "weight_scale", "weight_shape"})
    optional_parts = frozenset({"weight_zero_point", "weight_g_idx"})

    @classmethod
    def from_config(cls, config: dict) -> CompressedTensorsConfig:
        """See ``QuantizationConfig.from_config``: ``pack-quantized`` W4A16 groups targeting every
        Linear, compressed, without sparsity, transforms or a quantized KV cache."""
        fmt = require(config, "format", ("pack-quantized",))
        require(config, "quantization_status", ("compressed",), "compressed")
        for key in ("kv_cache_scheme", "sparsity_config", "transform_config"):
            if config.get(key):
                raise UnsupportedQuantization(f"quantization_config.{key} is not supported")
        groups = config.get("config_groups") or {}
        if len(groups) != 1:
            raise UnsupportedQuantization(f"quantization_config.config_groups has {len(groups)} groups "
                                          "(supported: one)")
        (name, group), = groups.items()
        if group.get("format", fmt) != "pack-quantized":
            raise UnsupportedQuantization(f"quantization_config.config_groups.{name}.format = "
                                          f"{group.get('format')!r} is not supported (supported: 'pack-quantized')")
        _check_group(name, group)
        return cls(bool(group["weights"].get("symmetric", True)))

    def weight(self, prefix: str, parts: dict[str, torch.Tensor]) -> Int4Weight | torch.Tensor:
        """See ``QuantizationConfig.weight``."""
        packed, scale = parts["weight_packed"], parts["weight_scale"]
        out, k = (int(x) for x in parts["weight_shape"].tolist())
        if packed.dim() != 2 or tuple(packed.shape) != (out, k // 8) or k % 8 or scale.dim() != 2 \
                or scale.shape[0] != out:
            raise ValueError(f"compressed-tensors layer {prefix!r}: weight_packed {tuple(packed.shape)} and "
                             f"weight_scale {tuple(scale.shape)} do not fit weight_shape {(out, k)}")
        codes = unpack_int32(packed, dim=1)  # q + 8, [out, in]
        if self.symmetric:
            zeros = torch.full((scale.shape[1], out), 8, dtype=torch.int32)
        elif "weight_zero_point" not in parts:
            raise ValueError(f"compressed-tensors layer {prefix!r}: asymmetric without weight_zero_point")
        else:
            zeros = unpack_int32(parts["weight_zero_point"], dim=0)[:out].t()  # zp + 8, [groups, out]
        return grouped_int4(codes, zeros, scale.t(), parts.get("weight_g_idx"),
                            f"compressed-tensors layer {prefix!r}")
