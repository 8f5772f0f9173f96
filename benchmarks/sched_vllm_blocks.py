"""vLLM v1-style block pool and KV managers for the scheduler benchmark (``sched_vllm_style``).

Written from vLLM v1's documented behaviour (``v1/core/block_pool.py``,
``single_type_kv_cache_manager.py``), one pool per KV group (FULL, SWA)::

    block            id, reference count, block hash (set once the block is full and
                     cached; cleared when the block is evicted), free-queue links
    free queue       doubly linked, least recently freed first: popleft_n takes from the
                     head, append_n adds at the tail, remove takes a block out of the
                     middle in O(1) (a cache hit on a free block)
    pool             blocks 0 .. n (block 0 the null block, never free); with caching a
                     map block hash -> {block id: block}: a freed cached block stays in
                     the map and in the free queue, reusable by a hit (touch) until a
                     popleft reuses it for new content (its hash evicted then)
    full manager     find_longest_cache_hit: the leading blocks whose chained hashes are
                     in the map, at most max_length tokens
    SWA manager      find_longest_cache_hit: from the right, the first run of
                     cdiv(W - 1, bs) cached blocks (or a run reaching block 0) ends the
                     hit; the blocks before it are the null block; remove_skipped_blocks
                     frees the blocks wholly below computed - W + 1

Counts per step (``begin_step`` resets them): ``taken`` blocks popped for new content,
``given`` blocks whose reference count reached 0 (back in the free queue), of them
``freed`` without a hash (content dropped) and ``cached_in`` with one (still cached);
``revived`` cached free blocks taken out of the queue by a hit, ``evicted`` cached blocks
popped for new content. Pool state: free (queue, no hash) + used (reference count > 0) +
cached (queue, hash) = the pool, at every step (``state``); ``audit`` recounts it from the
blocks themselves.
"""

from __future__ import annotations

__all__ = ["Block", "FreeBlockQueue", "BlockPool", "FullAttentionManager",
           "SlidingWindowManager"]


class Block:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int):
        self.block_id = block_id  # 0 .. n_blocks (0: the null block)
        self.ref_cnt = 0
        self.block_hash = None  # set once full and cached; None again when evicted
        self.prev_free = None  # links: only the free queue touches them
        self.next_free = None


class FreeBlockQueue:
    """vLLM's FreeKVCacheBlockQueue: sentinel head and tail (never popped, so every real
    node has two neighbours), O(1) popleft, append and removal from the middle."""

    def __init__(self, blocks: list):
        self.head = Block(-1)
        self.tail = Block(-1)
        prev = self.head
        for b in blocks:
            prev.next_free, b.prev_free = b, prev
            prev = b
        prev.next_free, self.tail.prev_free = self.tail, prev
        self.n = len(blocks)

    def popleft_n(self, n: int) -> list:
        out = []
        b = self.head.next_free
        for _ in range(n):
            out.append(b)
            nxt = b.next_free
            b.prev_free = b.next_free = None
            b = nxt
        self.head.next_free, b.prev_free = b, self.head
        self.n -= n
        return out

    def append_n(self, blocks: list) -> None:
        last = self.tail.prev_free
        for b in blocks:
            last.next_free, b.prev_free = b, last
            last = b
        last.next_free, self.tail.prev_free = self.tail, last
        self.n += len(blocks)

    def remove(self, b: Block) -> None:
        b.prev_free.next_free, b.next_free.prev_free = b.next_free, b.prev_free
        b.prev_free = b.next_free = None
        self.n -= 1

    def blocks(self) -> list:
        """Every queued block, head first (O(n); checks only)."""
        out, b = [], self.head.next_free
        while b is not self.tail:
            out.append(b)
            b = b.next_free
        return out


