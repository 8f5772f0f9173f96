"""The window rule, in one place: how far a request's SWA frontier may move.

An SWA layer at committed length C reads positions ``>= C - W`` (W the allocator's window,
``AllocatorConfig.sliding_window``); the pages wholly below ``floor_page(C - W)`` are no
longer read. The rule's target for a row is ``floor_page(max(f, min(L0, C) - W))`` (f the
frontier, L0 the length when the step begins: a row is evicted before anything allocates
for it). Both planners and the free-group recorder use this function (the compiled twin
mirrors it). Cost: O(rows) numpy.
"""

from __future__ import annotations

import numpy as np

__all__ = ["window_targets"]


def window_targets(config, ledger, rows: np.ndarray, len_at_start=None) -> np.ndarray:
    """The window rule's frontier for ``rows`` (``len_at_start``: the lengths when the step
    began, default the ledger's current lengths)."""
    length = (ledger.seq_len if len_at_start is None else len_at_start)[rows]
    length = np.minimum(length, ledger.committed[rows])
    ps = config.page_size
    threshold = np.maximum(length - config.sliding_window, 0)
    return np.maximum(ledger.frontier[rows], threshold // ps * ps)
