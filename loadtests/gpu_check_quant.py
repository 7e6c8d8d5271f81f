"""The GPU check's packed-weights part (``loadtests/gpu_check.py``): the
Triton GEMM that dequantizes 4-bit, int8 and FP8 weights in its tiles
(``kernels/triton_quant_linear.py``) on the device.

For each layout, at a Llama-3-8B MLP shape on CUDA (a small shape in the CPU
dry run, Triton's interpreter, float16: the interpreter cannot run bfloat16's
``tl.dot``): the outputs are bitwise the dense batch-invariant Triton GEMM's
on the reference dequantization (``Int4Weight``/``Int8Weight``/``FP8Weight``
``.dequantize()``), a row's bits are the same alone and in a batch of 64, and
on CUDA the time of one call at 1 and 64 rows against the dense GEMM's and
the bytes each reads.
"""

from __future__ import annotations

import time

import torch


def _weights(n: int, k: int, g: torch.Generator) -> dict:
    from engine.quantization.fp8 import FP8Weight
    from engine.quantization.int4 import Int4Weight
    from engine.quantization.int8 import Int8Weight

    fp8_bits = torch.randint(0, 256, (n, k), generator=g, dtype=torch.uint8)
    fp8_bits[(fp8_bits & 0x7F) == 0x7F] = 0x3C  # no NaN codes
    return {
        "int4 groups of 128": Int4Weight(torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8),
                                         torch.randint(0, 17, (n, k // 128), generator=g, dtype=torch.int32),
                                         (torch.rand(n, k // 128, generator=g) * 0.02 + 1e-3).half().float(), 128),
        "int8 one scale a row": Int8Weight(torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8),
                                           torch.rand(n, 1, generator=g) * 1e-3 + 1e-5, k),
        "fp8 one scale a row": FP8Weight(fp8_bits.view(torch.float8_e4m3fn), torch.rand(n, 1, generator=g) * 0.05),
    }


def _time_ms(fn, repeats: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / repeats * 1e3


def check_packed_gemm(part, device: str) -> None:
    """Run the packed layouts on ``device`` (see the module docstring); fills ``part.results``."""
    from engine.layers.triton_packed_linear import TritonPackedLinear
    from kernels import triton_batch_invariant as bi

    cuda = device == "cuda"
    n, k, rows = (14336, 4096, 64) if cuda else (192, 256, 8)
    dtype = torch.bfloat16 if cuda else torch.float16
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, k, generator=g).to(dtype).to(device)
    results, ok = {}, True
    for name, weight in _weights(n, k, g).items():
        layer = TritonPackedLinear([weight], torch.device(device))
        dense = weight.dequantize().to(dtype).to(device)
        batched = layer(x)
        same_as_dense = bool(torch.equal(batched, bi.linear(x, dense)))
        alone_same = all(torch.equal(layer(x[i:i + 1]), batched[i:i + 1]) for i in (0, rows // 2, rows - 1))
        r = {"bitwise_dense": same_as_dense, "rows_invariant": alone_same,
             "packed_bytes": layer.nbytes, "dense_bytes": dense.numel() * dense.element_size()}
        if cuda:
            for m in (1, rows):
                r[f"packed_ms_{m}"] = round(_time_ms(lambda: layer(x[:m])), 4)
                r[f"dense_ms_{m}"] = round(_time_ms(lambda: bi.linear(x[:m], dense)), 4)
        results[name] = r
        ok = ok and same_as_dense and alone_same
        del layer, dense
    part.results = {"shape": [n, k], "rows": rows, "dtype": str(dtype), "layouts": results}
    part.status = "ok" if ok else "failed"
