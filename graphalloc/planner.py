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
    FrontierError,
    OverlapError,
    PositionError,
    RingOverflowError,
    UnknownRequestError,
)
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

__all__ = ["StepBuilder", "as_rows"]

_EMPTY = np.zeros((0, ROW_WIDTH), dtype=np.int64)


def as_rows(rows, n_reqs: int) -> np.ndarray:
    """Request rows as an int64 array; refuses non-integers and out-of-range values."""
    if isinstance(rows, np.ndarray) and rows.dtype == np.int64 and rows.ndim == 1:
        arr = rows  # fast path: already the planner's dtype
        if len(arr) and (arr.min() < 0 or arr.max() >= n_reqs):
            bad = arr[(arr < 0) | (arr >= n_reqs)]
            raise UnknownRequestError(
                f"request row {int(bad[0])} is outside [0, {n_reqs}) (max_reqs={n_reqs})")
        return arr
    arr = np.asarray(rows)
    if arr.ndim == 0:
        arr = arr.reshape(1)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise UnknownRequestError(f"request rows must be a 1-D sequence of ints, got {rows!r}")
    arr = arr.astype(np.int64, copy=False)
    bad = (arr < 0) | (arr >= n_reqs)
    if bad.any():
        raise UnknownRequestError(
            f"request row {int(arr[bad][0])} is outside [0, {n_reqs}) (max_reqs={n_reqs})")
    return arr


