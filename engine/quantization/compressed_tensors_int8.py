"""compressed-tensors int8 checkpoints (llm-compressor's W8A16 and W8A8
recipes; vLLM's ``CompressedTensorsWNA16`` at 8 bits and
``CompressedTensorsW8A8Int8``), chosen by ``CompressedTensorsConfig.from_config``:

* W8A16, format ``pack-quantized`` with ``num_bits: 8`` (the package's
  ``infer_quantization_format`` writes weight-only int8 so): ``weight_packed``
  int32 [out, in / 4] of q + 128, four along the inputs (input 4j + i in
  bits 8i..8i+7 of word j), ``weight_scale`` [out, groups] (strategy "group")
  or [out, 1] ("channel"), ``weight_shape``; symmetric, w = q * s.
* W8A8, format ``int-quantized``: ``weight`` int8 [out, in] and
  ``weight_scale`` [out, 1] ("channel") or [1] ("tensor"), w = q * s; the
  activations quantized to int8 per token at run time (``input_activations``:
  strategy token, dynamic, symmetric), so no activation scales are stored.

Each layer becomes an ``Int8Weight`` (``engine.quantization.int8``), run by
``engine.layers.int8_linear``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.quantization.base import QuantizationConfig, check_groups
from engine.quantization.int8 import Int8Weight, unpack_int8


@dataclass
class W8A16Config(QuantizationConfig):
    """compressed-tensors ``pack-quantized`` 8-bit weights, bfloat16 (model dtype) activations.

    Attributes:
        group_size: inputs per scale as declared (None: one scale a row), checked against each layer.
        field: the declared weights' place in config.json, for errors.
    """

    group_size: int | None = None
    field: str = "quantization_config.config_groups.group_0.weights"

    name = "compressed-tensors"
    parts = frozenset({"weight_packed", "weight_scale", "weight_shape"})

    def weight(self, prefix: str, parts: dict[str, torch.Tensor]) -> Int8Weight:
        """See ``QuantizationConfig.weight``: the codes with their float32 scales per group."""
        packed, scale = parts["weight_packed"], parts["weight_scale"]
        out, k = (int(x) for x in parts["weight_shape"].tolist())
        if packed.dim() != 2 or tuple(packed.shape) != (out, (k + 3) // 4) or scale.dim() != 2 \
                or scale.shape[0] != out or k % scale.shape[1]:
            raise ValueError(f"compressed-tensors layer {prefix!r}: weight_packed {tuple(packed.shape)} and "
                             f"weight_scale {tuple(scale.shape)} do not fit an 8-bit weight_shape {(out, k)}")
        check_groups(prefix, self.field, self.group_size, k, scale.shape[1])
        return Int8Weight(unpack_int8(packed, k), scale.float().contiguous(), k // scale.shape[1])


@dataclass
class W8A8Config(QuantizationConfig):
    """compressed-tensors ``int-quantized`` W8A8: int8 weights with a per-channel or per-tensor
    scale, int8 activations quantized per token at run time.

    Attributes:
        strategy: the weights' "tensor" or "channel".
    """

    strategy: str

    name = "compressed-tensors"
    parts = frozenset({"weight", "weight_scale"})

    def quantized_weights(self, weights):
        """See ``QuantizationConfig.quantized_weights``: an int8 ``weight`` (by its dtype) and its scale
        become one ``Int8Weight``; every other tensor passes through."""
        held: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in weights:
            prefix, _, suffix = name.rpartition(".")
            if suffix == "weight_scale" or (suffix == "weight" and tensor.dtype == torch.int8):
                held.setdefault(prefix, {})[suffix] = tensor
            else:
                yield name, tensor
        for prefix, parts in held.items():
            if parts.keys() != self.parts:
                raise ValueError(f"int8 layer {prefix!r} has {sorted(parts)}, expected {sorted(self.parts)}")
            yield f"{prefix}.weight", self.weight(prefix, parts)

    def weight(self, prefix: str, parts: dict[str, torch.Tensor]) -> Int8Weight:
        """See ``QuantizationConfig.weight``: the codes with a float32 scale per row."""
        w, scale = parts["weight"], parts["weight_scale"].float()
        rows = w.shape[0] if self.strategy == "channel" else 1
        if w.dim() != 2 or scale.numel() != rows or (self.strategy == "channel" and scale.shape[0] != rows):
            raise ValueError(f"int8 layer {prefix!r}: weight_scale {tuple(scale.shape)} does not fit strategy "
                             f"{self.strategy!r} of a {tuple(w.shape)} weight")
        scales = scale.reshape(-1, 1).expand(w.shape[0], 1).contiguous()
        return Int8Weight(w.contiguous(), scales, w.shape[1], activations="token")
