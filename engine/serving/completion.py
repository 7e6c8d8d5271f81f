"""``POST /v1/completions`` (legacy completions) over an ``AsyncEngine``
(vLLM's ``entrypoints/openai/serving_completion.py``): one or several
prompts (text or token ids), ``echo``, legacy ``logprobs``; the
``text_completion`` object or its typed stream chunks back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator

from msgspec import UNSET

from engine.outputs import CompletionOutput
from engine.protocol.errors import ServingError
from engine.protocol.param_ranges import echo_only
from engine.serving.answer_check import AnswerCheck, checked_finish
from engine.serving.chat_structured import ChatPlan, structured_spec
from engine.serving.chunks import Chunk, CompletionChoiceChunk, StreamError, StreamItem
from engine.serving.logprobs import TextCursor, empty_completion_logprobs
from engine.serving.protocol import CompletionRequest, RequestValidationError
from engine.serving.serving import (OpenAIServing, Prompt, RenderedPrompt, engine_id, error_from_engine,
                                    merge_streams, parse_body, reject_abort, truncate_prompt, usage, usage_options)


class OpenAIServingCompletion(OpenAIServing):
    """Legacy completions (constructor: ``OpenAIServing``'s)."""

    # ------------------------------------------------------------ completions
    async def prepare_completion(self, body: dict, rendered: RenderedPrompt | None = None
                                 ) -> tuple[RenderedPrompt, list[Prompt]]:
        """Every check ``POST /v1/completions`` makes before it queues a body (rendering, model, parameters,
        context length, the grammar's compile): its rendering and its prompts with their sampling parameters.
        The one validation the endpoint and ``POST /v1/ttft`` share.

        Raises:
            ServingError: as ``create_completion``.
        """
        r = self.truncated(rendered if rendered is not None else render_completion(self.engine.tokenizer, body))
        req = r.request
        self._check_common(req, body.get("model"))
        prompt_logprobs = req.prompt_logprobs
        if req.echo and req.logprobs is not None:
            prompt_logprobs = max(req.logprobs, prompt_logprobs or 0)
        try:
            spec, param = structured_spec(req)
            plan = ChatPlan(structured_outputs=spec, param=param)
        except RequestValidationError as exc:
            raise ServingError(400, str(exc), param=exc.param, code=exc.code) from None
        spec = await self._compile_grammar(plan)
        prompts = []
        # the prompt alone: the engine samples one token to end the request, which the answer leaves out
        max_tokens = 1 if echo_only(body) else req.max_tokens
        for text, ids in r.prompts:
            params = self._sampling_params(req, len(ids), max_tokens=max_tokens, logprobs=req.logprobs,
                                           prompt_logprobs=prompt_logprobs, prompt_field="prompt",
                                           structured_outputs=spec)
            prompts.append(Prompt(ids, text, params, req.cache_salt, self.token_ids_named(req)))
        return r, prompts

    async def create_completion(self, body: dict, request_id: str, priority: int = 0,
                                rendered: RenderedPrompt | None = None,
                                response_model: str | None = None) -> dict | AsyncIterator[list[StreamItem]]:
        """``POST /v1/completions`` (legacy completions).

        Args:
            body: the decoded JSON body.
            request_id: unique id; also the response's ``id``; with several
                prompts the engine ids are ``f"{request_id}-{i}"``.
            priority: scheduling priority when the body has none (lower = first).
            rendered: ``render_completion`` of this body, when the caller (the gateway) already rendered it;
                the body is then not parsed or tokenized again (the rendering's fields are used; only the
                body's ``model`` is checked).
            response_model: the ``model`` the answer reports (the gateway's public name); default the
                served name.

        Returns:
            The ``text_completion`` object, or when streaming an async iterator of its chunks
            (``engine/serving/chunks.py``, one list per engine output).

        Raises:
            ServingError: 400 bad input (names the parameter), 404 unknown
                model, 503 engine draining/dead.
        """
        r, prompts = await self.prepare_completion(body, rendered)
        req = r.request
        echo = bool(req.echo)
        prompt_only = echo_only(body)
        prio = req.priority if req.priority is not None else priority
        model = response_model or self.reported_model(body.get("model"))
        check = AnswerCheck.of(prompts[0].params.structured_outputs, None, False)
        if req.stream:
            include_usage, continuous = usage_options(req)
            return self._completion_stream(request_id, model, prompts, prio, req.logprobs, echo, include_usage,
                                           continuous, check, return_ids=req.return_token_ids,
                                           prompt_only=prompt_only)
        return await self._completion_full(request_id, model, prompts, prio, req.logprobs, echo, check,
                                           return_ids=req.return_token_ids, prompt_only=prompt_only)

    def _prompt_text(self, prompt: Prompt) -> str:
        if prompt.text is not None:
            return prompt.text
        return self.engine.tokenizer.decode(prompt.token_ids, skip_special_tokens=False)

    async def _completion_full(self, request_id: str, model: str, prompts: list[Prompt], priority: int,
                               logprobs: int | None, echo: bool, check: AnswerCheck | None = None,
                               return_ids: bool = False, prompt_only: bool = False) -> dict:
        """The ``text_completion`` object; ``return_ids``: vLLM's ``return_token_ids`` (each choice's
        ``prompt_token_ids`` and ``token_ids``); ``prompt_only``: ``echo_only``'s answer, each choice the
        prompt alone (no generated token counted or shown)."""
        choices, cached, prompt_lps = await self._collect(request_id, prompts, priority)
        if prompt_only:
            choices = [{i: prompt_alone(ch) for i, ch in by_index.items()} for by_index in choices]
        out_choices = []
        num_prompt = completion_tokens = 0
        for p_idx, prompt in enumerate(prompts):
            n = prompt.params.n
            num_prompt += len(prompt.token_ids)
            prefix = self._prompt_text(prompt) if echo else ""
            for index, ch in sorted(choices[p_idx].items()):
                reject_abort(ch.finish_reason)
                completion_tokens += ch.num_generated_tokens
                lps = None
                if logprobs is not None:
                    lps = empty_completion_logprobs()
                    cursor = TextCursor()
                    fmt = self.logprobs_of(prompt)
                    if echo:
                        cursor = fmt.append_prompt_logprobs(lps, prompt.token_ids, prompt_lps[p_idx], logprobs)
                    fmt.append_completion_logprobs(lps, ch.token_ids, ch.logprobs or [], logprobs, cursor)
                finish_reason, stop_reason = checked_finish(self.engine, check, ch.finish_reason, ch.stop_reason,
                                                            ch.text)
                choice = {"index": p_idx * n + index, "text": prefix + ch.text, "logprobs": lps,
                          "finish_reason": finish_reason, "stop_reason": stop_reason}
                if prompt.params.prompt_logprobs is not None and not echo:  # vLLM: per choice
                    choice["prompt_logprobs"] = self.logprobs.prompt_logprobs_vllm(prompt.token_ids, prompt_lps[p_idx])
                if return_ids:   # vLLM: per choice, a request may hold several prompts
                    choice["prompt_token_ids"], choice["token_ids"] = list(prompt.token_ids), list(ch.token_ids)
                out_choices.append(choice)
        return {
            "id": request_id, "object": "text_completion", "created": int(time.time()),
            "model": model, "choices": out_choices,
            "usage": usage(num_prompt, completion_tokens, sum(cached)),
            "system_fingerprint": self.engine.system_fingerprint or None,
        }

    async def _completion_stream(self, request_id: str, model: str, prompts: list[Prompt], priority: int,
                                 logprobs: int | None, echo: bool, include_usage: bool,
                                 continuous: bool, check: AnswerCheck | None = None, return_ids: bool = False,
                                 prompt_only: bool = False) -> AsyncIterator[list[StreamItem]]:
        """The chunks of a streamed answer (``text_completion`` ``chunks.Chunk``s), one list per engine output;
        a failure: ``chunks.StreamError``. ``return_ids``: each choice's first chunk carries its prompt's
        ``prompt_token_ids``, every chunk its new ``token_ids`` (vLLM's ``return_token_ids``); ``prompt_only``:
        ``echo_only``'s stream, the prompt and the end."""
        created = int(time.time())
        fingerprint = self.engine.system_fingerprint or None
        num_prompt = sum(len(p.token_ids) for p in prompts)
        generated: dict[tuple[int, int], int] = {}
        cached = [0] * len(prompts)
        offsets: dict[tuple[int, int], TextCursor] = {}   # each choice's text_offset cursor
        started: set[tuple[int, int]] = set()   # choices that sent their first chunk
        texts: dict[tuple[int, int], str] = {}   # each choice's generated text: the second line checks it

        def chunk(choices: list, final: bool = False) -> Chunk:
            return Chunk(request_id, "text_completion", created, model, fingerprint, choices,
                         usage(num_prompt, sum(generated.values()), sum(cached)) if continuous or final else UNSET)

        streams = [self.engine.generate(p.token_ids, p.params, engine_id(request_id, i, len(prompts)), priority,
                                        cache_salt=p.cache_salt) for i, p in enumerate(prompts)]
        try:
            async with contextlib.aclosing(merge_streams(streams)) as merged:
                async for p_idx, out in merged:
                    prompt = prompts[p_idx]
                    cached[p_idx] = out.num_cached_tokens
                    batch = []
                    for c in out.outputs:
                        reject_abort(c.finish_reason)
                        if prompt_only:
                            c = prompt_alone(c)
                        key = (p_idx, c.index)
                        generated[key] = c.num_generated_tokens
                        text = c.text
                        texts[key] = texts.get(key, "") + c.text
                        finish_reason, stop_reason = checked_finish(self.engine, check, c.finish_reason,
                                                                    c.stop_reason, texts[key])
                        lps = None
                        if logprobs is not None:
                            lps = empty_completion_logprobs()
                        first = key not in started
                        started.add(key)
                        if echo and first:
                            text = self._prompt_text(prompt) + text
                            if lps is not None:
                                offsets[key] = self.logprobs_of(prompt).append_prompt_logprobs(
                                    lps, prompt.token_ids, out.prompt_logprobs or [], logprobs)
                        if lps is not None:
                            offsets[key] = self.logprobs_of(prompt).append_completion_logprobs(
                                lps, c.token_ids, c.logprobs or [], logprobs, offsets.get(key) or TextCursor())
                            if not lps["tokens"]:
                                lps = None
                        ids = return_ids and (first or bool(c.token_ids))   # tokens whose text is held back, too
                        if not text and c.finish_reason is None and lps is None and not ids:
                            continue
                        choice = CompletionChoiceChunk(p_idx * prompt.params.n + c.index, text, lps, finish_reason)
                        if finish_reason is not None:
                            choice.stop_reason = stop_reason
                        if return_ids:
                            choice.token_ids = list(c.token_ids)
                            if first:
                                choice.prompt_token_ids = list(prompt.token_ids)
                        batch.append(chunk([choice]))
                    if batch:
                        yield batch
            if include_usage:
                yield [chunk([], final=True)]
        except Exception as exc:  # noqa: BLE001 - reported to the client, never a traceback
            yield [StreamError(error_from_engine(exc).to_dict()["error"])]


def prompt_alone(output: CompletionOutput) -> CompletionOutput:
    """``output`` without its generated token (``echo_only``: the engine samples one to end the request; the
    answer is the prompt alone): no text, token, logprob or count; once finished, "length" (``max_tokens`` 0
    ended it, whatever the hidden token was)."""
    finished = output.finish_reason is not None
    return dataclasses.replace(output, text="", token_ids=[], logprobs=None if output.logprobs is None else [],
                               num_generated_tokens=0, finish_reason="length" if finished else None,
                               stop_reason=None)


def render_completion(tokenizer, body: dict) -> RenderedPrompt:
    """``body`` parsed and checked, its prompt(s) (text, token ids, or lists of either) tokenized: the prompts
    the engine runs. The gateway counts ``prompt_tokens`` with it and hands it to ``create_completion``.

    Args:
        tokenizer: the engine's ``engine.tokenizer.Tokenizer``.
        body: the decoded JSON body.

    Raises:
        ServingError: 400 naming the parameter (bad field, empty prompt, token id outside the vocabulary,
            ``suffix``).
    """
    req = parse_body(body, CompletionRequest)
    if req.suffix:
        raise ServingError(400, "suffix: is not supported", param="suffix", code="unsupported_parameter")
    p = req.prompt
    vocab = tokenizer.vocab_size
    if isinstance(p, str):
        items: list = [p]
    elif p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        items = [p]
    else:
        items = list(p)
    if not items:
        raise ServingError(400, "prompt: must not be empty", param="prompt", code="invalid_value")
    if len({isinstance(item, str) for item in items}) > 1:   # OpenAI's and vLLM's schemas: one kind a list
        raise ServingError(400, "prompt: a list must hold only strings or only token-id lists, not both",
                           param="prompt", code="invalid_value")
    out = []
    keep = req.truncate_prompt_tokens
    for item in items:
        if isinstance(item, str):
            ids = tokenizer.encode(item, add_special_tokens=req.add_special_tokens)
            cut = truncate_prompt(ids, keep)
            out.append((item if len(cut) == len(ids) else None, cut))   # an echo shows the prompt as truncated
        elif isinstance(item, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in item):
            if any(t < 0 or t >= vocab for t in item):
                raise ServingError(400, f"prompt: token ids must be in [0, {vocab})", param="prompt",
                                   code="invalid_value")
            out.append((None, truncate_prompt(list(item), keep)))
        else:
            raise ServingError(400, "prompt: must be a string, a list of strings, a list of token ids "
                                    "or a list of token-id lists", param="prompt", code="invalid_type")
        if not out[-1][1]:
            raise ServingError(400, "prompt: must not be empty", param="prompt", code="invalid_value")
    return RenderedPrompt(req, tuple(out))
