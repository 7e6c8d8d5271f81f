"""The OpenAI chunk codec (gateway/translate/chat_events.py): an upstream's events decoded once into ``ChatEvent``
values, and written back under the gateway's id and public model."""

from __future__ import annotations

import asyncio
import json

from gateway.sse import Last, event
from gateway.translate.chat_events import ChatEncoder, decode_event, decode_stream
from gateway.values import DONE, MALFORMED, ChatEvent, ChoiceDelta, ToolCallDelta, error_event

CHUNK = {"id": "up-1", "object": "chat.completion.chunk", "created": 7, "model": "upstream-model",
         "system_fingerprint": "fp", "obfuscation": "xyz",
         "choices": [{"index": 0, "delta": {"reasoning_content": "hm", "tool_calls": [
             {"index": 1, "id": "call_b", "type": "function", "function": {"name": "f", "arguments": "{\"a\""}}]},
             "logprobs": None, "finish_reason": None, "token_ids": [5, 6]}]}


def test_a_chunk_is_read_into_the_event_fields():
    ev = decode_event(json.dumps(CHUNK).encode())
    assert ev.kind == "content" and (ev.id, ev.model, ev.created, ev.system_fingerprint) == ("up-1", "upstream-model",
                                                                                              7, "fp")
    c = ev.choices[0]
    assert (c.index, c.reasoning, c.content, list(c.token_ids)) == (0, "hm", None, [5, 6])
    assert c.tool_calls == (ToolCallDelta(1, "call_b", "function", "f", '{"a"'),)


def test_the_kinds_the_attempt_loop_reads():
    assert decode_event(b"[DONE]") is DONE and decode_event(b" [DONE] ") is DONE
    assert decode_event(b"not json").kind == "malformed" and decode_event(b"[1]") is MALFORMED
    assert decode_event(b'{"error": {"message": "x"}}').kind == "error"
    assert decode_event(b'{"choices": [{"index": 0, "delta": {"role": "assistant"}}]}').kind == "meta"
    assert decode_event(b'{"choices": [], "usage": {"prompt_tokens": 1}}').usage == {"prompt_tokens": 1}
    assert decode_event(b'{"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}').kind == "content"
    assert decode_event(b'{"choices": [{"index": 0, "text": "hi"}]}').choices[0].content == "hi"   # completions
    assert decode_event(b'{"choices": [{"index": 0, "delta": {"reasoning": "r"}}]}').choices[0].reasoning == "r"


def test_odd_shapes_are_read_loosely_and_invalid_utf8_replaced():
    ev = decode_event(b'{"choices": [{"index": 0, "delta": "odd"}, {"index": 1, "finish_reason": "stop"}]}')
    assert [c.index for c in ev.choices] == [0, 1] and ev.kind == "content"
    ev = decode_event(b'{"choices": [{"index": 0, "delta": {"content": "a\xffb"}}]}')
    assert ev.choices[0].content == "a\ufffdb"


def test_the_encoder_writes_the_gateways_id_and_model_and_keeps_the_rest():
    ev = decode_event(json.dumps(CHUNK).encode())
    enc = ChatEncoder("chatcmpl-gw-1", "public")
    out = json.loads(enc.payload(ev))
    assert (out["id"], out["model"], out["created"], out["system_fingerprint"]) == ("chatcmpl-gw-1", "public", 7, "fp")
    assert "obfuscation" not in out
    choice = out["choices"][0]
    assert choice == {"index": 0, "delta": {"reasoning_content": "hm", "tool_calls": [
        {"index": 1, "id": "call_b", "type": "function", "function": {"name": "f", "arguments": "{\"a\""}}]},
        "logprobs": None, "finish_reason": None, "token_ids": [5, 6]}
    assert decode_event(enc.payload(ev)) == ChatEvent(ev.choices, id="chatcmpl-gw-1", model="public", created=7,
                                                      object="chat.completion.chunk", system_fingerprint="fp")
    assert enc.encode([DONE]) == b"data: [DONE]\n\n" and isinstance(enc.encode([DONE]), Last)
    err = error_event("boom\nline 2")     # a read's bytes: each event's payload framed as ``event`` writes it
    batch = enc.encode([ev, err, ev])
    assert batch == event(enc.payload(ev)) + event(enc.payload(err)) + event(enc.payload(ev))
    assert not isinstance(batch, Last) and isinstance(enc.encode([ev, DONE]), Last)
    assert json.loads(enc.payload(error_event("boom", code="c")))["error"]["code"] == "c"
    text = ChatEncoder("cmpl-1", "m", chat=False).payload(ChatEvent((ChoiceDelta(0, content="hi"),)))
    assert json.loads(text)["choices"][0]["text"] == "hi" and json.loads(text)["object"] == "text_completion"


def test_a_stream_is_read_per_read_with_empty_reads_for_comments_and_the_cut_tail():
    async def chunks():
        yield b": keep-alive\n\n"
        yield b'data: {"choices": [{"index": 0, "delta": {"content": "a"}}]}\n\ndata: {"choi'
        yield b'ces": [{"index": 0, "delta": {"content": "b"}, "finish_reason": "stop"}]}'

    async def read():
        return [batch async for batch in decode_stream(chunks())]

    batches = asyncio.run(read())
    assert [[e.choices[0].content for e in b] for b in batches] == [[], ["a"], [], ["b"]]
