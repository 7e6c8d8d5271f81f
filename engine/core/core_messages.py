"""Typed messages between the engine's front end and its core.

The front end (``engine/async_engine.py``: HTTP-facing asyncio API,
tokenization, ``engine/output_processor.py``) sends commands; the core
(``engine/core/engine_core.py`` driven by ``engine/core/core_loop.py``, in a thread or
in its own process) answers with one ``CoreStep`` per iteration: the outputs
of one model step, batched, plus the live stats. As vLLM v1's
``EngineCoreRequest`` / ``EngineCoreOutputs`` (vllm/v1/engine/__init__.py).

In the process mode every message crosses a pipe as msgpack (``msgspec``):
``encode_command`` / ``decode_command`` and ``encode_reply`` /
``decode_reply`` are the only codec; in the thread mode the same objects are
handed over as they are.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec

from engine.outputs import Logprob
from engine.sampling_params import SamplingParams, StructuredOutputsParams
from engine.core.ttft import TTFTState


# ------------------------------------------------------------------ front end -> core
class AddRequest(msgspec.Struct, tag=True, array_like=True):
    """Queue a request whose prompt is already tokenized.

    ``params`` is ``SamplingParams`` as a plain dict (``params_to_wire``);
    ``arrival_time`` is ``time.monotonic()`` seconds (system-wide on Linux,
    so comparable across processes)."""

    request_id: str
    prompt_token_ids: list[int]
    params: dict[str, Any]
    priority: int
    arrival_time: float
    resume: dict[int, list[int]] | None = None   # a continuation: choice -> tokens generated before
    cache_salt: str | None = None                # vLLM's: salts the prompt's prefix-cache hashes


class AbortRequests(msgspec.Struct, tag=True, array_like=True):
    """Abort client requests (every choice) and free their blocks. With
    ``ack`` the core answers ``CoreReply(call_id=ack)`` once they are freed."""

    request_ids: list[str]
    ack: int | None = None


class FinishSequences(msgspec.Struct, tag=True, array_like=True):
    """Choices that a stop string ended in the front end: (request id,
    choice index, stop string). The core finishes them as "stop" and frees
    their blocks."""

    stops: list[tuple[str, int, str]]


class CompileGrammar(msgspec.Struct, tag=True, array_like=True):
    """Validate and compile (and cache) a structured-output grammar in the
    core's compile pool; answered by ``CoreReply``."""

    call_id: int
    spec: dict[str, Any]


class Withdraw(msgspec.Struct, tag=True, array_like=True):
    """Take back a request that would give its first token too late, while nothing of it is computed
    (``EngineCore.withdraw``): re-predict its first token from its place in the queue and, when ``now +
    scale x prediction`` passes ``by`` (``time.monotonic()`` seconds), abort it. Answered by ``CoreReply(call_id,
    value=[withdrawn, predicted seconds or None])``; a request no longer waiting is never withdrawn."""

    call_id: int
    request_id: str
    by: float
    scale: float = 1.0
    arrival_tok_s: float = 0.0


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    """Abort whatever is left and stop the core loop."""


EMBED_ID_PREFIX = "embed-call-"   # an embed call's pooling requests' ids: f"{prefix}{call id}-{index}"


def embed_request_ids(call_id: int, count: int) -> list[str]:
    """The ids of the pooling requests of embed call ``call_id`` of ``count`` prompts, in input order: the core
    names them so (``engine/core/embed_calls.py``), and the front end aborts them by these names."""
    return [f"{EMBED_ID_PREFIX}{call_id}-{i}" for i in range(count)]


class EmbedPrompts(msgspec.Struct, tag=True, array_like=True):
    """Pool tokenized prompts into embeddings (``EngineCore.add_embed``: pooling requests, chunked and in steps
    shared with the running streams); answered once all are pooled by ``CoreReply(call_id, error, value)``,
    ``value`` one float list per prompt. ``pooling_type`` "" / ``normalize``
    None: the model's own pooling config (``engine/pooling.py``)."""

    call_id: int
    prompts: list[list[int]]
    pooling_type: str = ""
    normalize: bool | None = None


Command = AddRequest | AbortRequests | FinishSequences | CompileGrammar | Shutdown | EmbedPrompts | Withdraw


