"""A Llama-family decoder stack in one C call (``csrc/decoder_cpu.c``), and
the fused RoPE + KV-cache write it uses per layer.

A small model's decode step on CPU is short enough that ~10 Python-level
operations per layer (each a dispatch, an allocation and a ctypes call) cost
as much as the arithmetic: SmolLM2-135M's 30 layers made ~300 of them per
step. :func:`forward` runs the same kernels (``cpu_linear``,
``cpu_norm_act``, ``cpu_attention``, :func:`rope_cache`) in the same order
on the same inputs from C, so it gives the per-operation path's bits, and
holds the GIL for none of it (ctypes releases it around foreign calls: the
server's event loop runs meanwhile).

The model (``engine.models.llama``) builds a :class:`DecoderWeights` once
its weights are packed and its KV cache is known, and calls :func:`forward`
for bfloat16 on CPU with the ``cpu`` attention backend.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import torch

from kernels import cpu_linear
from kernels.cpu_build import STRUCTS, load_library


_Layer = STRUCTS["decoder_layer"]  # kernels.h's structs, read from it (kernels/c_header.py)
_Shape = STRUCTS["decoder_shape"]


PROJECTIONS = ("qkv", "o", "gate_up", "down")
# The layer features (``engine.models.spec.stack_features``) decoder_cpu.c implements beyond a plain
# Llama layer. A model using any other runs on the per-operation path: add a name here only with its C code
# and a test pinning the stack to the per-operation path on it (tests/test_cpu_decoder.py).
IMPLEMENTED = frozenset({"qkv_bias"})


def unimplemented(features: frozenset[str]) -> frozenset[str]:
    """The features of a model's layers that the C stack does not implement (empty: it can run them)."""
    return features - IMPLEMENTED


@dataclass
class LayerWeights:
    """One decoder layer's tensors as the C stack reads them.

    Attributes:
        input_norm, post_norm: [hidden] bfloat16 RMSNorm weights.
        bf16: per projection (``PROJECTIONS``: the fused q/k/v
            [q + 2 kv, hidden], output [hidden, q], fused gate/up
            [2 inter, hidden] and down [hidden, inter]), its
            ``cpu_linear.PackedLinear`` or None.
        q4: per projection, its ``cpu_linear.PackedQ4Linear`` (4-bit GGUF or
            checkpoint, with its group size and input order) or None. A
            projection needs one of the two; with both, the x86 builds read
            the 4-bit panels for every call (integer dots:
            ``cpu_linear.integer_copies``), the portable one for calls of up
            to two rows (``cpu_linear.COPY_MAX_ROWS``; larger ones read the
            bfloat16 panels: the same bits, fewer bytes or less arithmetic).
        qkv_bias: [q + 2 kv] float32, or None.
        key_cache, value_cache: [num_blocks, block_size, num_kv_heads,
            head_dim] bfloat16, contiguous.
        fp8: per projection, its ``cpu_linear.PackedFP8Linear`` (an FP8
            checkpoint's), read instead of the others when present.
        int8: per projection, its ``cpu_linear.PackedQ8Linear`` (W8A16) or
            ``cpu_linear.PackedW8A8Linear`` (W8A8), read instead of the others when present.
    """

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    bf16: dict[str, cpu_linear.PackedLinear | None]
    q4: dict[str, cpu_linear.PackedQ4Linear | None]
    qkv_bias: torch.Tensor | None
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    fp8: dict[str, cpu_linear.PackedFP8Linear | None] = field(default_factory=dict)
    int8: dict[str, cpu_linear.PackedQ8Linear | cpu_linear.PackedW8A8Linear | None] = field(default_factory=dict)


