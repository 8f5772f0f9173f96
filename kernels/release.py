"""Release: the graph's core node. Lookup the SWA peers of a step's freed pages and clear them.

One program per descriptor release row (see ``graphalloc.descriptor``)::

    row = rows[pid]                       # one 64-byte load from pinned host memory
    if row.n_pages == 0: return           # padded row
    for j in range(n_pages):              # in blocks of BLOCK_PAGES
        if RING_RETURN: swa_free[(swa_push + j) % cap] = ring_pages[r, j]; continue
        rep  = req_to_token[r, s + j*ps]  # fixed stride, no unique()
        page = rep // ps
        if SWA:  peer = full_to_swa[rep]; push peer // ps (0 + fault when peer == 0)
        barrier                           # rep is one of the slots cleared next
        if CLEAR: full_to_swa[page*ps : page*ps + ps] = 0   # a partial tail page whole
        if FULL:  full_free[(full_push + j) % cap] = page

Bytes per freed page: one index read of req_to_token, one of full_to_swa, ps
index writes for the clear, one or two index writes for the pushes.

``release_pages`` (Triton) and ``release_pages_torch`` (the reference twin)
share one signature and produce identical state.
"""

from __future__ import annotations

import torch

from graphalloc.descriptor import (
    REL_CLEAR,
    REL_FLAGS,
    REL_FULL,
    REL_FULL_PUSH,
    REL_N_PAGES,
    REL_REQ,
    REL_RING_RETURN,
    REL_START_POS,
    REL_SWA,
    REL_SWA_PUSH,
)
from graphalloc.errors import FaultCode

from .error_word import STAGE_RELEASE, record_faults_torch

__all__ = ["release_pages_torch"]


def _lanes_of_rows(n_per_row: torch.Tensor, n_lanes: int):
    """Flat lanes over rows: (row of lane, index within row, valid mask). Sync-free."""
    ends = torch.cumsum(n_per_row, 0)
    lanes = torch.arange(n_lanes, device=n_per_row.device)
    row_of_lane = torch.searchsorted(ends, lanes, right=True).clamp_(max=len(n_per_row) - 1)
    valid = lanes < ends[-1]
    within = lanes - (ends - n_per_row)[row_of_lane]
    return row_of_lane, torch.where(valid, within, 0), valid


def release_pages_torch(rows, req_to_token, full_to_swa, full_free, swa_free, ring_pages, err,
                        *, page_size: int, n_full_cap: int, n_swa_cap: int, n_lanes: int,
                        validate: bool = False) -> None:
    """Reference twin of the release kernel over ``n_lanes`` flat page lanes.

    ``req_to_token`` has one scratch row past the requests, ``full_free`` and
    ``swa_free`` one scratch entry past their capacity: padded lanes write there.
    """
    device = full_to_swa.device
    ps = page_size
    rows = rows.to(device, non_blocking=True)
    row_of, j, valid = _lanes_of_rows(rows[:, REL_N_PAGES], n_lanes)
    r = rows[row_of, REL_REQ]
    flags = torch.where(valid, rows[row_of, REL_FLAGS], 0)
    ring_return = (flags & REL_RING_RETURN) != 0
    reads = valid & ~ring_return
    col = torch.where(reads, rows[row_of, REL_START_POS] + j * ps, 0)
    r_read = torch.where(reads, r, req_to_token.shape[0] - 1)
    rep = req_to_token[r_read, col].to(torch.int64)
    full_page = rep // ps
    peer = full_to_swa[rep].to(torch.int64)
    mapped = peer > 0

    do_swa = reads & ((flags & REL_SWA) != 0)
    ring_col = torch.where(ring_return, j, 0).clamp_(max=ring_pages.shape[1] - 1)
    ring_page = ring_pages[torch.where(ring_return, r, 0), ring_col].to(torch.int64)
    swa_value = torch.where(ring_return, ring_page, torch.where(mapped, peer // ps, 0))
    swa_pos = torch.where(do_swa | ring_return,
                          (rows[row_of, REL_SWA_PUSH] + j) % n_swa_cap, n_swa_cap)
    fault = do_swa & ~mapped
    record_faults_torch(err, fault, FaultCode.UNMAPPED_PEER, STAGE_RELEASE, row_of, r, full_page)

    # The gathers above are materialised before the clear below: the twin's barrier.
    do_clear = reads & ((flags & REL_CLEAR) != 0)
    offs = torch.arange(ps, device=device)
    clear_slot = torch.where(do_clear[:, None], full_page[:, None] * ps + offs, 0)
    full_to_swa.index_put_((clear_slot.reshape(-1),),
                           torch.zeros((), dtype=full_to_swa.dtype, device=device))
    swa_free.index_put_((swa_pos,), swa_value.to(swa_free.dtype))
    do_full = reads & ((flags & REL_FULL) != 0)
    full_pos = torch.where(do_full, (rows[row_of, REL_FULL_PUSH] + j) % n_full_cap, n_full_cap)
    full_free.index_put_((full_pos,), full_page.to(full_free.dtype))
