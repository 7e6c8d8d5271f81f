"""The package's one SmolLM2 float32 server, shared by the modules whose tests leave it as they found it."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="package")
def float32_server():
    """``tandem engine serve`` in a thread (``test_serving.start_server``): SmolLM2 in float32, chunked
    prefill with a 256-token budget, max_model_len 1024; started once for test_serving.py and
    test_serving_request_semantics.py (each model load and warm-up costs seconds on a small CPU)."""
    from tests.engine.entrypoints.test_serving import MAX_MODEL_LEN, PREFILL_CHUNK, start_server

    s = start_server(dtype="float32", kv_cache_memory="96MiB", max_model_len=MAX_MODEL_LEN,
                     enable_chunked_prefill=True, max_num_batched_tokens=PREFILL_CHUNK)
    yield s
    s.stop()
