"""The heap of a loaded server, out of the garbage collector's reach: ``tandem engine serve`` and ``tandem serve``
(the gateway) call ``freeze_heap`` once they are loaded, as the engine core does (``gc.freeze``; vLLM's API server
does the same).

Unfrozen, every full collection walks every object the process has loaded (the app, its modules, the tokenizer):
in the engine's server a collection while serving walked ~77,000 objects, ~200 ms with the GIL held on the 2-core
box under load, during which no stream got an SSE event (issue #34); in the gateway ~107,000 objects, and under
load at 32 clients the collections' share of its CPU per request was 15 % (issue 48's profile: the time showed
on whatever line allocated when one started).
"""

from __future__ import annotations

import gc


def freeze_heap() -> None:
    """Collect, then move every object alive now out of the collector's reach (``gc.freeze``): later
    collections walk only what was allocated since. Call it once a server has loaded, and again after a
    late load (the gateway's co-located engine)."""
    gc.collect()
    gc.freeze()
