"""Deferred frees: an open ``free_group()`` block records its frees into one Step.

Inside the block, ``release``, ``evict_window``, ``advance_frontier``, ``drop_handle`` and
``drop_handle_swa`` are validated at the call -- by a dry run of the call through the
planner (the one rule site), plus the rules between calls below -- and recorded; nothing
changes until the block ends, so every view (lengths, frontiers, free counts, ``stats()``,
``audit()``) shows the committed state. At the end the recorded frees run as ONE step in
the step's order (releases, then frontier moves, then handle drops), split over consecutive
steps when they exceed the frozen shape (a free is never refused for size).

Ledger of a request inside a block::

    call                      recorded                            live ledger
    release(r)                r released at the end; r cannot     unchanged until the end
                              allocate, be freed again, or be
                              reused by admit() before it
    evict_window(r)           frontier target: the window rule    unchanged until the end
                              on the length at the call (the
                              largest target recorded wins)
    advance_frontier(r, p)    target p: aligned, forward of the   unchanged until the end
                              live frontier and of the block's
                              target (else FrontierError)
    drop_handle(h)            h dropped at the end; not usable,   unchanged until the end
                              not re-taken before it
    drop_handle_swa(h)        h tombstoned at the end (a later    unchanged until the end
                              drop_handle(h) makes it a drop)

A release supersedes the row's recorded target (it frees everything). Operations that are
not frees (admit, allocation, take_handle, load_back of rows the block did not touch) run
at once inside the block, as their own steps, and cannot use the deferred pages; ``commit``
/ ``trim`` / ``plan()`` and frees through ``step()`` are refused (``NestedGroupError``). An
exception escaping the block discards what it recorded (a block is a transaction, like
``scheduler_step()``).

The block records into the one accumulator (:class:`~graphalloc.plan.accumulator.
StepAccumulator`, which this class is): releases and drops in growable int64 columns, the
rows whose frontier moves in call order of their first move (their targets in ``target``),
and the masks ``released`` / ``dropped`` that the planner excludes and that the lowest free
row / handle skips (``alloc.free_row``, ``alloc.take_handle`` ask the block).

Cost per recorded call: one dry-run plan of that call (O(rows of the call)) and O(rows)
numpy (no Python loop over rows); the end: one plan of everything recorded, and one step
per part.
"""

from __future__ import annotations

import numpy as np

from ..errors import FrontierError
from .accumulator import FIELD, StepAccumulator
from .step import EMPTY, Step, normalize

__all__ = ["FreeGroup"]

_RELEASE, _ADVANCE_ROW = FIELD["release"], FIELD["advance_row"]
_DROP, _DROP_SWA = FIELD["drop"], FIELD["drop_swa"]


def _first_of_each(values: np.ndarray) -> np.ndarray:
    """``values`` without repeats, each at its first place. O(n log n) numpy."""
    if len(values) < 2:
        return values
    _, first = np.unique(values, return_index=True)
    return values[np.sort(first)]


