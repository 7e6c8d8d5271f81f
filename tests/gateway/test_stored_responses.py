"""Stored Responses in process (no Redis, or Redis unreachable): per tenant, a tenant's records never push out
another's (a security trial's tenant evicted another's conversations by storing 10,050 cached answers), and each
tenant's count and bytes are bounded, its own oldest dropped first, its newest kept."""

from __future__ import annotations

from gateway.state import SharedState
from gateway.stored_responses import ResponseStore, StoredResponse


def _record(tenant: str, rid: str, text: str = "x") -> StoredResponse:
    return StoredResponse(tenant, {"id": rid, "output": [{"type": "message", "content": text}]}, [], [])


async def test_one_tenants_records_never_evict_anothers():
    store = ResponseStore(SharedState(), max_in_process=5)
    await store.put(_record("alpha", "resp_a"))
    for i in range(50):                                   # beta stores ten times its bound
        await store.put(_record("beta", f"resp_b{i}"))
    assert (await store.get("resp_a", "alpha")).response["id"] == "resp_a"
    assert await store.get("resp_a", "beta") is None and not await store.delete("resp_a", "beta")
    kept = [i for i in range(50) if await store.get(f"resp_b{i}", "beta") is not None]
    assert kept == list(range(45, 50))                    # beta's own oldest went first


async def test_a_tenants_bytes_are_bounded_and_its_newest_record_is_kept():
    store = ResponseStore(SharedState(), max_bytes_in_process=3_000)
    for i in range(4):
        await store.put(_record("alpha", f"resp_{i}", "y" * 1_000))
    assert [await store.get(f"resp_{i}", "alpha") is not None for i in range(4)] == [False, False, True, True]
    await store.put(_record("alpha", "resp_big", "z" * 10_000))     # over the bound alone: kept, the rest dropped
    assert await store.get("resp_big", "alpha") is not None and await store.get("resp_3", "alpha") is None
    assert await store.delete("resp_big", "alpha") and await store.get("resp_big", "alpha") is None
    assert store._bytes["alpha"] == 0


async def test_an_expired_record_is_gone():
    store = ResponseStore(SharedState(), ttl_s=-1)
    await store.put(_record("alpha", "resp_old"))
    assert await store.get("resp_old", "alpha") is None and store._bytes["alpha"] == 0
