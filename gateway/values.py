"""The values that cross the gateway's layers, each made once and read (never re-parsed) by every later step:
the request (``GatewayRequest``, built by validation), one stream chunk (``ChatEvent``, decoded once at the edge
from an upstream's SSE or made directly from the local engine's outputs) and the answer (``Answer``, rendered by
the HTTP layer through the client API's codec). This module imports nothing from the steps that make or read
them (it sits below every other module of ``gateway/``).

A streamed answer is a ``ChatStream``: an async iterator of lists of ``ChatEvent``, one list per read from the
backend (an upstream's network read, an engine step): the events read together go downstream as one write, and
an empty list says bytes arrived that carried no event (an SSE comment such as ``: keep-alive``), which re-arms
the attempt loop's inter-chunk deadline. The client-API codecs (``gateway/translate/``) turn the events back
into the client's wire events; nothing between the edges sees bytes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec


class ToolCallDelta(msgspec.Struct, frozen=True, gc=False):
    """One piece of a streamed tool call (OpenAI's ``delta.tool_calls[]``): chat streams tell calls apart by
    ``index`` only and may interleave the pieces of several calls; ``id``, ``type`` and ``name`` come with a
    call's first piece, ``arguments`` is the next piece of its JSON arguments text (possibly empty)."""

    index: int = 0
    id: str | None = None
    type: str | None = None
    name: str | None = None
    arguments: str | None = None


class ChoiceDelta(msgspec.Struct, frozen=True, gc=False):
    """What one event says of one choice (``choices[]`` of a chat or completion chunk), flattened.

    content: the text delta (a chat delta's ``content``, a completion choice's ``text``). reasoning: the
    reasoning text delta (``reasoning_content`` or ``reasoning``). tool_calls: the tool-call pieces, by index.
    function_call: the legacy ``function_call`` delta (a dict) when sent. logprobs: the choice's ``logprobs``
    object as sent (chat: ``{"content": [{"token", "logprob", "top_logprobs"}...]}``). finish_reason: set on
    the choice's last event. stop_reason: vLLM's (the stop string or token id matched; ``msgspec.UNSET`` when the event did not carry it, so
    a client codec writes it as sent). token_ids: the token
    ids of this delta (vLLM's ``return_token_ids``; the resume path needs them). reasoning_signature: the signature
    that closes a thinking block, redacted_reasoning: a redacted thinking block's opaque data (an Anthropic
    upstream's ``signature_delta`` and ``redacted_thinking``: a Messages client sends them back on its next turn;
    chat has no place for them)."""

    index: int = 0
    role: str | None = None
    content: str | None = None
    reasoning: str | None = None
    refusal: str | None = None
    tool_calls: tuple[ToolCallDelta, ...] = ()
    function_call: dict | None = None
    logprobs: Any = None
    finish_reason: str | None = None
    stop_reason: Any = None
    token_ids: tuple[int, ...] | None = None
    reasoning_signature: str | None = None
    redacted_reasoning: str | None = None

    @property
    def has_content(self) -> bool:
        """Whether this delta carries output (text, reasoning, refusal, a tool call) or the choice's finish."""
        return bool(self.content or self.finish_reason or self.tool_calls or self.reasoning or self.refusal
                    or self.function_call or self.reasoning_signature or self.redacted_reasoning is not None)


class ChatEvent(msgspec.Struct, frozen=True, gc=False):
    """One event of a streamed chat or completion answer (OpenAI's chunk, with vLLM's extras), decoded once.

    choices: the choices this event speaks of. usage: OpenAI's ``usage`` object (prompt/completion/total tokens,
    ``prompt_tokens_details.cached_tokens``, ``completion_tokens_details.reasoning_tokens``) on the usage event.
    error: the error object of an error event (a failure after content; OpenAI's ``{"message", "type", "code"}``).
    done: the stream's ``[DONE]``. malformed: the upstream sent an event that is not a JSON object.
    id / model / created / object / system_fingerprint / service_tier: the chunk's own (the client codec writes
    the gateway's ``id`` and the public ``model`` instead: ``gateway/translate/chat_events.py``). object:
    ``chat.completion.chunk`` or ``text_completion`` (a completions stream)."""

    choices: tuple[ChoiceDelta, ...] = ()
    usage: dict | None = None
    error: Any = None
    done: bool = False
    malformed: bool = False
    id: str | None = None
    model: str | None = None
    created: int | None = None
    object: str | None = None
    system_fingerprint: str | None = None
    service_tier: str | None = None

    @property
    def kind(self) -> str:
        """``malformed`` | ``done`` | ``error`` | ``content`` (a choice with output or its finish) | ``meta``
        (a role-only delta, a usage event...): what the attempt loop decides a stream's fate on."""
        if self.malformed:
            return "malformed"
        if self.done:
            return "done"
        if self.error:
            return "error"
        for c in self.choices:
            if c.has_content:
                return "content"
        return "meta"


DONE = ChatEvent(done=True)
MALFORMED = ChatEvent(malformed=True)


def error_event(message: str, type_: str = "upstream_error", code: str | None = None) -> ChatEvent:
    """An error event carrying OpenAI's error object (how a stream that already sent content reports a failure)."""
    return ChatEvent(error={"message": message, "type": type_, "param": None, "code": code})


# One streamed answer: the events of each read, in order (see the module docstring).
ChatStream = AsyncIterator[list[ChatEvent]]


# Request fields that only the gateway understands: never sent to a backend as they are (the local engine takes the
# priority as an argument), nor translated for one.
GATEWAY_ONLY_FIELDS = ("priority",)


@dataclass(frozen=True, slots=True)
class GatewayRequest:
    """One request, built once by validation and read (never re-parsed) by every later step: routing features,
    admission, dispatch, observability.

    endpoint: "chat/completions" | "completions" | "embeddings" (a /v1/messages request is its chat translation).
    body: the client's parsed JSON (not mutated). model: the model as the client wrote it; public_model: its canonical public name. priority: smaller = more urgent.
    max_tokens: ``max_completion_tokens`` when set, else ``max_tokens``, else the endpoint's default (completions:
    16; chat: None, up to the context; embeddings: 0), the engine's rule. ``body`` has its top-level nulls dropped (null = not
    given).
    prompt_tokens: the prompt's length in tokens, counted once (the local engine's rendering when a rule reads
    it, else ``estimate_prompt_tokens``); prompt_tokens_exact: whether that is a count (rendered, or token ids
    given), not a guess. longest_prompt_tokens: the longest of its prompts, counted or estimated alike (a
    completions batch's prompts and an embeddings list's inputs are each a sequence of its own; otherwise the
    prompt's length): what must fit a backend's context, and what the rules' ``prompt_tokens`` reads. rendered:
    that rendering (``engine.serving.serving.RenderedPrompt``: template applied, tokenized), handed to the local
    engine so it does not tokenize again; None when not rendered. local_unsupported: a field the local engine
    cannot serve. headers: lower-case names -> values.
    unknown_params: top-level parameters neither OpenAI's nor a known vendor extension (``KNOWN_PARAMS``), refused
    unless the request's route passes them on (``unknown_parameter_error``).
    source: (API, body) of a request that came on another API and was translated onto chat (the Responses
    API: ``("responses", the client's body with its conversation expanded)``); an upstream that speaks that API
    natively (``apis``) is sent it as it is. None for a chat or completion request.
    """

    endpoint: str
    body: dict
    model: str
    stream: bool
    priority: int
    user: str
    metadata: dict
    max_tokens: int | None
    has_tools: bool
    has_response_format: bool
    local_unsupported: str | None
    public_model: str = ""
    tenant: str = ""
    request_id: str = ""
    prompt_tokens: int | None = None
    prompt_tokens_exact: bool = False
    longest_prompt_tokens: int | None = None
    rendered: Any = None
    headers: Mapping[str, str] = field(default_factory=dict)
    source: tuple[str, dict] | None = None
    unknown_params: tuple[str, ...] = ()

    @property
    def sequences(self) -> int:
        """How many completions the request generates, each up to ``max_tokens``: ``n`` (default 1), and for
        completions ``best_of`` when larger (it generates that many and returns the best ``n``)."""
        n = self.body.get("n")
        n = n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1
        best_of = self.body.get("best_of") if self.endpoint == "completions" else None
        return max(n, best_of) if isinstance(best_of, int) and not isinstance(best_of, bool) else n

    @property
    def anthropic_body(self) -> dict | None:
        """/v1/messages: the client's Anthropic Messages body (``source``), which a ``type: anthropic`` backend
        receives as it is (``body`` is its chat translation, ``gateway/translate/anthropic.py``, which every other
        step reads)."""
        return self.source[1] if self.source is not None and self.source[0] == "messages" else None


@dataclass
class Answer:
    """One answer, as backends produced it and the HTTP layer renders it: ``status``, ``headers`` (the
    ``x-tandem-*`` routing facts are added by the pipeline), ``content`` bytes (a whole answer: the OpenAI JSON
    body) or a ``stream`` of events, ``backend`` (who answered; "" when every attempt failed) and ``attempts``
    (upstream calls made). ``api``: the API the answer speaks when the backend was sent the request's ``source``
    natively ("" otherwise: the request's endpoint). ``render``: the client API's codec when it is not OpenAI's
    (``content(status, bytes)`` -> JSON bytes, ``stream(events)`` -> SSE bytes:
    ``gateway.translate.anthropic_render.MessagesRender``), applied by the HTTP layer after observability read the
    answer."""

    status: int
    content: bytes = b""
    stream: ChatStream | None = None
    content_type: str = "application/json"
    backend: str = ""
    attempts: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    api: str = ""
    render: Any = None
