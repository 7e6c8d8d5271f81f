"""The attempt loop's wait and stop policy as tenacity strategies (``RetrySettings``): an exponential backoff
from ``backoff_initial_s`` doubling per step up to ``backoff_max_s``, plus up to ``jitter_s`` of random jitter;
stop after ``max_attempts`` upstream calls or when the next wait would end past ``deadline_s``. The loop itself
stays a plain loop (``gateway/resilience/attempts.py``): it asks this policy, tenacity runs nothing.
"""

from __future__ import annotations

import time

from tenacity import RetryCallState, stop_after_attempt, stop_after_delay, wait_exponential, wait_random

from gateway.config.schema import RetrySettings


class RetryPolicy:
    """Wait and stop decisions for one request's attempt loop, started at ``start`` (``time.monotonic()``)."""

    __slots__ = ("wait", "stop", "state")

    def __init__(self, settings: RetrySettings, start: float):
        self.wait = (wait_exponential(multiplier=settings.backoff_initial_s, max=settings.backoff_max_s)
                     + wait_random(0, settings.jitter_s))
        self.stop = stop_after_attempt(settings.max_attempts) | stop_after_delay(settings.deadline_s)
        self.state = RetryCallState(None, None, (), {})
        self.state.start_time = start

    def backoff(self, step: int) -> float:
        """Seconds to back off after loop step ``step`` (1-based), before any ``Retry-After`` floor."""
        self.state.attempt_number = step
        return self.wait(self.state)

    def exhausted(self, calls: int, wait: float) -> bool:
        """True when ``calls`` upstream calls are the limit, or waiting ``wait`` seconds more would end past the
        deadline."""
        self.state.attempt_number = calls
        self.state.outcome_timestamp = time.monotonic() + wait
        return self.stop(self.state)
