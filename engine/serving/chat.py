"""``POST /v1/chat/completions`` over an ``AsyncEngine`` (vLLM's
``entrypoints/openai/serving_chat.py``): messages -> chat template -> token
ids -> engine; the ``chat.completion`` object or ``chat.completion.chunk``
SSE events back, with tool calls parsed (``engine/serving/chat_structured.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator

from msgspec import UNSET

from engine.outputs import CompletionOutput
from engine.protocol.chat_shapes import text_part_problem
from engine.protocol.errors import ServingError
from engine.sampling_params import SamplingParams
from engine.serving.answer_check import AnswerCheck, checked_finish
from engine.serving.chat_structured import plan_chat
from engine.serving.tool_call_parser import ToolCallFormat, ToolCallParser, parse_tool_calls
from engine.serving.chunks import ChatChoiceChunk, Chunk, Delta, StreamError, StreamItem
from engine.serving.protocol import ChatCompletionRequest, RequestValidationError
from engine.serving.serving import (OpenAIServing, Prompt, RenderedPrompt, error_from_engine, parse_body,
                                    reject_abort, truncate_prompt, usage, usage_options)


class OpenAIServingChat(OpenAIServing):
    """Chat completions (constructor: ``OpenAIServing``'s)."""

    async def prepare_chat(self, body: dict, rendered: RenderedPrompt | None = None
                           ) -> tuple[RenderedPrompt, SamplingParams]:
        """Every check ``POST /v1/chat/completions`` makes before it queues a body (rendering, model, parameters,
        context length, the grammar's compile): its rendering and sampling parameters. The one validation the
        endpoint and ``POST /v1/ttft`` share, so a prediction is answered only for a body the endpoint takes.

        Raises:
            ServingError: as ``create_chat_completion``.
        """
        r = self.truncated(rendered if rendered is not None else render_chat(self.engine.tokenizer, body))
        req, plan = r.request, r.plan
        self._check_common(req, body.get("model"))
        length_field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = self._sampling_params(req, len(r.prompts[0][1]), max_tokens=getattr(req, length_field),
                                       logprobs=logprobs, prompt_logprobs=req.prompt_logprobs, prompt_field="messages",
                                       structured_outputs=plan.structured_outputs, max_tokens_field=length_field)
        _resume(req, plan, self.engine.tokenizer.vocab_size)   # refused here, so /v1/ttft refuses it too
        spec = await self._compile_grammar(plan)
        if spec is not None:
            params = dataclasses.replace(params, structured_outputs=spec)
        return r, params

    async def create_chat_completion(self, body: dict, request_id: str, priority: int = 0,
                                     rendered: RenderedPrompt | None = None,
                                     response_model: str | None = None) -> dict | AsyncIterator[list[StreamItem]]:
        """``POST /v1/chat/completions``.

        Args:
            body: the decoded JSON body.
            request_id: unique id; also the response's ``id``.
            priority: scheduling priority when the body has none (lower = first).
            rendered: ``render_chat`` of this body, when the caller (the gateway) already rendered it; the
                body is then not parsed or tokenized again (the rendering's fields are used; only the body's
                ``model`` is checked).
            response_model: the ``model`` the answer reports (the gateway's public name); default the
                served name.

        Returns:
            The ``chat.completion`` object, or when streaming an async iterator of the answer's chunks
            (``engine/serving/chunks.py``: one list per engine output; ``chunks.sse_stream`` writes them as SSE).

        Raises:
            ServingError: 400 bad input (names the parameter; prompt over
                ``max_model_len``), 404 unknown model, 503 engine draining/dead.
        """
        r, params = await self.prepare_chat(body, rendered)
        req, plan, messages = r.request, r.plan, r.plan.messages
        token_ids = r.prompts[0][1]
        echo = ""
        if req.echo and messages and messages[-1].get("role") == "assistant":
            echo = messages[-1].get("content") or ""
        prompt = Prompt(token_ids, None, params, req.cache_salt, self.token_ids_named(req))
        prio = req.priority if req.priority is not None else priority
        top = req.top_logprobs or 0
        model = response_model or self.reported_model(body.get("model"))
        resume = _resume(req, plan, self.engine.tokenizer.vocab_size)
        check = AnswerCheck.of(params.structured_outputs, req.tools, plan.tool_calls is not None, plan.answer_format)
        if req.stream:
            include_usage, continuous = usage_options(req)
            return self._chat_stream(request_id, model, prompt, prio, bool(req.logprobs), top, echo,
                                     include_usage, continuous, plan.tool_calls,
                                     resume=resume, return_ids=req.return_token_ids, check=check)
        return await self._chat_full(request_id, model, prompt, prio, bool(req.logprobs), top, echo,
                                     plan.tool_calls, check=check,
                                     return_ids=req.return_token_ids)

    async def _chat_full(self, request_id: str, model: str, prompt: Prompt, priority: int, want_logprobs: bool,
                         top: int, echo: str, tool_calls: ToolCallFormat | None = None,
                         check: AnswerCheck | None = None, return_ids: bool = False) -> dict:
        """The ``chat.completion`` object; ``return_ids``: vLLM's ``return_token_ids`` (``prompt_token_ids``
        top level, each choice's ``token_ids``)."""
        choices, cached, prompt_lps = await self._collect(request_id, [prompt], priority)
        out_choices = []
        completion_tokens = 0
        for index, ch in sorted(choices[0].items()):
            reject_abort(ch.finish_reason)
            completion_tokens += ch.num_generated_tokens
            message = {"role": "assistant", "content": echo + ch.text, "refusal": None}
            finish_reason, calls = ch.finish_reason, []
            if tool_calls is not None:
                message["content"], calls = parse_tool_calls(ch.text, tool_calls, ch.finish_reason == "length")
                if calls:
                    message["tool_calls"] = calls
                    finish_reason = tool_finish_reason(finish_reason)
            finish_reason, stop_reason = checked_finish(self.engine, check, finish_reason, ch.stop_reason,
                                                        ch.text, calls)
            out_choices.append({
                "index": index,
                "message": message,
                "logprobs": {"content": self.logprobs_of(prompt).chat_logprobs(ch.token_ids, ch.logprobs or [], top),
                             "refusal": None} if want_logprobs else None,
                "finish_reason": finish_reason,
                "stop_reason": stop_reason,
            })
            if return_ids:
                out_choices[-1]["token_ids"] = list(ch.token_ids)
        response = {
            "id": request_id, "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": out_choices,
            "usage": usage(len(prompt.token_ids), completion_tokens, cached[0]),
            "system_fingerprint": self.engine.system_fingerprint or None,
        }
        if prompt.params.prompt_logprobs is not None:
            response["prompt_logprobs"] = self.logprobs.prompt_logprobs_vllm(prompt.token_ids, prompt_lps[0])
        if return_ids:
            response["prompt_token_ids"] = list(prompt.token_ids)
        return response

    async def _chat_stream(self, request_id: str, model: str, prompt: Prompt, priority: int, want_logprobs: bool,
                           top: int, echo: str, include_usage: bool, continuous: bool,
                           tool_calls: ToolCallFormat | None = None, resume: dict | None = None,
                           return_ids: bool = False, check: AnswerCheck | None = None
                           ) -> AsyncIterator[list[StreamItem]]:
        """The chunks of a streamed answer, one list per engine output (``chunks.Chunk``s of
        ``chat.completion.chunk``; a failure: ``chunks.StreamError``); ``resume``: a continuation (no role
        chunks: the client has them; counts from the tokens already generated); ``return_ids``: each choice's new
        ``token_ids``, and the prompt's ``prompt_token_ids`` on the first chunk (vLLM's)."""
        created = int(time.time())
        fingerprint = self.engine.system_fingerprint or None
        n = prompt.params.n
        parsers = [ToolCallParser(tool_calls) for _ in range(n)] if tool_calls is not None else None
        num_prompt = len(prompt.token_ids)
        generated = [len((resume or {}).get(i, ())) for i in range(n)]
        cached = 0
        texts = [""] * n   # each choice's text so far: the second line checks the finished answer

        def chunk(choice: ChatChoiceChunk) -> Chunk:
            return Chunk(request_id, "chat.completion.chunk", created, model, fingerprint, [choice],
                         usage(num_prompt, sum(generated), cached) if continuous else UNSET)

        try:
            def role_chunks() -> list[Chunk]:
                content = None if tool_calls and tool_calls.calls_only and not echo else echo   # OpenAI's null
                first = [chunk(ChatChoiceChunk(i, Delta(role="assistant", content=content))) for i in range(n)]
                for c in first if return_ids else ():   # vLLM: on each choice's role chunk
                    c.prompt_token_ids = list(prompt.token_ids)
                return first

            # the role chunks at once; with continuous usage after the first output, as vLLM's, so that their
            # usage says the cached prompt tokens as every later chunk does (an API trial's went 0, then 16)
            roles_due = resume is None
            if roles_due and not continuous:
                roles_due = False
                yield role_chunks()
            async with contextlib.aclosing(self.engine.generate(
                    prompt.token_ids, prompt.params, request_id, priority, resume=resume,
                    cache_salt=prompt.cache_salt)) as stream:
                async for out in stream:
                    cached = out.num_cached_tokens
                    if roles_due:
                        roles_due = False
                        yield role_chunks()
                    batch = []
                    for c in out.outputs:
                        reject_abort(c.finish_reason)
                        generated[c.index] = c.num_generated_tokens
                        lps = None
                        if want_logprobs and c.token_ids:
                            lps = {"content": self.logprobs_of(prompt).chat_logprobs(c.token_ids, c.logprobs or [],
                                                                                     top),
                                   "refusal": None}
                        deltas, finish_reason = stream_deltas(parsers, c)
                        stop_reason = c.stop_reason
                        if check is not None:
                            texts[c.index] += c.text
                            finish_reason, stop_reason = checked_finish(
                                self.engine, check, finish_reason, stop_reason, texts[c.index],
                                parsers[c.index].calls if parsers else None)
                        ids = return_ids and bool(c.token_ids)    # tokens whose text is held back, too
                        if not deltas and finish_reason is None and lps is None and not ids:
                            continue
                        deltas = deltas or [Delta()]
                        for k, delta in enumerate(deltas):
                            last = k == len(deltas) - 1
                            choice = ChatChoiceChunk(c.index, delta, lps if k == 0 else None,
                                                     finish_reason if last else None)
                            if ids:
                                choice.token_ids = list(c.token_ids) if k == 0 else []
                            if last and finish_reason is not None:
                                choice.stop_reason = stop_reason
                            batch.append(chunk(choice))
                    if batch:
                        yield batch
            if include_usage:
                yield [Chunk(request_id, "chat.completion.chunk", created, model, fingerprint, [],
                             usage(num_prompt, sum(generated), cached))]
        except Exception as exc:  # noqa: BLE001 - reported to the client, never a traceback
            yield [StreamError(error_from_engine(exc).to_dict()["error"])]


def render_chat(tokenizer, body: dict) -> RenderedPrompt:
    """``body`` parsed and checked, its messages (with tools and response_format, ``plan_chat``) through the
    model's chat template and tokenized: the prompt the engine runs. The gateway counts ``prompt_tokens`` with
    it and hands it to ``create_chat_completion``; ``tandem route explain`` counts with it.

    Args:
        tokenizer: the engine's ``engine.tokenizer.Tokenizer`` (its chat template).
        body: the decoded JSON body.

    Raises:
        ServingError: 400 naming the parameter (bad field, malformed message, the template failed).
    """
    req = parse_body(body, ChatCompletionRequest)
    if req.continue_final_message and req.add_generation_prompt:
        raise ServingError(400, "continue_final_message: cannot be used with add_generation_prompt=true",
                           param="continue_final_message", code="invalid_value")
    if req.top_logprobs is not None and not req.logprobs:
        raise ServingError(400, "top_logprobs: requires logprobs to be true", param="top_logprobs",
                           code="invalid_value")
    if req.top_logprobs is not None and not (0 <= req.top_logprobs <= 20):
        raise ServingError(400, f"top_logprobs: must be in [0, 20], got {req.top_logprobs}", param="top_logprobs",
                           code="invalid_value")
    if req.max_completion_tokens is not None and req.max_completion_tokens < 1:
        raise ServingError(400, f"max_completion_tokens: must be at least 1, got {req.max_completion_tokens}",
                           param="max_completion_tokens", code="integer_below_min_value")
    messages = normalize_messages(req.messages)
    try:
        plan = plan_chat(req, messages, tokenizer.chat_template)
    except RequestValidationError as exc:
        raise ServingError(400, str(exc), param=exc.param, code=exc.code) from None
    messages = plan.messages
    for key in req.chat_template_kwargs or ():
        if key in ("messages", "add_generation_prompt", "tokenize", *plan.template_kwargs):
            raise ServingError(400, f"chat_template_kwargs.{key}: set by the server from the request (send it as "
                                    "the request's own field, where it has one)",
                               param=f"chat_template_kwargs.{key}", code="invalid_value")
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt,
                                             tokenize=False, **plan.template_kwargs,
                                             **(req.chat_template_kwargs or {}))
    except Exception as exc:  # jinja2.TemplateError, ValueError (no template)
        raise ServingError(400, f"messages: the chat template failed: {exc}", param="messages",
                           code="invalid_value") from None
    if req.continue_final_message:
        text = cut_after_final_message(text, messages)
    token_ids = truncate_prompt(tokenizer.encode(text, add_special_tokens=req.add_special_tokens),
                                req.truncate_prompt_tokens)
    return RenderedPrompt(req, ((None, token_ids),), plan=plan)


