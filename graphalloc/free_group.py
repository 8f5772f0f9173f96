"""Deferred frees: one open ``HybridAllocator.free_group()`` block, planned as it goes.

Inside the block, ``release``, ``evict_window`` and ``advance_frontier`` are planned at
the call -- by the planner itself (:class:`~graphalloc.planner.StepBuilder`, the one
validator), on the group's own copy of the ledger, which already holds the block's
earlier frees -- and their descriptor rows are kept. At the block's end the rows are
flushed: one step, or several consecutive steps when they exceed the frozen step shape
(cut at row boundaries, lanes renumbered). Nothing is validated twice.

Why rows planned at the call are still right at the flush: a free pushes its pages at
the ring's tail, ``head + n_free``; the only device work allowed inside the block is
allocation (and ring admission, and load-back), which pops at the head, moving
``head`` up and ``n_free`` down by the same amount: the tail does not move. So the push
positions written at the call are the positions the flush's pushes must use, whatever
was allocated in between.

Ledger of a request inside a block::

    call                      at the call (group copy)            live ledger
    release(r)                r freed and marked pending:         unchanged until the
                              cannot allocate, be freed again,    flush (capacity too)
                              or be reused by admit()
    evict_window(r)           frontier to the window rule (of     unchanged until the
                              the length when the call was made)  flush
    advance_frontier(r, p)    frontier to p (aligned, forward)    unchanged until the flush

Operations that run at once inside the block (admit, allocation, load-back) update the
live ledger, and the rows they touched are copied into the group's copy, so a later
deferred free sees their new length. Frees accepted before an exception in the block
are still flushed, so no page is lost.
"""

from __future__ import annotations

import numpy as np

from .planner import StepBuilder, split_release_rows

__all__ = ["FreeGroup"]


class FreeGroup:
    """The state of one open block over ``alloc``'s ledger.

    ``builder`` plans the deferred frees on a copy of the ledger taken at the block's
    start; ``pending`` marks the rows released in the block. Cost per deferred call: the
    planner's cost for that call (O(rows)); the flush: one step per part.
    """

    def __init__(self, alloc):
        self.alloc = alloc
        self.builder = StepBuilder(alloc.config, alloc.ledger.copy())
        self.pending = np.zeros(alloc.config.max_reqs, dtype=bool)
        self.builder.pending = self.pending
        self.touched = np.zeros(alloc.config.max_reqs, dtype=bool)  # rows the block froze
        n_handles = alloc.ledger.n_handles
        self.pending_handles = np.zeros(n_handles, dtype=bool)  # handles dropped in the block
        self.touched_handles = np.zeros(n_handles, dtype=bool)
        self.builder.pending_handles = self.pending_handles

    def plan(self, op) -> None:
        """Apply ``op(builder)`` to the group: validated and planned now, flushed later.
        A refused call leaves the group as it was (the shared page mirror rolled back)."""
        b = self.builder
        saved_ledger, n_parts = b.ledger.copy(), len(b.release_parts)
        saved = (b.n_release_pages, dict(b.pages_freed), b.released.copy(), self.pending.copy(),
                 set(b.dropped_handles))
        refs = b.ledger.refs
        mark = refs.mark() if refs is not None else 0
        try:
            rows = op(b)
        except Exception:
            if refs is not None:
                refs.rollback(mark)
            b.ledger, b.release_parts[n_parts:] = saved_ledger, []
            b.n_release_pages, b.pages_freed = saved[0], saved[1]
            b.released[:], self.pending[:] = saved[2], saved[3]
            b.dropped_handles = saved[4]
            raise
        if refs is not None:
            refs.release_mark(mark)
        if rows is not None:
            self.touched[rows] = True
        self.pending |= b.released
        for h in b.dropped_handles:  # dropped or tombstoned: frozen until the block ends
            self.touched_handles[h] = True
            self.pending_handles[h] = True

    def sync_rows(self, rows: np.ndarray) -> None:
        """Copy the live ledger's state of ``rows`` into the group's copy after an operation
        that ran at once inside the block changed them: every field of a row the block has
        not touched (an admit), only the length of one it has (its frontier is the
        block's)."""
        live, group = self.alloc.ledger, self.builder.ledger
        rows = np.asarray(rows, dtype=np.int64)
        fresh = rows[~self.touched[rows]]
        group.assign_rows(live, fresh)
        group.seq_len[rows] = live.seq_len[rows]
        self.builder.len_at_start[rows] = live.seq_len[rows]

    def sync_handles(self) -> None:
        """Copy the live ledger's handles the block has not touched (taken at once inside
        the block) into the group's copy."""
        live, group = self.alloc.ledger, self.builder.ledger
        fresh = np.flatnonzero(~self.touched_handles)
        for name in live.HANDLE_ARRAYS:
            getattr(group, name)[fresh] = getattr(live, name)[fresh]

    def flush_parts(self) -> list[np.ndarray]:
        """The block's release rows, cut into parts that each fit one step."""
        cfg, parts = self.alloc.config, self.builder.release_parts
        if not parts:
            return []
        return split_release_rows(np.concatenate(parts), cfg.max_release_rows,
                                  cfg.max_step_pages)

    def commit(self, ledger) -> None:
        """Apply the block's frees to ``ledger`` (the live one, at the flush): the state of
        every row the block froze, and the pushed page counts."""
        rows = np.flatnonzero(self.touched)
        ledger.assign_rows(self.builder.ledger, rows)
        handles = np.flatnonzero(self.touched_handles)
        for name in ledger.HANDLE_ARRAYS:
            getattr(ledger, name)[handles] = getattr(self.builder.ledger, name)[handles]
        ledger.full.n_free += self.builder.pages_freed["full"]
        ledger.swa.n_free += self.builder.pages_freed["swa"]
