"""TTFT prediction against a scripted engine: a real Scheduler and KV cache manager, no model; each step costs
what a cost model says (a fixed step cost + prefill tokens / rate) on a simulated clock, so a prediction made at
admission can be compared with the TTFT the same engine then delivers."""

from __future__ import annotations

import random

import pytest

from engine.core.kv_cache_manager import hash_block_tokens
from engine.core.request import Request
from engine.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler
from engine.core.ttft import PendingAdds, PrefixMirror, TTFTCalibration, TTFTState, predict_ttft, state_of

STEP_S, PREFILL_TOK_S = 0.040, 1000.0


class ScriptedEngine:
    """A scheduler stepped on a simulated clock; its prefix cache mirrored as the front end mirrors it."""

    def __init__(self, **kw):
        args = dict(block_size=16, num_blocks=512, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=2048)
        args.update(kw)
        self.sched = Scheduler(**args)
        self.sched.kv_cache_manager.block_pool.kv_events = []
        self.cal = TTFTCalibration(step_s=STEP_S, prefill_tok_s=PREFILL_TOK_S, steps=1)
        self.mirror = PrefixMirror()
        self.now = 0.0
        self.added: dict[str, float] = {}
        self.first_token: dict[str, float] = {}
        self.state = self.publish()

    def publish(self) -> TTFTState:
        self.state = state_of(self.sched, self.cal)
        self.mirror.apply(self.state)
        return self.state

    def predict(self, prompt: list[int], priority: int = 0) -> float:
        cached = self.mirror.cached_tokens(prompt, self.state.block_size)
        return predict_ttft(self.state, len(prompt), cached, priority).seconds

    def add(self, rid: str, prompt: list[int], max_tokens: int = 8, priority: int = 0) -> None:
        self.sched.add_request(Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens), eos_token_id=None,
                                       max_tokens=max_tokens, priority=priority, arrival_time=self.now))
        self.added[rid] = self.now
        self.publish()

    def step(self) -> None:
        out = self.sched.schedule()
        prefill = sum(min(e.num_new_tokens, e.request.num_prompt_tokens - e.num_computed_tokens)
                      for e in out.scheduled if e.num_computed_tokens < e.request.num_prompt_tokens)
        decode = len(out.scheduled) - sum(e.num_computed_tokens < e.request.num_prompt_tokens for e in out.scheduled)
        cost = STEP_S + prefill / PREFILL_TOK_S
        self.now += cost
        self.cal.observe(cost, prefill, decode)
        sampled = {e.request.request_id: 7 for e in out.scheduled if e.sample}
        for rid in sampled:
            self.first_token.setdefault(rid, self.now)
        self.sched.update_from_output(out, sampled)
        self.publish()

    def run(self) -> None:
        while self.sched.has_unfinished_requests():
            self.step()

    def ttft(self, rid: str) -> float:
        return self.first_token[rid] - self.added[rid]


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 30000) for _ in range(n)]


def test_prediction_matches_the_scripted_engine_under_a_queue():
    """Requests arrive while others queue and decode: each prediction made at admission is within one step
    (plus 10 %) of the TTFT the engine then delivers."""
    rng = random.Random(1)
    eng = ScriptedEngine()
    predicted = {}
    for i in range(30):
        prompt = tokens(rng, rng.choice([40, 200, 700, 1500]))
        rid = f"r{i}"
        predicted[rid] = eng.predict(prompt)
        eng.add(rid, prompt, max_tokens=rng.choice([4, 16, 64]))
        for _ in range(rng.randrange(0, 4)):
            eng.step()
    eng.run()
    errors = {rid: abs(predicted[rid] - eng.ttft(rid)) for rid in predicted}
    for rid, err in errors.items():
        assert err <= STEP_S + 0.10 * eng.ttft(rid), (rid, predicted[rid], eng.ttft(rid))
    assert max(eng.ttft(r) for r in predicted) > 10 * STEP_S, "the queue never built up: the test shows nothing"


def test_a_long_queue_predicts_longer_than_an_idle_engine():
    rng = random.Random(2)
    eng = ScriptedEngine()
    prompt = tokens(rng, 300)
    idle = eng.predict(prompt)
    for i in range(6):
        eng.add(f"q{i}", tokens(rng, 1000))
    busy = eng.predict(prompt)
    assert idle == pytest.approx(2 * STEP_S + 300 / PREFILL_TOK_S)   # 2 steps of 256 tokens
    assert busy > idle + 6000 / PREFILL_TOK_S


def test_priority_class_counts_only_the_tokens_ahead_of_it():
    rng = random.Random(3)
    eng = ScriptedEngine(scheduling_policy="priority")
    for i in range(4):
        eng.add(f"low{i}", tokens(rng, 1000), priority=1)
    prompt = tokens(rng, 100)
    high, low = eng.predict(prompt, priority=-1), eng.predict(prompt, priority=1)
    assert high < 3 * STEP_S + 0.2 < low
    eng.add("high", prompt, priority=-1)
    eng.run()
    assert abs(eng.ttft("high") - high) <= STEP_S + 0.1 * eng.ttft("high")


