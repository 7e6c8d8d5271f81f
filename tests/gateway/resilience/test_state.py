"""Shared state, rate limits and circuit breakers, on a real Redis and in process (same tests for both)."""

from __future__ import annotations

import asyncio
import signal
import socket
import threading
import time
import uuid

import pytest

from gateway.config.schema import BreakerSettings, HealthSettings, StateSettings
from gateway.resilience.breaker import Breakers
from gateway.resilience.health import ActiveProber, HealthTracker
from gateway.resilience.ratelimit import Limit, RateLimiter, format_duration
from gateway.state import SharedState
from tests.conftest import free_port

T0 = 1_800_000_000_000  # a fixed clock, ms


@pytest.fixture(params=["redis", "memory"])
async def state(request, redis_url):
    url = redis_url if request.param == "redis" else None
    st = SharedState(StateSettings(redis_url=url, key_prefix=f"t{uuid.uuid4().hex[:8]}", socket_timeout_s=2.0))
    yield st
    await st.close()


def test_format_duration_matches_openai():
    assert format_duration(1) == "1s"
    assert format_duration(360) == "6m0s"
    assert format_duration(0.25) == "250ms"
    assert format_duration(3723) == "1h2m3s"
    assert format_duration(0.5001) == "501ms"


async def test_rpm_is_exact_and_reports_retry_after(state):
    rl = RateLimiter(state)
    lim = [Limit("key", "k1", rpm=5)]
    results = [await rl.acquire(lim, 10, f"r{i}", now=T0 + i * 1000) for i in range(7)]
    assert [r.allowed for r in results] == [True] * 5 + [False] * 2
    rej = results[5]
    assert rej.status == 429 and rej.limit == lim[0]
    # the oldest admission (T0) leaves the 60 s window at T0 + 60 s; asked at T0 + 5 s
    assert rej.retry_after_s == pytest.approx(55.0)
    h = rej.headers()
    assert h["retry-after"] == "55" and h["x-ratelimit-remaining-requests"] == "0"
    assert h["x-ratelimit-limit-requests"] == "5" and h["x-ratelimit-reset-requests"] == "55s"
    assert "(limit: 5 requests per 60s)" in rej.message and "None" not in rej.message   # only the limits set
    assert results[1].headers()["x-ratelimit-remaining-requests"] == "3"
    # the window slides: at T0 + 60.001 s the first admission has expired
    assert (await rl.acquire(lim, 10, "late", now=T0 + 60_001)).allowed
    assert not (await rl.acquire(lim, 10, "late2", now=T0 + 60_002)).allowed


async def test_tpm_reservation_and_reconcile(state):
    rl = RateLimiter(state)
    lim = [Limit("tenant", "acme", tpm=1000)]
    a = await rl.acquire(lim, 600, "a", now=T0)
    assert a.allowed and a.remaining_tokens == 400
    b = await rl.acquire(lim, 600, "b", now=T0 + 1)
    assert not b.allowed and b.retry_after_s == pytest.approx(60.0 - 0.001)
    assert b.headers()["x-ratelimit-remaining-tokens"] == "400"
    await rl.reconcile(a.reservation, 100)  # the real usage was smaller than the reservation
    c = await rl.acquire(lim, 600, "c", now=T0 + 2)
    assert c.allowed and c.remaining_tokens == 300
    too_big = await rl.acquire(lim, 5000, "d", now=T0 + 3)
    assert not too_big.allowed and too_big.retry_after_s is None and "too large" in too_big.message


async def test_all_limits_admit_or_none_records(state):
    rl = RateLimiter(state)
    key, tenant = Limit("key", "k", rpm=10), Limit("tenant", "t", rpm=1)
    assert (await rl.acquire([key, tenant], 1, "1", now=T0)).allowed
    r = await rl.acquire([key, tenant], 1, "2", now=T0 + 1)
    assert not r.allowed and r.limit == tenant
    # the rejected request was not counted against the key limit: 9 more fit
    got = [(await rl.acquire([key], 1, f"k{i}", now=T0 + 2 + i)).allowed for i in range(10)]
    assert got == [True] * 9 + [False]
    await rl.release(r.reservation)  # None: no-op


