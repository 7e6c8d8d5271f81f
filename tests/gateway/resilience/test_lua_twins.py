"""Differential property tests: each shared-state rule is written twice, a Lua script run by Redis and its
in-process Python twin (used without Redis and while it is unreachable). Hypothesis feeds the same random
operation sequence, at the same explicit clock, to a ``SharedState`` on the real Redis of the conftest fixture and
to an in-process one; every answer and the final state must be equal."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.billing.usage import Budget, UsageLedger, UsageRecord
from gateway.config.schema import BreakerSettings, StateSettings
from gateway.resilience.breaker import Breakers
from gateway.resilience.ratelimit import Limit, RateLimiter
from gateway.state import SharedState, now_ms

TWINS = settings(max_examples=40, deadline=None)
steps = st.integers(0, 4000)     # ms between two operations


def run_twins(redis_url: str, scenario) -> None:
    """``await scenario(state, t0)`` on a Redis-backed and on an in-process state, both from the clock ``t0``
    (ms); their results must be equal."""

    async def both():
        redis_state = SharedState(StateSettings(redis_url=redis_url, key_prefix=f"twin{uuid.uuid4().hex[:10]}",
                                              socket_timeout_s=5.0))
        memory_state, t0 = SharedState(StateSettings()), now_ms()
        try:
            on_redis = await scenario(redis_state, t0)
            assert redis_state.mode == "redis"          # the Lua scripts ran: no silent fallback
            assert on_redis == await scenario(memory_state, t0)
        finally:
            await redis_state.close()

    asyncio.run(both())


@TWINS
@given(st.lists(st.tuples(steps, st.sampled_from(["allow", "ok", "fail", "429", "503", "probe_ok", "probe_fail"]),
                          st.sampled_from([None, 0.5, 3.0])), min_size=1, max_size=25))
def test_breaker_lua_and_python_twins_agree(redis_url, ops):
    cfg = BreakerSettings(consecutive_failures=3, min_requests=4, window_s=5, buckets=5, open_s=2,
                          rate_limit_cooldown_s=4, half_open_probes=1, probe_timeout_s=3, cache_s=0)

    async def scenario(state, now):
        br, out = Breakers(state, cfg), []
        for dt, op, retry_after in ops:
            now += dt
            if op == "allow":
                out.append(dataclasses.astuple(await br.allow("t", now=now)))
                continue
            status = {"429": 429, "503": 503}.get(op)
            s = await br.record("t", op in ("ok", "probe_ok"), status=status, retry_after_s=retry_after,
                                probe=op.startswith("probe"), now=now)
            out.append((s.state, s.open_until_ms, s.consecutive_failures, s.previous))
        return out

    run_twins(redis_url, scenario)


@TWINS
@given(st.lists(st.tuples(steps, st.sampled_from(["acquire", "acquire", "reconcile", "release"]),
                          st.one_of(st.just(0), st.integers(0, 60)), st.sampled_from([(3, None), (None, 100), (2, 50)])),
                min_size=1, max_size=25))
def test_rate_limit_lua_and_python_twins_agree(redis_url, ops):
    async def scenario(state, now):
        rl, out, held = RateLimiter(state, window_s=5), [], []
        for i, (dt, op, tokens, (rpm, tpm)) in enumerate(ops):
            now += dt
            if op == "acquire" or not held:
                r = await rl.acquire([Limit("tenant", "a", rpm, tpm), Limit("key", "k", 4, None)], tokens,
                                     f"r{i}", now=now)
                if r.reservation is not None:
                    held.append(r.reservation)
                out.append(dataclasses.replace(r, reservation=None))
            elif op == "reconcile":
                await rl.reconcile(held.pop(0), tokens)
            else:
                await rl.release(held.pop())
        return out

    run_twins(redis_url, scenario)


@TWINS
@given(st.lists(st.tuples(st.integers(0, 400), st.sampled_from(["reserve", "reserve", "settle", "release", "spend"]),
                          st.one_of(st.just(0), st.integers(0, 30_000))), min_size=1, max_size=25))
def test_budget_reservation_lua_and_python_twins_agree(redis_url, ops):
    budget = Budget(0.0001, "day")              # 100_000 nano-USD
    monthly = Budget(0.0001, "month")           # never reserved on: its spend is every settle's too

    async def scenario(state, t0):
        ledger, now, out, held = UsageLedger(state, reservation_ttl_s=1), t0 / 1000, [], []
        for i, (dt, op, nusd) in enumerate(ops):
            now += dt / 1000
            if op == "spend":                    # a settle with no budget (before one was set)
                out.append(await ledger.settle(UsageRecord(f"s{i}", "t", "b", 1, 1, 0, nusd), now_s=now))
            elif op == "reserve" or not held:
                check = await ledger.reserve("t", f"r{i}", nusd, budget, now_s=now)
                if check.reservation is not None:
                    held.append(check.reservation)
                out.append((check.admitted, check.spent_nusd, check.reserved_nusd))
            elif op == "settle":
                res = held.pop(0)
                failed = nusd % 3 == 0           # accepted, unanswered: no tokens, no cost, the ``|fail`` count
                rec = UsageRecord(res.request_id, "t", "b", 0 if failed else 1, 0 if failed else 1, 0,
                                  0 if failed else nusd, estimated=nusd % 2 == 1, failed=failed)
                # a settle repeated (a journal replay, a late script) is a no-op in both twins
                out.append((await ledger.settle(rec, res, budget, now_s=now),
                            await ledger.settle(rec, res, budget, now_s=now)))
            else:
                await ledger.release(held.pop())
            out.append(await ledger.budget_state("t", budget, now_s=now))
            out.append(await ledger.budget_state("t", monthly, now_s=now))
        out.append(sorted((await ledger.records("t", now_s=now)).items()))
        out.append(await ledger.report("t", now_s=now))
        return out

    run_twins(redis_url, scenario)


@TWINS
@given(st.lists(st.tuples(st.integers(0, 4_000_000), st.sampled_from(["r1", "r2"]),
                          st.sampled_from(["running", "running", "paused", "promoted", "rolled_back", "aborted"]),
                          st.sampled_from([0, 0, 0, -1, 1]), st.floats(0, 1)), min_size=1, max_size=25))
def test_rollout_save_lua_and_python_twins_agree(redis_url, ops):
    """The rollout store's compare-and-set save (``_SAVE``): revisions, conflicts, the route's one holder (both
    rollouts are on one route), the names and live sets, and the rollout read back exactly as written (times in
    microseconds, a gate's value at full float precision)."""
    from gateway.config.schema import RolloutConfig
    from gateway.rollouts.controller import _moved, new_rollout
    from gateway.rollouts.store import Conflict, RolloutStore, RouteHeld

    spec = RolloutConfig(route="main", candidate="cand", steps=[5, 50, 100], hold_s=1)

    async def scenario(state, t0):
        store, now, out = RolloutStore(state), t0 / 1000, []
        for dt, name, new_state, rev_off, value in ops:
            now += dt / 1e6
            cur = await store.load(name)
            if cur is None:
                data, rev = new_rollout(name, spec, "stable", now), 0
            else:
                data, rev = _moved(cur, now, new_state, 1, 50.0, "gates held"), cur["rev"]
                data["final_gates"] = {"parity_min": {"limit": 0.99, "value": value, "ok": value >= 0.99}}
            try:
                out.append(await store.save(name, data, max(rev + rev_off, 0)))
            except Conflict as e:
                out.append(("conflict", e.rev))
            except RouteHeld as e:
                out.append(("held", e.holder))
            out.append((await store.load(name), await store.names(), await store.live_names()))
        return out

    run_twins(redis_url, scenario)
