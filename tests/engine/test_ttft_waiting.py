"""A waiting request's first token re-predicted from its place in the queue (``predict_waiting``), on a scripted
engine (a real scheduler stepped on a simulated clock), and ``EngineCore.withdraw`` through a real engine."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from engine.core.ttft import predict_waiting
from tests.engine.test_ttft import STEP_S, ScriptedEngine, tokens


def test_a_waiting_request_is_re_predicted_from_what_is_ahead_of_it_not_behind():
    """Midway through its wait a queued request's re-prediction matches the TTFT it then gets, and requests
    queued behind it change nothing (a new arrival's prediction counts them all)."""
    rng = random.Random(11)
    eng = ScriptedEngine(max_num_seqs=4)
    for i in range(6):
        eng.add(f"a{i}", tokens(rng, 400), max_tokens=6)
    eng.add("x", tokens(rng, 300), max_tokens=4)
    for _ in range(4):
        eng.step()
    before = predict_waiting(eng.sched, eng.cal, "x")
    assert before is not None and before.parts["uncached"] == 300 and before.parts["ahead"] > 0
    for i in range(5):
        eng.sched.add_request(eng_request(f"b{i}", tokens(rng, 500)))
    after = predict_waiting(eng.sched, eng.cal, "x")
    assert after.seconds == pytest.approx(before.seconds)
    eng.publish()
    assert eng.predict(tokens(rng, 300)) > before.seconds + 2500 / 1000.0 * 0.9   # the five behind count for new
    start = eng.now
    eng.run()
    delivered = eng.first_token["x"] - start
    assert abs(before.seconds - delivered) <= STEP_S + 0.15 * delivered, (before.seconds, delivered)


def test_only_a_request_still_waiting_with_nothing_computed_is_re_predicted():
    rng = random.Random(12)
    eng = ScriptedEngine(max_num_seqs=2)
    eng.add("r0", tokens(rng, 100), max_tokens=20)
    eng.add("r1", tokens(rng, 100), max_tokens=20)
    eng.add("w", tokens(rng, 100), max_tokens=4)
    eng.step()
    assert predict_waiting(eng.sched, eng.cal, "r0") is None      # running
    assert predict_waiting(eng.sched, eng.cal, "nobody") is None
    assert predict_waiting(eng.sched, eng.cal, "w") is not None
    eng.run()
    assert predict_waiting(eng.sched, eng.cal, "w") is None       # finished


def test_a_more_urgent_request_queued_later_is_ahead_under_priority_scheduling():
    rng = random.Random(13)
    eng = ScriptedEngine(max_num_seqs=2, scheduling_policy="priority")
    for i in range(2):
        eng.add(f"r{i}", tokens(rng, 100), max_tokens=30, priority=1)
    eng.add("w", tokens(rng, 200), max_tokens=4, priority=1)
    eng.step()
    alone = predict_waiting(eng.sched, eng.cal, "w").seconds
    eng.sched.add_request(eng_request("urgent", tokens(rng, 600), priority=0))
    eng.sched.add_request(eng_request("later", tokens(rng, 600), priority=1))
    assert predict_waiting(eng.sched, eng.cal, "w").seconds > alone + 0.5   # 600 tokens at 1,000 tok/s
    assert predict_waiting(eng.sched, eng.cal, "later").seconds > predict_waiting(eng.sched, eng.cal, "w").seconds


def eng_request(rid: str, prompt: list[int], max_tokens: int = 8, priority: int = 0):
    from engine.core.request import Request
    from engine.sampling_params import SamplingParams

    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens), eos_token_id=None,
                   max_tokens=max_tokens, priority=priority, arrival_time=time.monotonic())


@pytest.mark.slow
def test_the_engine_withdraws_a_queued_request_only_when_it_would_be_late(tmp_path):
    """Through the core's process: a request queued behind long prompts on two seats is withdrawn when its
    first token cannot come by the deadline (its ``generate`` raises ``RequestWithdrawn``, the others finish),
    kept when it can, and a running or finished request is never withdrawn."""
    from engine.async_engine import AsyncEngine, RequestWithdrawn
    from engine.config import EngineArgs
    from engine.sampling_params import SamplingParams
    from tests.tiny_models import save_byte_level_llama

    model = save_byte_level_llama(tmp_path)

    async def drain(gen) -> int:
        n = 0
        async for out in gen:
            n += sum(len(c.token_ids) for c in out.outputs)
        return n

    async def main():
        eng = AsyncEngine(EngineArgs(model=model, kv_cache_memory="64MiB", engine_core_process=True, block_size=16,
                                     max_num_seqs=2))
        await eng.start()
        try:
            long = [[2 + (7 * i + k) % 250 for i in range(1500)] for k in range(3)]
            ahead = [asyncio.ensure_future(drain(eng.generate(p, SamplingParams(max_tokens=64, ignore_eos=True),
                                                              f"a{k}"))) for k, p in enumerate(long)]
            kept = asyncio.ensure_future(drain(eng.generate([5] * 40, SamplingParams(max_tokens=2), "kept")))
            late = asyncio.ensure_future(drain(eng.generate([6] * 40, SamplingParams(max_tokens=2), "late")))
            await asyncio.sleep(0.05)
            withdrawn, seconds = await eng.withdraw("kept", by=time.monotonic() + 600.0)
            assert not withdrawn and seconds > 0
            withdrawn, seconds = await eng.withdraw("late", by=time.monotonic())
            assert withdrawn and seconds > 0
            with pytest.raises(RequestWithdrawn):
                await late
            assert await asyncio.gather(*ahead) == [64, 64, 64]
            assert await kept >= 1
            assert await eng.withdraw("a0", by=time.monotonic()) == (False, None)   # finished: unknown
            decoding = eng.generate([7] * 40, SamplingParams(max_tokens=32, ignore_eos=True), "decoding")
            await decoding.__anext__()   # its first token: no longer withdrawable, whatever the deadline
            assert await eng.withdraw("decoding", by=time.monotonic()) == (False, None)
            assert await drain(decoding) >= 1
            assert eng.get_stats().num_waiting == 0 and eng.get_stats().num_running == 0
        finally:
            await eng.shutdown()

    asyncio.run(main())
