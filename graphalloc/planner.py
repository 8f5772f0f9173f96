"""Host planning: turn a step's operations into descriptor rows. Pure numpy, never captured.

A :class:`StepBuilder` works on a *copy* of the ledger. Every operation first
validates all of its inputs, then updates the copy and appends rows; the
allocator commits the copy only when the whole step planned. A violated
contract therefore raises before anything, host or device, has changed.

Ledger of one request's positions for each operation (``ps`` = page size)::

    evict  (frontier f -> f'):  [f, f')               SWA freed, mapping cleared, FULL kept
    release (len L):            [protected, f)        FULL freed (SWA already gone)
                                [f, ceil_page(L))     FULL and SWA freed (a partial tail whole)
                                ring mode:            the R ring pages return to the SWA ring
    extend (len L -> L + n):    [L, ceil_page(L))     continues the partial page (no pop)
                                [ceil_page(L), L+n)   new pages, popped in order from both rings
    load_back (f -> f' < f):    [f', f)               FULL kept; fresh SWA pages popped and
                                                      mapped (the KV comes back from the host)

This module is the one validator: every operation -- run at once, deferred in a
free group, or dry-run by ``fits()`` -- is checked here, on the builder's copy.

Within one step every release row runs before every allocation row, so pages
freed by the step may be allocated by it (after the frees, in row order).
"""

from __future__ import annotations

import numpy as np

from .config import AllocatorConfig
from .errors import (
    AlignmentError,
    BatchTooLargeError,
    CapacityError,
    ContractError,
    FrontierError,
    OverlapError,
    PositionError,
    RingOverflowError,
    UnknownHandleError,
    UnknownRequestError,
)
from .inputs import as_counts, as_positions, as_rows
from .kernels.abi import (
    AL_COPY,
    AL_FLAGS,
    AL_FULL_POP,
    AL_N_PAGES,
    AL_N_TOKENS,
    AL_OUT,
    AL_REQ,
    AL_RING,
    AL_RING_ADMIT,
    AL_START_POS,
    AL_SWA_ONLY,
    AL_SWA_POP,
    REL_CLEAR,
    REL_EPOCH,
    REL_FLAGS,
    REL_FULL,
    REL_FULL_PUSH,
    REL_LANE,
    REL_N_PAGES,
    REL_REQ,
    REL_RING_RETURN,
    REL_START_POS,
    REL_SWA,
    REL_SWA_PUSH,
    ROW_WIDTH,
)
from .ledger import Ledger
from .references import ACT_BOTH, ACT_FULL, ACT_SWA, drop_actions

__all__ = ["StepBuilder", "renumber_lanes", "split_release_rows"]

_EMPTY = np.zeros((0, ROW_WIDTH), dtype=np.int64)


