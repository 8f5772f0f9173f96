"""Extra window pools: a model's second, third, ... window pool (index p >= 1).

A model with two sliding windows of different sizes (vLLM's hybrid allocator puts each
window in a group of its own) or a sliding window beside chunked local attention has one
window pool per window layer kind. The first (p = 0) is :class:`~graphalloc.pools.window.
WindowPool`, planned with FULL in the step's main release and allocation rows. Every
further pool is an :class:`ExtraWindowPool`: its own pages paired with FULL pages (its
``full_to_swa``), its own frontier per request and start per handle, its own free ring and
page mirror (:class:`~graphalloc.state.window_ledger.WindowLedger`), its own descriptor
sections and device tables. The pooled policy only (no ring of pages per request) and
pool mode (the page mirror); the config refuses the rest.

Ledger of request r in pool p (f_p its frontier, ``ps`` the page size)::

    release (L)                refs of [f_p, ceil_page(L)) dropped
    cut to L' (trim, commit)   refs of [ceil_page(L'), ceil_page(L)) dropped
    evict (f_p -> f_p')        f_p' = max(f_p, floor_page(needed_p(min(L0, C)))); refs of
                               [f_p, f_p') dropped (the pool's own rule)
    extend / decode            one page of pool p per new FULL page, popped in the same
                               order as the FULL pages (PAGES_SHORT names the pool)
    take handle h of r at n    h_start_p = min(f_p, n); +1 on [h_start_p, n)
    admit on h at n            f_p = min(h_start_p, n); +1 on [f_p, n)
    drop h / tombstone h       refs of [h_start_p, n) dropped; h_start_p = n (tombstone)
    trim to L'                 refused when f_p > 0 and L' < min_length_p(f_p)
    advance, load_back         the first pool only: pool p's frontier does not move

A page several rows of one call free is pushed once, at its first row (as
:func:`~graphalloc.state.references.drop_actions`); each kind is one call, in the step's
order. Rows (:mod:`graphalloc.kernels.abi`): release rows ``REL_SWA | REL_CLEAR`` (the FULL
page of position s + j*ps read from ``req_to_token``, its peer pushed, the mapping
cleared), split every ``max_pages_per_row`` pages; allocation rows ``AL_SWA_ONLY |
AL_NO_OUT`` of the new pages (page-aligned start, n_pages * ps tokens, no output lanes).
Cost: O(rows + pages) numpy per kind.
"""

from __future__ import annotations

import numpy as np

from ..device.layout import window_allocation, window_release
from ..kernels.abi import (
    AL_FLAGS,
    AL_N_PAGES,
    AL_N_TOKENS,
    AL_NO_OUT,
    AL_OUT,
    AL_REQ,
    AL_START_POS,
    AL_SWA_ONLY,
    AL_SWA_POP,
    REL_CLEAR,
    REL_EPOCH,
    REL_FLAGS,
    REL_LANE,
    REL_N_PAGES,
    REL_REQ,
    REL_START_POS,
    REL_SWA,
    REL_SWA_PUSH,
    ROW_WIDTH,
)
from ..plan.refusals import SHAPE_WINDOW_PAGES, SHAPE_WINDOW_ROWS, Kind, Refusal, RefusalCode

__all__ = ["ExtraWindowPool", "WindowPlan", "section_tokens"]

_EMPTY_ROWS = np.zeros((0, ROW_WIDTH), dtype=np.int64)


