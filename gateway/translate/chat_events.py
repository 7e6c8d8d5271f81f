"""OpenAI's chat/completions stream chunks <-> ``ChatEvent`` (``gateway/values.py``): the codec of the OpenAI wire
format on both edges. ``decode_event`` is the one place an upstream's streamed event is decoded (an SSE event's
data, once: ``decode_stream`` reads an upstream's SSE bytes into a ``ChatStream``); ``ChatEncoder`` writes events
back as the client's SSE (OpenAI chat/completions or completions chunks) under the gateway's answer ``id`` and
the public ``model``.

The event keeps what OpenAI's chunk schema and vLLM's extras define (``id``, ``object``, ``created``, ``model``,
``system_fingerprint``, ``service_tier``, ``usage``, ``error``; per choice ``index``, the delta's ``role``,
``content``, ``reasoning_content``/``reasoning``, ``refusal``, ``tool_calls``, ``function_call``, a completion's
``text``, ``logprobs``, ``finish_reason``, ``stop_reason``, ``token_ids``); any other field of an upstream's chunk is
not relayed. Reasoning goes to the client as ``reasoning_content`` (vLLM's and DeepSeek's name).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from gateway.sse import DONE as DONE_BYTES
from gateway.sse import EventReader, Last, event
from gateway.values import DONE, MALFORMED, ChatEvent, ChatStream, ChoiceDelta, ToolCallDelta


class _Fn(msgspec.Struct, gc=False):
    name: Any = None
    arguments: Any = None


class _Call(msgspec.Struct, gc=False):
    index: Any = 0
    id: Any = None
    type: Any = None
    function: _Fn | None = None


class _Delta(msgspec.Struct, gc=False):
    role: Any = None
    content: Any = None
    reasoning_content: Any = None
    reasoning: Any = None
    refusal: Any = None
    tool_calls: list[_Call] | None = None
    function_call: Any = None


class _Choice(msgspec.Struct, gc=False):
    index: Any = 0
    delta: _Delta | None = None
    text: Any = None
    logprobs: Any = None
    finish_reason: Any = None
    stop_reason: Any = msgspec.UNSET
    token_ids: Any = None


class _Chunk(msgspec.Struct, gc=False):
    """The fields of a streamed chunk the gateway keeps (others are skipped by the C decoder)."""

    id: Any = None
    object: Any = None
    created: Any = None
    model: Any = None
    system_fingerprint: Any = None
    service_tier: Any = None
    choices: list[_Choice] | None = None
    usage: Any = None
    error: Any = None


_decode_chunk = msgspec.json.Decoder(_Chunk).decode


def _index(index: Any) -> Any:
    return index if index.__class__ is int else repr(index)


def _call(c: _Call) -> ToolCallDelta:
    fn = c.function
    return ToolCallDelta(_index(c.index), c.id, c.type, fn.name if fn else None, fn.arguments if fn else None)


def _choice(ch: _Choice) -> ChoiceDelta:
    d = ch.delta
    if d is None:
        return ChoiceDelta(_index(ch.index), None, ch.text, None, None, (), None, ch.logprobs, ch.finish_reason or None,
                           ch.stop_reason, ch.token_ids)
    calls = d.tool_calls
    return ChoiceDelta(_index(ch.index), d.role, ch.text if d.content is None else d.content,
                       d.reasoning_content or d.reasoning or None, d.refusal,
                       tuple([_call(c) for c in calls]) if calls else (), d.function_call or None, ch.logprobs,
                       ch.finish_reason or None, ch.stop_reason, ch.token_ids)


def _event(c: _Chunk) -> ChatEvent:
    choices = c.choices
    return ChatEvent(tuple([_choice(ch) for ch in choices]) if choices else (), c.usage or None, c.error or None,
                     False, False, c.id, c.model, c.created, c.object, c.system_fingerprint, c.service_tier)


def decode_event(data: bytes) -> ChatEvent:
    """One SSE event's data (an OpenAI chat or completion chunk, ``[DONE]``, an error object) as a ``ChatEvent``:
    ``DONE``, ``MALFORMED`` (not a JSON object), or the chunk. Typed decoding (C, unknown fields skipped) for the
    usual shapes; any other JSON object goes the generic way with the same rules, and a payload that is JSON only
    once invalid UTF-8 is replaced (U+FFFD) is read in that form."""
    if data[:1] == b"{":
        try:
            return _event(_decode_chunk(data))
        except (msgspec.DecodeError, msgspec.ValidationError):
            pass
    elif data.strip() == b"[DONE]":
        return DONE
    try:
        obj = msgspec.json.decode(data)
    except msgspec.DecodeError:
        try:
            obj = json.loads(data.decode("utf-8", "replace"))
        except ValueError:
            return MALFORMED
    if not isinstance(obj, dict):
        return MALFORMED
    try:
        return _event(msgspec.convert(obj, _Chunk))
    except msgspec.ValidationError:
        return _loose_event(obj)


def event_from_object(item: Any) -> ChatEvent:
    """An in-process chunk (a msgspec struct or dict of OpenAI's chunk or error-event shape: the local engine's
    typed ``engine.serving.chunks`` items) as a ``ChatEvent``, with the rules of ``decode_event`` and no JSON
    bytes between (``msgspec.to_builtins`` drops unset fields as the wire encoder does)."""
    obj = msgspec.to_builtins(item)
    if not isinstance(obj, dict):
        return MALFORMED
    try:
        return _event(msgspec.convert(obj, _Chunk))
    except msgspec.ValidationError:
        return _loose_event(obj)


def _loose_event(obj: dict) -> ChatEvent:
    """A chunk whose choices or deltas are not the usual shapes: what can be read of them (an odd choice is
    read as an empty one, so its index still counts)."""
    choices = []
    for ch in obj.get("choices") or () if isinstance(obj.get("choices"), list) else ():
        if not isinstance(ch, dict):
            continue
        d = ch.get("delta") if isinstance(ch.get("delta"), dict) else {}
        choices.append(ChoiceDelta(_index(ch.get("index", 0)), None, d.get("content", ch.get("text")),
                                   d.get("reasoning_content") or d.get("reasoning") or None, d.get("refusal"),
                                   (), d.get("function_call") or None, ch.get("logprobs"),
                                   ch.get("finish_reason") or None))
    return ChatEvent(tuple(choices), obj.get("usage") or None, obj.get("error") or None, id=obj.get("id"),
                     model=obj.get("model"))


async def decode_stream(chunks: AsyncIterator[bytes]) -> ChatStream:
    """An upstream's SSE bytes (any split) as a ``ChatStream``: per read, the events it completed (an empty list
    for a read that completed none: a comment, part of an event); at the end, an event cut without its blank line.
    Each event is decoded once (``decode_event``). Transport errors raise through; closing it closes ``chunks``."""
    reader = EventReader()
    decode = decode_event
    exhausted = False
    try:
        async for chunk in chunks:
            reader.feed(chunk)
            out = []
            while (item := reader.pop()) is not None:
                out.append(decode(item[1]))
            yield out
        exhausted = True
        if (item := reader.tail()) is not None:
            yield [decode(item[1])]
    finally:
        aclose = None if exhausted else getattr(chunks, "aclose", None)
        if aclose is not None:
            await aclose()


def error_payload(error: Any) -> bytes:
    """An error event's data: ``{"error": ...}``."""
    return msgspec.json.encode({"error": error})


