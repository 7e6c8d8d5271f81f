"""The engine core: scheduler + model runner + sampler over the paged KV cache.

One ``step()`` = schedule, run the model, sample (grammar-constrained rows
masked), advance the scheduler, and report each choice's new tokens as
``EngineCoreOutput`` (raw token ids: detokenization, stop strings and the
assembly of ``RequestOutput`` live in ``engine/output_processor.py``, as in
vLLM v1's ``EngineCore`` / ``OutputProcessor`` split).

    add_request ─► Scheduler ─► ModelRunner ─► Sampler ─► Scheduler.update_from_output
                                                              │
                                        EngineCoreOutput ◄────┘

It is driven by ``LLMEngine`` (offline, same thread) or by
``engine/core/core_loop.py`` (in a thread or in its own process, for
``AsyncEngine``). Not thread-safe, except ``compile_grammar`` and
``submit_grammar``. Its start-up (loading, KV pool and budget sizing) is
``engine/core/core_setup.py``.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterable

from engine.config import EngineArgs
from engine.core.core_messages import EngineCoreOutput, EngineStats
from engine.worker.token_restrictions import resolved_for_model
from engine.worker.grammar_compiler import grammar_limits
from engine.distributed.parallel_state import RankFailure
from engine.outputs import Logprob
from engine.pooling import PoolingParams, model_pooling_params
from engine.core.core_setup import start_core
from engine.core.request import ForkGroup, Request, RequestStatus
from engine.worker.sampler import collect_prompt_logprobs, picks_raw_argmax
from engine.core.multi_step import steps_allowed
from engine.sampling_params import SamplingParams
from engine.core.step_work import step_work
from engine.worker.structured_outputs import StructuredOutputManager
from engine.core.ttft import predict_waiting, state_of
from engine.kv_events import take_batch
from engine.spec_decode.rejection import sample_with_drafts

# what a pooling request's sampling parameters are read for (prompt logprobs: none; nothing is sampled)
_POOLING_SAMPLING = SamplingParams(max_tokens=1)


class EngineCore:
    """Continuous-batching core over a paged KV cache.

    Args:
        args: engine configuration (vLLM's names).

    Raises:
        FileNotFoundError, ValueError: the model cannot be loaded.
        MemoryError: the KV pool does not fit (the message says which setting to lower).
    """

    def __init__(self, args: EngineArgs) -> None:
        start_core(self, args)

    # ------------------------------------------------------------------ input
    def add_request(self, request_id: str, token_ids: list[int], params: SamplingParams, priority: int = 0,
                    arrival_time: float | None = None, resume: dict[int, list[int]] | None = None,
                    cache_salt: str | None = None) -> None:
        """Queue a tokenized request (``params.n`` sequences).

        ``cache_salt``: vLLM's; mixed into the hash of the prompt's first block, so the request reads and
        leaves prefix-cache blocks only for requests with the same salt (tenants kept apart).

        ``resume``: a continuation of this request after another engine stopped it: choice index -> the tokens
        that choice had generated (only these choices run). Each is re-prefilled (prompt + its tokens, as after
        a preemption by recompute) and goes on from there as the uninterrupted request would have: its seeded
        draws are by output position (``engine/worker/sampler.py``), ``min_tokens``/``max_tokens`` count from the
        original start and its usage's prompt is the original prompt.

        Raises:
            ValueError: duplicate id, empty prompt, token id (of the prompt, of
                ``allowed_token_ids``) out of the vocabulary, a prompt of ``max_model_len`` tokens or more; a
                continuation of a choice out of range, with no tokens left to
                generate, or of a request with a grammar or prompt logprobs.
        """
        self._requests_added += 1
        if request_id in self._groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        max_tokens = self._check_prompt(token_ids, params)
        params = resolved_for_model(params, self.tokenizer, self.model_config.vocab_size)
        if resume is not None:
            self._check_resume(token_ids, params, max_tokens, resume)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        n = params.n
        # choices of a continuation have different tokens: no shared prompt to fork. A fork group runs its
        # members at once, so choices beyond max_num_seqs form further groups, admitted as seats free (their
        # leaders find the prompt in the prefix cache), as vLLM v1 schedules each child on its own
        seats = self.scheduler.max_num_seqs
        group = None
        seqs = []
        for index in (range(n) if resume is None else sorted(resume)):
            if n > 1 and resume is None and index % seats == 0:
                group = ForkGroup(parent_id=request_id) if n - index > 1 else None
            req = Request(
                request_id=f"{request_id}-{index}" if n > 1 else request_id, prompt_token_ids=token_ids,
                sampling_params=params, eos_token_id=self.tokenizer.eos_token_id, max_tokens=max_tokens,
                arrival_time=arrival, priority=priority, parent_id=request_id, index=index, group=group,
                cache_salt=cache_salt,
            )
            if resume is not None:
                req.append_output_token_ids(list(resume[index]))
            if group is not None:
                group.members.append(req)
            seqs.append(req)
        if params.structured_outputs is not None:
            for req in seqs:  # compiles (or finds in the cache) before anything is queued
                self.structured_outputs.add(req.request_id, params.structured_outputs, params.stop_token_ids)
        for req in seqs:
            self.scheduler.add_request(req)
            self._seqs[req.request_id] = req
        self._groups[request_id] = seqs
        if params.prompt_logprobs is not None:
            self._prompt_logprobs[request_id] = [None]

    def _check_resume(self, token_ids: list[int], params: SamplingParams, max_tokens: int,
                      resume: dict[int, list[int]]) -> None:
        """Raises ValueError when ``resume`` cannot continue this request (see ``add_request``)."""
        if not resume:
            raise ValueError("resume: no choice to continue")
        if params.structured_outputs is not None or params.prompt_logprobs is not None:
            raise ValueError("resume: a request with a grammar or prompt logprobs cannot be continued")
        vocab = self.model_config.vocab_size
        for index, done in resume.items():
            if not 0 <= index < params.n:
                raise ValueError(f"resume: choice {index} out of range for n={params.n}")
            if len(done) >= max_tokens or any(not isinstance(t, int) or t < 0 or t >= vocab for t in done):
                raise ValueError(f"resume: choice {index} has no tokens left to generate or a token out of range")

    def _check_prompt(self, token_ids: list[int], params: SamplingParams) -> int:
        """The resolved ``max_tokens`` of a valid prompt: at most the room ``max_model_len`` leaves after it, so a
        completion asked for more stops there with finish_reason "length", as vLLM's engine stops it (the OpenAI
        server refuses such a request before, as vLLM's server does: ``serving.py``). Raises ValueError: empty, a
        token id out of the vocabulary, or a prompt that leaves no room under ``max_model_len``."""
        if not token_ids:
            raise ValueError("prompt must not be empty")
        vocab = self.model_config.vocab_size
        if any(not isinstance(t, int) or t < 0 or t >= vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        num_prompt = len(token_ids)
        if num_prompt >= self.max_model_len:
            raise ValueError(f"This model's maximum context length is {self.max_model_len} tokens, "
                             f"but the prompt has {num_prompt} tokens (max_model_len)")
        room = self.max_model_len - num_prompt
        return room if params.max_tokens is None else min(params.max_tokens, room)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Abort client requests (all their sequences) and free their blocks now."""
        for rid in list(request_ids):
            seqs = self._groups.get(rid)
            if seqs is None:
                continue
            if seqs[0].pooling_params is not None:
                self.embed_calls.abort(rid)
            self.scheduler.finish_requests([s.request_id for s in seqs if not s.is_finished],
                                           RequestStatus.FINISHED_ABORTED)
            self._forget_group(rid)

    def withdraw(self, request_id: str, by: float, scale: float = 1.0,
                 arrival_tok_s: float = 0.0) -> tuple[bool, float | None]:
        """Abort ``request_id`` if it is still waiting with nothing computed and its first token, re-predicted
        from its place in the queue (``predict_waiting``; seconds, times ``scale``: the caller's correction of
        this engine's predictions), would come after ``by`` (``time.monotonic()`` seconds). The gateway asks
        this of a request it can still send to another backend in time (``gateway/backends/local.py``); nothing
        was computed for it, so nothing is lost or billed. Returns (withdrawn, the prediction in seconds or None
        when the request is not waiting so, or is one of several choices or prompts)."""
        if len(self._groups.get(request_id, ())) != 1:
            return False, None
        p = predict_waiting(self.scheduler, self.ttft_calibration, request_id, arrival_tok_s)
        if p is None:
            return False, None
        late = time.monotonic() + scale * p.seconds > by
        if late:
            self.abort_requests([request_id])
        return late, p.seconds

    def abort_all(self) -> list[str]:
        """Abort every request; returns their ids."""
        ids = list(self._groups)
        self.abort_requests(ids)
        return ids

    def finish_sequences(self, stops: Iterable[tuple[str, int, str]]) -> None:
        """Finish choices that a stop string ended, (request id, index, stop
        string) each, as "stop"; free their blocks. Unknown ones are ignored."""
        for rid, index, stop in stops:
            seqs = self._groups.get(rid)
            if seqs is None or index >= len(seqs):
                continue
            seq = seqs[index]
            if not seq.is_finished:
                self.scheduler.finish_requests([seq.request_id], RequestStatus.FINISHED_STOPPED, stop_reason=stop)
            if all(s.is_finished for s in seqs):
                self._forget_group(rid)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ------------------------------------------------------ tensor parallelism
    @property
    def failure(self) -> str | None:
        """Why the tensor-parallel ranks failed (a rank died, a step's collective failed), or None; once
        set the engine cannot step again (its loop ends: the engine reports dead)."""
        return self.executor.failure if self.executor is not None else None

    def on_failure(self, callback) -> None:
        """Call ``callback(reason)`` (from the executor's watcher thread) when a rank dies; one rank: never."""
        if self.executor is not None:
            self.executor.on_failure = callback

    # ------------------------------------------------------------------- step
    def step(self) -> list[EngineCoreOutput]:
        """Run one scheduling step; the news of every choice that sampled a token or finished: 1. schedule, 2. run
        the model, 3. sample (grammar-constrained rows masked), 4. advance the scheduler (EOS, stop token ids,
        lengths), 5. report (several decode steps of one call: each step's news apart)."""
        started = time.perf_counter()
        if self.spec_decoder is not None:
            self.spec_decoder.propose(self.scheduler.running)
        if self.failure is not None:
            raise RankFailure(self.failure)
        if self.executor is not None and self.executor.closed:
            raise RuntimeError("this engine was shut down (LLM.shutdown()): its tensor-parallel ranks are gone; "
                               "create a new LLM")
        sched = self._schedule()
        if sched.is_empty:
            return []
        try:
            runner_out = self.model_runner.execute_model(sched)
        except RankFailure as exc:
            self.executor.fail(str(exc))
            raise
        sampled, row_logprobs, grammar_done, content = self._sample(sched, runner_out)
        work = step_work(sched.scheduled, self.model_config.num_hidden_layers)
        self._prompt_tokens_total += work.prompt_tokens
        self._calibrate(started, work.prefill_tokens, work.decode_rows, work.quad, work.chunks, sched.num_steps)
        collect_prompt_logprobs(sched.scheduled, runner_out.prompt_logits, self._prompt_logprobs)
        before = {sid: self._seqs[sid].num_output_tokens for sid in sampled if sid in self._seqs}
        finished = self.scheduler.update_from_output(sched, sampled, not_stops=content)
        self.embed_calls.step(runner_out.pooled_hidden, self._seqs, finished)
        if self.spec_decoder is not None:
            self.spec_decoder.observe(sched, sampled)
        self._stop_finished_grammars(grammar_done, finished)
        kept = {sid: self._seqs[sid].output_token_ids[n:] for sid, n in before.items()}  # up to a finishing one
        self._generation_tokens_total += sum(generated := [len(v) for v in kept.values()])
        self.iteration_tokens.observe_call(work.prompt_tokens, generated, sched.num_steps)
        outputs = self._news(kept, before, row_logprobs, sched.num_steps)
        outputs += [self._output(req, [], None) for req in finished  # finished without a token (max_model_len)
                    if req.request_id not in sampled and req.request_id in self._seqs and req.pooling_params is None]
        for req in finished:
            if req.pooling_params is not None:
                self._forget_group(req.request_id)
        for rid in {o.request_id for o in outputs if o.finish_reason is not None}:
            if all(s.is_finished for s in self._groups[rid]):
                self._forget_group(rid)
        if not self.scheduler.has_unfinished_requests():
            self._last_step = None
        if self.kv_event_publisher is not None:
            batch = take_batch(self.scheduler.kv_cache_manager.block_pool.kv_cache_events)
            if batch is not None:
                self.kv_event_publisher.publish(batch)
        return outputs

    def close(self) -> None:
        """Release what outlives a step: the KV events publisher's thread and sockets, and the other
        tensor-parallel ranks (``MultiprocExecutor.stop``: the group left). Once done, a no-op."""
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.shutdown()
            self.kv_event_publisher = None
        if self.executor is not None:
            self.executor.stop(self.model_runner.tp)

    def _calibrate(self, started: float, prefill_tokens: int, decode_rows: int, quad: float, chunks: int,
                   steps: int = 1) -> None:
        """Time the previous step from its start to this one's (perf_counter seconds; several decode steps as that
        many of their mean): what a waiting request sees, hand-offs included. A step after which nothing was left
        to run is not timed (the loop then idled)."""
        if self._last_step is not None:
            last = self._last_step
            seconds = (started - last[0]) / last[5]
            self.ttft_calibration.observe(seconds, last[1], last[2], at=started, quad=last[3], chunks=last[4])
            if self._ttft_log is not None:
                self._ttft_log.step(seconds, last[1], last[2], started, last[3], last[4])
        self._last_step = (started, prefill_tokens, decode_rows, quad, chunks, steps)

    def _schedule(self):
        """The next batch, of several greedy decode steps where allowed (``engine/core/multi_step.py``)."""
        if self.max_scheduler_steps < 2:
            return self.scheduler.schedule()
        read = self.model_runner.decode_read_bytes(sum(r.num_tokens for r in self.scheduler.running))
        return self.scheduler.schedule(steps_allowed(self.max_scheduler_steps, read), picks_raw_argmax)

    def _sample(self, sched, runner_out) -> tuple[dict[str, list[int]], dict[str, list], list[str], set[str]]:
        """(sequence id -> the tokens it keeps: its accepted proposals then one sampled token, sequence id ->
        their logprobs, sequences whose grammar just completed, sequences whose sampled stop token is grammar
        content and must not stop them)."""
        entries = [sched.scheduled[i] for i in runner_out.sample_indices]
        rows = [e.request for e in entries]
        if runner_out.step_tokens:   # several greedy steps: their tokens (multi_step.py)
            return dict(zip((r.request_id for r in rows), runner_out.step_tokens)), {}, [], set()
        sampled: dict[str, list[int]] = {}
        row_logprobs: dict[str, list] = {}
        grammar_done: list[str] = []
        content: set[str] = set()
        if not rows:
            return sampled, row_logprobs, grammar_done, content
        so = self._structured_outputs
        bitmask = so.grammar_bitmask(rows) if so is not None else None
        drafts = [e.spec_token_ids for e in entries]
        draft_logits = [runner_out.spec_logits.get(r.request_id) for r in rows]
        result = sample_with_drafts(self.sampler, runner_out.logits, rows, drafts, draft_logits,
                                    grammar_bitmask=bitmask)
        for req, tokens, lps in zip(rows, result.token_ids, result.logprobs):
            sampled[req.request_id] = tokens
            if lps is not None:
                row_logprobs[req.request_id] = lps
            if bitmask is None or req.sampling_params.structured_outputs is None:
                continue
            tok = tokens[0]  # a row with a grammar gets no proposals
            if so.is_content(req.request_id, tok):
                content.add(req.request_id)
            if so.accept(req.request_id, tok):
                grammar_done.append(req.request_id)
        return sampled, row_logprobs, grammar_done, content

    def _news(self, kept: dict[str, list[int]], before: dict[str, int], row_logprobs: dict,
              steps: int) -> list[EngineCoreOutput]:
        """Each choice's news of a step: the tokens it kept (``before``: its output count before them) and their
        logprobs; of a call of several decode steps, one output per step and choice, in step order, as one
        step per call gives them (a stream's chunks do not depend on how many steps a call ran)."""
        if steps == 1:
            return [self._output(self._seqs[sid], t, None if (lps := row_logprobs.get(sid)) is None else lps[:len(t)])
                    for sid, t in kept.items()]
        news = [self._output(self._seqs[sid], [], None) for sid, t in kept.items() if not t]
        for k in range(max(map(len, kept.values()), default=0)):
            news += [self._output(self._seqs[sid], [t[k]], None, None if k + 1 == len(t) else before[sid] + k + 1)
                     for sid, t in kept.items() if k < len(t)]
        return news

    def _output(self, req: Request, tokens: list[int], logprobs: list[dict[int, Logprob]] | None,
                as_of: int | None = None) -> EngineCoreOutput:
        """One choice's news; the group's leader gives the request-level fields; ``as_of``: as it stood after that
        many output tokens, an earlier step of several in one call (not finished then)."""
        leader = self._groups[req.parent_id][0]
        if logprobs is not None:
            new_logprobs = list(logprobs)
        else:
            new_logprobs = None if req.sampling_params.logprobs is None or not tokens else []
        done = req.is_finished and as_of is None
        return EngineCoreOutput(
            request_id=req.parent_id, index=req.index, new_token_ids=tokens, new_logprobs=new_logprobs,
            finish_reason=req.status.finish_reason if done else None, stop_reason=req.stop_reason if done else None,
            stop_terminated=done and req.status == RequestStatus.FINISHED_STOPPED,
            num_output_tokens=req.num_output_tokens if as_of is None else as_of,
            # prompt tokens: a continuation's (resume) or a recomputed request's cache hits may cover output tokens
            num_cached_tokens=min(max(leader.num_cached_tokens, 0), leader.num_prompt_tokens),
            arrival_time=leader.arrival_time,
            first_scheduled_time=leader.first_scheduled_time, first_token_time=req.first_token_time,
            prompt_logprobs=self._prompt_logprobs.pop(req.parent_id, None) if tokens else None,
        )

    # ---------------------------------------------------------------- helpers
    def _forget_group(self, rid: str) -> None:
        for seq in self._groups.pop(rid, []):
            self._seqs.pop(seq.request_id, None)
            self.sampler.free(seq.request_id)
            if self._structured_outputs is not None:
                self._structured_outputs.free(seq.request_id)
        self._prompt_logprobs.pop(rid, None)
        self.embed_calls.forget(rid)

    @property
    def structured_outputs(self) -> StructuredOutputManager:
        """Grammar compiler and matchers (built on first use: importing
        xgrammar takes seconds)."""
        with self._structured_outputs_lock:
            if self._structured_outputs is None:
                self._structured_outputs = StructuredOutputManager(self.tokenizer, self.model_config.vocab_size,
                                                                   grammar_limits(self.args))
        return self._structured_outputs

    def prepare_structured_outputs(self) -> StructuredOutputManager:
        """Build the grammar manager now (call once the engine is idle and
        ready) and freeze the garbage collector's heap again, as ``__init__``
        does after loading: the manager's Python objects (xgrammar's modules,
        the tokenizer's vocabulary table: ~43,000 objects with SmolLM2) then
        never enter a collection. Left unfrozen, each full collection while
        serving walked them: 50-100 ms with the GIL held, on whichever core
        thread allocated, a stall of every running stream (issue #34)."""
        manager = self.structured_outputs
        gc.freeze()
        return manager

    def compile_grammar(self, params) -> None:
        """Validate and compile (and cache) a ``StructuredOutputsParams``
        grammar in the caller's thread.

        Raises:
            GrammarRefused: the spec is invalid, unsupported or too large (names the part).
        """
        self.structured_outputs.compile(params)

    def submit_grammar(self, params, done) -> None:
        """Validate and compile a grammar in the compile pool, off the step
        loop; ``done(digest, error)`` from a worker thread (``StructuredOutputManager.submit``)."""
        self.structured_outputs.submit(params, done)

    def _stop_finished_grammars(self, request_ids: list[str], finished: list[Request]) -> None:
        """Finish ("stop") sequences whose grammar terminated but that are
        still running (e.g. ``ignore_eos``, or a grammar stop token that is
        not EOS)."""
        for rid in request_ids:
            req = self._seqs.get(rid)
            if req is not None and not req.is_finished:
                self.scheduler.finish_requests([rid], RequestStatus.FINISHED_STOPPED)
                finished.append(req)

    # ------------------------------------------------------------------ stats
    def add_embed(self, call_id: int, prompts: list[list[int]], pooling_type: str | None = None,
                  normalize: bool | None = None) -> None:
        """Queue the embeddings of tokenized prompts (``engine/pooling.py``) as pooling requests: prefilled in
        chunks like any prompt, in steps shared with the running streams. ``take_embeds`` hands back the call's
        vectors (one float32 vector of ``hidden_size`` values per prompt) once all are pooled.
        ``pooling_type`` / ``normalize`` None: the model's own pooling config (else LAST, normalized).

        Raises:
            ValueError: an empty prompt, one over ``max_model_len``, a token id outside the vocabulary, an
                unknown pooling type, or a call id in use; nothing is queued then.
        """
        self._requests_added += 1   # one command, as the front end counts it (engine/core/ttft.py PendingAdds)
        own = model_pooling_params(self.args.model)
        params = PoolingParams(pooling_type or own.pooling_type, own.normalize if normalize is None else normalize)
        vocab = self.model_config.vocab_size
        for i, ids in enumerate(prompts):
            if not ids:
                raise ValueError(f"input {i}: the prompt is empty")
            if len(ids) > self.max_model_len:
                raise ValueError(f"input {i}: {len(ids)} tokens, more than max_model_len ({self.max_model_len})")
            if min(ids) < 0 or max(ids) >= vocab:
                raise ValueError(f"input {i}: token ids must be in [0, {vocab})")
        seq_ids = self.embed_calls.start(call_id, len(prompts))
        now = time.monotonic()
        for i, (sid, ids) in enumerate(zip(seq_ids, prompts)):
            req = Request(request_id=sid, prompt_token_ids=list(ids), sampling_params=_POOLING_SAMPLING,
                          max_tokens=0, arrival_time=now, pooling_params=params, input_index=i)
            self.scheduler.add_request(req)
            self._seqs[sid] = req
            self._groups[sid] = [req]

    def take_embeds(self) -> list[tuple[int, list[list[float]] | None, str | None]]:
        """The embed calls that ended since the last call, (call id, vectors, None) or (call id, None, error)
        (an error when a pooling request of the call was aborted: the step failed, or the engine stopped)."""
        return self.embed_calls.take()

    def embed(self, prompts: list[list[int]], pooling_type: str | None = None,
              normalize: bool | None = None) -> list[list[float]]:
        """``add_embed`` and step until its vectors are pooled (the offline API's; nothing else may be running).

        Raises:
            ValueError: as ``add_embed``.
            RuntimeError: other requests are running, or the embedding was aborted.
        """
        if self.has_unfinished_requests():
            raise RuntimeError("embed: the engine is running other requests (use add_embed and step)")
        self.add_embed(0, prompts, pooling_type, normalize)
        while self.has_unfinished_requests():
            self.step()
        (_, vectors, error), = self.take_embeds()
        if error:
            raise RuntimeError(error)
        return vectors

    def get_stats(self) -> EngineStats:
        """Snapshot of the live signals (cheap; called per gateway request)."""
        s = self.scheduler
        in_flight = sum(r.num_tokens for seqs in self._groups.values() for r in seqs if not r.is_finished)
        return EngineStats(
            num_running=s.num_running, num_waiting=s.num_waiting, kv_cache_usage=s.kv_cache_usage,
            prefix_cache_queries=s.prefix_cache_queries, prefix_cache_hits=s.prefix_cache_hits,
            num_preemptions=s.num_preemptions, tokens_in_flight=in_flight,
            prompt_tokens_total=self._prompt_tokens_total, generation_tokens_total=self._generation_tokens_total,
            ttft=state_of(s, self.ttft_calibration, self._requests_added),
            iteration_tokens=tuple(self.iteration_tokens.counts), iteration_tokens_sum=self.iteration_tokens.total,
            **({} if self.spec_decoder is None else self.spec_decoder.stats.engine_stats()),
        )
