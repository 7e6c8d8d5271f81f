"""The end of a streamed answer (issue 48): the response body ends with the ``[DONE]`` event (``gateway.sse.Last``:
HTTP/1.1's final chunk in the same send), and the layers below (the upstream closed, outcomes recorded, the usage
accounted) finish after it. Every stream still ends in one terminated body and one usage record, also when the
client leaves as soon as it has its answer; a budget is settled before ``[DONE]`` is sent (the tenant's next
request is admitted against it).

Real parts: ``stream_body`` over ASGI callables; the attempt loop's ``relay`` with its ``StreamEnd``; a gateway (the Litestar app under uvicorn, in this process) on the
fault-injecting upstream, read by a raw HTTP/1.1 client that closes its socket at the body's end."""

from __future__ import annotations

import asyncio
import json

import pytest

from gateway.billing.usage import Budget
from gateway.config.compile import load_config_text
from gateway.http.app import create_app
from gateway.http.transport import stream_body
from gateway.resilience.outcomes import Result, UpstreamResponse
from gateway.resilience.streaming import Held, StreamEnd, relay
from gateway.runtime import Gateway
from gateway.sse import DONE, Last
from gateway.values import DONE as DONE_EVENT
from gateway.values import ChatEvent, ChoiceDelta
from tests.gateway.fault_upstream import FaultUpstream
from tests.gateway.http.test_messages import KEY, config, records
from tests.gateway.support import serve_app


async def test_the_last_chunk_ends_the_body_before_the_stream_cleans_up_and_a_leaving_client_cancels_nothing():
    sent: list[dict] = []
    ended = asyncio.Event()              # the body's final event was sent: the client then leaves
    release = asyncio.Event()            # the test lets the iterator's cleanup go on
    cleanup: list[str] = []

    async def send(message: dict) -> None:
        sent.append(message)
        if not message["more_body"]:
            ended.set()

    async def receive() -> dict:
        await ended.wait()
        return {"type": "http.disconnect"}

    async def chunks():
        try:
            yield b"data: {}\n\n"
            yield Last(DONE)
            cleanup.append("after the last chunk")
        except asyncio.CancelledError:
            cleanup.append("cancelled")
            raise
        finally:
            await release.wait()         # the upstream closed, the usage accounted ...
            cleanup.append("finally")

    task = asyncio.create_task(stream_body(chunks(), send, receive))
    await ended.wait()
    assert [(m["body"], m["more_body"]) for m in sent] == [(b"data: {}\n\n", True), (DONE, False)]
    assert cleanup == ["after the last chunk"]           # the body ended before the stream's cleanup ran
    await asyncio.sleep(0.05)                            # the client's disconnect arrives meanwhile
    release.set()
    await task
    assert cleanup == ["after the last chunk", "finally"] and len(sent) == 2


@pytest.mark.parametrize("probe", [False, True])
async def test_a_stream_settles_before_its_done_goes_downstream_and_ends_after(probe):
    """``StreamEnd``: the token reservations' reconcile (``finished``) and a probe's outcome before the batch with
    ``[DONE]`` is yielded (the client's next request must find them done); the upstream closed and a plain
    outcome recorded once the stream has ended; each once."""
    calls: list[str] = []

    async def record(ok, status, retry_after, probe_, latency_s, ttft_s, reason=""):
        calls.append(f"record ok={ok} probe={probe_}")

    async def finished(res):
        calls.append(f"finished usage={res.usage}")

    async def closed():
        calls.append("closed")

    async def rest():
        yield [ChatEvent((ChoiceDelta(0, content="b", finish_reason="stop"),)),
               ChatEvent(usage={"total_tokens": 3}), DONE_EVENT]

    res = Result(200)
    held = Held([ChatEvent((ChoiceDelta(0, content="a"),))], [], rest(), UpstreamResponse(200, aclose=closed), False)
    end = StreamEnd(held.resp, res, probe, 0.0, record, finished)
    seen = []
    async for batch in relay(res, held, 5.0, True, end.end, None, end.settle):
        seen.append((batch[-1].done, list(calls)))
    settled = ["record ok=True probe=True"] if probe else []
    settled.append("finished usage={'total_tokens': 3}")
    assert seen == [(False, []), (True, settled)]
    assert calls == settled + ["closed"] + ([] if probe else ["record ok=True probe=False"])


async def _stream_and_leave(url: str) -> bytes:
    """One streamed chat request over a raw HTTP/1.1 connection, read to the chunked body's end, then the socket
    closed at once (as a client that has its answer and leaves); the raw response."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    body = json.dumps({"model": "m1", "stream": True, "messages": [{"role": "user", "content": "hi"}]}).encode()
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
                 b"authorization: Bearer " + KEY.encode() + b"\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
    await writer.drain()
    raw = b""
    while not raw.endswith(b"\r\n0\r\n\r\n"):
        more = await asyncio.wait_for(reader.read(65536), 10)
        assert more, raw
        raw += more
    writer.close()
    return raw


@pytest.mark.parametrize("budget", [False, True])
async def test_a_stream_ends_at_its_done_and_is_accounted_once_when_its_client_leaves_at_once(budget):
    up = FaultUpstream().start()
    cfg = config(up) + ("budgets:\n  tenants:\n    t1: {usd: 100, period: day}\n" if budget else "")
    gw = Gateway(None, load_config_text(cfg), start_engine=False)
    server, task, url = await serve_app(create_app(gw))
    try:
        for n in (1, 2):
            raw = await _stream_and_leave(url)
            assert raw.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in raw.lower()
            assert raw.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
            if budget:   # settled before [DONE] was sent: spent, nothing still reserved, once the client has it
                spent, reserved, _ = await gw.usage.budget_state("t1", Budget(100, "day"))
                assert (spent > 0, reserved) == (True, 0)
            recs = await records(gw, n)
            await asyncio.sleep(0.1)                         # nothing accounts it a second time
            assert len(await gw.usage.records("t1")) == n
        assert sorted((r.prompt_tokens, r.completion_tokens, r.estimated, r.disconnected)
                      for r in recs.values()) == [(5, 3, False, False)] * 2
    finally:
        server.should_exit = True
        await task
        up.stop()


async def test_a_stream_committed_after_a_drains_sweep_ends_at_its_first_read():
    """A load trial: the drain ended the streams open at its sweep; ten streams queued in the engine under
    preemption got their first token after it and ran on until the server's exit cancelled them (no event, no
    usage record). A stream committed after the sweep ends at its first read with the shutdown's event."""
    from gateway.resilience.streaming import GATEWAY_SHUTDOWN, OpenStreams

    streams = OpenStreams()
    assert streams.interrupt(GATEWAY_SHUTDOWN) == 0          # nothing open at the sweep
    never = asyncio.Event()

    async def rest():                                         # an engine that would not answer again in time
        await never.wait()
        yield []

    async def nothing(*args, **kw):
        return None

    res = Result(200)
    held = Held([ChatEvent((ChoiceDelta(0, content="a"),))], [], rest(), UpstreamResponse(200), False)
    batches = [b async for b in relay(res, held, 60.0, True, nothing, streams, None)]
    last = batches[-1][-1]
    assert len(batches) == 2 and [e.choices[0].content for e in batches[0]] == ["a"]   # what it had, then the event
    assert last.error["code"] == "stream_interrupted" and GATEWAY_SHUTDOWN in last.error["message"], last
    assert res.error == GATEWAY_SHUTDOWN and not never.is_set()
