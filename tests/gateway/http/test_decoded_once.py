"""Issue 48: an upstream's streamed event is decoded once, at the edge (``gateway.translate.chat_events.
decode_event``), and every layer after it reads the decoded ``ChatEvent``: here with the response cache, shadow
traffic, resume and the Responses API's translation all on, through real HTTP (the gateway on 127.0.0.1 in this
process, fault-injecting upstreams, the official openai SDK). A spy counts the decodes: every event the upstreams
sent (the client's stream, cut and resumed on another target, and both shadow sides) is decoded exactly once, and
the cached answer's replay decodes nothing."""

from __future__ import annotations

import asyncio
from collections import Counter

import openai

from gateway.config.compile import load_config_text
from gateway.http.app import create_app
from gateway.runtime import Gateway
from gateway.translate import chat_events
from tests.gateway.fault_upstream import FaultUpstream
from tests.gateway.support import serve_app


def config(a: FaultUpstream, b: FaultUpstream, cand: FaultUpstream) -> str:
    backends = "".join(f"  {u.name}:\n    type: openai\n    base_url: {u.base_url}\n" for u in (a, b, cand))
    return ("reload: {watch: false}\nresilience:\n  health: {interval_s: 0}\n"
            "observability:\n  logs: {requests: false}\n"
            f"models:\n  - name: m1\nbackends:\n{backends}"
            "routes:\n  main:\n    targets: [{backend: a}]\n    fallbacks: [{backend: b}]\n"
            "    resume: true\n    cache: {mode: best_effort}\n"
            "    shadow: {target: cand, percent: 100, max_concurrency: 4}\n"
            "policy:\n  default_route: main\n")


async def ask(client: openai.AsyncOpenAI) -> tuple[str, str, str]:
    """(x-tandem-cache, x-request-id, the streamed response's text) of one streamed Responses request."""
    async with client.responses.with_streaming_response.create(model="m1", input="hi", stream=True) as r:
        text = ""
        async for ev in await r.parse():
            if ev.type == "response.output_text.delta":
                text += ev.delta
            last = ev.type
        assert last == "response.completed"
        return r.headers["x-tandem-cache"], r.headers["x-request-id"], text


async def test_each_streamed_event_is_decoded_once_with_cache_shadow_resume_and_a_translator(monkeypatch):
    decoded: list[bytes] = []
    decode = chat_events.decode_event

    def spy(data: bytes):
        decoded.append(bytes(data))
        return decode(data)

    monkeypatch.setattr(chat_events, "decode_event", spy)
    a, b, cand = FaultUpstream("a").start(), FaultUpstream("b").start(), FaultUpstream("cand").start()
    a.set_default({"stamp": True, "token_ids": True, "chunks": 4, "cut_after": 2})    # cut: resumed on b
    b.set_default({"stamp": True, "token_ids": True, "chunks": 2})
    cand.set_default({"stamp": True, "token_ids": True})
    gw = Gateway(None, load_config_text(config(a, b, cand)))
    server, task, url = await serve_app(create_app(gw))
    try:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        cache, rid, text = await ask(client)
        assert cache == "miss" and text == "tok0 tok1 tok0 tok1 "       # a's two tokens, then b's continuation
        while gw.shadows.tasks:                                          # both shadow sides read to their end
            await asyncio.sleep(0.02)
        await gw.cache.drain()
        sent = a.sent + b.sent + cand.sent
        ours = [d for d in sent if f"chatcmpl-{rid}\"".encode() in d]
        assert a.calls == 2 and b.calls == 1 and cand.calls == 1        # client + shadow primary; resume; shadow
        assert len(ours) == 3 + 5 and any(b"-shadow/main-" in d for d in sent)   # a: role, 2 tokens; b: role,
        #                                                                      2 tokens, finish, usage
        assert Counter(decoded) == Counter(sent)                         # every event sent, decoded once

        before = (len(decoded), a.calls, b.calls, cand.calls)
        cache, _, again = await ask(client)
        await asyncio.sleep(0.1)
        assert (cache, again) == ("hit", text) and not gw.shadows.tasks  # a hit: replayed, never shadowed
        assert (len(decoded), a.calls, b.calls, cand.calls) == before     # ... and nothing decoded again
    finally:
        server.should_exit = True
        await task
        for u in (a, b, cand):
            u.stop()
