"""Engine test fixtures shared across modules."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def hf_smollm2():
    """transformers' Llama reading the embedded SmolLM2 GGUF (dequantized, float32, eval mode): the reference
    of the parity tests, loaded once per session (the GGUF dequantization takes ~15 s here)."""
    import torch
    from transformers import AutoModelForCausalLM

    from engine.config import default_model_path

    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                dtype=torch.float32).eval()
