"""When a stream is not resumed (``gateway/resilience/resume.py``): its events carried no token ids (an
aggregator), a choice had finished, the gateway is draining, or the resumes are spent; and the token ids the
gateway asked for are removed from what the client sees. The resumed path end to end, with real replicas:
``test_resume.py``."""

from __future__ import annotations

import asyncio
import json

from gateway.resilience.resume import ResumePlan, resumable
from gateway.resilience.streaming import GATEWAY_SHUTDOWN, SHUTDOWN_TYPE
from gateway.sse import event
from gateway.translate.chat_events import ChatEncoder, decode_stream, error_payload
from gateway.values import Answer, GatewayRequest

REQ = GatewayRequest(endpoint="chat/completions", body={"messages": [], "stream": True}, stream=True, model="m",
                     priority=0, user=None, metadata=None, max_tokens=None, has_tools=False,
                     has_response_format=False, local_unsupported=None)


def chunk(text: str, ids: list[int] | None = None, finish: str | None = None, index: int = 0,
          fingerprint: str | None = None) -> bytes:
    choice = {"index": index, "delta": {"content": text}, "finish_reason": finish}
    if ids is not None:
        choice["token_ids"] = ids
    return event(json.dumps({"id": "x", "choices": [choice], "system_fingerprint": fingerprint}).encode())


def gen(*parts: bytes):
    """The events of SSE ``parts``, as a backend's stream."""
    async def raw():
        for p in parts:
            yield p

    return decode_stream(raw())


def error_event(message: str, code: str, type_: str = "upstream_error") -> bytes:
    return event(error_payload({"message": message, "type": type_, "param": None, "code": code}))


def run(first: list[bytes], then: list[bytes] | None = None, attempts: int = 1, client_ids: bool = False):
    """(bytes the client got, the continuations asked for)."""
    calls = []

    async def call(req, failed):
        calls.append((req.body["resume_token_ids"], list(failed)))
        return Answer(200, stream=gen(*(then or [])), backend="r2")

    async def main():
        plan = ResumePlan(attempts, client_ids, 1)
        out = resumable(gen(*first), "r1", plan, REQ, call)
        return b"".join([c async for c in ChatEncoder("x", "m").stream(out)])

    return asyncio.run(main()), calls


CUT = error_event("stream interrupted: upstream connection failed", code="stream_interrupted")


def test_resumed_with_the_tokens_so_far_and_ids_removed():
    out, calls = run([chunk("ab", [1, 2]), chunk("c", [3]), CUT], [chunk("d", [4], "stop"), b"data: [DONE]\n\n"])
    assert calls == [([[1, 2, 3]], ["r1"])]
    assert b"stream_interrupted" not in out and b"token_ids" not in out and out.endswith(b"data: [DONE]\n\n")
    kept, _ = run([chunk("ab", [1, 2]), chunk("c", [3], "stop")], client_ids=True)
    assert b'"token_ids": [1, 2]' in kept or b'"token_ids":[1,2]' in kept     # the client asked for them


def test_cut_as_before_when_it_cannot_resume():
    no_ids = run([chunk("ab"), CUT])                                  # an aggregator: no token ids
    finished = run([chunk("ab", [1, 2], "stop", index=0), CUT])       # a choice had finished
    drain = run([chunk("ab", [1, 2]), error_event(f"stream interrupted: {GATEWAY_SHUTDOWN}",   # as a drain writes it
                                                   code="stream_interrupted", type_=SHUTDOWN_TYPE)])
    spent = run([chunk("ab", [1, 2]), CUT], attempts=0)
    for out, calls in (no_ids, finished, drain, spent):
        assert calls == [] and b"stream_interrupted" in out


def test_cut_when_the_continuation_fails_and_when_resumes_run_out():
    calls = []

    async def call(req, failed):
        calls.append(list(failed))
        if len(calls) == 1:
            return Answer(200, stream=gen(chunk("c", [3]), CUT), backend="r2")
        return Answer(503, b'{"error": "none left"}')

    async def main():
        plan = ResumePlan(2, False, 1)
        out = resumable(gen(chunk("ab", [1, 2]), CUT), "r1", plan, REQ, call)
        return b"".join([c async for c in ChatEncoder("x", "m").stream(out)])

    out = asyncio.run(main())
    assert calls == [["r1"], ["r1", "r2"]]
    assert out.count(b"stream_interrupted") == 1 and out.endswith(b'"code":"stream_interrupted"}}\n\n')


def test_a_continuation_of_another_build_is_never_joined_to_the_stream():
    """A trial resumed a native (AVX-512) replica's answer on an AVX2 replica: another build computes other bits,
    and the client got two answers joined. A continuation whose system_fingerprint is not the stream's is closed
    before any of its events is sent and the next target asked; none left: the cut, as before."""
    calls, resumed = [], []

    async def call(req, failed):
        calls.append(list(failed))
        if len(calls) == 1:
            return Answer(200, stream=gen(chunk("X", [9], fingerprint="fp_avx2")), backend="r2")
        return Answer(200, stream=gen(chunk("c", [3], "stop", fingerprint="fp_native"), b"data: [DONE]\n\n"),
                      backend="r3")

    async def main(attempts):
        plan = ResumePlan(attempts, False, 1)
        out = resumable(gen(chunk("ab", [1, 2], fingerprint="fp_native"), CUT), "r1", plan, REQ, call,
                        on_resumed=lambda cut, on: resumed.append((cut, on)))
        return b"".join([c async for c in ChatEncoder("x", "m").stream(out)])

    out = asyncio.run(main(2))
    assert calls == [["r1"], ["r1", "r2"]] and resumed == [("r2", "r3")]
    assert b'"X"' not in out and b"stream_interrupted" not in out and out.endswith(b"data: [DONE]\n\n")
    calls.clear(), resumed.clear()
    out = asyncio.run(main(1))   # one resume only: the foreign continuation is dropped, the stream cut
    assert calls == [["r1"]] and resumed == []
    assert b'"X"' not in out and out.count(b"stream_interrupted") == 1