def _resume(req, plan, vocab: int) -> dict[int, list[int]] | None:
    """The continuation a chat body asks for (``resume_token_ids``), as ``{choice: tokens}``.

    Raises:
        ServingError: 400 when it cannot be one (not streamed, one list per choice missing, tools or a grammar,
            a token id outside ``[0, vocab)``: checked here, before the 200, not by the engine inside a stream).
    """
    if req.resume_token_ids is None:
        return None
    if not req.stream or len(req.resume_token_ids) != (req.n or 1) or plan.tool_calls is not None \
            or plan.structured_outputs is not None or req.echo:
        raise ServingError(400, "resume_token_ids: only a streamed request without tools, a response format or "
                                "echo can be resumed, with one list of token ids per choice",
                           param="resume_token_ids", code="invalid_value")
    for i, ids in enumerate(req.resume_token_ids):
        for j, t in enumerate(ids):
            if not 0 <= t < vocab:
                raise ServingError(400, f"resume_token_ids[{i}][{j}]: {t} is not a token id of this model (ids "
                                        f"are in [0, {vocab}))", param="resume_token_ids", code="invalid_value")
    return dict(enumerate(req.resume_token_ids))


def tool_finish_reason(finish_reason: str | None) -> str | None:
    """OpenAI's "tool_calls" for an output that ended with tool calls."""
    return "tool_calls" if finish_reason == "stop" else finish_reason


