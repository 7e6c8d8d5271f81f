"""The synchronous engine: one ``step()`` = schedule, run the model, sample,
detokenize, and report what is new.

    add_request ─► Scheduler ─► ModelRunner ─► Sampler ─► Scheduler.update_from_output
                                                              │
                                 RequestOutput deltas ◄─ IncrementalDetokenizer

The async engine (``engine/async_engine.py``) drives ``step()`` in a
background thread; the offline ``LLM`` API drives it in a loop.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from engine.config import DEFAULT_MODEL, EngineArgs, default_model_path
from engine.detokenizer import IncrementalDetokenizer, fill_decoded_tokens
from engine.model_loader import load_model
from engine.model_runner import ModelRunner
from engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from engine.request import ForkGroup, Request, RequestStatus
from engine.sampler import Sampler, prompt_logprobs
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.structured_outputs import StructuredOutputManager

logger = logging.getLogger("tandem.engine")

_DEFAULT_CHUNKED_BUDGET = 2048  # tokens per step with chunked prefill (vLLM's online default)


@dataclass
class EngineStats:
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

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Hits / queries over the engine's life (0 when nothing was queried)."""
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


@dataclass
class _Tracked:
    """Per-sequence bookkeeping the scheduler does not need."""

    request: Request
    detokenizer: IncrementalDetokenizer
    prompt: str | None