def _stack(parts: list[np.ndarray]) -> np.ndarray:
    if not parts:
        return _EMPTY
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _ceil_div(a, b):
    return -(-a // b)


def renumber_lanes(release: np.ndarray) -> np.ndarray:
    """Release rows with ``REL_LANE`` made the exclusive prefix sum of their pages (in
    place), as a step's release rows must be."""
    if len(release):
        pages = release[:, REL_N_PAGES]
        release[:, REL_LANE] = np.cumsum(pages) - pages
    return release


def split_release_rows(release: np.ndarray, max_rows: int, max_pages: int) -> list[np.ndarray]:
    """Cut release rows, in order, into parts of at most ``max_rows`` rows and ``max_pages``
    pages each (lanes renumbered per part). Every row carries absolute free-ring push
    positions, so running the parts as consecutive steps pushes the same pages to the same
    positions as one step would. A single row never exceeds ``max_pages``: a row holds at
    most one request's or handle's pages, P <= ``min_step_pages`` <= ``max_step_pages``
    (the config guarantees it)."""
    parts, start = [], 0
    n = len(release)
    pages = release[:, REL_N_PAGES]
    while start < n:
        ends = start + np.flatnonzero(np.cumsum(pages[start:start + max_rows]) <= max_pages)
        stop = int(ends[-1]) + 1 if len(ends) else start + 1
        parts.append(renumber_lanes(release[start:stop].copy()))
        start = stop
    return parts


class StepBuilder:
    """Accumulates one step's rows over a working copy of the ledger: the one validator.

    Each operation validates all of its inputs against the copy (which already holds the
    step's earlier operations), then updates the copy and appends rows. Nothing outside
    the builder changes; the caller commits ``builder.ledger`` only when the whole step
    planned. Cost: O(rows of the operation) numpy per operation.
    """

    def __init__(self, config: AllocatorConfig, ledger: Ledger, epoch: int = 0):
        self.config = config
        self.ledger = ledger  # a working copy: mutated freely, committed by the caller
        self.epoch = epoch  # written into every release row (REL_EPOCH); > 0, never reused
        # Free pages before the step: pops within them never touch this step's pushes.
        self.n_free_before = {"full": ledger.full.n_free, "swa": ledger.swa.n_free}
        self.len_at_start = ledger.seq_len.copy()  # pages below this exist on the device
        self.released = np.zeros(config.max_reqs, dtype=bool)
        self.allocated = np.zeros(config.max_reqs, dtype=bool)
        self.pending = None  # rows released in an open free group (set by FreeGroup)
        self.release_parts: list[np.ndarray] = []
        self.alloc_parts: list[np.ndarray] = []
        self.n_tokens = 0  # allocated tokens so far (the next output lane)
        self.n_release_pages = 0  # freed pages so far (the next release page lane)
        self.pages_freed = {"full": 0, "swa": 0}
        self.pages_allocated = {"full": 0, "swa": 0}
        self.pages_evicted = 0  # SWA pages freed by frontier moves (a part of pages_freed)
        self.copied_handles: set[int] = set()  # handles written (AL_COPY) in this step
        self.dropped_handles: set[int] = set()
        self.pending_handles = None  # handles dropped in an open free group (FreeGroup)
        self.reclaim = None  # fn(builder, n_full, n_swa): frees cached pages into this step

    # ---- validation ----------------------------------------------------------------------
    def live_rows(self, rows, what: str) -> np.ndarray:
        """``rows`` as int64: live, not released in this step or in an open free group, and
        each once. Raises ``UnknownRequestError`` / ``OverlapError`` naming ``what``."""
        arr = as_rows(rows, self.config.max_reqs, what)
        led = self.ledger
        dead = ~led.live[arr]
        pending = self.pending
        if pending is not None:
            dead |= pending[arr]
        if dead.any():
            r = int(arr[dead][0])
            if pending is not None and pending[r]:
                state = ("released earlier in this free_group(); its release runs when the "
                         "block closes")
            elif self.released[r]:
                state = "released earlier in this step"
            elif led.admitted_once[r]:
                state = ("already released (a second release of one request?); a row is live "
                         "again only after admit() returns it")
            else:
                state = "not admitted; admit() returns live rows"
            raise UnknownRequestError(f"{what}: request row {r} is {state}")
        if len(arr) > 1:
            counts = np.bincount(arr)
            if counts.max() > 1:
                raise OverlapError(
                    f"{what}: request row {int(np.argmax(counts))} appears twice in one call; "
                    "its segments would share pages. Pass each request once")
        return arr

    # ---- frees ---------------------------------------------------------------------------
    def advance_frontier(self, rows: np.ndarray, new_pos, what: str = "advance_frontier") -> int:
        """Free the SWA pages of ``[frontier, new_pos)`` (page-aligned, forward only)."""
        led, cfg = self.ledger, self.config
        ps = cfg.page_size
        new_pos = as_positions(new_pos, len(rows), f"{what} positions")
        old = led.frontier[rows]
        limit = self.len_at_start[rows] // ps * ps
        if not ((new_pos % ps != 0) | (new_pos < old) | (new_pos > limit)).any():
            pass  # all valid (one check on the hot path; the diagnosis below on failure)
        elif (new_pos % ps != 0).any():
            i = int(np.flatnonzero(new_pos % ps)[0])
            raise AlignmentError(
                f"{what}: request {rows[i]}: frontier {new_pos[i]} is not a multiple of "
                f"page_size {ps}; only whole pages are freed")
        elif (new_pos < old).any():
            i = int(np.flatnonzero(new_pos < old)[0])
            raise FrontierError(
                f"{what}: request {rows[i]}: frontier would move back from {old[i]} to "
                f"{new_pos[i]} (only load_back() moves it back)")
        else:
            i = int(np.flatnonzero(new_pos > limit)[0])
            raise PositionError(
                f"{what}: request {rows[i]}: frontier {new_pos[i]} is past the last whole "
                f"page ({limit[i]}) that existed when the step began")
        n_pages = (new_pos - old) // ps
        if cfg.ring_mode:  # the ring pages stay with the request: only clear the mapping
            self._add_release(rows, old, n_pages, REL_CLEAR)
            n_freed = int(n_pages.sum())
        else:  # drop the SWA references of [old, new): pages nobody else holds are freed
            empty = np.zeros(len(rows), dtype=np.int64)
            n_freed = self._emit(*drop_actions(led.refs, rows, empty, empty, old // ps,
                                               new_pos // ps))
        led.frontier[rows] = new_pos
        self.pages_evicted += n_freed
        return n_freed

    def window_frontier(self, rows: np.ndarray) -> np.ndarray:
        """The window rule: ``floor_page(max(old, L - W))`` (L: the length when the step
        began)."""
        led, cfg = self.ledger, self.config
        ps, window = cfg.page_size, cfg.sliding_window
        threshold = np.maximum(self.len_at_start[rows] - window, 0)
        return np.maximum(led.frontier[rows], threshold // ps * ps)

    def evict(self, rows: np.ndarray) -> int:
        """Advance the frontiers of ``rows`` by the window rule."""
        return self.advance_frontier(rows, self.window_frontier(rows), "evict_window")

    def release(self, rows: np.ndarray) -> None:
        """Free everything the requests own and return their rows."""
        led, ps = self.ledger, self.config.page_size
        protected, frontier = led.protected[rows], led.frontier[rows]
        end_page = _ceil_div(led.seq_len[rows], ps)
        below = (frontier - protected) // ps
        above = end_page - frontier // ps
        if self.config.ring_mode:
            self._add_release(rows, protected, below, REL_FULL)
            self._add_release(rows, frontier, above, REL_FULL | REL_CLEAR)
            ring = np.full(len(rows), self.config.swa_ring_pages, dtype=np.int64)
            self._add_release(rows, np.zeros(len(rows), dtype=np.int64), ring, REL_RING_RETURN)
        else:  # drop FULL [0, L) and SWA [f, L): pages nobody else holds are freed
            zero = np.zeros(len(rows), dtype=np.int64)
            self._emit(*drop_actions(led.refs, rows, zero, end_page, frontier // ps, end_page))
        led.live[rows] = False
        led.seq_len[rows] = 0
        led.frontier[rows] = 0
        led.protected[rows] = 0
        self.released[rows] = True

    def _emit(self, r: np.ndarray, k: np.ndarray, action: np.ndarray) -> int:
        """Release rows for freed pages ``(row, page index, action)`` in push order (from
        :func:`~graphalloc.references.drop_actions`): consecutive pages of one row with one
        action are one segment. Updates the host mirror (rings, mapping). Returns the SWA
        pages freed."""
        if not len(r):
            return 0
        refs, ps = self.ledger.refs, self.config.page_size
        brk = np.ones(len(r), dtype=bool)
        brk[1:] = (r[1:] != r[:-1]) | (action[1:] != action[:-1]) | (k[1:] != k[:-1] + 1)
        starts = np.flatnonzero(brk)
        n_pages = np.diff(np.append(starts, len(r)))
        act = action[starts]
        flags = np.where(act == ACT_FULL, REL_FULL,
                         np.where(act == ACT_BOTH, REL_SWA | REL_FULL | REL_CLEAR,
                                  REL_SWA | REL_CLEAR))
        pages = refs.page_of[r, k].astype(np.int64)
        full_pages = pages[action != ACT_SWA]
        swa_pages = refs.swa_of[pages[action != ACT_FULL]].astype(np.int64)
        led = self.ledger
        full_tail = (led.full.head + led.full.n_free) % led.full.capacity
        swa_tail = (led.swa.head + led.swa.n_free) % led.swa.capacity
        self._add_release(r[starts], k[starts] * ps, n_pages, flags)
        refs.put("full_ring", (full_tail + np.arange(len(full_pages))) % led.full.capacity,
                 full_pages)
        refs.put("swa_ring", (swa_tail + np.arange(len(swa_pages))) % led.swa.capacity,
                 swa_pages)
        refs.put("swa_of", pages[action != ACT_FULL], 0)
        return len(swa_pages)

    def _add_release(self, rows, start_pos, n_pages, flags) -> None:
        """Release rows (split every ``max_pages_per_row`` pages), lanes and push positions
        assigned in row order. ``flags``: one int for every row, or one per row."""
        flags = np.broadcast_to(np.asarray(flags, dtype=np.int64), np.shape(rows))
        keep = n_pages > 0
        if not keep.all() or not len(keep):
            if not keep.any():
                return
            rows, start_pos, n_pages, flags = rows[keep], start_pos[keep], n_pages[keep], \
                flags[keep]
        cap = self.config.max_pages_per_row
        if n_pages.max() > cap:  # split long segments into rows of at most cap pages
            n_chunks = _ceil_div(n_pages, cap)
            seg = np.repeat(np.arange(len(rows)), n_chunks)
            chunk = np.arange(len(seg)) - np.repeat(np.cumsum(n_chunks) - n_chunks, n_chunks)
            rows, n_pages = rows[seg], np.minimum(cap, n_pages[seg] - chunk * cap)
            flags = flags[seg]
            # Ring rows too: a chunk's start position s gives its first ring column s // ps.
            start_pos = start_pos[seg] + chunk * cap * self.config.page_size
        out = np.empty((len(rows), ROW_WIDTH), dtype=np.int64)
        out[:, REL_REQ] = rows
        out[:, REL_START_POS] = start_pos
        out[:, REL_N_PAGES] = n_pages
        out[:, REL_FLAGS] = flags
        ends = np.cumsum(n_pages)
        out[:, REL_LANE] = ends - n_pages + self.n_release_pages  # page lanes, in row order
        self.n_release_pages += int(ends[-1])
        led = self.ledger
        for pool, ring, col, mask in (
                ("swa", led.swa, REL_SWA_PUSH, (flags & (REL_SWA | REL_RING_RETURN)) != 0),
                ("full", led.full, REL_FULL_PUSH, (flags & REL_FULL) != 0)):
            pushed = np.where(mask, n_pages, 0)
            ends = np.cumsum(pushed)
            total = int(ends[-1])
            out[:, col] = np.where(mask, (ring.push(total) + ends - pushed) % ring.capacity, 0)
            self.pages_freed[pool] += total
        out[:, REL_EPOCH] = self.epoch
        self.release_parts.append(out)

    # ---- allocation ------------------------------------------------------------------------
    def admit(self, row: int) -> None:
        """Make ``row`` live at length 0; in ring mode pop its R ring pages from the SWA
        ring."""
        cfg, led = self.config, self.ledger
        if cfg.ring_mode and led.swa.n_free < cfg.swa_ring_pages:
            raise CapacityError(
                f"admitting a request in ring mode needs {cfg.swa_ring_pages} SWA pages, "
                f"{led.swa.n_free} are free")
        led.live[row] = True
        led.admitted_once[row] = True
        led.seq_len[row] = 0
        led.frontier[row] = 0
        led.protected[row] = 0
        if not cfg.ring_mode:
            return
        n_ring = cfg.swa_ring_pages
        out = np.zeros((1, ROW_WIDTH), dtype=np.int64)
        out[0, AL_REQ] = row
        out[0, AL_SWA_POP] = led.swa.pop(n_ring)
        out[0, AL_FLAGS] = AL_RING_ADMIT
        out[0, AL_N_PAGES] = n_ring
        self.pages_allocated["swa"] += n_ring
        self.allocated[row] = True
        self.alloc_parts.append(out)

    # ---- shared pages (pool mode) --------------------------------------------------------
    def _sharing(self, what: str) -> None:
        if self.config.ring_mode:
            raise ContractError(
                f"{what}: prefix sharing needs pool mode; in ring mode every request keeps its "
                "window in its own ring of SWA pages, so a shared prefix's window cannot be "
                "shared (build the allocator with swa_ring_pages=0)")

    def live_handle(self, handle, what: str) -> int:
        """``handle`` as an int: a handle taken and not dropped (``UnknownHandleError``)."""
        self._sharing(what)
        led = self.ledger
        n = led.n_handles
        if isinstance(handle, (bool, np.bool_)) or not isinstance(handle, (int, np.integer)):
            raise UnknownHandleError(f"{what}: a handle is an int from take_handle(), got "
                                     f"{handle!r}")
        h = int(handle)
        pending = self.pending_handles
        if not 0 <= h < n or not led.h_live[h] or (pending is not None and pending[h]):
            state = ("outside [0, max_handles)" if not 0 <= h < n else
                     "dropped or tombstoned in the open free_group()" if led.h_live[h] else
                     "not held (never taken, or dropped already)")
            raise UnknownHandleError(f"{what}: handle {h} is {state}")
        if h in self.copied_handles:
            raise OverlapError(f"{what}: handle {h} is written in this step; use it in the "
                               "next step")
        return h

    def _hold(self, dst_row: int, src_row: int, n_tokens: int, swa_start: int) -> None:
        """``dst_row`` takes references to ``src_row``'s pages of ``[0, n_tokens)`` (SWA:
        ``[swa_start, n_tokens)``): the host mirror, the counts, and one AL_COPY row."""
        ps, refs = self.config.page_size, self.ledger.refs
        n_pages = n_tokens // ps
        pages = refs.page_of[src_row, :n_pages].astype(np.int64)
        refs.put("page_of", (np.full(n_pages, dst_row), np.arange(n_pages)), pages)
        refs.add("full_ref", pages, 1)
        refs.add("swa_ref", refs.swa_of[pages[swa_start // ps:]].astype(np.int64), 1)
        if n_pages:
            out = np.zeros((1, ROW_WIDTH), dtype=np.int64)
            out[0, AL_REQ] = dst_row
            out[0, AL_FULL_POP] = src_row
            out[0, AL_FLAGS] = AL_COPY
            out[0, AL_N_PAGES] = n_pages
            self.alloc_parts.append(out)

    def take_handle(self, row: int, n_tokens, handle: int) -> None:
        """Handle ``handle`` (a free one) takes references to ``row``'s first ``n_tokens``
        (whole pages): FULL ``[0, n)``, SWA ``[min(frontier, n), n)``."""
        self._sharing("take_handle")
        cfg, led, ps = self.config, self.ledger, self.config.page_size
        r = int(self.live_rows([row], "take_handle")[0])
        n = int(as_counts(n_tokens, 1, "take_handle n_tokens")[0])
        if n % ps:
            raise AlignmentError(f"take_handle: {n} tokens is not a whole number of pages "
                                 f"(page_size {ps}); share whole pages only")
        if not 0 < n <= self.len_at_start[r]:
            raise PositionError(f"take_handle: {n} tokens, request {r} holds "
                                f"{self.len_at_start[r]} (when the step began); take 1 .. that "
                                "many, whole pages")
        swa_start = min(int(led.frontier[r]), n)
        led.h_live[handle], led.h_len[handle], led.h_swa_start[handle] = True, n, swa_start
        self._hold(cfg.max_reqs + handle, r, n, swa_start)
        self.copied_handles.add(handle)

    def admit_on_handle(self, row: int, handle, n_tokens=None) -> None:
        """Make ``row`` live sharing ``handle``'s pages (its first ``n_tokens``, whole pages;
        default all): length n, frontier ``min(swa_start, n)`` (the window below the handle's
        SWA start must be recomputed)."""
        h = self.live_handle(handle, "admit(handle=)")
        led, ps = self.ledger, self.config.page_size
        n = int(led.h_len[h])
        if n_tokens is not None:
            m = int(as_counts(n_tokens, 1, "admit n_tokens")[0])
            if m % ps or not 0 < m <= n:
                raise AlignmentError(f"admit(handle={h}, n_tokens={m}): share whole pages of "
                                     f"the handle's {n} tokens (page_size {ps})")
            n = m
        self.admit(row)
        swa_start = min(int(led.h_swa_start[h]), n)
        led.seq_len[row], led.frontier[row] = n, swa_start
        self._hold(row, self.config.max_reqs + h, n, swa_start)

    def drop_handle(self, handle, swa_only: bool = False) -> None:
        """Drop ``handle``'s references (``swa_only``: its SWA references only, a tombstone:
        the handle's SWA start becomes its length)."""
        what = "drop_handle_swa" if swa_only else "drop_handle"
        h = self.live_handle(handle, what)
        led, ps = self.ledger, self.config.page_size
        row = np.array([self.config.max_reqs + h], dtype=np.int64)
        n_pages = np.array([led.h_len[h] // ps])
        swa_lo = np.array([led.h_swa_start[h] // ps])
        full_hi = np.zeros(1, dtype=np.int64) if swa_only else n_pages
        self._emit(*drop_actions(led.refs, row, np.zeros(1, dtype=np.int64), full_hi, swa_lo,
                                 n_pages))
        if swa_only:
            led.h_swa_start[h] = led.h_len[h]
        else:
            led.h_live[h], led.h_len[h], led.h_swa_start[h] = False, 0, 0
        self.dropped_handles.add(h)

    def extend(self, rows: np.ndarray, n_tokens, what: str = "alloc_extend") -> np.ndarray:
        """Allocate ``n_tokens[i]`` positions for ``rows[i]``; returns each row's first output
        lane. Refused whole when either pool is short."""
        cfg, led, ps = self.config, self.ledger, self.config.page_size
        n_tokens = as_counts(n_tokens, len(rows), f"{what} token counts")
        if self.allocated[rows].any():
            r = int(rows[self.allocated[rows]][0])
            raise OverlapError(f"{what}: request {r} already allocates in this step; "
                               "merge its tokens into one call")
        start = led.seq_len[rows]
        end = start + n_tokens
        if len(rows) and (end.max() > cfg.max_context_len
                          or n_tokens.max() > cfg.max_tokens_per_alloc_row):
            if (end > cfg.max_context_len).any():
                i = int(np.flatnonzero(end > cfg.max_context_len)[0])
                raise PositionError(
                    f"{what}: request {rows[i]}: positions up to {end[i]} exceed "
                    f"max_context_len {cfg.max_context_len}")
            i = int(np.argmax(n_tokens))
            raise BatchTooLargeError(
                f"{what}: request {rows[i]} allocates {n_tokens[i]} tokens in one step; the "
                f"frozen max_tokens_per_alloc_row is {cfg.max_tokens_per_alloc_row}: split the "
                "extend")
        new_pages = _ceil_div(end, ps) - _ceil_div(start, ps)
        need_full = int(new_pages.sum())
        need_swa = 0 if cfg.ring_mode else need_full
        if (need_full > led.full.n_free or need_swa > led.swa.n_free) and (
                self.reclaim is not None):  # a prefix cache may give pages back, this step
            self.reclaim(self, need_full - led.full.n_free, need_swa - led.swa.n_free)
        if need_full > led.full.n_free or need_swa > led.swa.n_free:
            raise CapacityError(
                f"{what}: allocation needs {need_full} FULL and {need_swa} SWA pages; "
                f"{led.full.n_free} FULL and {led.swa.n_free} SWA are free. Nothing was "
                "allocated: free or evict first, or allocate fewer tokens")
        if cfg.ring_mode:
            span = _ceil_div(end, ps) - led.frontier[rows] // ps
            if (span > cfg.swa_ring_pages).any():
                i = int(np.argmax(span))
                raise RingOverflowError(
                    f"{what}: request {rows[i]}: pages [{led.frontier[rows][i] // ps}, "
                    f"{_ceil_div(end[i], ps)}) would need {span[i]} ring pages, the ring has "
                    f"{cfg.swa_ring_pages}. Evict the window first (in the same step is fine), "
                    "or extend in smaller chunks")
        first_lane = self.n_tokens + np.cumsum(n_tokens) - n_tokens
        keep = n_tokens > 0
        if keep.all():
            k_rows, k_start, k_tok, k_pages, k_lane = rows, start, n_tokens, new_pages, first_lane
        else:
            k_rows, k_start, k_tok = rows[keep], start[keep], n_tokens[keep]
            k_pages, k_lane = new_pages[keep], first_lane[keep]
        if len(k_rows):
            pages_before = np.cumsum(k_pages) - k_pages
            out = np.zeros((len(k_rows), ROW_WIDTH), dtype=np.int64)
            out[:, AL_REQ] = k_rows
            out[:, AL_START_POS] = k_start
            out[:, AL_N_TOKENS] = k_tok
            out[:, AL_FULL_POP] = (led.full.pop(need_full) + pages_before) % led.full.capacity
            if cfg.ring_mode:
                out[:, AL_FLAGS] = AL_RING
            else:
                out[:, AL_SWA_POP] = (led.swa.pop(need_swa) + pages_before) % led.swa.capacity
            out[:, AL_OUT] = k_lane
            out[:, AL_N_PAGES] = k_pages
            self.alloc_parts.append(out)
            self.n_tokens = int(k_lane[-1] + k_tok[-1])
            if led.refs is not None and need_full:
                self._hold_new_pages(k_rows, k_start, k_pages, out[0, AL_FULL_POP],
                                     out[0, AL_SWA_POP], need_full)
        led.seq_len[rows] = end
        self.allocated[rows] = True
        self.pages_allocated["full"] += need_full
        self.pages_allocated["swa"] += need_swa
        return first_lane

    def _hold_new_pages(self, rows, start, n_pages, full_pop: int, swa_pop: int,
                        total: int) -> None:
        """Mirror the pops of an extension: row ``rows[i]`` gets the next ``n_pages[i]``
        pages of both rings at page indices from ``ceil(start[i] / ps)``; counts 1 each."""
        refs, ps = self.ledger.refs, self.config.page_size
        full = refs.ring_pages("full", int(full_pop), total).astype(np.int64)
        swa = refs.ring_pages("swa", int(swa_pop), total).astype(np.int64)
        seg = np.repeat(np.arange(len(rows)), n_pages)
        k = np.arange(total) - np.repeat(np.cumsum(n_pages) - n_pages, n_pages)
        refs.put("page_of", (rows[seg], _ceil_div(start, ps)[seg] + k), full)
        refs.put("swa_of", full, swa)
        refs.put("full_ref", full, 1)
        refs.put("swa_ref", swa, 1)

    def load_back(self, row: int, new_frontier_pos) -> int:
        """Move ``row``'s frontier back from ``f`` to ``new_frontier_pos``, re-pairing the FULL
        pages of ``[new_frontier_pos, f)`` with fresh SWA pages (one ``AL_SWA_ONLY`` row);
        returns the row's first output lane (its SWA slots, where the KV is copied back)."""
        cfg, led, ps = self.config, self.ledger, self.config.page_size
        if cfg.ring_mode:
            raise ContractError("load_back is for pool mode; a ring request keeps its ring "
                                "pages, there is nothing to load back")
        rows = self.live_rows([row], "load_back")
        r = int(rows[0])
        if self.allocated[r]:
            raise OverlapError(f"load_back: request {r} already allocates in this step")
        new = int(as_positions(new_frontier_pos, 1, "load_back frontier")[0])
        old = int(led.frontier[r])
        if new % ps:
            raise AlignmentError(f"load_back: frontier {new} is not a multiple of page_size "
                                 f"{ps}")
        if not int(led.protected[r]) <= new <= old:  # a negative target included
            raise FrontierError(f"load_back: request {r}: the frontier must move back into "
                                f"[protected {led.protected[r]}, frontier {old}], got {new}")
        n_pages = (old - new) // ps
        full_pages = led.refs.page_of[r, new // ps:old // ps].astype(np.int64)
        if led.refs.swa_of[full_pages].any():
            k = int(np.flatnonzero(led.refs.swa_of[full_pages])[0])
            raise ContractError(f"load_back: request {r}'s page at position {new + k * ps} "
                                "still has an SWA page (another holder's window covers it); "
                                "load back only pages nobody maps")
        if n_pages > led.swa.n_free:
            raise CapacityError(f"load_back needs {n_pages} SWA pages, {led.swa.n_free} are "
                                "free")
        if n_pages * ps > cfg.max_tokens_per_alloc_row:
            raise BatchTooLargeError(
                f"load_back of {n_pages * ps} positions exceeds the frozen "
                f"max_tokens_per_alloc_row {cfg.max_tokens_per_alloc_row}: load back in parts")
        first = self.n_tokens
        if n_pages:
            out = np.zeros((1, ROW_WIDTH), dtype=np.int64)
            out[0, AL_REQ] = r
            out[0, AL_START_POS] = new
            out[0, AL_N_TOKENS] = n_pages * ps
            swa_pop = led.swa.pop(n_pages)
            out[0, AL_SWA_POP] = swa_pop
            out[0, AL_OUT] = first
            out[0, AL_FLAGS] = AL_SWA_ONLY
            swa = led.refs.ring_pages("swa", swa_pop, n_pages).astype(np.int64)
            led.refs.put("swa_of", full_pages, swa)
            led.refs.put("swa_ref", swa, 1)
            out[0, AL_N_PAGES] = n_pages
            self.alloc_parts.append(out)
            self.n_tokens += n_pages * ps
            self.pages_allocated["swa"] += n_pages
        led.frontier[r] = new
        self.allocated[r] = True
        return first

    @property
    def fusable(self) -> bool:
        """True when release and allocation of this step may run as one launch: the step's
        pops of each FIFO ring fit in what was free before it, so they never read a
        position this step pushes to (``graphalloc.ledger.FreeRing``)."""
        return (self.pages_allocated["full"] <= self.n_free_before["full"]
                and self.pages_allocated["swa"] <= self.n_free_before["swa"])

    # ---- finish --------------------------------------------------------------------------
    def finish(self) -> tuple[np.ndarray, np.ndarray]:
        """The step's release and allocation rows, lanes assigned; checks frozen capacities."""
        cfg = self.config
        release = _stack(self.release_parts)
        alloc = _stack(self.alloc_parts)
        for what, have, cap, name in (
            ("release rows", len(release), cfg.max_release_rows, "max_release_rows"),
            ("freed pages", self.n_release_pages, cfg.max_step_pages, "max_step_pages"),
            ("allocation rows", len(alloc), cfg.max_alloc_rows, "max_alloc_rows"),
            ("allocated tokens", self.n_tokens, cfg.max_step_tokens, "max_step_tokens"),
        ):
            if have > cap:
                raise BatchTooLargeError(
                    f"this step needs {have} {what}; the frozen {name} is {cap}. Split the "
                    f"step, or build the allocator with a larger {name}")
        return release, alloc
