"""The exact response cache (issue #30): ``key`` (what an answer is keyed by), ``store`` (Redis or in process),
``response_cache`` (the pipeline's use of it)."""
