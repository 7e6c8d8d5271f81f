"""Quantized HF checkpoints (engine/quantization): GPTQ and AWQ tiny random Llama and Qwen2 models
packed by tests/quant_checkpoints.py (the formats' documented layouts; see there why not their own
tools), detected from config.json and kept in 4 bits, against transformers running the formats'
dequantized weights: float32 greedy token-identical on 8 prompts x 64 tokens with logprobs within
1e-4, alone and batched; in bfloat16 the C decoder stack reads the packed layers and a prompt's
tokens and logprobs are the same bits alone and batched. Refusals name the field."""

from __future__ import annotations

import json

import pytest
import torch

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.engine.test_architectures import COMMON, VOCAB, _check, _engine_and_references, _prompts
from tests.quant_checkpoints import (write_awq, write_compressed_tensors, write_fp8, write_gptq, write_w8a8,
                                     write_w8a16)

transformers = pytest.importorskip("transformers")


def _model(tmp_path, arch: str):
    """A tiny random float32 transformers model of ``arch`` ("llama", "llama128" / "llama192": intermediate size
    128 / 192 for groups of 64, or "qwen2", q/k/v biases) saved with a word-level tokenizer in
    ``tmp_path``; norms perturbed so that they matter."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(0)
    t = transformers
    if arch == "qwen2":
        model = t.Qwen2ForCausalLM(t.Qwen2Config(**COMMON))
    else:
        model = t.LlamaForCausalLM(t.LlamaConfig(**{**COMMON, "intermediate_size": {"llama128": 128, "llama192": 192}.get(
            arch, 96)}))
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.2)
    model = model.float().eval()
    model.save_pretrained(tmp_path)
    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    return model


CASES = {
    "gptq_sym_llama": ("llama", lambda p, m: write_gptq(p, m, 32, sym=True)),
    "gptq_asym_v2_qwen2": ("qwen2", lambda p, m: write_gptq(p, m, 32, sym=False, checkpoint_format="gptq_v2")),
    "gptq_asym_llama": ("llama", lambda p, m: write_gptq(p, m, 32, sym=False)),
    "gptq_asym_group64_llama": ("llama128", lambda p, m: write_gptq(p, m, 64, sym=False)),
    "awq_group64_llama": ("llama128", lambda p, m: write_awq(p, m, 64)),
    "gptq_desc_act_qwen2": ("qwen2", lambda p, m: write_gptq(p, m, 32, sym=False, desc_act=True)),
    "gptq_desc_act_group64_llama": ("llama128", lambda p, m: write_gptq(p, m, 64, sym=True, desc_act=True)),
    "gptq_desc_act_own_orders_llama": ("llama", lambda p, m: write_gptq(p, m, 32, sym=False, desc_act=True,
                                                                       shared_order=False)),
    "awq_llama": ("llama", lambda p, m: write_awq(p, m, 32)),
    "awq_qwen2": ("qwen2", lambda p, m: write_awq(p, m, 32)),
    "ct_w4a16_sym_llama": ("llama", lambda p, m: write_compressed_tensors(p, m, 32, sym=True)),
    "ct_w4a16_asym_qwen2": ("qwen2", lambda p, m: write_compressed_tensors(p, m, 32, sym=False)),
    "ct_w4a16_channel_llama": ("llama", lambda p, m: write_compressed_tensors(p, m, None, sym=False)),
    "ct_fp8_channel_llama": ("llama", lambda p, m: write_fp8(p, m, "channel")),
    "ct_fp8_dynamic_tensor_qwen2": ("qwen2", lambda p, m: write_fp8(p, m, "tensor", dynamic_activations=True)),
    "ct_w8a16_group_llama": ("llama", lambda p, m: write_w8a16(p, m, 32)),
    "ct_w8a16_channel_qwen2": ("qwen2", lambda p, m: write_w8a16(p, m, None)),
    "ct_w8a8_channel_llama": ("llama", lambda p, m: write_w8a8(p, m, "channel")),
    "ct_w8a8_tensor_qwen2": ("qwen2", lambda p, m: write_w8a8(p, m, "tensor")),
}


def _quantized(tmp_path, case: str):
    tmp_path.mkdir(exist_ok=True)
    arch, write = CASES[case]
    model = _model(tmp_path, arch)
    write(tmp_path, model)
    return model


@pytest.mark.parametrize("case", sorted(CASES))
def test_float32_matches_dequantized_reference_alone_and_batched(tmp_path, case, one_thread):
    hf = _quantized(tmp_path, case)
    llm, prompts, refs, params = _engine_and_references(tmp_path, hf, case)
    layer = llm.engine.model_runner.model.layers[0]
    # kept in 4 bits (act-order too: the inputs sorted by group), but for FP8 and W8A16 (dequantized at load:
    # exact in float32) and the fused projections whose parts have their own input orders (q/k/v, gate/up:
    # dequantized); W8A8 kept in 8 bits, its activations quantized per token in PyTorch
    assert sorted(layer.int4) == ([] if "fp8" in case or "w8a16" in case else ["down_proj", "o_proj"]
                                  if "own_orders" in case else ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"])
    if "desc_act" in case:
        assert all((lin.perm is not None) == (lin.in_features > lin.group) for lin in layer.int4.values())
    check = _check_w8a8 if "w8a8" in case else _check
    for prompt, ref in zip(prompts, refs):
        check(llm.generate([prompt], params)[0], ref)
    for out, ref in zip(llm.generate(prompts, params), refs):
        check(out, ref)


# W8A8 rounds each projection's input to 255 levels per token: where the engine's float32 hidden state
# and transformers' differ in their last bits (their sums' orders differ), an element on a rounding
# boundary takes the neighbouring code, a step of amax / 127, which moves that step's logprobs and,
# through the KV cache, the later ones' (up to 1.3e-2 seen here: a per-token flip chance of about 0.1 in
# these models) while the greedy tokens stay the same. So: the same tokens, logprobs within
# W8A8_LOGPROB_TOL. (The kernels' arithmetic is pinned bit for bit in tests/engine/test_int8_linear.py.)
W8A8_LOGPROB_TOL = 2e-2


def _check_w8a8(out, ref) -> None:
    tokens, logprobs = ref
    got = out.outputs[0].token_ids
    assert got == tokens
    for step, (tok, lp) in enumerate(zip(got, logprobs)):
        assert abs(out.outputs[0].logprobs[step][tok].logprob - lp) < W8A8_LOGPROB_TOL, step


def _bf16_run(path, prompts):
    """Greedy tokens and logprobs of prompt 3 alone and batched, in bfloat16 on CPU (the C kernels)."""
    llm = LLM(model=str(path), dtype="bfloat16", device="cpu", kv_cache_memory="16MiB",
              enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=32)
    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=0, ignore_eos=True)
    runs = [llm.generate([prompts[3]], params)[0].outputs[0], llm.generate(prompts, params)[3].outputs[0]]
    return llm.engine.model_runner.model, [(o.token_ids, [lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids)])
                                           for o in runs]


@pytest.mark.parametrize("case", ["gptq_sym_llama", "awq_llama", "awq_qwen2", "ct_w4a16_asym_qwen2",
                                  "gptq_desc_act_group64_llama", "ct_w4a16_channel_llama", "ct_fp8_channel_llama",
                                  "ct_fp8_dynamic_tensor_qwen2", "ct_w8a16_group_llama", "ct_w8a16_channel_qwen2",
                                  "ct_w8a8_channel_llama", "ct_w8a8_tensor_qwen2"])
def test_bfloat16_c_stack_reads_packed_layers_batch_invariant(tmp_path, case, one_thread):
    """bfloat16: every projection kept packed and read by the C decoder stack, a prompt's tokens and
    logprobs the same bits alone and batched; FP8, whose kernel computes with the reference
    dequantization's weights rounded to bfloat16 on every body, the same bits as the engine on the
    dequantized reference model in bfloat16 (packed vs dequantized; the 4-bit and int8 kernels run
    integer dots on the builds this test runs: tests/test_quant_int.py); held within 10 % of the
    checkpoint's packed bytes for the int8 formats."""
    from kernels import cpu_attention, cpu_linear, cpu_norm_act

    if not cpu_norm_act.available() or cpu_attention.available() is not None or not cpu_linear.q4_available():
        pytest.skip("the C kernels do not build here")
    hf = _quantized(tmp_path / "packed", case)
    prompts = _prompts(case)
    model, (alone, batched) = _bf16_run(tmp_path / "packed", prompts)
    assert all(len(layer.int4) == 4 and all(m.c_packed is not None for m in layer.int4.values())
               for layer in model.layers)
    assert model._c_decoder is not None
    assert batched == alone
    if "w8" in case:  # the projections' bytes held against their tensors' in the checkpoint, less W8A8's
        from safetensors.torch import load_file  # float32 scale and int32 code sum per channel (8 bytes a row:
        # 12 % of these 64-input rows, under 1 % from 1024 inputs)

        lins = [lin for layer in model.layers for lin in layer.int4.values()]
        held = sum(lin.nbytes for lin in lins) - (sum(8 * lin.out_features for lin in lins) if "w8a8" in case else 0)
        stored = sum(t.nbytes for n, t in load_file(str(tmp_path / "packed" / "model.safetensors")).items()
                     if n.rsplit(".", 1)[-1] in ("weight_packed", "weight_scale") or t.dtype == torch.int8)
        assert stored * 0.9 <= held <= 1.1 * stored, (held, stored)
    if "fp8" in case:
        hf.save_pretrained(tmp_path / "dense")
        (tmp_path / "dense" / "tokenizer.json").write_bytes((tmp_path / "packed" / "tokenizer.json").read_bytes())
        dense, (dense_alone, _) = _bf16_run(tmp_path / "dense", prompts)
        assert not dense.layers[0].int4
        assert dense_alone == alone


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_act_order_weight_is_the_group_dequantization_in_input_order(group_size):
    """grouped_int4 with a GPTQ act-order g_idx: the codes sorted by group (each group a run of
    group_size inputs), one (d, m) per group, and the dequantization back in the inputs' order equal
    to the checkpoint's (q[n, k] - z[g_idx[k], n]) * s[g_idx[k], n]."""
    from engine.quantization.int4 import act_order, grouped_int4

    gen = torch.Generator().manual_seed(group_size)
    groups = 256 // group_size
    codes = torch.randint(0, 16, (16, 256), generator=gen)
    zeros, scales = torch.randint(0, 16, (groups, 16), generator=gen), torch.rand(groups, 16, generator=gen).half()
    g_idx = torch.empty(256, dtype=torch.int64)
    g_idx[torch.randperm(256, generator=gen)] = torch.arange(256) // group_size
    reference = (codes - zeros[g_idx].t()).float() * scales.float()[g_idx].t()
    w = grouped_int4(codes, zeros, scales, g_idx, "test")
    assert w.group_size == group_size and torch.equal(g_idx[w.perm], torch.arange(256) // group_size)
    assert torch.equal(w.dequantize(), reference)
    q, d, m = w.codes_d_m()
    assert torch.equal(q[:, torch.argsort(w.perm)], codes.to(torch.int32))
    group = torch.arange(256) // group_size
    assert torch.equal((q * d[:, group] + m[:, group])[:, torch.argsort(w.perm)], reference)
    assert grouped_int4(codes, zeros, scales, torch.arange(256) // group_size, "test").perm is None
    uneven = torch.arange(256) // group_size
    uneven[group_size] = 0  # groups of other sizes: no order makes them runs, dequantized at load
    assert act_order(uneven, groups) is None
    assert torch.equal(grouped_int4(codes, zeros, scales, uneven, "test"),
                       (codes - zeros[uneven].t()).float() * scales.float()[uneven].t())


def test_packed_weights_split_as_dense_ones_at_group_boundaries():
    """Tensor parallel splits (``narrow``): a 4-bit weight's rows and its inputs at group boundaries,
    an FP8 weight's rows and inputs, an int8 weight's rows and inputs (per group or per channel), each
    the dense weight's same split; an input split inside a group, or of an act-order weight, refused."""
    from engine.quantization.fp8 import FP8Weight
    from engine.quantization.int4 import grouped_int4

    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (48, 256), generator=gen)
    zeros, scales = torch.randint(0, 16, (4, 48), generator=gen), torch.rand(4, 48, generator=gen).half()
    w = grouped_int4(codes, zeros, scales, None, "test")
    dense = w.dequantize()
    assert torch.equal(w.narrow(0, 16, 16).dequantize(), dense[16:32])
    assert torch.equal(w.narrow(1, 128, 128).dequantize(), dense[:, 128:])
    with pytest.raises(ValueError, match="group boundaries"):
        w.narrow(1, 96, 160)
    # one group a row (compressed-tensors W4A16 "channel", GPTQ group_size -1): any input split, as an int8
    # weight's (a trial's per-channel checkpoint was refused at every --tensor-parallel-size)
    channel = grouped_int4(codes, zeros[:1], scales[:1], None, "test")
    assert torch.equal(channel.narrow(1, 96, 128).dequantize(), channel.dequantize()[:, 96:224])
    assert channel.narrow(1, 96, 128).group_size == 128
    g_idx = torch.empty(256, dtype=torch.int64)
    g_idx[torch.randperm(256, generator=gen)] = torch.arange(256) // 64
    with pytest.raises(ValueError, match="with act-order .GPTQ desc_act. cannot be split by its inputs"):
        grouped_int4(codes, zeros, scales, g_idx, "test").narrow(1, 0, 128)
    f8 = FP8Weight((torch.randn(48, 256, generator=gen) * 10).to(torch.float8_e4m3fn), torch.rand(48, 1) + 0.1)
    assert torch.equal(f8.narrow(0, 8, 8).dequantize(), f8.dequantize()[8:16])
    assert torch.equal(f8.narrow(1, 32, 64).dequantize(), f8.dequantize()[:, 32:96])
    from engine.quantization.int8 import Int8Weight

    codes8 = torch.randint(-128, 128, (48, 256), generator=gen).to(torch.int8)
    for scales, group in ((torch.rand(48, 8, generator=gen), 32), (torch.rand(48, 1, generator=gen), 256)):
        w8 = Int8Weight(codes8, scales, group, "token" if group == 256 else None)
        assert torch.equal(w8.narrow(0, 8, 8).dequantize(), w8.dequantize()[8:16])
        assert torch.equal(w8.narrow(1, 64, 128).dequantize(), w8.dequantize()[:, 64:192])
        assert w8.narrow(1, 64, 128).activations == w8.activations
    with pytest.raises(ValueError, match="group boundaries"):
        Int8Weight(codes8, torch.rand(48, 8), 32).narrow(1, 16, 64)


def test_a_tensor_parallel_split_inside_a_group_names_the_layer():
    """The loader's refusal names the checkpoint tensor and the remedy (a trial read only "inputs [0, 16) of a
    4-bit weight in groups of 32 do not split at group boundaries", with no layer)."""
    from engine.distributed.shard_plan import Span
    from engine.layers.parallel_linear import RowParallelLinear
    from engine.models.weight_loading import _parts
    from engine.quantization.int4 import grouped_int4

    gen = torch.Generator().manual_seed(0)
    w = grouped_int4(torch.randint(0, 16, (8, 64), generator=gen), torch.randint(0, 16, (2, 8), generator=gen),
                     torch.rand(2, 8, generator=gen).half(), None, "test")
    name = "model.layers.1.mlp.down_proj.weight"
    fits = RowParallelLinear(64, 8, Span(32, 32))
    assert torch.equal(_parts(fits, "weight", None, w, fits.weight, name)[0][1].dequantize(), w.dequantize()[:, 32:])
    cut = RowParallelLinear(64, 8, Span(16, 16))   # a third rank's span, say: inside the first group of 32
    with pytest.raises(ValueError, match=rf"weight '{name}' cannot be split over the tensor-parallel ranks: inputs "
                                         r"\[16, 32\) of a 4-bit weight in groups of 32 do not split at group "
                                         r"boundaries \(another --tensor-parallel-size"):
        _parts(cut, "weight", None, w, cut.weight, name)


def _set_quantization_config(path, **changes) -> None:
    f = path / "config.json"
    cfg = json.loads(f.read_text())
    cfg["quantization_config"] = {**cfg["quantization_config"], **changes}
    f.write_text(json.dumps(cfg))


@pytest.mark.parametrize("changes, field", [
    ({"bits": 8}, "quantization_config.bits"),
    ({"quant_method": "bitsandbytes"}, "quantization_config.quant_method"),
    ({"quant_method": "fp8"}, "quantization_config.quant_method"),
    ({"lm_head": True}, "quantization_config.lm_head"),
    ({"checkpoint_format": "marlin"}, "quantization_config.checkpoint_format"),
    ({"dynamic": {"-:.*down_proj": {}}}, "quantization_config.dynamic"),
])
def test_unsupported_options_are_refused_naming_the_field(tmp_path, changes, field):
    from engine.quantization import UnsupportedQuantization, get_quantization_config

    _quantized(tmp_path, "gptq_sym_llama")
    _set_quantization_config(tmp_path, **changes)
    with pytest.raises(UnsupportedQuantization, match=field.replace(".", r"\.")):
        get_quantization_config(str(tmp_path))


def test_awq_options_refused_and_requested_method_must_match(tmp_path):
    from engine.quantization import UnsupportedQuantization, get_quantization_config

    _quantized(tmp_path, "awq_llama")
    assert get_quantization_config(str(tmp_path), "awq").name == "awq"
    with pytest.raises(UnsupportedQuantization, match="'gptq' was requested.*quant_method is 'awq'"):
        get_quantization_config(str(tmp_path), "gptq")
    for changes, field in [({"version": "gemv"}, "version"), ({"zero_point": False}, "zero_point"),
                           ({"modules_to_not_convert": ["mlp.down_proj"]}, "modules_to_not_convert")]:
        _set_quantization_config(tmp_path, **changes)
        with pytest.raises(UnsupportedQuantization, match=f"quantization_config.{field}"):
            get_quantization_config(str(tmp_path))
        _set_quantization_config(tmp_path, version="gemm", zero_point=True, modules_to_not_convert=None)


@pytest.mark.parametrize("path, value, field", [
    (("format",), "float-quantized", "config_groups.group_0.weights.num_bits"),
    (("format",), "int-quantized", "config_groups.group_0.input_activations"),
    (("format",), "naive-quantized", "quantization_config.format"),
    (("kv_cache_scheme",), {"num_bits": 8}, "quantization_config.kv_cache_scheme"),
    (("config_groups", "group_0", "weights", "num_bits"), 2, "config_groups.group_0.weights.num_bits"),
    (("config_groups", "group_0", "weights", "type"), "float", "config_groups.group_0.weights.type"),
    (("config_groups", "group_0", "weights", "strategy"), "tensor", "config_groups.group_0.weights.strategy"),
    (("config_groups", "group_0", "input_activations"), {"num_bits": 8, "type": "int", "dynamic": True},
     "config_groups.group_0.input_activations"),
])
def test_compressed_tensors_options_refused_naming_the_field(tmp_path, path, value, field):
    from engine.quantization import UnsupportedQuantization, get_quantization_config

    _quantized(tmp_path, "ct_w4a16_sym_llama")
    f = tmp_path / "config.json"
    cfg = json.loads(f.read_text())
    node = cfg["quantization_config"]
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    f.write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedQuantization, match=field.replace(".", r"\.")):
        get_quantization_config(str(tmp_path))


