"""The cache store's two implementations (a Lua script per operation on Redis, its in-process twin) answer the
same operation sequence, at the same explicit clock, the same way: hits, misses, expiry, LRU eviction by entry
count and by bytes, and a switched-off key space."""

from __future__ import annotations

import asyncio
import uuid

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.cache.store import Bounds, CacheStore
from gateway.config.schema import StateSettings
from gateway.state import SharedState, now_ms

ops = st.lists(st.tuples(st.sampled_from(["get", "put", "put"]), st.integers(0, 6), st.integers(0, 3000),
                         st.text(alphabet="ab\u00e9", max_size=12)), max_size=30)


def on_both(redis_url: str, scenario):
    """``await scenario(store, t0)`` on a Redis-backed and an in-process store; both results."""

    async def both():
        redis_state = SharedState(StateSettings(redis_url=redis_url, key_prefix=f"c{uuid.uuid4().hex[:10]}",
                                              socket_timeout_s=5.0))
        t0 = now_ms()
        try:
            on_redis = await scenario(CacheStore(redis_state), t0)
            assert redis_state.mode == "redis"          # the Lua scripts ran: no silent fallback
            return on_redis, await scenario(CacheStore(SharedState(StateSettings())), t0)
        finally:
            await redis_state.close()

    return asyncio.run(both())


@settings(max_examples=15, deadline=None)
@given(ops, st.sampled_from([None, 1, 3]), st.sampled_from([None, 8, 20]))
def test_redis_and_in_process_stores_agree(redis_url, sequence, max_entries, max_bytes):
    bounds = Bounds(ttl_ms=6000, max_entries=max_entries, max_bytes=max_bytes)

    async def scenario(store, t0):
        out, t = [], t0
        for op, key, dt, value in sequence:
            t += dt
            if op == "get":
                out.append(await store.get("r:fp", f"k{key}", t))
            else:
                out.append(await store.put("r:fp", f"k{key}", value, t, bounds))
        return out

    on_redis, in_process = on_both(redis_url, scenario)
    assert on_redis == in_process


def test_ttl_lru_bounds_and_switch_off(redis_url):
    async def scenario(store, t0):
        b = Bounds(ttl_ms=10_000, max_entries=2)
        await store.put("s", "a", "1", t0, b)
        await store.put("s", "b", "2", t0, b)
        hit_a = await store.get("s", "a", t0 + 1)               # a is now the most recently used
        evicted = await store.put("s", "c", "3", t0 + 2, b)     # evicts b, the least recently used
        after = [await store.get("s", k, t0 + 3) for k in "abc"]
        expired = await store.get("s", "c", t0 + 2 + 10_000)    # stored at t0 + 2 for 10 s
        by_bytes = await store.put("s", "d", "x" * 5, t0 + 4, Bounds(ttl_ms=10_000, max_bytes=5))
        await store.switch_off("s")
        return hit_a, evicted, after, expired, by_bytes, await store.get("s", "d", t0 + 5), \
            await store.get("other", "d", t0 + 5)

    on_redis, in_process = on_both(redis_url, scenario)
    assert on_redis == in_process == (
        ("hit", "1"), 1, [("hit", "1"), ("miss", None), ("hit", "3")], ("miss", None), 1, ("off", None),
        ("miss", None))
