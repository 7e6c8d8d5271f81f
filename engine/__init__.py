"""Tandem's paged-attention inference engine.

Importing it (or any of its modules) has no side effects: no OpenMP variables, no torch threads. Whoever
starts an engine core sets its threading policy before torch loads libgomp
(``engine.worker.device.choose_omp_wait_policy``, in ``engine.core.core_loop.start_engine_core``): the core
process's entry (``engine.core.core_loop.run_engine_core_process``), the in-thread core
(``ThreadCoreClient.start``) and the offline engine (``LLMEngine``, under ``LLM``); the core then sets its
torch threads (``configure_core_threads``).
"""
