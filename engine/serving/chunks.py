"""A streamed answer as typed values: what ``OpenAIServingChat`` and ``OpenAIServingCompletion`` make from the
engine's ``RequestOutput``s, one value per OpenAI stream chunk (the chat ``chat.completion.chunk`` and the legacy
``text_completion`` chunk, with vLLM's extras ``stop_reason`` and ``token_ids``), and ``StreamError`` for a failure
after the first chunk; a stream yields them as one list per engine output (an engine step's tokens), and ends
with the iterator (the SSE ``[DONE]`` is the wire's, ``sse_stream``).

The structs are shaped and named as the wire objects, field for field in OpenAI's order, so that ``msgspec`` writes
each as its JSON in one C call (``sse_stream``: ``tandem engine serve``), and the gateway's local backend reads
their fields in the same process with no JSON in between. A field left ``UNSET`` is absent from the JSON (a
``stop_reason`` only on a choice's last chunk, ``usage`` only when asked for); ``None`` is written as ``null``.

Sources: OpenAI API reference (the chat completion chunk object, the legacy completions object); vLLM's OpenAI
server (``stop_reason``, ``continuous_usage_stats``, ``return_token_ids``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Union

import msgspec
from msgspec import UNSET, UnsetType

DONE = b"data: [DONE]\n\n"


class FunctionPiece(msgspec.Struct, gc=False):
    """``function`` of a streamed tool call: its ``name`` with the call's first piece, then ``arguments`` text."""

    name: Union[str, UnsetType] = UNSET
    arguments: Union[str, UnsetType] = UNSET


class ToolCallPiece(msgspec.Struct, gc=False):
    """One piece of a streamed tool call (``delta.tool_calls[]``): the call's ``index`` among the choice's calls;
    ``id`` and ``type`` with its first piece only."""

    index: int
    id: Union[str, UnsetType] = UNSET
    type: Union[str, UnsetType] = UNSET
    function: FunctionPiece = msgspec.field(default_factory=FunctionPiece)


class Delta(msgspec.Struct, gc=False):
    """A chat choice's ``delta``: the ``role`` (first chunk), a ``content`` text piece or ``tool_calls`` pieces;
    ``{}`` (all unset) on a chunk that only finishes the choice or carries its logprobs. The role chunk's
    ``content`` is null where the answer can only be calls (``tool_choice`` required or named), as OpenAI's."""

    role: Union[str, UnsetType] = UNSET
    content: Union[str, None, UnsetType] = UNSET
    tool_calls: Union[list[ToolCallPiece], UnsetType] = UNSET


class ChatChoiceChunk(msgspec.Struct, gc=False):
    """One choice of a chat chunk. ``logprobs``: ``{"content": [...], "refusal": None}`` as OpenAI's chunk holds
    them (``engine/serving/logprobs.py``), or None. ``token_ids``: the choice's new token ids
    (``return_token_ids``). ``stop_reason``: vLLM's, with ``finish_reason`` only."""

    index: int
    delta: Delta
    logprobs: Any = None
    finish_reason: Union[str, None] = None
    token_ids: Union[list[int], UnsetType] = UNSET
    stop_reason: Any = UNSET


class CompletionChoiceChunk(msgspec.Struct, gc=False):
    """One choice of a legacy completion chunk: its ``text`` piece, legacy ``logprobs`` (``tokens``,
    ``token_logprobs``, ``top_logprobs``, ``text_offset``) or None. With ``return_token_ids`` (vLLM's): the
    prompt's ``prompt_token_ids`` on the choice's first chunk and its new ``token_ids`` on each."""

    index: int
    text: str
    logprobs: Any = None
    finish_reason: Union[str, None] = None
    stop_reason: Any = UNSET
    prompt_token_ids: Union[list[int], UnsetType] = UNSET
    token_ids: Union[list[int], UnsetType] = UNSET


class Chunk(msgspec.Struct, gc=False):
    """One chunk of a streamed answer: ``object`` is ``chat.completion.chunk`` (``choices`` of
    ``ChatChoiceChunk``) or ``text_completion`` (of ``CompletionChoiceChunk``); ``created`` in Unix seconds;
    ``usage`` (``serving.usage``) on the final usage chunk (``choices`` empty) or on every chunk with
    ``continuous_usage_stats``; ``prompt_token_ids`` (vLLM's ``return_token_ids``) on each role chunk of a
    chat stream (its first ones)."""

    id: str
    object: str
    created: int
    model: str
    system_fingerprint: Union[str, None]
    choices: list
    usage: Union[dict, UnsetType] = UNSET
    prompt_token_ids: Union[list[int], UnsetType] = UNSET


class StreamError(msgspec.Struct, gc=False):
    """A failure after the stream's first chunk (the engine died or aborted the request): OpenAI's error object
    (``{"message", "type", "param", "code"}``), written as the stream's last event before ``[DONE]``."""

    error: dict


StreamItem = Union[Chunk, StreamError]


_encode = msgspec.json.Encoder().encode


def sse(item: Any) -> bytes:
    """One Server-Sent Event: ``data: <json>\\n\\n``."""
    return b"data: " + _encode(item) + b"\n\n"


async def sse_stream(batches: AsyncIterator[list[StreamItem]]) -> AsyncIterator[bytes]:
    """The OpenAI wire form of a streamed answer: each chunk (or the error) as one SSE event, the events of one
    engine output in one write, then ``[DONE]``. Closing it closes ``batches`` (which aborts the engine request)."""
    try:
        async for batch in batches:
            yield b"".join([sse(item) for item in batch])
        yield DONE
    finally:
        await batches.aclose()
