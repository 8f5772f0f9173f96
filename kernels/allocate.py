"""Allocate: decode and extend allocation for a step, from the same descriptor.

One program per descriptor allocation row (see ``graphalloc.descriptor``)::

    row = rows[pid]
    if row.n_tokens == 0 and row.n_pages == 0: return       # padded row
    if RING_ADMIT: ring_pages[r, q] = swa_free[(swa_pop + q) % cap] for q < n_pages; return
    first_new = ceil(s / ps)                                # pages before it exist already
    for i in range(n_tokens):                               # in blocks of BLOCK_TOKENS
        t = s + i; page_no = t // ps; off = t % ps
        if page_no >= first_new:                            # a new page, popped in order
            k = page_no - first_new
            full = full_free[(full_pop + k) % cap_full]
            swa  = ring_pages[r, page_no % R] if RING else swa_free[(swa_pop + k) % cap_swa]
            if off == 0 and full > 0 and swa > 0:            # page-dense mapping, whole page
                full_to_swa[full*ps : full*ps + ps] = swa*ps + [0, ps)
        else:                                               # continue the partial page
            full = req_to_token[r, page_no * ps] // ps
            swa  = ring_pages[r, page_no % R] if RING else full_to_swa[full * ps] // ps
        req_to_token[r, t] = full*ps + off
        out_full[lane] = full*ps + off; out_swa[lane] = swa*ps + off

A popped 0 (the sink marker, left by a faulty release) is a SINK_POP fault: the
token is pointed at the sink page, the mapping is not written, and no page gets
two owners.

``allocate_tokens`` (Triton) and ``allocate_tokens_torch`` share one signature.
"""

from __future__ import annotations

import torch

from graphalloc.descriptor import (
    AL_FLAGS,
    AL_FULL_POP,
    AL_N_PAGES,
    AL_N_TOKENS,
    AL_OUT,
    AL_REQ,
    AL_RING,
    AL_RING_ADMIT,
    AL_START_POS,
    AL_SWA_POP,
)
from graphalloc.errors import FaultCode

from .error_word import STAGE_ALLOC, record_faults_torch
from .release import _lanes_of_rows

__all__ = ["allocate_tokens_torch"]


def allocate_tokens_torch(rows, req_to_token, full_to_swa, full_free, swa_free, ring_pages,
                          out_full_slots, out_swa_slots, err, *, page_size: int, n_full_cap: int,
                          n_swa_cap: int, n_lanes: int, validate: bool = False) -> None:
    """Reference twin of the allocation kernel over ``n_lanes`` flat token lanes.

    ``req_to_token`` has a scratch row past the requests and the output buffers
    a scratch entry past ``n_lanes``: padded lanes write there.
    """
    device = full_to_swa.device
    ps = page_size
    rows = rows.to(device, non_blocking=True)
    n_ring = ring_pages.shape[1]
    scratch_row = req_to_token.shape[0] - 1

    # --- ring admissions: pop n_pages SWA pages into the request's ring ---------------
    admit = (rows[:, AL_FLAGS] & AL_RING_ADMIT) != 0
    q = torch.arange(n_ring, device=device)
    admit_lane = admit[:, None] & (q[None, :] < rows[:, AL_N_PAGES, None])
    popped = swa_free[(rows[:, AL_SWA_POP, None] + q) % n_swa_cap].to(torch.int64)
    admit_r = torch.where(admit_lane, rows[:, AL_REQ, None], ring_pages.shape[0] - 1)
    ring_pages.index_put_((admit_r.reshape(-1), q.expand_as(admit_r).reshape(-1)),
                          popped.reshape(-1).to(ring_pages.dtype))
    row_ids = torch.arange(rows.shape[0], device=device)[:, None].expand_as(admit_lane)
    record_faults_torch(err, admit_lane & (popped == 0), FaultCode.SINK_POP, STAGE_ALLOC,
                        row_ids, rows[:, AL_REQ, None].expand_as(admit_lane), popped)

    # --- token lanes ------------------------------------------------------------------
    row_of, i, valid = _lanes_of_rows(rows[:, AL_N_TOKENS], n_lanes)
    r = torch.where(valid, rows[row_of, AL_REQ], scratch_row)
    s = rows[row_of, AL_START_POS]
    ring = (rows[row_of, AL_FLAGS] & AL_RING) != 0
    t = torch.where(valid, s + i, 0)
    page_no = t // ps
    off = t % ps
    first_new = (s + ps - 1) // ps
    is_new = valid & (page_no >= first_new)
    k = torch.where(is_new, page_no - first_new, 0)

    new_full = full_free[(rows[row_of, AL_FULL_POP] + k) % n_full_cap].to(torch.int64)
    new_swa_pool = swa_free[(rows[row_of, AL_SWA_POP] + k) % n_swa_cap].to(torch.int64)
    ring_swa = ring_pages[torch.where(ring & valid, r, 0), page_no % n_ring].to(torch.int64)
    old_col = torch.where(valid & ~is_new, page_no * ps, 0)
    old_full = req_to_token[r, old_col].to(torch.int64) // ps
    old_swa_pool = full_to_swa[old_full * ps].to(torch.int64) // ps

    full = torch.where(is_new, new_full, old_full)
    swa = torch.where(ring, ring_swa, torch.where(is_new, new_swa_pool, old_swa_pool))
    fault = is_new & ((new_full == 0) | (~ring & (new_swa_pool == 0)))
    record_faults_torch(err, fault, FaultCode.SINK_POP, STAGE_ALLOC, row_of, r,
                        torch.where(new_full == 0, new_full, new_swa_pool))

    full_slot = full * ps + off
    req_to_token[r, t] = full_slot.to(req_to_token.dtype)
    out_pos = torch.where(valid, rows[row_of, AL_OUT] + i, n_lanes)
    out_full_slots[out_pos] = full_slot.to(out_full_slots.dtype)
    out_swa_slots[out_pos] = (swa * ps + off).to(out_swa_slots.dtype)

    # Whole-page, page-dense mapping for every new page (written at its first token).
    writes_map = is_new & (off == 0) & (full > 0) & (swa > 0)
    offs = torch.arange(ps, device=device)
    map_slot = torch.where(writes_map[:, None], full[:, None] * ps + offs, 0)
    map_value = torch.where(writes_map[:, None], swa[:, None] * ps + offs, 0)
    full_to_swa.index_put_((map_slot.reshape(-1),), map_value.reshape(-1).to(full_to_swa.dtype))
