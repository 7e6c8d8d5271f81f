"""AsyncEngine: background step loop, delta streams, aborts, fault isolation, drain.

One engine (SmolLM2) per module, started with ``asyncio.run`` so that each
test's own event loop can use it (streams are delivered to the loop that reads them).
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from engine.async_engine import AsyncEngine, EngineDeadError, EngineDrainingError
from engine.config import EngineArgs
from engine.sampling_params import RequestOutputKind, SamplingParams

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def engine():
    eng = AsyncEngine(EngineArgs(kv_cache_memory="64MiB", max_model_len=512))
    asyncio.run(eng.start())
    yield eng
    if eng.ready:
        asyncio.run(eng.shutdown(drain=False))


async def wait_idle(eng: AsyncEngine, timeout: float = 30.0) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        s = eng.get_stats()
        if s.num_running == 0 and s.num_waiting == 0 and s.kv_cache_usage == 0.0 and s.tokens_in_flight == 0:
            return True
        await asyncio.sleep(0.02)
    return False


async def collect(eng: AsyncEngine, prompt, params: SamplingParams, request_id: str):
    outs = []
    async for out in eng.generate(prompt, params, request_id):
        outs.append(out)
    return outs


async def test_deltas_concatenate_to_the_completion(engine):
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    outs = await collect(engine, PROMPT, params, "delta-1")
    assert outs[-1].finished and all(not o.finished for o in outs[:-1])
    tokens = [t for o in outs for c in o.outputs for t in c.token_ids]
    assert len(tokens) == 6 and outs[-1].outputs[-1].finish_reason == "length"
    text = "".join(c.text for o in outs for c in o.outputs)
    assert text == engine.tokenizer.decode(tokens, skip_special_tokens=True)
    # Same prompt as token ids, greedy: same tokens.
    ids = engine.tokenizer.encode(PROMPT, add_special_tokens=True)
    again = await collect(engine, ids, params, "delta-2")
    assert [t for o in again for c in o.outputs for t in c.token_ids] == tokens
    assert await wait_idle(engine)


async def test_streams_carry_what_output_kind_asks(engine):
    """vLLM's ``output_kind`` (a trial's "unexpected keyword argument"): FINAL_ONLY streams one output, every
    choice whole; CUMULATIVE each choice whole so far; DELTA, the default, what is new."""
    params = dict(max_tokens=6, temperature=0, ignore_eos=True, n=2)
    deltas = await collect(engine, PROMPT, SamplingParams(**params), "kind-delta")
    text = {i: "".join(c.text for o in deltas for c in o.outputs if c.index == i) for i in (0, 1)}
    tokens = {i: [t for o in deltas for c in o.outputs if c.index == i for t in c.token_ids] for i in (0, 1)}
    (final,) = await collect(engine, PROMPT, SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY, **params),
                             "kind-final")
    assert final.finished and [(c.index, c.text, c.token_ids) for c in final.outputs] == [
        (i, text[i], tokens[i]) for i in (0, 1)]
    cumulative = await collect(engine, PROMPT, SamplingParams(output_kind=RequestOutputKind.CUMULATIVE, **params),
                               "kind-cumulative")
    assert len(cumulative) > 1 and cumulative[-1].finished
    last = {}
    for out in cumulative:
        for c in out.outputs:
            assert tokens[c.index][:len(c.token_ids)] == c.token_ids and text[c.index].startswith(c.text)
            assert len(c.token_ids) > len(last.get(c.index, ()))
            last[c.index] = c.token_ids
    assert last == tokens
    assert await wait_idle(engine)


async def test_concurrent_requests_and_n_choices(engine):
    params = [SamplingParams(max_tokens=5, temperature=0.8, seed=i, ignore_eos=True, n=1 + i % 2) for i in range(4)]
    results = await asyncio.gather(*(collect(engine, PROMPT, p, f"conc-{i}") for i, p in enumerate(params)))
    for p, outs in zip(params, results):
        per_index = {}
        for o in outs:
            for c in o.outputs:
                per_index.setdefault(c.index, []).extend(c.token_ids)
        assert sorted(per_index) == list(range(p.n))
        assert all(len(v) == 5 for v in per_index.values())
    assert await wait_idle(engine)


async def test_consumer_that_stops_iterating_aborts_the_request(engine):
    params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    stream = engine.generate(PROMPT, params, "walk-away")
    async with contextlib.aclosing(stream):
        async for out in stream:
            if out.outputs[0].num_generated_tokens >= 3:
                assert engine.get_stats().num_running == 1
                break
    assert await wait_idle(engine)


async def test_cancelled_task_aborts_the_request(engine):
    started = asyncio.Event()

    async def consume():
        async for _ in engine.generate(PROMPT, SamplingParams(max_tokens=400, ignore_eos=True), "cancel-me"):
            started.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(started.wait(), 60)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await wait_idle(engine)


async def test_abort_ends_the_stream_and_frees_blocks(engine):
    outs = []

    async def consume():
        async for out in engine.generate(PROMPT, SamplingParams(max_tokens=400, ignore_eos=True, n=2), "abort-me"):
            outs.append(out)

    task = asyncio.create_task(consume())
    while not outs:
        await asyncio.sleep(0.01)
    await engine.abort("abort-me")
    s = engine.get_stats()
    assert s.num_running == 0 and s.kv_cache_usage == 0.0  # freed when abort() returns
    await asyncio.wait_for(task, 30)
    assert outs[-1].finished
    assert {c.index for c in outs[-1].outputs} == {0, 1}
    assert all(c.finish_reason == "abort" for c in outs[-1].outputs)


async def test_bad_requests_fail_alone(engine):
    with pytest.raises(ValueError, match="empty"):
        await collect(engine, [], SamplingParams(max_tokens=2), "bad-empty")
    with pytest.raises(ValueError, match="maximum context length"):
        await collect(engine, list(range(600)), SamplingParams(max_tokens=2), "bad-long")
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    gen = engine.generate(PROMPT, params, "dup")
    first = await gen.__anext__()
    assert first.request_id == "dup"
    with pytest.raises(ValueError, match="already in use"):
        await collect(engine, PROMPT, params, "dup")
    await gen.aclose()
    outs = await collect(engine, PROMPT, SamplingParams(max_tokens=3, ignore_eos=True), "after-bad")
    assert outs[-1].finished
    assert await wait_idle(engine)


@pytest.fixture(scope="module")
def thread_engine():
    """The core in a thread of this process (``engine_core_process=False``): its step can be patched."""
    eng = AsyncEngine(EngineArgs(kv_cache_memory="64MiB", max_model_len=512, engine_core_process=False))
    asyncio.run(eng.start())
    yield eng
    asyncio.run(eng.shutdown(drain=False))


async def test_a_failing_step_fails_its_requests_but_not_the_loop(thread_engine, monkeypatch):
    engine = thread_engine
    real_step = engine.engine.step
    calls = {"n": 0}

    def flaky_step():  # fault injector: the third step raises
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected fault")
        return real_step()

    monkeypatch.setattr(engine.engine, "step", flaky_step)
    with pytest.raises(RuntimeError, match="injected fault"):
        await collect(engine, PROMPT, SamplingParams(max_tokens=20, ignore_eos=True), "victim")
    assert await wait_idle(engine)
    outs = await collect(engine, PROMPT, SamplingParams(max_tokens=3, ignore_eos=True), "survivor")
    assert outs[-1].finished and outs[-1].outputs[-1].finish_reason == "length"
    assert engine.is_alive


async def test_stats_report_live_signals(engine):
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    stream = engine.generate(PROMPT, params, "stats")
    async with contextlib.aclosing(stream):
        async for out in stream:
            if out.outputs[0].num_generated_tokens >= 2:
                s = engine.get_stats()
                assert s.num_running == 1 and s.kv_cache_usage > 0
                assert s.tokens_in_flight >= len(out.prompt_token_ids) + 2
                assert 0.0 <= s.prefix_cache_hit_rate <= 1.0
                break
    assert await wait_idle(engine)


async def test_an_embed_call_its_caller_left_stops_and_frees_its_blocks(engine):
    """A trial's client gave up on two 6,000-token embeddings: the core prefilled them to the end for nobody,
    holding KV blocks ~85 s. Cancelling the caller's task aborts the call's pooling requests: the core goes
    idle having computed only part of the prompts; vLLM's metrics count each prompt as an aborted request (a
    capacity trial: no trace of it)."""
    from prometheus_client import CollectorRegistry

    from engine.metrics import EngineMetrics
    registry = CollectorRegistry()
    EngineMetrics(registry, engine, "m").attach()

    def finished(reason: str) -> float:
        return registry.get_sample_value("vllm:request_success_total", {"model_name": "m", "finished_reason": reason})

    prompts = [[100 + (i * 131 + j * 7) % 40000 for j in range(480)] for i in range(48)]   # 23,040 tokens: ~45 steps
    before = engine.get_stats().prompt_tokens_total
    task = asyncio.create_task(engine.embed(prompts))
    while engine.get_stats().prompt_tokens_total == before and not task.done():   # the first chunk was computed
        await asyncio.sleep(0.005)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await wait_idle(engine)
    assert engine.get_stats().prompt_tokens_total - before < sum(map(len, prompts))
    assert (finished("abort"), finished("stop")) == (48, 0)
    vectors = await engine.embed(prompts[:1])   # the engine serves embeddings after it
    assert len(vectors) == 1 and len(vectors[0]) > 0
    assert (finished("abort"), finished("stop")) == (48, 1)


async def test_graceful_drain_finishes_running_requests(engine):
    """Last in the module: it shuts the shared engine down."""
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    running = asyncio.create_task(collect(engine, PROMPT, params, "drained"))
    while engine.get_stats().num_running == 0:
        await asyncio.sleep(0.01)
    stops = []
    stop = engine._client.shutdown
    engine._client.shutdown = lambda: (stops.append(1), stop())[1]
    shutdown = asyncio.create_task(engine.shutdown(drain=True, timeout=120))
    await asyncio.sleep(0)
    # a second call (tandem engine serve's app shutdown after its signal's drain) joins the first
    again = asyncio.create_task(engine.shutdown(drain=True, timeout=120))
    with pytest.raises(EngineDrainingError):
        await collect(engine, PROMPT, params, "too-late")
    outs = await running
    assert outs[-1].finished and outs[-1].outputs[-1].finish_reason == "length"
    assert sum(len(c.token_ids) for o in outs for c in o.outputs) == 8
    await shutdown
    await again
    assert not engine.is_alive and stops == [1]      # the core stopped once
    with pytest.raises(EngineDeadError):
        await collect(engine, PROMPT, params, "dead")
