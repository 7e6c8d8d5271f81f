"""Physical KV-cache blocks: reference counts, an LRU free queue and the
prefix-cache map (vLLM v1's ``BlockPool`` design, ``vllm/v1/core/block_pool.py``).

A block is ``block_size`` token slots in every layer's KV pool; this module
only tracks block *ids*: no tensors live here.

Invariants (checked by ``BlockPool.check_invariants`` in tests):
    * every block's ``ref_cnt >= 0``;
    * a block (other than the null block) is in the free queue iff its
      ``ref_cnt == 0``;
    * ``num free blocks + num used blocks == num_blocks - 1`` (the null block,
      id 0, is never handed out and counts as neither);
    * ``cached_block_hash_to_block[h].block_hash == h`` for every entry, and a
      block carries a ``block_hash`` iff it is the map's entry for that hash.
"""

from __future__ import annotations

from collections.abc import Iterable

from engine.kv_events import MEDIUM_GPU, BlockRemoved, BlockStored, external_block_hash

# A block hash: sha256 digest of (parent hash, token ids, extra keys); see
# engine.core.kv_cache_manager.hash_block_tokens.
BlockHash = bytes


class KVCacheBlock:
    """Metadata of one physical KV-cache block.

    Attributes:
        block_id: index into every layer's KV pool, 0..num_blocks-1.
        ref_cnt: number of block tables holding this block (>= 0).
        block_hash: prefix-cache hash when the block is full and cached, else
            None. Kept after the block is freed (lazy eviction) and dropped
            only when the block is reallocated.
        prev_free_block, next_free_block: links of the free queue (None when
            the block is not in it).
        is_null: True only for the null block (id 0).
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free_block", "next_free_block", "is_null")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None
        self.is_null = False

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={h})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks in eviction order (LRU first).

    ``popleft`` takes the head (least recently freed); ``append`` puts a freed
    block at the tail; ``remove`` unlinks a block from the middle in O(1)
    (a prefix-cache hit on a free cached block). Two sentinel nodes avoid
    special cases at the ends.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free_block = self._tail
        self._tail.prev_free_block = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        """Remove and return the head (least recently freed) block.

        Raises:
            ValueError: the queue is empty.
        """
        block = self._head.next_free_block
        if block is self._tail:
            raise ValueError("no free KV-cache block")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` (which must be in the queue) in O(1)."""
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise RuntimeError(f"{block} is not in the free queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put ``block`` (not in the queue) at the tail (evicted last)."""
        if block.prev_free_block is not None or block.next_free_block is not None:
            raise RuntimeError(f"{block} is already in the free queue")
        last = self._tail.prev_free_block
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self._tail
        self._tail.prev_free_block = block
        self.num_free_blocks += 1

    def __contains__(self, block: KVCacheBlock) -> bool:
        return block.prev_free_block is not None

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """The free blocks, head (next evicted) first. O(n); for tests and debugging."""
        out = []
        node = self._head.next_free_block
        while node is not self._tail:
            out.append(node)
            node = node.next_free_block
        return out


class BlockPool:
    """All device KV-cache blocks, their free queue and the prefix-cache map.

    Block 0 is the null block: reserved (e.g. as padding in block tables),
    never allocated, never freed, never cached. So ``num_blocks - 1`` blocks
    are usable.

    Args:
        num_blocks: total blocks, including the null block (>= 2).
        enable_caching: keep full blocks findable by hash after they are freed.

    Raises:
        ValueError: ``num_blocks < 2``.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        # hash -> the block holding those tokens (one block per hash: a second
        # block that computes the same tokens simply is not cached).
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}
        # (hash, cached?) in order, for the front end's copy of the cache (``engine/core/ttft.py``); None: not kept.
        # Bounded: an event past 4 x num_blocks undrained ones drops them and sets ``kv_events_lost`` (the reader
        # resyncs the whole cache instead), so a pool nobody drains (offline use) does not grow forever.
        self.kv_events: list[tuple[BlockHash, bool]] | None = None
        self.kv_events_lost = False
        # vLLM's KV events (``engine/kv_events.py``) in the order they happened, for the ZMQ publisher; None: not
        # kept (no publisher). Drained by the engine core after every step, so never longer than one step's.
        self.kv_cache_events: list[BlockStored | BlockRemoved] | None = None

    # -- allocation ---------------------------------------------------------
    def get_num_free_blocks(self) -> int:
        """Blocks with ``ref_cnt == 0`` (including evictable cached ones)."""
        return self.free_block_queue.num_free_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop ``num_blocks`` blocks from the head of the free queue, evict
        their cached hash if any (lazy eviction), and set ``ref_cnt = 1``.

        The blocks come back in ascending id (address) order: which blocks
        are evicted is the LRU queue's choice, but a request's table then
        walks the pool upwards. Requests free in reverse order, so without the
        sort a pool that has been used hands a request its blocks in
        descending runs.

        Raises:
            ValueError: fewer than ``num_blocks`` free blocks (nothing popped).
        """
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"cannot get {num_blocks} free blocks, only {self.get_num_free_blocks()} left")
        out = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            self._evict_cached_block(block)
            assert block.ref_cnt == 0, block
            block.ref_cnt = 1
            out.append(block)
        out.sort(key=lambda b: b.block_id)
        return out

    def _evict_cached_block(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        if self.cached_block_hash_to_block.get(block.block_hash) is block:
            del self.cached_block_hash_to_block[block.block_hash]
            self._kv_event(block.block_hash, False)
            if self.kv_cache_events is not None:
                self.kv_cache_events.append(BlockRemoved([external_block_hash(block.block_hash)], MEDIUM_GPU))
        block.block_hash = None

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference on each block (a prefix-cache hit or a fork).
        A block that was free (ref_cnt 0, cached) leaves the free queue."""
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def refresh(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Move the free blocks among ``ordered_blocks`` (cached, ``ref_cnt``
        0: evictable) to the tail of the free queue, in the order given (pass
        a prefix in REVERSE order, as to ``free_blocks``, so that its first
        block is evicted last); blocks in use are left alone. For a queued
        request whose prefix is cached: see ``KVCacheManager.refresh_prefix``."""
        for block in ordered_blocks:
            if block.ref_cnt == 0 and not block.is_null:
                self.free_block_queue.remove(block)
                self.free_block_queue.append(block)

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block; a block reaching 0 goes to the
        tail of the free queue (its hash stays: lazy eviction).

        Callers pass a request's blocks in REVERSE order, so that the tail of a
        sequence (least likely to be shared as a prefix) is evicted first.

        Raises:
            RuntimeError: a block's ref_cnt would go negative (double free).
        """
        for block in ordered_blocks:
            if block.is_null:
                continue
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    # -- prefix cache -------------------------------------------------------
    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """The block caching ``block_hash``, or None (free or in use)."""
        return self.cached_block_hash_to_block.get(block_hash)

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> bool:
        """Register a full, computed block under ``block_hash``. Returns False
        (and leaves the block uncached) when caching is off, the block is
        already cached, or another block already holds that hash."""
        if not self.enable_caching or block.is_null or block.block_hash is not None:
            return False
        if block_hash in self.cached_block_hash_to_block:
            return False
        block.block_hash = block_hash
        self.cached_block_hash_to_block[block_hash] = block
        self._kv_event(block_hash, True)
        return True

    def record_stored(self, hashes: list[BlockHash], parent: BlockHash | None, token_ids: list[int],
                      block_size: int) -> None:
        """Record that consecutive blocks of one sequence entered the cache (``hashes``, in order, after the
        block hashed ``parent``; ``token_ids``: their tokens, ``block_size`` each) when events are kept."""
        if self.kv_cache_events is None or not hashes:
            return
        self.kv_cache_events.append(BlockStored(
            [external_block_hash(h) for h in hashes], None if parent is None else external_block_hash(parent),
            token_ids, block_size, None, MEDIUM_GPU))

    def _kv_event(self, block_hash: BlockHash, cached: bool) -> None:
        """Record one event in ``kv_events`` when kept (see ``__init__``)."""
        events = self.kv_events
        if events is None:
            return
        if len(events) >= 4 * self.num_blocks:
            events.clear()
            self.kv_events_lost = True
        events.append((block_hash, cached))

    # -- metrics and checks -------------------------------------------------
    def get_usage(self) -> float:
        """Fraction (0..1) of usable (non-null) blocks with ``ref_cnt > 0``."""
        usable = self.num_blocks - 1
        return (usable - self.get_num_free_blocks()) / usable

    def check_invariants(self) -> None:
        """Assert the invariants in the module docstring (O(num_blocks); tests).

        Raises:
            AssertionError: an invariant does not hold.
        """
        in_queue = {b.block_id for b in self.free_block_queue.get_all_free_blocks()}
        assert len(in_queue) == self.free_block_queue.num_free_blocks, "free queue count drifted"
        assert 0 not in in_queue, "null block in the free queue"
        used = 0
        for block in self.blocks[1:]:
            assert block.ref_cnt >= 0, f"negative ref_cnt: {block}"
            assert (block.ref_cnt == 0) == (block.block_id in in_queue), f"free-queue membership wrong: {block}"
            used += block.ref_cnt > 0
            if block.block_hash is not None:
                assert self.cached_block_hash_to_block.get(block.block_hash) is block, f"stale hash on {block}"
        assert used + len(in_queue) == self.num_blocks - 1
        for h, block in self.cached_block_hash_to_block.items():
            assert block.block_hash == h and not block.is_null
