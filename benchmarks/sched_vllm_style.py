"""The scheduler benchmark's vLLM-style baseline, written from vLLM v1's documented behaviour.

:class:`VLLMStyle` -- vLLM v1's CPU block manager and the worker's block tables::

    block pool       per KV group (FULL, SWA) Python block objects, a doubly linked free
                     queue (popleft_n / append_n), reference counts, block 0 the null block
    managers         per request a list of blocks per group; allocate_slots(n) tops the
                     lists up to ceil((computed + n) / bs) blocks; the SWA group's
                     remove_skipped_blocks replaces the blocks wholly below
                     computed - W + 1 with the null block and frees them (here called
                     where the shared trace evicts, so that all three free the same pages
                     at the same steps; vLLM calls it in every allocate_slots, which at
                     interval 1 is the same); free(request) frees in reverse order
    worker           a persistent batch: request -> row, holes filled by new requests,
                     then condensed (rows moved); new block ids appended to the rows of a
                     pinned CPU block table [max_batch, 2 groups, max_blocks] int32; the
                     slot mapping of the step's tokens built in numpy from it; ONE
                     non_blocking copy of the block-table rows of the running requests
                     and one of the slot mapping per step

One pool per group (vLLM's hybrid manager shares one pool across groups) so the counts
compare with graphalloc's two pools; the free and capacity checks are leaner than
vLLM's (no prefix-cache hashing, no coordinator), which favours it. Its pinned buffers are
rewritten only after the previous copy completed (an event, as graphalloc's descriptor
"""

from __future__ import annotations

import numpy as np
import torch
from sched_baseline_kernels import NULL_CLOCK

__all__ = ["VLLMStyle"]


# ---- (b) vLLM-style CPU block manager ----------------------------------------------------
class _Block:
    __slots__ = ("block_id", "ref_cnt", "prev_free", "next_free")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.prev_free = None
        self.next_free = None


class _FreeBlockQueue:
    """A doubly linked list of free blocks (vLLM's FreeKVCacheBlockQueue: O(1) removal from
    the middle, used by prefix caching; here only popleft_n / append_n)."""

    def __init__(self, blocks: list):
        self.head = _Block(-1)
        self.tail = _Block(-1)
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


class _BlockPool:
    """Blocks ``0..n`` (0 is the null block, never free); counts what each step took and
    gave back."""

    def __init__(self, n_blocks: int):
        self.blocks = [_Block(i) for i in range(n_blocks + 1)]
        self.null_block = self.blocks[0]
        self.free_queue = _FreeBlockQueue(self.blocks[1:])
        self.n_blocks = n_blocks
        self.taken = self.given = 0

    def get_new_blocks(self, n: int) -> list:
        if n > self.free_queue.n:
            raise RuntimeError(f"vllm baseline: {n} blocks needed, {self.free_queue.n} free; "
                               "the trace sized the pool")
        blocks = self.free_queue.popleft_n(n)
        for b in blocks:
            b.ref_cnt += 1
        self.taken += n
        return blocks

    def free_blocks(self, ordered) -> None:
        freed = []
        null = self.null_block
        for b in ordered:
            if b is null:
                continue
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                freed.append(b)
        if freed:
            self.free_queue.append_n(freed)
            self.given += len(freed)


class _FullAttentionManager:
    """One KV group's block lists per request."""

    def __init__(self, pool: _BlockPool, block_size: int):
        self.pool, self.block_size = pool, block_size
        self.req_to_blocks: dict = {}

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

    def free(self, rid) -> None:
        blocks = self.req_to_blocks.pop(rid, None)
        if blocks:
            self.pool.free_blocks(reversed(blocks))


class _SlidingWindowManager(_FullAttentionManager):
    def __init__(self, pool: _BlockPool, block_size: int, sliding_window: int):
        super().__init__(pool, block_size)
        self.sliding_window = sliding_window  # the MODEL's window W

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
            self.pool.free_blocks(removed)


