"""Freeing, planned: frontier moves, window eviction and releases turned into release rows.

Ledger of one request's positions (``ps`` = page size)::

    evict  (frontier f -> f'):  [f, f')               SWA references dropped: pages nobody
                                                      else holds freed, mapping cleared
    release (len L):            [0, f)                FULL references dropped
                                [f, ceil_page(L))     FULL and SWA references dropped (a
                                                      partial tail page whole)
                                ring mode:            the R ring pages return to the SWA ring
    trim (len L -> L' <= L):    [ceil_page(L'), ceil_page(L))
                                                      FULL and SWA references dropped (ring
                                                      mode: FULL freed, mapping cleared); the
                                                      partial page of L' stays, continued
    commit (C, oldest speculative step s, the next s2; n accepted):
                                [0, C + n)            committed (C' = C + n, n <= s)
                                [C', C' + s2)         kept: the step still in flight
                                past C' + s2          a trim to L' = C' + s2

Speculative decoding (committed length C, allocated length L, ``spec_steps``): a decode with
lookahead k allocates ``[L, L + 1 + k)`` as one speculative step; the window rule and every
frontier move follow C only (the frontier never passes ``floor_page(C)``), so a rollback
never needs an evicted SWA page. A trim is refused below ``f + W`` (``f`` > 0 the frontier,
``W`` the window): the window of the new length must still be mapped.

Pages whose last reference goes are pushed in the order of
:func:`graphalloc.references.drop_actions`; every row carries absolute free-ring push
positions, so rows may be split over consecutive steps (:func:`split_release_rows`).
:class:`ReleasePlanning` is a part of :class:`graphalloc.planner.StepBuilder`.
"""

from __future__ import annotations

import numpy as np

from .errors import AlignmentError, FrontierError, PositionError, SpeculativeStateError
from .inputs import as_counts, as_positions
from .kernels.abi import (
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
from .references import ACT_BOTH, ACT_FULL, ACT_SWA, drop_actions

__all__ = ["ReleasePlanning", "renumber_lanes", "split_release_rows"]


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


class ReleasePlanning:
    """The planner's frees (a part of :class:`graphalloc.planner.StepBuilder`)."""

    def advance_frontier(self, rows: np.ndarray, new_pos, what: str = "advance_frontier") -> int:
        """Free the SWA pages of ``[frontier, new_pos)`` (page-aligned, forward only)."""
        led, cfg = self.ledger, self.config
        ps = cfg.page_size
        new_pos = as_positions(new_pos, len(rows), f"{what} positions")
        old = led.frontier[rows]
        # Pages that existed when the step began, and only committed ones (a rollback must
        # never need an evicted page).
        limit = np.minimum(self.len_at_start[rows], led.committed[rows]) // ps * ps
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
                f"committed page ({limit[i]}) that existed when the step began")
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
        """The window rule: ``floor_page(max(old, C - W))`` (C: the committed length, at most
        the length when the step began; C == L without speculation)."""
        led, cfg = self.ledger, self.config
        ps, window = cfg.page_size, cfg.sliding_window
        length = np.minimum(self.len_at_start[rows], led.committed[rows])
        threshold = np.maximum(length - window, 0)
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
        led.reset_rows(rows, live=False)
        self.released[rows] = True

    # ---- speculative decoding: commit, trim ------------------------------------------------
    def commit(self, rows: np.ndarray, n_accepted) -> None:
        """Resolve each row's oldest speculative step (size s): keep ``n_accepted[i] <= s`` of
        its tokens, keep the next step still in flight (s2), trim the rest: C' = C + n,
        L' = C' + s2."""
        led = self.ledger
        n = as_counts(n_accepted, len(rows), "commit accepted counts")
        if (led.spec_steps[rows, 0] == 0).any():
            i = int(np.flatnonzero(led.spec_steps[rows, 0] == 0)[0])
            raise SpeculativeStateError(
                f"commit: request {rows[i]} has no speculative step to commit "
                "(decode(..., lookahead=k) makes one)")
        oldest = led.spec_steps[rows, 0]
        if (n > oldest).any():
            i = int(np.flatnonzero(n > oldest)[0])
            raise PositionError(f"commit: request {rows[i]}: {n[i]} tokens accepted of a "
                                f"speculative step of {oldest[i]}")
        committed = led.committed[rows] + n
        later = led.spec_steps[rows, 1:]
        self._cut(rows, committed + later.sum(axis=1))
        led.committed[rows] = committed
        led.spec_steps[rows, :-1] = later
        led.spec_steps[rows, -1] = 0

    def trim(self, rows: np.ndarray, new_len) -> None:
        """Cut each row to ``new_len[i]`` tokens (the general rollback): pages wholly past it
        lose this row's references; C' = min(C, L'); the speculative steps are cut at L'.
        Refused above L, and below ``f + W`` once the frontier f has moved."""
        led, window = self.ledger, self.config.sliding_window
        new_len = as_positions(new_len, len(rows), "trim lengths")
        length, frontier = led.seq_len[rows], led.frontier[rows]
        if (new_len < 0).any():
            i = int(np.flatnonzero(new_len < 0)[0])
            raise PositionError(f"trim: request {rows[i]}: a length must be >= 0, got "
                                f"{new_len[i]}")
        if (new_len > length).any():
            i = int(np.flatnonzero(new_len > length)[0])
            raise PositionError(f"trim: request {rows[i]} holds {length[i]} tokens, cannot "
                                f"trim to {new_len[i]} (a trim only shortens)")
        low = (frontier > 0) & (new_len < frontier + window)
        if low.any():
            i = int(np.flatnonzero(low)[0])
            raise FrontierError(
                f"trim: request {rows[i]}: length {new_len[i]} is below frontier "
                f"{frontier[i]} + window {window}: the window of the new length would need "
                "SWA pages already evicted. Release the request instead (or load_back)")
        self._cut(rows, new_len)
        committed = led.committed[rows]
        keep = new_len - committed  # speculative tokens kept, cut step by step (oldest first)
        steps = led.spec_steps[rows]
        before = np.cumsum(steps, axis=1) - steps
        led.spec_steps[rows] = np.clip(keep[:, None] - before, 0, steps)
        led.committed[rows] = np.minimum(committed, new_len)

    def _cut(self, rows: np.ndarray, new_len: np.ndarray) -> None:
        """Set the rows' lengths to ``new_len`` (<= L): drop their references to the pages
        wholly past it (pool mode; ring mode frees the FULL pages and clears their mapping,
        the ring stays). Marks the rows ``cut`` (not fusable with their own allocation)."""
        led, ps = self.ledger, self.config.page_size
        lo, hi = _ceil_div(new_len, ps), _ceil_div(led.seq_len[rows], ps)
        if self.config.ring_mode:
            self._add_release(rows, lo * ps, hi - lo, REL_FULL | REL_CLEAR)
        else:
            self._emit(*drop_actions(led.refs, rows, lo, hi, lo, hi))
        led.seq_len[rows] = new_len
        self.cut[rows] |= hi > lo

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
