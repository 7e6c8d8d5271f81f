"""Offline API, as in vLLM: ``LLM(model=...).generate(prompts, SamplingParams)``, ``chat``, ``embed`` and
``encode``."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from engine.config import EngineArgs
from engine.entrypoints.vllm_flags import split_vllm_kwargs
from engine.input_checks import dimensions_problem
from engine.llm_engine import LLMEngine
from engine.llm_prompts import Prompt, parse_prompt, prompt_list, truncated_prompts
from engine.outputs import EmbeddingOutput, EmbeddingRequestOutput, PoolingOutput, PoolingRequestOutput, RequestOutput
from engine.protocol.errors import ServingError
from engine.sampling_params import RequestOutputKind, SamplingParams
from engine.serving.chat import render_chat

if TYPE_CHECKING:
    from engine.pooling import PoolingParams   # imports torch: only for the annotation


logger = logging.getLogger("tandem.llm")


class LLM:
    """Batch inference over the continuous-batching engine.

    Args:
        model: a ``.gguf`` file or HF directory (None: embedded SmolLM2).
        **engine_args: any ``EngineArgs`` field (``dtype``, ``block_size``,
            ``kv_cache_memory``, ``enable_prefix_caching``, ...), or one of vLLM's arguments without a setting
            here (``trust_remote_code``, ``enforce_eager``, ...: ``engine/entrypoints/vllm_flags.py``), logged
            as a warning that it changes nothing (on stderr even where the script configured no logging), or
            refused with a ValueError saying why.

    Example:
        >>> llm = LLM(dtype="float32")
        >>> llm.chat([{"role": "user", "content": "What is the capital of France?"}],
        ...          SamplingParams(temperature=0, max_tokens=16))[0].outputs[0].text
    """

    def __init__(self, model: str | None = None, **engine_args) -> None:
        engine_args, notes = split_vllm_kwargs(engine_args, model)   # vLLM's that change nothing here
        for note in notes:   # a warning: seen on stderr though the script configured no logging, as "max_model_len
            logger.warning("%s", note)   # capped" is (logging's last-resort handler); never configured on import
        self.engine = LLMEngine(EngineArgs(model=model, **engine_args))
        self._ids = itertools.count()
        if self.engine.core.executor is not None:   # other ranks: stopped when this LLM is dropped or at exit,
            # if the script did not (their collective would fail as the process ends, logged; a second
            # tensor-parallel LLM in a notebook after `del llm` found the first one's group, vLLM's frees it)
            weakref.finalize(self, self.engine.core.close)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def llm_engine(self) -> LLMEngine:
        """vLLM's name of the engine under this ``LLM``: ``engine``."""
        return self.engine

    def get_tokenizer(self):
        """The engine's tokenizer (vLLM's ``LLM.get_tokenizer``)."""
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: ``SamplingParams`` of the model's generation-config defaults (``EngineArgs.generation_config``;
        ``engine/generation_config.py``), the plain defaults when it has none; what ``generate`` and ``chat`` use
        when given no ``sampling_params``."""
        return SamplingParams(**self.engine.args.sampling_defaults)

    def shutdown(self) -> None:
        """Stop the engine's other tensor-parallel ranks (done at exit too, when a script did not) and what else
        outlives a step (``EngineCore.close``)."""
        self.engine.core.close()

    def embed(self, prompts: Prompt | Sequence[Prompt],
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None, *,
              truncate_prompt_tokens: int | None = None, use_tqdm: bool = True, lora_request: object | None = None,
              pooling_type: str | None = None, normalize: bool | None = None) -> list[EmbeddingRequestOutput]:
        """Embeddings of ``prompts`` (vLLM's ``LLM.embed``, its signature): each prompt's final hidden states pooled
        (``engine/pooling.py``: LAST or MEAN or CLS, L2-normalized; None: the model's own pooling config).

        Args:
            prompts: as ``generate`` takes them (texts, token-id lists, prompt dicts); text is tokenized as
                ``generate`` tokenizes it.
            pooling_params: one ``engine.pooling.PoolingParams`` for every prompt or one per prompt (its
                ``pooling_type`` and ``normalize``, None: the model's own; ``dimensions`` is refused: no model
                here is matryoshka); None: the model's own pooling config.
            truncate_prompt_tokens: vLLM's: keep each prompt's last N tokens (-1: what fits ``max_model_len``),
                the embeddings endpoint's rule.
            use_tqdm: vLLM's progress-bar switch, taken for its callers: this engine draws no progress bar.
            lora_request: vLLM's; only None (this engine has no LoRA).
            pooling_type, normalize: this engine's shorthand for ``PoolingParams(pooling_type, normalize)`` (not
                with ``pooling_params``).

        Returns:
            One ``EmbeddingRequestOutput`` per prompt, in input order: ``outputs.embedding`` is one float32
            vector of ``hidden_size`` values (Python floats), ``prompt_token_ids`` the tokens pooled.

        Raises:
            ValueError: an empty prompt, one over ``max_model_len``, a bad token id, pooling type,
                ``dimensions`` or truncation, pooling params not one per prompt, a LoRA request.
        """
        _refuse_lora(lora_request)
        if pooling_type is not None or normalize is not None:
            if pooling_params is not None:
                raise ValueError("pooling_type, normalize: give them in pooling_params, not beside it")
            from engine.pooling import PoolingParams   # imports torch: loaded with the engine's core already

            pooling_params = PoolingParams(pooling_type, normalize)
        return [EmbeddingRequestOutput(request_id=rid, outputs=EmbeddingOutput(vector), prompt_token_ids=ids)
                for rid, ids, vector in self._pool(prompts, pooling_params, truncate_prompt_tokens)]

    def encode(self, prompts: Prompt | Sequence[Prompt],
               pooling_params: PoolingParams | Sequence[PoolingParams] | None = None, *,
               truncate_prompt_tokens: int | None = None, use_tqdm: bool = True, lora_request: object | None = None,
               pooling_task: str | None = None) -> list[PoolingRequestOutput]:
        """vLLM's pooling entry point: ``pooling_task="embed"`` (the one task this engine pools) gives the
        vectors ``embed`` gives, as ``PoolingRequestOutput``s whose ``outputs.data`` is a tensor.

        Args:
            prompts, pooling_params, truncate_prompt_tokens: as ``embed``.
            use_tqdm: vLLM's progress-bar switch: no progress bar is drawn.
            lora_request: vLLM's; only None.
            pooling_task: "embed"; required, as vLLM requires it.

        Returns:
            One ``PoolingRequestOutput`` per prompt, in input order: ``outputs.data`` a float32 tensor
            ``[hidden_size]``, the ``embed`` vector's values bit for bit.

        Raises:
            ValueError: ``pooling_task`` missing or other than "embed", a LoRA request, or what ``embed``
                refuses.
        """
        _refuse_lora(lora_request)
        if pooling_task is None:
            raise ValueError('pooling_task: required, as in vLLM ("embed": the one task this engine pools)')
        if pooling_task != "embed":
            raise ValueError(f"pooling_task: {pooling_task!r} is not supported: this engine pools the \"embed\" "
                             "task only (classify, score, token_embed and token_classify need heads it lacks)")
        import torch   # loaded with the engine's core; not on this module's import

        return [PoolingRequestOutput(request_id=rid, outputs=PoolingOutput(torch.tensor(vector, dtype=torch.float32)),
                                     prompt_token_ids=ids)
                for rid, ids, vector in self._pool(prompts, pooling_params, truncate_prompt_tokens)]

    def _pool(self, prompts: Prompt | Sequence[Prompt], pooling_params, truncate_prompt_tokens: int | None,
              ) -> list[tuple[str, list[int], list[float]]]:
        """(request id, token ids, vector) per prompt, in input order: one core pooling call per distinct
        (pooling type, normalize) of ``pooling_params`` (one, one per prompt, or None)."""
        given = [parse_prompt(p, None)[0] for p in prompt_list(prompts)]
        ids = [self.tokenizer.encode(p, add_special_tokens=True) if isinstance(p, str) else p for p in given]
        ids = truncated_prompts(ids, truncate_prompt_tokens, self.engine.max_model_len)
        params = list(pooling_params) if isinstance(pooling_params, (list, tuple)) else [pooling_params] * len(ids)
        if len(params) != len(ids):
            raise ValueError(f"pooling_params: give one for all prompts or one per prompt ({len(ids)}), got "
                             f"{len(params)}")
        keys = []
        for p in params:
            if p is not None and not hasattr(p, "pooling_type"):
                raise ValueError(f"pooling_params: must be engine.pooling.PoolingParams, got {type(p).__name__}")
            if (problem := dimensions_problem(getattr(p, "dimensions", None), self.engine.served_model_name)):
                raise ValueError(problem)
            keys.append((None, None) if p is None else (p.pooling_type, p.normalize))
        vectors: list = [None] * len(ids)
        for key in dict.fromkeys(keys):
            rows = [i for i, k in enumerate(keys) if k == key]
            for i, v in zip(rows, self.engine.core.embed([ids[i] for i in rows], *key)):
                vectors[i] = v
        return [(f"offline-{next(self._ids)}", i, v) for i, v in zip(ids, vectors)]

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Sequence[int] | None = None,
        cache_salt: str | None = None,
        use_tqdm: bool = True,
        lora_request: object | None = None,
    ) -> list[RequestOutput]:
        """Generate completions for all prompts, submitted at once.

        Args:
            prompts: a text, a list of texts, one token-id list, or a list of them; or vLLM's prompt dicts,
                ``{"prompt": text}`` / ``{"prompt_token_ids": [ids]}`` (with an optional ``cache_salt``).
            sampling_params: one for all prompts or one per prompt (default:
                ``SamplingParams()``).
            priority: one priority per prompt (lower first; a non-zero one needs ``scheduling_policy="priority"``,
                as in vLLM).
            cache_salt: vLLM's; these prompts share prefix-cache blocks only with requests of the same salt.
            use_tqdm: vLLM's progress-bar switch, taken for its callers: this engine draws no progress bar.
            lora_request: vLLM's; only None (this engine has no LoRA).

        Returns:
            One final ``RequestOutput`` per prompt, in input order, with
            cumulative text and token ids per choice, whatever the params' ``output_kind`` (vLLM's: run as
            FINAL_ONLY).

        Raises:
            ValueError: a prompt is invalid (nothing is left queued), a LoRA request, ``priority`` not one per
                prompt or non-zero under ``scheduling_policy="fcfs"``, what ``engine/input_checks.py`` refuses
                (``logprobs`` above ``max_logprobs``, a ``logit_bias`` id past the vocabulary).
        """
        _refuse_lora(lora_request)
        prompts = prompt_list(prompts)
        prompts, salts = zip(*(parse_prompt(p, cache_salt) for p in prompts)) if prompts else ((), ())
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError("sampling_params must be one SamplingParams or one per prompt")
        params = _final_only(params)
        if priority is not None and len(priority) != len(prompts):   # vLLM's words
            raise ValueError(f"priority: The lengths of prompts ({len(prompts)}) and priority ({len(priority)}) "
                             "must be the same.")
        ids = [f"offline-{next(self._ids)}" for _ in prompts]
        try:
            for i, (rid, prompt, p, salt) in enumerate(zip(ids, prompts, params, salts)):
                self.engine.add_request(rid, prompt, p, priority=priority[i] if priority else 0, cache_salt=salt)
        except ValueError:
            self.engine.abort_request(ids)
            raise
        finals: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for final in self.engine.step():
                finals[final.request_id] = final
        return [finals[rid] for rid in ids]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: object | None = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """vLLM's ``LLM.chat``: render one conversation or a list of them as ``POST /v1/chat/completions``
        renders a body (``engine/serving/chat.py`` ``render_chat``: the same token ids), then ``generate``.

        Args:
            messages: one conversation (a list of ``{"role", "content"}`` dicts; content a string or text
                parts) or a list of them.
            sampling_params: one for all conversations or one per conversation (default
                ``get_default_sampling_params()``).
            use_tqdm: vLLM's progress-bar switch: no progress bar is drawn.
            lora_request: vLLM's; only None (this engine has no LoRA).
            chat_template: jinja2 source rendered instead of the model's template (compiled as the model's is).
            chat_template_content_format: "auto" or "string": content is rendered as a string (text parts
                joined by newlines), as the chat endpoint renders it; "openai" (content as a list of parts) is
                refused.
            add_generation_prompt: end the prompt with the assistant turn's opening.
            continue_final_message: end the prompt right after the last message, which the model continues
                (needs ``add_generation_prompt=False``).
            tools: OpenAI function tools, rendered into the prompt as the chat endpoint renders them (the
                template's ``tools``, or the generic tool prompt for a template that knows none); as in vLLM's
                ``LLM.chat``, the output is neither constrained nor parsed into tool calls.
            chat_template_kwargs: extra template variables.
            mm_processor_kwargs: vLLM's multimodal processor options; only None (no multimodal model here).

        Returns:
            One final ``RequestOutput`` per conversation, in input order; its ``prompt`` is the rendered
            conversation (vLLM's).

        Raises:
            ValueError: a malformed message or tool, a template that fails, an argument this engine cannot
                honour (named), or what ``generate`` refuses.
        """
        _refuse_lora(lora_request)
        if mm_processor_kwargs:
            raise ValueError("mm_processor_kwargs: not supported (this engine serves text-only models)")
        if chat_template_content_format not in ("auto", "string"):
            raise ValueError(f"chat_template_content_format: {chat_template_content_format!r} is not supported: "
                             "content is rendered as a string (\"auto\" or \"string\")")
        tokenizer = self.tokenizer if chat_template is None else self.tokenizer.with_chat_template(chat_template)
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        options = {"add_generation_prompt": add_generation_prompt, "continue_final_message": continue_final_message,
                   "tools": tools, "chat_template_kwargs": chat_template_kwargs}
        prompts = [_render(tokenizer, c, options) for c in conversations]
        outputs = self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
        for out in outputs:   # vLLM's: the conversation as the template rendered it (the ids round-trip to it)
            out.prompt = self.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False)
        return outputs


def _refuse_lora(lora_request) -> None:
    """Raises ValueError for a LoRA request: this engine serves base weights only."""
    if lora_request is not None:
        raise ValueError("lora_request: LoRA adapters are not supported by this engine (give None)")


def _final_only(params: list[SamplingParams]) -> list[SamplingParams]:
    """``params`` asking for FINAL_ONLY outputs: a copy of each distinct one that asks otherwise (vLLM's ``LLM``
    sets it on the caller's own)."""
    copies: dict[int, SamplingParams] = {}
    for p in params:
        if id(p) not in copies:
            asks_other = isinstance(p, SamplingParams) and p.output_kind != RequestOutputKind.FINAL_ONLY
            copies[id(p)] = dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY) if asks_other else p
    return [copies[id(p)] for p in params]


def _render(tokenizer, conversation: list[dict], options: dict[str, Any]) -> list[int]:
    """The token ids the chat endpoint renders for ``conversation`` with ``options`` (its body's fields).

    Raises:
        ValueError: the endpoint's 400 (a malformed message or tool, the template failed...), its message."""
    body = {"messages": conversation, **{k: v for k, v in options.items() if v is not None}}
    try:
        return list(render_chat(tokenizer, body).prompts[0][1])
    except ServingError as exc:
        raise ValueError(exc.message) from None