class DecoderWeights:
    """Every layer's tensors and the model's shape, as one C struct array
    (built once; the tensors are referenced here so they outlive it).

    Args:
        layers: per layer, its :class:`LayerWeights`.
        final_norm: [hidden] bfloat16.
        cos, sin: [max_positions, head_dim] float32 RoPE tables, contiguous.
        num_heads, num_kv_heads, head_dim, intermediate: the model's shape.
        rms_norm_eps: RMSNorm's epsilon; scale: attention's softmax scale.

    Raises:
        ValueError: a tensor of the wrong dtype or layout.
    """

    def __init__(self, layers: list[LayerWeights], final_norm: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 num_heads: int, num_kv_heads: int, head_dim: int, intermediate: int, rms_norm_eps: float,
                 scale: float) -> None:
        self.layers, self.final_norm, self.cos, self.sin = layers, final_norm.contiguous(), cos, sin
        for t in (cos, sin):
            if t.dtype != torch.float32 or not t.is_contiguous() or t.shape[1] != head_dim:
                raise ValueError(f"RoPE tables must be contiguous float32 [*, {head_dim}]")
        hidden = final_norm.shape[0]
        block_size = layers[0].key_cache.shape[1]
        self._arrays = (_Layer * len(layers))()
        self._keep = []
        for i, w in enumerate(layers):
            for cache in (w.key_cache, w.value_cache):
                if cache.dtype != torch.bfloat16 or not cache.is_contiguous() or cache.shape[1] != block_size:
                    raise ValueError("the KV caches must be contiguous bfloat16 with one block size")
            keep = [w.input_norm.contiguous(), w.post_norm.contiguous(), w.key_cache, w.value_cache]
            layer = self._arrays[i]
            layer.input_norm, layer.post_norm = keep[0].data_ptr(), keep[1].data_ptr()
            layer.key_cache, layer.value_cache = w.key_cache.data_ptr(), w.value_cache.data_ptr()
            if w.qkv_bias is not None:
                keep.append(w.qkv_bias.to(torch.float32).contiguous())
                layer.qkv_bias = keep[-1].data_ptr()
            for j, name in enumerate(PROJECTIONS):
                bf16, q4, fp8, i8 = w.bf16.get(name), w.q4.get(name), w.fp8.get(name), w.int8.get(name)
                if bf16 is None and q4 is None and fp8 is None and i8 is None:
                    raise ValueError(f"layer {i} has no packed {name} projection")
                if isinstance(i8, cpu_linear.PackedW8A8Linear):
                    keep += [i8.codes, i8.scales, i8.col_sums]
                    layer.i8_codes[j], layer.i8_scales[j] = i8.codes.data_ptr(), i8.scales.data_ptr()
                    layer.i8_sums[j] = i8.col_sums.data_ptr()
                elif i8 is not None:
                    keep += [i8.codes, i8.scales]
                    layer.i8_codes[j], layer.i8_scales[j], layer.i8_group[j] = (
                        i8.codes.data_ptr(), i8.scales.data_ptr(), i8.group)
                if fp8 is not None:
                    keep += [fp8.codes, fp8.scales]
                    layer.fp8_codes[j], layer.fp8_scales[j] = fp8.codes.data_ptr(), fp8.scales.data_ptr()
                    layer.fp8_group[j] = fp8.group
                if bf16 is not None:
                    keep.append(bf16.data)
                    layer.bf16[j] = bf16.data.data_ptr()
                if q4 is not None:
                    keep += [q4.codes, q4.scales]
                    layer.q4_codes[j], layer.q4_scales[j] = q4.codes.data_ptr(), q4.scales.data_ptr()
                    layer.q4_group[j] = q4.group
                    if q4.perm is not None:
                        keep.append(q4.perm)
                        layer.q4_perm[j] = q4.perm.data_ptr()
            self._keep.append(keep)
        self.shape = _Shape(len(layers), hidden, num_heads, num_kv_heads, head_dim, intermediate, block_size,
                            cos.shape[0], rms_norm_eps, scale)
        self.hidden = hidden


