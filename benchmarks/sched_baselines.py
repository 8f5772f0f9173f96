"""The scheduler benchmark's two baselines, written from the engines' documented behaviour.

Both replay a :class:`sched_workload.TraceStep` per scheduler iteration, keep their own
lengths and frontiers, and report the pages they allocated and freed
(``last_counts`` = FULL allocated, SWA allocated, FULL freed, SWA freed), which the
benchmark compares with graphalloc's and the trace's step by step.

:class:`SGLangStyle` -- SGLang's paged SWA allocator, as eager calls per iteration
(device tables as graphalloc's: ``req_to_token [rows, ctx]``, ``full_to_swa`` per slot,
int64, page 0 the sink; free pages in two device rings with host-side heads)::

    free group       per released request, split at its frontier f: FULL pages of
                     [0, L) -> one floor_divide of the page-start slots (a strided view of
                     req_to_token), SWA pages of [f, L) -> the fused lookup-and-clear
                     kernel (graphalloc.kernels.get_and_clear: SWA page ids, mapping
                     cleared); per evicting request (the window rule, when a page left
                     the window) one fused lookup-and-clear of [f, f'); at the group's
                     end one cat + ring write per pool
    allocation       per call (the prefill chunks, then the decodes): one host-to-device
                     copy of the batch's rows, prefix lengths, token counts, last
                     positions and prefix sums; last-location gather; its SWA
                     translation; ONE allocation kernel per pool (continue the partial
                     page from the last location, pop new pages from the ring); ONE
                     req_to_token write kernel; the full_to_swa scatter
    host             request rows from a free list, lengths and frontiers in numpy,
                     page counts computed on the host (no device read)

It is sync-free, which favours it: SGLang's own frees use ``torch.unique`` and boolean
masks (data-dependent shapes, 4 + 3 E host/device waits per iteration by the integration
notes); here the host passes one page-start slot per page and knows every count. The
allocation kernels are this module's own (``_alloc_slots`` / ``_write_rows``, Triton on
CUDA, Torch twins elsewhere), shaped like SGLang's one kernel per pool and call; the
batch's prefix sums come from the host (SGLang's kernel sums them in every program).
``decode="torch_ops"`` swaps the decode allocation for ``baselines.eager_decode_alloc``
(the ~20-op Torch sequence of bench_frees).

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
ring; vLLM relies on its per-step sync); ``stalls`` counts the waits.
"""

from __future__ import annotations

import inspect

import numpy as np
import torch

__all__ = ["SGLangStyle", "VLLMStyle", "NullClock", "NULL_CLOCK", "alloc_slots", "write_rows",
           "alloc_slots_torch", "write_rows_torch"]

BLOCK_T = 128  # tokens per loop iteration of the allocation kernels
# meta rows of one allocation call (int64 [6, k], one host-to-device copy)
M_ROW, M_PRE, M_N, M_PREV, M_LANE, M_PAGE = range(6)
N_META = 6


class NullClock:
    """The clock protocol the drivers call around their device work (here: nothing)."""

    def device_begin(self) -> None:
        pass

    def device_end(self) -> None:
        pass


NULL_CLOCK = NullClock()


