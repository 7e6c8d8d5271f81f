"""Benchmarks of the gateway outside the load-test scenarios: ``python -m loadtests.bench.transport_bench``
(httpx vs aiohttp transports). The gateway's overhead is ``tandem loadtest overhead``."""
