"""The answer side of ``/v1/messages`` as the HTTP layer renders it: ``MessagesRender`` (the chat answer as
Anthropic's Message JSON, events or error JSON) and the refusals' paths written as the Messages body's
(``messages_paths``), over the translation in ``gateway/translate/anthropic.py``."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator

import msgspec

from gateway.errors import ClientError, anthropic_error_body, anthropic_status
from gateway.translate.anthropic import MessageEvents, chat_to_message, message_events, turn_to_chat
from gateway.values import ChatStream

_JSON = "application/json"

# The chat body's paths a refusal may name -> the Messages body's (the translation's inverse: ``messages_to_chat``).
_CHAT_PATHS = ((re.compile(r"\btools(\[|\.)(\d+)(\]?)\.function\.parameters"), r"tools\1\2\3.input_schema"),
               (re.compile(r"\btools(\[|\.)(\d+)(\]?)\.function\."), r"tools\1\2\3."),
               (re.compile(r"\bresponse_format\.json_schema\.schema"), "output_config.format.schema"),
               (re.compile(r"\bresponse_format\b"), "output_config.format"),
               (re.compile(r"\btool_choice\.function\.name\b"), "tool_choice.name"),
               (re.compile(r"\bparallel_tool_calls\b"), "tool_choice.disable_parallel_tool_use"),
               (re.compile(r"(?<![\w.])stop(?!\w)"), "stop_sequences"))


# An index in a path as Anthropic writes it: ``tools.0.name``, ``messages.1.content.0`` (an agent trial saw both
# ``tools[0].name`` and ``tools.0.input_schema.type`` on /v1/messages).
_INDEX = re.compile(r"(\w)\[(\d+)\]")
# An OpenAI context-length 400's counts (the gateway's and vLLM's words): the window, and the prompt's tokens with
# or without the completion's
_WINDOW = re.compile(r"maximum context length is (\d+) tokens")
_PROMPT_AND_ANSWER = re.compile(r"\((\d+) in the \w+, (\d+) in the completion\)")
_PROMPT_ONLY = re.compile(r"resulted in (\d+) tokens")

# A target's refusal of the image part a Messages ``image`` block became (the local engine's wording: text only).
_IMAGE_PART = re.compile(r"\bmessages\[(\d+)\]\.content(?:\[\d+\])?: part type 'image_url'")


def _image_block(body: dict, k: int) -> str | None:
    """The Messages path of the first ``image`` block (in the turn, or in one of its tool results) of the turn that
    chat message ``k`` of ``body``'s translation came from; None when that is no such turn."""
    turns = [None] if body.get("system") else []
    msgs = body.get("messages") or ()
    for i, m in enumerate(msgs):
        try:
            turns += [i] * len(turn_to_chat(m, i, last=i == len(msgs) - 1))
        except ClientError:
            return None
    i = turns[k] if k < len(turns) else None
    content = body["messages"][i].get("content") if i is not None else None
    for j, b in enumerate(content if isinstance(content, list) else ()):
        inner = b.get("content") if isinstance(b, dict) and b.get("type") == "tool_result" else None
        if isinstance(b, dict) and b.get("type") == "image":
            return f"messages.{i}.content.{j}"
        for n, r in enumerate(inner if isinstance(inner, list) else ()):
            if isinstance(r, dict) and r.get("type") == "image":
                return f"messages.{i}.content.{j}.content.{n}"
    return None


def messages_paths(text: str, body: dict | None = None) -> str:
    """``text`` (a refusal's message) with the chat body's field paths it names written as the Messages body's:
    ``tools[0].function.parameters.x`` -> ``tools.0.input_schema.x`` (indices as Anthropic writes them),
    ``response_format.json_schema.schema``
    -> ``output_config.format.schema``, ``tool_choice.function.name`` -> ``tool_choice.name``, and with the
    Messages ``body`` at hand a refused ``image_url`` part of ``messages[k]`` -> the ``image`` block it came from
    (``messages.0.content.1: content block type 'image'``): the client sent the Messages body and looks there."""
    for pattern, repl in _CHAT_PATHS:
        text = pattern.sub(repl, text)
    m = _IMAGE_PART.search(text) if body is not None else None
    if m is not None and (path := _image_block(body, int(m.group(1)))) is not None:
        text = text[:m.start()] + f"{path}: content block type 'image'" + text[m.end():]
    return _INDEX.sub(r"\1.\2", text)


