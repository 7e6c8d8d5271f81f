"""Block tables, automatic prefix caching, copy-on-write and CPU swap space.

Design after vLLM: v1's ``KVCacheManager`` (prefix caching with hash chains,
lazy eviction, ``allocate_slots``) and v0's block manager (fork with
copy-on-write for parallel sampling, swapping to CPU blocks).

Block hash (prefix caching, vLLM's "automatic prefix caching"):
    ``hash(block i) = sha256(pickle((hash(block i-1) or None, tuple(token ids
    of block i), extra_keys)))`` as a 32-byte digest. sha256 over a pickle of
    ints/bytes/None is stable across processes and Python runs (unlike
    ``hash()`` of str) and collision-resistant, so a hit really means "same
    prefix". Only FULL blocks are hashed and cached. A request's
    ``cache_salt`` (vLLM's) is the first block's extra key: every later hash
    chains from it, so requests with different salts share no block.

Invariants (checked in tests through ``check_invariants``):
    * ref_cnt >= 0 for every block; a block is in the free queue iff
      ref_cnt == 0;
    * a block's ref_cnt == the number of block tables holding it;
    * num free + num used == num_blocks - 1 (block 0 is the null block);
    * a block table is append-only, except that copy-on-write replaces a shared
      block about to be written (always the table's last, partially filled
      block) by a private copy;
    * a block written in a step has ref_cnt == 1 and no hash (full cached
      blocks are never written: hits are whole blocks and the write starts
      after them);
    * CPU blocks: free + held by swapped requests == num_cpu_blocks, no
      duplicates.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence

from engine.core.block_pool import BlockHash, BlockPool, KVCacheBlock
from engine.core.request import Request


def hash_block_tokens(parent_block_hash: BlockHash | None, token_ids: Sequence[int],
                      extra_keys: tuple | None = None) -> BlockHash:
    """Prefix-cache hash of one full block: sha256 of the pickle of
    ``(parent hash, tuple(token_ids), extra_keys)``; a 32-byte digest.

    ``extra_keys`` separates caches that must not mix for the same tokens
    (e.g. a LoRA adapter or a cache salt); None when unused.
    """
    payload = pickle.dumps((parent_block_hash, tuple(token_ids), extra_keys), protocol=4)
    return hashlib.sha256(payload).digest()


def block_extra_keys(block_index: int, cache_salt: str | None) -> tuple | None:
    """The extra keys of a sequence's block ``block_index``: its ``cache_salt`` on the first block (vLLM's rule:
    the chain carries it to every later block), else None."""
    return (cache_salt,) if block_index == 0 and cache_salt else None


def cdiv(a: int, b: int) -> int:
    """Ceiling division."""
    return -(-a // b)


class KVCacheManager:
    """Maps requests to KV-cache blocks.

    Args:
        block_size: tokens per block.
        num_blocks: device blocks including the null block (>= 2).
        enable_caching: automatic prefix caching.
        num_cpu_blocks: CPU swap-space blocks (0: no swapping).

    Attributes:
        prefix_cache_queries, prefix_cache_hits: tokens looked up in / found in
            the prefix cache (cumulative, recorded by the scheduler through
            ``record_prefix_cache_stats``).
    """

    def __init__(self, *, block_size: int, num_blocks: int, enable_caching: bool = True,
                 num_cpu_blocks: int = 0) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if num_cpu_blocks < 0:
            raise ValueError(f"num_cpu_blocks must be >= 0, got {num_cpu_blocks}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.req_to_block_hashes: dict[str, list[BlockHash]] = {}
        # How many leading blocks of a request's table were already offered
        # to the prefix cache.
        self.num_cached_block: dict[str, int] = {}
        self._blocks_to_copy: list[tuple[int, int]] = []
        self.num_cpu_blocks = num_cpu_blocks
        self._free_cpu_blocks: list[int] = list(range(num_cpu_blocks - 1, -1, -1))
        self.req_to_cpu_blocks: dict[str, list[int]] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # -- queries ------------------------------------------------------------
    @property
    def usage(self) -> float:
        """Fraction (0..1) of non-null device blocks with ref_cnt > 0."""
        return self.block_pool.get_usage()

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    @property
    def num_free_cpu_blocks(self) -> int:
        return len(self._free_cpu_blocks)

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table (physical device block ids, in order)."""
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def get_num_blocks(self, request_id: str) -> int:
        return len(self.req_to_blocks.get(request_id, ()))

    def _block_hashes(self, request: Request, num_full_blocks: int) -> list[BlockHash]:
        """The request's block-hash chain, extended to ``num_full_blocks``.
        A block's key is its tokens and its parent's key, whether the tokens
        were prompt or generated: a follow-up turn reads the earlier answer;
        the first block's also the request's ``cache_salt``."""
        hashes = self.req_to_block_hashes.setdefault(request.request_id, [])
        tokens = request.all_token_ids
        bs = self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block_tokens(parent, tokens[i * bs:(i + 1) * bs],
                                            block_extra_keys(i, request.cache_salt)))
        return hashes

    # -- prefix cache -------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of a request that holds no blocks yet.

        Only full blocks match, and the hit is capped at
        ``(num_tokens - 1) // block_size`` blocks so that at least the last
        token is recomputed (its logits are needed). A request that asks for
        ``prompt_logprobs`` reads nothing from the cache: cached positions have
        no logits, and its logprobs are needed at every prompt position; nor
        does a pooling request (its pooled states may need every position). Does
        not take references (``allocate_slots`` does) and does not record stats.

        Returns:
            (cached blocks in order, number of cached tokens = len * block_size).
        """
        if not self.enable_caching or request.num_tokens == 0 or request.sampling_params.prompt_logprobs is not None \
                or request.pooling_params is not None:
            return [], 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._block_hashes(request, max_hit_blocks)
        blocks = []
        for h in hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(h)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def refresh_prefix(self, request: Request) -> None:
        """Mark the cached prefix of a request that holds no blocks yet (just
        queued) as recently used: its free blocks go to the tail of the LRU
        free queue (``BlockPool.refresh``), so that the allocations of the
        requests seated before it evict other blocks first.

        Why: a follow-up turn queued behind a busy engine found its
        conversation cached on arrival, but the LRU queue evicts by when a
        block was last freed (the earlier turn's end, seconds before); in the
        spill load test 17 of 324 queued requests lost their cached prefix
        while they waited 1.5-2.4 s and recomputed it whole (4,592 prompt
        tokens more than the cache lookup at arrival counted, 9-20 % more
        prefill in the busiest 5 s windows), which made the engine's TTFT
        predictions for the requests behind them short by as much."""
        blocks, _ = self.get_computed_blocks(request)
        self.block_pool.refresh(reversed(blocks))

    def record_prefix_cache_stats(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        """Add one lookup to the cumulative stats (tokens)."""
        self.prefix_cache_queries += num_queried_tokens
        self.prefix_cache_hits += num_hit_tokens

    def cache_full_blocks(self, request: Request) -> None:
        """Offer the request's newly full, computed blocks to the prefix cache.
        Call after ``request.num_computed_tokens`` advanced."""
        if not self.enable_caching:
            return
        rid = request.request_id
        blocks = self.req_to_blocks.get(rid)
        if not blocks:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(blocks))
        start = self.num_cached_block.get(rid, 0)
        if num_full <= start:
            return
        hashes = self._block_hashes(request, num_full)
        run = start  # first block of the current run of newly cached blocks (one BlockStored event per run)
        for i in range(start, num_full):
            if not self.block_pool.cache_block(blocks[i], hashes[i]):
                self._record_stored(request, hashes, run, i)
                run = i + 1
        self._record_stored(request, hashes, run, num_full)
        self.num_cached_block[rid] = num_full

    def _record_stored(self, request: Request, hashes: list[BlockHash], first: int, end: int) -> None:
        """Tell the pool's KV events that blocks ``first..end-1`` of ``request`` entered the cache."""
        if end > first and self.block_pool.kv_cache_events is not None:
            bs = self.block_size
            self.block_pool.record_stored(hashes[first:end], hashes[first - 1] if first else None,
                                          request.all_token_ids[first * bs:end * bs], bs)

    # -- allocation ---------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVCacheBlock] | None = None) -> bool:
        """Make the request's block table long enough for ``num_new_tokens``
        more tokens after its computed ones, all-or-nothing.

        ``new_computed_blocks`` (from ``get_computed_blocks``, only for a
        request holding no blocks and ``num_computed_tokens == 0``) are
        referenced and put at the front of the table. If the first block to be
        written is shared (ref_cnt > 1, after a fork), it is replaced by a new
        block and ``(src, dst)`` is queued for ``take_blocks_to_copy``
        (copy-on-write).

        Returns:
            True on success; False when there are not enough free blocks
            (nothing changed).
        """
        rid = request.request_id
        bs = self.block_size
        new_computed = new_computed_blocks or []
        blocks = self.req_to_blocks.get(rid, [])
        if new_computed and (blocks or request.num_computed_tokens):
            raise RuntimeError(f"{rid}: prefix-cache blocks given to a request that already has blocks")
        num_computed = request.num_computed_tokens + len(new_computed) * bs
        num_required = cdiv(num_computed + num_new_tokens, bs)
        num_new_blocks = max(0, num_required - len(blocks) - len(new_computed))
        cow_indices = []
        if num_new_tokens > 0:
            cow_indices = [i for i in range(num_computed // bs, len(blocks)) if blocks[i].ref_cnt > 1]
        num_evictable = sum(1 for b in new_computed if b.ref_cnt == 0)
        if num_new_blocks + len(cow_indices) + num_evictable > self.block_pool.get_num_free_blocks():
            return False

        blocks = self.req_to_blocks.setdefault(rid, blocks)
        if new_computed:
            self.block_pool.touch(new_computed)
            blocks.extend(new_computed)
            self.num_cached_block[rid] = len(new_computed)
        for i in cow_indices:
            old = blocks[i]
            new = self.block_pool.get_new_blocks(1)[0]
            self._blocks_to_copy.append((old.block_id, new.block_id))
            blocks[i] = new
            self.block_pool.free_blocks([old])
        if num_new_blocks:
            blocks.extend(self.block_pool.get_new_blocks(num_new_blocks))
        return True

    def take_blocks_to_copy(self) -> list[tuple[int, int]]:
        """Copy-on-write pairs (src, dst) queued since the last call."""
        out, self._blocks_to_copy = self._blocks_to_copy, []
        return out

    def fork(self, parent: Request, child: Request) -> None:
        """Share the parent's whole block table with ``child`` (which holds no
        blocks): ref_cnt++ on each block, no copy. The next write into a shared
        block copies it (``allocate_slots``)."""
        if self.req_to_blocks.get(child.request_id) or child.request_id in self.req_to_cpu_blocks:
            raise RuntimeError(f"fork: {child.request_id} already holds blocks")
        blocks = list(self.req_to_blocks.get(parent.request_id, []))
        self.block_pool.touch(blocks)
        self.req_to_blocks[child.request_id] = blocks
        self.num_cached_block[child.request_id] = self.num_cached_block.get(parent.request_id, 0)
        parent_hashes = self.req_to_block_hashes.get(parent.request_id)
        if parent_hashes is not None:
            # Hashes of prompt-only blocks; the child has the same prompt.
            n = min(len(parent_hashes), child.num_prompt_tokens // self.block_size)
            self.req_to_block_hashes[child.request_id] = parent_hashes[:n]

    def free(self, request: Request) -> None:
        """Release everything the request holds: device blocks (in reverse
        order, so its tail is evicted first), CPU swap blocks and its hash chain.
        Idempotent."""
        rid = request.request_id
        blocks = self.req_to_blocks.pop(rid, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))
        cpu = self.req_to_cpu_blocks.pop(rid, None)
        if cpu:
            self._free_cpu_blocks.extend(reversed(cpu))
        self.req_to_block_hashes.pop(rid, None)
        self.num_cached_block.pop(rid, None)

    # -- swapping -----------------------------------------------------------
    def can_swap_out(self, request: Request) -> bool:
        """Whether the request's device blocks fit in the free CPU blocks."""
        n = len(self.req_to_blocks.get(request.request_id, ()))
        return self.num_cpu_blocks > 0 and n <= len(self._free_cpu_blocks)

    def swap_out(self, request: Request) -> list[tuple[int, int]]:
        """Move the request's blocks to CPU blocks and free the device blocks
        (shared ones only lose a reference; their cached hashes stay).

        Returns:
            (device block id, cpu block id) pairs to copy before the device
            blocks are reused (the model runner copies them before this step's
            forward pass).

        Raises:
            RuntimeError: not enough free CPU blocks (check ``can_swap_out``).
        """
        rid = request.request_id
        if not self.can_swap_out(request):
            raise RuntimeError(f"{rid}: not enough free CPU blocks to swap out")
        blocks = self.req_to_blocks.pop(rid, [])
        cpu = [self._free_cpu_blocks.pop() for _ in blocks]
        self.req_to_cpu_blocks[rid] = cpu
        self.block_pool.free_blocks(reversed(blocks))
        self.num_cached_block.pop(rid, None)
        return [(b.block_id, c) for b, c in zip(blocks, cpu)]

    def can_swap_in(self, request: Request, num_new_tokens: int) -> bool:
        """Whether a swapped request fits back on the device together with
        ``num_new_tokens`` more tokens."""
        cpu = self.req_to_cpu_blocks.get(request.request_id, [])
        need = max(len(cpu), cdiv(request.num_computed_tokens + num_new_tokens, self.block_size))
        return need <= self.block_pool.get_num_free_blocks()

    def swap_in(self, request: Request) -> list[tuple[int, int]]:
        """Move a swapped request's blocks back to new device blocks and
        re-offer its full blocks to the prefix cache.

        Returns:
            (cpu block id, device block id) pairs to copy.

        Raises:
            ValueError: not enough free device blocks (check ``can_swap_in``).
        """
        rid = request.request_id
        cpu = self.req_to_cpu_blocks.get(rid, [])
        blocks = self.block_pool.get_new_blocks(len(cpu))
        del self.req_to_cpu_blocks[rid]
        self._free_cpu_blocks.extend(reversed(cpu))
        self.req_to_blocks[rid] = blocks
        self.num_cached_block[rid] = 0
        self.cache_full_blocks(request)
        return [(c, b.block_id) for c, b in zip(cpu, blocks)]

    # -- checks -------------------------------------------------------------
    def check_invariants(self) -> None:
        """Assert the module docstring's invariants (tests).

        Raises:
            AssertionError: an invariant does not hold.
        """
        self.block_pool.check_invariants()
        refs = [0] * self.num_blocks
        for blocks in self.req_to_blocks.values():
            for b in blocks:
                assert not b.is_null, "null block in a block table"
                refs[b.block_id] += 1
        for b in self.block_pool.blocks[1:]:
            assert b.ref_cnt == refs[b.block_id], f"{b}: {refs[b.block_id]} tables hold it"
        held = [c for cpu in self.req_to_cpu_blocks.values() for c in cpu]
        all_cpu = held + self._free_cpu_blocks
        assert sorted(all_cpu) == list(range(self.num_cpu_blocks)), "CPU blocks leaked or double-freed"
        assert not set(self.req_to_cpu_blocks) & set(self.req_to_blocks), "request both swapped and resident"