def test_prefix_cache_hits_shorten_the_prediction_and_the_mirror_agrees_with_the_cache():
    rng = random.Random(4)
    eng = ScriptedEngine()
    system = tokens(rng, 800)
    eng.add("turn1", system + tokens(rng, 50))
    eng.run()
    turn2 = system + tokens(rng, 60)
    cached = eng.mirror.cached_tokens(turn2, 16)
    probe = Request("probe", turn2, SamplingParams(max_tokens=4), max_tokens=4)
    _, hit = eng.sched.kv_cache_manager.get_computed_blocks(probe)
    assert cached == hit == 800
    assert eng.predict(turn2) < eng.predict(tokens(rng, len(turn2))) - 0.5


def test_fcfs_and_seat_wait():
    """With every seat taken, a new request waits for the shortest remaining decode first."""
    rng = random.Random(5)
    eng = ScriptedEngine(max_num_seqs=2)
    eng.add("a", tokens(rng, 20), max_tokens=50)
    eng.add("b", tokens(rng, 20), max_tokens=30)
    for _ in range(5):
        eng.step()
    prompt = tokens(rng, 20)
    p = predict_ttft(eng.state, len(prompt), 0)
    assert p.parts["wait_seat"] == pytest.approx((30 - 5) * STEP_S)
    eng.add("c", prompt)
    eng.run()
    assert abs(eng.ttft("c") - p.seconds) <= STEP_S + 0.1 * eng.ttft("c")


def test_mirror_resyncs_when_events_were_not_drained():
    rng = random.Random(6)
    eng = ScriptedEngine(num_blocks=40)
    pool = eng.sched.kv_cache_manager.block_pool
    for i in range(12):   # events piling up with nobody publishing: more than 4 x num_blocks
        eng.sched.add_request(Request(f"x{i}", tokens(rng, 300), SamplingParams(max_tokens=2), max_tokens=2))
        while eng.sched.has_unfinished_requests():
            out = eng.sched.schedule()
            eng.sched.update_from_output(out, {e.request.request_id: 7 for e in out.scheduled if e.sample})
    assert pool.kv_events_lost and len(pool.kv_events) <= 4 * 40
    eng.mirror.hashes.add(hash_block_tokens(None, [1] * 16))   # a stale entry the resync must drop
    state = eng.publish()
    assert state.resync is not None and eng.mirror.hashes == set(pool.cached_block_hash_to_block)


def test_calibration_follows_measured_steps():
    cal = TTFTCalibration()
    for _ in range(100):
        cal.observe(0.030, 0, 4)
        cal.observe(0.030 + 512 / 3000, 512, 4)
    assert cal.step_s == pytest.approx(0.030, rel=0.01)
    assert cal.prefill_tok_s == pytest.approx(3000, rel=0.05)


def test_requests_sent_but_not_yet_in_the_cores_state_count_as_queued():
    """A burst: each request the front end sent before the core's next state is ahead of the next one."""
    rng = random.Random(7)
    eng = ScriptedEngine()
    pending = PendingAdds()
    alone = predict_ttft(pending.with_pending(eng.state), 200, 0).seconds
    for _ in range(3):
        pending.note_sent(0, 1000)
    burst = predict_ttft(pending.with_pending(eng.state), 200, 0).seconds
    assert burst == pytest.approx(alone + 3000 / PREFILL_TOK_S + 12 * STEP_S)
    for i in range(3):   # the core takes them: its state counts them, the front end forgets them
        eng.sched.add_request(Request(f"b{i}", tokens(rng, 1000), SamplingParams(max_tokens=4), max_tokens=4))
    state = state_of(eng.sched, eng.cal, added=3)
    pending.seen(state.added)
    assert pending.with_pending(state) is state
    assert predict_ttft(state, 200, 0).seconds == pytest.approx(burst)


def test_requests_queued_for_seats_wait_for_the_running_set_to_finish():
    """Short prompts, long answers, few seats: the queue is of seats, not of prefill; each prediction is within a
    step (plus 15 %) of the TTFT delivered."""
    rng = random.Random(8)
    eng = ScriptedEngine(max_num_seqs=4)
    predicted = {}
    for i in range(16):
        prompt = tokens(rng, rng.choice([20, 60]))
        predicted[f"s{i}"] = eng.predict(prompt)
        eng.add(f"s{i}", prompt, max_tokens=rng.choice([20, 40]))
        eng.step()
    eng.run()
    for rid, p in predicted.items():
        assert abs(p - eng.ttft(rid)) <= STEP_S + 0.15 * eng.ttft(rid), (rid, p, eng.ttft(rid))
    assert max(eng.ttft(r) for r in predicted) > 40 * STEP_S, "no seat queue built up"


