"""The engine's OpenAI layer without HTTP (as vLLM's ``entrypoints/openai/serving_*.py``): a request body parsed,
checked, rendered through the chat template (tools and ``response_format`` as grammars) and mapped onto
``SamplingParams``; the engine's ``RequestOutput``s turned into typed answers and stream chunks
(``chunks.py``). ``tandem engine serve`` (``engine/entrypoints/``) encodes them as JSON and SSE; the gateway's
local backend reads them in its own process, with no JSON in between."""