@pytest.mark.parametrize("case, node, changes, field", [
    ("ct_w8a8_channel_llama", "input_activations", {"symmetric": False}, "input_activations.symmetric"),
    ("ct_w8a8_channel_llama", "input_activations", {"dynamic": False, "strategy": "tensor"},
     "input_activations.strategy"),
    ("ct_w8a8_channel_llama", "weights", {"strategy": "group", "group_size": 32}, "weights.strategy"),
    ("ct_w8a8_channel_llama", "weights", {"symmetric": False}, "weights.symmetric"),
    ("ct_w8a16_group_llama", "weights", {"symmetric": False}, "weights.symmetric"),
    ("ct_w8a16_group_llama", "weights", {"actorder": "group"}, "weights.actorder"),
])
def test_int8_options_refused_naming_the_field(tmp_path, case, node, changes, field):
    """What vLLM's W8A8Int8 / WNA16 schemes take and the engine does not (asymmetric or static
    activations, asymmetric 8-bit weights, 8-bit act-order) is refused, naming the field."""
    from engine.quantization import UnsupportedQuantization, get_quantization_config

    _quantized(tmp_path, case)
    assert get_quantization_config(str(tmp_path)).name == "compressed-tensors"
    f = tmp_path / "config.json"
    cfg = json.loads(f.read_text())
    cfg["quantization_config"]["config_groups"]["group_0"][node].update(changes)
    f.write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedQuantization, match=rf"group_0\.{field.replace('.', chr(92) + '.')}"):
        get_quantization_config(str(tmp_path))


