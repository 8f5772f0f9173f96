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
    UnknownRequestError,
)
from .inputs import as_counts, as_positions, as_rows
from .kernels.abi import (
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
    positions as one step would. A single row never exceeds ``max_pages``: the config
    guarantees ``max_pages_per_row <= max_step_pages``."""
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
        flags = REL_CLEAR if cfg.ring_mode else (REL_SWA | REL_CLEAR)
        self._add_release(rows, old, n_pages, flags)
        led.frontier[rows] = new_pos
        n_freed = int(n_pages.sum())
        self.pages_evicted += n_freed
        return n_freed

    def window_frontier(self, rows: np.ndarray) -> np.ndarray:
        """The chunk-cache rule: ``floor_page(max(old, L - W))``; with a protected prefix the
        threshold is ``L - max(W, ps)``; never below the protected length."""
        led, cfg = self.ledger, self.config
        ps, window = cfg.page_size, cfg.sliding_window
        length = self.len_at_start[rows]
        protected = led.protected[rows]
        threshold = np.where(protected > 0, length - max(window, ps), length - window)
        new = np.maximum(led.frontier[rows], np.maximum(threshold, 0) // ps * ps)
        return np.maximum(new, protected)

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
        else:
            self._add_release(rows, protected, below, REL_FULL)
            self._add_release(rows, frontier, above, REL_SWA | REL_FULL | REL_CLEAR)
        led.live[rows] = False
        led.seq_len[rows] = 0
        led.frontier[rows] = 0
        led.protected[rows] = 0
        self.released[rows] = True

    def _add_release(self, rows, start_pos, n_pages, flags: int) -> None:
        keep = n_pages > 0
        if not keep.all() or not len(keep):
            if not keep.any():
                return
            rows, start_pos, n_pages = rows[keep], start_pos[keep], n_pages[keep]
        cap = self.config.max_pages_per_row
        if n_pages.max() > cap:  # split long segments into rows of at most cap pages
            n_chunks = _ceil_div(n_pages, cap)
            seg = np.repeat(np.arange(len(rows)), n_chunks)
            chunk = np.arange(len(seg)) - np.repeat(np.cumsum(n_chunks) - n_chunks, n_chunks)
            rows, n_pages = rows[seg], np.minimum(cap, n_pages[seg] - chunk * cap)
            # Ring rows too: a chunk's start position s gives its first ring column s // ps.
            start_pos = start_pos[seg] + chunk * cap * self.config.page_size
        out = np.empty((len(rows), ROW_WIDTH), dtype=np.int64)
        out[:, REL_REQ] = rows
        out[:, REL_START_POS] = start_pos
        out[:, REL_N_PAGES] = n_pages
        out[:, REL_FLAGS] = flags
        ends = np.cumsum(n_pages)
        total = int(ends[-1])
        before = ends - n_pages
        out[:, REL_LANE] = before + self.n_release_pages  # page lanes, in row order
        self.n_release_pages += total
        led = self.ledger
        if flags & (REL_SWA | REL_RING_RETURN):
            out[:, REL_SWA_PUSH] = (led.swa.push(total) + before) % led.swa.capacity
            self.pages_freed["swa"] += total
        else:
            out[:, REL_SWA_PUSH] = 0
        if flags & REL_FULL:
            out[:, REL_FULL_PUSH] = (led.full.push(total) + before) % led.full.capacity
            self.pages_freed["full"] += total
        else:
            out[:, REL_FULL_PUSH] = 0
        out[:, REL_EPOCH] = self.epoch
        self.release_parts.append(out)

    # ---- allocation ------------------------------------------------------------------------
    def admit(self, row: int, n_prefix: int = 0) -> None:
        """Make ``row`` live at length ``n_prefix`` (a protected prefix); in ring mode pop its
        R ring pages from the SWA ring."""
        cfg, led = self.config, self.ledger
        if cfg.ring_mode and led.swa.n_free < cfg.swa_ring_pages:
            raise CapacityError(
                f"admitting a request in ring mode needs {cfg.swa_ring_pages} SWA pages, "
                f"{led.swa.n_free} are free")
        led.live[row] = True
        led.admitted_once[row] = True
        led.seq_len[row] = n_prefix
        led.frontier[row] = n_prefix
        led.protected[row] = n_prefix
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
        led.seq_len[rows] = end
        self.allocated[rows] = True
        self.pages_allocated["full"] += need_full
        self.pages_allocated["swa"] += need_swa
        return first_lane

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
            out[0, AL_SWA_POP] = led.swa.pop(n_pages)
            out[0, AL_OUT] = first
            out[0, AL_FLAGS] = AL_SWA_ONLY
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
