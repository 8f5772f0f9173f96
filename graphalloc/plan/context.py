"""One step being planned by the numpy reference planner: its running state and validators.

:class:`PlanContext` is created for one call of :func:`graphalloc.plan.reference.plan_step`
and dropped after it. It holds the ledger (written in place through its journal), what the
step has done so far (rows released, allocated, cut; handles written or dropped), the rows
it has produced and its counters, and the two validators every kind uses
(:meth:`PlanContext.live_rows`, :meth:`PlanContext.live_handles`). A rule a kind breaks is
raised as a :class:`~graphalloc.plan.refusals.Refusal`; the caller rolls the journal back.

Validation is rule-major (every row against rule 1, then every row against rule 2, ...)
and names the first offending position: the compiled twin checks in the same order, so both
refuse with the same ``(code, kind, row, value, limit)``. Cost: O(rows) per validator.
"""

from __future__ import annotations

import numpy as np

from ..kernels.abi import ROW_WIDTH
from ..pools.extra_window import WindowPlan
from .refusals import Refusal, RefusalCode, kind_id

__all__ = ["PlanContext", "first_repeat"]

_EMPTY_ROWS = np.zeros((0, ROW_WIDTH), dtype=np.int64)


def first_repeat(values: np.ndarray) -> int:
    """Index of the first entry equal to an earlier one, or -1."""
    if len(values) < 2:
        return -1
    _, first = np.unique(values, return_index=True)
    if len(first) == len(values):
        return -1
    seen = np.zeros(len(values), dtype=bool)
    seen[first] = True
    return int(np.flatnonzero(~seen)[0])


