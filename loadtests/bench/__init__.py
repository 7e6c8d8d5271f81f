"""Benchmarks outside the load-test scenarios, kept out of the runtime packages: ``engine_throughput`` and
``kv_pool`` (``tandem bench engine``), ``structured`` (``tandem bench structured``), ``kernels_gpu`` (Triton vs
SDPA on CUDA; ``loadtests/gpu_check.sh``), ``kernels_cpu`` (the C kernels vs the PyTorch attention path and
oneDNN's linear layers), ``compile_check`` (the Triton
kernels compiled for sm_90 without a GPU), ``transport_bench`` (the gateway's httpx vs aiohttp transports). The
gateway's overhead is ``tandem loadtest overhead``."""
