"""KVCacheManager: prefix-cache hits, the last-token cap, copy-on-write after a
fork, swap out/in, freeing and usage."""

import os
import subprocess
import sys

import pytest

from engine.core.kv_cache_manager import KVCacheManager, hash_block_tokens
from engine.core.request import Request
from engine.sampling_params import SamplingParams

BS = 16


def req(rid, tokens, max_tokens=8):
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens), max_tokens=max_tokens)


def run_prefill(kv, r):
    """Admit ``r`` like the scheduler: lookup, allocate, compute everything but
    nothing sampled; returns the number of cached tokens."""
    blocks, hit = kv.get_computed_blocks(r)
    assert kv.allocate_slots(r, r.num_tokens - hit, blocks)
    r.num_computed_tokens = r.num_tokens
    kv.cache_full_blocks(r)
    return hit


def test_hash_is_stable_and_chained():
    h1 = hash_block_tokens(None, [1, 2, 3])
    assert h1 == hash_block_tokens(None, (1, 2, 3)) and len(h1) == 32
    assert hash_block_tokens(h1, [4]) != hash_block_tokens(None, [4])
    assert hash_block_tokens(None, [1, 2, 3], ("lora", 1)) != h1
    # Stable across processes, whatever PYTHONHASHSEED is (unlike hash()).
    code = "from engine.core.kv_cache_manager import hash_block_tokens as h; print(h(h(None, [1, 2]), [3], ('x',)).hex())"
    digests = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                              env={**os.environ, "PYTHONHASHSEED": seed}).stdout.strip() for seed in ("1", "2")}
    assert digests == {hash_block_tokens(hash_block_tokens(None, [1, 2]), [3], ("x",)).hex()}


def test_cache_salt_separates_prefix_caches():
    """vLLM's ``cache_salt``: only requests with the same salt share blocks; the salt is in the first block's
    hash, and every later block's hash chains from it."""
    kv = KVCacheManager(block_size=BS, num_blocks=20)
    prefix = list(range(100, 148))

    def salted(rid, salt):
        r = req(rid, prefix + [1, 2])
        r.cache_salt = salt
        return r

    assert run_prefill(kv, salted("a", "tenant-a")) == 0
    assert kv.get_computed_blocks(salted("b", "tenant-b"))[1] == 0
    assert kv.get_computed_blocks(req("unsalted", prefix + [1, 2]))[1] == 0
    assert kv.get_computed_blocks(salted("a2", "tenant-a"))[1] == 48
    a, b = kv.req_to_block_hashes["a"], kv.req_to_block_hashes["b"]
    assert all(x != y for x, y in zip(a, b))
    assert a[0] == hash_block_tokens(None, prefix[:BS], ("tenant-a",))
    assert a[1] == hash_block_tokens(a[0], prefix[BS:2 * BS])   # later blocks: no extra key, the chain carries it
    kv.check_invariants()


def test_shared_48_token_prefix_hits_three_blocks():
    kv = KVCacheManager(block_size=BS, num_blocks=20)
    prefix = list(range(100, 148))
    a = req("a", prefix + [1, 2, 3, 4, 5])
    assert run_prefill(kv, a) == 0
    b = req("b", prefix + [9, 9])
    blocks, hit = kv.get_computed_blocks(b)
    assert hit == 48 and [x.block_id for x in blocks] == kv.get_block_ids("a")[:3]
    assert kv.allocate_slots(b, b.num_tokens - hit, blocks)
    assert kv.get_block_ids("b")[:3] == kv.get_block_ids("a")[:3]
    assert all(kv.block_pool.blocks[i].ref_cnt == 2 for i in kv.get_block_ids("a")[:3])
    kv.check_invariants()


def test_exactly_three_full_blocks_recomputes_last_token():
    kv = KVCacheManager(block_size=BS, num_blocks=20)
    tokens = list(range(48))
    assert run_prefill(kv, req("a", tokens)) == 0
    kv.free(req("a", tokens))
    b = req("b", tokens)
    blocks, hit = kv.get_computed_blocks(b)
    assert hit == 32 and len(blocks) == 2  # capped at (48 - 1) // 16 blocks
    assert kv.allocate_slots(b, 16, blocks)
    assert kv.get_num_blocks("b") == 3
    # Longer prompts with the same 48 tokens do hit all three blocks.
    blocks, hit = kv.get_computed_blocks(req("c", tokens + [7]))
    assert hit == 48
    kv.check_invariants()


def test_freed_cached_blocks_hit_until_evicted():
    kv = KVCacheManager(block_size=4, num_blocks=5)  # 4 usable blocks
    a = req("a", range(9))  # 3 blocks, 2 full
    run_prefill(kv, a)
    kv.free(a)
    assert kv.usage == 0.0
    _, hit = kv.get_computed_blocks(req("a2", range(9)))
    assert hit == 8
    # A new request taking every block evicts the cached ones (LRU) ...
    c = req("c", range(50, 66))
    assert run_prefill(kv, c) == 0
    assert kv.usage == 1.0
    kv.free(c)
    _, hit = kv.get_computed_blocks(req("a3", range(9)))
    assert hit == 0
    kv.check_invariants()


def test_caching_disabled_never_hits():
    kv = KVCacheManager(block_size=4, num_blocks=10, enable_caching=False)
    run_prefill(kv, req("a", range(12)))
    assert kv.get_computed_blocks(req("b", range(12))) == ([], 0)


def test_allocate_fails_atomically():
    kv = KVCacheManager(block_size=4, num_blocks=4)  # 3 usable
    a = req("a", range(8))
    assert kv.allocate_slots(a, 8)
    before = kv.block_pool.get_num_free_blocks()
    assert kv.allocate_slots(req("b", range(9)), 9) is False
    assert kv.block_pool.get_num_free_blocks() == before and kv.get_num_blocks("b") == 0
    kv.check_invariants()