async def test_rpm_exact_across_two_replicas_concurrently(redis_url):
    prefix = f"t{uuid.uuid4().hex[:8]}"
    # 160 calls queue for the pools' connections: on a loaded host that took over 2 s, the store went to its
    # outage fallback (tested on its own) and admitted 103-131. The timeout here only bounds a hang.
    a = SharedState(StateSettings(redis_url=redis_url, key_prefix=prefix, socket_timeout_s=30.0))
    b = SharedState(StateSettings(redis_url=redis_url, key_prefix=prefix, socket_timeout_s=30.0))
    try:
        lims = [Limit("key", "shared", rpm=100)]
        ra, rb = RateLimiter(a), RateLimiter(b)
        res = await asyncio.gather(*[(ra if i % 2 else rb).acquire(lims, 1, f"r{i}") for i in range(160)])
        assert sum(r.allowed for r in res) == 100
    finally:
        await a.close()
        await b.close()


async def test_breaker_opens_after_consecutive_failures_and_probes(state):
    br = Breakers(state, BreakerSettings(consecutive_failures=3, open_s=30, min_requests=100))
    t = "up/m"
    for i in range(2):
        assert (await br.record(t, False, status=500, now=T0 + i)).state == "closed"
    s = await br.record(t, False, status=500, now=T0 + 2)
    assert s.state == "open" and s.open_until_ms == T0 + 2 + 30_000
    d = await br.allow(t, now=T0 + 1000)
    assert not d.allowed and d.retry_after_s == pytest.approx(29.002)
    # half-open: one probe at a time
    p1 = await br.allow(t, now=T0 + 30_010)
    p2 = await br.allow(t, now=T0 + 30_011)
    assert p1.allowed and p1.probe and p1.state == "half_open" and not p2.allowed
    # a failed probe re-opens for another open_s
    s = await br.record(t, False, status=502, probe=True, now=T0 + 30_020)
    assert s.state == "open" and s.open_until_ms == T0 + 60_020
    p3 = await br.allow(t, now=T0 + 60_030)
    assert p3.allowed and p3.probe
    s = await br.record(t, True, probe=True, now=T0 + 60_040)
    assert s.state == "closed"
    assert (await br.allow(t, now=T0 + 60_050)).allowed


async def test_breaker_failure_rate_needs_min_requests(state):
    br = Breakers(state, BreakerSettings(failure_rate=0.5, min_requests=10, consecutive_failures=100, window_s=30))
    t = "up/rate"
    for i in range(8):  # 4 ok / 4 failed alternating: below min_requests
        await br.record(t, i % 2 == 0, status=None if i % 2 == 0 else 500, now=T0 + i)
    assert (await br.get(t, now=T0 + 9)).state == "closed"
    await br.record(t, True, now=T0 + 10)
    s = await br.record(t, False, status=500, now=T0 + 11)  # 10 outcomes, 5 failures = 50 %
    assert s.state == "open"
    # outcomes older than the window do not count
    t2 = "up/rate2"
    for i in range(9):
        await br.record(t2, False, status=500, now=T0 + i)
    for i in range(10):
        await br.record(t2, True, now=T0 + 40_000 + i)
    assert (await br.record(t2, False, status=500, now=T0 + 40_100)).state == "closed"


async def test_429_cooldowns_only_move_later(state):
    """429 Retry-After: 1, then (as the half-open probe) a 429 without the header: out for the default 60 s."""
    br = Breakers(state, BreakerSettings(rate_limit_cooldown_s=60, open_s=5))
    t = "agg/model"
    s = await br.record(t, False, status=429, retry_after_s=1, now=T0)
    assert s.state == "open" and s.open_until_ms == T0 + 1000
    d = await br.allow(t, now=T0 + 1100)
    assert d.allowed and d.probe
    s = await br.record(t, False, status=429, probe=True, now=T0 + 1200)
    assert s.state == "open" and s.open_until_ms == T0 + 61_200
    # a later, shorter cooldown (429 with Retry-After: 2) does not cut it short
    s = await br.record(t, False, status=429, retry_after_s=2, now=T0 + 5000)
    assert s.open_until_ms == T0 + 61_200
    assert (await br.get(t, now=T0 + 60_000)).state == "open"
    assert await br.soonest_half_open([t, "other/closed"], now=T0 + 1200) == 0.0
    assert await br.soonest_half_open([t], now=T0 + 1200) == pytest.approx(60.0)
    # a 503 with a long Retry-After extends it
    s = await br.record(t, False, status=503, retry_after_s=120, now=T0 + 6000)
    assert s.open_until_ms == T0 + 126_000
    # a 503 with a short one (a restarting engine replica's engine_loading: Retry-After 5) cools down that long, not
    # open_s (a scale-out trial's replica got no traffic for 30 s after it had loaded)
    s = await Breakers(state, BreakerSettings(open_s=30)).record("rep/m", False, status=503, retry_after_s=5, now=T0)
    assert s.state == "open" and s.open_until_ms == T0 + 5000