def _stack(parts: list[np.ndarray]) -> np.ndarray:
    if not parts:
        return _EMPTY
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _ceil_div(a, b):
    return -(-a // b)


class StepBuilder:
    """Accumulates one step's rows over a working copy of the ledger."""

    def __init__(self, config: AllocatorConfig, ledger: Ledger, epoch: int = 0):
        self.config = config
        self.ledger = ledger  # a working copy: mutated freely, committed by the caller
        self.epoch = epoch  # written into every release row (REL_EPOCH); > 0, never reused
        # Free pages before the step: pops within them never touch this step's pushes.
        self.n_free_before = {"full": ledger.full.n_free, "swa": ledger.swa.n_free}
        self.len_at_start = ledger.seq_len.copy()  # pages below this exist on the device
        self.released = np.zeros(config.max_reqs, dtype=bool)
        self.allocated = np.zeros(config.max_reqs, dtype=bool)
        self.release_parts: list[np.ndarray] = []
        self.alloc_parts: list[np.ndarray] = []
        self.n_tokens = 0  # allocated tokens so far (the next output lane)
        self.n_release_pages = 0  # freed pages so far (the next release page lane)
        self.n_alloc_calls = 0
        self.pages_freed = {"full": 0, "swa": 0}
        self.pages_allocated = {"full": 0, "swa": 0}

    # ---- validation helpers ------------------------------------------------------------
    def live_rows(self, rows, what: str) -> np.ndarray:
        arr = as_rows(rows, self.config.max_reqs)
        dead = ~self.ledger.live[arr]
        if dead.any():
            r = int(arr[dead][0])
            state = "released earlier in this step" if self.released[r] else "not admitted"
            raise UnknownRequestError(f"{what}: request row {r} is {state}; admit() it first")
        counts = np.bincount(arr, minlength=1)
        if len(arr) > 1 and counts.max() > 1:
            raise OverlapError(
                f"{what}: request row {int(np.argmax(counts))} appears twice in one call; "
                "its segments would share pages. Pass each request once")
        return arr

    # ---- frees -------------------------------------------------------------------------
    def advance_frontier(self, rows: np.ndarray, new_pos: np.ndarray) -> int:
        """Free the SWA pages of ``[frontier, new_pos)`` (page-aligned, forward only)."""
        led, ps = self.ledger, self.config.page_size
        new_pos = np.asarray(new_pos, dtype=np.int64).reshape(-1)
        if len(new_pos) != len(rows):
            raise PositionError(f"{len(rows)} rows but {len(new_pos)} frontier positions")
        old = led.frontier[rows]
        limit = self.len_at_start[rows] // ps * ps
        if not ((new_pos % ps != 0) | (new_pos < old) | (new_pos > limit)).any():
            pass  # all valid (one check on the hot path; the diagnosis below on failure)
        elif (new_pos % ps != 0).any():
            i = int(np.flatnonzero(new_pos % ps)[0])
            raise AlignmentError(
                f"request {rows[i]}: frontier {new_pos[i]} is not a multiple of page_size {ps}; "
                "only whole pages are freed")
        elif (new_pos < old).any():
            i = int(np.flatnonzero(new_pos < old)[0])
            raise FrontierError(
                f"request {rows[i]}: frontier would move back from {old[i]} to {new_pos[i]}")
        else:
            i = int(np.flatnonzero(new_pos > limit)[0])
            raise PositionError(
                f"request {rows[i]}: frontier {new_pos[i]} is past the last whole page "
                f"({limit[i]}) that existed when the step began")
        n_pages = (new_pos - old) // ps
        flags = REL_CLEAR if self.config.ring_mode else (REL_SWA | REL_CLEAR)
        self._add_release(rows, old, n_pages, flags)
        led.frontier[rows] = new_pos
        return int(n_pages.sum())

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

    # ---- allocation --------------------------------------------------------------------
    def ring_admit(self, row: int) -> None:
        """Ring mode: pop the request's R ring pages from the SWA ring."""
        n_ring = self.config.swa_ring_pages
        if self.ledger.swa.n_free < n_ring:
            raise CapacityError(
                f"admitting a request in ring mode needs {n_ring} SWA pages, "
                f"{self.ledger.swa.n_free} are free")
        out = np.zeros((1, ROW_WIDTH), dtype=np.int64)
        out[0, AL_REQ] = row
        out[0, AL_SWA_POP] = self.ledger.swa.pop(n_ring)
        out[0, AL_FLAGS] = AL_RING_ADMIT
        out[0, AL_N_PAGES] = n_ring
        self.pages_allocated["swa"] += n_ring
        self.alloc_parts.append(out)

    def extend(self, rows: np.ndarray, n_tokens: np.ndarray) -> np.ndarray:
        """Allocate ``n_tokens[i]`` positions for ``rows[i]``; returns each row's first output
        lane. Refused whole when either pool is short."""
        cfg, led, ps = self.config, self.ledger, self.config.page_size
        n_tokens = np.asarray(n_tokens, dtype=np.int64).reshape(-1)
        if len(n_tokens) != len(rows):
            raise PositionError(f"{len(rows)} rows but {len(n_tokens)} token counts")
        if self.n_alloc_calls and self.allocated[rows].any():
            r = int(rows[self.allocated[rows]][0])
            raise OverlapError(f"request {r} already allocates in this step; "
                               "merge its tokens into one call")
        start = led.seq_len[rows]
        end = start + n_tokens
        if len(rows) and (n_tokens.min() < 0 or end.max() > cfg.max_context_len
                          or n_tokens.max() > cfg.max_tokens_per_alloc_row):
            if (n_tokens < 0).any():
                raise PositionError(f"token counts must be >= 0, got {n_tokens.min()}")
            if (end > cfg.max_context_len).any():
                i = int(np.flatnonzero(end > cfg.max_context_len)[0])
                raise PositionError(
                    f"request {rows[i]}: positions up to {end[i]} exceed max_context_len "
                    f"{cfg.max_context_len}")
            i = int(np.argmax(n_tokens))
            raise BatchTooLargeError(
                f"request {rows[i]} allocates {n_tokens[i]} tokens in one step; the frozen "
                f"max_tokens_per_alloc_row is {cfg.max_tokens_per_alloc_row}: split the extend")
        new_pages = _ceil_div(end, ps) - _ceil_div(start, ps)
        need_full = int(new_pages.sum())
        need_swa = 0 if cfg.ring_mode else need_full
        if need_full > led.full.n_free or need_swa > led.swa.n_free:
            raise CapacityError(
                f"allocation needs {need_full} FULL and {need_swa} SWA pages; "
                f"{led.full.n_free} FULL and {led.swa.n_free} SWA are free. Nothing was "
                "allocated: free or evict first, or allocate fewer tokens")
        if cfg.ring_mode:
            span = _ceil_div(end, ps) - led.frontier[rows] // ps
            if (span > cfg.swa_ring_pages).any():
                i = int(np.argmax(span))
                raise RingOverflowError(
                    f"request {rows[i]}: pages [{led.frontier[rows][i] // ps}, "
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
        self.n_alloc_calls += 1
        self.pages_allocated["full"] += need_full
        self.pages_allocated["swa"] += need_swa
        return first_lane

    @property
    def fusable(self) -> bool:
        """True when release and allocation of this step may run as one launch: the step's
        pops of each FIFO ring fit in what was free before it, so they never read a
        position this step pushes to (``graphalloc.ledger.FreeRing``)."""
        return (self.pages_allocated["full"] <= self.n_free_before["full"]
                and self.pages_allocated["swa"] <= self.n_free_before["swa"])

    # ---- finish ------------------------------------------------------------------------
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
