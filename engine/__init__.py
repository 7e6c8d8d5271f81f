"""Tandem's paged-attention inference engine.

Importing it (or any of its modules) has no side effects: no OpenMP variables, no torch threads. Whoever
starts an engine core sets its threading policy before torch loads libgomp
(``engine.worker.device.choose_omp_wait_policy``, in ``engine.core.core_loop.start_engine_core``): the core
process's entry (``engine.core.core_loop.run_engine_core_process``), the in-thread core
(``ThreadCoreClient.start``) and the offline engine (``LLMEngine``, under ``LLM``); the core then sets its
torch threads (``configure_core_threads``).
"""

from __future__ import annotations

import importlib

# vLLM's top-level names (``from vllm import LLM, SamplingParams``), each imported on first use (PEP 562): importing
# ``engine`` alone still loads nothing (a vLLM user's first line was an ImportError).
_EXPORTS = {
    "LLM": "engine.llm", "SamplingParams": "engine.sampling_params",
    "StructuredOutputsParams": "engine.sampling_params", "PoolingParams": "engine.pooling",
    "RequestOutput": "engine.outputs", "CompletionOutput": "engine.outputs",
    "PoolingRequestOutput": "engine.outputs", "EmbeddingRequestOutput": "engine.outputs",
    "EngineArgs": "engine.config", "LLMEngine": "engine.llm_engine", "AsyncEngine": "engine.async_engine",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    """``engine.LLM`` and the other ``_EXPORTS``, imported from their module when first asked for."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