class FreeGroup(StepAccumulator):
    """The frees recorded by one open ``free_group()`` block (see the module docstring)."""

    def __init__(self, alloc):
        cfg = alloc.config
        StepAccumulator.__init__(self, cfg)
        self.alloc = alloc
        self.released = np.zeros(cfg.max_reqs, dtype=bool)  # excluded from at-once steps
        self.dropped = np.zeros(cfg.max_handles, dtype=bool)
        self.tombstoned = np.zeros(cfg.max_handles, dtype=bool)
        self.target = np.full(cfg.max_reqs, -1, dtype=np.int64)  # frontier target, -1 none

    def touched(self, row: int) -> bool:
        return bool(self.released[row] or self.target[row] >= 0)

    @property
    def recorded(self) -> bool:
        """Whether the block recorded anything to run."""
        f = self.fields
        return bool(len(f[_RELEASE]) or len(f[_DROP]) or len(self._tombs())
                    or (self.target[f[_ADVANCE_ROW]] >= 0).any())

    def _tombs(self) -> np.ndarray:
        """Handles tombstoned at the end, in call order (a later drop supersedes)."""
        tomb = self.fields[_DROP_SWA]
        return _first_of_each(tomb[self.tombstoned[tomb]]) if len(tomb) else EMPTY

    def _moved(self) -> np.ndarray:
        """Rows with a frontier target, in the order of their first move."""
        rows = self.fields[_ADVANCE_ROW]
        return rows[self.target[rows] >= 0] if len(rows) else EMPTY

    # ---- recording ----------------------------------------------------------------------
    def release(self, rows) -> None:
        arr = normalize(Step(release=rows), self.alloc.config).release
        self.alloc.dry_run(Step(release=arr), oversize=True)
        self.released[arr] = True
        self.target[arr] = -1
        self.put(_RELEASE, arr)

    def advance(self, rows, new_frontier_pos) -> None:
        a = normalize(Step(advance=(rows, new_frontier_pos)), self.alloc.config)
        rows, pos = a.advance_row, a.advance_pos
        self.alloc.dry_run(Step(advance=(rows, pos)), oversize=True)
        behind = (self.target[rows] >= 0) & (pos < self.target[rows])
        if behind.any():
            i = int(np.flatnonzero(behind)[0])
            raise FrontierError(
                f"advance_frontier: request {rows[i]}: frontier would move back from "
                f"{self.target[rows[i]]} (moved there earlier in this free_group()) to {pos[i]}")
        self._target(rows, pos)

    def evict(self, rows) -> None:
        alloc = self.alloc
        if rows is None:
            arr = np.flatnonzero(alloc.ledger.live & ~self.released)
        else:
            arr = normalize(Step(evict=rows), alloc.config).evict
            alloc.dry_run(Step(evict=arr), oversize=True)
        targets = alloc.config.pools.window.targets(alloc.ledger, arr)
        self._target(arr, np.maximum(targets, self.target[arr]))

    def _target(self, rows: np.ndarray, pos: np.ndarray) -> None:
        self.put(_ADVANCE_ROW, _first_of_each(rows[self.target[rows] < 0]))
        self.target[rows] = pos

    def drop(self, handle, swa_only: bool) -> None:
        arr = normalize(Step(drop=handle), self.alloc.config).drop
        self.alloc.dry_run(Step(drop_swa=arr) if swa_only else Step(drop=arr), oversize=True)
        if swa_only:
            new = _first_of_each(arr[~self.tombstoned[arr]])
            self.tombstoned[new] = True
            self.put(_DROP_SWA, new)
        else:
            self.dropped[arr] = True
            self.tombstoned[arr] = False  # a drop supersedes the tombstone
            self.put(_DROP, arr)

    # ---- the end ------------------------------------------------------------------------
    def to_step(self) -> Step:
        """Everything recorded, as one Step (releases and drops in call order, frontier
        targets in the order their rows were first moved)."""
        adv = self._moved()
        return Step(release=self.fields[_RELEASE], advance=(adv, self.target[adv]),
                    drop=self.fields[_DROP], drop_swa=self._tombs())

    def merged_with(self, step: Step) -> Step:
        """The block's Step with ``step``'s frees added (a query counting what they add;
        ``step`` was checked against the block already)."""
        cfg = self.alloc.config
        q = normalize(step, cfg)
        target = self.target.copy()
        moved = self._moved()
        rows, pos = q.advance_row, q.advance_pos
        new = _first_of_each(rows[target[rows] < 0])
        np.maximum.at(target, rows, pos)  # (-1 or the block's target, raised to pos)
        rel = np.concatenate([self.fields[_RELEASE], q.release])
        target[rel] = -1
        order = np.concatenate([moved, new])
        order = order[target[order] >= 0]
        tombs = self._tombs()
        return Step(release=rel, advance=(order, target[order]),
                    drop=np.concatenate([self.fields[_DROP], q.drop]),
                    drop_swa=tombs[~np.isin(tombs, q.drop)])
