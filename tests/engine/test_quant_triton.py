"""Packed checkpoint weights on the CUDA path (engine/layers/triton_packed_linear.py), run here by Triton's
interpreter on CPU: a 4-bit (compressed-tensors W4A16, asymmetric, with q/k/v biases) or FP8 checkpoint kept
packed and multiplied by the Triton GEMM that dequantizes in its tiles gives the same tokens and the same
logprob bits as the engine on the weights dequantized at load (the dense batch-invariant Triton GEMM), alone
and batched. On CPU the engine picks this path only on CUDA devices, so the tests let the CPU count as one."""

from __future__ import annotations

import pytest
import torch

from engine.layers import linear
from engine.layers.triton_packed_linear import TritonPackedLinear, triton_packable
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.engine.test_quantization import _quantized

PROMPTS = [[5, 17, 33, 8, 91, 4, 60, 22, 71, 13, 40, 3, 77, 9, 50, 66, 31, 12, 88], [44, 19, 7]]
NEW_TOKENS = 4


@pytest.fixture(autouse=True)
def _interpreter():
    from kernels.triton_jit import interpreter_active

    if not torch.cuda.is_available() and not interpreter_active():
        pytest.skip("triton was imported before TRITON_INTERPRET=1 (tests/conftest.py sets it first)")


def _generate(path: str, packed_on_cpu: bool, monkeypatch) -> tuple[LLM, list]:
    if packed_on_cpu:
        monkeypatch.setattr(linear, "triton_packable", lambda parts, device: triton_packable(parts, torch.device("cuda")))
    else:  # the reference: every quantized layer dequantized at load (a CPU keeps 4-bit ones for PyTorch's int4 mm)
        monkeypatch.setattr(linear, "int4_packable", lambda parts: False)
    llm = LLM(model=path, dtype="float32", device="cpu", attention_backend="triton", block_size=16,
              kv_cache_memory="4MiB")
    monkeypatch.undo()
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    batched = llm.generate(PROMPTS, params)
    alone = llm.generate(PROMPTS[1:2], params)
    return llm, [batched, alone]


def _bits(outputs) -> list:
    return [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outputs]


# the int8 layout is pinned at the kernel level (tests/test_triton_quant_linear.py); the interpreter is slow
@pytest.mark.parametrize("case", ["ct_w4a16_asym_qwen2", "ct_fp8_channel_llama"])
def test_packed_triton_path_gives_the_dequantized_engines_bits(tmp_path, monkeypatch, case):
    _quantized(tmp_path, case)
    llm, (batched, alone) = _generate(str(tmp_path), True, monkeypatch)
    layer = llm.engine.model_runner.model.layers[0]
    assert sorted(layer.int4) == ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"]
    assert all(isinstance(m, TritonPackedLinear) for m in layer.int4.values())
    assert layer.qkv_proj.weight.numel() == 0  # the dense weight was not kept
    dense, (dense_batched, dense_alone) = _generate(str(tmp_path), False, monkeypatch)
    assert not dense.engine.model_runner.model.layers[0].int4
    assert _bits(batched) == _bits(dense_batched)
    assert _bits(alone) == _bits(dense_alone) == _bits(batched)[1:2]


def test_only_cuda_devices_and_supported_layouts_take_the_packed_triton_path():
    from engine.quantization.int4 import Int4Weight
    from engine.quantization.int8 import Int8Weight

    w4 = Int4Weight(torch.zeros(64, 64, dtype=torch.uint8), torch.full((64, 2), 8), torch.ones(64, 2), 32)
    w8a8 = Int8Weight(torch.zeros(64, 64, dtype=torch.int8), torch.ones(64, 1), 64, activations="token")
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert triton_packable([w4, w4], cuda) and not triton_packable([w4], cpu)
    assert not triton_packable([w8a8], cuda)  # W8A8 quantizes its activations: its own path
    act_order = Int4Weight(w4.codes, w4.zeros, w4.scales, 32, perm=torch.arange(64).flip(0))
    assert not triton_packable([act_order], cuda)
    other_group = Int4Weight(w4.codes, torch.full((64, 1), 8), torch.ones(64, 1), 64)
    assert not triton_packable([w4, other_group], cuda)