def resolve_device(name: str) -> torch.device:
    """``auto`` -> CUDA when available, else CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str) -> torch.dtype:
    """``auto`` -> bfloat16 (2-3x faster than float32 on this CPU, native on GPUs)."""
    return {"auto": torch.bfloat16, "float32": torch.float32, "bfloat16": torch.bfloat16,
            "float16": torch.float16}[name]


def _is_default_model(path: str) -> bool:
    try:
        return path == default_model_path()
    except FileNotFoundError:
        return False


def _resolve_max_model_len(requested: int | None, model_max: int, kv_capacity: int) -> int:
    """The context limit, tokens: the model's, capped by what the KV pool holds.

    Raises:
        ValueError: an explicit ``max_model_len`` larger than the model's or
            than the KV pool (vLLM refuses to start in the same case).
    """
    if requested is None:
        if kv_capacity < model_max:
            logger.warning("max_model_len capped from %d to %d tokens: the KV pool holds no more "
                           "(raise kv_cache_memory / gpu_memory_utilization for longer contexts)",
                           model_max, kv_capacity)
        return min(model_max, kv_capacity)
    if requested > model_max:
        raise ValueError(f"max_model_len {requested} exceeds the model's context of {model_max} tokens")
    if requested > kv_capacity:
        raise ValueError(
            f"max_model_len {requested} needs more KV cache than the pool holds ({kv_capacity} tokens): "
            "raise kv_cache_memory (CPU) or gpu_memory_utilization (CUDA), or lower max_model_len")
    return requested


class LLMEngine:
    """Continuous-batching engine over a paged KV cache.

    Args:
        args: engine configuration (vLLM's names).

    Raises:
        FileNotFoundError, ValueError: the model cannot be loaded.
        MemoryError: the KV pool does not fit (the message says which setting to lower).
    """

    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        if args.num_threads and args.device != "cuda":
            torch.set_num_threads(args.num_threads)
        self.device = resolve_device(args.device)
        self.dtype = resolve_dtype(args.dtype)
        model, self.tokenizer, self.model_config = load_model(args)
        self.served_model_name = args.served_model_name or (
            DEFAULT_MODEL if _is_default_model(args.model) else self.model_config.name)
        num_blocks, num_cpu_blocks = ModelRunner.determine_num_blocks(
            args, self.model_config, self.device, self.dtype
        )
        self.max_model_len = _resolve_max_model_len(
            args.max_model_len, self.model_config.max_position_embeddings, (num_blocks - 1) * args.block_size
        )
        self.model_runner = ModelRunner(
            args, model, self.model_config, self.device, self.dtype, num_blocks, num_cpu_blocks
        )
        if args.max_num_batched_tokens is not None:
            budget = args.max_num_batched_tokens
        elif args.enable_chunked_prefill:
            budget = _DEFAULT_CHUNKED_BUDGET
        else:
            budget = max(self.max_model_len, _DEFAULT_CHUNKED_BUDGET)
        self.max_num_batched_tokens = budget
        self.scheduler = Scheduler(
            block_size=args.block_size,
            num_blocks=num_blocks,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=self.max_model_len,
            enable_prefix_caching=args.enable_prefix_caching,
            enable_chunked_prefill=args.enable_chunked_prefill,
            scheduling_policy=args.scheduling_policy,
            num_cpu_blocks=num_cpu_blocks,
        )
        self.sampler = Sampler(self.model_config.vocab_size, self.device, seed=args.seed)
        self._structured_outputs: StructuredOutputManager | None = None  # built on first use
        self._structured_outputs_lock = threading.Lock()
        self.num_blocks = num_blocks
        self._tracked: dict[str, _Tracked] = {}  # sequence id -> bookkeeping
        self._groups: dict[str, list[Request]] = {}  # client request id -> its sequences
        self._prompt_logprobs: dict[str, list] = {}  # client request id -> prompt logprobs so far
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0
        logger.info(
            "engine ready: model=%s device=%s dtype=%s blocks=%d block_size=%d max_model_len=%d "
            "max_num_batched_tokens=%d", self.served_model_name, self.device, self.dtype, num_blocks,
            args.block_size, self.max_model_len, budget,
        )

    # ------------------------------------------------------------------ input
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request (``params.n`` sequences).

        A text prompt is tokenized with the tokenizer's special tokens (BOS
        where the model adds one); token ids are taken as they are.

        Raises:
            ValueError: duplicate id, empty prompt, token id out of the
                vocabulary, prompt + ``max_tokens`` over ``max_model_len``.
        """
        if request_id in self._groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.tokenizer.encode(prompt, add_special_tokens=True) if text is not None else list(prompt)
        if not token_ids:
            raise ValueError("prompt must not be empty")
        vocab = self.model_config.vocab_size
        if any(not isinstance(t, int) or t < 0 or t >= vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        num_prompt = len(token_ids)
        if num_prompt >= self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens, "
                f"but the prompt has {num_prompt} tokens (max_model_len)"
            )
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - num_prompt
        if num_prompt + max_tokens > self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {num_prompt + max_tokens} tokens ({num_prompt} in the prompt, {max_tokens} "
                f"for the completion) (max_model_len)"
            )
        arrival = time.monotonic() if arrival_time is None else arrival_time
        n = params.n
        group = ForkGroup(parent_id=request_id) if n > 1 else None
        seqs = []
        for index in range(n):
            req = Request(
                request_id=f"{request_id}-{index}" if n > 1 else request_id,
                prompt_token_ids=token_ids,
                sampling_params=params,
                eos_token_id=self.tokenizer.eos_token_id,
                max_tokens=max_tokens,
                arrival_time=arrival,
                priority=priority,
                parent_id=request_id,
                index=index,
                group=group,
            )
            if group is not None:
                group.members.append(req)
            seqs.append(req)
        if params.structured_outputs is not None:
            for req in seqs:  # compiles (or finds in the cache) before anything is queued
                self.structured_outputs.add(req.request_id, params.structured_outputs)
        for req in seqs:
            self.scheduler.add_request(req)
            self._tracked[req.request_id] = _Tracked(
                req, IncrementalDetokenizer(self.tokenizer, token_ids, params), text
            )
        self._groups[request_id] = seqs
        if params.prompt_logprobs is not None:
            self._prompt_logprobs[request_id] = [None]

    def abort_request(self, request_ids: Iterable[str]) -> None:
        """Abort client requests (all their sequences) and free their blocks now."""
        for rid in list(request_ids):
            seqs = self._groups.pop(rid, None)
            if seqs is None:
                continue
            self.scheduler.finish_requests(
                [s.request_id for s in seqs if not s.is_finished], RequestStatus.FINISHED_ABORTED
            )
            for s in seqs:
                self._forget(s)
            self._prompt_logprobs.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Run one scheduling step and return the delta of every request with news:
        1. schedule, 2. run the model, 3. sample (grammar-constrained rows
        masked), 4. advance the scheduler, 5. detokenize each sampled token into
        a per-sequence delta, 6. group the deltas per client request."""
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        runner_out = self.model_runner.execute_model(sched)
        sampled, row_logprobs, grammar_done = self._sample(sched, runner_out)
        for entry in sched.scheduled:
            req = entry.request
            if entry.num_computed_tokens < req.num_prompt_tokens:
                self._prompt_tokens_total += min(
                    entry.num_new_tokens, req.num_prompt_tokens - entry.num_computed_tokens
                )
        self._collect_prompt_logprobs(sched, runner_out.prompt_logits)
        finished = self.scheduler.update_from_output(sched, sampled)
        self._stop_finished_grammars(grammar_done, finished)
        self._generation_tokens_total += len(sampled)
        return self._request_outputs(self._sequence_deltas(sampled, row_logprobs, finished), time.monotonic())

    def _sample(self, sched, runner_out) -> tuple[dict[str, int], dict[str, dict], list[str]]:
        """(sequence id -> sampled token, sequence id -> its decoded logprobs,
        sequences whose grammar just completed)."""
        rows = [sched.scheduled[i].request for i in runner_out.sample_indices]
        sampled: dict[str, int] = {}
        row_logprobs: dict[str, dict] = {}
        grammar_done: list[str] = []
        if not rows:
            return sampled, row_logprobs, grammar_done
        so = self._structured_outputs
        bitmask = so.grammar_bitmask([r.request_id for r in rows]) if so is not None else None
        sampler_out = self.sampler.sample(runner_out.logits, rows, grammar_bitmask=bitmask)
        for req, tok, lp in zip(rows, sampler_out.token_ids, sampler_out.logprobs):
            sampled[req.request_id] = tok
            if lp is not None:
                row_logprobs[req.request_id] = self._decode_logprobs(lp)
            if bitmask is not None and so.accept(req.request_id, tok):
                grammar_done.append(req.request_id)
        return sampled, row_logprobs, grammar_done

    def _sequence_deltas(self, sampled: dict[str, int], row_logprobs: dict[str, dict],
                         finished: list[Request]) -> dict[str, list[CompletionOutput]]:
        """Client request id -> this step's CompletionOutput of each of its
        sequences with news; stop strings end their sequence here."""
        deltas: dict[str, list[CompletionOutput]] = {}
        for req_id, tok in sampled.items():
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            req = tracked.request
            # A stop token id (or EOS) that ended the request stays out of the text.
            text, stop = tracked.detokenizer.update(
                [tok], stop_terminated=req.status == RequestStatus.FINISHED_STOPPED)
            if stop is not None:
                if req.is_finished:  # the same token also hit a length limit: the stop string wins
                    req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, stop
                else:
                    self.scheduler.finish_requests([req_id], RequestStatus.FINISHED_STOPPED, stop_reason=stop)
            elif req.is_finished:
                text += tracked.detokenizer.flush()
            deltas.setdefault(req.parent_id, []).append(CompletionOutput(
                index=req.index,
                text=text,
                token_ids=[tok],
                logprobs=[row_logprobs[req_id]] if req_id in row_logprobs else
                (None if req.sampling_params.logprobs is None else []),
                finish_reason=req.status.finish_reason if req.is_finished else None,
                stop_reason=req.stop_reason if req.is_finished else None,
                num_generated_tokens=req.num_output_tokens,
            ))
        for req in finished:  # finished without a sampled token this step (e.g. max_model_len)
            if req.request_id not in sampled and req.parent_id in self._groups:
                tail = self._tracked[req.request_id].detokenizer.flush()
                deltas.setdefault(req.parent_id, []).append(CompletionOutput(
                    index=req.index, text=tail, finish_reason=req.status.finish_reason,
                    stop_reason=req.stop_reason, num_generated_tokens=req.num_output_tokens))
        return deltas

    def _request_outputs(self, deltas: dict[str, list[CompletionOutput]], done_time: float) -> list[RequestOutput]:
        """One RequestOutput per client request with news; a request whose
        sequences all finished is forgotten."""
        outputs = []
        for parent_id, outs in deltas.items():
            seqs = self._groups[parent_id]
            all_done = all(s.is_finished for s in seqs)
            leader = seqs[0]
            outputs.append(RequestOutput(
                request_id=parent_id,
                prompt=self._tracked[leader.request_id].prompt,
                prompt_token_ids=leader.prompt_token_ids,
                outputs=sorted(outs, key=lambda o: o.index),
                finished=all_done,
                prompt_logprobs=self._prompt_logprobs.get(parent_id),
                num_cached_tokens=max(leader.num_cached_tokens, 0),
                metrics=RequestMetrics(
                    arrival_time=leader.arrival_time,
                    first_scheduled_time=leader.first_scheduled_time,
                    first_token_time=min((s.first_token_time for s in seqs if s.first_token_time), default=None),
                    last_token_time=done_time,
                    finished_time=done_time if all_done else None,
                ),
            ))
            if all_done:
                for s in seqs:
                    s.finished_time = done_time
                    self._forget(s)
                del self._groups[parent_id]
                self._prompt_logprobs.pop(parent_id, None)
        return outputs

    # ---------------------------------------------------------------- helpers
    def _forget(self, seq: Request) -> None:
        self._tracked.pop(seq.request_id, None)
        self.sampler.free(seq.request_id)
        if self._structured_outputs is not None:
            self._structured_outputs.free(seq.request_id)

    @property
    def structured_outputs(self) -> StructuredOutputManager:
        """Grammar compiler and matchers (built on first use: importing
        xgrammar takes seconds)."""
        with self._structured_outputs_lock:
            if self._structured_outputs is None:
                self._structured_outputs = StructuredOutputManager(self.tokenizer, self.model_config.vocab_size)
        return self._structured_outputs

    def compile_grammar(self, params) -> None:
        """Compile (and cache) a ``StructuredOutputsParams`` grammar; safe
        from any thread.

        Raises:
            ValueError: the spec is invalid or unsupported (names the part).
        """
        self.structured_outputs.compile(params)

    def _stop_finished_grammars(self, request_ids: list[str], finished: list[Request]) -> None:
        """Finish ("stop") sequences whose grammar terminated but that are
        still running (e.g. ``ignore_eos``, or a grammar stop token that is
        not EOS)."""
        for rid in request_ids:
            tracked = self._tracked.get(rid)
            if tracked is not None and not tracked.request.is_finished:
                self.scheduler.finish_requests([rid], RequestStatus.FINISHED_STOPPED)
                finished.append(tracked.request)

    def _decode_logprobs(self, position: dict[int, Logprob]) -> dict[int, Logprob]:
        fill_decoded_tokens(self.tokenizer, position)
        return position

    def _collect_prompt_logprobs(self, sched, prompt_logits: dict) -> None:
        """Store this chunk's prompt logprobs at their positions: the logits at
        position p score token p+1. Positions already stored (a chunk
        recomputed after preemption) keep their first value."""
        for entry in sched.scheduled:
            req = entry.request
            logits = prompt_logits.get(req.request_id)
            collected = self._prompt_logprobs.get(req.parent_id)
            if logits is None or req.index != 0 or collected is None:
                continue
            start = entry.num_computed_tokens
            end = min(start + entry.num_new_tokens, req.num_prompt_tokens)
            targets = req.prompt_token_ids[start + 1:end + 1]
            if start + 1 > len(collected):
                raise RuntimeError(f"request {req.parent_id}: prompt logprobs missing before position {start + 1} "
                                   "(a cached prefix was read)")
            new = targets[len(collected) - start - 1:]
            if new:
                positions = prompt_logprobs(logits[len(targets) - len(new):len(targets)], new,
                                            req.sampling_params.prompt_logprobs)
                collected.extend(self._decode_logprobs(p) for p in positions)

    # ------------------------------------------------------------------ stats
    def get_stats(self) -> EngineStats:
        """Snapshot of the live signals (cheap; called per gateway request)."""
        s = self.scheduler
        in_flight = sum(r.num_tokens for seqs in self._groups.values() for r in seqs if not r.is_finished)
        return EngineStats(
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            kv_cache_usage=s.kv_cache_usage,
            prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits,
            num_preemptions=s.num_preemptions,
            tokens_in_flight=in_flight,
            prompt_tokens_total=self._prompt_tokens_total,
            generation_tokens_total=self._generation_tokens_total,
        )
