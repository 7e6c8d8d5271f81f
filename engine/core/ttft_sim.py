"""A request's time to first token by simulating the scheduler's coming steps (``simulate_ttft``).

From the core's published queue (``TTFTState``: the running requests in the order a step serves them, the waiting
ones in the order they get seats, each as computed tokens, tokens to its next sample, tokens left to generate and
its kind), the requests a front end sent since (``PendingAdds``) and the new request, the steps are replayed as
``engine/core/scheduler.py`` takes them: each step serves the running requests first, a decode row each and a
prefill or pooling chunk as ``chunk_tokens`` (the scheduler's own rule) allows under the token budget (and, for a
pooling chunk beside generation work, the step's ``StepAllowance``: ``engine/core/step_cost.py``), preempting
the last running request when the KV blocks run out; then admits waiting requests in order while budget, seats
(``max_num_seqs``) and blocks last. A request finishes after its last token (a pooling one after its last chunk),
freeing its seat and blocks. Each step costs what the calibration says of its shape (``TTFTCalibration.cost``:
decode rows, prefill tokens, its rows' attention pairs (``quad_of``: a decode row's too), chunks), so a chunk
deep in a long prompt costs its attention over that context, and so does a decode row deep in its conversation. The new request's TTFT is the end of the step that samples
its first token.

Decode lengths are taken at ``max_tokens`` (a request that meets its end of sequence earlier frees its seat
sooner: the simulation is late there, never early). Stretches where nothing but decoding can happen (every seat
taken by decoding requests) are jumped whole: the simulation's cost grows with the queue's events, not its steps.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.core.chunking import chunk_tokens
from engine.core.step_cost import PoolingBudget, StepAllowance, attention_pairs

# The kinds of a published sequence (``TTFTState.running_seqs`` / ``waiting_seqs``)
PREFILL, DECODING, POOLING = 0, 1, 2
MAX_STEPS = 20_000   # a simulation that has not reached the first token by then answers the time so far


@dataclass
class _Seq:
    """One request in the simulation: ``ctx`` tokens computed, ``need`` to its next sample (or its end, pooling),
    ``left`` tokens still to generate, its ``kind``, the KV blocks it ``held``; ``target``: the new request."""

    ctx: int
    need: int
    left: int
    kind: int
    held: int = 0
    target: bool = False


@dataclass
class SimResult:
    """``seconds`` to the target's first token from now; ``parts``: steps simulated (``steps``), seconds left of
    the step running now (``current``), seconds waiting for a seat (``wait_seat``) or for KV blocks
    (``wait_kv``), prefill tokens ahead of it (``ahead``), tokens arriving meanwhile that shared its steps
    (``arriving``), prefill chunks computed (``chunks``)."""

    seconds: float
    parts: dict


def attention_pairs_f(tokens: float, context: float) -> float:
    """``attention_pairs`` of a fractional chunk (the tokens arriving meanwhile: a rate times seconds)."""
    return tokens * context + tokens * (tokens + 1) / 2


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class _Sim:
    """The scheduler's queues and the KV blocks free, stepped on a simulated clock (``simulate_ttft``)."""

    def __init__(self, state, cost) -> None:
        self.s, self.cost = state, cost
        self.bs = state.block_size
        self.running = [_Seq(c, n, left, kind, _cdiv(c, state.block_size)) for c, n, left, kind in state.running_seqs]
        self.waiting = [_Seq(c, n, left, kind) for _, _, c, n, left, kind in state.waiting_seqs]
        self.free = state.free_blocks
        self.pooling = PoolingBudget(*state.pooling_budget) if state.pooling_budget else None
        self.t = 0.0
        self.steps = self.chunks = 0
        self.done = False   # the target sampled its first token

    def step(self, arrivals: float = 0.0) -> tuple[float, bool, bool, float]:
        """One step: (its seconds, whether the target waited for a seat, or for blocks, and the arriving
        tokens it took: up to ``arrivals`` into what budget the target's admission leaves)."""
        s = self.s
        budget, batch, preempted = s.budget, [], False
        allowance = StepAllowance(self.pooling, any(q.kind != POOLING for q in (*self.running, *self.waiting)))
        i = 0
        while i < len(self.running) and budget > 0:
            q = self.running[i]
            n = self._chunk(q, budget, allowance)
            if n <= 0:
                i += 1
                continue
            grow = _cdiv(q.ctx + n, self.bs) - q.held
            if grow > self.free:
                preempted = True
                if not self._preempt_for(q, grow):
                    break   # it preempted itself, the last running
            self.free -= grow
            q.held += grow
            batch.append((q, n))
            allowance.spend(q.kind == POOLING, q.ctx, n)
            budget -= n
            i += 1
        seat_wait = kv_wait = False
        target_in = not any(q.target for q in self.waiting)
        j = 0
        while not preempted and j < len(self.waiting) and budget > 0:
            q = self.waiting[j]
            if len(self.running) >= s.max_num_seqs:
                seat_wait = True
                break
            n = self._chunk(q, budget, allowance)
            if n <= 0 and q.kind == POOLING:
                j += 1   # the step's allowance for pooling chunks is spent: the requests behind go on
                continue
            blocks = _cdiv(q.ctx + n, self.bs)
            if n <= 0 or blocks > self.free:
                kv_wait = n > 0
                break
            self.waiting.pop(j)
            self.free -= blocks
            q.held = blocks
            self.running.append(q)
            batch.append((q, n))
            allowance.spend(q.kind == POOLING, q.ctx, n)
            budget -= n
            target_in = target_in or q.target
        # Requests arriving after the target queue behind it: they take what budget its admission leaves.
        room = target_in and not self.waiting and len(self.running) < s.max_num_seqs
        arriving = min(budget, arrivals) if room else 0.0
        return self._run(batch, arriving), seat_wait, kv_wait, arriving

    def _chunk(self, q: _Seq, budget: int, allowance: StepAllowance) -> int:
        """Tokens the scheduler gives ``q`` this step under ``budget`` tokens left and the step's ``allowance``."""
        return chunk_tokens(q.need, allowance.limit(q.kind == POOLING, q.ctx, budget), self.s.budget, self.s.chunked)

    def _preempt_for(self, q: _Seq, grow: int) -> bool:
        """Preempt running requests from the end (recompute) until ``grow`` blocks are free for ``q``; False when
        ``q`` itself was preempted."""
        while grow > self.free:
            victim = self.running.pop()
            self.free += victim.held
            victim.need, victim.ctx, victim.held = victim.ctx + victim.need, 0, 0
            victim.kind = POOLING if victim.kind == POOLING else PREFILL
            self.waiting.insert(0, victim)
            if victim is q:
                return False
        return True

    def _run(self, batch: list[tuple[_Seq, int]], arriving: float) -> float:
        """Charge the step its cost and advance its requests; its seconds."""
        rows = tokens = chunks = 0
        quad = attention_pairs_f(arriving, 0.0)
        for q, n in batch:
            quad += attention_pairs(n, q.ctx)
            if q.kind == DECODING:
                rows += 1
            else:
                tokens += n
                chunks += 1
        seconds = self.cost(rows, tokens + arriving, quad, chunks + (arriving > 0))
        self.t += seconds
        self.steps += 1
        self.chunks += chunks
        for q, n in batch:
            q.ctx += n
            q.need -= n
            if q.need > 0:
                continue
            if q.kind == POOLING:
                self._finish(q)
                continue
            if q.target:
                self.done = True
            q.kind, q.need, q.left = DECODING, 1, q.left - 1
            if q.left <= 0:
                self._finish(q)
        return seconds

    def _finish(self, q: _Seq) -> None:
        self.running.remove(q)
        self.free += q.held

    def decode_only(self) -> bool:
        """Nothing but decoding can happen until a running request finishes: every seat is taken by decoding
        requests (and they fit the budget)."""
        return (len(self.running) >= self.s.max_num_seqs and len(self.running) <= self.s.budget
                and all(q.kind == DECODING for q in self.running))

    def jump(self) -> float:
        """Run the decode steps until the first running request finishes, at once; their seconds."""
        k = min(q.left for q in self.running)
        rows = len(self.running)   # each row attends over its context, one key more each step
        pairs = k * sum(q.ctx + 1 for q in self.running) + rows * k * (k - 1) // 2
        seconds = self.cost(rows, 0, pairs / k, 0) * k   # the cost is linear in the pairs: k steps at their mean
        self.t += seconds
        self.steps += k
        for q in list(self.running):
            q.ctx += k
            q.left -= k
            if q.left <= 0:
                self._finish(q)
        return seconds


