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

import contextlib
from collections.abc import Iterator

import numpy as np

from .errors import NestedGroupError
from .kernels.abi import REL_EPOCH, REL_N_PAGES, ROW_WIDTH
from .planner import StepBuilder
from .release_rows import split_release_rows
from .results import PlannedStep

__all__ = ["FreeGroup", "GroupedFrees"]

_EMPTY_ROWS = np.zeros((0, ROW_WIDTH), dtype=np.int64)


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
        for h in b.dropped_handles:  # a dropped handle is gone until the block ends
            self.touched_handles[h] = True
            if not b.ledger.h_live[h]:
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
        group.committed[rows] = live.committed[rows]
        group.spec_steps[rows] = live.spec_steps[rows]
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


class GroupedFrees:
    """The allocator's free-group API and flush (a part of :class:`graphalloc.HybridAllocator`):
    every free runs through a group, its own one-call block when none is open."""

    @contextlib.contextmanager
    def free_group(self) -> Iterator[None]:
        """Defer every free in the block to one step at its end.

        Inside the block, ``release``, ``evict_window`` and ``advance_frontier`` are
        validated and planned at the call (see :mod:`graphalloc.free_group`) and run at
        exit as one step (several when they exceed the frozen shape) that keeps request
        boundaries. Capacity is unchanged until then. Allocations inside the block run at
        once and cannot use the deferred pages; a request released in the block cannot
        allocate or be freed again. ``plan()`` is refused inside a block (use ``step()``,
        which runs at once). Frees accepted before an exception in the block are still
        flushed, so no page is lost. Nesting raises :class:`NestedGroupError`.
        """
        if self._group is not None:
            raise NestedGroupError("free_group() blocks cannot be nested; "
                                   "close the outer block first")
        self._refuse_planning()
        self._group = FreeGroup(self)
        try:
            yield
        finally:
            group, self._group = self._group, None
            self._flush(group)

    def _deferred(self, op) -> None:
        """Run a free: into the open free group, or as a block of its own (one step; several
        when its rows exceed the frozen step shape, so a free is never refused for size)."""
        if self._group is not None:
            self._group.plan(op)
            return
        steps = self.steps_run
        with self.free_group():
            self._group.plan(op)
        if self.steps_run == steps:  # nothing to push: still this operation's one step
            self._run(lambda b: None)

    def _cache_reclaim(self, cache, n_full: int, n_swa: int) -> None:
        self._deferred(lambda b: cache.reclaim(b, n_full, n_swa))

    def _flush(self, group: FreeGroup) -> None:
        """Run a closed block's frees: its planned release rows as one step, or as several
        consecutive steps when they exceed the frozen shape (never refused: every row was
        validated at its call, and one row always fits a step)."""
        parts = group.flush_parts()
        group.commit(self.ledger)  # rows released with no pages still return their row
        for part in parts:
            part[:, REL_EPOCH] = self.steps_run + 1
            index = self.ring.acquire()
            self.ring.write(index, part, _EMPTY_ROWS, fusable=True)
            pages = int(part[:, REL_N_PAGES].sum())
            self._pending = PlannedStep(index, len(part), 0, 0, {"pages": pages}, {}, None,
                                        True, owner=self)
            self.run(self._pending)
