"""``gateway/tasks.py``: a background loop ends when its owner stops it, even when a library drops the cancel (the
gateway's shutdown hung about once in ten runs of the rollout promotion test: CPython 3.11's ``asyncio.wait_for``
under redis-py's socket writes); the caller's own cancel still reaches the caller. The gateway's case with real
parts: a ``Gateway`` started and stopped in this event loop on a real Redis."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from gateway.config.compile import load_config_text
from gateway.runtime import Gateway
from gateway.tasks import cancel_task
from tests.gateway.fault_upstream import FaultUpstream
from tests.gateway.rollouts.conftest import two_upstreams


async def write_ending_with_the_cancel() -> None:
    """A Redis command's socket write that completes in the loop step where a cancel of its task arrives. redis-py
    writes through ``asyncio.wait_for``, which on CPython 3.11 then returns the write's result and drops the cancel
    (gh-86296: "if fut.done(): return fut.result()"). Modelled here (the write ends as the cancel comes) so that the
    race happens every time, whatever the timing and the Python version."""
    try:
        await asyncio.get_running_loop().create_future()
    except asyncio.CancelledError:
        return


async def test_a_loop_that_drops_its_cancel_is_ended():
    calls = []

    async def loop():
        while True:
            calls.append("write" if not calls else "sleep")
            await (write_ending_with_the_cancel() if len(calls) == 1 else asyncio.sleep(3600))

    task = asyncio.create_task(loop())
    await asyncio.sleep(0)                       # the loop is in its write
    async with asyncio.timeout(30) as bound:     # a liveness bound: one cancel never ended it
        assert await cancel_task(task) is None
    assert not bound.expired() and task.cancelled() and calls == ["write", "sleep"]


async def test_the_loops_last_error_is_dropped_and_the_callers_own_cancel_propagates():
    async def failing():
        raise RuntimeError("the loop's last error")

    task = asyncio.create_task(failing())
    await asyncio.sleep(0)
    assert await cancel_task(task) is None and isinstance(task.exception(), RuntimeError)

    stop = asyncio.Event()

    async def stubborn():                        # drops every cancel until told to stop
        while not stop.is_set():
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                pass

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    owner = asyncio.create_task(cancel_task(task))
    await asyncio.sleep(0)                       # the owner waits for the loop to end
    owner.cancel()                               # and is cancelled itself (a shutdown deadline, say)
    await asyncio.wait([owner], timeout=30)      # a liveness bound (not awaited: that would cancel the owner again)
    stop.set()
    await cancel_task(task)
    assert owner.cancelled() and task.done()


@pytest.mark.parametrize("loop", ["rollout controller", "config sync"])
async def test_the_gateway_stops_when_a_redis_write_of_its_loop_drops_the_cancel(redis_url, loop):
    """``Gateway.stop`` (the server's shutdown) cancelled each loop once and awaited it: the loop ran on and the
    stop never returned."""
    with FaultUpstream("stable") as stable, FaultUpstream("cand") as cand:
        text = two_upstreams(stable, cand, extra=f"state: {{redis_url: '{redis_url}', key_prefix: "
                             f"t{uuid.uuid4().hex[:8]}, sync_interval_s: 0.05}}\n")
        gw = Gateway(None, load_config_text(text), start_engine=False)
        await gw.start()
        owner, name = (gw.rollouts.store, "live_names") if loop == "rollout controller" else (gw.ledger, "version")
        real, inside = getattr(owner, name), asyncio.Event()

        async def held():                        # the loop's next Redis call, its write ending as the cancel comes
            setattr(owner, name, real)
            inside.set()
            await write_ending_with_the_cancel()
            return await real()

        setattr(owner, name, held)
        async with asyncio.timeout(30) as bound:     # a liveness bound: the old stop() never returned by itself
            await inside.wait()
            await gw.stop()
    # (the old stop "returned" at the bound only: it swallowed the bound's cancel, which ended the loop)
    assert not bound.expired(), f"Gateway.stop waited on the {loop} loop, which ran on after its cancel"
    assert gw.rollouts._task is None and not gw._tasks