def _ceil_div(a, b):
    return -(-a // b)


# ---- allocation kernels (Triton, defined on first use) and their Torch twins -------------
_KERNELS: dict = {}


def _triton_kernels():
    """``(alloc_slots_kernel, write_rows_kernel)``, defined on first use (``@triton.jit``
    reads TRITON_INTERPRET when it runs; the scripts settle it in ``main()``)."""
    if _KERNELS:
        return _KERNELS["alloc"], _KERNELS["write"]
    import triton
    import triton.language as tl

    args = {"do_not_specialize": ["k", "head", "cap", "page_size", "stride"]}
    if "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters:
        args["do_not_specialize_on_alignment"] = ["meta_ptr"]

    @triton.jit(**args)
    def alloc_slots_kernel(meta_ptr, last_ptr, ring_ptr, out_ptr, k, head, cap, page_size,
                           stride, BLOCK: tl.constexpr):
        """Request i: tokens [pre, pre + n) -> slots; the partial page continues from the
        last location, new pages come from ring[(head + page0 + j) % cap]."""
        i = tl.program_id(0).to(tl.int64)
        pre = tl.load(meta_ptr + 1 * k + i)
        n = tl.load(meta_ptr + 2 * k + i).to(tl.int32)  # a chunk: < 2^31 tokens
        lane0 = tl.load(meta_ptr + 4 * k + i)
        page0 = tl.load(meta_ptr + 5 * k + i)
        last = tl.load(last_ptr + i)
        first_new = (pre + page_size - 1) // page_size * page_size
        for t0 in range(0, n, BLOCK):
            t = t0 + tl.arange(0, BLOCK)
            mask = t < n
            pos = pre + t
            cont = pos < first_new
            j = tl.where(cont, 0, (pos - first_new) // page_size)
            page = tl.load(ring_ptr + (head + page0 + j) % cap, mask=mask & ~cont, other=0)
            slot = tl.where(cont, last + 1 + t, page * page_size + pos % page_size)
            tl.store(out_ptr + lane0 + t, slot, mask=mask)

    @triton.jit(**args)
    def write_rows_kernel(meta_ptr, last_ptr, ring_ptr, out_ptr, k, head, cap, page_size,
                          stride, BLOCK: tl.constexpr):
        """Request i: req_to_token[row, pre:pre + n] = slots[lane0:lane0 + n] (``ring_ptr``
        is req_to_token, ``out_ptr`` the slots; the other pointers are unused)."""
        i = tl.program_id(0).to(tl.int64)
        row = tl.load(meta_ptr + 0 * k + i)
        pre = tl.load(meta_ptr + 1 * k + i)
        n = tl.load(meta_ptr + 2 * k + i).to(tl.int32)
        lane0 = tl.load(meta_ptr + 4 * k + i)
        for t0 in range(0, n, BLOCK):
            t = t0 + tl.arange(0, BLOCK)
            mask = t < n
            slot = tl.load(out_ptr + lane0 + t, mask=mask, other=0)
            tl.store(ring_ptr + row * stride + pre + t, slot, mask=mask)

    _KERNELS.update(alloc=alloc_slots_kernel, write=write_rows_kernel)
    return alloc_slots_kernel, write_rows_kernel


def _token_layout(meta: torch.Tensor, k: int, n_tokens: int):
    """Twins: per token its request index and offset t (device ops, sizes from the host)."""
    n = meta[M_N]
    req = torch.repeat_interleave(torch.arange(k, device=meta.device), n,
                                  output_size=n_tokens)
    t = torch.arange(n_tokens, device=meta.device) - meta[M_LANE][req]
    return req, t


def alloc_slots_torch(meta, last, ring, out, k: int, n_tokens: int, head: int, cap: int,
                      page_size: int) -> None:
    """Twin of the allocation kernel: same slots into ``out[:n_tokens]``."""
    ps = page_size
    req, t = _token_layout(meta, k, n_tokens)
    pos = meta[M_PRE][req] + t
    first_new = (meta[M_PRE][req] + ps - 1) // ps * ps
    cont = pos < first_new
    j = torch.where(cont, 0, (pos - first_new) // ps)
    page = ring[(head + meta[M_PAGE][req] + j) % cap]
    out[:n_tokens] = torch.where(cont, last[req] + 1 + t, page * ps + pos % ps)


def write_rows_torch(meta, req_to_token, slots, k: int, n_tokens: int) -> None:
    """Twin of the req_to_token write kernel."""
    req, t = _token_layout(meta, k, n_tokens)
    req_to_token[meta[M_ROW][req], meta[M_PRE][req] + t] = slots[:n_tokens]


def alloc_slots(meta, last, ring, out, k: int, n_tokens: int, head: int, cap: int,
                page_size: int, backend: str) -> None:
    """One pool's allocation for k requests: one launch (Triton) or the twin's ops."""
    if backend != "triton":
        return alloc_slots_torch(meta, last, ring, out, k, n_tokens, head, cap, page_size)
    kernel, _ = _triton_kernels()
    kernel[(k,)](meta, last, ring, out, k, head, cap, page_size, 0, BLOCK=BLOCK_T)


def write_rows(meta, req_to_token, slots, k: int, n_tokens: int, backend: str) -> None:
    """req_to_token rows of k requests: one launch (Triton) or the twin's ops."""
    if backend != "triton":
        return write_rows_torch(meta, req_to_token, slots, k, n_tokens)
    _, kernel = _triton_kernels()
    kernel[(k,)](meta, slots, req_to_token, slots, k, 0, 1, 1, req_to_token.stride(0),
                 BLOCK=BLOCK_T)


class _PinnedRing:
    """``n`` host buffers (pinned on CUDA), each rewritten only after the copy that read it
    completed (an event per buffer). ``stalls`` counts the waits."""

    def __init__(self, n: int, size: int, dtype, is_cuda: bool):
        self.bufs = [torch.zeros(size, dtype=dtype, pin_memory=is_cuda) for _ in range(n)]
        self.np = [b.numpy() for b in self.bufs]
        self.events = [None] * n
        self.is_cuda = is_cuda
        self.next = 0
        self.stalls = 0

    def acquire(self) -> int:
        i = self.next
        event = self.events[i]
        if event is not None and not event.query():
            self.stalls += 1
            event.synchronize()  # only when the device is n copies behind
        self.next = (i + 1) % len(self.bufs)
        return i

    def submitted(self, i: int) -> None:
        if self.is_cuda:
            event = self.events[i] or torch.cuda.Event()
            event.record()
            self.events[i] = event


# ---- (a) SGLang-style eager calls ---------------------------------------------------------
class SGLangStyle:
    """SGLang's per-iteration allocator calls, eagerly (see the module docstring).

    Cost per step: O(requests released + evicting + allocating) Python and launches:
    2 per release, 1 per eviction that frees a page, 1-3 per pool at the free group's end,
    8 per allocation call (1 copy, 2 gathers, 2 allocation kernels, 1 write kernel, 1
    scatter, on Triton), no host/device synchronisation.
    """

    name = "sglang"

    def __init__(self, *, num_full_pages: int, num_swa_pages: int, max_reqs: int,
                 max_context_len: int, page_size: int, sliding_window: int, n_requests: int,
                 max_rows: int, device, backend: str, decode: str = "kernels"):
        from baselines import load_fused

        dev = torch.device(device)
        self.device, self.backend, self.ps = dev, backend, page_size
        self.is_cuda = dev.type == "cuda"
        self.window = sliding_window  # the allocator's window (W - 1)
        fused, name, why = load_fused(backend)
        if fused is None:
            raise RuntimeError(f"the fused lookup-and-clear op is unavailable: {why}")
        self.fused, self.fused_name = fused, name
        if decode not in ("kernels", "torch_ops"):
            raise ValueError(f"decode must be 'kernels' or 'torch_ops', got {decode!r}")
        self.decode_impl = decode
        i64 = dict(dtype=torch.int64, device=dev)
        self.req_to_token = torch.zeros(max_reqs, max_context_len, **i64)
        self.full_to_swa = torch.zeros((num_full_pages + 1) * page_size, **i64)
        # Both rings get one capacity (eager_decode_alloc indexes both modulo one size); a
        # ring holds its pool's pages in [head, head + count) modulo it.
        cap = max(num_full_pages, num_swa_pages)
        self.n_pages = {"full": num_full_pages, "swa": num_swa_pages}
        self.rings = {pool: torch.cat([torch.arange(1, n + 1, **i64),
                                       torch.zeros(cap - n, **i64)])
                      for pool, n in self.n_pages.items()}
        self.head = {"full": 0, "swa": 0}
        self.count = dict(self.n_pages)
        self.cap = {"full": cap, "swa": cap}
        self.free_rows = list(range(max_reqs - 1, -1, -1))  # pop() gives the lowest
        self.row_of = np.full(n_requests, -1, dtype=np.int64)
        self.length = np.zeros(n_requests, dtype=np.int64)
        self.front = np.zeros(n_requests, dtype=np.int64)
        self.meta = _PinnedRing(4, N_META * max_rows, torch.int64, self.is_cuda)
        self.last_counts = (0, 0, 0, 0)
        self._prewarm()

    def _prewarm(self) -> None:
        """Compile and load every kernel a step uses before the first step (none of it
        changes state: page 0 is the sink, its slots map to nothing)."""
        sink = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.fused(sink, self.full_to_swa, self.ps)
        parts = [sink // self.ps, sink // self.ps]
        torch.cat(parts)
        meta = torch.zeros(N_META, 1, dtype=torch.int64, device=self.device)
        out = torch.zeros(1, dtype=torch.int64, device=self.device)
        alloc_slots(meta, out, self.rings["full"], out, 1, 0, 0, 1, self.ps, self.backend)
        write_rows(meta, torch.zeros_like(self.req_to_token[:1]), out, 1, 0, self.backend)
        if self.is_cuda:
            torch.cuda.synchronize()

    # ---- one scheduler iteration -----------------------------------------------------
    def step(self, st, clock=NULL_CLOCK) -> None:
        clock.device_begin()
        ps, r2t, f2s, fused = self.ps, self.req_to_token, self.full_to_swa, self.fused
        length, front, row_of = self.length, self.front, self.row_of
        full_parts, swa_parts = [], []
        n_full = n_swa = 0
        # free group: releases, split at the frontier ...
        for rid in st.release.tolist():
            a, b = self._release_one(rid, full_parts, swa_parts)
            n_full += a
            n_swa += b
        # ... and window evictions (the rule on the host; a launch only where a page left)
        ev = st.evict
        if len(ev):
            old = front[ev]
            new = np.maximum(old, np.maximum(length[ev] - self.window, 0) // ps * ps)
            for i in np.flatnonzero(new > old).tolist():
                rid, a, b = int(ev[i]), int(old[i]), int(new[i])
                swa_pages, _ = fused(r2t[int(row_of[rid]), a:b:ps], f2s, ps)
                swa_parts.append(swa_pages)
                n_swa += (b - a) // ps
            front[ev] = new
        self._push("full", full_parts, n_full)  # free_group_end
        self._push("swa", swa_parts, n_swa)
        # admits, then allocations
        for rid in st.admit.tolist():
            row_of[rid] = self.free_rows.pop()
            length[rid] = 0
            front[rid] = 0
        n_new = 0
        if len(st.extend_ids):
            n_new += self._allocate(st.extend_ids, st.extend_n)
        if len(st.decode):
            n_new += self._allocate(st.decode, None)
        clock.device_end()
        self.last_counts = (n_new, n_new, n_full, n_swa)

    def _release_one(self, rid: int, full_parts: list, swa_parts: list) -> tuple[int, int]:
        """Free request ``rid`` into the open group: FULL pages of [0, L) (a floor_divide of
        the page-start slots), SWA pages of [f, L) (the fused lookup-and-clear). Returns
        the FULL and SWA pages freed."""
        ps = self.ps
        row, n_pages = int(self.row_of[rid]), _ceil_div(int(self.length[rid]), ps)
        fp = int(self.front[rid]) // ps
        starts = self.req_to_token[row, 0:n_pages * ps:ps]  # one full slot per page (a view)
        full_parts.append(starts // ps)
        n_swa = 0
        if n_pages > fp:
            swa_pages, _ = self.fused(starts[fp:], self.full_to_swa, ps)
            swa_parts.append(swa_pages)
            n_swa = n_pages - fp
        self.free_rows.append(row)
        return n_pages, n_swa

    def _push(self, pool: str, parts: list, n: int) -> None:
        """Return ``n`` pages to a pool's ring: one cat, one or two slice writes."""
        if n == 0:
            return
        pages = parts[0] if len(parts) == 1 else torch.cat(parts)
        ring, cap = self.rings[pool], self.cap[pool]
        tail = (self.head[pool] + self.count[pool]) % cap
        first = min(n, cap - tail)
        ring[tail:tail + first].copy_(pages[:first])
        if first < n:
            ring[:n - first].copy_(pages[first:])
        self.count[pool] += n

    def _allocate(self, ids: np.ndarray, n_tok) -> int:
        """Allocate ``n_tok[i]`` tokens (one each when None) for requests ``ids``; returns
        the new pages per pool. Host: page counts and prefix sums; device: 8 launches."""
        ps = self.ps
        rows, pre = self.row_of[ids], self.length[ids]
        k = len(ids)
        n = np.ones(k, dtype=np.int64) if n_tok is None else n_tok
        pages = _ceil_div(pre + n, ps) - _ceil_div(pre, ps)
        n_pages = int(pages.sum())
        for pool in ("full", "swa"):
            if n_pages > self.count[pool]:
                raise RuntimeError(f"sglang baseline: {pool} pool short ({n_pages} needed, "
                                   f"{self.count[pool]} free); the trace sized it")
        if n_tok is None and self.decode_impl == "torch_ops":
            self._decode_torch_ops(rows, pre, n_pages)
            self.length[ids] = pre + 1
            return n_pages
        ends = np.cumsum(n)
        n_tokens = int(ends[-1])
        i = self.meta.acquire()
        host = self.meta.np[i][:N_META * k].reshape(N_META, k)
        host[M_ROW], host[M_PRE], host[M_N] = rows, pre, n
        np.maximum(pre - 1, 0, out=host[M_PREV])
        host[M_LANE] = ends - n
        host[M_PAGE] = np.cumsum(pages) - pages
        meta = self.meta.bufs[i][:N_META * k].to(self.device, non_blocking=True, copy=True)
        self.meta.submitted(i)
        meta = meta.view(N_META, k)
        last = self.req_to_token[meta[M_ROW], meta[M_PREV]]
        swa_last = self.full_to_swa[last]
        out_full = torch.empty(n_tokens, dtype=torch.int64, device=self.device)
        out_swa = torch.empty(n_tokens, dtype=torch.int64, device=self.device)
        for pool, lst, out in (("full", last, out_full), ("swa", swa_last, out_swa)):
            alloc_slots(meta, lst, self.rings[pool], out, k, n_tokens, self.head[pool],
                        self.cap[pool], ps, self.backend)
        write_rows(meta, self.req_to_token, out_full, k, n_tokens, self.backend)
        self.full_to_swa.index_put_((out_full,), out_swa)
        self._popped(n_pages)
        self.length[ids] = pre + n
        self.out_slots = (out_full, out_swa)
        return n_pages

    def _popped(self, n_pages: int) -> None:
        for pool in ("full", "swa"):
            self.head[pool] = (self.head[pool] + n_pages) % self.cap[pool]
            self.count[pool] -= n_pages

    def _decode_torch_ops(self, rows: np.ndarray, pre: np.ndarray, n_pages: int) -> None:
        """The decode through ``baselines.eager_decode_alloc`` (its ~20 Torch ops)."""
        from baselines import eager_decode_alloc

        k = len(rows)
        i = self.meta.acquire()
        host = self.meta.np[i]
        host[:k], host[k:2 * k] = rows, pre
        dev = self.meta.bufs[i][:2 * k].to(self.device, non_blocking=True, copy=True)
        self.meta.submitted(i)
        view = _DecodeView(self, dev[:k], dev[k:])
        self.out_slots = eager_decode_alloc(view)
        self._popped(n_pages)

    # ---- checks (after the run; reads the device) ------------------------------------
    def verify(self, live_ids) -> dict:
        """Device state against the host: each ring's free section holds distinct pages,
        FULL + SWA conservation, and exactly the live SWA slots mapped."""
        ps = self.ps
        live_ids = np.asarray(live_ids, dtype=np.int64)
        length, front = self.length[live_ids], self.front[live_ids]
        held_full = int(_ceil_div(length, ps).sum())
        held_swa = int((_ceil_div(length, ps) - front // ps).sum())
        out = {}
        for pool, held in (("full", held_full), ("swa", held_swa)):
            cap, count, head = self.cap[pool], self.count[pool], self.head[pool]
            idx = (head + torch.arange(count, device=self.device)) % cap
            free = self.rings[pool][idx].cpu().numpy()
            out[f"{pool}_free_distinct"] = bool(len(np.unique(free)) == count)
            n_pages = self.n_pages[pool]
            out[f"{pool}_free_in_range"] = bool(count == 0 or (free.min() >= 1
                                                               and free.max() <= n_pages))
            out[f"{pool}_conserved"] = count + held == n_pages
        mapped = int(torch.count_nonzero(self.full_to_swa).item())
        out["mapped_slots"] = mapped
        out["mapped_slots_expected"] = int((length - front).sum())
        out["ok"] = all(v for k, v in out.items() if k.endswith(
            ("distinct", "range", "conserved"))) and mapped == out["mapped_slots_expected"]
        return out

    @property
    def stalls(self) -> int:
        return self.meta.stalls


class _DecodeView:
    """The attributes ``baselines.eager_decode_alloc`` reads, over the baseline's tables."""

    def __init__(self, owner: SGLangStyle, rows: torch.Tensor, pos: torch.Tensor):
        self.page_size, self.rows, self.pos = owner.ps, rows, pos
        self.req_to_token, self.full_to_swa = owner.req_to_token, owner.full_to_swa
        self.full_free, self.swa_free = owner.rings["full"], owner.rings["swa"]
        self.full_head, self.swa_head = owner.head["full"], owner.head["swa"]


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