class BlockPool:
    """Blocks ``0..n_blocks`` (0 the null block, never free), the free queue and, with
    ``enable_caching``, the hash map (module docstring). Allocation raises before it pops
    anything when the queue is short."""

    def __init__(self, n_blocks: int, enable_caching: bool = False):
        self.blocks = [Block(i) for i in range(n_blocks + 1)]
        self.null_block = self.blocks[0]
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self.n_blocks = n_blocks
        self.enable_caching = enable_caching
        self.cached: dict = {}  # block hash -> {block id: block}
        self.n_used = 0  # blocks with ref_cnt > 0 (kept with caching)
        self.total_refs = 0  # the sum of every block's ref_cnt (kept with caching)
        self.n_cached_free = 0  # queued blocks with a hash
        self.evicted_total = 0  # cached blocks reused for new content, all steps
        self.begin_step()

    def begin_step(self) -> None:
        self.taken = self.given = self.freed = self.cached_in = 0
        self.revived = self.evicted = 0

    # ---- allocation ------------------------------------------------------------------
    def get_new_blocks(self, n: int) -> list:
        if n > self.free_queue.n:
            raise RuntimeError(f"vllm baseline: {n} blocks needed, {self.free_queue.n} free; "
                               "the trace sized the pool")
        blocks = self.free_queue.popleft_n(n)
        if self.enable_caching:
            for b in blocks:
                if b.block_hash is not None:  # _maybe_evict_cached_block
                    self._evict(b)
                b.ref_cnt = 1
            self.n_used += n
            self.total_refs += n
        else:
            for b in blocks:
                b.ref_cnt += 1
        self.taken += n
        return blocks

    def _evict(self, b: Block) -> None:
        entries = self.cached[b.block_hash]
        del entries[b.block_id]
        if not entries:
            del self.cached[b.block_hash]
        b.block_hash = None
        self.n_cached_free -= 1
        self.evicted += 1
        self.evicted_total += 1

    # ---- prefix caching --------------------------------------------------------------
    def get_cached_block(self, block_hash):
        entries = self.cached.get(block_hash)
        return next(iter(entries.values())) if entries else None

    def touch(self, blocks) -> None:
        """A hit takes these blocks: +1 reference, out of the free queue if it was 0."""
        null = self.null_block
        for b in blocks:
            if b is null:
                continue
            if b.ref_cnt == 0:
                self.free_queue.remove(b)
                self.n_cached_free -= 1
                self.n_used += 1
                self.revived += 1
            b.ref_cnt += 1
            self.total_refs += 1

    def cache_full_blocks(self, blocks: list, block_hashes: list, num_cached: int,
                          num_full: int) -> None:
        """Hash blocks ``[num_cached, num_full)`` of a request (now full) into the map."""
        null = self.null_block
        cached = self.cached
        for i in range(num_cached, num_full):
            b = blocks[i]
            if b is null or b.block_hash is not None:
                continue
            h = b.block_hash = block_hashes[i]
            entries = cached.get(h)
            if entries is None:
                cached[h] = {b.block_id: b}
            else:  # the same content computed twice: both stay until evicted
                entries[b.block_id] = b

    # ---- frees -----------------------------------------------------------------------
    def free_blocks(self, ordered) -> None:
        """-1 reference each (null blocks skipped); those at 0 join the queue's tail in the
        order given (vLLM frees a request's blocks tail first: evicted first)."""
        freed = []
        null = self.null_block
        n_refs = 0
        for b in ordered:
            if b is null:
                continue
            n_refs += 1
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                freed.append(b)
        self.total_refs -= n_refs
        if not freed:
            return
        self.free_queue.append_n(freed)
        self.given += len(freed)
        if self.enable_caching:
            n_hashed = sum(1 for b in freed if b.block_hash is not None)
            self.n_used -= len(freed)
            self.n_cached_free += n_hashed
            self.cached_in += n_hashed
            self.freed += len(freed) - n_hashed
        else:
            self.freed += len(freed)

    # ---- state -------------------------------------------------------------------------
    def state(self, n_entries: int | None = None) -> tuple[int, int, int]:
        """(free, used, cached) blocks from the counters (O(1)). With ``n_entries`` (the
        non-null entries of the requests' block lists) the references no list accounts
        for are taken off ``used``: a block a request dropped without freeing it then
        shows as a block missing from free + used + cached."""
        if not self.enable_caching:
            return self.free_queue.n, self.n_blocks - self.free_queue.n, 0
        used = self.n_used
        if n_entries is not None:
            used -= self.total_refs - n_entries
        return self.free_queue.n - self.n_cached_free, used, self.n_cached_free

    def audit(self, holders) -> dict:
        """Recount from the blocks (O(n)): ``holders`` the request block lists of this
        pool. Every reference count equals the lists holding the block, the queue holds
        exactly the unreferenced blocks, each hash is in the map under its block."""
        null = self.null_block
        held: dict = {}
        for blocks in holders:
            for b in blocks:
                if b is not null:
                    held[b.block_id] = held.get(b.block_id, 0) + 1
        queued = self.free_queue.blocks()
        queued_ids = {b.block_id for b in queued}
        refs_ok = all(b.ref_cnt == held.get(b.block_id, 0) for b in self.blocks[1:])
        queue_ok = (len(queued_ids) == len(queued) == self.free_queue.n
                    and queued_ids == {b.block_id for b in self.blocks[1:] if b.ref_cnt == 0})
        hashed = [b for b in self.blocks[1:] if b.block_hash is not None]
        map_ok = (sum(len(v) for v in self.cached.values()) == len(hashed) and all(
            self.cached.get(b.block_hash, {}).get(b.block_id) is b for b in hashed))
        n_cached = sum(1 for b in queued if b.block_hash is not None)
        free, used, cached = len(queued) - n_cached, len(held), n_cached
        return {"refs_ok": refs_ok, "queue_ok": queue_ok, "map_ok": map_ok,
                "state": (free, used, cached), "state_ok": (free, used, cached) == self.state(),
                "conserved": free + used + cached == self.n_blocks}


