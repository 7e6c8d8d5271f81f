"""Tiny GPTQ, AWQ and compressed-tensors checkpoints written by a script that follows each format's
documented layout (auto-gptq/gptqmodel's, AutoAWQ's and the compressed_tensors package's packing; the
first two tools need CUDA builds that do not install here, llm-compressor is not installed):
round-to-nearest codes per group (the algorithms differ in how they choose codes, not in
what they store), packed as those tools pack them. Each writer also turns the transformers model
it is given into its reference: every quantized weight replaced by the format's dequantization."""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
# projections that read the same input (GPTQ's act-order follows that input's Hessian)
SAME_INPUT = {"self_attn.q_proj": "attention input", "self_attn.k_proj": "attention input",
              "self_attn.v_proj": "attention input", "mlp.gate_proj": "mlp input", "mlp.up_proj": "mlp input"}
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's GEMM packing: nibble i holds output 8c + AWQ_ORDER[i]


def quantize(w: torch.Tensor, g_idx: torch.Tensor, groups: int, sym: bool, zero_range=(0, 15)):
    """Round-to-nearest 4-bit codes of ``w`` [out, in] with input k in group ``g_idx[k]``:
    (codes int [out, in], zeros int [groups, out], scales float16 [groups, out]) and the dequantized
    float32 weight (q - z) * s. GPTQ's quantizer grid: the range includes 0; symmetric puts z at 8."""
    out = w.shape[0]
    zeros = torch.empty(groups, out, dtype=torch.int64)
    scales = torch.empty(groups, out, dtype=torch.float16)
    for g in range(groups):
        cols = w[:, g_idx == g]
        lo, hi = cols.min(1).values.clamp(max=0), cols.max(1).values.clamp(min=0)
        if sym:
            s = torch.maximum(hi, -lo) * 2 / 15
            z = torch.full((out,), 8)
        else:
            s = (hi - lo) / 15
            z = torch.round(-lo / s.clamp(min=1e-8)).long().clamp(*zero_range)
        scales[g], zeros[g] = s.clamp(min=1e-6).half(), z
    s, z = scales.float()[g_idx].t(), zeros[g_idx].t()
    codes = torch.clamp(torch.round(w / s) + z, 0, 15).long()
    return codes, zeros, scales, (codes - z).float() * s


