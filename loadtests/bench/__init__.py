"""Benchmarks of the gateway (run with ``python -m loadtests.bench.NAME``)."""