class FullAttentionManager:
    """One KV group's block lists per request (and, with caching, how many of each list
    are hashed)."""

    def __init__(self, pool: BlockPool, block_size: int):
        self.pool, self.block_size = pool, block_size
        self.req_to_blocks: dict = {}
        self.num_cached_block: dict = {}
        self.num_null: dict = {}  # rid -> leading null blocks of its list (SWA)

    def n_entries(self) -> int:
        """Non-null entries of every request's list (O(requests))."""
        return sum(len(b) for b in self.req_to_blocks.values()) - sum(
            self.num_null.values())

    def find_longest_cache_hit(self, block_hashes: list, max_length: int) -> list:
        """The leading cached blocks, at most ``max_length`` tokens (a chained hash that
        misses ends it: no later block can hit)."""
        pool = self.pool
        out = []
        for h in block_hashes[:max_length // self.block_size]:
            b = pool.get_cached_block(h)
            if b is None:
                break
            out.append(b)
        return out

    def save_new_computed_blocks(self, rid, blocks: list) -> None:
        self.req_to_blocks[rid] = list(blocks)
        self.num_cached_block[rid] = len(blocks)
        null = self.pool.null_block
        n_null = sum(1 for b in blocks if b is null)
        if n_null:
            self.num_null[rid] = n_null

    def allocate_new_blocks(self, rid, num_tokens: int) -> list:
        blocks = self.req_to_blocks.get(rid)
        if blocks is None:
            blocks = self.req_to_blocks[rid] = []
        n_new = -(-num_tokens // self.block_size) - len(blocks)
        if n_new <= 0:
            return []
        new = self.pool.get_new_blocks(n_new)
        blocks.extend(new)
        return new

    def cache_blocks(self, rid, block_hashes: list, num_tokens: int) -> None:
        num_full = num_tokens // self.block_size
        num_cached = self.num_cached_block.get(rid, 0)
        if num_full > num_cached:
            self.pool.cache_full_blocks(self.req_to_blocks[rid], block_hashes, num_cached,
                                        num_full)
            self.num_cached_block[rid] = num_full

    def free(self, rid) -> None:
        blocks = self.req_to_blocks.pop(rid, None)
        self.num_cached_block.pop(rid, None)
        self.num_null.pop(rid, None)
        if blocks:
            self.pool.free_blocks(reversed(blocks))


class SlidingWindowManager(FullAttentionManager):
    def __init__(self, pool: BlockPool, block_size: int, sliding_window: int):
        super().__init__(pool, block_size)
        self.sliding_window = sliding_window  # the MODEL's window W

    def find_longest_cache_hit(self, block_hashes: list, max_length: int) -> list:
        """Scanning from the right: the first run of cdiv(W - 1, bs) cached blocks ends the
        hit (blocks before it: the null block); without one, the run from block 0."""
        pool, bs = self.pool, self.block_size
        need = -(-(self.sliding_window - 1) // bs)
        n = max_length // bs
        out = [pool.null_block] * n
        run = 0
        for i in range(n - 1, -1, -1):
            b = pool.get_cached_block(block_hashes[i])
            if b is None:
                run = 0
                continue
            out[i] = b
            run += 1
            if run >= need:
                del out[i + run:]
                return out
        del out[run:]
        return out

    def remove_skipped_blocks(self, rid, num_computed_tokens: int) -> None:
        """Blocks wholly below ``num_computed_tokens - W + 1`` -> the null block, freed."""
        last_useful_block = (num_computed_tokens - self.sliding_window + 1) // self.block_size
        blocks = self.req_to_blocks.get(rid)
        if not blocks or last_useful_block <= 0:
            return
        null = self.pool.null_block
        removed = []
        for i in range(last_useful_block - 1, -1, -1):
            if blocks[i] is null:
                break
            removed.append(blocks[i])
            blocks[i] = null
        if removed:
            self.num_null[rid] = self.num_null.get(rid, 0) + len(removed)
            self.pool.free_blocks(removed)


if __name__ == "__main__":  # a module, not a script: --help says what it is and what to run
    import argparse

    _ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=(
            "A module imported by other scripts; run benchmarks/bench_scheduler.py "
            "instead (each takes --help)."))
    _ap.parse_args()
    _ap.error("nothing to run here: see --help")
