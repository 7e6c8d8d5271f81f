"""Ending the gateway's background loops (config sync and file watch, rollout controller, health probes, replica
loads, Redis reconnect): one ``cancel_task`` for all of them.

One cancel is not enough to end a loop: a library may drop it. On Python 3.11 ``asyncio.wait_for``, which redis-py's
socket writes go through (``Connection.send_packed_command``), returns the awaited result and drops a cancel that
arrives in the loop step where that result came in (CPython gh-86296, fixed in 3.12 by rebuilding ``wait_for`` on
``asyncio.timeout``). The loop then runs on with its cancel spent, and an owner that cancelled it once and awaited it
waits for ever: the gateway's shutdown hung that way about once in ten test runs. anyio's cancel scopes re-deliver a
cancellation until the task has left the scope for the same reason; ``cancel_task`` repeats the cancel until the task
has ended.
"""

from __future__ import annotations

import asyncio

RECANCEL_S = 0.05      # how long a cancelled loop gets to end before it is cancelled again


async def cancel_task(task: asyncio.Task | None) -> None:
    """Cancel the background loop ``task`` and wait until it has ended, cancelling it again every ``RECANCEL_S``
    seconds while it runs on (a cancel dropped by a library, module docstring). What the loop raised is dropped; a
    cancel of the caller itself propagates. Returns None, for ``self._task = await cancel_task(self._task)``.

    Only for loops whose cancellation needs no awaited cleanup: a second cancel would interrupt it."""
    if task is None:
        return None
    while not task.done():
        task.cancel()
        await asyncio.wait([task], timeout=RECANCEL_S)
    if not task.cancelled():
        task.exception()   # retrieved: the loop's last error is not logged again as never retrieved
    return None