# The client's chunk as msgspec encodes it (a field left at its default is not written; ``logprobs`` and
# ``finish_reason`` are always written, null or not, as OpenAI writes them).
class _OutFn(msgspec.Struct, omit_defaults=True, gc=False):
    name: Any = None
    arguments: Any = None


class _OutCall(msgspec.Struct, omit_defaults=True, gc=False):
    index: Any
    id: Any = None
    type: Any = None
    function: _OutFn | None = None


class _OutDelta(msgspec.Struct, omit_defaults=True, gc=False):
    role: Any = None
    content: Any = None
    reasoning_content: Any = None
    refusal: Any = None
    tool_calls: list[_OutCall] | None = None
    function_call: Any = None


class _OutChatChoice(msgspec.Struct, omit_defaults=True, gc=False):
    index: Any
    delta: _OutDelta
    logprobs: Any
    finish_reason: Any
    stop_reason: Any = msgspec.UNSET
    token_ids: Any = None


class _OutTextChoice(msgspec.Struct, omit_defaults=True, gc=False):
    index: Any
    text: str
    logprobs: Any
    finish_reason: Any
    stop_reason: Any = msgspec.UNSET
    token_ids: Any = None


class _OutChunk(msgspec.Struct, omit_defaults=True, kw_only=True, gc=False):
    id: Any
    object: str
    created: Any
    model: Any
    system_fingerprint: Any = None
    service_tier: Any = None
    choices: list
    usage: Any = None


def _out_call(t: ToolCallDelta) -> _OutCall:
    return _OutCall(t.index, t.id, t.type, _OutFn(t.name, t.arguments))


