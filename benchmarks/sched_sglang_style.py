"""The scheduler benchmark's SGLang-style baseline, written from SGLang's documented behaviour.

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
allocation kernels are the benchmark's own (``sched_baseline_kernels``, Triton on
CUDA, Torch twins elsewhere), shaped like SGLang's one kernel per pool and call; the
batch's prefix sums come from the host (SGLang's kernel sums them in every program).
``decode="torch_ops"`` swaps the decode allocation for ``baselines.eager_decode_alloc``
(the ~20-op Torch sequence of bench_frees).
"""

from __future__ import annotations

import numpy as np
import torch
from sched_baseline_kernels import (
    M_LANE,
    M_N,
    M_PAGE,
    M_PRE,
    M_PREV,
    M_ROW,
    N_META,
    NULL_CLOCK,
    _ceil_div,
    _PinnedRing,
    alloc_slots,
    write_rows,
)

__all__ = ["SGLangStyle"]


# ---- (a) SGLang-style eager calls ---------------------------------------------------------
class SGLangStyle:
    """SGLang's per-iteration allocator calls, eagerly (see the module docstring).

    Cost per step: O(requests released + evicting + allocating) Python and launches:
    2 per release, 1 per eviction that frees a page, 1-3 per pool at the free group's end,
    8 per allocation call (1 copy, 2 gathers, 2 allocation kernels, 1 write kernel, 1
    scatter, on Triton), no host/device synchronisation.
    """

    name = "sglang"
    prefix_cache = False  # sched_sglang_prefix.SGLangRadixStyle: the radix cache on

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
        self.pool_sizes = (num_full_pages, num_swa_pages)
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
        if len(st.extend_ids):  # (a prefix workload's hits are allocated as fresh tokens)
            n_new += self._allocate(st.extend_ids, st.extend_n_nocache)
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
        self._make_room(n_pages)
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

    def _make_room(self, n_pages: int) -> None:
        """Before an allocation of ``n_pages`` per pool (the radix cache evicts here)."""

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

    def state(self) -> tuple:
        """(free, used, cached) of the FULL pool, then of the SWA pool (no cache: 0)."""
        full, swa = self.count["full"], self.count["swa"]
        return (full, self.n_pages["full"] - full, 0, swa, self.n_pages["swa"] - swa, 0)

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


if __name__ == "__main__":  # a module, not a script: --help says what it is and what to run
    import argparse

    _ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=(
            "A module imported by other scripts; run benchmarks/bench_scheduler.py "
            "instead (each takes --help)."))
    _ap.parse_args()
    _ap.error("nothing to run here: see --help")
