"""Scheduler without a model: a fake model runner stores token ids in KV
"slots" (block id, offset), applies swaps and copy-on-write in the documented
order, and checks that every scheduled request reads back exactly its own
tokens. So a wrong block table, a missing copy, a block shared while written
or a lost swap fails these tests the way it would corrupt a real model's
output."""

from __future__ import annotations

import random
from collections import defaultdict

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from engine.core.request import ForkGroup, Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler
from engine.core.scheduler_output import SchedulerOutput

EOS = 1


def make_req(rid, prompt, max_tokens=8, *, eos=EOS, priority=0, arrival=None, **params):
    sp = SamplingParams(max_tokens=max_tokens, **params)
    kw = {} if arrival is None else {"arrival_time": arrival}
    return Request(rid, list(prompt), sp, eos_token_id=eos, max_tokens=max_tokens, priority=priority, **kw)


def make_group(parent, prompt, n, max_tokens=8, *, arrival=None, **params):
    group = ForkGroup(parent_id=parent)
    sp = SamplingParams(n=n, max_tokens=max_tokens, **params)
    arrival = 0.0 if arrival is None else arrival
    for i in range(n):
        group.members.append(Request(f"{parent}-{i}", list(prompt), sp, eos_token_id=EOS, max_tokens=max_tokens,
                                     arrival_time=arrival, parent_id=parent, index=i, group=group))
    return group.members


def sched_(**kw):
    args = dict(block_size=4, num_blocks=64, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256)
    args.update(kw)
    return Scheduler(**args)