class _PersistentBatch:
    """The worker's batch: request -> row, block ids per (row, group) in a pinned table."""

    def __init__(self, max_batch: int, width: int, is_cuda: bool):
        self.table = torch.zeros(max_batch, 2, width, dtype=torch.int32, pin_memory=is_cuda)
        self.np = self.table.numpy()
        self.num_blocks = np.zeros((max_batch, 2), dtype=np.int64)
        self.index: dict = {}
        self.req = [None] * max_batch
        self.n = 0  # rows in use, holes included
        self.holes: list[int] = []

    def remove(self, rid) -> None:
        row = self.index.pop(rid)
        self.req[row] = None
        self.holes.append(row)

    def add(self, rid) -> int:
        if self.holes:
            self.holes.sort()
            row = self.holes.pop(0)
        else:
            row = self.n
            self.n += 1
        self.index[rid] = row
        self.req[row] = rid
        self.num_blocks[row] = 0
        return row

    def append_row(self, row: int, group: int, block_ids: list) -> None:
        start = self.num_blocks[row, group]
        self.np[row, group, start:start + len(block_ids)] = block_ids
        self.num_blocks[row, group] = start + len(block_ids)

    def condense(self) -> None:
        """Fill the holes with the last rows (each move copies the row's block ids)."""
        holes = sorted(self.holes)
        self.holes = []
        while holes:
            last = self.n - 1
            if self.req[last] is None:
                self.n -= 1
                if holes and holes[-1] == last:
                    holes.pop()
                continue
            hole = holes.pop(0)
            if hole >= last:
                continue
            rid = self.req[last]
            for g in (0, 1):
                k = self.num_blocks[last, g]
                self.np[hole, g, :k] = self.np[last, g, :k]
            self.num_blocks[hole] = self.num_blocks[last]
            self.req[hole], self.req[last] = rid, None
            self.index[rid] = hole
            self.n -= 1


