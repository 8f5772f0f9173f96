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

Cost per recorded call: one dry-run plan of that call (O(rows of the call)); the end: one
plan of everything recorded, and one step per part.
"""

from __future__ import annotations

import numpy as np

from ..errors import FrontierError
from .step import Step, normalize

__all__ = ["FreeGroup"]


class FreeGroup:
    """The frees recorded by one open ``free_group()`` block (see the module docstring)."""

    def __init__(self, alloc):
        self.alloc = alloc
        cfg = alloc.config
        self.released = np.zeros(cfg.max_reqs, dtype=bool)  # excluded from at-once steps
        self.dropped = np.zeros(cfg.max_handles, dtype=bool)
        self.tombstoned = np.zeros(cfg.max_handles, dtype=bool)
        self.target = np.full(cfg.max_reqs, -1, dtype=np.int64)  # frontier target, -1 none
        self._release: list[int] = []  # in call order
        self._advance: list[int] = []
        self._drop: list[int] = []
        self._tomb: list[int] = []

    def touched(self, row: int) -> bool:
        return bool(self.released[row] or self.target[row] >= 0)

    @property
    def recorded(self) -> bool:
        """Whether the block recorded anything to run."""
        return bool(self._release or self._drop or self._tomb
                    or (self.target[self._advance] >= 0).any())

    # ---- recording ----------------------------------------------------------------------
    def release(self, rows) -> None:
        arr = normalize(Step(release=rows), self.alloc.config).release
        self.alloc.dry_run(Step(release=arr), oversize=True)
        self.released[arr] = True
        self.target[arr] = -1
        self._release.extend(arr.tolist())

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
        new = self.target[rows] < 0
        self._advance.extend(rows[new].tolist())
        self.target[rows] = pos

    def drop(self, handle, swa_only: bool) -> None:
        arr = normalize(Step(drop=handle), self.alloc.config).drop
        self.alloc.dry_run(Step(drop_swa=arr) if swa_only else Step(drop=arr), oversize=True)
        for h in arr.tolist():
            if swa_only:
                if not self.tombstoned[h]:
                    self.tombstoned[h] = True
                    self._tomb.append(h)
            else:
                self.dropped[h] = True
                self._drop.append(h)
                if self.tombstoned[h]:
                    self.tombstoned[h] = False
                    self._tomb.remove(h)

    # ---- the end ------------------------------------------------------------------------
    def to_step(self) -> Step:
        """Everything recorded, as one Step (releases and drops in call order, frontier
        targets in the order their rows were first moved)."""
        adv = [r for r in self._advance if self.target[r] >= 0]
        return Step(release=np.array(self._release, dtype=np.int64),
                    advance=(np.array(adv, dtype=np.int64), self.target[adv]),
                    drop=np.array(self._drop, dtype=np.int64),
                    drop_swa=np.array(self._tomb, dtype=np.int64))

    def merged_with(self, step: Step) -> Step:
        """The block's Step with ``step``'s frees added (a query counting what they add;
        ``step`` was checked against the block already)."""
        cfg = self.alloc.config
        q = normalize(step, cfg)
        target = self.target.copy()
        order = [r for r in self._advance if target[r] >= 0]
        for r, p in zip(q.advance_row.tolist(), q.advance_pos.tolist(), strict=True):
            if target[r] < 0:
                order.append(r)
            target[r] = max(int(target[r]), p)
        rel = np.concatenate([np.array(self._release, dtype=np.int64), q.release])
        target[rel] = -1
        order = [r for r in order if target[r] >= 0]
        return Step(release=rel, advance=(np.array(order, dtype=np.int64), target[order]),
                    drop=np.concatenate([np.array(self._drop, dtype=np.int64), q.drop]),
                    drop_swa=np.array([h for h in self._tomb if h not in set(q.drop.tolist())],
                                      dtype=np.int64))