class FakeRunner:
    """Stand-in for the model runner: KV "contents" are token ids per slot."""

    def __init__(self, sched: Scheduler):
        self.sched = sched
        bs = sched.block_size
        self.dev = defaultdict(lambda: [None] * bs)
        self.cpu = defaultdict(lambda: [None] * bs)

    def execute(self, out: SchedulerOutput, ahead: dict[str, list[int]] | None = None) -> None:
        """Check and run ``out``; for a step of several decode steps (``out.num_steps``), ``ahead`` holds each
        entry's tokens chosen by all but its last step (the later steps' inputs)."""
        s, bs = self.sched, self.sched.block_size
        pool = s.kv_cache_manager.block_pool
        assert out.num_batched_tokens == sum(sr.num_new_tokens for sr in out.scheduled)
        assert out.num_batched_tokens <= s.max_num_batched_tokens
        assert len(out.scheduled) <= s.max_num_seqs
        assert len({sr.request.request_id for sr in out.scheduled}) == len(out.scheduled)
        for sr in out.scheduled:
            assert sr.num_new_tokens >= 1
            end = sr.num_computed_tokens + sr.num_new_tokens + out.num_steps - 1
            assert len(sr.block_ids) >= -(-end // bs)
            assert sr.sample == (sr.num_computed_tokens + sr.num_new_tokens == sr.request.num_tokens
                                 and sr.request.pooling_params is None)
            # Blocks written this step are private and not in the prefix cache.
            for i in range(sr.num_computed_tokens // bs, (end - 1) // bs + 1):
                block = pool.blocks[sr.block_ids[i]]
                assert block.ref_cnt == 1 and block.block_hash is None, (sr.request.request_id, block)
        for d, c in out.blocks_to_swap_out:
            self.cpu[c] = list(self.dev[d])
        for c, d in out.blocks_to_swap_in:
            self.dev[d] = list(self.cpu[c])
        for src, dst in out.blocks_to_copy:
            self.dev[dst] = list(self.dev[src])
        for sr in out.scheduled:
            toks = sr.request.all_token_ids + (ahead or {}).get(sr.request.request_id, [])
            for p in range(sr.num_computed_tokens, sr.num_computed_tokens + sr.num_new_tokens + out.num_steps - 1):
                self.dev[sr.block_ids[p // bs]][p % bs] = toks[p]
        for sr in out.scheduled:  # attention reads every earlier token (each step's: the last step's, all)
            toks = sr.request.all_token_ids + (ahead or {}).get(sr.request.request_id, [])
            end = sr.num_computed_tokens + sr.num_new_tokens + out.num_steps - 1
            seen = [self.dev[sr.block_ids[p // bs]][p % bs] for p in range(end)]
            assert seen == toks[:end], f"{sr.request.request_id} reads wrong KV"


def default_token(req: Request) -> int:
    return 1000 + req.num_output_tokens  # never EOS


def step(sched, runner, token_fn=default_token):
    out = sched.schedule()
    runner.execute(out)
    sampled = {sr.request.request_id: token_fn(sr.request) for sr in out.scheduled if sr.sample}
    finished = sched.update_from_output(out, sampled)
    sched.check_invariants()
    return out, finished


def run_until_idle(sched, runner, token_fn=default_token, max_steps=5000):
    outs, finished = [], []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return outs, finished
        out, fin = step(sched, runner, token_fn)
        outs.append(out)
        finished += fin
    raise AssertionError("scheduler made no progress (livelock)")


# -- prefix caching ----------------------------------------------------------

def test_shared_48_token_prefix_is_cached():
    s = sched_(block_size=16)
    r = FakeRunner(s)
    prefix = [random.Random(0).randrange(2, 500) for _ in range(48)]
    a = make_req("a", prefix + [7, 8, 9], max_tokens=4)
    s.add_request(a)
    run_until_idle(s, r)
    b = make_req("b", prefix + [3, 4], max_tokens=4)
    s.add_request(b)
    out, _ = step(s, r)
    assert b.num_cached_tokens == 48 and a.num_cached_tokens == 0
    assert out.scheduled[0].num_computed_tokens == 48 and out.scheduled[0].num_new_tokens == 2
    assert s.prefix_cache_hits == 48 and s.prefix_cache_queries == 51 + 50
    run_until_idle(s, r)
    assert b.num_output_tokens == 4


def test_a_queued_follow_up_keeps_its_cached_prefix_while_it_waits():
    """A conversation's follow-up turn queued behind a request that needs most of the free blocks: the LRU free
    queue evicts by when a block was freed (the earlier turn's end, before another request's), so without
    ``refresh_prefix`` the request seated first evicts the turn's cached prefix and the turn recomputes it; with
    it, the other request's blocks (freed later, not needed by anyone queued) go first."""
    s = sched_(num_blocks=17, max_num_seqs=1)   # 16 usable blocks of 4 tokens
    r = FakeRunner(s)
    turn1 = make_req("turn1", range(100, 116), max_tokens=1)      # 4 full blocks, cached when it ends
    s.add_request(turn1)
    run_until_idle(s, r)
    s.add_request(make_req("other", range(200, 216), max_tokens=1))
    run_until_idle(s, r)                                           # 4 more cached blocks, freed after turn1's
    s.add_request(make_req("big", range(300, 347), max_tokens=1))  # 12 blocks: 8 never used + 4 cached ones
    turn2 = make_req("turn2", turn1.all_token_ids + [5, 6, 7], max_tokens=1)
    s.add_request(turn2)                                           # queued behind "big" (one seat)
    run_until_idle(s, r)
    assert turn2.num_cached_tokens == 16
    _, hit = s.kv_cache_manager.get_computed_blocks(make_req("probe", range(200, 216), max_tokens=1))
    assert hit == 0                                                # "other"'s blocks were evicted instead


def test_prompt_of_exactly_three_blocks_recomputes_last_token():
    s = sched_(block_size=16)
    r = FakeRunner(s)
    prompt = list(range(10, 58))
    s.add_request(make_req("a", prompt, max_tokens=2))
    run_until_idle(s, r)
    b = make_req("b", prompt, max_tokens=2)
    s.add_request(b)
    out, _ = step(s, r)
    assert b.num_cached_tokens == 32  # at most 2 of the 3 blocks
    (sr,) = out.scheduled
    assert sr.num_computed_tokens == 32 and sr.num_new_tokens == 16 and sr.sample
    run_until_idle(s, r)


def test_prefix_caching_off_reports_zero():
    s = sched_(enable_prefix_caching=False)
    r = FakeRunner(s)
    for rid in "ab":
        s.add_request(make_req(rid, range(2, 30), max_tokens=2))
        run_until_idle(s, r)
    assert s.prefix_cache_hits == 0 and s.requests == {}


# -- budget, chunked prefill, admission ---------------------------------------

def test_chunked_prefill_respects_budget():
    s = sched_(max_num_batched_tokens=32)
    r = FakeRunner(s)
    d = make_req("d", range(2, 6), max_tokens=50)
    s.add_request(d)
    step(s, r)  # d is decoding from now on
    long = make_req("long", range(100, 200), max_tokens=3)
    s.add_request(long)
    chunks = []
    while long.num_output_tokens == 0:
        out, _ = step(s, r)
        assert out.num_batched_tokens <= 32
        assert out.scheduled[0].request is d and out.scheduled[0].num_new_tokens == 1  # running first
        chunks += [sr.num_new_tokens for sr in out.scheduled if sr.request is long]
    assert chunks == [31, 31, 31, 7]
    run_until_idle(s, r)


def test_without_chunked_prefill_a_prompt_waits_for_budget():
    s = sched_(max_num_batched_tokens=32, enable_chunked_prefill=False)
    r = FakeRunner(s)
    with pytest.raises(ValueError, match="max_num_batched_tokens=32"):
        s.add_request(make_req("x", range(2, 40)))
    a, b = make_req("a", range(2, 22)), make_req("b", range(30, 50))
    s.add_request(a)
    s.add_request(b)
    out, _ = step(s, r)
    assert [sr.request.request_id for sr in out.scheduled] == ["a"]  # b (20) does not fit in 12
    out, _ = step(s, r)
    assert [(sr.request.request_id, sr.num_new_tokens) for sr in out.scheduled] == [("a", 1), ("b", 20)]
    run_until_idle(s, r)


def test_max_num_seqs_caps_running():
    s = sched_(max_num_seqs=2)
    r = FakeRunner(s)
    for i in range(5):
        s.add_request(make_req(f"r{i}", range(2, 8), max_tokens=3))
    outs, fin = run_until_idle(s, r)
    assert all(len(o.scheduled) <= 2 for o in outs) and len(fin) == 5
    assert [q.request_id for q in fin] == [f"r{i}" for i in range(5)]


# -- stopping ------------------------------------------------------------------

def test_stop_conditions():
    s = sched_()
    r = FakeRunner(s)
    eos_early = make_req("eos", range(2, 6), max_tokens=10)
    min_tok = make_req("min", range(2, 6), max_tokens=10, min_tokens=3)
    ignore = make_req("ign", range(2, 6), max_tokens=5, ignore_eos=True)
    stop_id = make_req("sid", range(2, 6), max_tokens=10, stop_token_ids=[77])
    for q in (eos_early, min_tok, ignore, stop_id):
        s.add_request(q)

    def tok(q):
        if q.request_id == "sid":
            return 77 if q.num_output_tokens == 2 else 5
        return EOS

    run_until_idle(s, r, tok)
    assert eos_early.output_token_ids == [EOS] and eos_early.status == RequestStatus.FINISHED_STOPPED
    assert eos_early.stop_reason is None and eos_early.status.finish_reason == "stop"
    assert min_tok.num_output_tokens == 3 and min_tok.status == RequestStatus.FINISHED_STOPPED
    assert ignore.num_output_tokens == 5 and ignore.status == RequestStatus.FINISHED_LENGTH
    assert stop_id.output_token_ids == [5, 5, 77] and stop_id.stop_reason == 77
    assert s.kv_cache_usage == 0.0
    assert all(q.first_scheduled_time <= q.first_token_time <= q.last_token_time <= q.finished_time
               for q in (eos_early, min_tok, ignore, stop_id))


def test_finish_requests_abort_and_stop_string():
    s = sched_(max_num_seqs=1)
    r = FakeRunner(s)
    a, b = make_req("a", range(2, 20), max_tokens=20), make_req("b", range(2, 20), max_tokens=20)
    s.add_request(a)
    s.add_request(b)
    out = s.schedule()
    r.execute(out)
    assert s.kv_cache_usage > 0
    assert s.finish_requests(["b", "nope"], RequestStatus.FINISHED_ABORTED) == [b]  # waiting
    assert s.finish_requests("a", RequestStatus.FINISHED_STOPPED, "END") == [a]  # running
    assert a.stop_reason == "END" and b.status.finish_reason == "abort"
    assert s.kv_cache_usage == 0.0 and not s.has_unfinished_requests()
    assert s.update_from_output(out, {"a": 5}) == []  # finished after schedule(): ignored
    assert a.num_output_tokens == 0
    with pytest.raises(ValueError):
        s.finish_requests(["a"], RequestStatus.RUNNING)


# -- bad input -------------------------------------------------------------------

def test_bad_input_raises_and_next_request_works():
    s = sched_(max_model_len=32, num_blocks=6)  # 5 blocks of 4 = 20 tokens
    r = FakeRunner(s)
    with pytest.raises(ValueError, match="at least one token"):
        s.add_request(make_req("e", []))
    with pytest.raises(ValueError, match="max_model_len=32"):
        s.add_request(make_req("t", range(2, 40)))
    with pytest.raises(ValueError, match="max_model_len=32"):
        s.add_request(make_req("m", range(2, 22), max_tokens=20))
    with pytest.raises(ValueError, match="KV cache"):
        s.add_request(make_req("k", range(2, 22), max_tokens=5))
    s.add_request(make_req("ok", range(2, 12), max_tokens=4))
    with pytest.raises(ValueError, match="already in use"):
        s.add_request(make_req("ok", range(2, 12)))
    _, fin = run_until_idle(s, r)
    assert [q.request_id for q in fin] == ["ok"] and fin[0].num_output_tokens == 4
    with pytest.raises(ValueError, match="scheduling_policy"):
        sched_(scheduling_policy="lifo")


# -- preemption -------------------------------------------------------------------

def test_preemption_by_recompute_finishes_with_same_tokens():
    s = sched_(num_blocks=9)  # 8 usable blocks = 32 tokens
    r = FakeRunner(s)
    reqs = [make_req(f"r{i}", range(10 * i + 2, 10 * i + 12), max_tokens=12, arrival=float(i)) for i in range(3)]
    for q in reqs:
        s.add_request(q)
    outs, fin = run_until_idle(s, r)
    assert s.num_preemptions > 0
    victims = [v.request_id for o in outs for v in o.preempted]
    assert "r0" not in victims  # fcfs: the oldest is never the victim
    for o in outs:
        if o.preempted:
            assert all(v.status != RequestStatus.RUNNING or v.request_id not in
                       {sr.request.request_id for sr in o.scheduled} for v in o.preempted)
    assert all(q.num_output_tokens == 12 and q.output_token_ids == [1000 + k for k in range(12)] for q in reqs)
    assert sum(q.num_preemptions for q in reqs) == s.num_preemptions
    assert s.kv_cache_usage == 0.0


def test_no_admission_in_a_step_that_preempts():
    s = sched_(num_blocks=7)  # 6 usable blocks
    r = FakeRunner(s)
    a = make_req("a", range(2, 10), max_tokens=14, arrival=0.0)  # grows to 6 blocks
    b = make_req("b", range(20, 28), max_tokens=14, arrival=1.0)
    s.add_request(a)
    s.add_request(b)
    step(s, r)
    s.add_request(make_req("c", range(40, 42), max_tokens=2, arrival=2.0))
    while True:
        running_before = {q.request_id for q in s.running}
        out, _ = step(s, r)
        if out.preempted:
            assert {sr.request.request_id for sr in out.scheduled} <= running_before
            break
    run_until_idle(s, r)


def test_swap_out_and_back_in():
    s = sched_(num_blocks=9, num_cpu_blocks=16)
    r = FakeRunner(s)
    reqs = [make_req(f"r{i}", range(10 * i + 2, 10 * i + 12), max_tokens=12, arrival=float(i)) for i in range(3)]
    for q in reqs:
        s.add_request(q)
    outs = []
    while not any(o.blocks_to_swap_out for o in outs):
        assert s.has_unfinished_requests(), "no swap-out happened"
        outs.append(step(s, r)[0])
    # Swapped requests count as waiting while out.
    assert outs[-1].preempted[0].status == RequestStatus.SWAPPED
    assert s.num_swapped >= 1 and s.num_waiting == len(s.waiting) + s.num_swapped
    outs += run_until_idle(s, r)[0]
    swapped_out = [p for o in outs for p in o.blocks_to_swap_out]
    swapped_in = [p for o in outs for p in o.blocks_to_swap_in]
    assert swapped_out and swapped_in and len(swapped_out) == len(swapped_in)
    assert all(q.num_output_tokens == 12 and q.output_token_ids == [1000 + k for k in range(12)] for q in reqs)
    assert s.kv_cache_manager.num_free_cpu_blocks == 16


def test_swap_falls_back_to_recompute_when_cpu_is_full():
    s = sched_(num_blocks=9, num_cpu_blocks=1)
    r = FakeRunner(s)
    for i in range(3):
        s.add_request(make_req(f"r{i}", range(10 * i + 2, 10 * i + 12), max_tokens=12, arrival=float(i)))
    outs, fin = run_until_idle(s, r)
    assert s.num_preemptions > 0 and not any(o.blocks_to_swap_out for o in outs)
    assert len(fin) == 3


# -- policies --------------------------------------------------------------------

def test_priority_policy_orders_admission():
    s = sched_(max_num_seqs=1, scheduling_policy="priority")
    r = FakeRunner(s)
    s.add_request(make_req("low", range(2, 6), max_tokens=2, priority=5, arrival=0.0))
    s.add_request(make_req("hi-late", range(2, 6), max_tokens=2, priority=0, arrival=2.0))
    s.add_request(make_req("hi-early", range(2, 6), max_tokens=2, priority=0, arrival=1.0))
    _, fin = run_until_idle(s, r)
    assert [q.request_id for q in fin] == ["hi-early", "hi-late", "low"]


def test_fcfs_ignores_priority():
    s = sched_(max_num_seqs=1)
    r = FakeRunner(s)
    s.add_request(make_req("first", range(2, 6), max_tokens=2, priority=9))
    s.add_request(make_req("second", range(2, 6), max_tokens=2, priority=0))
    _, fin = run_until_idle(s, r)
    assert [q.request_id for q in fin] == ["first", "second"]


def make_embed(call, prompts, *, arrival, priority=0):
    """The pooling requests of one embedding call (``EngineCore.add_embed``'s): input ``i`` has ``input_index`` i."""
    from engine.pooling import PoolingParams
    return [Request(f"{call}-{i}", list(p), SamplingParams(max_tokens=1), max_tokens=0, arrival_time=arrival,
                    priority=priority, pooling_params=PoolingParams(), input_index=i) for i, p in enumerate(prompts)]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_short_call_is_not_queued_behind_a_long_calls_inputs(policy):
    """Four 40-token embedding inputs of one call, then a 2-token embedding and a chat prompt arriving later:
    both are seated before the first call's second input (round-robin between calls), so each finishes before
    it. Served in arrival order, they waited for all four inputs to be seated."""
    s = sched_(max_num_batched_tokens=16, scheduling_policy=policy)
    r = FakeRunner(s)
    for req in make_embed("long", [range(100 + 40 * i, 140 + 40 * i) for i in range(4)], arrival=0.0):
        s.add_request(req)
    step(s, r)
    s.add_request(make_embed("short", [range(2, 4)], arrival=1.0)[0])
    s.add_request(make_req("chat", range(5, 9), max_tokens=2, arrival=2.0))
    assert [q.request_id for q in s.seat_order()] == ["short-0", "chat", "long-1", "long-2", "long-3"]
    _, fin = run_until_idle(s, r)
    order = [q.request_id for q in fin]
    assert order.index("short-0") < order.index("long-1") and order.index("chat") < order.index("long-1")
    assert set(order) == {"long-0", "long-1", "long-2", "long-3", "short-0", "chat"}


def test_embedding_calls_take_turns():
    """Two calls of three inputs: seated input by input, the earlier call first at each (round-robin); a
    request preempted for recompute goes first among the requests of its input index (``_preempt``'s
    ``_enqueue(front=True)``), and a later arrival last among them, with no sort per step."""
    s = sched_(max_num_seqs=1)
    for req in [*make_embed("a", [range(2, 6)] * 3, arrival=0.0), *make_embed("b", [range(7, 11)] * 3, arrival=1.0)]:
        s.add_request(req)
    assert [q.request_id for q in s.seat_order()] == ["a-0", "b-0", "a-1", "b-1", "a-2", "b-2"]
    s.add_request(make_req("chat", range(3, 8), arrival=5.0))
    for victim in (make_req("victim", range(3, 9), arrival=6.0), make_embed("c", [[1], [2]], arrival=7.0)[1]):
        s.requests[victim.request_id] = victim
        s._enqueue(victim, front=True)
    assert [q.request_id for q in s.seat_order()] == ["victim", "a-0", "b-0", "chat", "c-1", "a-1", "b-1", "a-2",
                                                      "b-2"]


def test_priority_preempts_lowest_priority():
    s = sched_(num_blocks=9, scheduling_policy="priority")  # 32 tokens of KV
    r = FakeRunner(s)
    # Oldest arrival but least important: it must be the victim.
    low = make_req("low", range(2, 12), max_tokens=12, priority=3, arrival=0.0)
    mid = make_req("mid", range(20, 30), max_tokens=12, priority=1, arrival=1.0)
    top = make_req("top", range(40, 50), max_tokens=12, priority=0, arrival=2.0)
    s.add_request(low)
    step(s, r)  # low runs first
    s.add_request(mid)
    s.add_request(top)
    out, _ = step(s, r)
    assert [sr.request.request_id for sr in out.scheduled] == ["low", "top"]  # mid does not fit yet
    outs, fin = run_until_idle(s, r)
    victims = [v.request_id for o in outs for v in o.preempted]
    assert victims and victims[0] == "low" and "top" not in victims
    assert fin[0] is top and all(q.num_output_tokens == 12 for q in (low, mid, top))


# -- parallel sampling (fork + copy-on-write) ---------------------------------------

def test_n3_fork_shares_blocks_and_copies_on_write():
    s = sched_()
    r = FakeRunner(s)
    members = make_group("p", range(2, 12), 3, max_tokens=4)  # 10 tokens, bs 4
    for m in members:
        s.add_request(m)
    out, _ = step(s, r)
    (sr,) = out.scheduled
    assert sr.request is members[0] and sr.num_new_tokens == 9 and not sr.sample
    assert members[0].group.forked
    tables = [s.get_block_ids(m.request_id) for m in members]
    assert tables[0] == tables[1] == tables[2] and len(tables[0]) == 3
    assert s.num_running == 3
    out, _ = step(s, r)
    assert [(x.request.index, x.num_computed_tokens, x.num_new_tokens, x.sample) for x in out.scheduled] == \
        [(0, 9, 1, True), (1, 9, 1, True), (2, 9, 1, True)]
    assert len(out.blocks_to_copy) == 2 and {src for src, _ in out.blocks_to_copy} == {tables[0][2]}
    new_tables = [s.get_block_ids(m.request_id) for m in members]
    assert all(t[:2] == tables[0][:2] for t in new_tables) and len({t[2] for t in new_tables}) == 3
    assert all(m.num_cached_tokens == 0 for m in members)
    run_until_idle(s, r, lambda q: 100 * q.index + q.num_output_tokens + 2)
    assert [m.output_token_ids for m in members] == [[1000, 3, 4, 5], [1000, 103, 104, 105], [1000, 203, 204, 205]]
    assert s.kv_cache_usage == 0.0


def test_fork_of_one_token_prompt_and_cached_leader():
    s = sched_()
    r = FakeRunner(s)
    one = make_group("one", [5], 2, max_tokens=3)
    for m in one:
        s.add_request(m)
    _, fin = run_until_idle(s, r)
    assert all(m.num_output_tokens == 3 for m in one)
    # Leader whose prompt_len - 1 tokens are all cached forks at admission.
    s.add_request(make_req("warm", range(2, 11), max_tokens=1))  # 9 tokens: 2 full blocks cached
    run_until_idle(s, r)
    g = make_group("g", range(2, 11), 3, max_tokens=2)
    for m in g:
        s.add_request(m)
    out, _ = step(s, r)
    assert g[0].group.forked and all(m.num_cached_tokens == 8 for m in g) and not out.scheduled
    out, _ = step(s, r)
    assert [x.num_new_tokens for x in out.scheduled] == [1, 1, 1] and out.blocks_to_copy == []
    run_until_idle(s, r)


def test_fork_group_abort_of_leader_before_fork():
    s = sched_(max_num_batched_tokens=8)
    r = FakeRunner(s)
    g = make_group("g", range(2, 30), 3, max_tokens=2)
    for m in g:
        s.add_request(m)
    step(s, r)  # leader computes its first chunk
    s.finish_requests([g[0].request_id], RequestStatus.FINISHED_ABORTED)
    _, fin = run_until_idle(s, r)
    assert {m.request_id for m in fin} == {"g-1", "g-2"} and all(m.num_output_tokens == 2 for m in fin)


def test_n_above_max_num_seqs_rejected():
    s = sched_(max_num_seqs=2)
    with pytest.raises(ValueError, match="max_num_seqs=2"):
        s.add_request(make_group("g", range(2, 6), 3)[0])


# -- property test ------------------------------------------------------------------

configs = st.fixed_dictionaries({
    "block_size": st.sampled_from([1, 2, 4, 4]),
    "num_blocks": st.integers(3, 20),
    "max_num_seqs": st.integers(1, 5),
    "max_num_batched_tokens": st.integers(1, 40),
    "enable_chunked_prefill": st.booleans(),
    "enable_prefix_caching": st.booleans(),
    "scheduling_policy": st.sampled_from(["fcfs", "priority"]),
    "num_cpu_blocks": st.sampled_from([0, 0, 3, 16]),
    "max_steps": st.sampled_from([1, 1, 2, 4]),
})
# ("add", prefix family, prompt length, max_tokens, n, priority, min_tokens, ignore_eos)
add_op = st.tuples(st.just("add"), st.integers(0, 2), st.integers(0, 24), st.integers(1, 14), st.integers(1, 3),
                   st.integers(0, 3), st.integers(0, 2), st.booleans())
ops_st = st.lists(st.one_of(add_op, add_op, st.just(("step",)), st.just(("step",)), st.just(("step",)),
                            st.tuples(st.just("abort"), st.integers(0, 100)),
                            st.tuples(st.just("stop"), st.integers(0, 100))), min_size=4, max_size=60)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configs, ops=ops_st, seed=st.integers(0, 2**16))
def test_random_workloads_never_leak_or_corrupt(cfg, ops, seed):
    for name in simulate(cfg, ops, seed):
        event(name)


def random_ops(rng: random.Random, num_ops: int) -> list[tuple]:
    """A busier workload than hypothesis' small examples: many requests in flight."""
    ops = []
    for _ in range(num_ops):
        x = rng.random()
        if x < 0.4:
            ops.append(("add", rng.randrange(3), rng.randrange(25), rng.randrange(1, 15), rng.choice([1, 1, 2, 3]),
                        rng.randrange(4), rng.randrange(3), rng.random() < 0.5))
        elif x < 0.92:
            ops.append(("step",))
        else:
            ops.append((rng.choice(["abort", "stop"]), rng.randrange(100)))
    return ops


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configs, seed=st.integers(0, 2**32 - 1))
def test_busy_random_workloads_never_leak_or_corrupt(cfg, seed):
    rng = random.Random(seed)
    for name in simulate(cfg, random_ops(rng, 80), seed):
        event(name)


def simulate(cfg: dict, ops: list[tuple], seed: int) -> set[str]:
    """Run ``ops`` against a Scheduler and a FakeRunner, checking every
    invariant after each op, then drain, check nothing leaked, and admit a
    request that needs the whole pool. Returns the events seen (coverage)."""
    max_model_len = 48
    cfg = dict(cfg)
    max_steps = cfg.pop("max_steps", 1)
    s = Scheduler(max_model_len=max_model_len, **cfg)
    runner = FakeRunner(s)
    rng = random.Random(seed)
    families = [[rng.randrange(2, 6) for _ in range(30)] for _ in range(3)]
    capacity = (cfg["num_blocks"] - 1) * cfg["block_size"]
    added: list[Request] = []

    def token(q):
        return EOS if rng.random() < 0.1 else rng.randrange(2, 8)

    seen = set()

    def checked_step():
        running_before = {q.request_id for q in s.running}
        out = s.schedule(max_steps, lambda q: q.num_output_tokens >= q.sampling_params.min_tokens)
        if out.preempted:  # no admission in a step that preempted
            assert {sr.request.request_id for sr in out.scheduled} <= running_before
        if out.num_steps > 1:   # a batch of whole decodes, nothing waiting (multi_step.py)
            assert not s.waiting and not s.swapped and not out.preempted
            assert all(sr.num_new_tokens == 1 and sr.num_computed_tokens >= sr.request.num_prompt_tokens
                       and sr.request.num_output_tokens + out.num_steps <= sr.request.max_tokens
                       for sr in out.scheduled)
        chosen = {sr.request.request_id: [token(sr.request) for _ in range(out.num_steps)]
                  for sr in out.scheduled if sr.sample}
        runner.execute(out, {rid: t[:-1] for rid, t in chosen.items()})
        for name, happened in (("preempt", out.preempted), ("swap in", out.blocks_to_swap_in),
                               ("copy-on-write", out.blocks_to_copy), ("several steps", out.num_steps > 1),
                               ("prefix hit", any(sr.request.num_cached_tokens > 0 for sr in out.scheduled))):
            if happened:
                seen.add(name)
        sampled = {rid: t if out.num_steps > 1 else t[0] for rid, t in chosen.items()}
        s.update_from_output(out, sampled)
        for sr in out.scheduled:   # every step's keys and values count as computed: none is recomputed
            q = sr.request
            if out.num_steps > 1 and not q.is_finished and q.status == RequestStatus.RUNNING:
                assert q.num_computed_tokens == q.num_tokens - 1 == sr.num_computed_tokens + out.num_steps
        s.check_invariants()

    for k, op in enumerate(ops):
        if op[0] == "add":
            _, fam, plen, max_tokens, n, prio, min_tokens, ignore_eos = op
            prompt = families[fam][:plen] + ([rng.randrange(2, 6)] if plen and rng.random() < 0.5 else [])
            min_tokens = min(min_tokens, max_tokens)
            params = dict(min_tokens=min_tokens, ignore_eos=ignore_eos, stop_token_ids=[7] if prio == 3 else [])
            reqs = (make_group(f"g{k}", prompt, n, max_tokens, arrival=float(k), **params) if n > 1 else
                    [make_req(f"r{k}", prompt, max_tokens, priority=prio, arrival=float(k), **params)])
            plen = len(prompt)
            invalid = (plen == 0 or plen + max_tokens > max_model_len or plen + max_tokens - 1 > capacity
                       or (not cfg["enable_chunked_prefill"] and plen > cfg["max_num_batched_tokens"])
                       or n > cfg["max_num_seqs"])
            if invalid:
                with pytest.raises(ValueError):
                    s.add_request(reqs[0])
                continue
            for q in reqs:
                s.add_request(q)
            added += reqs
        elif op[0] == "step":
            checked_step()
        elif s.requests:
            rid = sorted(s.requests)[op[1] % len(s.requests)]
            status = RequestStatus.FINISHED_ABORTED if op[0] == "abort" else RequestStatus.FINISHED_STOPPED
            reason = None if op[0] == "abort" else "a stop string"
            assert [q.request_id for q in s.finish_requests([rid], status, reason)] == [rid]
        s.check_invariants()

    for _ in range(3000):
        if not s.has_unfinished_requests():
            break
        checked_step()
    assert not s.has_unfinished_requests(), "livelock"
    kv = s.kv_cache_manager
    assert kv.num_free_blocks == cfg["num_blocks"] - 1 and s.kv_cache_usage == 0.0
    assert kv.num_free_cpu_blocks == cfg["num_cpu_blocks"] and not kv.req_to_blocks
    for q in added:
        assert q.is_finished and q.num_output_tokens <= q.max_tokens
        if q.status == RequestStatus.FINISHED_LENGTH:
            assert q.num_output_tokens == q.max_tokens
        if q.status == RequestStatus.FINISHED_STOPPED and q.stop_reason is None:
            assert q.output_token_ids[-1] == EOS and q.num_output_tokens >= q.sampling_params.min_tokens
    # Idle: a request needing the whole pool is admitted at once.
    plen = min(capacity, max_model_len - 1)
    if not cfg["enable_chunked_prefill"]:
        plen = min(plen, cfg["max_num_batched_tokens"])
    big = make_req("big", [rng.randrange(2, 6) for _ in range(plen)], max_tokens=1)
    s.add_request(big)
    peak_usage = 0.0
    while s.has_unfinished_requests():
        out = s.schedule()
        assert [sr.request for sr in out.scheduled] == [big]  # admitted at once, never preempted
        peak_usage = max(peak_usage, s.kv_cache_usage)
        runner.execute(out)
        s.update_from_output(out, {"big": 5} if out.scheduled[0].sample else {})
    assert big.num_output_tokens == 1 and big.num_preemptions == 0
    if plen == capacity:
        assert peak_usage == 1.0
    return seen