def test_fp8_static_activation_scales_refused(tmp_path):
    from engine.quantization import UnsupportedQuantization, get_quantization_config

    _quantized(tmp_path, "ct_fp8_dynamic_tensor_qwen2")
    assert get_quantization_config(str(tmp_path)).name == "compressed-tensors"
    f = tmp_path / "config.json"
    cfg = json.loads(f.read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["input_activations"].update(dynamic=False, strategy="tensor")
    f.write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedQuantization, match=r"group_0\.input_activations\.strategy"):
        get_quantization_config(str(tmp_path))


def test_requested_method_refused_for_a_full_precision_checkpoint(tmp_path):
    from engine.quantization import UnsupportedQuantization

    _model(tmp_path, "llama")
    with pytest.raises(UnsupportedQuantization, match="no quantization_config"):
        LLM(model=str(tmp_path), dtype="float32", device="cpu", kv_cache_memory="16MiB", quantization="gptq")


def test_quantization_choices_name_every_method():
    from engine.quantization_names import QUANTIZATION_CHOICES
    from engine.quantization import QUANTIZATION_METHODS

    assert QUANTIZATION_CHOICES == ("none", "gguf", *QUANTIZATION_METHODS)


def test_vllms_quantization_values_are_taken_or_refused_in_one_line():
    """A trial's ``--quantization fp8`` / ``gptq_marlin`` got argparse's usage and exit 2: vLLM's kernel names
    (``gptq_marlin``, ``awq_marlin``) are the method they read, vLLM's other methods a one-line refusal saying
    so, before anything loads (the engine's own CLI, as a vLLM user types it)."""
    import subprocess
    import sys

    from engine.config import EngineArgs

    assert EngineArgs(quantization="gptq_marlin").quantization == "gptq"
    assert EngineArgs(quantization="awq_marlin").quantization == "awq"
    with pytest.raises(ValueError, match="'bitsandbytes' is vLLM's and not implemented here"):
        EngineArgs(quantization="bitsandbytes")
    r = subprocess.run([sys.executable, "-m", "gateway.cli", "generate", "-q", "fp8", "--prompt", "hi"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "usage:" not in r.stderr and "'fp8' is vLLM's and not implemented here" in r.stderr


def test_settings_in_a_side_file_are_read(tmp_path):
    """Older AutoAWQ/auto-gptq repositories keep the settings in quant_config.json / quantize_config.json
    (AutoAWQ's own key names, no quant_method), as vLLM's get_quant_config reads them."""
    from engine.quantization import get_quantization_config
    from engine.quantization.awq import AWQConfig
    from engine.quantization.gptq import GPTQConfig

    _quantized(tmp_path, "awq_llama")
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "quant_config.json").write_text(json.dumps({"zero_point": True, "q_group_size": 32, "w_bit": 4,
                                                             "version": "GEMM"}))
    assert get_quantization_config(str(tmp_path)) == AWQConfig(32)
    (tmp_path / "quant_config.json").unlink()
    (tmp_path / "quantize_config.json").write_text(json.dumps({"bits": 4, "group_size": 128, "desc_act": False,
                                                                "sym": True}))
    assert get_quantization_config(str(tmp_path)) == GPTQConfig(128, False, 1)


def test_a_checkpoint_method_needs_a_directory(tmp_path):
    from engine.config import EngineArgs
    from engine.model_loader import load_model

    f = tmp_path / "model.gguf"
    f.write_bytes(b"")
    with pytest.raises(ValueError, match="quantization 'awq' needs a HF checkpoint directory"):
        load_model(EngineArgs(model=str(f), device="cpu", quantization="awq"))


@pytest.mark.parametrize("case, declared", [("ct_w4a16_sym_llama", 64), ("ct_w8a16_group_llama", 16),
                                            ("ct_w4a16_channel_llama", 32)])
def test_a_declared_group_size_the_layers_do_not_have_is_refused_naming_the_field(tmp_path, case, declared):
    """A config.json whose group_size (or channel strategy) contradicts the layers' weight_scale is refused at
    load, naming the field (it loaded and served before, from the tensors' shapes)."""
    _quantized(tmp_path, case)
    cfg = json.loads((tmp_path / "config.json").read_text())
    weights = cfg["quantization_config"]["config_groups"]["group_0"]["weights"]
    weights.update(strategy="group", group_size=declared)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"quantization_config\.config_groups\.group_0\.weights\.group_size = "
                                         rf"{declared} does not fit layer .*weight_scale has \d+ group"):
        LLM(model=str(tmp_path), dtype="float32", kv_cache_memory="4MiB")


