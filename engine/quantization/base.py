"""What every checkpoint quantization format implements (vLLM's
``QuantizationConfig``, ``model_executor/layers/quantization/base_config.py``):
built from config.json's ``quantization_config``, it refuses what it does not
implement and turns the checkpoint's packed tensors into the weights the model
loads."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import ClassVar

import torch

from engine.quantization.int4 import Int4Weight


class UnsupportedQuantization(ValueError):
    """A quantization format or option the engine does not implement (refused at load, never loaded wrong)."""


class QuantizationConfig:
    """One format's settings; subclasses set ``name`` and ``parts`` and implement ``from_config`` and ``weight``.

    Attributes:
        name: the ``quant_method`` it reads (and the ``--quantization`` value).
        parts: the tensor suffixes of one quantized linear layer (``qweight``...).
        optional_parts: suffixes a layer may lack (GPTQ's ``g_idx``).
    """

    name: ClassVar[str] = ""
    parts: ClassVar[frozenset[str]] = frozenset()
    optional_parts: ClassVar[frozenset[str]] = frozenset()

    @classmethod
    def from_config(cls, config: dict) -> QuantizationConfig:
        """The settings of ``quantization_config``.

        Raises:
            UnsupportedQuantization: an option the engine does not implement, naming its field.
        """
        raise NotImplementedError

    def weight(self, prefix: str, parts: dict[str, torch.Tensor]) -> Int4Weight | torch.Tensor:
        """The [out, in] weight of the linear layer ``prefix`` from its tensors (suffix -> tensor):
        kept packed (``Int4Weight``) or a dense float32 tensor where the kernels cannot follow its layout.

        Raises:
            ValueError: tensors whose shapes do not fit together.
        """
        raise NotImplementedError

    def quantized_weights(self, weights: Iterable[tuple[str, torch.Tensor]]
                          ) -> Iterator[tuple[str, torch.Tensor | Int4Weight]]:
        """The checkpoint's (name, tensor) stream with each quantized layer's
        tensors replaced by one ``<prefix>.weight``; other tensors pass through
        as read. A layer's parts are held (packed, a few bytes a weight) until
        the stream ends: shards may split them.

        Raises:
            ValueError: a layer with some of its parts missing.
        """
        held: dict[str, dict[str, torch.Tensor]] = {}
        every = self.parts | self.optional_parts
        for name, tensor in weights:
            prefix, _, suffix = name.rpartition(".")
            if suffix in every:
                held.setdefault(prefix, {})[suffix] = tensor
            else:
                yield name, tensor
        for prefix, parts in held.items():
            missing = self.parts - parts.keys()
            if missing:
                raise ValueError(f"{self.name} layer {prefix!r} lacks {sorted(missing)}")
            yield f"{prefix}.weight", self.weight(prefix, parts)


def require(config: dict, key: str, allowed, default=None):
    """``config[key]`` (or ``default`` when absent) when it is in ``allowed``.

    Raises:
        UnsupportedQuantization: another value, naming ``quantization_config.<key>``.
    """
    value = config.get(key, default)
    if value not in allowed:
        raise UnsupportedQuantization(f"quantization_config.{key} = {value!r} is not supported "
                                      f"(supported: {', '.join(map(repr, allowed))})")
    return value


def declared_group_size(weights: dict) -> int | None:
    """The inputs per scale a ``pack-quantized`` group's ``weights`` declare: ``group_size`` for the "group"
    strategy, None for "channel" (one scale a row)."""
    return int(weights["group_size"]) if weights.get("strategy") == "group" else None


def check_groups(prefix: str, field: str, group_size: int | None, in_features: int, groups: int) -> None:
    """Refuse a layer whose ``weight_scale`` has another number of groups than the config declares
    (vLLM sizes its scale parameters from the declared ``group_size`` and fails to load such a layer).

    Raises:
        ValueError: naming the field, the declared value and what the layer holds.
    """
    expected = 1 if group_size is None else in_features // group_size
    if (group_size is not None and in_features % group_size) or groups != expected:
        declared = f"group_size = {group_size}" if group_size is not None else "strategy = 'channel'"
        raise ValueError(f"{field}.{declared} does not fit layer {prefix!r}: its weight_scale has {groups} "
                         f"group(s) for {in_features} inputs")
