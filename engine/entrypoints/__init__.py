"""The engine's front ends: ``tandem engine serve`` (OpenAI-compatible HTTP,
as vLLM's ``entrypoints/openai/``), structured chat (tools and
``response_format`` as grammars) and the engine's command line."""
