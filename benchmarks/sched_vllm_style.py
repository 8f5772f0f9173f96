"""The scheduler benchmark's vLLM-style baseline, written from vLLM v1's documented behaviour.

:class:`VLLMStyle` -- vLLM v1's CPU block manager and the worker's block tables::

    block pool       per KV group (FULL, SWA) Python block objects, a doubly linked free
                     queue, reference counts, block 0 the null block (sched_vllm_blocks)
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

With ``prefix_caching`` (vLLM's ``enable_prefix_caching``, on by default in vLLM)::

    block hashes     per request, chained over the token ids of each full block:
                     hash((parent hash, block's token ids)); the prompt's at admission
                     (vLLM hashes them when the request arrives, in the same engine
                     loop), an output block's when its last token is known
    admission        get_computed_blocks: max length = prompt tokens - 1; the FULL hit
                     (leading cached blocks), then the SWA hit within it (a run of
                     cdiv(W - 1, bs) cached blocks ending the hit, the null block
                     before), the FULL hit cut to the SWA one (the hybrid coordinator);
                     touch (a free cached block leaves the queue), the hit blocks become
                     the request's first blocks
    allocation       after allocate_new_blocks, cache_blocks(computed + n): the request's
                     newly full blocks get their hash and enter the map
    frees            unchanged: a cached block whose count reaches 0 stays cached in the
                     free queue until a popleft reuses it (its hash evicted then)

The trace gives every admission's expected hit (``TraceStep.hit``). The engine's own hit
must not exceed it (the trace's cache never evicts); a shorter one (a pool small enough
to evict) is recomputed: its missing tokens join the admission's chunk, so lengths stay
the trace's (``hit_tokens`` keeps the engine's hits, ``recomputed_tokens`` the rest).

One pool per group (vLLM's hybrid manager shares one pool across groups) so the counts
compare with graphalloc's two pools; the capacity checks are leaner than vLLM's (no
can-allocate precheck, no coordinator object), which favours it. Its pinned buffers are
rewritten only after the previous copy completed (an event, as graphalloc's descriptor
ring; vLLM relies on its per-step sync); ``stalls`` counts the waits.

``last_counts`` = (FULL blocks taken, SWA taken, FULL freed, SWA freed): without caching
freed = every block back in the free queue; with it, those without a hash (content
dropped; a cached block in the queue is not free, ``state()`` counts it as cached).
"""

from __future__ import annotations

import numpy as np
import torch
from sched_baseline_kernels import NULL_CLOCK
from sched_vllm_blocks import BlockPool, FullAttentionManager, SlidingWindowManager

