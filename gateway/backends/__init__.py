"""Backends the attempt loop calls: the in-process engine and OpenAI-compatible upstreams."""