def section_tokens(config) -> int:
    """Token lanes of an extra pool's allocation section: its rows are the step's
    allocating rows with new pages, each ``n_pages * ps`` tokens, and ``sum ceil(n_i / ps)
    <= ceil(max_step_tokens / ps) + max_alloc_rows``, so ``ps`` times that bounds it."""
    ps = config.page_size
    return ps * (-(-config.max_step_tokens // ps) + config.max_alloc_rows)


class ExtraWindowPool:
    """Window pool ``index`` (>= 1) of a model: ``rule`` (a sliding or chunk rule) over
    ``num_pages`` pages (see the module docstring)."""

    has_window = True

    def __init__(self, rule, num_pages: int, index: int):
        self.rule, self.num_pages, self.index = rule, int(num_pages), int(index)

    def descriptor_sections(self, config) -> tuple:
        """Its two descriptor sections (:mod:`graphalloc.device.layout`), of the main
        sections' shapes: ``window{p}_release``, then ``window{p}_allocation``."""
        return ((window_release(self.index), config.max_release_rows),
                (window_allocation(self.index), config.max_alloc_rows))

    def min_pages(self, page_size: int, request_pages: int) -> int:
        """Pages one request can hold at its window: ``ceil(reach / ps) + 1``, capped by the
        pages one request can own."""
        return min(-(-self.rule.reach // page_size) + 1, request_pages)

    def targets(self, ledger, window, rows: np.ndarray, len_at_start=None) -> np.ndarray:
        """The rule's frontier for ``rows``: ``max(f_p, floor_page(needed_from(min(L0,
        C))))``."""
        length = (ledger.seq_len if len_at_start is None else len_at_start)[rows]
        length = np.minimum(length, ledger.committed[rows])
        ps = ledger.config.page_size
        return np.maximum(window.frontier[rows], self.rule.needed_from(length) // ps * ps)

    def present(self, start: int, n_tokens: int, page_size: int) -> bool:
        """Whether a holder whose pages of this pool start at ``start`` still has the window
        a request admitted on its first ``n_tokens`` needs."""
        return start <= int(self.rule.needed_from(n_tokens)) // page_size * page_size

    def describe(self) -> str:
        return f"window pool {self.index}: {self.rule.describe()}, {self.num_pages} pages"


class WindowPlan:
    """Pool ``pool``'s part of one step's plan: the rules the kinds call, its section's
    rows and counters (made by :class:`~graphalloc.plan.context.PlanContext`, one per extra
    pool, dropped with it). ``window`` is the pool's ledger slice."""

    def __init__(self, pool: ExtraWindowPool, window, ctx):
        self.pool, self.window, self.ctx = pool, window, ctx
        self.release_parts: list[np.ndarray] = []
        self.alloc_parts: list[np.ndarray] = []
        self.n_release_pages = 0  # the release section's page lanes so far
        self.n_tokens = 0  # the allocation section's token lanes so far
        self.pages_freed = self.pages_allocated = 0

    # ---- frees -----------------------------------------------------------------------------
    def release(self, rows: np.ndarray, end_page: np.ndarray) -> None:
        """A release (before the rows are reset): refs of ``[f_p, ceil_page(L))``."""
        self._drop(rows, self.window.frontier[rows] // self.ctx.ps, end_page)

    def cut(self, rows: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> None:
        """A cut of page indices ``[lo, hi)`` (trim, commit; ``lo >= f_p / ps``)."""
        self._drop(rows, np.maximum(lo, self.window.frontier[rows] // self.ctx.ps), hi)

    def evict(self, rows: np.ndarray) -> None:
        """The pool's own rule on its own frontiers (the step's evict kind)."""
        ctx, w = self.ctx, self.window
        new = self.pool.targets(ctx.ledger, w, rows, ctx.len_at_start)
        old = w.frontier[rows]
        moved = new > old
        if moved.any():
            rows, old, new = rows[moved], old[moved], new[moved]
            self._drop(rows, old // ctx.ps, new // ctx.ps)
            w.put("frontier", rows, new)

    def drop_handles(self, handles: np.ndarray, swa_only: np.ndarray) -> None:
        """Handles drop their refs of ``[h_start_p, n)`` (before the ledger forgets them);
        a tombstone's start becomes n, a whole drop's 0."""
        ctx, w = self.ctx, self.window
        h_len = ctx.ledger.h_len[handles]
        self._drop(ctx.config.max_reqs + handles, w.h_start[handles] // ctx.ps, h_len // ctx.ps)
        w.put("h_start", handles, np.where(swa_only != 0, h_len, 0))

    def check_trim(self, rows: np.ndarray, new_len: np.ndarray) -> None:
        """Refuse a trim whose new length's window would need this pool's evicted pages."""
        frontier = self.window.frontier[rows]
        limit = self.pool.rule.min_length(frontier)
        low = (frontier > 0) & (new_len < limit)
        if low.any():
            i = int(np.flatnonzero(low)[0])
            raise Refusal(RefusalCode.TRIM_BELOW_WINDOW, Kind.TRIM, int(rows[i]),
                          int(new_len[i]), int(limit[i]))

    # ---- shares ----------------------------------------------------------------------------
    def take(self, handles: np.ndarray, rows: np.ndarray, n: np.ndarray) -> None:
        """Handles taken on ``rows``' first ``n`` tokens: ``h_start_p = min(f_p, n)``."""
        start = np.minimum(self.window.frontier[rows], n)
        self.window.put("h_start", handles, start)
        self._hold(rows, start, n)

    def admit_on(self, rows: np.ndarray, handles: np.ndarray, n: np.ndarray) -> None:
        """Requests admitted on handles' first ``n`` tokens: ``f_p = min(h_start_p, n)``."""
        start = np.minimum(self.window.h_start[handles], n)
        self.window.put("frontier", rows, start)
        self._hold(self.ctx.config.max_reqs + handles, start, n)

    def _hold(self, src_rows: np.ndarray, start: np.ndarray, n: np.ndarray) -> None:
        """+1 on this pool's pages of ``src_rows``' positions ``[start, n)``."""
        ps = self.ctx.ps
        lo, hi = start // ps, n // ps
        full = _pages(self.ctx.refs.page_of, src_rows, lo, hi)[2]
        self.window.add("swa_ref", self.window.swa_of[full].astype(np.int64), 1)

    # ---- allocations -----------------------------------------------------------------------
    def short(self, need: int) -> bool:
        """Whether an allocation of ``need`` new FULL pages finds this pool short."""
        return need > self.window.free.n_free

    def check_room(self, need: int, kind: Kind) -> None:
        """Refuse (``PAGES_SHORT``, the pool named: row ``index + 1``) when short."""
        n_free = self.window.free.n_free
        if need > n_free:
            raise Refusal(RefusalCode.PAGES_SHORT, kind, self.pool.index + 1, need - n_free,
                          n_free)

    def extend(self, rows, start, n_pages, full_pop: int, total: int) -> None:
        """Rows ``rows`` got ``n_pages[i]`` new FULL pages from page index ``ceil(start[i] /
        ps)`` on (``total`` popped at FULL ring position ``full_pop``): pair each with a page
        of this pool, popped in the same order; one allocation row per row with pages."""
        if not total:
            return
        ctx, w, ps = self.ctx, self.window, self.ctx.ps
        full = ctx.refs.ring_pages("full", int(full_pop), total).astype(np.int64)
        pop = w.free.pop(total)
        peer = w.ring_pages(pop, total).astype(np.int64)
        w.put("swa_of", full, peer)
        w.put("swa_ref", peer, 1)
        keep = n_pages > 0
        r, s, n = rows[keep], start[keep], n_pages[keep]
        before = np.cumsum(n) - n
        out = np.zeros((len(r), ROW_WIDTH), dtype=np.int64)
        out[:, AL_REQ] = r
        out[:, AL_START_POS] = -(-s // ps) * ps
        out[:, AL_N_TOKENS] = n * ps
        out[:, AL_SWA_POP] = (pop + before) % w.num_pages
        out[:, AL_OUT] = self.n_tokens + before * ps  # (informative: no output lanes)
        out[:, AL_FLAGS] = AL_SWA_ONLY | AL_NO_OUT
        out[:, AL_N_PAGES] = n
        self.alloc_parts.append(out)
        self.n_tokens += total * ps
        self.pages_allocated += total

    # ---- the section -----------------------------------------------------------------------
    def check_shape(self) -> None:
        """Refuse a release section over the frozen shape (``STEP_OVER_SHAPE``, shapes
        ``SHAPE_WINDOW_ROWS`` / ``SHAPE_WINDOW_PAGES``). The allocation section cannot
        exceed its shape: a row per allocating row with new pages (at most
        ``max_alloc_rows``), :func:`section_tokens` tokens."""
        cfg = self.ctx.config
        n_rows = sum(len(p) for p in self.release_parts)
        for which, have, cap in ((SHAPE_WINDOW_ROWS, n_rows, cfg.max_release_rows),
                                 (SHAPE_WINDOW_PAGES, self.n_release_pages,
                                  cfg.max_step_pages)):
            if have > cap:
                raise Refusal(RefusalCode.STEP_OVER_SHAPE, Kind.STEP, which, have, cap)

    def rows(self) -> tuple[np.ndarray, np.ndarray]:
        """``(release rows, allocation rows)`` of the section, in order."""
        return _concat(self.release_parts), _concat(self.alloc_parts)

    # ---- dropping references ---------------------------------------------------------------
    def _drop(self, rows: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> int:
        """Rows drop their refs of this pool's pages at page indices ``[lo, hi)``; the pages
        that frees (first occurrence: rows in call order, pages in index order) become
        release rows. Returns the pages freed."""
        ctx, w = self.ctx, self.window
        r, k, full = _pages(ctx.refs.page_of, rows, lo, hi)
        if not len(r):
            return 0
        peer = w.swa_of[full].astype(np.int64)
        w.add("swa_ref", peer, -1)
        hit = np.flatnonzero(w.swa_ref[peer] == 0)
        _, first = np.unique(full[hit], return_index=True)
        keep = np.sort(hit[first])
        self._emit(r[keep], k[keep], full[keep], peer[keep])
        return len(keep)

    def _emit(self, r, k, full, peer) -> None:
        """Release rows for freed pages in push order (consecutive pages of one row are one
        segment, split every ``max_pages_per_row``); the mirror: ring, mapping."""
        if not len(r):
            return
        ctx, w, ps = self.ctx, self.window, self.ctx.ps
        brk = np.ones(len(r), dtype=bool)
        brk[1:] = (r[1:] != r[:-1]) | (k[1:] != k[:-1] + 1)
        starts = np.flatnonzero(brk)
        n_pages = np.diff(np.append(starts, len(r)))
        seg_rows, seg_first = r[starts], k[starts]
        cap = ctx.config.max_pages_per_row
        n_chunks = -(-n_pages // cap)
        seg = np.repeat(np.arange(len(starts)), n_chunks)
        chunk = np.arange(len(seg)) - np.repeat(np.cumsum(n_chunks) - n_chunks, n_chunks)
        n_row = np.minimum(cap, n_pages[seg] - chunk * cap)
        before = np.cumsum(n_row) - n_row
        tail = w.free.tail
        out = np.zeros((len(seg), ROW_WIDTH), dtype=np.int64)
        out[:, REL_REQ] = seg_rows[seg]
        out[:, REL_START_POS] = (seg_first[seg] + chunk * cap) * ps
        out[:, REL_N_PAGES] = n_row
        out[:, REL_FLAGS] = REL_SWA | REL_CLEAR
        out[:, REL_SWA_PUSH] = (tail + before) % w.num_pages
        out[:, REL_LANE] = self.n_release_pages + before
        out[:, REL_EPOCH] = ctx.epoch
        self.release_parts.append(out)
        self.n_release_pages += len(r)
        self.pages_freed += len(r)
        w.free.push(len(r))
        w.put("swa_ring", (tail + np.arange(len(r))) % w.num_pages, peer)
        w.put("swa_of", full, 0)


def _pages(page_of: np.ndarray, rows: np.ndarray, lo: np.ndarray, hi: np.ndarray):
    """``(row, page index, FULL page)`` of every index in ``[lo[i], hi[i])`` of ``rows[i]``,
    rows in order, indices ascending (int64)."""
    n = np.maximum(hi - lo, 0)
    total = int(n.sum())
    if not total:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    seg = np.repeat(np.arange(len(rows)), n)
    k = np.arange(total) - np.repeat(np.cumsum(n) - n, n) + lo[seg]
    r = rows[seg].astype(np.int64)
    return r, k.astype(np.int64), page_of[r, k].astype(np.int64)


def _concat(parts: list[np.ndarray]) -> np.ndarray:
    return _EMPTY_ROWS if not parts else parts[0] if len(parts) == 1 else np.concatenate(parts)
