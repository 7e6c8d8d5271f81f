"""The C decoder stack's view of a model (``kernels/cpu_decoder.py``): which
weights, copies and caches the one-call decoder reads, or why it cannot run.

Split from ``engine/models/llama.py``: the model decides when the view is
built (once per set of caches, again when its kernels are chosen); this
module builds it, and counts the bytes of weights a one-row step of it reads
(the decode roofline's, and what bounds several steps in one call).
"""

from __future__ import annotations

import torch

from engine.layers.linear import PROJECTIONS
from kernels import cpu_decoder, cpu_linear


def c_stack_weights(model, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> cpu_decoder.DecoderWeights | None:
    """The C decoder stack's view (``kernels.cpu_decoder.DecoderWeights``) of
    ``model``'s weights (a ``LlamaForCausalLM`` whose kernels are chosen, RoPE
    tables built) and ``kv_caches`` (per layer: key and value caches), built
    now; None where the stack cannot run: not bfloat16 on CPU with C RoPE, a
    projection on no C linear kernel (bfloat16 panels, 4-bit, FP8, int8), a
    bias outside q/k/v, a Triton kernel chosen, shapes the kernels refuse.
    ``LlamaForCausalLM._c_decoder_weights`` says when it is built."""
    embed = model.embed_tokens.weight
    if not model.layers[0].c_rope or embed.dtype != torch.bfloat16 or model.config.hidden_size % 16 \
            or model.norm.triton_rms_norm is not None or model.norm.weight.dtype != torch.bfloat16:
        return None
    layers = []
    for layer, (kc, vc) in zip(model.layers, kv_caches):
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        bf16, q4, fp8, int8 = {}, {}, {}, {}
        for short, name in zip(cpu_decoder.PROJECTIONS, PROJECTIONS):
            if name in layer.int4:
                packed = layer.int4[name].c_packed
                if packed is None:  # a W8A8 layer on its PyTorch path
                    return None
                kind = fp8 if isinstance(packed, cpu_linear.PackedFP8Linear) else int8 if isinstance(
                    packed, (cpu_linear.PackedQ8Linear, cpu_linear.PackedW8A8Linear)) else q4
                kind[short] = packed
            else:
                packed = layer.packed.get(name, getattr(layer, name).weight)
                bf16[short] = packed if isinstance(packed, cpu_linear.PackedLinear) else None
                q4[short] = layer.fresh_q4_copy(name)
            if all(d.get(short) is None for d in (bf16, q4, fp8, int8)):
                return None
            if name != "qkv_proj" and getattr(layer, name).bias is not None:
                return None
        if layer.packed.triton_linear is not None or any(
                n.weight.dtype != torch.bfloat16 or n.triton_rms_norm is not None for n in norms):
            return None
        layers.append(cpu_decoder.LayerWeights(
            norms[0].weight.detach(), norms[1].weight.detach(), bf16, q4,
            layer.qkv_proj.bias.detach() if layer.qkv_proj.bias is not None else None, kc, vc, fp8, int8))
    c = model.config
    try:
        return cpu_decoder.DecoderWeights(
            layers, model.norm.weight.detach(), model.rope_cos, model.rope_sin, c.num_attention_heads,
            c.num_key_value_heads, c.head_dim, c.intermediate_size, c.rms_norm_eps, model.layers[0].scale)
    except ValueError:
        return None


def _projection_bytes(layer: cpu_decoder.LayerWeights, name: str) -> int:
    """Bytes of the form ``decoder_cpu.c``'s ``project`` reads for a one-row call: int8, FP8, the 4-bit copy,
    else the bfloat16 panels."""
    for form in (layer.int8.get(name), layer.fp8.get(name), layer.q4.get(name), layer.bf16.get(name)):
        if form is not None:
            return form.nbytes
    return 0


def decode_weight_bytes(model, kv_caches) -> int | None:
    """Bytes of weights one single-row decode step of ``model`` (a ``LlamaForCausalLM`` on the C decoder stack)
    reads: each layer's projections in the form a one-row call reads, its norms and q/k/v bias, the final norm,
    the output head (its 8-bit copy where a one-row call reads it, else its bfloat16 panels) and one embedding
    row. The KV cache (context-dependent) is not counted. None where the model does not run on the C stack."""
    stack = model._c_decoder_weights(kv_caches)
    if stack is None:
        return None
    total = stack.final_norm.nbytes
    for layer in stack.layers:
        total += layer.input_norm.nbytes + layer.post_norm.nbytes
        total += 0 if layer.qkv_bias is None else layer.qkv_bias.nbytes
        total += sum(_projection_bytes(layer, name) for name in cpu_decoder.PROJECTIONS)
    embed = model.embed_tokens.weight
    head = model._c_head(1) if model._c_head is not None else \
        model.packed.get("lm_head", embed if model.lm_head is None else model.lm_head.weight)
    return total + head.nbytes + embed.shape[1] * embed.element_size()