def test_asymmetric_config_without_zero_points_names_the_field(tmp_path):
    _quantized(tmp_path, "ct_w4a16_sym_llama")
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["symmetric"] = False
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"weights\.symmetric = False, but layer .* has no weight_zero_point"):
        LLM(model=str(tmp_path), dtype="float32", kv_cache_memory="4MiB")


@pytest.mark.parametrize("layout", ["unpacked_int8", "unpacked_int32"])
def test_zero_points_not_packed_as_compressed_tensors_packs_them_are_refused(tmp_path, layout):
    """A trial's asymmetric W4A16 checkpoint with its zero points stored one a value ([out, groups], int8 or
    int32) instead of eight an int32 down the rows loaded without a word and answered wrong tokens on every
    prompt (the unpacking's slice to ``out`` rows hid the shape)."""
    from safetensors.torch import load_file, save_file

    _quantized(tmp_path, "ct_w4a16_asym_qwen2")
    tensors = load_file(tmp_path / "model.safetensors")
    for name in [n for n in tensors if n.endswith("weight_zero_point")]:
        packed = tensors[name]
        out = int(tensors[name.rpartition(".")[0] + ".weight_shape"][0])
        points = (packed.unsqueeze(-1) >> (torch.arange(8) * 4)) & 0xF          # [out/8, groups, 8]
        points = points.permute(0, 2, 1).reshape(-1, packed.shape[1])[:out] - 8  # [out, groups], signed
        tensors[name] = points.to(torch.int8 if layout == "unpacked_int8" else torch.int32)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"weight_zero_point is torch\.int(8|32) \(\d+, \d+\), expected int32"):
        LLM(model=str(tmp_path), dtype="float32", kv_cache_memory="4MiB")


