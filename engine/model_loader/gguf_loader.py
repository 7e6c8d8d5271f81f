"""Read a GGUF file (llama.cpp's format): model shape, dequantized weights, tokenizer.

Spec: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md. Tensors are
dequantized with the ``gguf`` package (Q4_0, Q4_1, Q8_0, F16, F32 and the
other types it supports) and renamed to transformers' names.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from engine.model_config import ModelConfig
from engine.layers.quant_linear import INT4_TYPES, GGUFBlocks
from engine.models.registry import GGUF_ARCHITECTURES, GGUFArchitecture

_SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# GGUF layer tensor -> HF module, for every architecture but where its registry entry says otherwise
# (``GGUFArchitecture.tensors``: Gemma's four norms, Phi-3's fused projections)
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",  # qwen3
    "attn_k_norm": "self_attn.k_norm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# llama.cpp's Gemma "27B" model types scale queries by (hidden / heads) ** -0.5, every other Gemma by head_dim's
# (llama-model.cpp, f_attention_scale; HF: query_pre_attn_scalar): (architecture, block count) of those
_GEMMA_27B = {("gemma2", 46), ("gemma3", 62)}


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_model_config(reader, path: str) -> ModelConfig:
    """ModelConfig from GGUF metadata (``{arch}.embedding_length``, ...).

    Raises:
        ValueError: unsupported ``general.architecture`` or missing keys.
    """
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"{path}: unsupported architecture {arch!r} (supported: {sorted(GGUF_ARCHITECTURES)})")
    entry = GGUF_ARCHITECTURES[arch]

    def req(key):
        v = _field(reader, f"{arch}.{key}")
        if v is None:
            raise ValueError(f"{path}: metadata key {arch}.{key} is missing")
        return v

    names = {t.name for t in reader.tensors}
    if names & {"rope_factors_long.weight", "rope_factors_short.weight"}:
        raise ValueError(f"{path}: longrope scaling (rope_factors_long/short) is not supported")
    heads = int(req("attention.head_count"))
    hidden = int(req("embedding_length"))
    layers = int(req("block_count"))
    kv = _field(reader, f"{arch}.attention.head_count_kv", heads)
    if isinstance(kv, list):
        raise ValueError(f"{path}: per-layer head_count_kv is not supported")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = _field(reader, f"{arch}.vocab_size") or (len(tokens.data) if tokens is not None else None)
    if vocab is None:
        raise ValueError(f"{path}: neither {arch}.vocab_size nor tokenizer.ggml.tokens is present")
    rope_scaling = None
    kind = _field(reader, f"{arch}.rope.scaling.type")
    if kind == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(req("rope.scaling.factor"))}
    elif kind not in (None, "none"):
        raise ValueError(f"{path}: unsupported rope scaling {kind!r}")
    head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // heads))
    window, layer_types = _sliding_layers(reader, arch, entry, layers)
    rope_dim = _field(reader, f"{arch}.rope.dimension_count")
    local_theta = _field(reader, f"{arch}.rope.freq_base_swa", 10000.0 if arch == "gemma3" else None)
    return ModelConfig(
        architecture=entry.hf,
        hidden_size=hidden,
        intermediate_size=int(req("feed_forward_length")),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=int(kv),
        head_dim=head_dim,
        vocab_size=int(vocab),
        max_position_embeddings=int(_field(reader, f"{arch}.context_length", 2048)),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        rms_norm_eps=float(req("attention.layer_norm_rms_epsilon")),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names or "blk.0.attn_qkv.bias" in names,
        hidden_act=entry.hidden_act,
        sliding_window=window,
        layer_types=layer_types,
        attn_logit_softcapping=_field(reader, f"{arch}.attn_logit_softcapping"),
        final_logit_softcapping=_field(reader, f"{arch}.final_logit_softcapping"),
        query_pre_attn_scalar=hidden / heads if (arch, layers) in _GEMMA_27B else None,
        rope_local_theta=None if local_theta is None else float(local_theta),
        partial_rotary_factor=1.0 if rope_dim is None else int(rope_dim) / head_dim,
        name=str(_field(reader, "general.name", "") or ""),
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
    )


def _sliding_layers(reader, arch: str, entry: GGUFArchitecture, layers: int) -> tuple[int | None, list[str] | None]:
    """(sliding window, per-layer attention types or None) from ``{arch}.attention.sliding_window`` and
    ``.sliding_window_pattern`` (a period, or one bool per layer: true = sliding), else the registry's
    period (llama.cpp's default for the architecture); None, None without a window."""
    window = _field(reader, f"{arch}.attention.sliding_window")
    if not window:
        return None, None
    pattern = _field(reader, f"{arch}.attention.sliding_window_pattern", entry.full_every)
    if isinstance(pattern, list):
        return int(window), ["sliding_attention" if p else "full_attention" for p in pattern]
    if not pattern:
        return int(window), None
    return int(window), ["full_attention" if (i + 1) % int(pattern) == 0 else "sliding_attention"
                         for i in range(layers)]


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's ``convert_hf_to_gguf.py`` ``permute`` of attn_q/attn_k rows.

    llama.cpp stores each head's rows with the two rotary halves interleaved
    (GPT-J order); HF keeps them as [first half; second half] (rotate-half
    order). Works for weights [rows, cols] and biases [rows].
    """
    shape = w.shape
    return w.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


class GGUFTensor:
    """One tensor of a GGUF file as the engine reads it, still on disk (the reader's memory map): renamed
    rows un-permuted, norms less their offset, dequantized to float32, or kept in its quantized blocks.

    Args:
        tensor: the ``gguf.ReaderTensor``.
        blocks: keep it in its quantized blocks (``GGUFBlocks``) instead of dequantizing.
        heads: un-permute llama.cpp's interleaved RoPE rows of this many heads (None: not permuted).
        norm_offset: subtracted from every value (Gemma's norms).
    """

    def __init__(self, tensor, blocks: bool = False, heads: int | None = None, norm_offset: float = 0.0) -> None:
        self.tensor = tensor
        self.shape = tuple(int(x) for x in reversed(tensor.shape))
        self.blocks = blocks
        self.heads = heads
        self.norm_offset = norm_offset

    def read(self) -> torch.Tensor | GGUFBlocks:
        """The whole tensor: float32 [rows, cols] (or [n]), or its blocks."""
        return self.narrow(0, 0, self.shape[0])

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor | GGUFBlocks:
        """Rows (``dim`` 0) or columns (1) ``[start, start + length)``, reading only those from the file; a
        column range that splits quantization blocks reads whole rows (dequantized, then cut).
        Un-permuted rows must be whole heads."""
        import gguf

        t, qtype = self.tensor, self.tensor.tensor_type
        raw = np.asarray(t.data)
        if len(self.shape) == 2:
            raw = raw.reshape(self.shape[0], -1)
        shape = list(self.shape)
        if dim == 0:
            raw = raw[start:start + length]
            shape[0] = length
        else:
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            if start % block or length % block:
                return self.narrow(0, 0, self.shape[0])[:, start:start + length].contiguous()
            raw = raw.reshape(self.shape[0], -1, size)[:, start // block:(start + length) // block]
            raw = raw.reshape(self.shape[0], -1)
            shape[1] = length
        heads = None if self.heads is None else self.heads * shape[0] // self.shape[0]
        if self.blocks:
            data = np.ascontiguousarray(raw)
            return GGUFBlocks(qtype.name, tuple(shape), data if heads is None else unpermute_qk(data, heads))
        try:
            arr = gguf.quants.dequantize(raw, qtype).reshape(shape)
        except Exception as e:
            raise ValueError(f"cannot read tensor {t.name} ({type(e).__name__}: {e})") from None
        if heads is not None:
            arr = unpermute_qk(arr, heads)
        if self.norm_offset:
            arr = np.asarray(arr, dtype=np.float32) - np.float32(self.norm_offset)
        return torch.from_numpy(np.array(arr, dtype=np.float32, copy=not arr.flags.writeable, order="C"))


def gguf_weights(reader, config: ModelConfig, path: str, keep_int4: bool = False,
                 lazy: bool = False) -> Iterator[tuple[str, torch.Tensor | GGUFBlocks | GGUFTensor]]:
    """Yield (HF name, float32 tensor) for every tensor, dequantized, renamed
    through the architecture's registry entry (``GGUFArchitecture``), with
    attn_q/attn_k un-permuted where llama.cpp permuted them (llama) and
    norms less the offset llama.cpp added (Gemma's ``1 + weight``). ``rope_freqs`` (Llama
    3 frequency factors) is put into ``config.extra`` instead.

    With ``keep_int4``, the Q4_0/Q4_1 weights of the layers' linear
    projections come as ``GGUFBlocks`` (still quantized, rows un-permuted)
    instead of float32 tensors (``quantization: gguf``, or the 4-bit copies
    of ``none``), and so does a Q8_0 output head or embedding. With ``lazy``
    each comes as a ``GGUFTensor`` not read yet (a tensor-parallel rank reads
    its part: ``narrow``).

    Raises:
        ValueError: an unsupported quantization type or an unknown tensor name.
    """
    entry = next(e for e in GGUF_ARCHITECTURES.values() if e.hf == config.architecture)
    layer_names = {**LAYER_NAMES, **dict(entry.tensors)}
    for t in reader.tensors:
        qtype = t.tensor_type.name
        if qtype not in _SUPPORTED_TYPES:
            raise ValueError(f"{path}: tensor {t.name} has unsupported type {qtype}")
        base, _, kind = t.name.rpartition(".")
        parts = base.split(".")
        if base == "rope_freqs":
            config.extra["rope_freq_factors"] = GGUFTensor(t).read()
            continue
        if base in _TOP_NAMES:
            name = f"{_TOP_NAMES[base]}.{kind}"
            blocks = keep_int4 and qtype == "Q8_0" and kind == "weight" and base in ("token_embd", "output")
        elif len(parts) == 3 and parts[0] == "blk" and parts[2] in layer_names:
            name = f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{kind}"
            blocks = keep_int4 and qtype in INT4_TYPES and kind == "weight" and "norm" not in parts[2]
        else:
            raise ValueError(f"{path}: unexpected tensor {t.name}")
        heads = None
        if entry.permuted_qk and len(parts) == 3 and parts[2] in ("attn_q", "attn_k"):
            heads = config.num_attention_heads if parts[2] == "attn_q" else config.num_key_value_heads
        offset = entry.norm_offset if base.endswith("norm") else 0.0
        tensor = GGUFTensor(t, blocks, heads, offset)
        yield name, tensor if lazy else tensor.read()
