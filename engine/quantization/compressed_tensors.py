"""compressed-tensors checkpoints as llm-compressor writes them
(``quant_method: compressed-tensors``; vLLM's
``quantization/compressed_tensors/``): the ``pack-quantized`` format with
4-bit integer weights and no activation quantization (W4A16, from the GPTQ
or AWQ recipes); its 8-bit weights (W8A16) and the ``int-quantized`` W8A8
format are read by ``compressed_tensors_int8``.

Per quantized linear layer ``<prefix>`` (the ``compressed_tensors`` package's
``PackedQuantizationCompressor``):

* ``weight_packed`` int32 [out, in / 8]: signed codes q in -8..7 stored as
  q + 8, eight along the inputs, input 8j + i in bits 4i..4i+3 of word j;
* ``weight_scale`` [out, groups] (strategy "group"), [out, 1] ("channel");
* ``weight_zero_point`` (asymmetric only) int32 [out / 8, groups]: signed
  zero points + 8, packed the same way along the outputs;
* ``weight_shape`` [2]; ``weight_g_idx`` [in] with ``actorder``.

w[n, k] = (q - zp) * s. Layers without ``weight_packed`` (``ignore``) load
as full-precision weights. The ``float-quantized`` FP8 format: ``FP8Config``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.quantization.base import (QuantizationConfig, UnsupportedQuantization, check_groups,
                                      declared_group_size, require)
from engine.quantization.compressed_tensors_int8 import W8A8Config, W8A16Config
from engine.quantization.fp8 import FP8Weight
from engine.quantization.int4 import Int4Weight, grouped_int4, unpack_int32


# what each implemented format's config group may say: weights key -> (allowed values, default)
_PACKED_W4 = {"num_bits": ((4, 8), None), "type": (("int",), None), "strategy": (("group", "channel"), None),
              "dynamic": ((False,), False), "actorder": ((None, "group", "weight", "static"), None)}
_FP8 = {"num_bits": ((8,), None), "type": (("float",), None), "strategy": (("tensor", "channel"), None),
        "dynamic": ((False,), False)}
# FP8_DYNAMIC's per-token activation quantization: run weight-only (see FP8Config)
_FP8_ACTIVATIONS = {"num_bits": ((8,), None), "type": (("float",), None), "strategy": (("token",), None),
                    "dynamic": ((True,), None)}
# W8A8 int8 (vLLM's CompressedTensorsW8A8Int8 with dynamic per-token activations, symmetric ones only)
_INT8 = {"num_bits": ((8,), None), "type": (("int",), None), "strategy": (("tensor", "channel"), None),
         "dynamic": ((False,), False), "symmetric": ((True,), True)}
_INT8_ACTIVATIONS = {"num_bits": ((8,), None), "type": (("int",), None), "strategy": (("token",), None),
                     "dynamic": ((True,), None), "symmetric": ((True,), True)}
# 8-bit pack-quantized (W8A16): what vLLM's CompressedTensorsWNA16 takes at 8 bits, less act-order
_PACKED_W8 = {"symmetric": ((True,), True), "actorder": ((None,), None)}
_WEIGHTS = {"pack-quantized": _PACKED_W4, "float-quantized": _FP8, "int-quantized": _INT8}


def _check(where: str, values: dict, rules: dict) -> None:
    for key, (allowed, default) in rules.items():
        try:
            require(values, key, allowed, default)
        except UnsupportedQuantization as e:
            raise UnsupportedQuantization(str(e).replace("quantization_config.", f"{where}.")) from None


def check_config(config: dict, fmt: str) -> dict:
    """The one ``config_groups`` entry of a compressed-tensors config in format ``fmt``
    ("pack-quantized" W4A16 / W8A16, "float-quantized" FP8 or "int-quantized" W8A8), checked
    against what the engine implements.

    Raises:
        UnsupportedQuantization: anything else, naming the field.
    """
    require(config, "quantization_status", ("compressed",), "compressed")
    for key in ("kv_cache_scheme", "sparsity_config", "transform_config"):
        if config.get(key):
            raise UnsupportedQuantization(f"quantization_config.{key} is not supported")
    groups = config.get("config_groups") or {}
    if len(groups) != 1:
        raise UnsupportedQuantization(f"quantization_config.config_groups has {len(groups)} groups (supported: one)")
    (name, group), = groups.items()
    where = f"quantization_config.config_groups.{name}"
    if group.get("format", fmt) != fmt:
        raise UnsupportedQuantization(f"{where}.format = {group.get('format')!r} is not supported (supported: {fmt!r})")
    if group.get("targets") != ["Linear"]:
        raise UnsupportedQuantization(f"{where}.targets = {group.get('targets')!r} is not supported "
                                      "(supported: ['Linear'])")
    if group.get("output_activations"):
        raise UnsupportedQuantization(f"{where}.output_activations is not supported")
    if fmt == "int-quantized" and not group.get("input_activations"):
        raise UnsupportedQuantization(f"{where}.input_activations is required for int-quantized (W8A8; "
                                      "weight-only int8 is pack-quantized)")
    if group.get("input_activations"):
        if fmt == "pack-quantized":
            raise UnsupportedQuantization(f"{where}.input_activations is not supported (weight-only W4A16/W8A16 is)")
        _check(f"{where}.input_activations", group["input_activations"],
               _FP8_ACTIVATIONS if fmt == "float-quantized" else _INT8_ACTIVATIONS)
    weights = group.get("weights") or {}
    _check(f"{where}.weights", weights, _WEIGHTS[fmt])
    if fmt == "pack-quantized" and weights["num_bits"] == 8:
        _check(f"{where}.weights", weights, _PACKED_W8)
    size = weights.get("group_size")
    if weights.get("strategy") == "group" and (not isinstance(size, int) or isinstance(size, bool) or size <= 0):
        raise UnsupportedQuantization(f"{where}.weights.group_size = {size!r} is not supported with strategy "
                                      "'group' (supported: a positive integer)")
    group["field"] = f"{where}.weights"
    return group


@dataclass
class CompressedTensorsConfig(QuantizationConfig):
    """compressed-tensors settings.

    Attributes:
        symmetric: no zero points are stored (zp = 0).
        group_size: inputs per scale as declared (None: one scale a row), checked against each layer.
        field: the declared weights' place in config.json, for errors.
        actorder_group: ``actorder: group``: groups assigned in activation order, each input's group in
            ``weight_g_idx`` (required then; ``weight``/``static`` keep the groups in order, as vLLM reads them).
    """

    symmetric: bool
    group_size: int | None = None
    field: str = "quantization_config.config_groups.group_0.weights"
    actorder_group: bool = False

    name = "compressed-tensors"
    parts = frozenset({"weight_packed", "weight_scale", "weight_shape"})
    optional_parts = frozenset({"weight_zero_point", "weight_g_idx"})

    @classmethod
    def from_config(cls, config: dict) -> QuantizationConfig:
        """See ``QuantizationConfig.from_config``: ``pack-quantized`` W4A16 (this class) or W8A16
        (``W8A16Config``), ``float-quantized`` FP8 (``FP8Config``) or ``int-quantized`` W8A8
        (``W8A8Config``), one group targeting every Linear, compressed, without sparsity, transforms
        or a quantized KV cache."""
        fmt = require(config, "format", ("pack-quantized", "float-quantized", "int-quantized"))
        group = check_config(config, fmt)
        if fmt == "float-quantized":
            return FP8Config(group["weights"]["strategy"])
        if fmt == "int-quantized":
            return W8A8Config(group["weights"]["strategy"])
        weights = group["weights"]
        if weights["num_bits"] == 8:
            return W8A16Config(declared_group_size(weights), group["field"])
        return cls(bool(weights.get("symmetric", True)), declared_group_size(weights), group["field"],
                   weights.get("actorder") == "group")

    def weight(self, prefix: str, parts: dict[str, torch.Tensor]) -> Int4Weight | torch.Tensor:
        """See ``QuantizationConfig.weight``."""
        packed, scale = parts["weight_packed"], parts["weight_scale"]
        out, k = (int(x) for x in parts["weight_shape"].tolist())
        if packed.dim() != 2 or tuple(packed.shape) != (out, k // 8) or k % 8 or scale.dim() != 2 \
                or scale.shape[0] != out:
            raise ValueError(f"compressed-tensors layer {prefix!r}: weight_packed {tuple(packed.shape)} and "
                             f"weight_scale {tuple(scale.shape)} do not fit weight_shape {(out, k)}")
        check_groups(prefix, self.field, self.group_size, k, scale.shape[1])
        codes = unpack_int32(packed, dim=1)  # q + 8, [out, in]
        if self.symmetric:
            zeros = torch.full((scale.shape[1], out), 8, dtype=torch.int32)
        elif "weight_zero_point" not in parts:
            raise ValueError(f"{self.field}.symmetric = False, but layer {prefix!r} has no weight_zero_point")
        else:
            zp = parts["weight_zero_point"]
            packed_zp = (-(-out // 8), scale.shape[1])   # eight 4-bit points an int32, down the rows
            if zp.dtype != torch.int32 or tuple(zp.shape) != packed_zp:
                raise ValueError(f"compressed-tensors layer {prefix!r}: weight_zero_point is {zp.dtype} "
                                 f"{tuple(zp.shape)}, expected int32 {packed_zp} (packed 4-bit points, eight an "
                                 "int32 along the output rows)")
            zeros = unpack_int32(zp, dim=0)[:out].t().to(torch.int32)  # zp + 8
        if self.actorder_group and "weight_g_idx" not in parts:   # out-of-order groups: only g_idx says how
            raise ValueError(f"{self.field}.actorder = 'group', but compressed-tensors layer {prefix!r} has no "
                             f"{prefix}.weight_g_idx (each input's group)")
        return grouped_int4(codes, zeros, scale.t(), parts.get("weight_g_idx"),
                            f"compressed-tensors layer {prefix!r}")


@dataclass
class FP8Config(QuantizationConfig):
    """compressed-tensors ``float-quantized`` FP8 checkpoints (llm-compressor's FP8 and FP8_DYNAMIC
    schemes): ``weight`` float8_e4m3fn [out, in] and ``weight_scale`` float [1] ("tensor") or
    [out, 1] ("channel"), w = weight * weight_scale; activations, FP8 per token in FP8_DYNAMIC, are
    not rounded to FP8 (weight-only, as vLLM runs FP8 on devices without FP8 arithmetic).

    Each layer becomes an ``FP8Weight`` (its codes as stored, a float32 scale per row): kept in 8
    bits in bfloat16 on CPU (``engine.layers.fp8_linear``: these CPUs have no FP8 arithmetic, the C
    kernel upcasts tiles to the bfloat16 values bf16(code * scale)), dequantized at load elsewhere
    (float32: exact).

    Attributes:
        strategy: "tensor" or "channel".
    """

    strategy: str

    name = "compressed-tensors"
    parts = frozenset({"weight", "weight_scale"})
    optional_parts = frozenset({"input_scale"})

    def quantized_weights(self, weights):
        """See ``QuantizationConfig.quantized_weights``: an FP8 ``weight`` (by its dtype) and its scale
        become one ``FP8Weight``; every other tensor passes through."""
        held: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in weights:
            prefix, _, suffix = name.rpartition(".")
            if suffix == "weight_scale" or (suffix == "weight" and tensor.dtype == torch.float8_e4m3fn):
                held.setdefault(prefix, {})[suffix] = tensor
            elif suffix != "input_scale":
                yield name, tensor
        for prefix, parts in held.items():
            if parts.keys() != self.parts:
                raise ValueError(f"fp8 layer {prefix!r} has {sorted(parts)}, expected {sorted(self.parts)}")
            yield f"{prefix}.weight", self.weight(prefix, parts)

    def weight(self, prefix: str, parts: dict[str, torch.Tensor]) -> FP8Weight:
        """See ``QuantizationConfig.weight``: the codes with a float32 scale per row."""
        w, scale = parts["weight"], parts["weight_scale"].float()
        expected = (1,) if self.strategy == "tensor" else (w.shape[0], 1)
        if w.dim() != 2 or tuple(scale.reshape(-1, 1).shape if self.strategy == "channel" else
                                 scale.reshape(-1).shape) != expected:
            raise ValueError(f"fp8 layer {prefix!r}: weight_scale {tuple(scale.shape)} does not fit strategy "
                             f"{self.strategy!r} of a {tuple(w.shape)} weight")
        return FP8Weight(w, scale.reshape(-1, 1).expand(w.shape[0], 1).contiguous())