@pytest.mark.parametrize("case, suffix, actorder", [("gptq_desc_act_qwen2", ".g_idx", None),
                                                    ("ct_w4a16_sym_llama", ".weight_g_idx", "group")])
def test_an_act_order_checkpoint_without_its_group_indices_is_refused(tmp_path, case, suffix, actorder):
    """A trial's act-order checkpoints (GPTQ ``desc_act``, compressed-tensors ``actorder: group``) with their
    ``g_idx`` tensors left out loaded as if the groups were in input order and answered wrong tokens on every
    prompt; only g_idx says which group each input is in, so a layer without it is refused, naming it."""
    from safetensors.torch import load_file, save_file

    _quantized(tmp_path, case)
    tensors = load_file(tmp_path / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if not k.endswith(suffix)}, tmp_path / "model.safetensors")
    if actorder is not None:
        cfg = json.loads((tmp_path / "config.json").read_text())
        cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["actorder"] = actorder
        (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=rf"(desc_act is true|actorder = 'group'), but .* has no .*{suffix}"):
        LLM(model=str(tmp_path), dtype="float32", kv_cache_memory="4MiB")


def test_a_per_channel_4bit_checkpoint_serves_over_two_ranks(tmp_path):
    """compressed-tensors W4A16 ``strategy: channel`` (one scale a row) over 2 tensor-parallel ranks: a trial's
    was refused at every size ("do not split at group boundaries" of a group that is the whole row); it now
    splits as a per-channel int8 weight does, and greedy float32 tokens equal one rank's."""
    _quantized(tmp_path, "ct_w4a16_channel_llama")
    prompts = [[5, 17, 33, 60, 2 + i, 71, 9] for i in range(2)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    one = LLM(model=str(tmp_path), dtype="float32", kv_cache_memory="4MiB")
    want = [o.outputs[0].token_ids for o in one.generate(prompts, params)]
    two = LLM(model=str(tmp_path), dtype="float32", kv_cache_memory="4MiB", tensor_parallel_size=2)
    try:
        assert [o.outputs[0].token_ids for o in two.generate(prompts, params)] == want
    finally:
        two.shutdown()


def test_a_rank_that_cannot_load_its_part_is_the_engines_one_error(tmp_path):
    """A trial's GPTQ checkpoint in groups of 64 over 4 ranks: ranks 2 and 3 refused their shard of the MLP's 192
    inputs, and the engine's error was gloo's "Connection closed by peer" (the reason logged in the middle by the
    ranks). The driver fails on the first failing rank's own reason."""
    tmp_path.mkdir(exist_ok=True)
    write_gptq(tmp_path, _model(tmp_path, "llama192"), 64, sym=True)
    with pytest.raises(ValueError, match=r"tensor-parallel rank 2 could not load its part: ValueError: weight "
                                         r"'model\.layers\.0\.mlp\.down_proj\.weight' cannot be split"):
        LLM(model=str(tmp_path), dtype="float32", kv_cache_memory="4MiB", tensor_parallel_size=4)
