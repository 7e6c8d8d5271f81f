"""The OpenAI serving base: what ``engine/serving/chat.py`` and
``completion.py`` share over an ``AsyncEngine`` (vLLM's
``entrypoints/openai/serving_engine.py``): the model list, the checks common
to both endpoints, the mapping of a request onto ``SamplingParams`` with the
context-length rule, running several prompts and the mapping of engine errors
onto OpenAI errors. Streams are typed chunks (``chunks.py``); ``tandem engine
serve`` frames them as SSE.

Formats follow the OpenAI API reference (chat completion object, chunk object,
legacy completions) and vLLM's OpenAI server (extra sampling fields,
``stop_reason``, ``continuous_usage_stats``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any


from engine.async_engine import AsyncEngine, EngineDeadError, EngineDrainingError, RequestWithdrawn
from engine.config import default_model_path
from engine.input_checks import logprobs_problem, priority_problem, token_id_problem
from engine.outputs import CompletionOutput, RequestOutput
from engine.protocol.errors import ServingError
from engine.protocol.guided import GUIDED_FIELDS, guided_field_hint
from engine.protocol.param_ranges import check_param
from engine.sampling_params import SamplingParams
from engine.serving.chat_structured import ChatPlan
from engine.serving.logprobs import LogprobFormatter
from engine.serving.protocol import UNSERVED_FIELDS, ChatCompletionRequest, RequestValidationError, parse_request

logger = logging.getLogger("tandem.serving")

@dataclass
class Prompt:
    """One prompt ready for the engine; ``cache_salt``: the request's (``AsyncEngine.generate``);
    ``return_tokens_as_token_ids``: its answer's logprobs name tokens ``token_id:<id>`` (vLLM's)."""

    token_ids: list[int]
    text: str | None
    params: SamplingParams
    cache_salt: str | None = None
    return_tokens_as_token_ids: bool = False


@dataclass(frozen=True)
class RenderedPrompt:
    """A request body parsed, checked and tokenized as the engine runs it (``chat.render_chat``,
    ``completion.render_completion``). The gateway renders a request once, reads ``prompt_tokens`` for routing
    and hands the rendering to the engine, which then does not tokenize again.

    Args:
        request: the parsed body (``ChatCompletionRequest`` | ``CompletionRequest``).
        prompts: (text or None for token-id and chat prompts, token ids) per prompt; one for chat.
        plan: chat only: what tools and response_format add to the template and the sampling (``plan.messages``:
            the messages the template rendered).
    """

    request: Any
    prompts: tuple[tuple[str | None, list[int]], ...]
    plan: ChatPlan | None = None

    @property
    def prompt_tokens(self) -> int:
        """Tokens over all prompts (``usage.prompt_tokens`` of the answer)."""
        return sum(len(ids) for _, ids in self.prompts)

    @property
    def longest_prompt_tokens(self) -> int:
        """Tokens of the longest prompt: each prompt of a batch is a sequence of its own, which must fit the
        context alone."""
        return max((len(ids) for _, ids in self.prompts), default=0)


def parse_body(body: Any, schema):
    """``body`` (decoded JSON) as ``schema``.

    Raises:
        ServingError: 400 naming the offending parameter.
    """
    try:
        return parse_request(body, schema)
    except RequestValidationError as exc:
        raise ServingError(400, str(exc), param=exc.param, code=exc.code) from None



class OpenAIServing:
    """What the chat and completions paths share over an ``AsyncEngine``: the
    model list, common checks, request -> ``SamplingParams``, running prompts.

    Args:
        engine: a started ``AsyncEngine`` (its tokenizer and max_model_len are used).
        served_model_name: the model name accepted (404 otherwise), or several
            (vLLM's aliases): each is accepted and an answer reports the one its
            request named; a request without ``model`` gets the first.
        return_tokens_as_token_ids: the default of requests' ``return_tokens_as_token_ids`` (vLLM's
            ``--return-tokens-as-token-ids``).
    """

    def __init__(self, engine: AsyncEngine, served_model_name: str | Sequence[str],
                 return_tokens_as_token_ids: bool = False) -> None:
        self.engine = engine
        self.return_tokens_as_token_ids = return_tokens_as_token_ids
        names = (served_model_name,) if isinstance(served_model_name, str) else tuple(served_model_name)
        self.served_model_name, self.served_model_names = names[0], names
        self.created = int(time.time())
        self.logprobs = LogprobFormatter(engine.tokenizer)
        self._logprobs_by_id = LogprobFormatter(engine.tokenizer, as_token_ids=True)

    # ------------------------------------------------------------------ models
    def models(self) -> dict:
        """Body of ``GET /v1/models``: vLLM's ``ModelCard`` per served name (``root``: the model's path, as given),
        with its ``permission`` list (one ``model_permission``, vLLM's defaults)."""
        return {"object": "list", "data": [{
            "id": name, "object": "model", "created": self.created, "owned_by": "tandem",
            "root": self.engine.args.model or default_model_path(), "parent": None,
            "max_model_len": self.engine.max_model_len,
            "permission": [model_permission(self.created)],
        } for name in self.served_model_names]}

    def token_ids_named(self, req) -> bool:
        """Whether ``req``'s logprobs name tokens ``token_id:<id>``: its ``return_tokens_as_token_ids``, else the
        server's default."""
        asked = req.return_tokens_as_token_ids
        return self.return_tokens_as_token_ids if asked is None else asked

    def reported_model(self, model: str | None) -> str:
        """The ``model`` an answer reports: the body's when it is one of the served names (vLLM echoes it),
        else the first served name."""
        return model if model in self.served_model_names else self.served_model_name

    def check_model(self, model: str | None) -> None:
        """404 ``model_not_found`` (OpenAI's) unless ``model`` is None or one of the served names."""
        if model is not None and model not in self.served_model_names:
            raise ServingError(404, f"The model `{model}` does not exist. Available: "
                                    f"{', '.join(self.served_model_names)}",
                               type="invalid_request_error", param="model", code="model_not_found")


    async def _compile_grammar(self, plan: ChatPlan):
        """Validate and compile the request's grammar in the engine core's
        grammar pool (its step loop then finds it in the cache); the spec
        with its digest (the core does not hash it again), or None.

        Raises:
            ServingError: 400 when the spec is refused (invalid, outside the
                supported subset, over ``structured_outputs_max_bytes``), 408
                when its compile ran past ``structured_outputs_compile_timeout_s``,
                500 when the compile failed inside; the same for the tools
                ``tool_choice: "none"`` leaves unused (``plan.unused_tools``).
        """
        if plan.unused_tools is not None:
            await self._compiled(plan.unused_tools, "tools")
        if plan.structured_outputs is None:
            return None
        digest = await self._compiled(plan.structured_outputs, plan.param)
        return dataclasses.replace(plan.structured_outputs, digest=digest)

    async def _compiled(self, spec, field: str) -> str:
        """``spec``'s digest once compiled (``AsyncEngine.compile_grammar``); ``field``: the request's field it
        comes from, where its message names no other. Raises ServingError as ``_compile_grammar`` says."""
        try:
            return await self.engine.compile_grammar(spec)
        except ValueError as exc:
            status = getattr(exc, "status", 400)
            param = _faulty_field(str(exc), spec.where, field)
            message = str(exc) if str(exc).startswith(param) else f"{param}: {exc}"
            code = None
            if status == 408:
                code = "grammar_compile_timeout"
            elif status < 500:      # a refused JSON schema (a response format's, tools' parameters): OpenAI's code
                code = "invalid_json_schema" if spec.json is not None or spec.structural_tag else "invalid_value"
            raise ServingError(status, message, param=param,
                               type="server_error" if status >= 500 else "invalid_request_error",
                               code=code) from None

    # ---------------------------------------------------------------- helpers
    def _check_common(self, req, model: str | None) -> None:
        """Engine state and the checks both endpoints share; ``model`` is the body's (the gateway rewrites it to
        the served name after rendering)."""
        if not self.engine.ready:
            raise ServingError(503, "the engine is not ready", type="server_error", code="engine_not_ready")
        if not self.engine.accepting:
            raise ServingError(503, "the engine is shutting down", type="server_error", code="engine_draining")
        self.check_model(model)
        for name, why in UNSERVED_FIELDS.items():   # ignoring one would answer otherwise than vLLM does
            value = getattr(req, name, None)   # chat_template: chat's only
            if value is not None and value is not False:
                raise ServingError(400, f"{name}: {why}", param=name, code="unsupported_parameter")
        if req.best_of is not None and req.best_of != (req.n or 1):
            raise ServingError(400, f"best_of: only best_of == n is supported, got {req.best_of}", param="best_of",
                               code="unsupported_value")
        for name in GUIDED_FIELDS:   # vLLM's older constraint fields: ignoring one would answer unconstrained
            if getattr(req, name) is not None:
                raise ServingError(400, f"{name}: {guided_field_hint(name)}", param=name, code="unsupported_parameter")
        if req.prompt_logprobs is not None and req.stream:   # vLLM's refusal, word for word
            raise ServingError(400, "`prompt_logprobs` are not available when `stream=True`.",
                               param="prompt_logprobs", code="invalid_value")
        if req.stream_options is not None and not req.stream:
            raise ServingError(400, "stream_options: only allowed when stream is true", param="stream_options",
                               code="invalid_value")
        if (problem := priority_problem(req.priority or 0, self.engine.args.scheduling_policy)) is not None:
            raise ServingError(400, problem.message, param="priority", code="invalid_value")   # vLLM refuses it too

    def _sampling_params(self, req, num_prompt_tokens: int, *, max_tokens: int | None, logprobs: int | None,
                         prompt_logprobs: int | None, prompt_field: str, structured_outputs=None,
                         max_tokens_field: str = "max_tokens") -> SamplingParams:
        """Map a request onto ``SamplingParams`` and check the context limit (``max_tokens_field``: the field
        ``max_tokens`` came from, named by the error).

        Raises:
            ServingError: 400 naming the bad parameter, or naming ``max_model_len``
                when the prompt (plus ``max_tokens``) does not fit.
        """
        defaults = self.engine.args.sampling_defaults   # the model's generation config (vLLM's default "auto")

        def pick(name: str, fallback):   # the request's value, else the model's default, else vLLM's
            value = getattr(req, name)
            return value if value is not None else defaults.get(name, fallback)

        if defaults.get("max_tokens") is not None:   # vLLM's get_max_tokens: the smallest of both
            max_tokens = defaults["max_tokens"] if max_tokens is None else min(max_tokens, defaults["max_tokens"])
        stop = req.stop
        if isinstance(stop, str):
            stop = [stop]
        kwargs = dict(
            n=pick("n", 1), temperature=pick("temperature", 1.0), top_p=pick("top_p", 1.0), top_k=pick("top_k", 0),
            min_p=pick("min_p", 0.0), presence_penalty=pick("presence_penalty", 0.0),
            frequency_penalty=pick("frequency_penalty", 0.0), repetition_penalty=pick("repetition_penalty", 1.0),
            seed=req.seed,
            logit_bias=self._logit_bias(req.logit_bias),
            max_tokens=max_tokens,
            min_tokens=req.min_tokens, stop=stop or [], stop_token_ids=req.stop_token_ids or [],
            ignore_eos=req.ignore_eos, include_stop_str_in_output=req.include_stop_str_in_output,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs, skip_special_tokens=req.skip_special_tokens,
            spaces_between_special_tokens=req.spaces_between_special_tokens,
            structured_outputs=structured_outputs, allowed_token_ids=req.allowed_token_ids, bad_words=req.bad_words,
        )
        try:
            params = SamplingParams(**kwargs)
        except ValueError as exc:
            message = str(exc)
            param = message.split(" ", 1)[0]
            if param == "logprobs" and isinstance(req, ChatCompletionRequest):
                param, message = "top_logprobs", "top_logprobs" + message[len("logprobs"):]
            raise ServingError(400, message, param=param, code="invalid_value") from None
        if (problem := logprobs_problem(params, self.engine.args.max_logprobs,
                                        self.engine.tokenizer.vocab_size)) is not None:
            field = problem.field
            if field == "logprobs" and isinstance(req, ChatCompletionRequest):
                field = "top_logprobs"
            raise ServingError(400, problem.message, param=field, code="invalid_value")
        if (problem := token_id_problem(params, self.engine.tokenizer.vocab_size)) is not None:
            raise ServingError(400, problem.message, param=problem.field, code="invalid_value")
        limit = self.engine.max_model_len
        if num_prompt_tokens >= limit:
            raise ServingError(
                400, f"This model's maximum context length is {limit} tokens (max_model_len). However, your "
                     f"{prompt_field} resulted in {num_prompt_tokens} tokens. Please reduce the length of the "
                     f"{prompt_field}.", param=prompt_field, code="context_length_exceeded")
        if max_tokens is not None and num_prompt_tokens + max_tokens > limit:
            raise ServingError(
                400, f"This model's maximum context length is {limit} tokens (max_model_len). However, you "
                     f"requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the "
                     f"{prompt_field}, {max_tokens} in the completion). Please reduce the length of the "
                     f"{prompt_field} or of {max_tokens_field}.", param=max_tokens_field,
                code="context_length_exceeded")
        if max_tokens is None and params.min_tokens > limit - num_prompt_tokens:   # vLLM sets max_tokens to that room
            raise ServingError(400, f"min_tokens must be <= max_tokens={limit - num_prompt_tokens} (the room the "
                                    f"context leaves after the {num_prompt_tokens}-token {prompt_field}), got "
                                    f"{params.min_tokens}", param="min_tokens", code="invalid_value")
        return params

    @staticmethod
    def _logit_bias(bias: dict | None) -> dict[int, float] | None:
        """A request's ``logit_bias`` (token id as a JSON key -> bias; keys and biases checked by the shared range
        table when the body was parsed: ``param_ranges``; ids past the vocabulary by ``token_id_problem``) as
        ``SamplingParams`` takes it."""
        return {int(key): value for key, value in bias.items()} if bias else None

    def logprobs_of(self, prompt: Prompt) -> LogprobFormatter:
        """The formatter of ``prompt``'s answer logprobs (tokens named by id when it asks)."""
        return self._logprobs_by_id if prompt.return_tokens_as_token_ids else self.logprobs

    def truncated(self, r: RenderedPrompt) -> RenderedPrompt:
        """``r`` with vLLM's ``truncate_prompt_tokens`` of -1 applied (each prompt's last ``max_model_len`` tokens;
        a positive value was applied when it was rendered: ``truncate_prompt``).

        Raises:
            ServingError: 400 when the value is above ``max_model_len`` (vLLM's refusal)."""
        keep = truncation(r.request.truncate_prompt_tokens, self.engine.max_model_len)   # refused above it
        if r.request.truncate_prompt_tokens != -1:
            return r
        return dataclasses.replace(r, prompts=tuple((text if len(ids) <= keep else None, ids[-keep:])
                                                    for text, ids in r.prompts))

    async def _collect(self, request_id: str, prompts: list[Prompt], priority: int):
        """Run every prompt to completion; per prompt: {index: cumulative
        CompletionOutput}, cached prompt tokens and prompt logprobs. Cancelled, the ``CancelledError`` goes on
        with the usage so far (``PARTIAL_USAGE``)."""
        choices: list[dict[int, CompletionOutput]] = [{} for _ in prompts]
        cached = [0] * len(prompts)
        prompt_lps: list[list] = [[] for _ in prompts]
        streams = [self.engine.generate(p.token_ids, p.params, engine_id(request_id, i, len(prompts)), priority,
                                        cache_salt=p.cache_salt) for i, p in enumerate(prompts)]
        try:
            async with contextlib.aclosing(merge_streams(streams)) as merged:
                async for p_idx, out in merged:
                    cached[p_idx] = out.num_cached_tokens
                    if out.prompt_logprobs is not None:
                        prompt_lps[p_idx] = out.prompt_logprobs
                    for c in out.outputs:
                        ch = choices[p_idx].get(c.index)
                        if ch is None:
                            choices[p_idx][c.index] = ch = CompletionOutput(c.index)
                        merge_choice(ch, c)
        except asyncio.CancelledError as exc:   # the caller gave up (its client left): the engine aborted them
            generated = sum(ch.num_generated_tokens for per_prompt in choices for ch in per_prompt.values())
            setattr(exc, PARTIAL_USAGE, usage(sum(len(p.token_ids) for p in prompts), generated, sum(cached)))
            raise
        except Exception as exc:
            raise error_from_engine(exc) from None
        return choices, cached, prompt_lps


# ---------------------------------------------------------------------- helpers
# The attribute a whole (non-streamed) answer's cancellation carries: its ``usage`` up to the last output the
# serving layer received before the abort (the prompt, the tokens generated so far, the cached ones). The gateway
# bills a client that left with it (``gateway.billing.counting.partial_usage`` reads it).
PARTIAL_USAGE = "partial_usage"


def model_permission(created: int) -> dict:
    """vLLM's ``ModelPermission`` with its defaults (sampling, logprobs and viewing allowed)."""
    return {"id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission", "created": created,
            "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
            "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False, "organization": "*",
            "group": None, "is_blocking": False}


def truncation(keep: int | None, limit: int) -> int | None:
    """vLLM's ``truncate_prompt_tokens`` against ``max_model_len`` ``limit``: the tokens a prompt keeps (-1: ``limit``;
    None: all).

    Raises:
        ServingError: 400 out of the shared range table's range (below -1: ``param_ranges``), or above ``limit``
            (vLLM's refusal, in its words)."""
    if keep is not None and (v := check_param("truncate_prompt_tokens", keep)) is not None:
        raise ServingError(400, v.message, param=v.param, code=v.code)
    if keep is not None and keep > limit:
        raise ServingError(400, f"truncate_prompt_tokens value ({keep}) is greater than max_model_len ({limit}). "
                                "Please, select a smaller truncation size.", param="truncate_prompt_tokens",
                           code="invalid_value")
    return limit if keep == -1 else keep


def truncate_prompt(ids: list[int], keep: int | None) -> list[int]:
    """vLLM's ``truncate_prompt_tokens`` where a prompt is rendered: its last ``keep`` token ids when ``keep`` >= 1
    (-1, the whole context, is applied by ``OpenAIServing.truncated``; None: all).

    Raises:
        ServingError: 400 for 0 (no prompt would be left)."""
    if keep == 0:
        raise ServingError(400, "truncate_prompt_tokens: must be -1 (the model's context) or at least 1, got 0",
                           param="truncate_prompt_tokens", code="invalid_value")
    return ids[-keep:] if keep is not None and keep > 0 else ids


def engine_id(request_id: str, i: int, num_prompts: int) -> str:
    return request_id if num_prompts == 1 else f"{request_id}-{i}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def usage_options(req) -> tuple[bool, bool]:
    """``stream_options`` as (include_usage, continuous_usage_stats); the
    latter only counts together with the former."""
    opts = req.stream_options
    include_usage = bool(opts and opts.include_usage)
    return include_usage, include_usage and bool(opts.continuous_usage_stats)


def merge_choice(ch: CompletionOutput, delta: CompletionOutput) -> None:
    """Fold a delta into the cumulative output of its choice."""
    ch.text += delta.text
    ch.token_ids.extend(delta.token_ids)
    if delta.logprobs is not None:
        if ch.logprobs is None:
            ch.logprobs = []
        ch.logprobs.extend(delta.logprobs)
    if delta.finish_reason is not None:
        ch.finish_reason, ch.stop_reason = delta.finish_reason, delta.stop_reason
    ch.num_generated_tokens = max(ch.num_generated_tokens, delta.num_generated_tokens)


def reject_abort(finish_reason: str | None) -> None:
    if finish_reason == "abort":
        raise ServingError(503, "the request was aborted by the engine (shutting down)", type="server_error",
                           code="aborted")


# The error code of a request the engine withdrew before computing anything (``AsyncEngine.withdraw``).
WITHDRAWN = "withdrawn"


def error_from_engine(exc: BaseException) -> ServingError:
    """Map an engine exception onto a client error (never a traceback)."""
    if isinstance(exc, ServingError):
        return exc
    if isinstance(exc, (EngineDrainingError, EngineDeadError)):
        return ServingError(503, str(exc), type="server_error", code="engine_unavailable")
    if isinstance(exc, RequestWithdrawn):
        return ServingError(503, str(exc), type="server_error", code=WITHDRAWN)
    if isinstance(exc, ValueError):
        status = getattr(exc, "status", 400)   # a core call's reply may carry a server-side status (an aborted embed)
        if status >= 500:
            return ServingError(status, str(exc), type="server_error")
        return ServingError(400, str(exc), code="invalid_value")
    logger.error("request failed in the engine", exc_info=exc)
    return ServingError(500, f"internal engine error ({type(exc).__name__})", type="server_error")


_END = object()


async def merge_streams(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several engine streams as (stream index, output); closing
    this iterator closes (and so aborts) every stream."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as s:
            async for out in s:
                yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream) -> None:
        try:
            async with contextlib.aclosing(stream) as s:
                async for out in s:
                    queue.put_nowait((i, out, None))
        except Exception as exc:  # noqa: BLE001 - re-raised by the consumer
            queue.put_nowait((i, None, exc))
        finally:
            queue.put_nowait((i, _END, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, out, exc = await queue.get()
            if exc is not None:
                raise exc
            if out is _END:
                remaining -= 1
                continue
            yield i, out
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _faulty_field(message: str, where: tuple[str, ...], param: str) -> str:
    """The top-level field a refused grammar's ``message`` names: that of the spec's schema path (``where``) it
    starts with (``tools`` for ``tools[i].function.parameters...``, ``response_format``), else ``param``, the
    plan's (a trial's bad response format sent beside tools was blamed on ``tools``)."""
    for path in where:
        if message.startswith(path):
            return path.split(".", 1)[0].split("[", 1)[0]
    return param
