"""The AMX body of the integer quantized kernels (kernels/csrc/quant_amx.h: calls of 16 rows or more on a CPU
with AMX-INT8) against the AVX512-VNNI body on the same build and CPU, bit for bit: the same calls run in
this process (AMX) and in a child process with ``TANDEM_CPU_AMX=0`` (VNNI), 4-bit (Q4_1, Q4_0, a group of
128 with act-order) and 8-bit (Q8_0, a W8A16 group of 64) weights, full and partial row tiles, partial
panels, bias, residual, both output dtypes. (tests/test_quant_int512.py holds the same calls on this build
against the AVX2 build.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import cpu_linear

ROWS = (16, 17, 31, 64, 130)
ROOT = Path(__file__).resolve().parents[1]

# The child: the same weights and calls as outputs() below, on the VNNI body.
CHILD = """
import sys, torch
sys.path.insert(0, sys.argv[2])
from tests.test_quant_amx import outputs
from kernels import cpu_linear
assert not cpu_linear.uses_amx()
torch.save(outputs(), sys.argv[1])
"""


@pytest.fixture(autouse=True)
def _amx():
    if not cpu_linear.uses_amx():
        pytest.skip("needs a CPU with AMX-INT8 and the tile state granted to this process")


def _weights():
    """(name, packed) of each weight kind, the same in every process."""
    g = torch.Generator().manual_seed(7)
    out = []
    for kind, group, n, k in (("q4_1", 32, 203, 320), ("q4_0", 32, 150, 576), ("q4_perm", 128, 96, 512)):
        codes = torch.randint(0, 16, (n, k), generator=g)
        d = (torch.rand(n, k // group, generator=g) * 0.02 + 1e-3).half().float()
        m = None if kind == "q4_0" else (-torch.rand(n, k // group, generator=g) * 0.1).half().float()
        perm = torch.randperm(k, generator=g) if kind == "q4_perm" else None
        out.append((kind, cpu_linear.pack_q4(codes, d, m, group, perm)))
    for group, n, k in ((32, 203, 320), (64, 70, 384)):
        codes = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int32).to(torch.int8)
        codes[0, :32] = -128
        out.append((f"q8_{group}", cpu_linear.pack_q8(codes, torch.rand(n, k // group, generator=g) * 0.02 + 1e-4,
                                                      group)))
    return out


def outputs() -> dict[str, torch.Tensor]:
    """Every (weight, rows, call form)'s output, keyed by a name; the inputs' first block all zero."""
    out = {}
    for name, packed in _weights():
        for rows in ROWS:
            g = torch.Generator().manual_seed(rows)
            n, k = packed.out_features, packed.in_features
            x = torch.randn(rows, k, generator=g)
            x[0, :32] = 0
            x = x.bfloat16()
            bias, residual = torch.randn(n, generator=g), torch.randn(rows, n, generator=g).bfloat16()
            out[f"{name}/{rows}/bias+residual"] = cpu_linear.linear(x, packed, bias, residual)
            out[f"{name}/{rows}/residual,f32"] = cpu_linear.linear(x, packed, None, residual, out_dtype=torch.float32)
            out[f"{name}/{rows}/plain"] = cpu_linear.linear(x, packed)
    return out


def test_the_amx_body_gives_the_vnni_bits(tmp_path):
    here = outputs()
    path = tmp_path / "vnni.pt"
    env = {**os.environ, "TANDEM_CPU_AMX": "0"}
    subprocess.run([sys.executable, "-c", CHILD, str(path), str(ROOT)], env=env, check=True, cwd=ROOT)
    there = torch.load(path)
    assert here.keys() == there.keys() and len(here) == 5 * len(ROWS) * 3
    for key, a in here.items():
        b = there[key]
        view = torch.int16 if a.dtype == torch.bfloat16 else torch.int32
        assert torch.equal(a.view(view), b.view(view)), (key, (a.float() - b.float()).abs().max().item())
