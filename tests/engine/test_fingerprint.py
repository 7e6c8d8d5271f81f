"""``system_fingerprint`` (engine/fingerprint.py) changes with the model, the numerics and the build."""

from __future__ import annotations

from engine.config import default_model_path
from engine.fingerprint import system_fingerprint

NUMERICS = {"device": "cpu", "dtype": "torch.bfloat16", "quantization": "none", "batch_invariant": True}


def test_the_fingerprint_is_stable_and_changes_with_model_and_numerics(tmp_path, monkeypatch):
    model = default_model_path()
    fp = system_fingerprint(model, NUMERICS)
    assert fp == system_fingerprint(model, dict(NUMERICS)) and fp.startswith("fp_") and len(fp) == 19
    assert system_fingerprint(model, {**NUMERICS, "dtype": "torch.float32"}) != fp
    assert system_fingerprint(model, {**NUMERICS, "batch_invariant": False}) != fp
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGUF" + b"\0" * 64)
    assert system_fingerprint(str(other), NUMERICS) != fp
    monkeypatch.setattr("engine.fingerprint.build_identity", lambda: b"another build")
    assert system_fingerprint(model, NUMERICS) != fp


def test_the_cpu_kernels_body_is_part_of_the_numerics(monkeypatch):
    """Each CPU build says which arithmetic it runs: its linear body (AVX512-BF16, AVX2, portable: their
    bfloat16 linears and attention give other bits) and its quantized copies' (integer dots on every x86
    build, the same bits on AVX2 and AVX-512; the dequantized bfloat16 values on the portable one). An AVX2
    machine's engine and an AVX512-BF16 one's answer with other bits (their attention differs): their
    fingerprints differ (the other builds are made here with TANDEM_CPU_MARCH)."""
    import torch

    from engine.config import EngineArgs
    from engine.fingerprint import numerics_of
    from kernels import cpu_linear

    args, cpu = EngineArgs(), torch.device("cpu")
    monkeypatch.delenv("TANDEM_CPU_MARCH", raising=False)   # the native build, also in a run that sets it
    native = numerics_of(args, cpu, torch.bfloat16)
    monkeypatch.setenv("TANDEM_CPU_MARCH", "x86-64-v3")
    avx2 = numerics_of(args, cpu, torch.bfloat16)
    monkeypatch.setenv("TANDEM_CPU_MARCH", "x86-64")
    portable = numerics_of(args, cpu, torch.bfloat16)
    assert avx2["cpu_isa"] == "avx2" and native["cpu_isa"] == cpu_linear.isa("native")
    assert avx2["cpu_quant"] == "integer-dots" and portable["cpu_quant"] == "dequantized"
    assert native["cpu_quant"] == ("integer-dots" if cpu_linear.integer_copies("native") else "dequantized")
    if native["cpu_isa"] != "avx2":
        assert system_fingerprint(default_model_path(), avx2) != system_fingerprint(default_model_path(), native)


def test_the_tensor_parallel_size_is_part_of_the_numerics():
    """N ranks cut each row-parallel sum N ways: other bits than one rank's, so another fingerprint; one rank
    keeps the fingerprint it had before tensor parallelism existed (no key)."""
    import torch

    from engine.config import EngineArgs
    from engine.fingerprint import numerics_of

    cpu = torch.device("cpu")
    one, two = numerics_of(EngineArgs(), cpu, torch.float32), numerics_of(EngineArgs(tensor_parallel_size=2), cpu,
                                                                          torch.float32)
    assert "tensor_parallel_size" not in one and two["tensor_parallel_size"] == 2
    assert system_fingerprint(default_model_path(), one) != system_fingerprint(default_model_path(), two)


def test_a_models_sampling_defaults_are_part_of_its_fingerprint(tmp_path):
    """A generation config's sampling defaults decide what a request that leaves a field unset samples with
    (``engine/generation_config.py``): they change the fingerprint, which the gateway's exact cache keys on; a
    model without them keeps the fingerprint it had."""
    import json
    import shutil

    import torch

    from engine.config import EngineArgs, default_model_path
    from engine.fingerprint import numerics_of, system_fingerprint
    from tests.tiny_models import save_byte_level_llama

    (tmp_path / "plain").mkdir()
    plain = save_byte_level_llama(tmp_path / "plain")
    shutil.copytree(plain, tmp_path / "gen")
    (tmp_path / "gen" / "generation_config.json").write_text(json.dumps({"temperature": 0.6}))
    cpu = torch.device("cpu")
    base = numerics_of(EngineArgs(model=plain), cpu, torch.float32)
    assert "sampling_defaults" not in base and base == numerics_of(EngineArgs(), cpu, torch.float32)
    with_defaults = numerics_of(EngineArgs(model=plain, generation_config=str(tmp_path / "gen")), cpu, torch.float32)
    assert with_defaults["sampling_defaults"] == {"temperature": 0.6}
    assert system_fingerprint(default_model_path(), base) != system_fingerprint(default_model_path(), with_defaults)


def test_naming_the_checkpoints_own_method_keeps_the_fingerprint():
    """A trial: ``--quantization gptq`` on a GPTQ checkpoint changed ``system_fingerprint`` though its outputs were
    bitwise those of auto-detection (which follows the checkpoint, and a mismatch is refused); ``gguf`` (4-bit
    kept instead of dequantized) is other arithmetic, and another fingerprint."""
    import torch

    from engine.config import EngineArgs
    from engine.fingerprint import numerics_of

    cpu = torch.device("cpu")
    auto = numerics_of(EngineArgs(), cpu, torch.bfloat16)
    for method in ("gptq", "awq", "compressed-tensors", "gptq_marlin"):
        assert numerics_of(EngineArgs(quantization=method), cpu, torch.bfloat16) == auto, method
    assert numerics_of(EngineArgs(quantization="gguf"), cpu, torch.bfloat16) != auto
