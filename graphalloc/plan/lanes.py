"""The numpy reference planner's attention lanes: one row per lane of the step's batch, for
the page-table kernel (layout ``PT_*`` in :mod:`graphalloc.kernels.abi`), and the host
copies an attention wrapper plans from.

Lane i (of ``B = max_batch``): request row r, its length L after the step's allocations,
``end = ceil(L / ps)``, the SWA window start ``ws = max(f, L - (q - 1) - W, 0)`` (q the
lane's query tokens, f its frontier after the step's evictions, W the model window), the
first SWA page ``ws // ps``, its offsets into the FULL and SWA ``kv_indices`` (exclusive
prefix sums of page counts), the tokens in its last page. Lanes past the batch are padding
(an empty range; indptr stays monotone). Refused, as the frozen step shape is, when the
batch exceeds B lanes or a CSR's index capacity (code 35, shapes 4-6). Cost: O(B) numpy.
"""

from __future__ import annotations

import numpy as np

from ..kernels.abi import (
    PT_END_PAGE,
    PT_FULL_OFF,
    PT_LAST_LEN,
    PT_REQ,
    PT_SEQ_LEN,
    PT_SWA_FIRST,
    PT_SWA_OFF,
    PT_WINDOW_START,
    ROW_WIDTH,
)
from .refusals import Kind, Refusal, RefusalCode

__all__ = ["plan_lanes", "LaneOutcome"]


class LaneOutcome:
    """Lane rows ``[B, 8]`` and the host copies: ``full_indptr`` / ``swa_indptr`` ``[B+1]``,
    ``last_page_len`` / ``swa_last_page_len`` / ``seq_lens`` ``[B]`` (int64), ``n_lanes``."""

    __slots__ = ("rows", "full_indptr", "swa_indptr", "last_page_len", "swa_last_page_len",
                 "seq_lens", "n_lanes")

    def __init__(self, rows, full_indptr, swa_indptr, last_page_len, swa_last_page_len,
                 seq_lens, n_lanes):
        self.rows, self.full_indptr, self.swa_indptr = rows, full_indptr, swa_indptr
        self.last_page_len, self.swa_last_page_len = last_page_len, swa_last_page_len
        self.seq_lens, self.n_lanes = seq_lens, n_lanes


def plan_lanes(ctx, spec, rows: np.ndarray, query: np.ndarray) -> LaneOutcome:
    """Lane rows for ``rows`` (request rows in lane order) with ``query`` tokens each, on
    the ledger as the step leaves it. ``spec``: the resolved
    :class:`~graphalloc.attention.spec.PageTableSpec`."""
    B, ps, W = spec.max_batch, ctx.ps, spec.model_window
    n = len(rows)
    k = Kind.STEP
    if n > B:
        raise Refusal(RefusalCode.STEP_OVER_SHAPE, k, 4, n, B)
    led = ctx.ledger
    cols = np.zeros((ROW_WIDTH, B), dtype=np.int64)
    L, f = led.seq_len[rows], led.frontier[rows]
    end = -(-L // ps)
    ws, first = ctx.window.lane_window(L, query, W, f, end, ps)
    full_indptr = np.zeros(B + 1, dtype=np.int64)
    swa_indptr = np.zeros(B + 1, dtype=np.int64)
    np.cumsum(end, out=full_indptr[1:n + 1])
    np.cumsum(end - first, out=swa_indptr[1:n + 1])
    full_indptr[n + 1:] = full_indptr[n]
    swa_indptr[n + 1:] = swa_indptr[n]
    for which, layer, total, cap in ((5, "full", full_indptr[-1], spec.max_full_indices),
                                     (6, "swa", swa_indptr[-1], spec.max_swa_indices)):
        if total > cap and spec.has("csr", layer):
            raise Refusal(RefusalCode.STEP_OVER_SHAPE, k, which, int(total), cap)
    last = np.where(L > 0, L - (end - 1) * ps, 0)
    cols[PT_REQ, :n] = rows
    cols[PT_SEQ_LEN, :n] = L
    cols[PT_END_PAGE, :n] = end
    cols[PT_SWA_FIRST, :n] = first
    cols[PT_FULL_OFF] = full_indptr[:-1]
    cols[PT_SWA_OFF] = swa_indptr[:-1]
    cols[PT_LAST_LEN, :n] = last
    cols[PT_WINDOW_START, :n] = ws
    seq_lens = cols[PT_SEQ_LEN].copy()
    last_all = cols[PT_LAST_LEN].copy()
    swa_last = np.where(cols[PT_END_PAGE] > cols[PT_SWA_FIRST], last_all, 0)
    return LaneOutcome(np.ascontiguousarray(cols.T), full_indptr, swa_indptr, last_all,
                       swa_last, seq_lens, n)