class PlanContext:
    """The running state of one step's plan (see the module docstring).

    Args:
        config: the allocator's config.
        ledger: its ledger (written in place, journaled).
        epoch: the step's number (written into release rows; > 0).
        excluded_rows / excluded_handles: bool masks of rows released / handles dropped in
            an open ``free_group()`` (their frees run when the block closes), or ``None``.
        reclaim: ``(tombstone_handles, evict_handles)`` a prefix cache offers, in the order
            it would give them up, or ``None``.
        oversize: plan past the frozen release shape (a free group's flush, split after).
        tables: the resolved :class:`~graphalloc.attention.spec.PageTableSpec` when every
            step also plans its attention lanes, else ``None``.
    """

    def __init__(self, config, ledger, epoch: int, excluded_rows=None, excluded_handles=None,
                 reclaim=None, oversize: bool = False, tables=None):
        self.config, self.ledger, self.epoch = config, ledger, epoch
        self.tables = tables
        self.journal = ledger.journal
        self.refs = ledger.refs
        self.ps = config.page_size
        n = config.max_reqs
        self.len_at_start = ledger.seq_len.copy()  # pages below this exist on the device
        self.n_free_before = (ledger.full.n_free, ledger.swa.n_free)
        self.released = np.zeros(n, dtype=bool)
        self.allocated = np.zeros(n, dtype=bool)
        self.cut = np.zeros(n, dtype=bool)  # rows trimmed / committed (their tails freed)
        self.ring_admitted = np.zeros(n, dtype=bool)
        self.admitted = np.zeros(n, dtype=bool)
        self.written_handles = np.zeros(ledger.n_handles, dtype=bool)
        self.dropped_handles = np.zeros(ledger.n_handles, dtype=bool)
        self.excluded_rows = excluded_rows
        self.excluded_handles = excluded_handles
        self.reclaim = reclaim
        self.reclaim_next = [0, 0]  # candidates consumed (tombstone, evict)
        self.reclaimed: list[tuple] = []  # (handle, tombstone, FULL, SWA freed) by reclaim
        self.reclaim_keep = np.zeros(0, dtype=np.int64)  # handles reclaim must not drop
        self.oversize = oversize
        self.release_parts: list[np.ndarray] = []
        self.alloc_parts: list[np.ndarray] = []
        self.results: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self.n_tokens = 0  # allocated tokens so far (the next output lane)
        self.n_release_pages = 0  # freed pages so far (the next release page lane)
        self.pages_freed = [0, 0]  # FULL, SWA
        self.pages_allocated = [0, 0]
        self.pages_evicted = 0  # SWA pages freed by frontier moves (part of pages_freed)
        pools = config.pools
        self.window = pools.window  # the window pool's rules (NoWindow: no window layers)
        self.state = pools.state  # the state pool's rules (NoStates: no recurrent layers)
        # The further window pools' parts of the step (none for one window pool or none):
        # each kind that frees, shares or allocates calls every one of them.
        self.windows = tuple(WindowPlan(pool, window, self)
                             for pool, window in zip(pools.extras, ledger.windows, strict=True))
        self.state_parts: list[np.ndarray] = []  # ST_SET / ST_COPY rows (plan.states)
        self.spec_parts: list[np.ndarray] = []  # (row, step, n) newest speculative steps
        self.state_freed = 0
        self.taken_state = None  # per handle taken this step: the slot its snapshot copies

    # ---- validators ---------------------------------------------------------------------
    def live_rows(self, rows: np.ndarray, kind: str, repeats: bool = False) -> np.ndarray:
        """``rows`` (in range, from the normaliser): live, not released in this step or in
        an open free group, each once unless ``repeats`` (codes 1, 2)."""
        if not len(rows):
            return rows
        led = self.ledger
        excl = self.excluded_rows
        dead = ~led.live[rows]
        if excl is not None:
            dead |= excl[rows]
        if dead.any():
            r = int(rows[np.flatnonzero(dead)[0]])
            state = (3 if excl is not None and excl[r] else 2 if self.released[r]
                     else 1 if led.admitted_once[r] else 0)
            raise Refusal(RefusalCode.ROW_NOT_LIVE, kind_id(kind), r, state)
        i = -1 if repeats else first_repeat(rows)
        if i >= 0:
            raise Refusal(RefusalCode.ROW_REPEATED, kind_id(kind), int(rows[i]))
        return rows

    def free_rows(self, rows: np.ndarray, kind: str) -> np.ndarray:
        """Rows to admit: not live, not released in this step or an open free group, each
        once (codes 3, 4)."""
        if not len(rows):
            return rows
        excl = self.excluded_rows
        bad = self.ledger.live[rows] | self.released[rows] | self.admitted[rows]
        if excl is not None:
            bad |= excl[rows]
        if bad.any():
            r = int(rows[np.flatnonzero(bad)[0]])
            if self.admitted[r]:
                raise Refusal(RefusalCode.ROW_ADMITTED_TWICE, kind_id(kind), r)
            state = 2 if excl is not None and excl[r] else 1 if self.released[r] else 0
            raise Refusal(RefusalCode.ROW_NOT_FREE, kind_id(kind), r, state)
        i = first_repeat(rows)
        if i >= 0:
            raise Refusal(RefusalCode.ROW_ADMITTED_TWICE, kind_id(kind), int(rows[i]))
        return rows

    def live_handles(self, handles: np.ndarray, kind: str, repeats: bool = False) -> np.ndarray:
        """Handles that are held, not dropped in this step or an open free group, not
        written in this step, each once unless ``repeats`` (codes 9, 5, 6, 7)."""
        if not len(handles):
            return handles
        k = kind_id(kind)
        if not self.window.shares:
            raise Refusal(RefusalCode.SHARING_NEEDS_POOL_MODE, k)
        led, n = self.ledger, self.ledger.n_handles
        out = (handles < 0) | (handles >= n)
        if out.any():
            raise Refusal(RefusalCode.HANDLE_NOT_HELD, k, int(handles[np.flatnonzero(out)[0]]), 0,
                          n)
        excl = self.excluded_handles
        dead = ~led.h_live[handles] | self.dropped_handles[handles]
        if excl is not None:
            dead |= excl[handles]
        if dead.any():
            h = int(handles[np.flatnonzero(dead)[0]])
            state = (2 if excl is not None and excl[h] else 3 if self.dropped_handles[h]
                     else 1)
            raise Refusal(RefusalCode.HANDLE_NOT_HELD, k, h, state, n)
        written = self.written_handles[handles]
        if written.any():
            raise Refusal(RefusalCode.HANDLE_WRITTEN_THIS_STEP, k,
                          int(handles[np.flatnonzero(written)[0]]))
        i = -1 if repeats else first_repeat(handles)
        if i >= 0:
            raise Refusal(RefusalCode.HANDLE_REPEATED, k, int(handles[i]))
        return handles

    def reclaim_pages(self, need_full: int, need_swa: int, need_states: int = 0) -> None:
        """Drop the prefix cache's offered entries until the pools hold what is needed (a
        no-op without an offer): :func:`graphalloc.plan.allocation.reclaim`."""
        if self.reclaim is not None:
            from .allocation import reclaim  # (allocation imports this module)
            reclaim(self, need_full, need_swa, need_states)

    # ---- the rows produced ----------------------------------------------------------------
    def release_rows(self) -> np.ndarray:
        parts = self.release_parts
        return _EMPTY_ROWS if not parts else parts[0] if len(parts) == 1 else np.concatenate(parts)

    def alloc_rows(self) -> np.ndarray:
        parts = self.alloc_parts
        return _EMPTY_ROWS if not parts else parts[0] if len(parts) == 1 else np.concatenate(parts)

    @property
    def fusable(self) -> bool:
        """Release and allocation may run as one launch: the step's pops of each FIFO ring
        fit in what was free before it (so no pop reads a position this step pushes), and no
        row frees its tail and allocates again (the release must read req_to_token first)."""
        return (self.pages_allocated[0] <= self.n_free_before[0]
                and self.pages_allocated[1] <= self.n_free_before[1]
                and not (self.cut & self.allocated).any())