def pack_rows(codes: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    """int32 [rows, cols / 8]: nibble i of element c holds column 8c + order[i] of ``codes`` [rows, cols]."""
    rows, cols = codes.shape
    runs = codes.reshape(rows, cols // 8, 8)[..., list(order)].long()
    packed = sum(runs[..., i] << (4 * i) for i in range(8))
    return ((packed + 2**31) % 2**32 - 2**31).to(torch.int32)


def _write(path, model, tensors: dict, quantization_config: dict) -> None:
    packed = {k.rsplit(".", 1)[0] for k in tensors}
    state = {k: v.contiguous() for k, v in model.state_dict().items()
             if k.removesuffix(".weight") not in packed and "rotary" not in k}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file({**state, **tensors}, str(path / "model.safetensors"))
    cfg = model.config.to_dict()
    cfg["quantization_config"] = quantization_config
    (path / "config.json").write_text(json.dumps(cfg))


@torch.no_grad()
def write_gptq(path, model, group_size: int, sym: bool = True, desc_act: bool = False,
               checkpoint_format: str = "gptq", seed: int = 0, shared_order: bool = True) -> None:
    """``model``'s projections as a GPTQ checkpoint in ``path``: qweight [in / 8, out] packed along
    the inputs, qzeros [groups, out / 8] (zero - 1 for "gptq", the zero for "gptq_v2"), float16
    scales [groups, out], g_idx [in]; ``model`` becomes its reference. With ``desc_act`` the inputs
    are quantized in a random order (GPTQ's: by decreasing Hessian diagonal), g_idx[order[i]] =
    i // group_size; layers that read the same input (q, k, v; gate, up) share their order, as
    GPTQ's Hessian is that input's, unless ``shared_order`` is False."""
    gen = torch.Generator().manual_seed(seed)
    tensors, orders = {}, {}
    for name, p in model.named_parameters():
        module = name.removesuffix(".weight").split(".", 3)[-1]
        if not name.endswith(".weight") or module not in PROJECTIONS:
            continue
        k = p.shape[1]
        groups = k // group_size
        g_idx = torch.arange(k) // group_size
        if desc_act:
            reads = name.removesuffix(f"{module}.weight") + SAME_INPUT.get(module, module)
            order = orders.setdefault(reads if shared_order else name, torch.randperm(k, generator=gen))
            g_idx = torch.empty(k, dtype=torch.int64)
            g_idx[order] = torch.arange(k) // group_size
        low = 1 if checkpoint_format == "gptq" else 0  # auto-gptq's zero - 1 cannot store a zero of 0
        codes, zeros, scales, deq = quantize(p.float(), g_idx, groups, sym, (low, 15))
        prefix = name.removesuffix(".weight")
        stored = zeros - 1 if checkpoint_format == "gptq" else zeros
        tensors[f"{prefix}.qweight"] = pack_rows(codes).t().contiguous()
        tensors[f"{prefix}.qzeros"] = pack_rows(stored)
        tensors[f"{prefix}.scales"] = scales
        tensors[f"{prefix}.g_idx"] = g_idx.to(torch.int32)
        p.copy_(deq)
    _write(path, model, tensors, {"quant_method": "gptq", "bits": 4, "group_size": group_size, "sym": sym,
                                  "desc_act": desc_act, "checkpoint_format": checkpoint_format})


@torch.no_grad()
def write_awq(path, model, group_size: int) -> None:
    """``model``'s projections as an AutoAWQ GEMM checkpoint in ``path``: qweight [in, out / 8] and
    qzeros [groups, out / 8] packed along the outputs in AWQ_ORDER, float16 scales [groups, out];
    ``model`` becomes its reference."""
    tensors = {}
    for name, p in model.named_parameters():
        module = name.removesuffix(".weight").split(".", 3)[-1]
        if not name.endswith(".weight") or module not in PROJECTIONS:
            continue
        k = p.shape[1]
        codes, zeros, scales, deq = quantize(p.float(), torch.arange(k) // group_size, k // group_size, sym=False)
        prefix = name.removesuffix(".weight")
        tensors[f"{prefix}.qweight"] = pack_rows(codes.t().contiguous(), AWQ_ORDER)
        tensors[f"{prefix}.qzeros"] = pack_rows(zeros, AWQ_ORDER)
        tensors[f"{prefix}.scales"] = scales
        p.copy_(deq)
    _write(path, model, tensors, {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
                                  "version": "gemm"})


@torch.no_grad()
def write_compressed_tensors(path, model, group_size: int | None, sym: bool = True) -> None:
    """``model``'s projections as an llm-compressor ``pack-quantized`` W4A16 checkpoint in ``path``
    (the ``compressed_tensors`` package's ``pack_to_int32``): weight_packed [out, in / 8] of q + 8
    (q in -8..7) packed along the inputs, weight_scale [out, groups], weight_zero_point (asymmetric)
    zp + 8 packed along the outputs [out / 8, groups], weight_shape; strategy "group", or "channel"
    for ``group_size`` None; ``model`` becomes its reference."""
    tensors = {}
    for name, p in model.named_parameters():
        module = name.removesuffix(".weight").split(".", 3)[-1]
        if not name.endswith(".weight") or module not in PROJECTIONS:
            continue
        k = p.shape[1]
        size = k if group_size is None else group_size
        codes, zeros, scales, deq = quantize(p.float(), torch.arange(k) // size, k // size, sym)
        prefix = name.removesuffix(".weight")
        tensors[f"{prefix}.weight_packed"] = pack_rows(codes)  # q + 8 = the unsigned code
        tensors[f"{prefix}.weight_scale"] = scales.t().contiguous()
        tensors[f"{prefix}.weight_shape"] = torch.tensor(p.shape)
        if not sym:
            tensors[f"{prefix}.weight_zero_point"] = pack_rows(zeros).t().contiguous()
        p.copy_(deq)
    weights = {"num_bits": 4, "type": "int", "symmetric": sym, "dynamic": False, "actorder": None,
               "strategy": "channel" if group_size is None else "group", "group_size": group_size}
    _write(path, model, tensors, {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                      "output_activations": None}},
        "ignore": ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {}})


@torch.no_grad()
def write_fp8(path, model, strategy: str = "channel", dynamic_activations: bool = False) -> None:
    """``model``'s projections as an llm-compressor ``float-quantized`` FP8 checkpoint in ``path``:
    weight float8_e4m3fn [out, in], weight_scale float32 [out, 1] ("channel") or [1] ("tensor"), the
    FP8 range's amax / 448; with ``dynamic_activations`` the FP8_DYNAMIC scheme's per-token activation
    entry; ``model`` becomes its reference (weight * weight_scale in float32)."""
    tensors = {}
    for name, p in model.named_parameters():
        module = name.removesuffix(".weight").split(".", 3)[-1]
        if not name.endswith(".weight") or module not in PROJECTIONS:
            continue
        amax = p.abs().amax(dim=1, keepdim=True) if strategy == "channel" else p.abs().amax().reshape(1)
        scale = (amax / 448).float()
        w8 = (p / (scale if strategy == "channel" else scale[0])).clamp(-448, 448).to(torch.float8_e4m3fn)
        tensors[name] = w8
        tensors[f"{name}_scale"] = scale
        p.copy_(w8.float() * (scale if strategy == "channel" else scale[0]))
    activations = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True, "strategy": "token"} \
        if dynamic_activations else None
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k not in tensors and "rotary" not in k}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file({**state, **tensors}, str(path / "model.safetensors"))
    cfg = model.config.to_dict()
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": activations,
                                      "weights": {"num_bits": 8, "type": "float", "symmetric": True,
                                                  "dynamic": False, "strategy": strategy}}},
        "ignore": ["lm_head"]}
    (path / "config.json").write_text(json.dumps(cfg))


