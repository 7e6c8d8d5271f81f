"""Settlement of a whole (non-streamed) request its client left (issue 26), driven through ``Observability``'s
events as the request path sends them (``begin``, ``note``, ``admitted``, the attempt hook, ``abandon``), with a
gateway's real config snapshot and usage ledger and no HTTP: the two orders the HTTP layer cannot pin, a cancel
that races the answer and a cancel that carries the engine's count."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from gateway.billing.prices import Price, cost_nusd
from gateway.billing.usage import UsageRecord
from gateway.config.compile import load_config_text
from gateway.resilience.outcomes import UpstreamResponse, settle_outcome
from gateway.runtime import Gateway

CONFIG = """reload: {watch: false}
resilience: {health: {interval_s: 0}}
observability: {logs: {requests: false}}
models:
  - name: m1
backends:
  up:
    type: openai
    base_url: http://127.0.0.1:9/v1
    prices: {input: 1, output: 2}
routes:
  r1:
    targets: [{backend: up}]
policy: {default_route: r1}
"""
PRICE = Price(1.0, 2.0)
USAGE = {"prompt_tokens": 20, "completion_tokens": 300, "total_tokens": 320}


@pytest.fixture
async def gw():
    g = Gateway(None, load_config_text(CONFIG), start_engine=False)
    await g.start()
    yield g
    await g.stop()


def _routed(gw, rid: str):
    """A request through ``begin``/``note``/``admitted``: its record and its attempt hook."""
    rec = gw.obs.begin(rid, "chat/completions", {})
    req = SimpleNamespace(request_id=rid, tenant="t1", public_model="m1", model="m1", stream=False, max_tokens=None,
                          prompt_tokens=6, body={"model": "m1", "messages": [{"role": "user", "content": "hello"}]})
    gw.obs.note(req, SimpleNamespace(route="r1", rule=""))
    return rec, gw.obs.admitted(rid)


CANDIDATE = SimpleNamespace(target=SimpleNamespace(backend="up"), name="up/m1")


async def _one_record(gw) -> object:
    for _ in range(500):                 # settles run in a task once the request ends (a liveness bound)
        if recs := await gw.usage.records("t1"):
            assert len(recs) == 1, recs
            return next(iter(recs.values()))
        await asyncio.sleep(0.01)
    raise AssertionError("no usage record")


async def test_a_cancel_that_races_the_answer_bills_the_answer_once(gw):
    """The backend answered, then the client's disconnect won (``unless_disconnected`` drops the answer): the
    answer's own usage is billed once, marked disconnected; a second ``abandon`` adds nothing."""
    rec, hook = _routed(gw, "race")

    async def answered(_c):
        return UpstreamResponse(200, {}, json.dumps({"choices": [], "usage": USAGE}).encode())

    settle_outcome(await hook(answered)(CANDIDATE), "ok")   # as the attempt loop does once it read the answer
    gw.obs.abandon(rec)
    gw.obs.abandon(rec)
    got = await _one_record(gw)
    assert (got.backend, got.prompt_tokens, got.completion_tokens, got.estimated, got.disconnected) == (
        "up", 20, 300, False, True)
    assert got.nusd == cost_nusd(PRICE, 20, 300)


async def test_a_cancel_carrying_the_engines_count_bills_it(gw):
    """A call cancelled with the usage the local engine's serving layer attaches (``PARTIAL_USAGE``) is billed
    that count, exact, marked disconnected."""
    from engine.serving.serving import PARTIAL_USAGE

    rec, hook = _routed(gw, "cut")

    async def cut(_c):
        exc = asyncio.CancelledError()
        setattr(exc, PARTIAL_USAGE, USAGE)
        raise exc

    with pytest.raises(asyncio.CancelledError):
        await hook(cut)(CANDIDATE)
    gw.obs.abandon(rec)
    got = await _one_record(gw)
    assert (got.prompt_tokens, got.completion_tokens, got.estimated, got.disconnected) == (20, 300, False, True)


async def test_a_client_gone_after_a_failed_call_is_not_billed(gw):
    """The last call failed (no answer to bill) when the client left: the accepted request's one record is a
    failed one, of no tokens and no cost, on the backend tried, marked disconnected."""
    rec, hook = _routed(gw, "failed")

    async def failed(_c):
        return UpstreamResponse(500, {}, b'{"error": {"message": "boom"}}')

    await hook(failed)(CANDIDATE)
    gw.obs.abandon(rec)
    got = await _one_record(gw)
    assert got == UsageRecord("failed", "t1", "none", 0, 0, 0, 0, disconnected=True, failed=True)


async def test_a_whole_answer_is_accounted_once_after_its_finish(gw):
    """Without a budget, ``finish`` ends the record at once and accounts it in a task (the answer is sent
    meanwhile): the HTTP layer's ``abandon`` that follows (its ``finally``, before the send) neither bills it
    again nor marks it disconnected, and the one record is the answer's own usage."""
    rec, hook = _routed(gw, "whole")
    body = json.dumps({"model": "m1", "choices": [], "usage": USAGE}).encode()

    async def answered(_c):
        return UpstreamResponse(200, {}, body)

    await hook(answered)(CANDIDATE)
    assert await gw.obs.finish(rec, "up", 200, body) == body
    gw.obs.abandon(rec)
    got = await _one_record(gw)
    assert (got.backend, got.prompt_tokens, got.completion_tokens, got.estimated, got.disconnected) == (
        "up", 20, 300, False, False)
    await asyncio.wait(set(gw.obs._tasks) or {asyncio.ensure_future(asyncio.sleep(0))})
    assert len(await gw.usage.records("t1")) == 1
