"""The serving protocol's rules that both halves apply, below both: the value ranges of request fields
(``param_ranges``), that a ``tool_choice`` needs ``tools`` (``tool_choice``), the ``x-request-id`` rule (``request_ids``) and the OpenAI error a server returns
(``errors.ServingError``). ``tandem engine serve`` (``engine/entrypoints/``) and the gateway read them from here,
so the gateway imports nothing from the engine's HTTP package.

This package imports nothing else from ``engine`` (nor from ``gateway``, ``policies`` or ``loadtests``), and
importing it loads neither torch nor msgspec (``tests/engine/test_package_boundaries.py``): it is the part of the
engine the gateway may read without loading the engine.
"""
