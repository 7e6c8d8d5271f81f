"""Checkpoint tensors (transformers' names) into a Llama-family model's fused
parameters, this rank's part of each only.

A value is a ``torch.Tensor``, a GGUF tensor kept in its 4-bit or 8-bit
blocks (``GGUFBlocks``), a GPTQ/AWQ/W4A16 layer (``Int4Weight``), an FP8
layer (``FP8Weight``), an int8 W8A16/W8A8 layer (``Int8Weight``; the packed
ones split at their groups: ``narrow``), or, when the model is split over ranks, a tensor still on disk (``engine.model_loader
.lazy``) of which ``narrow(dim, start, length)`` reads only that part. Where
a rank holds the whole tensor (one rank, or a replicated norm) the value is
taken as it is.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from engine.layers.linear import load_packed, q8_head_copy
from engine.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from engine.layers.quant_linear import GGUFBlocks
from engine.quantization.fp8 import FP8Weight
from engine.quantization.int4 import Int4Weight
from engine.quantization.int8 import Int8Weight

# HF module suffix of a decoder layer -> (our module, its parallel layer's shard ids; None: the whole
# parameter, or a row-parallel weight's input columns)
LAYER_MODULES = {
    "self_attn.q_proj": ("qkv_proj", ("q",)),
    "self_attn.k_proj": ("qkv_proj", ("k",)),
    "self_attn.v_proj": ("qkv_proj", ("v",)),
    "self_attn.o_proj": ("o_proj", None),
    "mlp.gate_proj": ("gate_up_proj", (0,)),
    "mlp.up_proj": ("gate_up_proj", (1,)),
    "mlp.down_proj": ("down_proj", None),
    "input_layernorm": ("input_layernorm", None),
    "post_attention_layernorm": ("post_attention_layernorm", None),
    # already fused (Phi-3)
    "self_attn.qkv_proj": ("qkv_proj", ("q", "k", "v")),
    "mlp.gate_up_proj": ("gate_up_proj", (0, 1)),
    # variants' extra norms (ModelSpec): a checkpoint without the variant fails on them below
    "self_attn.q_norm": ("q_norm", None),
    "self_attn.k_norm": ("k_norm", None),
    "pre_feedforward_layernorm": ("pre_feedforward_layernorm", None),
    "post_feedforward_layernorm": ("post_feedforward_layernorm", None),
}


def _narrow(value, dim: int, start: int, length: int):
    """``value``'s part ``[start, start + length)`` along ``dim``: the value itself where that is all of it
    and it is in memory, else its ``narrow`` (a lazy tensor reads only that part)."""
    in_memory = isinstance(value, (torch.Tensor, GGUFBlocks, Int4Weight, FP8Weight, Int8Weight))
    if in_memory and start == 0 and length == value.shape[dim]:
        return value
    return value.narrow(dim, start, length)


def _parts(module, kind: str, shard_ids, value, param: torch.Tensor, name: str) -> list[tuple[int, object]]:
    """(first row of ``param``, the value's part for the rows from there) pairs for checkpoint tensor
    ``name``, as ``module`` (the parameter's layer) splits it.

    Raises:
        ValueError: the checkpoint tensor's shape is not the layer's.
    """
    shape = tuple(value.shape)
    if isinstance(module, ColumnParallelLinear) and shard_ids is not None:
        rows = sum(module.parts[s][0] for s in shard_ids)
        if shape[0] != rows or shape[1:] != tuple(param.shape[1:]):
            raise ValueError(f"weight {name!r} has shape {shape}, expected {(rows, *param.shape[1:])}")
        return [(dst, _narrow(value, 0, src, n)) for src, dst, n in module.row_copies(tuple(shard_ids))]
    if isinstance(module, RowParallelLinear) and kind == "weight":
        span = module.input_span
        if shape != (param.shape[0], module.full_in_features):
            raise ValueError(f"weight {name!r} has shape {shape}, expected {(param.shape[0], module.full_in_features)}")
        try:
            return [(0, _narrow(value, 1, span.start, span.size))]
        except ValueError as exc:   # a packed weight's groups (or act order) the rank's span would cut
            raise ValueError(f"weight {name!r} cannot be split over the tensor-parallel ranks: {exc} (another "
                             "--tensor-parallel-size may split it)") from None
    if isinstance(module, VocabParallelEmbedding):
        span = module.vocab
        if len(shape) != 2 or shape[1] != param.shape[1] or not span.stop <= shape[0]:
            raise ValueError(f"weight {name!r} has shape {shape}, expected ({span.stop} rows or more, "
                             f"{param.shape[1]}): config.json's vocab_size and hidden_size must fit it")
        param.data[span.size:].zero_()  # padding rows of the last rank
        return [(0, _narrow(value, 0, span.start, span.size))]
    return [(0, _narrow(value, 0, 0, shape[0]))]


def _target(model, name: str):
    """(parameter name, its module, the parallel layer's shard ids or None) of checkpoint tensor ``name``."""
    if name.startswith("model.layers."):
        _, _, idx, rest = name.split(".", 3)
        module, kind = rest.rsplit(".", 1)
        if module not in LAYER_MODULES:
            raise ValueError(f"unexpected weight {name!r}")
        ours, shard_ids = LAYER_MODULES[module]
        layer = model.layers[int(idx)] if int(idx) < len(model.layers) else None
        return f"layers.{idx}.{ours}.{kind}", getattr(layer, ours, None), shard_ids
    target = name[len("model."):] if name.startswith("model.") else name
    owner = target.rsplit(".", 1)[0]
    return target, getattr(model, owner, None) if "." not in owner else None, None


@torch.no_grad()
def load_hf_weights(model, weights: Iterable[tuple[str, object]], q4_copy: bool = False) -> None:
    """Copy HF-named tensors (``model.layers.0.self_attn.q_proj.weight``...)
    into ``model``'s fused parameters (this rank's part of each), casting to
    each parameter's dtype; the caller chooses the kernels afterwards.

    A ``GGUFBlocks`` value (``quantization: gguf``), an ``Int4Weight`` (a
    GPTQ/AWQ/W4A16 checkpoint's layer, ``engine.quantization``), an
    ``FP8Weight`` or an ``Int8Weight`` is kept packed when every part of its
    fused projection is one (``engine.layers.linear.load_packed``), else dequantized. With ``q4_copy`` (``quantization: none`` from a 4-bit GGUF,
    bfloat16 on CPU) it is dequantized into the parameter and also kept as
    the C kernel's 4-bit copy (``LlamaDecoderLayer.q4_copy``).

    Raises:
        ValueError: an unexpected name or shape, or parameters left unloaded.
    """
    params = dict(model.named_parameters())
    head = "lm_head.weight" if model.lm_head is not None else "embed_tokens.weight"
    loaded: dict[str, int] = {}
    # fused target -> (row offset, quantized part)
    int4: dict[str, list[tuple[int, GGUFBlocks | Int4Weight | FP8Weight | Int8Weight]]] = {}
    for name, tensor in weights:
        if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and model.lm_head is None):
            continue  # tied: the embedding is the head
        target, module, shard_ids = _target(model, name)
        param = params.get(target)
        if param is None:
            raise ValueError(f"unexpected weight {name!r} for {model.config.architecture}")
        kind = target.rsplit(".", 1)[1]
        parts = _parts(module, kind, shard_ids, tensor, param, name)
        vocab = isinstance(module, VocabParallelEmbedding)
        whole = shard_ids is None and not vocab
        for offset, value in parts:
            dst = param.data if whole else param.data[offset:offset + value.shape[0]]
            if tuple(dst.shape) != tuple(value.shape):
                raise ValueError(f"weight {name!r} has shape {tuple(value.shape)}, expected {tuple(dst.shape)}")
            if isinstance(value, GGUFBlocks) and value.qtype == "Q8_0":  # the output head (or tied embedding)
                dst.copy_(value.dequantize())
                copy = q8_head_copy(value, dst) if target == head and dst.shape[0] == param.shape[0] else None
                if copy is not None:
                    model.lm_head_q8, model._lm_head_q8_of = copy, (param, param._version)
            elif isinstance(value, (GGUFBlocks, Int4Weight, FP8Weight, Int8Weight)):
                int4.setdefault(target, []).append((offset, value))
            else:
                dst.copy_(value)
            loaded[target] = loaded.get(target, 0) + (param.shape[0] if whole or vocab else value.shape[0])
    missing = [n for n, p in params.items() if loaded.get(n, 0) != p.shape[0]]
    if missing:
        raise ValueError(f"weights missing for {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    for target, pieces in int4.items():
        _, idx, name, _ = target.split(".")
        load_packed(model.layers[int(idx)], name, sorted(pieces, key=lambda p: p[0]), params[target], q4_copy)