class VLLMStyle:
    """vLLM v1's block manager and the worker's block-table upload (module docstring).

    Cost per step: O(scheduled requests) Python (two group managers each), O(new blocks)
    list work, an O(rows x max_blocks) table copy and an O(tokens) numpy slot mapping;
    two host-to-device copies, no kernels, no host/device synchronisation.
    """

    name = "vllm"

    def __init__(self, *, num_full_pages: int, num_swa_pages: int, max_batch: int,
                 max_context_len: int, page_size: int, model_window: int, max_tokens: int,
                 n_requests: int, device):
        if model_window < 2:
            raise ValueError("the model window must be >= 2 (the allocator's is W - 1)")
        dev = torch.device(device)
        self.device, self.bs = dev, page_size
        self.is_cuda = dev.type == "cuda"
        self.pools = (_BlockPool(num_full_pages), _BlockPool(num_swa_pages))
        self.managers = (_FullAttentionManager(self.pools[0], page_size),
                         _SlidingWindowManager(self.pools[1], page_size, model_window))
        width = -(-max_context_len // page_size)
        self.batch = _PersistentBatch(max_batch, width, self.is_cuda)
        self.table_dev = torch.zeros(max_batch, 2, width, dtype=torch.int32, device=dev)
        self.slots_host = torch.zeros(max_tokens, 2, dtype=torch.int64,
                                      pin_memory=self.is_cuda)
        self.slots_np = self.slots_host.numpy()
        self.slots_dev = torch.zeros(max_tokens, 2, dtype=torch.int64, device=dev)
        self.num_computed = np.zeros(n_requests, dtype=np.int64)
        self._uploaded = None  # event behind the last copies
        self.stalls = 0
        self.last_counts = (0, 0, 0, 0)

    def step(self, st, clock=NULL_CLOCK) -> None:
        clock.device_begin()
        event = self._uploaded
        if event is not None and not event.query():  # the pinned rows are rewritten below
            self.stalls += 1
            event.synchronize()
        full_mgr, swa_mgr = self.managers
        batch, computed = self.batch, self.num_computed
        for p in self.pools:
            p.taken = p.given = 0
        for rid in st.release.tolist():  # finished requests
            full_mgr.free(rid)
            swa_mgr.free(rid)
            batch.remove(rid)
        for rid in st.evict.tolist():
            swa_mgr.remove_skipped_blocks(rid, int(computed[rid]))
        sched_ids, sched_n = [], []
        for rid in st.decode.tolist():
            self._allocate_slots(rid, 1)
            sched_ids.append(rid)
        sched_n = [1] * len(sched_ids)
        new = set(st.admit.tolist())
        for rid, n in zip(st.extend_ids.tolist(), st.extend_n.tolist(), strict=True):
            if rid in new:
                batch.add(rid)
            self._allocate_slots(rid, n)
            sched_ids.append(rid)
            sched_n.append(n)
        batch.condense()
        self._upload(sched_ids, sched_n)
        clock.device_end()
        self.last_counts = (self.pools[0].taken, self.pools[1].taken, self.pools[0].given,
                            self.pools[1].given)

    def _allocate_slots(self, rid, n: int) -> None:
        total = int(self.num_computed[rid]) + n
        row = self.batch.index[rid]
        for g, mgr in enumerate(self.managers):
            blocks = mgr.allocate_new_blocks(rid, total)
            if blocks:
                self.batch.append_row(row, g, [b.block_id for b in blocks])
        self.num_computed[rid] = total

    def _upload(self, sched_ids: list, sched_n: list) -> None:
        """Slot mapping of the step's tokens (numpy, from the CPU block table), then the
        block-table rows of the running requests and the slots: two non_blocking copies."""
        batch, bs = self.batch, self.bs
        n_sched = len(sched_ids)
        if n_sched:
            ids = np.array(sched_ids, dtype=np.int64)
            counts = np.array(sched_n, dtype=np.int64)
            index = batch.index
            rows = np.array([index[r] for r in sched_ids], dtype=np.int64)
            start = self.num_computed[ids] - counts  # positions before this step
            ends = np.cumsum(counts)
            n_tok = int(ends[-1])
            tok_row = np.repeat(rows, counts)
            tok_pos = np.repeat(start, counts) + (np.arange(n_tok) - np.repeat(ends - counts,
                                                                                counts))
            col, off = tok_pos // bs, tok_pos % bs
            for g in (0, 1):
                self.slots_np[:n_tok, g] = batch.np[tok_row, g, col].astype(np.int64) * bs + off
            self.slots_dev[:n_tok].copy_(self.slots_host[:n_tok], non_blocking=True)
        if batch.n:
            self.table_dev[:batch.n].copy_(batch.table[:batch.n], non_blocking=True)
        if self.is_cuda:
            event = self._uploaded or torch.cuda.Event()
            event.record()
            self._uploaded = event

    # ---- checks (after the run) ------------------------------------------------------
    def verify(self, live_ids) -> dict:
        """Blocks held + free == pool, reference counts 0 or 1, and the device block table
        equal to the host's (reads the device)."""
        out = {}
        for name, pool, mgr in (("full", self.pools[0], self.managers[0]),
                                ("swa", self.pools[1], self.managers[1])):
            held = [b for blocks in mgr.req_to_blocks.values() for b in blocks
                    if b is not pool.null_block]
            out[f"{name}_conserved"] = len(held) + pool.free_queue.n == pool.n_blocks
            out[f"{name}_held_distinct"] = len({id(b) for b in held}) == len(held)
            out[f"{name}_ref_ok"] = all(b.ref_cnt == 1 for b in held)
        n = self.batch.n
        if self.is_cuda:
            torch.cuda.synchronize()
        same = True
        dev = self.table_dev[:n].cpu().numpy()
        for row in range(n):
            for g in (0, 1):
                k = self.batch.num_blocks[row, g]
                same &= bool(np.array_equal(dev[row, g, :k], self.batch.np[row, g, :k]))
        out["device_table_equal"] = same
        out["rows"] = n
        out["ok"] = all(v for k, v in out.items() if k != "rows")
        return out
