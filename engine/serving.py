"""OpenAI-compatible text generation on top of ``AsyncEngine``, independent of HTTP.

``OpenAIServing.create_chat_completion(body, request_id)`` and
``create_completion(body, request_id)`` take a decoded JSON body and return
either the full response (a dict) or, when ``body["stream"]`` is true, an
async iterator of Server-Sent-Events lines (``b"data: {...}\\n\\n"`` ...
``b"data: [DONE]\\n\\n"``). Bad input raises ``ServingError`` before anything
is streamed. Both ``tandem engine serve`` (engine/server.py) and the gateway's
local backend call this class in-process.

Formats follow the OpenAI API reference (chat completion object, chunk object,
legacy completions with ``logprobs``/``text_offset``) and vLLM's OpenAI server
(extra sampling fields, ``stop_reason``, ``continuous_usage_stats``).

Logprobs are the model's own distribution (log-softmax of the raw logits,
before temperature, penalties and top-k/top-p; see engine/sampler.py); they
are clamped to -9999.0 so that -inf stays valid JSON.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgspec

from engine.async_engine import AsyncEngine, EngineDeadError, EngineDrainingError
from engine.chat_structured import ChatPlan, ToolCallParser, parse_tool_calls, plan_chat, structured_outputs_extra
from engine.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from engine.protocol import ChatCompletionRequest, CompletionRequest, RequestValidationError, parse_request
from engine.sampling_params import SamplingParams
from engine.tokenizer import bytes_to_unicode

logger = logging.getLogger("tandem.serving")

_MIN_LOGPROB = -9999.0
_DONE = b"data: [DONE]\n\n"


class ServingError(Exception):
    """An error to return to the client in OpenAI's format.

    Attributes:
        status_code: HTTP status (400 bad input, 404 unknown model, 503
            draining or dead engine, 500 internal).
        message: human-readable, names the parameter at fault.
        type: OpenAI error type ("invalid_request_error", "server_error", ...).
        param: the request field at fault, or None.
        code: OpenAI error code (e.g. "model_not_found"), or None.
    """

    def __init__(self, status_code: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def to_dict(self) -> dict:
        """``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _sse(obj: Any) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


def _clamp(lp: float) -> float:
    return _MIN_LOGPROB if math.isnan(lp) or lp < _MIN_LOGPROB else float(lp)


def _byte_decoder() -> dict[str, int]:
    """Byte-level BPE spelling -> byte (the inverse of GPT-2's table)."""
    return {c: b for b, c in bytes_to_unicode().items()}


class _TokenTexts:
    """Cached text and raw bytes of single tokens, for logprobs.

    ``bytes`` are exact for byte-level BPE tokens (a token may hold part of a
    multi-byte character); other tokens fall back to their decoded UTF-8."""

    def __init__(self, tokenizer) -> None:
        self._tok = tokenizer
        self._decoder = _byte_decoder()
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def get(self, token_id: int, decoded: str = "") -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is not None:
            return hit
        text = decoded or self._tok.decode([token_id], skip_special_tokens=False)
        spelled = self._tok.convert_ids_to_tokens([token_id])[0] or ""
        if spelled and all(ch in self._decoder for ch in spelled) and token_id not in self._tok.all_special_ids:
            raw = [self._decoder[ch] for ch in spelled]
        else:
            raw = list(text.encode("utf-8"))
        self._cache[token_id] = (text, raw)
        return text, raw


@dataclass
class _Prompt:
    """One prompt ready for the engine."""

    token_ids: list[int]
    text: str | None
    params: SamplingParams


