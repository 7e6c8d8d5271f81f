"""Gemma 2 (Gemma Team 2024) and Gemma 3 text (Gemma Team 2025): the Llama
decoder with (1 + weight) RMSNorms, norms after attention and around the
MLP, embeddings scaled by sqrt(hidden_size), and from their configs GeGLU
(``gelu_pytorch_tanh``), the softmax scale ``query_pre_attn_scalar ** -0.5``
and alternating sliding-window/global layers. Gemma 2 caps attention scores
and logits (``attn_/final_logit_softcapping``); Gemma 3 adds q/k norms and
gives its sliding-window layers their own RoPE base (``rope_local_theta``).
HF ``modeling_gemma2.py`` / ``modeling_gemma3.py``."""

from __future__ import annotations

from engine.models.llama import LlamaForCausalLM
from engine.models.spec import ModelSpec


class Gemma2ForCausalLM(LlamaForCausalLM):
    spec = ModelSpec(gemma_norms=True, sandwich_norms=True, embed_scale=True)


class Gemma3ForCausalLM(LlamaForCausalLM):
    spec = ModelSpec(qk_norm=True, gemma_norms=True, sandwich_norms=True, embed_scale=True)
