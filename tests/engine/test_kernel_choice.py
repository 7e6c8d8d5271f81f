"""Kernels are chosen once, when the weights are where they will run
(construction, ``.to()``/``.to_empty()``, load, batch-invariant mode), not on
every call: a forward pass asks nothing about the C library, and moving the
model re-chooses."""

from __future__ import annotations

import pytest
import torch

from engine.layers.activation import silu_and_mul
from engine.layers.attention import AttentionMetadata
from engine.layers.norm import RMSNorm
from engine.model_config import ModelConfig
from engine.models.llama import LlamaForCausalLM
from kernels import cpu_norm_act, get_attention_backend

needs_c = pytest.mark.skipif(not cpu_norm_act.available(), reason="the C kernels do not build here")


def test_a_norm_binds_its_kernel_when_its_weight_moves():
    norm = RMSNorm(64, 1e-6)
    assert norm._kernel == norm._torch
    norm = norm.bfloat16()
    assert norm._kernel == (norm._c if cpu_norm_act.available() else norm._torch)
    calls = []
    norm.use_triton(lambda x, w, eps: calls.append(x) or x)
    x = torch.randn(3, 64).bfloat16()
    assert norm(x) is x and calls == [x]
    norm.use_triton(None)
    assert norm.float()._kernel == norm._torch


@needs_c
def test_forward_asks_nothing_per_call_and_moving_the_model_rechooses(monkeypatch):
    config = ModelConfig(architecture="LlamaForCausalLM", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=50,
                         max_position_embeddings=64)
    backend = get_attention_backend("cpu", "cpu", dtype=torch.bfloat16, heads=(4, 2, 16))
    with torch.device("meta"):
        model = LlamaForCausalLM(config, backend)
    model = model.to_empty(device="cpu")
    torch.nn.init.normal_(model.embed_tokens.weight, std=0.1)
    model = model.to(torch.bfloat16).eval()
    layer = model.layers[0]
    assert layer.c_rope and layer.act is cpu_norm_act.silu_mul and not model._gather_rope
    model.use_c_decoder = False  # the per-operation path: each layer's own kernels

    def asked(*args, **kwargs):
        raise AssertionError("a kernel was chosen during forward")

    monkeypatch.setattr(cpu_norm_act, "available", asked)
    caches = [(torch.zeros(4, 16, 2, 16, dtype=torch.bfloat16), torch.zeros(4, 16, 2, 16, dtype=torch.bfloat16))
              for _ in range(2)]
    md = AttentionMetadata(torch.arange(5), torch.tensor([0, 5], dtype=torch.int32),
                           torch.tensor([5], dtype=torch.int32), torch.tensor([[1]], dtype=torch.int32))
    with torch.inference_mode():
        hidden = model(torch.arange(5), torch.arange(5), md, caches)
        assert model.compute_logits(hidden).shape == (5, 50)
    monkeypatch.undo()
    model = model.float()
    assert not layer.c_rope and layer.act is silu_and_mul and model._gather_rope
    assert model.norm._kernel == model.norm._torch