def stream_deltas(parsers: list[ToolCallParser] | None, c: CompletionOutput) -> tuple[list[Delta], str | None]:
    """A choice's streamed deltas for this output and its finish reason."""
    if parsers is None:
        return ([Delta(content=c.text)] if c.text else []), c.finish_reason
    parser = parsers[c.index]
    deltas = parser.feed(c.text) + (parser.finish(c.finish_reason == "length") if c.finish_reason is not None
                                     else [])
    return deltas, tool_finish_reason(c.finish_reason) if parser.calls else c.finish_reason



def normalize_messages(messages: list[dict]) -> list[dict]:
    """Messages with string content (text parts joined by newlines; an assistant's ``refusal`` part is its text,
    as vLLM reads it), for templates.

    Raises:
        ServingError: a message is malformed or holds a non-text part.
    """
    if not messages:
        raise ServingError(400, "messages: must be a non-empty list", param="messages", code="empty_array")
    out = []
    for i, m in enumerate(messages):
        role = m.get("role")
        if not isinstance(role, str):
            raise ServingError(400, f"messages[{i}].role: must be a string", param=f"messages[{i}].role",
                               code="invalid_type")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if isinstance(part, str):
                    parts.append(part)
                elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                    parts.append(part["text"])
                elif (role == "assistant" and isinstance(part, dict) and part.get("type") == "refusal"
                      and isinstance(part.get("refusal"), str)):
                    parts.append(part["refusal"])
                elif (problem := text_part_problem(part, f"messages[{i}].content[{j}]")) is not None:
                    path, message, code = problem            # its string missing: in the gateway's words
                    raise ServingError(400, message, param=path, code=code)
                else:
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise ServingError(400, f"messages[{i}].content[{j}]: part type {kind!r} is not supported "
                                            "(text only)", param=f"messages[{i}].content[{j}].type",
                                       code="invalid_value")
            content = "\n".join(parts)
        elif content is None and not (role == "assistant" and (m.get("tool_calls") or m.get("function_call"))):
            # OpenAI: only an assistant message that calls tools may omit its content
            raise ServingError(400, f"messages[{i}].content: is required (null only on an assistant message "
                                    "with tool_calls)", param=f"messages[{i}].content", code="invalid_value")
        elif content is not None and not isinstance(content, str):
            raise ServingError(400, f"messages[{i}].content: must be a string or a list of parts",
                               param=f"messages[{i}].content", code="invalid_type")
        if m.get("name") is not None and not isinstance(m["name"], str):
            raise ServingError(400, f"messages[{i}].name: must be a string", param=f"messages[{i}].name",
                               code="invalid_type")
        if role == "assistant" and m.get("tool_calls") is not None:
            check_assistant_tool_calls(i, m["tool_calls"])
        msg = dict(m)
        msg["role"] = "system" if role == "developer" else role
        msg["content"] = content if content is not None else ""
        out.append(msg)
    return out