__all__ = ["VLLMStyle"]


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
    two host-to-device copies, no kernels, no host/device synchronisation. With prefix
    caching add O(prompt blocks) hashing and hash lookups per admission, O(1) hashing
    per block filled.
    """

    name = "vllm"

    def __init__(self, *, num_full_pages: int, num_swa_pages: int, max_batch: int,
                 max_context_len: int, page_size: int, model_window: int, max_tokens: int,
                 n_requests: int, device, prefix_caching: bool = False, tokens=None,
                 prompt_lens=None):
        if model_window < 2:
            raise ValueError("the model window must be >= 2 (the allocator's is W - 1)")
        if prefix_caching and (tokens is None or prompt_lens is None):
            raise ValueError("prefix caching needs the requests' tokens and prompt_lens "
                             "(Trace.tokens, Trace.fill): a trace with a prefix workload")
        dev = torch.device(device)
        self.device, self.bs = dev, page_size
        self.is_cuda = dev.type == "cuda"
        self.prefix_cache = prefix_caching
        self.pools = (BlockPool(num_full_pages, prefix_caching),
                      BlockPool(num_swa_pages, prefix_caching))
        self.pool_sizes = (num_full_pages, num_swa_pages)
        self.managers = (FullAttentionManager(self.pools[0], page_size),
                         SlidingWindowManager(self.pools[1], page_size, model_window))
        width = -(-max_context_len // page_size)
        self.batch = _PersistentBatch(max_batch, width, self.is_cuda)
        self.table_dev = torch.zeros(max_batch, 2, width, dtype=torch.int32, device=dev)
        self.slots_host = torch.zeros(max_tokens, 2, dtype=torch.int64,
                                      pin_memory=self.is_cuda)
        self.slots_np = self.slots_host.numpy()
        self.slots_dev = torch.zeros(max_tokens, 2, dtype=torch.int64, device=dev)
        self.num_computed = np.zeros(n_requests, dtype=np.int64)
        self.tokens, self.prompt_lens = tokens, prompt_lens
        self.block_hashes: dict = {}  # rid -> chained hashes of its full blocks so far
        self.hit_tokens = np.full(n_requests, -1, dtype=np.int64)
        self.recomputed_tokens = 0
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
            p.begin_step()
        for rid in st.release.tolist():  # finished requests
            full_mgr.free(rid)
            swa_mgr.free(rid)
            batch.remove(rid)
            if self.prefix_cache:
                del self.block_hashes[rid]
        for rid in st.evict.tolist():
            swa_mgr.remove_skipped_blocks(rid, int(computed[rid]))
        sched_ids, sched_n = [], []
        for rid in st.decode.tolist():
            self._allocate_slots(rid, 1)
            sched_ids.append(rid)
        sched_n = [1] * len(sched_ids)
        if self.prefix_cache:
            chunks, hits = st.extend_n, dict(zip(st.admit.tolist(), st.hit.tolist(), strict=True))
        else:  # a prefix workload's hits are allocated as fresh tokens
            chunks, hits = st.extend_n_nocache, dict.fromkeys(st.admit.tolist(), 0)
        for rid, n in zip(st.extend_ids.tolist(), chunks.tolist(), strict=True):
            if rid in hits:
                batch.add(rid)
                if self.prefix_cache:
                    n += self._admit_on_cache(rid, hits[rid])
            self._allocate_slots(rid, n)
            sched_ids.append(rid)
            sched_n.append(n)
        batch.condense()
        self._upload(sched_ids, sched_n)
        clock.device_end()
        full, swa = self.pools
        if self.prefix_cache:
            self.last_counts = (full.taken, swa.taken, full.freed, swa.freed)
        else:
            self.last_counts = (full.taken, swa.taken, full.given, swa.given)

    def _hashes(self, rid, n_blocks: int) -> list:
        """The request's block hashes, extended to ``n_blocks`` full blocks."""
        hashes = self.block_hashes.get(rid)
        if hashes is None:
            hashes = self.block_hashes[rid] = []
        if len(hashes) < n_blocks:
            toks, bs = self.tokens[rid], self.bs
            prev = hashes[-1] if hashes else None
            for j in range(len(hashes), n_blocks):
                prev = hash((prev, tuple(toks[j * bs:(j + 1) * bs].tolist())))
                hashes.append(prev)
        return hashes

    def _admit_on_cache(self, rid, expected_hit: int) -> int:
        """get_computed_blocks + touch + save_new_computed_blocks for a new request;
        returns the tokens of the trace's hit it must recompute (module docstring)."""
        full_mgr, swa_mgr = self.managers
        bs, fill = self.bs, int(self.prompt_lens[rid])
        hashes = self._hashes(rid, fill // bs)
        full = full_mgr.find_longest_cache_hit(hashes, fill - 1)
        swa = swa_mgr.find_longest_cache_hit(hashes, len(full) * bs)
        full = full[:len(swa)]  # the FULL hit cut to the SWA one (hybrid coordinator)
        hit = len(swa) * bs
        if hit > expected_hit:
            raise RuntimeError(f"vllm baseline: request {rid} hits {hit} tokens, the trace "
                               f"{expected_hit}: the trace's cache model misses an entry")
        row = self.batch.index[rid]
        for g, (pool, mgr, blocks) in enumerate(((self.pools[0], full_mgr, full),
                                                 (self.pools[1], swa_mgr, swa))):
            pool.touch(blocks)
            mgr.save_new_computed_blocks(rid, blocks)
            if blocks:
                self.batch.append_row(row, g, [b.block_id for b in blocks])
        self.num_computed[rid] = hit
        self.hit_tokens[rid] = hit
        self.recomputed_tokens += expected_hit - hit
        return expected_hit - hit

    def _allocate_slots(self, rid, n: int) -> None:
        total = int(self.num_computed[rid]) + n
        row = self.batch.index[rid]
        for g, mgr in enumerate(self.managers):
            blocks = mgr.allocate_new_blocks(rid, total)
            if blocks:
                self.batch.append_row(row, g, [b.block_id for b in blocks])
        if self.prefix_cache:
            hashes = self._hashes(rid, total // self.bs)
            for mgr in self.managers:
                mgr.cache_blocks(rid, hashes, total)
        self.num_computed[rid] = total

    @property
    def evicted_pages(self) -> tuple[int, int]:
        """Cached blocks reused for new content (evicted), FULL and SWA, all steps."""
        return self.pools[0].evicted_total, self.pools[1].evicted_total

    def state(self) -> tuple:
        """(free, used, cached) of the FULL pool, then of the SWA pool (O(running): used
        is checked against the requests' block lists, ``BlockPool.state``)."""
        return (self.pools[0].state(self.managers[0].n_entries())
                + self.pools[1].state(self.managers[1].n_entries()))

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
        """Per pool: references equal the request lists holding each block, the free
        queue holds exactly the unreferenced blocks, free + used + cached == pool; the
        device block table equal to the host's (reads the device)."""
        out = {}
        for name, pool, mgr in (("full", self.pools[0], self.managers[0]),
                                ("swa", self.pools[1], self.managers[1])):
            a = pool.audit(mgr.req_to_blocks.values())
            out[f"{name}_conserved"] = a["conserved"] and a["state_ok"]
            out[f"{name}_ref_ok"] = a["refs_ok"] and a["queue_ok"] and a["map_ok"]
            out[f"{name}_state"] = list(a["state"])
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
        out["ok"] = all(v for k, v in out.items() if k != "rows" and not k.endswith("state"))
        return out


if __name__ == "__main__":  # a module, not a script: --help says what it is and what to run
    import argparse

    _ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=(
            "A module imported by other scripts; run benchmarks/bench_scheduler.py "
            "instead (each takes --help)."))
    _ap.parse_args()
    _ap.error("nothing to run here: see --help")
