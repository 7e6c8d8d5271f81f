"""Load tests and benchmarks for Tandem.

``tandem loadtest ...`` / ``python -m loadtests ...``: open-loop (Poisson) or
closed-loop (fixed concurrency) load against any OpenAI-compatible server,
with MT-Bench or synthetic workloads, TTFT / TPOT / ITL / end-to-end
percentiles, JSON + markdown + PNG reports, and six scenarios that each
measure Tandem against a baseline from the same run (see ``loadtests/README.md``).
"""