def test_evictable_hit_blocks_count_against_free_space():
    kv = KVCacheManager(block_size=4, num_blocks=4)  # 3 usable
    a = req("a", range(9))
    run_prefill(kv, a)  # 3 blocks, 2 cached
    kv.free(a)
    b = req("b", list(range(8)) + [50, 51, 52, 53, 54])  # hits 2 blocks, needs 2 more
    blocks, hit = kv.get_computed_blocks(b)
    assert hit == 8
    assert kv.allocate_slots(b, 5, blocks) is False  # 2 evictable + 2 new > 3 free
    assert all(x.ref_cnt == 0 for x in blocks)
    kv.check_invariants()


def test_fork_then_copy_on_write():
    kv = KVCacheManager(block_size=4, num_blocks=20)
    prompt = list(range(10))  # leader computes 9 tokens: 2 full blocks + 1 partial
    leader, s1, s2 = (req(f"p-{i}", prompt) for i in range(3))
    assert kv.allocate_slots(leader, 9)
    leader.num_computed_tokens = 9
    kv.cache_full_blocks(leader)
    for s in (s1, s2):
        kv.fork(leader, s)
        s.num_computed_tokens = 9
    shared = kv.get_block_ids(leader.request_id)
    assert kv.get_block_ids("p-1") == kv.get_block_ids("p-2") == shared
    assert all(kv.block_pool.blocks[i].ref_cnt == 3 for i in shared)
    # Each member writes its last prompt token into the shared partial block.
    assert kv.allocate_slots(leader, 1)
    assert kv.allocate_slots(s1, 1)
    assert kv.allocate_slots(s2, 1)
    copies = kv.take_blocks_to_copy()
    assert len(copies) == 2 and all(src == shared[2] for src, _ in copies)
    dsts = {dst for _, dst in copies}
    tables = [kv.get_block_ids(r.request_id) for r in (leader, s1, s2)]
    assert {t[2] for t in tables} == dsts | {shared[2]}  # three private last blocks
    assert all(t[:2] == shared[:2] for t in tables)  # full blocks still shared
    assert kv.block_pool.blocks[shared[2]].ref_cnt == 1
    assert kv.take_blocks_to_copy() == []
    kv.check_invariants()
    for r in (leader, s1, s2):
        kv.free(r)
    assert kv.usage == 0.0
    kv.check_invariants()


def test_fork_at_block_boundary_needs_no_copy():
    kv = KVCacheManager(block_size=4, num_blocks=20)
    leader, child = req("l", range(9)), req("c", range(9))
    assert kv.allocate_slots(leader, 8)
    leader.num_computed_tokens = 8
    kv.fork(leader, child)
    child.num_computed_tokens = 8
    assert kv.allocate_slots(leader, 1) and kv.allocate_slots(child, 1)
    assert kv.take_blocks_to_copy() == []
    assert kv.get_block_ids("l")[2] != kv.get_block_ids("c")[2]


def test_swap_out_and_in_round_trip():
    kv = KVCacheManager(block_size=4, num_blocks=6, num_cpu_blocks=4)
    a = req("a", range(10))
    assert kv.allocate_slots(a, 10)
    a.num_computed_tokens = 10
    dev = kv.get_block_ids("a")
    assert kv.can_swap_out(a)
    out = kv.swap_out(a)
    assert [d for d, _ in out] == dev and len({c for _, c in out}) == 3
    assert kv.usage == 0.0 and kv.num_free_cpu_blocks == 1
    kv.check_invariants()
    assert kv.can_swap_in(a, 1)
    back = kv.swap_in(a)
    assert [c for c, _ in back] == [c for _, c in out]
    assert kv.get_num_blocks("a") == 3 and kv.num_free_cpu_blocks == 4
    assert kv.allocate_slots(a, 1)
    kv.check_invariants()
    # Not enough CPU blocks: cannot swap.
    big = req("big", range(20))
    assert kv.allocate_slots(big, 8)
    small_cpu = KVCacheManager(block_size=4, num_blocks=6, num_cpu_blocks=1)
    assert small_cpu.allocate_slots(big, 8) and not small_cpu.can_swap_out(big)
    with pytest.raises(RuntimeError):
        small_cpu.swap_out(big)


def test_free_is_idempotent_and_releases_cpu_blocks():
    kv = KVCacheManager(block_size=4, num_blocks=6, num_cpu_blocks=4)
    a = req("a", range(6))
    kv.allocate_slots(a, 6)
    kv.swap_out(a)
    kv.free(a)
    kv.free(a)
    assert kv.num_free_cpu_blocks == 4 and kv.usage == 0.0
    kv.check_invariants()


def test_a_follow_up_prompt_reads_the_earlier_answer():
    """Turn 1: a 20-token prompt and a 28-token answer (3 full blocks, the
    last two holding generated positions). Turn 2's prompt starts with all
    48 tokens and reads all three blocks: a block's key does not depend on
    whether its tokens were prompt or generated (the model computes both
    kinds alike, bit for bit, in batch-invariant mode)."""
    kv = KVCacheManager(block_size=BS, num_blocks=20)
    first = req("a", range(100, 120), max_tokens=28)
    run_prefill(kv, first)
    for t in range(28):
        first.append_output_token_ids(500 + t)
        assert kv.allocate_slots(first, 1)
        first.num_computed_tokens += 1
        kv.cache_full_blocks(first)
    kv.free(first)
    follow_up = req("b", list(range(100, 120)) + [500 + t for t in range(28)] + [7, 8, 9])
    blocks, hit = kv.get_computed_blocks(follow_up)
    assert hit == len(blocks) * BS == 48
    kv.check_invariants()
