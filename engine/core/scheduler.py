"""Continuous-batching scheduler with chunked prefill, prefix caching,
preemption (recompute or swap) and parallel sampling (fork + copy-on-write).

One unified step, as in vLLM v1 (``vllm/v1/core/sched/scheduler.py``): there
are no separate prefill and decode phases; every request simply has
``num_computed_tokens`` and a target length, and a step hands each chosen
request its next ``num_new_tokens`` (1 for a decode, a chunk for a prefill):

1. running requests, in policy order (fcfs: as seated, as in vLLM v1;
   priority: ``_key``), under the token budget ``max_num_batched_tokens``; when a
   running request cannot get blocks, the least important running request is
   preempted (swapped to CPU when swap space allows, else freed for
   recompute) until it can, or it preempts itself;
2. unless step 1 preempted: swapped requests are swapped back in;
3. unless step 1 preempted or requests are still swapped out: waiting
   requests are admitted (prefix-cache lookup first) under the budget and
   ``max_num_seqs``;
4. a batch of decodes alone may run several steps (``engine/core/multi_step.py``).

A pooling request (an embedding) is a prompt like any other, prefilled in chunks under the same budget beside
decoding rows; it samples nothing and finishes when its prompt is computed (``engine/core/chunking.py``). An
embedding call's inputs are served round-robin with every other request: its input ``i`` is seated after the
inputs ``< i`` of every call and after every generation request (``Request.input_index``; ``seat_order``), so a
short call is not queued behind a long call's inputs.

Parallel sampling (vLLM v0's ``SequenceGroup`` fork): the leader of a
``ForkGroup`` (its first unfinished member) prefills ``prompt_len - 1``
tokens while its siblings wait; admitting the leader reserves seats for all
members. Once the leader has computed ``prompt_len - 1`` tokens its block
table is forked into every sibling (ref counts, no copy) and they join the
running queue; each member then computes the last prompt token itself, which
copies the shared last block first (copy-on-write, ``blocks_to_copy``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from engine.core.admission import check_admissible
from engine.core.chunking import drop_layer_chunk, layer_pass_midway, next_chunk, spec_tokens
from engine.core.kv_cache_manager import KVCacheManager, cdiv
from engine.core.multi_step import lookahead_steps
from engine.core.request import Request, RequestStatus
from engine.core.scheduler_output import ScheduledRequest, SchedulerOutput
from engine.core.step_cost import PoolingBudget, StepAllowance
from engine.core.stop_check import check_stop


class Scheduler:
    """Decides, each step, which requests run and how many tokens each computes.

    Args:
        block_size: tokens per KV block.
        num_blocks: device KV blocks, including the null block.
        max_num_seqs: most requests running at once (a step schedules at most
            this many).
        max_num_batched_tokens: token budget of one step.
        max_model_len: prompt + completion limit, tokens.
        enable_prefix_caching: automatic prefix caching.
        enable_chunked_prefill: split a prompt across steps to fit the budget;
            without it a prompt runs whole or waits.
        scheduling_policy: "fcfs" or "priority" (lower value served first,
            ties by earlier arrival).
        num_cpu_blocks: CPU swap blocks; > 0 preempts by swapping when the
            victim fits, else by recompute.
        pooling_budget: sizes pooling chunks beside generation work (None:
            the token budget alone; with chunked prefill only).

    Raises:
        ValueError: a bad setting (the message names it).
    """

    def __init__(self, *, block_size: int, num_blocks: int, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, enable_prefix_caching: bool = True, enable_chunked_prefill: bool = True,
                 scheduling_policy: str = "fcfs", num_cpu_blocks: int = 0,
                 pooling_budget: PoolingBudget | None = None) -> None:
        for name, value, low in (("block_size", block_size, 1), ("num_blocks", num_blocks, 2),
                                 ("max_num_seqs", max_num_seqs, 1),
                                 ("max_num_batched_tokens", max_num_batched_tokens, 1),
                                 ("max_model_len", max_model_len, 1), ("num_cpu_blocks", num_cpu_blocks, 0)):
            if value < low:
                raise ValueError(f"{name} must be >= {low}, got {value}")
        if scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be fcfs or priority, got {scheduling_policy!r}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_prefix_caching = enable_prefix_caching
        self.enable_chunked_prefill = enable_chunked_prefill
        self.scheduling_policy = scheduling_policy
        self.num_cpu_blocks = num_cpu_blocks
        self.pooling_budget = pooling_budget if enable_chunked_prefill else None
        self._allowance = StepAllowance(None, False)   # the step's, for pooling chunks (set by schedule())
        self._dropped: set[str] = set()   # chunks in flight whose hidden state the runner drops at the next step
        self.kv_cache_manager = KVCacheManager(block_size=block_size, num_blocks=num_blocks,
                                               enable_caching=enable_prefix_caching, num_cpu_blocks=num_cpu_blocks)
        self.requests: dict[str, Request] = {}  # unfinished requests by id
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self._num_preemptions = 0

    # -- stats --------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        """Requests not running: waiting (incl. preempted) and swapped out."""
        return len(self.waiting) + len(self.swapped)

    @property
    def num_swapped(self) -> int:
        return len(self.swapped)

    @property
    def kv_cache_usage(self) -> float:
        """Fraction (0..1) of non-null device blocks in use."""
        return self.kv_cache_manager.usage

    @property
    def prefix_cache_queries(self) -> int:
        """Prompt tokens looked up in the prefix cache (cumulative)."""
        return self.kv_cache_manager.prefix_cache_queries

    @property
    def prefix_cache_hits(self) -> int:
        """Prompt tokens found in the prefix cache (cumulative)."""
        return self.kv_cache_manager.prefix_cache_hits

    @property
    def num_preemptions(self) -> int:
        """Preemptions (recompute or swap) so far, cumulative."""
        return self._num_preemptions

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_block_ids(self, request_id: str) -> list[int]:
        return self.kv_cache_manager.get_block_ids(request_id)

    # -- requests -----------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request (for n > 1, the engine adds all n siblings, which
        share one ``ForkGroup``).

        Raises:
            ValueError: a request that could never run under this scheduler's limits (``check_admissible``).
        """
        check_admissible(request, self)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self._enqueue(request)
        self.kv_cache_manager.refresh_prefix(request)   # its cached prefix is needed soon: evicted last

    def finish_requests(self, request_ids: Iterable[str] | str, status: RequestStatus,
                        stop_reason: int | str | None = None) -> list[Request]:
        """Finish requests from outside (abort, stop string): remove them from
        their queue and free their blocks. Unknown or finished ids are ignored.

        Returns:
            The requests finished by this call.
        """
        if not status.is_finished:
            raise ValueError(f"status must be a finished status, got {status!r}")
        ids = [request_ids] if isinstance(request_ids, str) else request_ids
        done = [self.requests[rid] for rid in dict.fromkeys(ids) if rid in self.requests]
        for req in done:
            self._finish(req, status, stop_reason)
        return done

    def _finish(self, req: Request, status: RequestStatus, stop_reason: int | str | None) -> None:
        queue = {RequestStatus.RUNNING: self.running, RequestStatus.SWAPPED: self.swapped}.get(req.status, self.waiting)
        queue.remove(req)
        req.status = status
        req.stop_reason = stop_reason
        req.finished_time = time.monotonic()
        self.kv_cache_manager.free(req)
        del self.requests[req.request_id]
        drop_layer_chunk(req, self._dropped)

    # -- helpers ------------------------------------------------------------
    def _key(self, req: Request) -> tuple:
        """A request's place: (priority under the priority policy, place among its embedding call's inputs,
        arrival). Orders the swapped requests, and under the priority policy the running and waiting ones too."""
        rank = (req.input_index, req.arrival_time)
        return (req.priority, *rank) if self.scheduling_policy == "priority" else rank

    def _enqueue(self, req: Request, front: bool = False) -> None:
        """Queue ``req`` where fcfs admission seats it, keeping ``waiting`` ordered by ``input_index`` (an
        embedding call's input ``i`` after every waiting request of a smaller one): after every request of its
        index or a smaller one, or, ``front`` (a preempted request), before every request of its index or a
        larger one. The queue is then in seat order with no sort per step."""
        w, k = self.waiting, req.input_index
        w.insert(next((j for j, r in enumerate(w) if r.input_index >= k), len(w)) if front
                 else next((j for j in range(len(w), 0, -1) if w[j - 1].input_index <= k), 0), req)

    def _sort_waiting(self) -> list[Request]:
        """The waiting queue in the order admission seats it (a copy): by ``_key`` under the priority policy
        (sorted in place); under fcfs as queued (``_enqueue`` keeps it so)."""
        if self.scheduling_policy == "priority":
            self.waiting.sort(key=self._key)
        return list(self.waiting)

    def seat_order(self) -> list[Request]:
        """The swapped and waiting requests in the order the next step gives them seats: the swapped first
        (phase 2), by ``_key``, then the waiting (``_sort_waiting``). Sorts both queues in place."""
        self.swapped.sort(key=self._key)
        return [*self.swapped, *self._sort_waiting()]

    @staticmethod
    def _leader(req: Request) -> Request:
        return next(m for m in req.group.members if not m.is_finished)

    @staticmethod
    def _unforked(req: Request) -> bool:
        return req.group is not None and not req.group.forked

    def _target_len(self, req: Request) -> int:
        """Tokens the request must have computed before it can sample: an
        unforked leader stops at prompt_len - 1 (the fork point)."""
        return req.num_prompt_tokens - 1 if self._unforked(req) else req.num_tokens

    def _seats_needed(self, req: Request) -> int:
        """max_num_seqs seats taken by the request (an unforked leader holds
        one for each unfinished member of its group)."""
        return sum(1 for m in req.group.members if not m.is_finished) if self._unforked(req) else 1

    def _chunk(self, req: Request, computed: int, budget: int) -> tuple[int, tuple[int, int] | None]:
        """(tokens of ``req`` past ``computed`` to schedule under ``budget``, their layers) (``next_chunk``)."""
        return next_chunk(self._allowance, req, computed, self._target_len(req) - computed, budget,
                          self.max_num_batched_tokens, self.enable_chunked_prefill)

    def _fork(self, leader: Request) -> None:
        """Share the leader's block table with every unfinished sibling and
        move them to the running queue."""
        group = leader.group
        now = time.monotonic()
        for m in group.members:
            if m is leader or m.is_finished:
                continue
            self.kv_cache_manager.fork(leader, m)
            m.num_computed_tokens = leader.num_computed_tokens
            m.num_cached_tokens = leader.num_cached_tokens
            if m.first_scheduled_time is None:
                m.first_scheduled_time = now
            self.waiting.remove(m)
            m.status = RequestStatus.RUNNING
            self.running.append(m)
        group.forked = True

    def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
        kv = self.kv_cache_manager
        victim.num_preemptions += 1
        self._num_preemptions += 1
        if self.num_cpu_blocks > 0 and kv.can_swap_out(victim):
            out.blocks_to_swap_out.extend(kv.swap_out(victim))
            victim.status = RequestStatus.SWAPPED
            self.swapped.append(victim)
        else:
            kv.free(victim)
            victim.num_computed_tokens = 0
            drop_layer_chunk(victim, self._dropped)
            victim.status = RequestStatus.PREEMPTED
            self._enqueue(victim, front=True)
        out.preempted.append(victim)

    def _schedule_one(self, out: SchedulerOutput, req: Request, num_new: int, spec: list[int] | None = None,
                      layers: tuple[int, int] | None = None) -> None:
        n = req.num_computed_tokens
        spec = spec or []
        out.scheduled.append(ScheduledRequest(
            request=req, num_computed_tokens=n, num_new_tokens=num_new,
            block_ids=self.kv_cache_manager.get_block_ids(req.request_id),
            sample=n + num_new - len(spec) == req.num_tokens and req.pooling_params is None,
            spec_token_ids=spec, layers=layers))
        out.num_batched_tokens += num_new
        self._allowance.spend(req.pooling_params is not None, n, num_new, layers)

    def _admit_waiting(self, out: SchedulerOutput, budget: int, seats: int, now: float) -> None:
        """Phase 3 of :meth:`schedule`: admit waiting requests in order (a
        prefix-cache hit counts as computed) while the token budget and the
        ``max_num_seqs`` seats last; a leader whose prompt is cached up to its
        fork point forks at once."""
        kv = self.kv_cache_manager
        for req in self._sort_waiting():
            if budget <= 0 or seats >= self.max_num_seqs:
                break
            if req.status == RequestStatus.RUNNING:
                continue  # a sibling that joined at a fork in this loop
            if self._unforked(req) and self._leader(req) is not req:
                continue  # a sibling: joins at the fork
            need_seats = self._seats_needed(req)
            if seats + need_seats > self.max_num_seqs:
                break
            computed_blocks, num_hit = kv.get_computed_blocks(req)
            num_new, layers = self._chunk(req, num_hit, budget)
            fork_now = self._unforked(req) and num_hit == self._target_len(req)
            if num_new <= 0 and not fork_now:
                if req.pooling_params is not None:
                    continue   # the step's allowance for pooling chunks is spent: the requests behind go on
                break
            if not kv.allocate_slots(req, num_new, computed_blocks):
                break
            self.waiting.remove(req)
            req.num_computed_tokens = num_hit
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            seats += need_seats
            if req.num_cached_tokens < 0:  # first scheduling
                req.num_cached_tokens = num_hit
                if self.enable_prefix_caching:
                    kv.record_prefix_cache_stats(req.num_tokens, num_hit)
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
            if fork_now:
                # The leader holds exactly prompt_len - 1 tokens (all cached, or none for a 1-token prompt):
                # fork now; every member computes its last prompt token from next step.
                self._fork(req)
                continue
            self._schedule_one(out, req, num_new, layers=layers)
            budget -= num_new

    # -- the step -----------------------------------------------------------
    def schedule(self, max_steps: int = 1, qualifies: Callable[[Request], bool] | None = None) -> SchedulerOutput:
        """Choose this step's batch. Does NOT advance ``num_computed_tokens``
        by the scheduled tokens (``update_from_output`` does); a request
        admitted with a prefix-cache hit gets ``num_computed_tokens`` = the hit.
        With ``max_steps`` > 1 and nothing waiting or swapped out, a batch of
        decodes of requests ``qualifies`` accepts may run several steps
        (``multi_step.lookahead_steps``: ``out.num_steps``).

        The output may schedule nothing while requests are unfinished (e.g.
        only swap-outs, or a leader admitted exactly at its fork point); the
        caller still applies the block operations and calls
        ``update_from_output``.
        """
        kv = self.kv_cache_manager
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        now = time.monotonic()
        self._allowance = StepAllowance(self.pooling_budget, any(
            r.pooling_params is None for r in self.requests.values()))
        out.finished_req_ids, self._dropped = self._dropped, set()

        # 1. Running requests (most important first; victims from the end): fcfs keeps them as seated (vLLM v1).
        if self.scheduling_policy == "priority":
            self.running.sort(key=self._key)
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new, layers = self._chunk(req, req.num_computed_tokens, budget)
            if num_new <= 0:
                i += 1
                continue
            spec = spec_tokens(req, num_new, budget, self.max_model_len)
            if spec and kv.allocate_slots(req, num_new + len(spec)):
                self._schedule_one(out, req, num_new + len(spec), spec)
                budget -= num_new + len(spec)
                i += 1
                continue
            while not kv.allocate_slots(req, num_new):
                victim = self.running.pop()
                self._preempt(victim, out)
                if victim is req:
                    break
            else:
                self._schedule_one(out, req, num_new, layers=layers)
                budget -= num_new
                i += 1

        preempted = bool(out.preempted)
        seats = sum(self._seats_needed(r) for r in self.running)

        # 2. Swap in (not in a step that preempted).
        if not preempted:
            self.swapped.sort(key=self._key)   # as seat_order gives them
            while self.swapped and budget > 0:
                req = self.swapped[0]
                if seats + self._seats_needed(req) > self.max_num_seqs:
                    break
                num_new, layers = self._chunk(req, req.num_computed_tokens, budget)
                if num_new <= 0 or not kv.can_swap_in(req, num_new):
                    break
                out.blocks_to_swap_in.extend(kv.swap_in(req))
                if not kv.allocate_slots(req, num_new):  # checked by can_swap_in
                    raise RuntimeError(f"{req.request_id}: allocation failed after swap-in")
                self.swapped.pop(0)
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                seats += self._seats_needed(req)
                self._schedule_one(out, req, num_new, layers=layers)
                budget -= num_new

        # 3. Admit waiting requests (not while preempting or swapped out).
        if not preempted and not self.swapped:
            self._admit_waiting(out, budget, seats, now)
        if qualifies is not None and not self.waiting and not self.swapped:
            out.num_steps = lookahead_steps(out, kv, max_steps, self.max_model_len, qualifies)
        out.blocks_to_copy = kv.take_blocks_to_copy()
        return out

    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, int | list[int]],
                           not_stops: set[str] | frozenset[str] = frozenset()) -> list[Request]:
        """Apply a step's results.

        Advances ``num_computed_tokens`` of every scheduled (still unfinished) request by its
        ``num_new_tokens`` (and ``out.num_steps`` - 1) less its rejected proposals (their keys and values stay in
        its blocks past ``num_computed_tokens``, to be overwritten), appends ``sampled[request_id]`` for entries
        with ``sample=True`` one token at a time and finishes requests on EOS (unless ``ignore_eos``), a stop
        token id (neither before ``min_tokens`` outputs), ``max_tokens`` or ``max_model_len`` (tokens after the
        one that finished it are dropped), offers newly full blocks to the prefix cache, forks a group whose
        leader reached its fork point, and finishes a pooling request whose prompt is computed (it samples
        nothing); finished requests' blocks are freed.

        Args:
            out: the ``schedule()`` result this step ran.
            sampled: request_id -> sampled token id, or the tokens kept after verifying its proposals
                (accepted proposals, then one sampled token) or of its ``out.num_steps`` steps, for entries
                with sample=True.
            not_stops: requests whose sampled token, though one of their stop token ids, is content of their
                grammar (it could go on no other way: ``StructuredOutputManager.is_content``).

        Returns:
            The requests finished by this call (status and stop_reason set).

        Raises:
            KeyError: a sampled token is missing for an entry with sample=True.
        """
        kv = self.kv_cache_manager
        finished = []
        now = time.monotonic()
        for sr in out.scheduled:
            req = sr.request
            if req.is_finished or req.status != RequestStatus.RUNNING:
                continue  # aborted after schedule()
            assert req.num_computed_tokens == sr.num_computed_tokens, req.request_id
            if sr.layers is not None and layer_pass_midway(req, sr, self.pooling_budget.num_layers):
                continue   # a chunk through part of the layers: computed after its last one
            tokens: list[int] = []
            if sr.sample:
                if req.request_id not in sampled:
                    raise KeyError(f"no sampled token for request {req.request_id!r}")
                got = sampled[req.request_id]
                tokens = [got] if isinstance(got, int) else list(got)
            rejected = len(sr.spec_token_ids) + 1 - len(tokens) if sr.spec_token_ids else 0
            req.num_computed_tokens += sr.num_new_tokens - rejected + out.num_steps - 1
            status = reason = None
            for token in tokens:
                req.append_output_token_ids(token)
                status, reason = check_stop(req, token, self.max_model_len, req.request_id in not_stops)
                if status is not None:
                    break
            # a stop among accepted proposals: what follows it is not the request's
            req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens)
            kv.cache_full_blocks(req)
            if self._unforked(req) and req.num_computed_tokens == self._target_len(req):
                self._fork(req)
            if req.pooling_params is not None and req.num_computed_tokens == req.num_tokens:
                self._finish(req, RequestStatus.FINISHED_STOPPED, None)   # pooled: its last chunk ran
                finished.append(req)
                continue
            if not tokens:
                continue
            if req.first_token_time is None:
                req.first_token_time = now
            req.last_token_time = now
            if status is not None:
                self._finish(req, status, reason)
                finished.append(req)
        return finished

    # -- checks -------------------------------------------------------------
    def check_invariants(self) -> None:
        """Assert queue/block consistency (tests).

        Raises:
            AssertionError: an invariant does not hold.
        """
        kv = self.kv_cache_manager
        kv.check_invariants()
        queued = self.waiting + self.running + self.swapped
        assert len(queued) == len({id(r) for r in queued}) == len(self.requests), "request in two queues"
        assert sum(self._seats_needed(r) for r in self.running) <= self.max_num_seqs
        for r in self.running:
            assert r.status == RequestStatus.RUNNING
            assert kv.get_num_blocks(r.request_id) >= cdiv(r.num_computed_tokens, self.block_size)
        for r in self.swapped:
            assert r.status == RequestStatus.SWAPPED and r.request_id in kv.req_to_cpu_blocks
        for r in self.waiting:
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert r.request_id not in kv.req_to_cpu_blocks
            assert kv.get_num_blocks(r.request_id) == 0 and r.num_computed_tokens == 0, r.request_id
        held = set(kv.req_to_blocks) | set(kv.req_to_cpu_blocks) | set(kv.req_to_block_hashes)
        assert held <= set(self.requests), f"blocks held by finished requests: {held - set(self.requests)}"