def _out_choice(c: ChoiceDelta, chat: bool) -> _OutChatChoice | _OutTextChoice:
    stop_reason = c.stop_reason   # written as sent: absent (UNSET), null, or the stop matched
    if not chat:
        return _OutTextChoice(c.index, c.content or "", c.logprobs, c.finish_reason, stop_reason, c.token_ids)
    calls = [_out_call(t) for t in c.tool_calls] if c.tool_calls else None
    return _OutChatChoice(c.index, _OutDelta(c.role, c.content, c.reasoning, c.refusal, calls, c.function_call),
                          c.logprobs, c.finish_reason, stop_reason, c.token_ids)


def _out_chunk(ev: ChatEvent, id_: str | None, model: str | None, chat: bool, created: int) -> _OutChunk:
    return _OutChunk(id=ev.id if id_ is None else id_,
                     object=ev.object or ("chat.completion.chunk" if chat else "text_completion"),
                     created=ev.created or created, model=ev.model if model is None else model,
                     system_fingerprint=ev.system_fingerprint, service_tier=ev.service_tier,
                     choices=[_out_choice(c, chat) for c in ev.choices], usage=ev.usage)


def chunk_object(ev: ChatEvent, id_: str | None = None, model: str | None = None, chat: bool = True,
                 created: int = 0) -> dict:
    """A content, meta or usage event as OpenAI's chunk object (a dict, as the client codec writes it): a chat
    chunk (``chat``) or a completion chunk, under ``id_`` and ``model`` (None: the event's own), ``created`` when
    the event has none."""
    return msgspec.to_builtins(_out_chunk(ev, id_, model, chat, created))


_encoder = msgspec.json.Encoder()
_encode, _encode_into = _encoder.encode, _encoder.encode_into


class ChatEncoder:
    """Events -> the client's SSE bytes on OpenAI's chat/completions (``chat: True``) or completions endpoint, every
    chunk under ``id`` and ``model`` (the gateway's answer id, the public model name: whoever answered); ``[DONE]``
    and error events as OpenAI writes them. ``created``: the chunks' time when an event has none (Unix seconds)."""

    __slots__ = ("id", "model", "chat", "created")

    def __init__(self, id_: str, model: str, chat: bool = True, created: int | None = None):
        self.id, self.model, self.chat = id_, model, chat
        self.created = int(time.time()) if created is None else created

    def payload(self, ev: ChatEvent) -> bytes:
        """One event's data bytes (``[DONE]``, an error object, or a chunk)."""
        if ev.done:
            return b"[DONE]"
        if ev.error or ev.malformed:
            return error_payload(ev.error)
        return _encode(_out_chunk(ev, self.id, self.model, self.chat, self.created))

    def encode(self, events: list[ChatEvent]) -> bytes:
        """The SSE bytes of ``events`` (one read's: written downstream as one chunk); ``Last`` when they end in
        ``[DONE]`` (the end of the stream: the transport ends the body with them). A chunk's JSON is encoded
        straight into one buffer as one ``data:`` line (msgspec's JSON has no raw newline: ``event``'s rule)."""
        buf = bytearray()
        for ev in events:
            if ev.done:
                buf += DONE_BYTES
            elif ev.error or ev.malformed:
                buf += event(error_payload(ev.error))
            else:
                buf += b"data: "
                _encode_into(_out_chunk(ev, self.id, self.model, self.chat, self.created), buf, -1)
                buf += b"\n\n"
        return Last(buf) if events and events[-1].done else bytes(buf)

    async def stream(self, events: ChatStream) -> AsyncIterator[bytes]:
        """A ``ChatStream`` as the client's SSE bytes, one chunk per non-empty read. Closing it closes ``events``."""
        exhausted = False
        try:
            async for batch in events:
                if batch:
                    yield self.encode(batch)
            exhausted = True
        finally:
            aclose = None if exhausted else getattr(events, "aclose", None)
            if aclose is not None:
                await aclose()


class ChatRender:
    """The OpenAI codec of one request's answer (``gateway.values.Answer.render``) on chat/completions (``chat``)
    or completions: a whole answer as its backend's JSON (relabelled already), a stream's events as OpenAI's
    chunks under ``id_`` (the gateway's answer id) and ``model`` (the public model)."""

    __slots__ = ("id", "model", "chat")

    def __init__(self, id_: str, model: str, chat: bool):
        self.id, self.model, self.chat = id_, model, chat

    def content(self, status: int, content: bytes, media_type: str) -> tuple[int, bytes, str]:
        """A whole answer: ``(status, body, media type)`` as they are."""
        return status, content, media_type

    def stream(self, events: ChatStream) -> AsyncIterator[bytes]:
        """A stream: OpenAI's SSE chunks."""
        return ChatEncoder(self.id, self.model, self.chat).stream(events)
