"""The synchronous engine: the engine core plus tokenization and output
processing in one thread, for the offline ``LLM`` API and benchmarks.

    add_request ─► tokenize ─► EngineCore.step() ─► OutputProcessor ─► RequestOutputs (deltas by default)
                                      ▲                    │
                                      └── stop strings ────┘  (finish_sequences)

``AsyncEngine`` (``engine/async_engine.py``) drives the same two parts with
the core in its own process (or thread).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from engine.config import EngineArgs
from engine.core.core_loop import start_engine_core
from engine.core.core_messages import EngineStats  # noqa: F401 - re-exported: the engine's stats type
from engine.input_checks import check_input
from engine.llm_prompts import truncated_prompts
from engine.output_processor import OutputProcessor
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams


class LLMEngine:
    """Continuous-batching engine over a paged KV cache (one thread).

    Args:
        args: engine configuration (vLLM's names).

    Attributes:
        core: the ``EngineCore`` (scheduler, model runner, sampler).
        tokenizer, max_model_len, served_model_name, model_config, device,
        dtype, num_blocks, max_num_batched_tokens, scheduler, model_runner,
        sampler: the core's.

    Raises:
        FileNotFoundError, ValueError: the model cannot be loaded.
        MemoryError: the KV pool does not fit (the message says which setting to lower).
    """

    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        self.core = core = start_engine_core(args)   # torch: imported by whoever starts a core, not on import
        self.tokenizer = core.tokenizer
        self.output_processor = OutputProcessor(core.tokenizer)
        self.model_config, self.device, self.dtype = core.model_config, core.device, core.dtype
        self.served_model_name, self.max_model_len = core.served_model_name, core.max_model_len
        self.num_blocks, self.max_num_batched_tokens = core.num_blocks, core.max_num_batched_tokens
        self.scheduler, self.model_runner, self.sampler = core.scheduler, core.model_runner, core.sampler

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams, priority: int = 0,
                    arrival_time: float | None = None, resume: dict[int, list[int]] | None = None,
                    cache_salt: str | None = None) -> None:
        """Queue a request (``params.n`` sequences); ``resume``: continue it from the tokens each choice had
        generated; ``cache_salt``: share prefix-cache blocks only with requests of the same salt
        (``EngineCore.add_request``).

        A text prompt is tokenized with the tokenizer's special tokens (BOS
        where the model adds one); token ids are taken as they are; either is cut to its last
        ``params.truncate_prompt_tokens`` tokens when set (vLLM's).

        Raises:
            ValueError: duplicate id, empty prompt, token id out of the
                vocabulary, a prompt of ``max_model_len`` tokens or more (a completion stops at
                ``max_model_len``, finish_reason "length", as in vLLM); what the OpenAI server refuses of the
                engine's settings (``engine/input_checks.py``: ``max_logprobs``, a priority without
                ``scheduling_policy="priority"``, a token id of ``logit_bias``... past the vocabulary).
        """
        if request_id in self.output_processor:
            raise ValueError(f"request_id {request_id!r} is already in use")
        params = check_input(params, priority, vocab_size=self.tokenizer.vocab_size,
                             max_logprobs=self.args.max_logprobs, scheduling_policy=self.args.scheduling_policy)
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.tokenizer.encode(prompt, add_special_tokens=True) if text is not None else list(prompt)
        if params.truncate_prompt_tokens is not None:   # vLLM's: the prompt's last N tokens (-1: what fits)
            token_ids = truncated_prompts([token_ids], params.truncate_prompt_tokens, self.max_model_len)[0]
        self.core.add_request(request_id, token_ids, params, priority=priority, arrival_time=arrival_time,
                              resume=resume, cache_salt=cache_salt)
        self.output_processor.add_request(request_id, text, token_ids, params, resume)

    def abort_request(self, request_ids: Iterable[str]) -> None:
        """Abort client requests (all their sequences) and free their blocks now."""
        ids = list(request_ids)
        self.core.abort_requests(ids)
        for rid in ids:
            self.output_processor.forget(rid)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """Run one core step and return the output of every request with news, as its ``output_kind`` asks
        (deltas by default; a FINAL_ONLY request's only when it finished); choices a stop string ended are
        finished in the core before the next step."""
        core_outputs = self.core.step()
        if not core_outputs:
            return []
        processed = self.output_processor.process_outputs(core_outputs, time.monotonic())
        if processed.stops:
            self.core.finish_sequences(processed.stops)
        return self.output_processor.as_asked(processed.request_outputs)

    @property
    def structured_outputs(self):
        """The core's ``StructuredOutputManager``."""
        return self.core.structured_outputs

    def compile_grammar(self, params) -> None:
        """Compile (and cache) a grammar; safe from any thread.

        Raises:
            ValueError: the spec is invalid or unsupported (names the part).
        """
        self.core.compile_grammar(params)

    def get_stats(self) -> EngineStats:
        """Snapshot of the live signals (cheap)."""
        return self.core.get_stats()
