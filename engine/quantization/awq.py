"""AWQ 4-bit checkpoints as AutoAWQ writes them with its GEMM kernels'
packing (``quant_method: awq``, ``version: gemm``; vLLM's ``quantization/awq.py``).

Per linear layer ``<prefix>``:

* ``qweight`` int32 [in, out / 8]: eight 4-bit codes along the output
  dimension, interleaved: nibble i of column c holds output 8c + ORDER[i]
  (AutoAWQ's ``AWQ_ORDER`` = 0, 2, 4, 6, 1, 3, 5, 7);
* ``qzeros`` int32 [groups, out / 8]: the zero points, packed the same way;
* ``scales`` float16 [groups, out].

w[n, k] = (q[k, n] - z[k // group_size, n]) * s[k // group_size, n].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.quantization.base import QuantizationConfig, UnsupportedQuantization, require
from engine.quantization.int4 import Int4Weight, grouped_int4, unpack_int32

ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the output held by each nibble of a packed int32


@dataclass
class AWQConfig(QuantizationConfig):
    """AWQ settings.

    Attributes:
        group_size: inputs per group.
    """

    group_size: int

    name = "awq"
    parts = frozenset({"qweight", "qzeros", "scales"})

    @classmethod
    def from_config(cls, config: dict) -> AWQConfig:
        """See ``QuantizationConfig.from_config``: 4 bits (``bits`` or AutoAWQ's ``w_bit``), zero points,
        GEMM packing, every linear layer quantized."""
        require(config, "bits" if "bits" in config else "w_bit", (4,))
        require(config, "zero_point", (True,), True)
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            raise UnsupportedQuantization(f"quantization_config.version = {version!r} is not supported "
                                          "(supported: 'gemm')")
        if config.get("modules_to_not_convert"):
            raise UnsupportedQuantization("quantization_config.modules_to_not_convert is not supported")
        group = config.get("group_size", config.get("q_group_size"))
        if not isinstance(group, int) or group <= 0:
            raise UnsupportedQuantization(f"quantization_config.group_size = {group!r} is not supported")
        return cls(group)

    def weight(self, prefix: str, parts: dict[str, torch.Tensor]) -> Int4Weight | torch.Tensor:
        """See ``QuantizationConfig.weight``."""
        qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
        if qweight.dim() != 2 or qzeros.dim() != 2 or qzeros.shape[1] != qweight.shape[1] \
                or scales.shape[0] * self.group_size != qweight.shape[0]:
            raise ValueError(f"awq layer {prefix!r}: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)} "
                             f"and scales {tuple(scales.shape)} do not fit group size {self.group_size}")
        codes = unpack_int32(qweight, dim=1, order=ORDER).t()  # [out, in]
        zeros = unpack_int32(qzeros, dim=1, order=ORDER)  # [groups, out]
        return grouped_int4(codes, zeros, scales, None, f"awq layer {prefix!r}")