# ------------------------------------------------------------------ core -> front end
class EngineCoreOutput(msgspec.Struct, array_like=True):
    """What one choice of one request produced in one step (raw tokens: the
    front end detokenizes and applies stop strings).

    Attributes:
        request_id: the client's request id.
        index: the choice index (0..n-1).
        new_token_ids: the token sampled this step ([] when the choice ended
            without one, e.g. at ``max_model_len``).
        new_logprobs: one ``{token_id: Logprob}`` per new token when logprobs
            were asked for ([] without a token), else None; ``decoded_token``
            is left empty.
        finish_reason, stop_reason: set once the core finished the choice
            ("stop": EOS, a stop token id or a grammar's end; "length").
        stop_terminated: the last new token ended the choice (EOS, stop token
            id): it stays out of the text.
        num_output_tokens: tokens generated by this choice so far.
        num_cached_tokens: prompt tokens served from the prefix cache.
        arrival_time, first_scheduled_time, first_token_time: monotonic seconds.
        prompt_logprobs: the whole prompt's logprobs, sent once, with the
            request's first output (None otherwise or when not asked for).
    """

    request_id: str
    index: int
    new_token_ids: list[int]
    new_logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    stop_reason: int | str | None
    stop_terminated: bool
    num_output_tokens: int
    num_cached_tokens: int
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


class EngineStats(msgspec.Struct, array_like=True):
    """Live engine signals, for the gateway's policies and for metrics.

    Attributes:
        num_running: requests (sequences) in the running set.
        num_waiting: requests waiting (new, preempted or swapped).
        kv_cache_usage: fraction of device KV blocks in use, 0..1.
        prefix_cache_queries: prompt tokens looked up in the prefix cache (cumulative).
        prefix_cache_hits: prompt tokens found there (cumulative).
        num_preemptions: preemptions so far (cumulative).
        tokens_in_flight: prompt + generated tokens of unfinished requests.
        prompt_tokens_total: prompt tokens computed (cumulative, excludes cache hits).
        generation_tokens_total: tokens generated (cumulative).
        ttft: what a TTFT prediction needs (``engine/core/ttft.py``); None from a core that does not publish it.
        spec_method: the speculative proposer (``ngram``, ``draft_model``; empty when speculation is off).
        spec_num_drafts, spec_num_draft_tokens, spec_num_accepted_tokens, spec_num_accepted_tokens_per_pos:
            speculative decoding's cumulative counters (``engine/spec_decode/proposing.py``; 0 when it is off).
        spec_accepted_per_draft: verified proposals by how many of their tokens were accepted (index 0..k).
        iteration_tokens, iteration_tokens_sum: steps by their tokens (bucket counts of
            ``engine.core.step_work.ITERATION_TOKEN_BUCKETS``, then past them) and those steps' tokens (cumulative).
    """

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    tokens_in_flight: int
    prompt_tokens_total: int
    generation_tokens_total: int
    ttft: TTFTState | None = None
    spec_method: str = ""
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_num_accepted_tokens_per_pos: tuple[int, ...] = ()
    spec_accepted_per_draft: tuple[int, ...] = ()
    iteration_tokens: tuple[int, ...] = ()
    iteration_tokens_sum: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Hits / queries over the engine's life (0 when nothing was queried)."""
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


class CoreStep(msgspec.Struct, tag=True, array_like=True):
    """One iteration of the core loop.

    Attributes:
        outputs: every choice with news this step (one message per step).
        stats: the live signals after the step and the commands.
        timestamp: ``time.monotonic()`` at the end of the step.
        rejected: (request id, exception type name, message) of requests
            ``add_request`` refused (duplicate id, prompt too long).
        failed: request ids aborted because the step raised ``error``
            (``"TypeName: message"``); the loop goes on.
        acks: ``AbortRequests.ack`` values now done.
    """

    outputs: list[EngineCoreOutput]
    stats: EngineStats
    timestamp: float
    rejected: list[tuple[str, str, str]] = []
    failed: list[str] = []
    error: str | None = None
    acks: list[int] = []


