"""A request's time to first token (TTFT), predicted from the engine's real state at admission.

The core publishes, after every step, a ``TTFTState`` with its stats (``EngineStats.ttft``): its queue, request by
request (the running ones in the order a step serves them, the waiting ones in the order they get seats), the
KV blocks free, and the step costs it measured (``TTFTCalibration``: a least-squares fit of each step's seconds on
its shape, times the box's recent speed). It also publishes which prompt blocks entered or left its prefix cache
(as vLLM's KV cache events do for llm-d's prefix-aware router); ``PrefixMirror`` replays them in the front end, so
a prompt's cached prefix is looked up there without a round trip to the core's process and with no scrape lag (at
most one step old). ``predict_ttft`` is a pure function of the state and the request: it replays the scheduler's
coming steps (``engine/core/ttft_sim.py``) until the request's first token, each at the cost of its shape.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import msgspec

from engine.core.kv_cache_manager import block_extra_keys, hash_block_tokens
from engine.core.request import RequestStatus
from engine.core.step_cost import attention_pairs
from engine.core.ttft_calibration import CALIBRATION_TAU_S, TTFTCalibration, prefill_seconds
from engine.core.ttft_sim import DECODING, POOLING, PREFILL, simulate_ttft


class TTFTState(msgspec.Struct, array_like=True):
    """The core's state that a TTFT prediction needs (one per step, in ``EngineStats.ttft``).

    Attributes:
        block_size: tokens per KV block.
        budget: token budget of one step (``max_num_batched_tokens``).
        max_num_seqs: seats of the running set.
        num_running: sequences running. decode_rows: running sequences past their prefill (1 token a step).
        queued_prefill: [priority, prompt tokens not yet computed, requests] per priority class of the waiting
            requests.
        running_prefill: prompt tokens not yet computed of running requests (any priority: a step serves the
            running set first).
        fcfs: the scheduler ignores priorities (a new request is seated after every queued request of rank 0).
        free_blocks: device blocks free or evictable.
        typical_decode: the mean ``max_tokens`` of the running sequences (how many steps a request's decode
            shares with the prefill queued: ``predict_tpot``).
        step_s: measured seconds of a step of one decode row (``TTFTCalibration``).
            prefill_tok_s: measured prefill tokens per second. fixed_s, row_s: a step's measured fixed cost and
            cost per decode row, seconds (a step of n rows costs ``fixed_s + n * row_s``: TPOT at a batch size).
            quad_s: measured seconds per attention pair of a step's rows (``quad_of``: prefill chunks' and decode
            rows'): what a step costs beyond its tokens / ``prefill_tok_s`` and its rows (attention, and caches a
            long context overflows).
            chunk_s: measured seconds per prefill chunk (a request's prefill in one step), beyond its tokens' costs.
        running_prefill_reqs: running requests with prompt tokens left to compute.
        added: requests the core has taken from its queue of commands so far (accepted or refused; an embedding
            call counts once): a front end counts what it sent beyond that as queued too (``PendingAdds``).
        stored, removed: block hashes that entered / left the prefix cache since the last state.
        resync: every cached block hash (the events were not drained in time; replaces the mirror), or None.
        running_seqs: (computed tokens, tokens to its next sample or, pooling, to its end, tokens left to
            generate, kind: ``ttft_sim.PREFILL`` / ``DECODING`` / ``POOLING``) of each running request, in the order
            a step serves them.
        waiting_seqs: (priority, rank, tokens computed or in the prefix cache for it, tokens to its next sample,
            tokens left to generate, kind) of the first waiting (and swapped) requests, in the order they get seats;
            rank: a waiting embedding input's ``Request.input_index`` (a new request of its priority is seated
            before it: ``Scheduler.seat_order``), else 0.
        pending_seqs: as ``waiting_seqs``, requests a front end sent that the core's state does not count yet
            (``PendingAdds.with_pending``; the core publishes none).
        chunked: the scheduler splits a prompt across steps (``enable_chunked_prefill``).
        speed: the box's recent speed the costs include (``TTFTCalibration.speed``: the last seconds' steps
            measured over what the fitted shape says of them; > 1: slower than the steps the shape was fitted on).
        pooling_budget: (pairs per token-equivalent, token-equivalents a step's pooling chunks may cost beside
            generation work, and without) of the scheduler's ``PoolingBudget`` (``engine/core/step_cost.py``), or
            None: pooling chunks get the token budget alone.
    """

    block_size: int
    budget: int
    max_num_seqs: int
    num_running: int
    decode_rows: int
    queued_prefill: list[tuple[int, int, int]]
    running_prefill: int
    fcfs: bool
    free_blocks: int
    typical_decode: float
    step_s: float
    prefill_tok_s: float
    added: int = 0
    stored: list[bytes] = []
    removed: list[bytes] = []
    resync: list[bytes] | None = None
    fixed_s: float = 0.0
    row_s: float = 0.0
    quad_s: float = 0.0
    chunk_s: float = 0.0
    running_prefill_reqs: int = 0
    running_seqs: list[tuple[int, int, int, int]] = []
    waiting_seqs: list[tuple[int, int, int, int, int, int]] = []
    pending_seqs: list[tuple[int, int, int, int, int, int]] = []
    chunked: bool = True
    speed: float = 1.0
    pooling_budget: tuple[float, float, float] | None = None

    def prefill_s(self, tokens: float, quad: float = 0.0, chunks: float = 0.0) -> float:
        """Seconds the steps spend on ``tokens`` prefill tokens in ``chunks`` chunks of ``quad_of`` ``quad``,
        beyond their decode (``prefill_seconds`` at the calibration's costs)."""
        return prefill_seconds(self, tokens, quad, chunks)

    def decode_step_s(self, rows: float) -> float:
        """Seconds of a decode step of ``rows`` rows (``fixed_s + rows x row_s``; ``step_s`` before any fit)."""
        return self.fixed_s + self.row_s * rows if self.fixed_s or self.row_s else self.step_s

    def step_cost(self, rows: float, tokens: float, quad: float, chunks: float) -> float:
        """Seconds of a step of ``rows`` decode rows and ``tokens`` prefill tokens in ``chunks`` chunks, its rows'
        attention pairs ``quad`` (``quad_of``) (``TTFTCalibration.cost`` as published)."""
        return self.decode_step_s(rows) + self.prefill_s(tokens, quad, chunks)

    def queued(self) -> tuple[int, int]:
        """(prompt tokens not yet computed, the requests they belong to): the running set's and every waiting
        class's."""
        return (self.running_prefill + sum(c[1] for c in self.queued_prefill),
                self.running_prefill_reqs + sum(c[2] for c in self.queued_prefill))


@dataclass
class TTFTPrediction:
    """A predicted TTFT (``seconds``) and the numbers it came from (``parts``), for explanations."""

    seconds: float
    parts: dict = field(default_factory=dict)

    def describe(self) -> str:
        """One line: the prediction and its inputs."""
        p = self.parts
        waits = "".join(f", waits {p[k]:.2f} s for {k[5:]}" for k in ("wait_seat", "wait_kv") if p.get(k))
        now = f"{p['current']:.2f} s left of the running step + " if p.get("current") else ""
        tpot = f"; TPOT {p['tpot_s'] * 1000:.0f} ms" if p.get("tpot_s") else ""
        waits += f", {p['arriving']} tokens arriving meanwhile" if p.get("arriving") else ""
        return (f"{self.seconds:.2f} s ({now}{p.get('ahead', 0)} prefill tokens ahead + "
                f"{p.get('uncached', 0)} uncached of {p.get('prompt', 0)}: {p.get('steps', 0)} steps simulated, "
                f"{p.get('chunks', 0)} prefill chunks; a step {p.get('fixed_s', 0) * 1000:.0f} ms + "
                f"{p.get('row_s', 0) * 1000:.1f} ms a row + {p.get('prefill_tok_s', 0):.0f} tok/s + "
                f"{p.get('chunk_s', 0) * 1000:.1f} ms a chunk + {p.get('quad_s', 0) * 1e9:.1f} ns an attention "
                f"pair (speed {p.get('speed', 1.0):.2f}){waits}{tpot})")


def predict_ttft(state: TTFTState, prompt_tokens: int, cached_tokens: int, priority: int = 0,
                 elapsed_s: float | None = None, arrival_tok_s: float = 0.0) -> TTFTPrediction:
    """Predicted seconds from admission to the first token of a request of ``prompt_tokens`` tokens, of which
    ``cached_tokens`` are in the prefix cache, at ``priority`` (smaller = more urgent), given ``state``: the
    scheduler's coming steps simulated (``simulate_ttft``) at the calibration's costs.

    ``elapsed_s``: seconds since ``state`` was published, while a busy core runs its next step (planned without
    this request, which joins the step after): that step is simulated whole and ``elapsed_s`` of it has passed.
    None: no step is running (the request joins the next one, as in a scripted engine between steps). Without
    it, a request arriving late in a long prefill step was predicted that whole step again (0.3 s measured after
    1.2 s predicted in the spill run), and one arriving during a decode step was predicted to share it.

    ``arrival_tok_s``: uncached prompt tokens arriving per second lately (``PendingAdds.arrival_tok_s``). The
    steps up to this request's first token may have room beyond the prefill queued now (its own last chunk); the
    scheduler fills it with requests that arrive meanwhile, and a fuller step takes longer. Without it, on an SLO
    route whose engine gets a request every second or so, a request arriving at an idle engine was predicted its
    own chunks alone and measured 2-3x that (a 650-token prompt: 1.6 s predicted, 4.4 s measured with requests
    arriving 1 s apart)."""
    sim = simulate_ttft(state, state.step_cost, prompt_tokens, cached_tokens, priority, elapsed_s, arrival_tok_s)
    return TTFTPrediction(sim.seconds, {
        "prompt": prompt_tokens, "uncached": max(prompt_tokens - cached_tokens, 1), **sim.parts,
        "fixed_s": state.fixed_s, "row_s": state.row_s, "prefill_tok_s": state.prefill_tok_s,
        "quad_s": state.quad_s, "chunk_s": state.chunk_s, "speed": state.speed, "tpot_s": predict_tpot(state)})


def predict_tpot(state: TTFTState) -> float:
    """Predicted seconds per output token (TPOT) of a request added now, once it decodes: a step of the batch
    it will decode in (the running set, the queued requests and itself, at most ``max_num_seqs`` rows: the
    queue takes every seat that frees) at the measured cost per row, plus the queued prefill that the steps of
    its decode also compute (spread over ``typical_decode`` steps, at most the budget left by the decode rows),
    its chunks included, and each row's attention over its context (the running rows' mean context)."""
    rows = min(state.num_running + sum(c[2] for c in state.queued_prefill) + 1, state.max_num_seqs)
    steps = max(state.typical_decode, 1.0)
    queued, n_prefill = state.queued()
    interleaved = min(queued, steps * max(state.budget - rows, 0)) / steps
    chunks = interleaved / (queued / n_prefill) if n_prefill and queued else 0.0   # chunks of the queue's mean length
    context = sum(s[0] for s in state.running_seqs) / len(state.running_seqs) if state.running_seqs else 0.0
    return state.decode_step_s(rows) + state.prefill_s(interleaved, rows * (context + 1), chunks)


def quad_of(rows) -> float:
    """Attention (query, key) pairs of a step's ``rows`` ((context tokens, new tokens) each: prefill chunks and
    decode rows alike), ``step_cost.attention_pairs`` summed: the work a step does beyond its tokens' own, which
    grows with each row's context (measured on this project's CPU engine, a 475-token prompt cost 2-6x per token
    what 83- and 227-token ones did; a decode row 6,000 tokens deep attends over ten token-equivalents of pairs
    each step, SmolLM2 on CPU)."""
    return float(sum(attention_pairs(n, ctx) for ctx, n in rows))


def cached_prefix_tokens(token_ids: list[int], block_size: int, is_cached, cache_salt: str | None = None) -> int:
    """Tokens of ``token_ids`` the prefix cache would serve: full blocks whose hash chain ``is_cached(hash)``
    holds, at most ``(len - 1) // block_size`` blocks (the last token is always computed), as
    ``KVCacheManager.get_computed_blocks`` finds them for a request salted ``cache_salt``."""
    parent = None
    hit = 0
    for i in range((len(token_ids) - 1) // block_size):
        parent = hash_block_tokens(parent, token_ids[i * block_size:(i + 1) * block_size],
                                   block_extra_keys(i, cache_salt))
        if not is_cached(parent):
            break
        hit += 1
    return hit * block_size


class PendingAdds:
    """Requests a front end sent to the core that its last state does not count yet (in the pipe, or sent
    after that step): without them a burst of arrivals would each see the same short queue."""

    def __init__(self) -> None:
        self.sent = 0
        # (send index, [(priority, rank, cached tokens, uncached tokens, max_tokens, kind), ...]): a send's requests
        self._queue: list[tuple[int, list[tuple[int, int, int, int, int, int]]]] = []
        self._tokens = 0.0                  # uncached tokens sent, each weighted by exp(-age / CALIBRATION_TAU_S)
        self._at: float | None = None       # when the last was sent (monotonic seconds)

    def note_sent(self, priority: int, uncached_tokens: int, now: float | None = None, cached_tokens: int = 0,
                  max_tokens: int = 16, pooling: bool = False) -> None:
        """One request sent to the core (call in send order) at ``now`` (monotonic seconds; None: not timed),
        ``max_tokens`` to generate, or an embedding (``pooling``)."""
        self.note_sent_many([(priority, 0, cached_tokens, uncached_tokens, 0 if pooling else max_tokens,
                              POOLING if pooling else PREFILL)], now)

    def note_sent_many(self, seqs: list[tuple[int, int, int, int, int, int]], now: float | None = None) -> None:
        """One command sent to the core with several requests (an embedding call's inputs): (priority, rank,
        cached tokens, uncached tokens, max_tokens, kind) each, as ``TTFTState.waiting_seqs``."""
        self.sent += 1
        self._queue.append((self.sent, seqs))
        if now is not None:
            self._tokens = self.arrival_tok_s(now) * CALIBRATION_TAU_S + sum(s[3] for s in seqs)
            self._at = now

    def arrival_tok_s(self, now: float) -> float:
        """Uncached prompt tokens sent per second lately (exponentially weighted over ``CALIBRATION_TAU_S``)."""
        if self._at is None:
            return 0.0
        return self._tokens * math.exp(-max(now - self._at, 0.0) / CALIBRATION_TAU_S) / CALIBRATION_TAU_S

    def seen(self, added: int) -> None:
        """The core's state counts its first ``added`` requests: forget those."""
        if self._queue and self._queue[0][0] <= added:
            self._queue = [p for p in self._queue if p[0] > added]

    def with_pending(self, state: TTFTState) -> TTFTState:
        """``state`` with the requests not yet counted queued: in its priority classes and as ``pending_seqs``."""
        seqs = [s for i, sent in self._queue if i > state.added for s in sent]
        if not seqs:
            return state
        classes = {p: [t, n] for p, t, n in state.queued_prefill}
        for priority, _, _, tokens, _, _ in seqs:
            c = classes.setdefault(priority, [0, 0])
            c[0] += tokens
            c[1] += 1
        return msgspec.structs.replace(state, queued_prefill=sorted((p, t, n) for p, (t, n) in classes.items()),
                                       pending_seqs=seqs)


class PrefixMirror:
    """The set of block hashes in the core's prefix cache, kept from the states' events (front end side)."""

    def __init__(self) -> None:
        self.hashes: set[bytes] = set()

    def apply(self, state: TTFTState) -> None:
        """Replay one state's events (a ``resync`` replaces the set first)."""
        if state.resync is not None:
            self.hashes = set(state.resync)
        self.hashes.difference_update(state.removed)
        self.hashes.update(state.stored)

    def cached_tokens(self, token_ids: list[int], block_size: int, cache_salt: str | None = None) -> int:
        """Tokens of ``token_ids`` the core's prefix cache holds for a request salted ``cache_salt``
        (``cached_prefix_tokens``)."""
        return cached_prefix_tokens(token_ids, block_size, self.hashes.__contains__, cache_salt)


def drain_kv_events(pool) -> tuple[list[bytes], list[bytes], list[bytes] | None]:
    """(stored, removed, resync) from ``pool.kv_events`` (a ``BlockPool``), emptied: each hash's last event wins,
    so replaying removed then stored is exact. Events dropped undrained (``pool.kv_events_lost``): a resync of
    the whole cache instead."""
    events = pool.kv_events
    if events is None:
        return [], [], None
    if pool.kv_events_lost:
        events.clear()
        pool.kv_events_lost = False
        return [], [], list(pool.cached_block_hash_to_block)
    last = dict(events)
    events.clear()
    return [h for h, c in last.items() if c], [h for h, c in last.items() if not c], None


def _to_compute(kv, req, ahead: set) -> int:
    """Prompt tokens ``req`` (waiting or swapped) still has to compute: a waiting request that holds no blocks
    yet less the prefix its admission will find cached: blocks in the cache now (``get_computed_blocks``: dict
    look-ups of hashes kept per request) or computed by then by a request ahead of it (``ahead``: their block
    hashes; ``req``'s are added). Counting a queued follow-up turn's whole conversation as prefill made a deep
    queue of multi-turn requests look about twice as long as it was (its earlier turn, queued ahead, computes
    and caches the shared prefix)."""
    todo = max(req.num_prompt_tokens - req.num_computed_tokens, 0)
    if req.num_computed_tokens == 0 and todo and req.request_id not in kv.req_to_blocks:
        _, hit = kv.get_computed_blocks(req)
        hashes = kv.req_to_block_hashes.get(req.request_id, ())
        n = hit // kv.block_size
        while n < len(hashes) and hashes[n] in ahead:
            n += 1
        ahead.update(hashes)
        todo -= min(n * kv.block_size, todo - 1)
    return todo


def state_of(scheduler, calibration: TTFTCalibration, added: int = 0) -> TTFTState:
    """The ``TTFTState`` of ``scheduler`` (an ``engine.core.scheduler.Scheduler``) now, with ``calibration``'s step
    costs, ``added`` requests taken so far and the prefix cache's events since the last call."""
    state, _ = _queue_state(scheduler, calibration, scheduler.seat_order(), added,
                            drain_kv_events(scheduler.kv_cache_manager.block_pool))
    return state


def predict_waiting(scheduler, calibration: TTFTCalibration, request_id: str,
                    arrival_tok_s: float = 0.0) -> TTFTPrediction | None:
    """Predicted seconds from now (between two steps) to the first token of ``request_id``, a request still
    waiting in ``scheduler`` with nothing computed: ``predict_ttft`` of it as if it arrived now behind only the
    requests the scheduler seats before it (``Scheduler.seat_order``) and the running set, its prompt less the
    prefix the cache holds or those requests will have computed. None when it is not waiting so (running, swapped, computed
    in part, finished or unknown). ``arrival_tok_s``: uncached prompt tokens arriving per second lately (they
    queue behind it, and fill the room its last step leaves). Re-predicted late in its wait, less is left to
    predict than at admission (``gateway/backends/local.py``'s hand-over asks it)."""
    req = scheduler.requests.get(request_id)
    if req is None or req.num_computed_tokens or req not in scheduler.waiting:
        return None
    order = scheduler.seat_order()
    ahead_reqs = order[:order.index(req)]
    state, ahead = _queue_state(scheduler, calibration, ahead_reqs, all_ahead=True)
    todo = _to_compute(scheduler.kv_cache_manager, req, ahead)
    return predict_ttft(state, req.num_prompt_tokens, req.num_prompt_tokens - todo, req.priority,
                        arrival_tok_s=arrival_tok_s)


def _queue_state(scheduler, calibration: TTFTCalibration, queue: list, added: int = 0,
                 events: tuple | None = None, all_ahead: bool = False) -> tuple[TTFTState, set]:
    """The ``TTFTState`` of ``scheduler``'s running set with ``queue`` (waiting and swapped requests, in the
    order they get seats, which is the order their cached prefixes are counted in) as its waiting requests,
    ``events`` the prefix cache's (stored, removed, resync; None: none) and ``all_ahead`` whether every queued
    request counts as ahead of a new one (``predict_waiting``'s queue: ranks 0, fcfs). Also the block hashes the
    running set and ``queue`` have or will have cached (``_to_compute``'s ``ahead``)."""
    kv = scheduler.kv_cache_manager
    stored, removed, resync = events if events is not None else ([], [], None)   # new lists per call
    queued: dict[int, list[int]] = {}
    ahead: set = set()   # block hashes the running set and the requests seated before have or will cache
    for r in scheduler.running:
        ahead.update(kv.req_to_block_hashes.get(r.request_id, ()))
    todo_of: dict[str, int] = {}
    for req in queue:
        c = queued.setdefault(req.priority, [0, 0])
        todo_of[req.request_id] = todo = _to_compute(kv, req, ahead)
        c[0] += todo
        c[1] += 1
    running_prefill = running_prefill_reqs = 0
    for r in scheduler.running:
        todo = max(r.num_prompt_tokens - r.num_computed_tokens, 0)
        running_prefill += todo
        running_prefill_reqs += todo > 0
    decoding = [r for r in scheduler.running if r.num_computed_tokens >= r.num_prompt_tokens]
    waiting_seqs = []
    for r in queue:   # computed (swapped) or cached for it; to its next sample (a preempted one's outputs too)
        ctx = max(r.num_computed_tokens, r.num_prompt_tokens - todo_of[r.request_id])
        rank = 0 if all_ahead or r.status == RequestStatus.SWAPPED else r.input_index
        waiting_seqs.append((r.priority, rank, ctx, *_seq(r, ctx)))
    return TTFTState(
        block_size=scheduler.block_size, budget=scheduler.max_num_batched_tokens,
        max_num_seqs=scheduler.max_num_seqs, num_running=len(scheduler.running), decode_rows=len(decoding),
        queued_prefill=sorted((p, t, n) for p, (t, n) in queued.items()), running_prefill=running_prefill,
        fcfs=all_ahead or scheduler.scheduling_policy == "fcfs",
        free_blocks=kv.num_free_blocks,
        typical_decode=sum(r.max_tokens for r in scheduler.running) / max(len(scheduler.running), 1),
        step_s=calibration.cost(len(decoding)), prefill_tok_s=calibration.prefill_tok_s, added=added,
        stored=stored, removed=removed, resync=resync, fixed_s=calibration.fixed_s, row_s=calibration.row_s,
        quad_s=calibration.quad_s, chunk_s=calibration.chunk_s, running_prefill_reqs=running_prefill_reqs,
        running_seqs=[(r.num_computed_tokens, *_seq(r, r.num_computed_tokens)) for r in scheduler.running],
        waiting_seqs=waiting_seqs, chunked=scheduler.enable_chunked_prefill, speed=calibration.speed,
        pooling_budget=_budget_of(scheduler.pooling_budget)), ahead


def _budget_of(budget) -> tuple[float, float, float] | None:
    """A ``PoolingBudget`` as ``TTFTState.pooling_budget`` publishes it."""
    return None if budget is None else (budget.pairs_per_token, budget.step_cost, budget.alone_cost)


def _seq(req, ctx: int) -> tuple[int, int, int]:
    """(tokens to its next sample or, pooling, to its end, tokens left to generate, kind) of ``req`` with ``ctx``
    tokens computed (``TTFTState.running_seqs``)."""
    kind = POOLING if req.pooling_params is not None else DECODING if ctx >= req.num_prompt_tokens else PREFILL
    return max(req.num_tokens - ctx, 1), req.max_tokens - req.num_output_tokens, kind
