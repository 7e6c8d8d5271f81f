"""Speculative decoding that changes no output (issue 52): proposers guess a sequence's next tokens, the
scheduler's normal step computes them as extra query tokens, and ``rejection.py`` keeps the longest prefix that
the target model's own sampling reproduces, plus the token it samples after it."""