def forward(weights: DecoderWeights, x: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
            layers: tuple[int, int] | None = None) -> torch.Tensor:
    """``final_norm(layers(x))`` for a flat batch of prefill chunks and decodes,
    writing the new tokens' keys and values into the caches; with ``layers``
    (first, end) through those layers only (the same per-layer arithmetic), and
    when end is not the last layer the residual stream leaving it (``x``) is
    returned instead, not normed.

    Args:
        x: [num_tokens, hidden] bfloat16 token embeddings (overwritten: the
            residual stream runs in it).
        positions, slot_mapping: [num_tokens] int64 (slot -1: not cached).
        block_tables: [num_seqs, max_blocks] int32; seq_lens [num_seqs] and
            query_start_loc [num_seqs + 1] int32, all contiguous (the
            ``cpu`` attention backend's plan).

    Returns:
        [num_tokens, hidden] bfloat16 final-normed hidden states.

    Raises:
        ValueError: a position outside the RoPE tables, or attention shapes
            the kernel does not take.
        MemoryError: the kernel's scratch could not be allocated.
    """
    t = x.shape[0]
    if x.dtype != torch.bfloat16 or not x.is_contiguous() or x.shape[1:] != (weights.hidden,):
        raise ValueError(f"forward takes contiguous bfloat16 [num_tokens, {weights.hidden}], got {x.dtype} "
                         f"{tuple(x.shape)}")
    positions, slot_mapping = positions.contiguous(), slot_mapping.contiguous()
    if positions.dtype != torch.int64 or slot_mapping.dtype != torch.int64:
        raise ValueError("positions and slot_mapping must be int64")
    first, end = layers or (0, len(weights.layers))
    if not 0 <= first < end <= len(weights.layers):
        raise ValueError(f"layers {layers} outside the stack's {len(weights.layers)}")
    shape = _Shape.from_buffer_copy(weights.shape)
    shape.num_layers = end - first
    out = torch.empty_like(x)
    rc = load_library().decoder_forward_bf16(
        ctypes.byref(shape), ctypes.byref(weights._arrays, first * ctypes.sizeof(_Layer)),
        weights.final_norm.data_ptr(), x.data_ptr(), out.data_ptr(), t,
        positions.data_ptr(), weights.cos.data_ptr(), weights.sin.data_ptr(), slot_mapping.data_ptr(),
        block_tables.data_ptr(), block_tables.shape[1], seq_lens.data_ptr(), query_start_loc.data_ptr(),
        seq_lens.numel(), torch.get_num_threads())
    if rc == 1:
        raise ValueError(f"a position is outside the RoPE tables ({weights.cos.shape[0]} positions) or the attention "
                         "kernel does not take these shapes")
    if rc == 2:
        raise MemoryError("the decoder's scratch could not be allocated")
    return out if end == len(weights.layers) else x


