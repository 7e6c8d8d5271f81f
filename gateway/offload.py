"""Work on a large request body runs in a worker thread, off the event loop: decoding, the chat template and
tokenizing a 4 MB chat body take seconds, during which no other request (of any tenant) would move. The engine's
tokenizer releases the GIL meanwhile (``engine.tokenizer.Tokenizer.encode``). Smaller bodies stay on the loop,
where a thread hop would cost more than the work. Read by the request pipeline, the response cache's exact key,
``/tokenize``, ``/detokenize`` and ``/v1/messages/count_tokens``."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

# Bodies from this size on (bytes) are worked on in a worker thread.
OFFLOAD_BYTES = 16 * 1024


async def off_loop(size: int, fn: Callable[..., T], /, *args) -> T:
    """``fn(*args)`` for a body of ``size`` bytes: in a worker thread (``asyncio.to_thread``) from
    ``OFFLOAD_BYTES`` on, else at once on the loop."""
    if size < OFFLOAD_BYTES:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)