def check_assistant_tool_calls(i: int, calls: object) -> None:
    """An assistant message's ``tool_calls`` as OpenAI (and vLLM) take them: a list of ``{"id": str, "type":
    "function", "function": {"name": str, "arguments": str}}``.

    Raises:
        ServingError: 400 naming the first missing or malformed part (``messages[1].tool_calls[0].function``).
    """
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise ServingError(400, f"{where}: must be an array of tool calls", param=where, code="invalid_type")
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        if not isinstance(call, dict):
            raise ServingError(400, f"{at}: must be an object", param=at, code="invalid_type")
        fn = call.get("function")
        for part, value, ok in (("id", call.get("id"), isinstance(call.get("id"), str)),
                                ("type", call.get("type"), call.get("type") == "function"),
                                ("function", fn, isinstance(fn, dict)),
                                ("function.name", (fn or {}).get("name") if isinstance(fn, dict) else None,
                                 isinstance(fn, dict) and isinstance(fn.get("name"), str)),
                                ("function.arguments", (fn or {}).get("arguments") if isinstance(fn, dict) else None,
                                 isinstance(fn, dict) and isinstance(fn.get("arguments"), str))):
            if ok:
                continue
            if value is None:
                raise ServingError(400, f"Missing required parameter: '{at}.{part}'.", param=f"{at}.{part}",
                                   code="missing_required_parameter")
            wanted = "'function'" if part == "type" else ("an object" if part == "function" else "a string")
            raise ServingError(400, f"{at}.{part}: must be {wanted}, got {value!r}", param=f"{at}.{part}",
                               code="invalid_type")


def cut_after_final_message(text: str, messages: list[dict]) -> str:
    """``continue_final_message``: end the prompt right after the last
    message's content, so that the model continues it (transformers' rule)."""
    final = messages[-1].get("content") or ""
    idx = text.rfind(final) if final else -1
    if idx < 0:
        raise ServingError(400, "continue_final_message: the final message was not found in the rendered prompt",
                           param="continue_final_message", code="invalid_value")
    return text[: idx + len(final)]