def decode_greedy(weights: DecoderWeights, embed: torch.Tensor,
                  head: cpu_linear.PackedQ8Linear | cpu_linear.PackedLinear, token_ids: torch.Tensor,
                  start_positions: torch.Tensor, block_tables: torch.Tensor, steps: int) -> torch.Tensor:
    """``steps`` greedy decode steps of a batch in one C call (``csrc/decode_steps_cpu.c``): per step the
    tokens' embeddings, :func:`forward`, the head's float32 logits and each row's first maximum (the sampler's
    ``argmax_rows``), fed back as the next step's input; the same kernels on the same inputs as one step at a
    time, so the same tokens.

    Args:
        embed: [vocab, hidden] bfloat16 token embeddings, contiguous.
        head: the output head's 8-bit copy or bfloat16 panels (what the model's head method reads for
            ``len(token_ids)`` rows).
        token_ids: [rows] int64, each sequence's next input token.
        start_positions: [rows] int64, that token's position (the sequence's computed tokens).
        block_tables: [rows, max_blocks] int32, each long enough for ``start + steps - 1``.

    Returns:
        [steps, rows] int64: the token each step chose per row.

    Raises:
        ValueError: a position outside the RoPE tables, shapes the kernels refuse, a token outside the
            vocabulary.
        MemoryError: the scratch could not be allocated.
    """
    rows = token_ids.shape[0]
    vocab = embed.shape[0]
    if embed.dtype != torch.bfloat16 or not embed.is_contiguous() or embed.shape[1] != weights.hidden \
            or head.in_features != weights.hidden or head.out_features != vocab:
        raise ValueError(f"decode_greedy takes contiguous bfloat16 embeddings [vocab, {weights.hidden}] and a "
                         "head of the same shape")
    tokens = torch.empty((steps + 1, rows), dtype=torch.int64)
    tokens[0] = token_ids
    starts = start_positions.to(torch.int64).contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    q8 = isinstance(head, cpu_linear.PackedQ8Linear)
    rc = load_library().decode_greedy_bf16(
        ctypes.byref(weights.shape), ctypes.byref(weights._arrays), weights.final_norm.data_ptr(), embed.data_ptr(),
        head.codes.data_ptr() if q8 else None, head.scales.data_ptr() if q8 else None, head.group if q8 else 0,
        None if q8 else head.data.data_ptr(), vocab, tokens.data_ptr(), rows, steps, starts.data_ptr(),
        weights.cos.data_ptr(), weights.sin.data_ptr(), tables.data_ptr(), tables.shape[1], torch.get_num_threads())
    if rc == 2:
        raise MemoryError("the decoder's scratch could not be allocated")
    if rc == 3:
        raise ValueError(f"a token id outside the vocabulary of {vocab}")
    if rc:
        raise ValueError(f"a position is outside the RoPE tables ({weights.cos.shape[0]} positions) or the kernels "
                         "do not take these shapes")
    return tokens[1:]


def rope_cache(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
               num_kv_heads: int, head_dim: int, slot_mapping: torch.Tensor, key_cache: torch.Tensor,
               value_cache: torch.Tensor) -> None:
    """RoPE (Su et al. 2021, HF's rotate-half layout) on the q and k heads of
    the fused projection, in place, in float32 with one rounding; then the
    rotated keys and the values are written to the caches at their slots.

    Args:
        qkv: [num_tokens, (num_heads + 2 num_kv_heads) * head_dim] bfloat16,
            rows contiguous (a row stride is allowed).
        positions, slot_mapping: [num_tokens] int64 (slot -1: not written).
        cos, sin: [max_positions, head_dim] float32, contiguous.
        key_cache, value_cache: [num_blocks, block_size, num_kv_heads,
            head_dim] bfloat16, contiguous.

    Raises:
        ValueError: other dtypes or layouts, or a position outside the tables.
    """
    width = (num_heads + 2 * num_kv_heads) * head_dim
    if qkv.dtype != torch.bfloat16 or qkv.dim() != 2 or qkv.shape[1] != width or qkv.stride(1) != 1:
        raise ValueError(f"rope_cache takes bfloat16 [num_tokens, {width}] with contiguous rows, got {qkv.dtype} "
                         f"{tuple(qkv.shape)}")
    for cache in (key_cache, value_cache):
        if cache.dtype != torch.bfloat16 or not cache.is_contiguous():
            raise ValueError("rope_cache writes contiguous bfloat16 caches")
    positions, slot_mapping = positions.contiguous(), slot_mapping.contiguous()
    rc = load_library().rope_cache_bf16(qkv.data_ptr(), qkv.stride(0), qkv.shape[0], positions.data_ptr(),
                                        cos.data_ptr(), sin.data_ptr(), cos.shape[0], num_heads, num_kv_heads,
                                        head_dim, slot_mapping.data_ptr(), key_cache.data_ptr(),
                                        value_cache.data_ptr(), torch.get_num_threads())
    if rc:
        raise ValueError(f"a position is outside the RoPE tables ({cos.shape[0]} positions)")
