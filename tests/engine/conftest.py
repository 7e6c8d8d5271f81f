"""Engine test fixtures shared across modules."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def hf_smollm2():
    """transformers' Llama reading the embedded SmolLM2 GGUF (dequantized, float32, eval mode): the reference
    of the parity tests, loaded once per session (the GGUF dequantization takes ~15 s here)."""
    from tests.engine.hf_reference import load_hf_smollm2

    return load_hf_smollm2()


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer():
    """transformers' tokenizer read from the embedded SmolLM2 GGUF (the reference of the tokenizer and
    detokenizer tests; reading it from the GGUF takes seconds, so once per session)."""
    import os

    transformers = pytest.importorskip("transformers")
    from engine.config import default_model_path

    path = default_model_path()
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """The engine's own tokenizer built from the embedded SmolLM2 GGUF, once per session."""
    from engine.config import default_model_path
    from engine.tokenizer import Tokenizer

    return Tokenizer.from_gguf(default_model_path())


@pytest.fixture
def one_thread():
    """One intra-op thread: tiny models' matmuls only lose to a thread pool on a shared box."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
