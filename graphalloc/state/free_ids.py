"""The lowest free request row or handle: written once, for every front door.

A row (handle) is taken when the ledger holds it live (``Ledger.live`` / ``h_live``) or a
caller has set it aside: rows released in an open ``free_group()`` (their frees run when it
closes), rows a ``scheduler_step()`` block or an engine iteration reserved for its admits,
handles it reserved for its cache inserts. Those sets are kept by the one Step accumulator
(:class:`~graphalloc.plan.accumulator.StepAccumulator`: its admit and take columns, its
``released`` / ``dropped`` masks), whose ``free_row`` / ``free_handle`` ask
:func:`lowest_free`; ``alloc.free_row``, ``alloc.take_handle``, the recorder's ``admit`` /
``take_handle`` and the engine iterations' cache inserts go through them, so every door
gives the same id for the same state.

Cost: O(rows) numpy (one copy of the mask, one scan), whatever is reserved.
"""

from __future__ import annotations

import numpy as np

__all__ = ["lowest_free"]


def lowest_free(live: np.ndarray, *aside) -> int:
    """The lowest index that ``live`` (a bool mask) does not hold and no entry of ``aside``
    sets aside (each None, a bool mask of the same length, or ids), or -1 when none is
    free."""
    taken = live.copy()
    for ids in aside:
        if ids is not None and len(ids):
            taken[ids] = True
    free = np.flatnonzero(~taken)
    return int(free[0]) if len(free) else -1
