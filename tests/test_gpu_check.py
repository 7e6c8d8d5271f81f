"""loadtests/gpu_check.sh's dry run: without a CUDA device it says so, runs
the kernel checks, the engine-vs-transformers parity and the batch-invariance
check in Triton's interpreter, tensor parallelism over gloo and a tiny throughput run on CPU, and writes its
summary."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(os.path.exists("/dev/nvidiactl"), reason="a CUDA machine runs the real check")]


def test_dry_run_without_cuda(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHON"] = sys.executable
    proc = subprocess.run([str(ROOT / "loadtests" / "gpu_check.sh"), str(tmp_path / "out")], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=560)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "no CUDA device" in proc.stdout
    summary = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    parts = {p["name"]: p for p in summary["parts"]}
    assert [p["status"] for p in parts.values()] == ["ok"] * 6, parts
    kernels = parts["kernels"]["results"]
    assert kernels["checks_ok"] == kernels["checks"] == 4
    parity = parts["parity (triton, fp32, tiny Llama)"]["results"]
    assert (parity["backend"], parity["exact"], parity["mismatches"]) == ("triton", parity["prompts"], [])
    invariance = parts["batch invariance (triton path)"]["results"]
    assert (invariance["differ_batched_vs_alone"], invariance["differ_cache_hit_vs_alone"]) == (0, 0), invariance
    tp = parts["tensor parallel"]["results"]
    assert tp["world_of_one"]["logits_bitwise_equal"] and all(tp["world_of_one"]["collectives"].values()), tp
    assert tp["two_ranks"]["fp32_tokens_equal_tp1"] and tp["two_ranks"]["bf16_differ_batched_vs_alone"] == 0, tp
    packed = parts["packed weights (triton, 4-bit/int8/fp8)"]["results"]["layouts"]
    assert len(packed) == 3 and all(r["bitwise_dense"] and r["rows_invariant"] for r in packed.values()), packed
    throughput = parts["throughput tiny shape (CPU)"]["results"]
    assert throughput["tandem"]["output_tok_per_s"] > 0 and throughput["ratio_output_tok_per_s"] > 0
    assert (tmp_path / "out" / "kernels" / "kernels_bench.md").is_file()
    assert "| parity (triton, fp32, tiny Llama) | ok |" in (tmp_path / "out" / "gpu_check.md").read_text()