async def test_breaker_is_shared_between_replicas(redis_url):
    prefix = f"t{uuid.uuid4().hex[:8]}"
    a = SharedState(StateSettings(redis_url=redis_url, key_prefix=prefix))
    b = SharedState(StateSettings(redis_url=redis_url, key_prefix=prefix))
    try:
        await Breakers(a).record("x/y", False, status=429)
        d = await Breakers(b).allow("x/y")
        assert not d.allowed and d.state == "open" and d.retry_after_s > 50
        # keys are namespaced and expire
        ttl = await b.redis.pttl(f"{prefix}:cb:x/y")
        assert ttl > 60_000
    finally:
        await a.close()
        await b.close()


async def test_a_reset_breaker_is_closed_with_its_failures_forgotten(state):
    """``Breakers.reset`` (a restarted local engine's targets): an open breaker answers closed at once, and one
    failure after it does not reopen it (the window's failures went with the record), in Redis and in process."""
    br = Breakers(state, BreakerSettings(consecutive_failures=2, open_s=600))
    for _ in range(2):
        await br.record("local", False, status=500)
    assert not (await br.allow("local")).allowed
    await br.reset("local", "the local engine restarted")
    assert (await br.allow("local")).allowed and (await br.get("local")).state == "closed"
    assert (await br.record("local", False, status=500)).state == "closed"


