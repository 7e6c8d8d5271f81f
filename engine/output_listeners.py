"""Who watches an ``AsyncEngine``'s answers besides their requests (its metrics, ``engine/metrics.py``): output
listeners see every step's delta outputs, pooling listeners every embedding call answered. Each is called in the
thread that processes outputs; it must be quick, and a listener that raises is logged, never the request's
failure."""

from __future__ import annotations

import logging
from collections.abc import Callable

from engine.outputs import RequestOutput

logger = logging.getLogger("tandem.async_engine")

# A listener sees every batch of outputs: (outputs, time.monotonic() of the step).
OutputListener = Callable[[list[RequestOutput], float], None]
# A pooling listener sees every embedding call ended: (each prompt's tokens, time.monotonic() of the call and of
# its end, "stop" when answered or "abort" when its caller left first).
PoolingListener = Callable[[list[int], float, float, str], None]


class Listeners:
    """An engine's listeners: ``outputs`` and ``pooling``, called by ``stepped`` and ``pooled``."""

    def __init__(self) -> None:
        self.outputs: list[OutputListener] = []
        self.pooling: list[PoolingListener] = []

    def stepped(self, outputs: list[RequestOutput], now: float) -> None:
        """One step's ``outputs`` (``now``: ``time.monotonic()`` of the step) to every output listener."""
        for listener in self.outputs:
            try:
                listener(outputs, now)
            except Exception:  # noqa: BLE001
                logger.exception("output listener failed")

    def pooled(self, prompt_lens: list[int], arrival: float, now: float, reason: str = "stop") -> None:
        """One ended embedding call (each prompt's tokens; ``time.monotonic()`` of the call and of its end;
        ``reason``: "stop" answered, "abort" its caller left) to every pooling listener."""
        for listener in self.pooling:
            try:
                listener(prompt_lens, arrival, now, reason)
            except Exception:  # noqa: BLE001
                logger.exception("pooling listener failed")