def fake_quantize_tokens(x: torch.Tensor) -> torch.Tensor:
    """W8A8's dynamic per-token activation quantization applied and undone in float32 (vLLM's
    dynamic_scaled_int8_quant: q = rne(x * (127 / amax)), x = q * (amax / 127))."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax != 0, torch.tensor(127.0) / amax, torch.zeros(()))
    return (torch.round(xf * inv).clamp(-127, 127) * (amax / torch.tensor(127.0))).to(x.dtype)


def _int8_codes(w: torch.Tensor, group_size: int):
    """Symmetric round-to-nearest int8 codes of ``w`` [out, in] with a bfloat16 scale (amax / 127) per
    row and group of inputs: (codes int8 [out, in], scales bfloat16 [out, groups], the float32
    dequantization codes * scales)."""
    out, k = w.shape
    g = w.reshape(out, k // group_size, group_size)
    scales = (g.abs().amax(-1) / 127).clamp(min=1e-8).bfloat16()
    codes = torch.round(g / scales.float()[..., None]).clamp(-128, 127).to(torch.int8)
    return codes.reshape(out, k), scales, (codes.float() * scales.float()[..., None]).reshape(out, k)


def _int8_config(fmt: str, weights: dict, activations: dict | None) -> dict:
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": activations, "output_activations": None}},
            "ignore": ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {}}


@torch.no_grad()
def write_w8a16(path, model, group_size: int | None) -> None:
    """``model``'s projections as an llm-compressor W8A16 checkpoint in ``path`` (format
    ``pack-quantized`` at 8 bits, the ``compressed_tensors`` package's ``pack_to_int32``):
    weight_packed int32 [out, in / 4] of q + 128, four along the inputs, lowest bits first;
    weight_scale bfloat16 [out, groups] (strategy "group", or "channel" for ``group_size`` None);
    weight_shape; ``model`` becomes its reference."""
    tensors = {}
    for name, p in model.named_parameters():
        module = name.removesuffix(".weight").split(".", 3)[-1]
        if not name.endswith(".weight") or module not in PROJECTIONS:
            continue
        k = p.shape[1]
        codes, scales, deq = _int8_codes(p.float(), k if group_size is None else group_size)
        u = (codes.long() + 128).reshape(p.shape[0], k // 4, 4)
        packed = sum(u[..., i] << (8 * i) for i in range(4))
        prefix = name.removesuffix(".weight")
        tensors[f"{prefix}.weight_packed"] = ((packed + 2**31) % 2**32 - 2**31).to(torch.int32)
        tensors[f"{prefix}.weight_scale"] = scales
        tensors[f"{prefix}.weight_shape"] = torch.tensor(p.shape)
        p.copy_(deq)
    weights = {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": False, "actorder": None,
               "strategy": "channel" if group_size is None else "group", "group_size": group_size}
    _write(path, model, tensors, _int8_config("pack-quantized", weights, None))


@torch.no_grad()
def write_w8a8(path, model, strategy: str = "channel") -> None:
    """``model``'s projections as an llm-compressor W8A8 checkpoint in ``path`` (format
    ``int-quantized``, its W8A8 recipe's scheme): weight int8 [out, in], weight_scale bfloat16
    [out, 1] ("channel") or [1] ("tensor"), activations int8 per token, dynamic and symmetric (no
    scales stored). ``model`` becomes its reference: the dequantized weights, and each projection's
    input fake-quantized per token (a forward pre-hook)."""
    tensors = {}
    for name, p in model.named_parameters():
        module = name.removesuffix(".weight").split(".", 3)[-1]
        if not name.endswith(".weight") or module not in PROJECTIONS:
            continue
        w = p.float() if strategy == "channel" else p.float().reshape(1, -1)
        codes, scales, deq = _int8_codes(w, w.shape[1])
        tensors[name] = codes.reshape(p.shape)
        tensors[f"{name}_scale"] = scales if strategy == "channel" else scales.reshape(1)
        p.copy_(deq.reshape(p.shape))
    for name, m in model.named_modules():
        if name.split(".", 3)[-1] in PROJECTIONS:
            m.register_forward_pre_hook(lambda _, args: (fake_quantize_tokens(args[0]), *args[1:]))
    weights = {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": False, "strategy": strategy,
               "group_size": None}
    activations = {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": True, "strategy": "token"}
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k not in tensors and "rotary" not in k}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file({**state, **tensors}, str(path / "model.safetensors"))
    cfg = model.config.to_dict()
    cfg["quantization_config"] = _int8_config("int-quantized", weights, activations)
    (path / "config.json").write_text(json.dumps(cfg))
