"""Engine test fixtures shared across modules."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def hf_smollm2():
    """transformers' Llama reading the embedded SmolLM2 GGUF (dequantized, float32, eval mode): the reference
    of the parity tests, loaded once per session (the GGUF dequantization takes ~15 s here)."""
    from tests.engine.hf_reference import load_hf_smollm2

    return load_hf_smollm2()
