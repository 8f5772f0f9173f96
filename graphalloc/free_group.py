"""Deferred frees: the state of one open ``HybridAllocator.free_group()`` block.

Inside the block, ``release``, ``evict_window`` and ``advance_frontier`` are
validated at the call (against the ledger plus what the block already
deferred) and recorded as intents; at the block's end the allocator plans all
of them, in call order, as ONE step. Ledger of a request inside a block::

    call                      now                            at the flush
    release(r)                r marked pending (cannot       FULL [protected, f), FULL+SWA
                              allocate, cannot be freed again) [f, ceil_page(L)), row returned
    evict_window(r)           nothing                        frontier to the window rule
    advance_frontier(r, p)    p checked: aligned, forward    frontier to max(p, frontier then)

Capacity does not change until the flush; allocations made inside the block
run at once and cannot use deferred pages.
"""

from __future__ import annotations

import numpy as np

from .errors import (
    AlignmentError,
    FrontierError,
    OverlapError,
    PositionError,
    UnknownRequestError,
)
from .planner import StepBuilder, as_rows

__all__ = ["FreeGroup"]


class FreeGroup:
    """Intents of one open block over ``alloc``'s ledger (read, never written, here)."""

    def __init__(self, alloc):
        n = alloc.config.max_reqs
        self.alloc = alloc
        self.intents: list[tuple[str, np.ndarray, np.ndarray | None]] = []
        self.pending = np.zeros(n, dtype=bool)  # released inside the block
        self.frontier = np.zeros(n, dtype=np.int64)  # highest advance requested in the block

    def rows(self, rows, what: str) -> np.ndarray:
        """Live, not released in this block, each once (``None``: every such row)."""
        led = self.alloc.ledger
        if rows is None:
            return np.flatnonzero(led.live & ~self.pending)
        arr = as_rows(rows, self.alloc.config.max_reqs)
        bad = ~led.live[arr] | self.pending[arr]
        if bad.any():
            r = int(arr[bad][0])
            why = "released earlier in this free_group" if self.pending[r] else "not live"
            raise UnknownRequestError(f"{what}: request row {r} is {why}")
        if len(np.unique(arr)) != len(arr):
            raise OverlapError(f"{what}: a request row appears twice in one call")
        return arr

    def release(self, rows) -> None:
        arr = self.rows(rows, "release")
        self.pending[arr] = True
        self.intents.append(("release", arr, None))

    def evict(self, rows) -> None:
        self.intents.append(("evict", self.rows(rows, "evict_window"), None))

    def advance(self, rows, new_frontier_pos) -> None:
        arr = self.rows(rows, "advance_frontier")
        led, ps = self.alloc.ledger, self.alloc.config.page_size
        pos = np.asarray(new_frontier_pos, dtype=np.int64).reshape(-1)
        if len(pos) != len(arr):
            raise PositionError(f"{len(arr)} rows but {len(pos)} frontier positions")
        if (pos % ps).any():
            bad = int(pos[pos % ps != 0][0])
            raise AlignmentError(f"frontier position {bad} must be a multiple of "
                                 f"page_size {ps}; only whole pages are freed")
        current = np.maximum(led.frontier[arr], self.frontier[arr])
        if (pos < current).any():
            i = int(np.flatnonzero(pos < current)[0])
            raise FrontierError(f"request {arr[i]}: frontier would move back from "
                                f"{current[i]} to {pos[i]}")
        limit = led.seq_len[arr] // ps * ps
        if (pos > limit).any():
            i = int(np.flatnonzero(pos > limit)[0])
            raise PositionError(f"request {arr[i]}: frontier {pos[i]} is past the last whole "
                                f"page ({limit[i]})")
        self.frontier[arr] = pos
        self.intents.append(("advance", arr, pos))

    def refuse_released(self, rows: np.ndarray, what: str) -> np.ndarray:
        """A request released inside the block cannot allocate: its release is only
        deferred, so the ledger still shows it live."""
        if self.pending[rows].any():
            r = int(rows[self.pending[rows]][0])
            raise UnknownRequestError(f"{what}: request row {r} was released earlier in this "
                                      "free_group(); it cannot allocate")
        return rows

    def apply(self, b: StepBuilder) -> None:
        """Plan every intent, in call order, into one step."""
        self.apply_intents(b, self.intents)

    @staticmethod
    def apply_intents(b: StepBuilder, intents: list) -> None:
        for kind, rows, pos in intents:
            if kind == "release":
                b.release(rows)
            elif kind == "evict":
                live = rows[b.ledger.live[rows]]
                b.advance_frontier(live, b.window_frontier(live))
            else:
                # Validated at the call against the frontier then; an evict_window() earlier
                # in the block may since have moved it past pos (pages already freed): no-op.
                b.advance_frontier(rows, np.maximum(pos, b.ledger.frontier[rows]))