def anthropic_error(status: int, content: bytes, body: dict | None = None) -> bytes:
    """An error answer's body (OpenAI's error JSON, or already Anthropic's) as Anthropic's error JSON, naming the
    paths of the Messages ``body`` (``messages_paths``)."""
    try:
        obj = msgspec.json.decode(content)
    except msgspec.DecodeError:
        obj = None
    if isinstance(obj, dict) and obj.get("type") == "error":
        return content
    err = obj.get("error") if isinstance(obj, dict) else None
    message = (err.get("message") if isinstance(err, dict) else None) or content.decode("utf-8", "replace") \
        or f"HTTP {status}"
    if isinstance(err, dict) and err.get("code") == "context_length_exceeded":
        message = _too_long(str(message))
    return anthropic_error_body(status, messages_paths(str(message), body))


def _too_long(message: str) -> str:
    """An OpenAI context-length message in Anthropic's words ("prompt is too long: 3090 tokens > 2048 maximum";
    with ``max_tokens``: "input length and `max_tokens` exceed context limit: 3090 + 32 > 2048, ..."); as it is
    when its counts cannot be read (a new-user trial read OpenAI's "completion" on /v1/messages)."""
    window = _WINDOW.search(message)
    if window is None:
        return message
    if (both := _PROMPT_AND_ANSWER.search(message)) is not None:
        return (f"input length and `max_tokens` exceed context limit: {both.group(1)} + {both.group(2)} > "
                f"{window.group(1)}, decrease input length or `max_tokens` and try again")
    if (prompt := _PROMPT_ONLY.search(message)) is not None:
        return f"prompt is too long: {prompt.group(1)} tokens > {window.group(1)} maximum"
    return message


class MessagesRender:
    """The ``/v1/messages`` codec of one request's answer (``gateway.values.Answer.render``): the chat
    answer, as observability read it, rendered as Anthropic's Message JSON, events or error JSON."""

    def __init__(self, message_id: str, model: str, input_tokens: int, stop_sequences: list | None,
                 body: dict | None = None):
        self.message_id, self.model, self.input_tokens = message_id, model, input_tokens
        self.stop_sequences, self.body = stop_sequences, body

    @classmethod
    def of(cls, req) -> "MessagesRender":
        """For a ``GatewayRequest`` built from a Messages body: id ``msg_<request id>``, the public model."""
        stop = req.anthropic_body.get("stop_sequences")
        return cls(f"msg_{req.request_id}", req.public_model or req.model, req.prompt_tokens or 0,
                   stop if isinstance(stop, list) else None, req.anthropic_body)

    def content(self, status: int, content: bytes, media_type: str = _JSON) -> tuple[int, bytes, str]:
        """A whole answer: ``(status, body, media type)``: the Message, or Anthropic's error JSON under Anthropic's
        status (``gateway.errors.anthropic_status``; ``media_type``, the backend's, unused)."""
        if status >= 400:
            return anthropic_status(status), anthropic_error(status, content, self.body), _JSON
        try:
            chat = msgspec.json.decode(content)
        except msgspec.DecodeError:
            return 502, anthropic_error(502, b"the backend's answer is not JSON"), _JSON
        return status, msgspec.json.encode(chat_to_message(chat, self.message_id, self.model,
                                                           self.stop_sequences)), _JSON

    def stream(self, chunks: ChatStream) -> AsyncIterator[bytes]:
        """A chat stream's events as Anthropic's event stream."""
        return message_events(chunks, MessageEvents(self.message_id, self.model, self.input_tokens,
                                                    self.stop_sequences))
