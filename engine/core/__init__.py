"""The engine core: the scheduler and its KV cache bookkeeping, and the loop that drives one step at a time.

``request`` (a request's state), ``block_pool`` and ``kv_cache_manager`` (paged KV blocks, prefix caching),
``scheduler`` / ``scheduler_output`` (what runs this step), ``engine_core`` (one step: schedule, run the
model, sample, update), ``core_loop`` / ``core_client`` / ``core_messages`` (that step in a thread or in its
own process, and the messages to and from it), ``ttft`` (the TTFT prediction from the core's state).
"""
