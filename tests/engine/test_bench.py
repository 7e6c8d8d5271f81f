"""``tandem bench engine``: its peer tooling (``--peer vllm``) never installs
anything and says why a peer was skipped; a run on a tiny model fills its JSON."""

from __future__ import annotations

import argparse
import json
import sys

from loadtests.bench.engine_throughput import _hf_baseline_missing, add_bench_args, bench_vllm, run_bench
from engine.config import add_engine_cli_args
from tests.tiny_models import save_byte_level_llama


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_bench_args(p)
    add_engine_cli_args(p)
    return p.parse_args(list(argv))


def test_peer_without_its_interpreter_is_skipped(tmp_path):
    args = _args("--peer", "vllm", "--peer-python", str(tmp_path / "nope" / "python"))
    assert "no peer interpreter" in bench_vllm(args, [[1, 2, 3]], "m")["skipped"]


def test_peer_without_vllm_installed_is_skipped():
    """This venv's python runs the peer script, which finds no vllm (exit 3)."""
    args = _args("--peer", "vllm", "--peer-python", sys.executable, "--output-len", "4")
    result = bench_vllm(args, [[1, 2, 3]], "m", timeout_s=120)
    assert "vllm is not importable" in result["skipped"], result


def test_bench_engine_on_a_tiny_model(tmp_path, capsys):
    model = save_byte_level_llama(tmp_path)
    out = tmp_path / "r.json"
    args = _args("--model", model, "--num-prompts", "3", "--input-len", "8", "--output-len", "5", "--ignore-eos",
                 "--no-baseline", "--kv-cache-memory", "8MiB", "--output-json", str(out), "--peer", "vllm",
                 "--peer-python", str(tmp_path / "missing"))
    assert run_bench(args) == 0
    result = json.loads(out.read_text())
    assert result["tandem"]["output_tokens"] == 15 and "skipped" in result["vllm"]
    assert "ratio_vs_vllm" not in result and "no peer interpreter" in capsys.readouterr().out


def test_hf_baseline_of_a_gguf_without_accelerate_is_skipped_with_the_reason(monkeypatch):
    """`make serve`'s install has no accelerate, which transformers needs to read a GGUF: the baseline is skipped
    with the reason (the fresh-user trial got a traceback instead of Tandem's figures)."""
    import importlib.util

    find_spec = importlib.util.find_spec
    assert _hf_baseline_missing("/models/m.gguf") == ""          # this venv has accelerate
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "accelerate" else find_spec(name, *a))
    assert "accelerate" in _hf_baseline_missing("/models/m.gguf")
    assert _hf_baseline_missing("/models/hf-dir") == ""           # HF directories load without it