def _blackhole() -> tuple[int, socket.socket]:
    """A TCP port that accepts connections and never answers (a hung Redis)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    conns = []

    def accept():
        while True:
            try:
                conns.append(srv.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    return srv.getsockname()[1], srv


@pytest.mark.parametrize("kind", ["dead", "hung"])
async def test_redis_outage_falls_back_in_process(kind):
    if kind == "dead":
        port, srv = free_port(), None
    else:
        port, srv = _blackhole()
    st = SharedState(StateSettings(redis_url=f"redis://127.0.0.1:{port}/0", socket_timeout_s=0.2, reconnect_min_s=5))
    try:
        rl = RateLimiter(st)
        r = await asyncio.wait_for(rl.acquire([Limit("key", "k", rpm=1)], 1, "a"), 5)
        assert r.allowed and st.degraded and st.mode == "degraded"
        r2 = await asyncio.wait_for(rl.acquire([Limit("key", "k", rpm=1)], 1, "b"), 5)
        assert not r2.allowed and r2.status == 429  # the in-process limiter still limits
        br = Breakers(st)
        assert (await br.record("u/m", False, status=429)).state == "open"
        assert not (await br.allow("u/m")).allowed
    finally:
        await st.close()
        if srv:
            srv.close()


async def test_fail_closed_limits_reject_while_redis_is_down():
    st = SharedState(StateSettings(redis_url=f"redis://127.0.0.1:{free_port()}/0", socket_timeout_s=0.2,
                                 fail_closed_limits=True, reconnect_min_s=5))
    try:
        r = await RateLimiter(st).acquire([Limit("key", "k", rpm=10)], 1, "a")
        assert not r.allowed and r.status == 503 and "retry-after" in r.headers()
        assert r.error().code == "rate_limiter_unavailable"
    finally:
        await st.close()


async def test_a_late_admission_script_records_nothing(redis_server):
    """Fail-closed limits with Redis stalled past the caller's timeout: the caller answers 503; the queued script,
    run when Redis wakes, finds its deadline passed and takes no slot (a replicas trial's next request saw
    remaining 8 of 10 after one 503 and no admission)."""
    st = SharedState(StateSettings(redis_url=redis_server.url, socket_timeout_s=0.3, fail_closed_limits=True,
                                   reconnect_min_s=0.05, reconnect_max_s=0.1))
    limit = Limit("tenant", f"late-{uuid.uuid4().hex}", rpm=10)
    try:
        rl = RateLimiter(st)
        warm = await rl.acquire([Limit("tenant", f"warm-{uuid.uuid4().hex}", rpm=10)], 1, "warm")   # script loaded
        assert warm.allowed and not st.degraded
        redis_server.proc.send_signal(signal.SIGSTOP)
        try:
            refused = await rl.acquire([limit], 1, "stalled")
            assert refused.status == 503
            await asyncio.sleep(0.5)                      # the caller is long gone when Redis wakes
        finally:
            redis_server.proc.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 10
        while st.degraded and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        served = await rl.acquire([limit], 1, "next")
        assert served.allowed and served.remaining_requests == 9, served
    finally:
        await st.close()


async def test_rejoins_when_redis_returns_and_pushes_cooldowns(redis_server):
    st = SharedState(StateSettings(redis_url=redis_server.url, socket_timeout_s=0.3, reconnect_min_s=0.05,
                                 reconnect_max_s=0.2))
    other = SharedState(StateSettings(redis_url=redis_server.url, socket_timeout_s=0.3))
    try:
        br = Breakers(st)
        assert (await br.allow("a/b")).allowed and st.mode == "redis"
        redis_server.stop()
        s = await br.record("a/b", False, status=429)  # opened in process during the outage
        assert s.state == "open" and st.degraded
        rl = RateLimiter(st)
        assert (await rl.acquire([Limit("tenant", "t", rpm=2)], 5, "during-outage")).allowed
        redis_server.start()
        for _ in range(200):
            if st.rejoins:
                break
            await asyncio.sleep(0.05)
        assert not st.degraded and st.outages == 1 and st.rejoins == 1
        # the cooldown opened during the outage reached Redis: another replica sees it
        d = await Breakers(other).allow("a/b")
        assert not d.allowed and d.state == "open"
        assert (await RateLimiter(st).acquire([Limit("key", "z", rpm=1)], 1, "q")).allowed
        # the admission counted in process during the outage was added to Redis: one of 2 left
        r = await RateLimiter(other).acquire([Limit("tenant", "t", rpm=2)], 5, "after")
        assert r.allowed and r.remaining_requests == 0
        assert st.mode == "redis"
    finally:
        await st.close()
        await other.close()


async def test_health_passive_and_active(state):
    h = HealthTracker(state)
    for ok in (True, True, False, False, False):
        await h.record("up/m", ok, latency_s=0.5, ttft_s=0.1)
    s = await h.stats("up/m")
    assert s.requests == 5 and s.errors == 3 and s.latency_s == pytest.approx(0.5) and s.ttft_s == pytest.approx(0.1)
    assert not s.healthy(h.config)

    async def good():
        return True

    async def bad():
        raise ConnectionRefusedError("down")

    res = await ActiveProber(h, {"good/x": good, "bad/x": bad}).probe_once()
    assert res == {"good/x": True, "bad/x": False}
    assert (await h.stats("good/x")).probe_ok is True
    bad_stats = await h.stats("bad/x")
    assert bad_stats.probe_ok is False and "down" in bad_stats.probe_error and not bad_stats.healthy(h.config)


async def test_a_target_failing_its_probes_is_said_once_and_its_return_too(state, caplog):
    """A new user's trial: a canary backend nobody listened for was unavailable in /health/ready only. Two
    failed rounds in a row are logged once (one may be a blip), and the first pass after them."""
    import logging

    results = [False, False, False, True, False, True]

    async def flaky():
        if not results.pop(0):
            raise ConnectionRefusedError("refused")

    prober = ActiveProber(HealthTracker(state), {"canary/x": flaky})
    said = []
    with caplog.at_level(logging.INFO, logger="tandem.health"):
        for _ in range(6):
            await prober.probe_once()
            said.append([r.getMessage() for r in caplog.records])
            caplog.clear()
    assert said == [[], ["health probe of canary/x failed 2 times in a row: ConnectionRefusedError: refused "
                         "(/health/ready lists it unavailable)"], [], ["health probe of canary/x passes again"],
                    [], []]


async def test_a_reload_turns_probing_off_and_on(state, monkeypatch):
    """``interval_s`` is read each round: a reload to 0 stops probing (an observability trial's reload to 0 probed
    each upstream ~470 times a second), one from 0 starts it (it never started)."""
    from gateway.resilience import health

    monkeypatch.setattr(health, "OFF_RECHECK_S", 0.01)
    calls: list[float] = []

    async def probe():
        calls.append(time.monotonic())

    tracker = HealthTracker(state, HealthSettings(interval_s=0))
    prober = ActiveProber(tracker, {"up/x": probe})
    prober.start()
    try:
        await asyncio.sleep(0.1)
        assert calls == []                                   # off from the start
        tracker.config = HealthSettings(interval_s=0.02)     # what a reload does (Resilience.apply)
        for _ in range(500):
            if len(calls) >= 3:
                break
            await asyncio.sleep(0.01)
        assert len(calls) >= 3
        tracker.config = HealthSettings(interval_s=0)
        await asyncio.sleep(0.1)
        n = len(calls)
        await asyncio.sleep(0.2)
        assert len(calls) == n                               # off again: no round at all, let alone a tight loop
    finally:
        await prober.stop()


async def test_replica_trusts_closed_for_cache_s_only(redis_url):
    prefix = f"t{uuid.uuid4().hex[:8]}"
    a = SharedState(StateSettings(redis_url=redis_url, key_prefix=prefix))
    b = SharedState(StateSettings(redis_url=redis_url, key_prefix=prefix))
    try:
        ba, bb = Breakers(a), Breakers(b, BreakerSettings(cache_s=0.25))
        assert (await bb.allow("c/m", now=T0)).allowed            # B learns "closed" from Redis
        await ba.record("c/m", False, status=429, now=T0 + 10)     # A opens it for 60 s
        assert (await bb.allow("c/m", now=T0 + 100)).allowed      # B's view is at most cache_s old
        d = await bb.allow("c/m", now=T0 + 300)                    # then B asks Redis again
        assert not d.allowed and d.retry_after_s == pytest.approx(59.71)
        assert not (await bb.allow("c/m", now=T0 + 30_000)).allowed  # still open in Redis
    finally:
        await a.close()
        await b.close()


async def test_a_breaker_record_that_leaves_redis_closes_on_every_replica_within_cache_s(redis_url):
    """An operator deletes an open breaker's record (``DEL tandem:cb:<id>``; an eviction, failover or flush does the
    same): a replica that learnt "open until an hour from now" routes to the target again after ``cache_s``, as
    its readiness (``get``) says at once, instead of skipping it for the rest of the cooldown."""
    import redis.asyncio as aioredis

    prefix = f"t{uuid.uuid4().hex[:8]}"
    a = SharedState(StateSettings(redis_url=redis_url, key_prefix=prefix))
    b = SharedState(StateSettings(redis_url=redis_url, key_prefix=prefix))
    r = aioredis.Redis.from_url(redis_url)
    try:
        ba, bb = Breakers(a), Breakers(b, BreakerSettings(cache_s=0.25))
        await ba.record("p/m", False, status=429, retry_after_s=3600, now=T0)   # A opens it for an hour
        d = await bb.allow("p/m", now=T0 + 10)                                   # B learns "open" from Redis
        assert not d.allowed and d.retry_after_s == pytest.approx(3599.99)
        assert await r.delete(b.key("cb", "p/m")) == 1                            # the record leaves Redis
        assert (await bb.get("p/m", now=T0 + 20)).state == "closed"               # readiness: at once
        d = await bb.allow("p/m", now=T0 + 10 + 250)                              # routing: within cache_s
        assert d.allowed and d.state == "closed"
        assert (await ba.allow("p/m", now=T0 + 10 + 250)).allowed                 # and on the replica that opened it
    finally:
        await r.aclose()
        await a.close()
        await b.close()
