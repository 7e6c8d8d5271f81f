"""The memory roofline of one stream's decode step: the bytes of weights a
one-row step reads, this machine's read bandwidth measured now, and their
quotient, the time below which no engine can produce a token (issue 56).

``tandem bench engine`` prints the roofline beside Tandem's TPOT p50 (and
per round beside the peer's decode rate), the bandwidth measured in the same
run: on a shared box it moves with the load (22-40 GB/s within minutes on the 2-core
AVX512-BF16 machine of docs/benchmarks/decode-roofline.md).
"""

from __future__ import annotations

import time

import torch

from kernels import cpu_decoder, cpu_linear

READ_MIB = 512  # above the last-level cache (32 MiB on the Zen 4 box; ~128-192 MiB usable on the Intel host)


def read_bandwidth(num_threads: int, mib: int = READ_MIB, repeats: int = 5) -> float:
    """This machine's read bandwidth, GB/s (1e9 bytes/s): the median of ``repeats`` ``torch.sum`` over a float32
    tensor of ``mib`` MiB with ``num_threads`` torch threads (the issue's measure: a streaming read, as a decode
    step's pass over the weights is). The tensor is freed before returning."""
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        x = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
        x.sum()  # fault the pages in
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            x.sum()
            times.append(time.perf_counter() - start)
        times.sort()
        return x.numel() * 4 / times[len(times) // 2] / 1e9
    finally:
        torch.set_num_threads(previous)


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
    head = model.lm_head_q8 if model.lm_head_q8 is not None and cpu_linear.copy_max_rows() >= 1 else \
        model.packed.get("lm_head", embed if model.lm_head is None else model.lm_head.weight)
    return total + head.nbytes + embed.shape[1] * embed.element_size()


def weights_mib(weight_bytes: int) -> int:
    """The MiB of a read-bandwidth buffer the size of ``weight_bytes`` (at least 1): what a decode step reads
    again every token, which a last-level cache larger than the weights may hold between steps (the Intel
    host of docs/benchmarks/decode-roofline.md reads <= 128 MiB at 46-50 GB/s and >= 192 MiB at 24-27)."""
    return max(1, round(weight_bytes / 2**20))


def roofline_ms(weight_bytes: int, bandwidth_gb_s: float) -> float:
    """The time to read ``weight_bytes`` once at ``bandwidth_gb_s``, ms: one token's floor."""
    return weight_bytes / (bandwidth_gb_s * 1e9) * 1e3
