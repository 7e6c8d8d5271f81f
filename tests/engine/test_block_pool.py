"""BlockPool and its free queue: LRU order, O(1) removal, null block, lazy eviction."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock


def ids(blocks):
    return [b.block_id for b in blocks]


def test_free_queue_fifo_and_middle_removal():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks)
    assert q.num_free_blocks == 5
    q.remove(blocks[2])
    assert ids(q.get_all_free_blocks()) == [0, 1, 3, 4]
    assert blocks[2] not in q and blocks[3] in q
    assert q.popleft() is blocks[0]
    q.append(blocks[2])
    assert ids(q.get_all_free_blocks()) == [1, 3, 4, 2]
    assert q.num_free_blocks == 4
    with pytest.raises(RuntimeError):
        q.append(blocks[2])
    with pytest.raises(RuntimeError):
        q.remove(blocks[0])
    for _ in range(4):
        q.popleft()
    with pytest.raises(ValueError):
        q.popleft()


def test_null_block_is_never_allocated():
    pool = BlockPool(4)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert pool.get_num_free_blocks() == 3
    got = pool.get_new_blocks(3)
    assert 0 not in ids(got)
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    assert pool.get_usage() == 1.0
    pool.free_blocks([pool.null_block])  # ignored
    pool.check_invariants()
    with pytest.raises(ValueError):
        BlockPool(1)


def test_reverse_free_evicts_tail_first():
    pool = BlockPool(5)
    seq = pool.get_new_blocks(3)  # ids 1, 2, 3
    pool.free_blocks(reversed(seq))
    # The sequence's last block is evicted first, its first block last.
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [4, 3, 2, 1]
    pool.check_invariants()


def test_new_blocks_come_in_address_order_after_reverse_free():
    pool = BlockPool(8)
    first = pool.get_new_blocks(3)
    rest = pool.get_new_blocks(4)
    pool.free_blocks(reversed(first))
    pool.free_blocks(reversed(rest))
    # LRU picks the same blocks as before (first's, tail first), handed out ascending.
    assert ids(pool.get_new_blocks(4)) == [1, 2, 3, 7]
    pool.check_invariants()


def test_double_free_raises():
    pool = BlockPool(3)
    (b,) = pool.get_new_blocks(1)
    pool.free_blocks([b])
    with pytest.raises(RuntimeError):
        pool.free_blocks([b])


def test_touch_removes_free_cached_block_and_lazy_eviction():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    assert pool.cache_block(a, b"h1")
    assert not pool.cache_block(b, b"h1")  # hash taken by a
    pool.free_blocks([b, a])
    # Freed but still cached (lazy eviction).
    assert pool.get_cached_block(b"h1") is a and a.block_hash == b"h1"
    pool.touch([a])  # cache hit on a free block
    assert a.ref_cnt == 1 and a not in pool.free_block_queue
    pool.touch([a])
    assert a.ref_cnt == 2
    pool.check_invariants()
    pool.free_blocks([a, a])
    # Reallocating every free block evicts a's hash.
    got = pool.get_new_blocks(3)
    assert a in got and a.block_hash is None and pool.get_cached_block(b"h1") is None
    pool.check_invariants()


def test_caching_disabled_caches_nothing():
    pool = BlockPool(3, enable_caching=False)
    (a,) = pool.get_new_blocks(1)
    assert not pool.cache_block(a, b"x")
    assert pool.get_cached_block(b"x") is None


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "free", "cache", "touch"]), st.integers(0, 50)), max_size=60))
def test_pool_random_ops_keep_invariants(ops):
    pool = BlockPool(9)
    held: list = []  # one entry per reference
    for op, x in ops:
        if op == "alloc":
            n = x % 4
            if n <= pool.get_num_free_blocks():
                held.extend(pool.get_new_blocks(n))
            else:
                with pytest.raises(ValueError):
                    pool.get_new_blocks(n)
        elif op == "free" and held:
            pool.free_blocks([held.pop(x % len(held))])
        elif op == "cache" and held:
            pool.cache_block(held[x % len(held)], bytes([x % 5]))
        elif op == "touch":
            block = pool.get_cached_block(bytes([x % 5]))
            if block is not None:
                pool.touch([block])
                held.append(block)
        pool.check_invariants()
        for b in pool.blocks[1:]:
            assert b.ref_cnt == sum(h is b for h in held)
    pool.free_blocks(reversed(held))
    assert pool.get_num_free_blocks() == 8 and pool.get_usage() == 0.0