def test_queued_follow_up_turns_count_only_what_the_prefix_cache_lacks():
    """Multi-turn: follow-ups queued behind a busy engine repeat conversations the cache holds; the prediction
    counts their uncached tails as prefill ahead, not their whole prompts, and matches the engine's TTFT."""
    rng = random.Random(9)
    eng = ScriptedEngine()
    systems = [tokens(rng, 800) for _ in range(4)]
    for i, s in enumerate(systems):
        eng.add(f"first{i}", s + tokens(rng, 30), max_tokens=2)
    eng.run()
    for i, s in enumerate(systems):
        eng.add(f"next{i}", s + tokens(rng, 60), max_tokens=2)
    ahead = sum(c[1] for c in eng.state.queued_prefill)
    assert ahead <= 4 * (60 + 16 + 30)   # the tails (and a partial block each), not 4 x 860
    prompt = tokens(rng, 100)
    p = eng.predict(prompt)
    eng.add("new", prompt, max_tokens=2)
    eng.run()
    assert abs(p - eng.ttft("new")) <= STEP_S + 0.1 * eng.ttft("new"), (p, eng.ttft("new"))


def test_prefill_rate_is_weighted_by_tokens_not_averaged_over_steps():
    """Full chunks and short tails alternate: the rate is the tokens over their time, which a few noisy short
    steps cannot drag down."""
    cal = TTFTCalibration(step_s=0.030, prefill_tok_s=3000.0, steps=1)
    for _ in range(200):
        cal.observe(0.030 + 512 / 3000, 512, 4)
        cal.observe(0.030 + 0.010 + 20 / 3000, 20, 4)   # a short tail with 10 ms of noise
    assert cal.prefill_tok_s == pytest.approx(3000, rel=0.1)


def test_calibration_averages_its_first_steps_alike():
    """A fresh engine's first prefill step is slow (first use of its shapes): after ten more steps it weighs a
    tenth, not 0.9^10 of a plain EWMA started from it."""
    cal = TTFTCalibration()
    cal.observe(0.030 + 512 / 300, 512, 4)          # 10x slower than the steps that follow
    for _ in range(9):
        cal.observe(0.030 + 512 / 3000, 512, 4)
    assert cal.prefill_tok_s == pytest.approx(512 * 10 / (512 / 300 + 9 * 512 / 3000), rel=0.1)
    assert cal.prefill_tok_s > 1500


def test_a_request_arriving_during_a_step_waits_for_what_is_left_of_it():
    """A busy core runs its next step as soon as it publishes a state; a request arriving joins the step after.
    Predicted at the state (elapsed 0) it waits for that whole step; half a step later, for half of it less;
    the prediction at elapsed 0 matches the scripted engine's TTFT counted from that moment."""
    rng = random.Random(10)
    eng = ScriptedEngine()
    eng.add("long", tokens(rng, 1000))
    eng.step()
    prompt = tokens(rng, 100)
    at_state = predict_ttft(eng.state, len(prompt), 0, elapsed_s=0.0)
    running_step = STEP_S + 256 / PREFILL_TOK_S
    later = predict_ttft(eng.state, len(prompt), 0, elapsed_s=running_step / 2)
    assert at_state.seconds - later.seconds == pytest.approx(running_step / 2)
    assert "left of the running step" in at_state.describe()
    t0 = eng.now
    eng.step()                                         # the step that was running, planned without the request
    eng.add("new", prompt)
    eng.run()
    delivered = eng.first_token["new"] - t0
    assert abs(at_state.seconds - delivered) <= 0.1 * delivered, (at_state.seconds, delivered)
    idle = ScriptedEngine()
    assert predict_ttft(idle.state, 100, 0, elapsed_s=5.0).seconds == pytest.approx(STEP_S + 100 / PREFILL_TOK_S)


def test_a_follow_up_queued_behind_its_earlier_turn_counts_only_its_new_tail():
    """Turn 1 and turn 2 of a conversation both queued: turn 1 computes and caches the shared prefix before
    turn 2 is seated, so turn 2 adds only its tail to the prefill ahead; the prediction matches the engine."""
    rng = random.Random(11)
    eng = ScriptedEngine()
    system = tokens(rng, 800)
    turn1 = system + tokens(rng, 30)
    eng.add("turn1", turn1, max_tokens=2)
    eng.add("turn2", turn1 + tokens(rng, 60), max_tokens=2)
    ahead = sum(c[1] for c in eng.state.queued_prefill)
    assert ahead <= len(turn1) + 60 + 2 * 16          # not 830 + 890
    prompt = tokens(rng, 100)
    p = eng.predict(prompt)
    eng.add("new", prompt, max_tokens=2)
    eng.run()
    assert abs(p - eng.ttft("new")) <= STEP_S + 0.1 * eng.ttft("new"), (p, eng.ttft("new"))