class CoreReply(msgspec.Struct, tag=True, array_like=True):
    """The answer to a ``CompileGrammar`` (``error`` None when it compiled: ``digest``, its cache key; else the
    refusal's message and HTTP status, 400 refused or 408 compile timeout), an ``EmbedPrompts`` (``value``:
    its embeddings; an error is the request's, status 400) or a ``Withdraw`` (``value``: [withdrawn, seconds])."""

    call_id: int
    error: str | None = None
    status: int = 400
    digest: str | None = None
    value: Any = None


class CoreReady(msgspec.Struct, tag=True, array_like=True):
    """The core loaded its model and runs (first message of a core process)."""

    served_model_name: str
    max_model_len: int
    num_blocks: int
    vocab_size: int
    stats: EngineStats
    system_fingerprint: str = ""


class CoreFailed(msgspec.Struct, tag=True, array_like=True):
    """The core could not start (bad model path, out of memory): the
    exception's type name and message, raised again in the front end."""

    error_type: str
    message: str


Reply = CoreStep | CoreReply | CoreReady | CoreFailed

_command_decoder = msgspec.msgpack.Decoder(Command)
_reply_decoder = msgspec.msgpack.Decoder(Reply)
_encoder = msgspec.msgpack.Encoder()


def encode(msg: Command | Reply) -> bytes:
    """msgpack bytes of a command or a reply."""
    return _encoder.encode(msg)


def decode_command(data: bytes) -> Command:
    """The command encoded in ``data`` (raises ``msgspec.DecodeError`` on garbage)."""
    return _command_decoder.decode(data)


def decode_reply(data: bytes) -> Reply:
    """The reply encoded in ``data`` (raises ``msgspec.DecodeError`` on garbage)."""
    return _reply_decoder.decode(data)


def params_to_wire(params: SamplingParams | StructuredOutputsParams) -> dict[str, Any]:
    """``SamplingParams`` (or a structured-output spec) as a plain dict, nested
    spec included. Shallow: the values are shared, not copied
    (``dataclasses.asdict`` deep-copies, ~0.1 s on the event loop for a 400 KB
    schema); msgpack encodes them as they are. A spec's JSON schema crosses
    as JSON text (key order kept; msgspec, ~1 ms per 400 KB): the core then
    decodes one string, not one Python object per schema node, in a thread
    that shares its GIL with the engine step (issue #34). A request's spec
    that compiled already (``digest`` set) crosses as its digest alone: the
    core finds the grammar by it, and the schema crosses the pipe once, in
    its ``CompileGrammar`` (writing it again took the core's reader up to
    130 ms of GIL at 64 KB a time)."""
    out = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}
    spec = out.get("structured_outputs")
    if spec is not None:
        out["structured_outputs"] = {"digest": spec.digest} if spec.digest is not None else params_to_wire(spec)
    if isinstance(params, StructuredOutputsParams) and isinstance(params.json, (dict, bool)):
        out["json"] = msgspec.json.encode(params.json).decode()
    return out


def params_from_wire(data: dict[str, Any]) -> SamplingParams:
    """Rebuild (and so re-validate) ``SamplingParams`` from ``params_to_wire``'s dict."""
    data = dict(data)
    spec = data.pop("structured_outputs", None)
    return SamplingParams(**data, structured_outputs=spec_from_wire(spec) if spec is not None else None)


def spec_from_wire(data: dict[str, Any]) -> StructuredOutputsParams:
    """Rebuild a ``StructuredOutputsParams`` from ``params_to_wire``'s dict (a reference when only ``digest``)."""
    return StructuredOutputsParams(**data)


class EngineCoreError(RuntimeError):
    """A failure inside the engine core, raised again in the front end."""


_ERRORS: dict[str, type[Exception]] = {
    "ValueError": ValueError, "FileNotFoundError": FileNotFoundError, "MemoryError": MemoryError,
    "RuntimeError": RuntimeError, "NotADirectoryError": NotADirectoryError, "PermissionError": PermissionError,
}


def rebuild_error(type_name: str, message: str) -> Exception:
    """The front end's exception for a core error sent as (type name, message):
    the same built-in type when it is a known one, else ``EngineCoreError``."""
    cls = _ERRORS.get(type_name)
    return cls(message) if cls is not None else EngineCoreError(f"{type_name}: {message}")