def simulate_ttft(state, cost, prompt_tokens: int, cached_tokens: int, priority: int = 0,
                  elapsed_s: float | None = None, arrival_tok_s: float = 0.0) -> SimResult:
    """Seconds from now to the first token of a request of ``prompt_tokens`` tokens (``cached_tokens`` of them in
    the prefix cache, at ``priority``) added now to the engine ``state`` describes (a
    ``TTFTState``; its ``pending_seqs`` join with the request). ``cost(rows, tokens, quad, chunks)``: a step's
    seconds (``TTFTState.step_cost``).

    ``elapsed_s``: seconds since ``state`` was published, while a busy core runs its next step (planned from
    ``state`` alone: the request joins the step after); None: no step is running (a scripted engine between
    steps). ``arrival_tok_s``: uncached prompt tokens arriving per second lately: those that arrive before a step
    of the request's starts queue behind it and take the budget its admission leaves (a step's batch is fixed
    when it starts)."""
    sim = _Sim(state, cost)
    current = 0.0
    if elapsed_s is not None and (sim.running or sim.waiting):
        first, _, _, _ = sim.step()
        current = max(first - elapsed_s, 0.0)
        sim.t = max(sim.t, elapsed_s)   # a step that overran its prediction ends now at the earliest
    origin = sim.t - current            # now, on the simulation's clock
    uncached = max(prompt_tokens - cached_tokens, 1)   # the last prompt token is always computed
    target = _Seq(prompt_tokens - uncached, uncached, 1, PREFILL, target=True)   # its decode is past its TTFT
    joining = [_Seq(c, n, left, kind) for _, _, c, n, left, kind in state.pending_seqs]
    queue = sim.waiting + joining
    # Seated as the scheduler would (Scheduler.seat_order): by (priority unless fcfs, rank), stably; the target
    # (rank 0) after every request it does not precede, before an embedding call's later inputs of its priority.
    seats = [(0 if state.fcfs else p, rank) for p, rank, *_ in [*state.waiting_seqs, *state.pending_seqs]]
    order = sorted(range(len(queue)), key=lambda i: (seats[i], i))
    queue = [queue[i] for i in order]
    at = sum(1 for seat in seats if seat <= (0 if state.fcfs else priority, 0))
    sim.waiting = queue[:at] + [target] + queue[at:]
    ahead = sum(q.need for q in sim.running if q.kind != DECODING) + sum(q.need for q in sim.waiting[:at])
    wait_seat = wait_kv = arrived = 0.0
    while not sim.done and sim.steps < MAX_STEPS:
        if sim.decode_only() and target in sim.waiting:
            wait_seat += sim.jump()
            continue
        available = arrival_tok_s * max(sim.t - origin, 0.0) - arrived
        seconds, seat, kv, took = sim.step(available)
        arrived += took
        wait_seat += seconds if seat and target in sim.waiting else 0.0
        wait_kv += seconds if kv and target in sim.waiting else 0.0
    return SimResult(sim.t - origin, {"steps": sim.steps, "current": current, "wait_seat": wait_seat,
                                      "wait_kv": wait_kv, "ahead": ahead, "arriving": round(arrived),
                                      "chunks": sim.chunks})