class OpenAIServing:
    """The OpenAI API (chat completions, completions, models) over an ``AsyncEngine``.

    Args:
        engine: a started ``AsyncEngine`` (its tokenizer and max_model_len are used).
        served_model_name: the only model name accepted (404 otherwise); a
            request without ``model`` gets it too.
    """

    def __init__(self, engine: AsyncEngine, served_model_name: str) -> None:
        self.engine = engine
        self.served_model_name = served_model_name
        self.created = int(time.time())
        self._texts: _TokenTexts | None = None

    # ------------------------------------------------------------------ models
    def models(self) -> dict:
        """Body of ``GET /v1/models``."""
        return {"object": "list", "data": [{
            "id": self.served_model_name, "object": "model", "created": self.created, "owned_by": "tandem",
            "root": self.served_model_name, "parent": None, "max_model_len": self.engine.max_model_len,
        }]}

    # ------------------------------------------------------------------- chat
    async def create_chat_completion(self, body: dict, request_id: str,
                                     priority: int = 0) -> dict | AsyncIterator[bytes]:
        """``POST /v1/chat/completions``.

        Args:
            body: the decoded JSON body.
            request_id: unique id; also the response's ``id``.
            priority: scheduling priority when the body has none (lower = first).

        Returns:
            The ``chat.completion`` object, or an async iterator of SSE lines
            (``chat.completion.chunk`` objects, then ``[DONE]``) when streaming.

        Raises:
            ServingError: 400 bad input (names the parameter; prompt over
                ``max_model_len``), 404 unknown model, 503 engine draining/dead.
        """
        req = self._parse(body, ChatCompletionRequest)
        self._check_common(req)
        if req.continue_final_message and req.add_generation_prompt:
            raise ServingError(400, "continue_final_message: cannot be used with add_generation_prompt=true",
                               param="continue_final_message")
        if req.top_logprobs is not None and not req.logprobs:
            raise ServingError(400, "top_logprobs: requires logprobs to be true", param="top_logprobs")
        if req.top_logprobs is not None and not (0 <= req.top_logprobs <= 20):
            raise ServingError(400, f"top_logprobs: must be in [0, 20], got {req.top_logprobs}", param="top_logprobs")
        if req.max_completion_tokens is not None and req.max_completion_tokens < 1:
            raise ServingError(400, f"max_completion_tokens: must be at least 1, got {req.max_completion_tokens}",
                               param="max_completion_tokens")
        messages = _normalize_messages(req.messages)
        tokenizer = self.engine.tokenizer
        try:
            plan = plan_chat(req, messages, tokenizer.chat_template)
        except RequestValidationError as exc:
            raise ServingError(400, str(exc), param=exc.param) from None
        messages = plan.messages
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt,
                                                 **plan.template_kwargs, **(req.chat_template_kwargs or {}))
        except Exception as exc:  # jinja2.TemplateError, ValueError (no template)
            raise ServingError(400, f"messages: the chat template failed: {exc}", param="messages") from None
        if req.continue_final_message:
            text = _cut_after_final_message(text, messages)
        token_ids = tokenizer.encode(text, add_special_tokens=req.add_special_tokens)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = self._sampling_params(req, len(token_ids), max_tokens=max_tokens, logprobs=logprobs,
                                       prompt_logprobs=req.prompt_logprobs, prompt_field="messages",
                                       structured_outputs=plan.structured_outputs)
        await self._compile_grammar(plan)
        echo = ""
        if req.echo and messages and messages[-1].get("role") == "assistant":
            echo = messages[-1].get("content") or ""
        prompt = _Prompt(token_ids, None, params)
        prio = req.priority if req.priority is not None else priority
        top = req.top_logprobs or 0
        if req.stream:
            include_usage, continuous = _usage_options(req)
            return self._chat_stream(request_id, prompt, prio, bool(req.logprobs), top, echo,
                                     include_usage, continuous, plan.parse_tool_calls)
        return await self._chat_full(request_id, prompt, prio, bool(req.logprobs), top, echo, plan.parse_tool_calls)

    async def _compile_grammar(self, plan: ChatPlan) -> None:
        """Compile the request's grammar in a worker thread (the engine thread
        then finds it in the cache).

        Raises:
            ServingError: 400 when xgrammar refuses the spec.
        """
        if plan.structured_outputs is None:
            return
        try:
            await self.engine.compile_grammar(plan.structured_outputs)
        except ValueError as exc:
            raise ServingError(400, f"{plan.param}: {exc}", param=plan.param) from None

    async def _chat_full(self, request_id: str, prompt: _Prompt, priority: int, want_logprobs: bool,
                         top: int, echo: str, tool_calls: bool = False) -> dict:
        choices, cached, prompt_lps = await self._collect(request_id, [prompt], priority)
        out_choices = []
        completion_tokens = 0
        for index, ch in sorted(choices[0].items()):
            _reject_abort(ch.finish_reason)
            completion_tokens += ch.num_generated_tokens
            message = {"role": "assistant", "content": echo + ch.text, "refusal": None}
            finish_reason = ch.finish_reason
            if tool_calls:
                message["content"], calls = parse_tool_calls(ch.text)
                if calls:
                    message["tool_calls"] = calls
                    finish_reason = _tool_finish_reason(finish_reason)
            out_choices.append({
                "index": index,
                "message": message,
                "logprobs": {"content": self._chat_logprobs(ch.token_ids, ch.logprobs or [], top),
                             "refusal": None} if want_logprobs else None,
                "finish_reason": finish_reason,
                "stop_reason": ch.stop_reason,
            })
        response = {
            "id": request_id, "object": "chat.completion", "created": int(time.time()),
            "model": self.served_model_name, "choices": out_choices,
            "usage": _usage(len(prompt.token_ids), completion_tokens, cached[0]),
            "system_fingerprint": None,
        }
        if prompt.params.prompt_logprobs is not None:
            response["prompt_logprobs"] = self._prompt_logprobs_vllm(prompt.token_ids, prompt_lps[0])
        return response

    async def _chat_stream(self, request_id: str, prompt: _Prompt, priority: int, want_logprobs: bool,
                           top: int, echo: str, include_usage: bool, continuous: bool,
                           tool_calls: bool = False) -> AsyncIterator[bytes]:
        created = int(time.time())
        n = prompt.params.n
        parsers = [ToolCallParser() for _ in range(n)] if tool_calls else None
        num_prompt = len(prompt.token_ids)
        generated = [0] * n
        cached = 0

        def chunk(choices: list, usage: dict | None = None) -> bytes:
            return self._chunk(request_id, "chat.completion.chunk", created, choices, usage)

        def running_usage() -> dict | None:
            return _usage(num_prompt, sum(generated), cached) if continuous else None

        try:
            for i in range(n):
                yield chunk([{"index": i, "delta": {"role": "assistant", "content": echo},
                              "logprobs": None, "finish_reason": None}], running_usage())
            async with contextlib.aclosing(self.engine.generate(
                    prompt.token_ids, prompt.params, request_id, priority)) as stream:
                async for out in stream:
                    cached = out.num_cached_tokens
                    for c in out.outputs:
                        _reject_abort(c.finish_reason)
                        generated[c.index] = c.num_generated_tokens
                        lps = None
                        if want_logprobs and c.token_ids:
                            lps = {"content": self._chat_logprobs(c.token_ids, c.logprobs or [], top),
                                   "refusal": None}
                        deltas, finish_reason = _stream_deltas(parsers, c)
                        if not deltas and finish_reason is None and lps is None:
                            continue
                        deltas = deltas or [{}]
                        for k, delta in enumerate(deltas):
                            last = k == len(deltas) - 1
                            choice = {"index": c.index, "delta": delta, "logprobs": lps if k == 0 else None,
                                      "finish_reason": finish_reason if last else None}
                            if last and finish_reason is not None:
                                choice["stop_reason"] = c.stop_reason
                            yield chunk([choice], running_usage())
            if include_usage:
                yield chunk([], _usage(num_prompt, sum(generated), cached))
        except Exception as exc:  # noqa: BLE001 - reported to the client, never a traceback
            yield _sse(_error_from_engine(exc).to_dict())
        yield _DONE

    # ------------------------------------------------------------ completions
    async def create_completion(self, body: dict, request_id: str,
                                priority: int = 0) -> dict | AsyncIterator[bytes]:
        """``POST /v1/completions`` (legacy completions).

        Args:
            body: the decoded JSON body.
            request_id: unique id; also the response's ``id``; with several
                prompts the engine ids are ``f"{request_id}-{i}"``.
            priority: scheduling priority when the body has none (lower = first).

        Returns:
            The ``text_completion`` object, or an async iterator of SSE lines.

        Raises:
            ServingError: 400 bad input (names the parameter), 404 unknown
                model, 503 engine draining/dead.
        """
        req = self._parse(body, CompletionRequest)
        self._check_common(req)
        if req.suffix:
            raise ServingError(400, "suffix: is not supported", param="suffix")
        echo = bool(req.echo)
        texts_and_ids = self._completion_prompts(req)
        prompt_logprobs = req.prompt_logprobs
        if echo and req.logprobs is not None:
            prompt_logprobs = max(req.logprobs, prompt_logprobs or 0)
        try:
            plan = ChatPlan(structured_outputs=structured_outputs_extra(req.structured_outputs),
                            param="structured_outputs")
        except RequestValidationError as exc:
            raise ServingError(400, str(exc), param=exc.param) from None
        await self._compile_grammar(plan)
        prompts = []
        for text, ids in texts_and_ids:
            params = self._sampling_params(req, len(ids), max_tokens=req.max_tokens, logprobs=req.logprobs,
                                           prompt_logprobs=prompt_logprobs, prompt_field="prompt",
                                           structured_outputs=plan.structured_outputs)
            prompts.append(_Prompt(ids, text, params))
        prio = req.priority if req.priority is not None else priority
        if req.stream:
            include_usage, continuous = _usage_options(req)
            return self._completion_stream(request_id, prompts, prio, req.logprobs, echo, include_usage, continuous)
        return await self._completion_full(request_id, prompts, prio, req.logprobs, echo)

    def _completion_prompts(self, req: CompletionRequest) -> list[tuple[str | None, list[int]]]:
        """The request's prompts as (text or None, token ids)."""
        p = req.prompt
        vocab = self.engine.tokenizer.vocab_size
        if isinstance(p, str):
            items: list = [p]
        elif p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            items = [p]
        else:
            items = list(p)
        if not items:
            raise ServingError(400, "prompt: must not be empty", param="prompt")
        out = []
        for item in items:
            if isinstance(item, str):
                ids = self.engine.tokenizer.encode(item, add_special_tokens=req.add_special_tokens)
                out.append((item, ids))
            elif isinstance(item, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in item):
                if any(t < 0 or t >= vocab for t in item):
                    raise ServingError(400, f"prompt: token ids must be in [0, {vocab})", param="prompt")
                out.append((None, list(item)))
            else:
                raise ServingError(400, "prompt: must be a string, a list of strings, a list of token ids "
                                        "or a list of token-id lists", param="prompt")
            if not out[-1][1]:
                raise ServingError(400, "prompt: must not be empty", param="prompt")
        return out

    def _prompt_text(self, prompt: _Prompt) -> str:
        if prompt.text is not None:
            return prompt.text
        return self.engine.tokenizer.decode(prompt.token_ids, skip_special_tokens=False)

    async def _completion_full(self, request_id: str, prompts: list[_Prompt], priority: int,
                               logprobs: int | None, echo: bool) -> dict:
        choices, cached, prompt_lps = await self._collect(request_id, prompts, priority)
        out_choices = []
        num_prompt = completion_tokens = 0
        for p_idx, prompt in enumerate(prompts):
            n = prompt.params.n
            num_prompt += len(prompt.token_ids)
            prefix = self._prompt_text(prompt) if echo else ""
            for index, ch in sorted(choices[p_idx].items()):
                _reject_abort(ch.finish_reason)
                completion_tokens += ch.num_generated_tokens
                lps = None
                if logprobs is not None:
                    lps = _empty_completion_logprobs()
                    offset = 0
                    if echo:
                        offset = self._append_prompt_logprobs(lps, prompt.token_ids, prompt_lps[p_idx], logprobs)
                    self._append_completion_logprobs(lps, ch.token_ids, ch.logprobs or [], logprobs, offset)
                choice = {"index": p_idx * n + index, "text": prefix + ch.text, "logprobs": lps,
                          "finish_reason": ch.finish_reason, "stop_reason": ch.stop_reason}
                if prompt.params.prompt_logprobs is not None and not echo:  # vLLM: per choice
                    choice["prompt_logprobs"] = self._prompt_logprobs_vllm(prompt.token_ids, prompt_lps[p_idx])
                out_choices.append(choice)
        return {
            "id": request_id, "object": "text_completion", "created": int(time.time()),
            "model": self.served_model_name, "choices": out_choices,
            "usage": _usage(num_prompt, completion_tokens, sum(cached)),
            "system_fingerprint": None,
        }

    async def _completion_stream(self, request_id: str, prompts: list[_Prompt], priority: int,
                                 logprobs: int | None, echo: bool, include_usage: bool,
                                 continuous: bool) -> AsyncIterator[bytes]:
        created = int(time.time())
        num_prompt = sum(len(p.token_ids) for p in prompts)
        generated: dict[tuple[int, int], int] = {}
        cached = [0] * len(prompts)
        offsets: dict[tuple[int, int], int] = {}
        echoed: set[tuple[int, int]] = set()

        def chunk(choices: list, usage: dict | None = None) -> bytes:
            return self._chunk(request_id, "text_completion", created, choices, usage)

        def running_usage() -> dict | None:
            return _usage(num_prompt, sum(generated.values()), sum(cached)) if continuous else None

        streams = [self.engine.generate(p.token_ids, p.params, _engine_id(request_id, i, len(prompts)), priority)
                   for i, p in enumerate(prompts)]
        try:
            async with contextlib.aclosing(_merge(streams)) as merged:
                async for p_idx, out in merged:
                    prompt = prompts[p_idx]
                    cached[p_idx] = out.num_cached_tokens
                    for c in out.outputs:
                        _reject_abort(c.finish_reason)
                        key = (p_idx, c.index)
                        generated[key] = c.num_generated_tokens
                        text = c.text
                        lps = None
                        if logprobs is not None:
                            lps = _empty_completion_logprobs()
                        if echo and key not in echoed:
                            echoed.add(key)
                            text = self._prompt_text(prompt) + text
                            if lps is not None:
                                offsets[key] = self._append_prompt_logprobs(
                                    lps, prompt.token_ids, out.prompt_logprobs or [], logprobs)
                        if lps is not None:
                            offsets[key] = self._append_completion_logprobs(
                                lps, c.token_ids, c.logprobs or [], logprobs, offsets.get(key, 0))
                            if not lps["tokens"]:
                                lps = None
                        if not text and c.finish_reason is None and lps is None:
                            continue
                        choice = {"index": p_idx * prompt.params.n + c.index, "text": text, "logprobs": lps,
                                  "finish_reason": c.finish_reason}
                        if c.finish_reason is not None:
                            choice["stop_reason"] = c.stop_reason
                        yield chunk([choice], running_usage())
            if include_usage:
                yield chunk([], _usage(num_prompt, sum(generated.values()), sum(cached)))
        except Exception as exc:  # noqa: BLE001 - reported to the client, never a traceback
            yield _sse(_error_from_engine(exc).to_dict())
        yield _DONE

    # ---------------------------------------------------------------- helpers
    def _chunk(self, request_id: str, obj_type: str, created: int, choices: list, usage: dict | None) -> bytes:
        """One SSE event of a streamed response (``usage`` only when given)."""
        obj = {"id": request_id, "object": obj_type, "created": created,
               "model": self.served_model_name, "choices": choices}
        if usage is not None:
            obj["usage"] = usage
        return _sse(obj)

    def _parse(self, body: Any, schema):
        try:
            return parse_request(body, schema)
        except RequestValidationError as exc:
            raise ServingError(400, str(exc), param=exc.param) from None

    def _check_common(self, req) -> None:
        if not self.engine.ready:
            raise ServingError(503, "the engine is not ready", type="server_error", code="engine_not_ready")
        if not self.engine.accepting:
            raise ServingError(503, "the engine is shutting down", type="server_error", code="engine_draining")
        if req.model is not None and req.model != self.served_model_name:
            raise ServingError(404, f"The model `{req.model}` does not exist. Available: {self.served_model_name}",
                               type="invalid_request_error", param="model", code="model_not_found")
        if req.use_beam_search:
            raise ServingError(400, "use_beam_search: beam search is not supported", param="use_beam_search")
        if req.best_of is not None and req.best_of != (req.n or 1):
            raise ServingError(400, f"best_of: only best_of == n is supported, got {req.best_of}", param="best_of")
        if req.logit_bias:
            raise ServingError(400, "logit_bias: is not supported", param="logit_bias")
        policy = self.engine.args.scheduling_policy
        if req.priority not in (None, 0) and policy != "priority":  # vLLM refuses it too
            raise ServingError(400, f"priority: got {req.priority}, but this engine schedules {policy}; start it "
                                    "with --scheduling-policy priority (scheduling_policy: priority) to use "
                                    "request priorities", param="priority")

    def _sampling_params(self, req, num_prompt_tokens: int, *, max_tokens: int | None, logprobs: int | None,
                         prompt_logprobs: int | None, prompt_field: str,
                         structured_outputs=None) -> SamplingParams:
        """Map a request onto ``SamplingParams`` and check the context limit.

        Raises:
            ServingError: 400 naming the bad parameter, or naming ``max_model_len``
                when the prompt (plus ``max_tokens``) does not fit.
        """
        def pick(value, default):
            return default if value is None else value

        stop = req.stop
        if isinstance(stop, str):
            stop = [stop]
        kwargs = dict(
            n=pick(req.n, 1), temperature=pick(req.temperature, 1.0), top_p=pick(req.top_p, 1.0),
            top_k=pick(req.top_k, 0), min_p=pick(req.min_p, 0.0),
            presence_penalty=pick(req.presence_penalty, 0.0), frequency_penalty=pick(req.frequency_penalty, 0.0),
            repetition_penalty=pick(req.repetition_penalty, 1.0), seed=req.seed, max_tokens=max_tokens,
            min_tokens=req.min_tokens, stop=stop or [], stop_token_ids=req.stop_token_ids or [],
            ignore_eos=req.ignore_eos, include_stop_str_in_output=req.include_stop_str_in_output,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs, skip_special_tokens=req.skip_special_tokens,
            spaces_between_special_tokens=req.spaces_between_special_tokens,
            structured_outputs=structured_outputs,
        )
        try:
            params = SamplingParams(**kwargs)
        except ValueError as exc:
            message = str(exc)
            param = message.split(" ", 1)[0]
            if param == "logprobs" and isinstance(req, ChatCompletionRequest):
                param, message = "top_logprobs", "top_logprobs" + message[len("logprobs"):]
            raise ServingError(400, message, param=param) from None
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
                     f"{prompt_field} or of max_tokens.", param="max_tokens", code="context_length_exceeded")
        return params

    async def _collect(self, request_id: str, prompts: list[_Prompt], priority: int):
        """Run every prompt to completion; per prompt: {index: cumulative
        CompletionOutput}, cached prompt tokens and prompt logprobs."""
        choices: list[dict[int, CompletionOutput]] = [{} for _ in prompts]
        cached = [0] * len(prompts)
        prompt_lps: list[list] = [[] for _ in prompts]
        streams = [self.engine.generate(p.token_ids, p.params, _engine_id(request_id, i, len(prompts)), priority)
                   for i, p in enumerate(prompts)]
        try:
            async with contextlib.aclosing(_merge(streams)) as merged:
                async for p_idx, out in merged:
                    cached[p_idx] = out.num_cached_tokens
                    if out.prompt_logprobs is not None:
                        prompt_lps[p_idx] = out.prompt_logprobs
                    for c in out.outputs:
                        ch = choices[p_idx].get(c.index)
                        if ch is None:
                            choices[p_idx][c.index] = ch = CompletionOutput(c.index)
                        _merge_choice(ch, c)
        except Exception as exc:
            raise _error_from_engine(exc) from None
        return choices, cached, prompt_lps

    def _token_texts(self) -> _TokenTexts:
        if self._texts is None:
            self._texts = _TokenTexts(self.engine.tokenizer)
        return self._texts

    def _chat_logprobs(self, token_ids: list[int], positions: list[PositionLogprobs], top: int) -> list[dict]:
        """OpenAI chat ``logprobs.content``: token, logprob, bytes, top_logprobs."""
        texts = self._token_texts()
        content = []
        for tok, pos in zip(token_ids, positions):
            lp = pos.get(tok)
            text, raw = texts.get(tok, lp.decoded_token if lp else "")
            tops = []
            if top:
                for t, l in sorted(pos.items(), key=lambda kv: kv[1].rank):
                    if l.rank > top or len(tops) >= top:
                        break
                    t_text, t_raw = texts.get(t, l.decoded_token)
                    tops.append({"token": t_text, "logprob": _clamp(l.logprob), "bytes": t_raw})
            content.append({"token": text, "logprob": _clamp(lp.logprob) if lp else _MIN_LOGPROB,
                            "bytes": raw, "top_logprobs": tops})
        return content

    def _append_completion_logprobs(self, lps: dict, token_ids: list[int], positions: list[PositionLogprobs],
                                    k: int, offset: int) -> int:
        """Append generated tokens to legacy completions logprobs; returns
        the text offset after them. ``top_logprobs`` holds the top ``k`` plus
        the sampled token (OpenAI: up to logprobs+1 entries)."""
        texts = self._token_texts()
        for tok, pos in zip(token_ids, positions):
            lp = pos.get(tok)
            text, _ = texts.get(tok, lp.decoded_token if lp else "")
            lps["tokens"].append(text)
            lps["token_logprobs"].append(_clamp(lp.logprob) if lp else _MIN_LOGPROB)
            lps["top_logprobs"].append(self._top_dict(pos, k, tok))
            lps["text_offset"].append(offset)
            offset += len(text)
        return offset

    def _append_prompt_logprobs(self, lps: dict, token_ids: list[int], positions: list, k: int) -> int:
        texts = self._token_texts()
        offset = 0
        for i, tok in enumerate(token_ids):
            pos = positions[i] if i < len(positions) else None
            lp = pos.get(tok) if pos else None
            text, _ = texts.get(tok, lp.decoded_token if lp else "")
            lps["tokens"].append(text)
            lps["token_logprobs"].append(_clamp(lp.logprob) if lp else None)
            lps["top_logprobs"].append(self._top_dict(pos, k, tok) if pos else None)
            lps["text_offset"].append(offset)
            offset += len(text)
        return offset

    def _top_dict(self, pos: PositionLogprobs, k: int, sampled: int) -> dict[str, float]:
        texts = self._token_texts()
        out: dict[str, float] = {}
        for t, l in sorted(pos.items(), key=lambda kv: kv[1].rank):
            if l.rank <= k or t == sampled:
                out[texts.get(t, l.decoded_token)[0]] = _clamp(l.logprob)
        return out

    def _prompt_logprobs_vllm(self, token_ids: list[int], positions: list) -> list:
        """vLLM's ``prompt_logprobs`` field: per prompt position None or
        {token_id: {"logprob", "rank", "decoded_token"}}."""
        texts = self._token_texts()
        out = []
        for i in range(len(token_ids)):
            pos = positions[i] if i < len(positions) else None
            out.append(None if pos is None else {
                str(t): {"logprob": _clamp(l.logprob), "rank": l.rank,
                         "decoded_token": texts.get(t, l.decoded_token)[0]} for t, l in pos.items()})
        return out


