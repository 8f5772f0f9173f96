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
    decode, lookahead k (C, L): [L, L + 1 + k)        like an extend, but speculative: C stays,
                                                      the step joins ``spec_steps`` (commit and
                                                      trim: :mod:`graphalloc.release_rows`)

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
    SpeculativeStateError,
    UnknownRequestError,
)
from .handles import HandlePlanning
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
    ROW_WIDTH,
)
from .ledger import Ledger
from .release_rows import ReleasePlanning, renumber_lanes, split_release_rows

__all__ = ["StepBuilder", "renumber_lanes", "split_release_rows"]  # (the two from release_rows)

_EMPTY = np.zeros((0, ROW_WIDTH), dtype=np.int64)


def _stack(parts: list[np.ndarray]) -> np.ndarray:
    if not parts:
        return _EMPTY
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _ceil_div(a, b):
    return -(-a // b)


class StepBuilder(ReleasePlanning, HandlePlanning):
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
        self.cut = np.zeros(config.max_reqs, dtype=bool)  # rows trimmed / committed (freed)
        self.ring_admitted = np.zeros(config.max_reqs, dtype=bool)  # ring admits of this step
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
    # ---- allocation ------------------------------------------------------------------------
    def admit(self, row: int) -> None:
        """Make ``row`` live at length 0; in ring mode pop its R ring pages from the SWA
        ring."""
        cfg, led = self.config, self.ledger
        if cfg.ring_mode and led.swa.n_free < cfg.swa_ring_pages:
            raise CapacityError(
                f"admitting a request in ring mode needs {cfg.swa_ring_pages} SWA pages, "
                f"{led.swa.n_free} are free")
        led.reset_rows(row, live=True)
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
        self.ring_admitted[row] = True
        self.alloc_parts.append(out)

    def extend(self, rows: np.ndarray, n_tokens, what: str = "alloc_extend",
               speculative: bool = False) -> np.ndarray:
        """Allocate ``n_tokens[i]`` positions for ``rows[i]``; returns each row's first output
        lane. Refused whole when either pool is short. ``speculative``: the positions are one
        speculative step of each row (a decode with lookahead); otherwise they are committed
        at once, and a row with a speculative tail is refused."""
        cfg, led, ps = self.config, self.ledger, self.config.page_size
        n_tokens = as_counts(n_tokens, len(rows), f"{what} token counts")
        if self.allocated[rows].any():
            r = int(rows[self.allocated[rows]][0])
            if self.ring_admitted[r]:
                raise OverlapError(
                    f"{what}: request {r} is admitted in this step (ring mode): its ring pages "
                    "are written by this step, so it allocates from the next step on")
            raise OverlapError(f"{what}: request {r} already allocates in this step; "
                               "merge its tokens into one call")
        spec = led.spec_steps[rows]
        if speculative and spec[:, -1].any():
            r = int(rows[np.flatnonzero(spec[:, -1])[0]])
            raise SpeculativeStateError(
                f"{what}: request {r} already has {led.SPEC_DEPTH} speculative steps in "
                "flight; commit the oldest (step(commit=...)) before drafting another")
        if not speculative and spec[:, 0].any():
            i = int(np.flatnonzero(spec[:, 0])[0])
            raise SpeculativeStateError(
                f"{what}: request {rows[i]} has a speculative tail of {int(spec[i].sum())} "
                "tokens; commit or trim it first, or decode with lookahead=")
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
        if speculative:  # the step joins the row's speculative steps (first empty slot)
            slot = np.count_nonzero(spec, axis=1)
            led.spec_steps[rows, slot] = n_tokens
        else:
            led.committed[rows] = end
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
                and self.pages_allocated["swa"] <= self.n_free_before["swa"]
                # a row that frees its tail and allocates again in one step: the release
                # must read req_to_token before the allocation rewrites it
                and not (self.cut & self.allocated).any())

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
