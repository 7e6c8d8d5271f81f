"""The engine's front ends: ``tandem engine serve`` (OpenAI-compatible HTTP over ``engine/serving/``, as vLLM's
``entrypoints/openai/``) and the engine's command line."""