# ---------------------------------------------------------------------- helpers
def _engine_id(request_id: str, i: int, num_prompts: int) -> str:
    return request_id if num_prompts == 1 else f"{request_id}-{i}"


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _usage_options(req) -> tuple[bool, bool]:
    """``stream_options`` as (include_usage, continuous_usage_stats); the
    latter only counts together with the former."""
    opts = req.stream_options
    include_usage = bool(opts and opts.include_usage)
    return include_usage, include_usage and bool(opts.continuous_usage_stats)


def _empty_completion_logprobs() -> dict:
    return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}


def _merge_choice(ch: CompletionOutput, delta: CompletionOutput) -> None:
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


def _tool_finish_reason(finish_reason: str | None) -> str | None:
    """OpenAI's "tool_calls" for an output that ended with tool calls."""
    return "tool_calls" if finish_reason == "stop" else finish_reason


def _stream_deltas(parsers: list[ToolCallParser] | None, c: CompletionOutput) -> tuple[list[dict], str | None]:
    """A choice's streamed delta messages for this output and its finish reason."""
    if parsers is None:
        return ([{"content": c.text}] if c.text else []), c.finish_reason
    parser = parsers[c.index]
    deltas = parser.feed(c.text) + (parser.finish() if c.finish_reason is not None else [])
    return deltas, _tool_finish_reason(c.finish_reason) if parser.calls else c.finish_reason


