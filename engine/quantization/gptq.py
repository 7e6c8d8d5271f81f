"""GPTQ 4-bit checkpoints as auto-gptq, optimum and gptqmodel write them
(``quant_method: gptq``; vLLM's ``quantization/gptq.py``).

Per linear layer ``<prefix>``:

* ``qweight`` int32 [in / 8, out]: eight 4-bit codes along the input
  dimension, input 8i + j in bits 4j..4j+3 of row i;
* ``qzeros`` int32 [groups, out / 8]: eight zero points along the output
  dimension in the same nibble order. ``checkpoint_format`` "gptq" (auto-gptq,
  optimum; the default) stores zero - 1, read back as stored + 1 as vLLM's
  kernels do; "gptq_v2" (gptqmodel's internal format) stores the zero itself;
* ``scales`` float16 [groups, out];
* ``g_idx`` int32 [in]: the group of each input (k // group_size unless
  ``desc_act`` reordered the quantization).

w[n, k] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n]. ``sym`` only fixes the
zero points at 8, so both kinds read the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.quantization.base import QuantizationConfig, UnsupportedQuantization, require
from engine.quantization.int4 import Int4Weight, grouped_int4, unpack_int32


@dataclass
class GPTQConfig(QuantizationConfig):
    """GPTQ settings.

    Attributes:
        group_size: inputs per group (-1: one group per row).
        desc_act: the quantization order followed activation size (``g_idx`` then groups
            inputs out of order; such layers are dequantized at load, not kept packed).
        zero_offset: what to add to a stored zero point (1 for "gptq", 0 for "gptq_v2").
    """

    group_size: int
    desc_act: bool
    zero_offset: int

    name = "gptq"
    parts = frozenset({"qweight", "qzeros", "scales"})
    optional_parts = frozenset({"g_idx"})

    @classmethod
    def from_config(cls, config: dict) -> GPTQConfig:
        """See ``QuantizationConfig.from_config``: 4 bits, no quantized ``lm_head``, no per-module ``dynamic``."""
        require(config, "bits", (4,))
        require(config, "lm_head", (False,), False)
        if config.get("dynamic"):
            raise UnsupportedQuantization("quantization_config.dynamic (per-module GPTQ settings) is not supported")
        fmt = require(config, "checkpoint_format", ("gptq", "gptq_v2"), "gptq")
        group = config.get("group_size", -1)
        if not isinstance(group, int) or (group != -1 and group <= 0):
            raise UnsupportedQuantization(f"quantization_config.group_size = {group!r} is not supported")
        return cls(group, bool(config.get("desc_act", False)), 1 if fmt == "gptq" else 0)

    def weight(self, prefix: str, parts: dict[str, torch.Tensor]) -> Int4Weight | torch.Tensor:
        """See ``QuantizationConfig.weight``."""
        qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
        if qweight.dim() != 2 or qzeros.dim() != 2 or qzeros.shape[1] * 8 != qweight.shape[1]:
            raise ValueError(f"gptq layer {prefix!r}: qweight {tuple(qweight.shape)} and qzeros "
                             f"{tuple(qzeros.shape)} do not fit together")
        codes = unpack_int32(qweight, dim=0).t()  # [out, in]
        zeros = unpack_int32(qzeros, dim=1).to(torch.int32) + self.zero_offset  # [groups, out]
        if self.group_size != -1 and scales.shape[0] * self.group_size != codes.shape[1]:
            raise ValueError(f"gptq layer {prefix!r}: {scales.shape[0]} groups of {self.group_size} do not cover "
                             f"{codes.shape[1]} inputs")
        if self.desc_act and "g_idx" not in parts:   # its groups are out of order: only g_idx says how
            raise ValueError(f"gptq layer {prefix!r}: quantization_config.desc_act is true, but the checkpoint has "
                             f"no {prefix}.g_idx (each input's group)")
        return grouped_int4(codes, zeros, scales, parts.get("g_idx"), f"gptq layer {prefix!r}")