def _reject_abort(finish_reason: str | None) -> None:
    if finish_reason == "abort":
        raise ServingError(503, "the request was aborted by the engine (shutting down)", type="server_error",
                           code="aborted")


def _error_from_engine(exc: BaseException) -> ServingError:
    """Map an engine exception onto a client error (never a traceback)."""
    if isinstance(exc, ServingError):
        return exc
    if isinstance(exc, (EngineDrainingError, EngineDeadError)):
        return ServingError(503, str(exc), type="server_error", code="engine_unavailable")
    if isinstance(exc, ValueError):
        return ServingError(400, str(exc))
    logger.error("request failed in the engine", exc_info=exc)
    return ServingError(500, f"internal engine error ({type(exc).__name__})", type="server_error")


def _normalize_messages(messages: list[dict]) -> list[dict]:
    """Messages with string content (text parts joined by newlines), for templates.

    Raises:
        ServingError: a message is malformed or holds a non-text part.
    """
    if not messages:
        raise ServingError(400, "messages: must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        role = m.get("role")
        if not isinstance(role, str):
            raise ServingError(400, f"messages[{i}].role: must be a string", param="messages")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if isinstance(part, str):
                    parts.append(part)
                elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                    parts.append(part["text"])
                else:
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise ServingError(400, f"messages[{i}].content: part type {kind!r} is not supported "
                                            "(text only)", param="messages")
            content = "\n".join(parts)
        elif content is not None and not isinstance(content, str):
            raise ServingError(400, f"messages[{i}].content: must be a string or a list of parts",
                               param="messages")
        msg = dict(m)
        msg["role"] = "system" if role == "developer" else role
        msg["content"] = content if content is not None else ""
        out.append(msg)
    return out


def _cut_after_final_message(text: str, messages: list[dict]) -> str:
    """``continue_final_message``: end the prompt right after the last
    message's content, so that the model continues it (transformers' rule)."""
    final = messages[-1].get("content") or ""
    idx = text.rfind(final) if final else -1
    if idx < 0:
        raise ServingError(400, "continue_final_message: the final message was not found in the rendered prompt",
                           param="continue_final_message")
    return text[: idx + len(final)]


_END = object()


async def _merge(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
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
