"""Allocate: decode and extend allocation for a step, from the same descriptor.

``n_chunks`` programs per descriptor allocation row (layout: ``graphalloc.kernels.abi``),
over the launch's first ``n_rows`` rows (grid ``n_rows * n_chunks``; program ``pid`` works
on row ``pid // n_chunks``, chunk ``pid % n_chunks``)::

    if STAMP and pid == 0: count the step's stamp once      # kernels.stamp
    row = rows[pid // n_chunks]
    if row.n_tokens == 0 and row.n_pages == 0: return       # padded row
    # each loop below runs over the chunk's contiguous share of its blocks (all of them
    # with n_chunks = 1), and the ring admission on chunk 0 only
    if RING_ADMIT: ring_pages[r, q] = swa_free[(swa_pop + q) % cap] for q < n_pages; return
    if COPY: req_to_token[r, s:s + n_pages*ps] = req_to_token[src, same]; return   # sharing
    if SWA_ONLY:                                            # load-back of [s, s + n_tokens)
        for i < n_tokens: k = i // ps; off = i % ps
            full = req_to_token[r, s + k*ps] // ps; swa = swa_free[(swa_pop + k) % cap]
            full_to_swa[full*ps + off] = swa*ps + off
            if not NO_OUT: out_full/out_swa[lane] = the slots  # NO_OUT: a further window
        return                                              # pool's new pages, no lanes
    first_new = ceil(s / ps)                                # pages before it exist already
    for i in range(n_tokens):                               # in blocks of BLOCK_TOKENS
        t = s + i; page_no = t // ps; off = t % ps
        if page_no >= first_new:                            # a new page, popped in order
            k = page_no - first_new
            full = full_free[(full_pop + k) % cap_full]
            swa  = ring_pages[r, page_no % R] if RING else 0 if NO_WINDOW else \
                   swa_free[(swa_pop + k) % cap_swa]
            if off == 0 and full > 0 and swa > 0:            # page-dense mapping, whole page
                full_to_swa[full*ps : full*ps + ps] = swa*ps + [0, ps)
        else:                                               # continue the partial page
            full = req_to_token[r, page_no * ps] // ps
            swa  = ring_pages[r, page_no % R] if RING else 0 if NO_WINDOW else \
                   full_to_swa[full * ps] // ps
        req_to_token[r, t] = full*ps + off
        out_full[lane] = full*ps + off; out_swa[lane] = swa*ps + off

A popped 0 (the sink marker, left by a faulty release) is a SINK_POP fault: the
token is pointed at the sink page, the mapping is not written, and no page gets
two owners.

Validate mode (``validate=True``: the constexpr ``VALIDATE``; compiled out when
off, skipped by the twin) also checks every popped id against its pool: a FULL
page outside ``[1, n_full_cap]`` or an SWA page outside ``[1, n_swa_cap]``
(token and admission pops alike) is an OUT_OF_RANGE fault and is treated as the
sink: no mapping written, the token pointed at the sink page, the ring entry of
an admission set to 0. A lane is counted once whatever it broke.

The Triton kernel writes the mapping in a second loop over the row's new
pages (``[BLOCK_PAGES, BLOCK_PS]`` tiles) instead of per token: the same
writes, with a tile that does not grow with the token block. The row's work is
the device function ``_allocate_body``, shared by ``_allocate_kernel`` and the
fused step kernel of ``kernels.step``.

Grid. The launcher runs rows ``[0, n_rows)`` (``n_rows=None``: all of them); rows past
the planner's are padding, so a step launches programs for the rows it has. A long row
(a prefill of thousands of tokens) is shared by ``n_chunks`` programs, each taking a
contiguous share of the token blocks, of the new pages' mapping tiles and of a prefix
copy's blocks (:func:`~graphalloc.kernels.rows.chunk_span`), so it runs at the speed of
many programs instead of one block after another. The programs of one row are
independent: a token's pops depend only on its position (``pop + page_no - first_new``),
the pages it continues are below ``first_new`` (never mapped by this row), and each new
page is mapped by exactly one tile. Every ``n_chunks >= 1`` gives the same state, and
chunk c's lanes precede chunk c + 1's (the interpreter records faults in lane order).

Bytes per token: one index write to req_to_token and two to the outputs, plus
the gathers of the popped (or continued) page ids; per new page, ps index
writes of the mapping.

``allocate_tokens`` (Triton) and ``allocate_tokens_torch`` share one signature.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .abi import (
    AL_COPY,
    AL_FLAGS,
    AL_FULL_POP,
    AL_N_PAGES,
    AL_N_TOKENS,
    AL_NO_OUT,
    AL_NO_WINDOW,
    AL_OUT,
    AL_REQ,
    AL_RING,
    AL_RING_ADMIT,
    AL_START_POS,
    AL_SWA_ONLY,
    AL_SWA_POP,
    STAGE_ALLOC,
    FaultCode,
)
from .error_word import record_fault_bits, record_fault_bits_torch
from .errors import TensorSpecError
from .rows import (
    block_ps,
    check_rows,
    check_tables,
    chunk_span,
    lanes_of_rows,
    launch_rows,
    load_row,
    row_col,
    warps,
)
from .stamp import check_stamp, record_stamp, record_stamp_torch, stamp_args

__all__ = ["allocate_tokens", "allocate_tokens_torch", "allocate_meta"]

# Descriptor columns, flags and codes as constexprs (jit code reads only constexpr globals).
_REQ = tl.constexpr(AL_REQ)
_START_POS = tl.constexpr(AL_START_POS)
_N_TOKENS = tl.constexpr(AL_N_TOKENS)
_FULL_POP = tl.constexpr(AL_FULL_POP)
_SWA_POP = tl.constexpr(AL_SWA_POP)
_OUT = tl.constexpr(AL_OUT)
_FLAGS = tl.constexpr(AL_FLAGS)
_N_PAGES = tl.constexpr(AL_N_PAGES)
_F_RING, _F_RING_ADMIT = tl.constexpr(AL_RING), tl.constexpr(AL_RING_ADMIT)
_F_SWA_ONLY = tl.constexpr(AL_SWA_ONLY)
_F_COPY = tl.constexpr(AL_COPY)
_F_NO_WINDOW = tl.constexpr(AL_NO_WINDOW)
_F_NO_OUT = tl.constexpr(AL_NO_OUT)
_SINK_POP = tl.constexpr(FaultCode.SINK_POP)
_MAPPED_PEER = tl.constexpr(FaultCode.MAPPED_PEER)
_OUT_OF_RANGE = tl.constexpr(FaultCode.OUT_OF_RANGE)
_STAGE_ALLOC = tl.constexpr(STAGE_ALLOC)


@triton.jit
def _allocate_body(
    pid, chunk, n_chunks, rows_ptr,
    r2t_ptr, f2s_ptr, full_free_ptr, swa_free_ptr, ring_ptr, out_full_ptr, out_swa_ptr, err_ptr,
    stride_r2t_row, stride_ring_row,
    page_size, n_full_cap, n_swa_cap, n_lanes, n_ring_cols,
    VALIDATE: tl.constexpr, BLOCK_TOKENS: tl.constexpr, BLOCK_PAGES: tl.constexpr,
    BLOCK_PS: tl.constexpr,
):
    """Program ``chunk`` of the ``n_chunks`` sharing allocation row ``pid`` (int64; the row
    faults name): the body of ``_allocate_kernel`` and of the fused step kernel
    (``kernels.step``)."""
    row, cols = load_row(rows_ptr, pid)
    n_tokens = row_col(row, cols, _N_TOKENS)
    n_pages = row_col(row, cols, _N_PAGES)
    if (n_tokens == 0) & (n_pages == 0):  # padded row
        return
    r = row_col(row, cols, _REQ)
    start_pos = row_col(row, cols, _START_POS)
    full_pop = row_col(row, cols, _FULL_POP)
    swa_pop = row_col(row, cols, _SWA_POP)
    first_out = row_col(row, cols, _OUT)
    flags = row_col(row, cols, _FLAGS)
    ring = (flags & _F_RING) != 0
    pool = (flags & (_F_RING | _F_NO_WINDOW)) == 0  # SWA pages from the shared pool
    r2t_row_ptr = r2t_ptr + r * stride_r2t_row
    ring_row_ptr = ring_ptr + r * stride_ring_row
    lanes_t = tl.arange(0, BLOCK_TOKENS)

    # Ring admission: pop the request's ring pages (q < min(n_pages, ring width)); a ring
    # is short (a window's pages), so chunk 0 does it, before its token lanes.
    if ((flags & _F_RING_ADMIT) != 0) & (chunk == 0):
        n_admit = tl.minimum(n_pages, n_ring_cols)
        for start in range(0, n_admit, BLOCK_TOKENS):
            q = start + lanes_t
            admit_mask = q < n_admit
            popped = tl.load(swa_free_ptr + (swa_pop + q) % n_swa_cap, mask=admit_mask,
                             other=0).to(tl.int64)
            if VALIDATE:
                oor = admit_mask & ((popped < 0) | (popped > n_swa_cap))
                bits = (tl.where(admit_mask & (popped == 0), _SINK_POP, 0)
                        | tl.where(oor, _OUT_OF_RANGE, 0))
                record_fault_bits(err_ptr, bits.to(tl.int64), lanes_t, _STAGE_ALLOC, pid, r,
                                  popped, BLOCK_TOKENS)
                popped = tl.where(oor, 0, popped)  # out of range: the ring gets the sink
            else:
                bits = tl.where(admit_mask & (popped == 0), _SINK_POP, 0)
                record_fault_bits(err_ptr, bits.to(tl.int64), lanes_t, _STAGE_ALLOC, pid, r,
                                  popped, BLOCK_TOKENS)
            tl.store(ring_row_ptr + q, popped.to(ring_ptr.dtype.element_ty), mask=admit_mask)

    # Prefix sharing: copy the source row's slots of [s, s + n_pages*ps) (AL_FULL_POP = src).
    if (flags & _F_COPY) != 0:
        src_row_ptr = r2t_ptr + full_pop * stride_r2t_row
        n_copy = n_pages * page_size
        first_copy, end_copy = chunk_span(n_copy, BLOCK_TOKENS, chunk, n_chunks)
        for start in range(first_copy, end_copy, BLOCK_TOKENS):
            t = start_pos + start + lanes_t
            copy_mask = (start + lanes_t) < n_copy
            slot = tl.load(src_row_ptr + t, mask=copy_mask, other=0)
            tl.store(r2t_row_ptr + t, slot, mask=copy_mask)
        return

    # Load-back: re-pair existing FULL pages of [s, s + n_pages*ps) with popped SWA pages
    # (AL_NO_OUT: no output lanes, the row's tokens not bounded by n_lanes).
    first_tok, end_tok = chunk_span(n_tokens, BLOCK_TOKENS, chunk, n_chunks)
    if (flags & _F_SWA_ONLY) != 0:
        no_out = (flags & _F_NO_OUT) != 0
        writes_out = (flags & _F_NO_OUT) == 0
        for start in range(first_tok, end_tok, BLOCK_TOKENS):
            i = start + lanes_t
            tok_mask = (i < n_tokens) & ((first_out + i < n_lanes) | no_out)
            k = i // page_size
            off = i - k * page_size
            full = tl.load(r2t_row_ptr + start_pos + k * page_size, mask=tok_mask,
                           other=0).to(tl.int64) // page_size
            swa = tl.load(swa_free_ptr + (swa_pop + k) % n_swa_cap, mask=tok_mask,
                          other=0).to(tl.int64)
            swa_bad = tok_mask & ((swa <= 0) | (swa > n_swa_cap))
            bits = (tl.where(tok_mask & (swa == 0), _SINK_POP, 0)
                    | tl.where(swa_bad & (swa != 0), _OUT_OF_RANGE, 0))
            map_mask = tok_mask & (full > 0) & ~swa_bad
            if VALIDATE:  # the host says these pages have no peer; the device checks it
                current = tl.load(f2s_ptr + full * page_size + off, mask=map_mask, other=0)
                still = map_mask & (current != 0)
                bits = bits | tl.where(still, _MAPPED_PEER, 0)
                map_mask = map_mask & ~still
            record_fault_bits(err_ptr, bits.to(tl.int64), lanes_t, _STAGE_ALLOC, pid, r, swa,
                              BLOCK_TOKENS)
            swa = tl.where(swa_bad, 0, swa)
            tl.store(f2s_ptr + full * page_size + off,
                     (swa * page_size + off).to(f2s_ptr.dtype.element_ty), mask=map_mask)
            out_mask = tok_mask & writes_out
            tl.store(out_full_ptr + first_out + i,
                     (full * page_size + off).to(out_full_ptr.dtype.element_ty), mask=out_mask)
            tl.store(out_swa_ptr + first_out + i,
                     (swa * page_size + off).to(out_swa_ptr.dtype.element_ty), mask=out_mask)
        return

    # Token lanes: continue the partial page, then new pages popped in order.
    first_new = (start_pos + page_size - 1) // page_size  # pages below it exist already
    for start in range(first_tok, end_tok, BLOCK_TOKENS):
        i = start + lanes_t  # int64: token index within the row
        tok_mask = (i < n_tokens) & (first_out + i < n_lanes)
        pos = start_pos + i
        page_no = pos // page_size
        off = pos - page_no * page_size
        is_new = tok_mask & (page_no >= first_new)
        is_old = tok_mask & (page_no < first_new)
        k = page_no - first_new
        new_full = tl.load(full_free_ptr + (full_pop + k) % n_full_cap, mask=is_new,
                           other=0).to(tl.int64)
        new_swa = tl.load(swa_free_ptr + (swa_pop + k) % n_swa_cap, mask=is_new & pool,
                          other=0).to(tl.int64)
        ring_swa = tl.load(ring_row_ptr + page_no % n_ring_cols, mask=tok_mask & ring,
                           other=0).to(tl.int64)
        old_full = tl.load(r2t_row_ptr + page_no * page_size, mask=is_old,
                           other=0).to(tl.int64) // page_size
        old_swa = tl.load(f2s_ptr + old_full * page_size, mask=is_old & pool,
                          other=0).to(tl.int64) // page_size
        if VALIDATE:
            full_bad = is_new & ((new_full <= 0) | (new_full > n_full_cap))
            swa_bad = is_new & pool & ((new_swa <= 0) | (new_swa > n_swa_cap))
            bits = (tl.where((is_new & (new_full == 0)) | (is_new & pool & (new_swa == 0)),
                             _SINK_POP, 0)
                    | tl.where((full_bad & (new_full != 0)) | (swa_bad & (new_swa != 0)),
                               _OUT_OF_RANGE, 0))
            record_fault_bits(err_ptr, bits.to(tl.int64), lanes_t, _STAGE_ALLOC, pid, r,
                              tl.where(full_bad, new_full, new_swa), BLOCK_TOKENS)
            new_full = tl.where(full_bad, 0, new_full)  # a bad id is treated as the sink
            new_swa = tl.where(swa_bad, 0, new_swa)
        else:
            fault = is_new & ((new_full == 0) | (pool & (new_swa == 0)))
            record_fault_bits(err_ptr, tl.where(fault, _SINK_POP, 0).to(tl.int64), lanes_t,
                              _STAGE_ALLOC, pid, r, tl.where(new_full == 0, new_full, new_swa),
                              BLOCK_TOKENS)
        full = tl.where(is_new, new_full, old_full)
        swa = tl.where(ring, ring_swa, tl.where(is_new, new_swa, old_swa))
        full_slot = full * page_size + off
        tl.store(r2t_row_ptr + pos, full_slot.to(r2t_ptr.dtype.element_ty), mask=tok_mask)
        tl.store(out_full_ptr + first_out + i, full_slot.to(out_full_ptr.dtype.element_ty),
                 mask=tok_mask)
        tl.store(out_swa_ptr + first_out + i,
                 (swa * page_size + off).to(out_swa_ptr.dtype.element_ty), mask=tok_mask)

    # Page-dense mapping of each new page, whole, where both pops are real pages.
    n_new = (start_pos + n_tokens + page_size - 1) // page_size - first_new
    lanes_p = tl.arange(0, BLOCK_PAGES)
    offs_ps = tl.arange(0, BLOCK_PS)
    in_page = offs_ps < page_size
    first_tile, end_tile = chunk_span(n_new, BLOCK_PAGES, chunk, n_chunks)
    for start in range(first_tile, end_tile, BLOCK_PAGES):
        k = start + lanes_p
        page_no = first_new + k
        page_mask = (k < n_new) & (first_out + page_no * page_size - start_pos < n_lanes)
        full = tl.load(full_free_ptr + (full_pop + k) % n_full_cap, mask=page_mask,
                       other=0).to(tl.int64)
        pool_swa = tl.load(swa_free_ptr + (swa_pop + k) % n_swa_cap, mask=page_mask & pool,
                           other=0).to(tl.int64)
        ring_swa = tl.load(ring_row_ptr + page_no % n_ring_cols, mask=page_mask & ring,
                           other=0).to(tl.int64)
        if VALIDATE:  # out-of-range pops are the sink here too: no mapping written
            full = tl.where(full <= n_full_cap, full, 0)
            pool_swa = tl.where(pool_swa <= n_swa_cap, pool_swa, 0)
        swa = tl.where(ring, ring_swa, pool_swa)
        map_mask = (page_mask & (full > 0) & (swa > 0))[:, None] & in_page[None, :]
        slots = full[:, None] * page_size + offs_ps[None, :]
        values = swa[:, None] * page_size + offs_ps[None, :]
        tl.store(f2s_ptr + slots, values.to(f2s_ptr.dtype.element_ty), mask=map_mask)


@triton.jit(do_not_specialize=["stride_r2t_row", "stride_ring_row", "n_full_cap", "n_swa_cap",
                               "n_lanes", "n_ring_cols", "n_chunks"])
def _allocate_kernel(
    # descriptor (int64 [n_rows, 8], may be pinned host memory)
    rows_ptr,
    # device tables and outputs
    r2t_ptr, f2s_ptr, full_free_ptr, swa_free_ptr, ring_ptr, out_full_ptr, out_swa_ptr, err_ptr,
    # the step stamp (pinned int64 [1]) and the seen word (kernels.stamp; unread unless STAMP)
    stamp_ptr, seen_ptr,
    # strides
    stride_r2t_row, stride_ring_row,
    # sizes (n_chunks: programs per row)
    page_size, n_full_cap, n_swa_cap, n_lanes, n_ring_cols, n_chunks,
    # meta-parameters
    VALIDATE: tl.constexpr, STAMP: tl.constexpr, BLOCK_TOKENS: tl.constexpr,
    BLOCK_PAGES: tl.constexpr, BLOCK_PS: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    if STAMP:  # program 0 counts the step (before its row: a padded row 0 still counts)
        record_stamp(stamp_ptr, seen_ptr, pid)
    row_id = pid // n_chunks
    _allocate_body(row_id, pid - row_id * n_chunks, n_chunks, rows_ptr,
                   r2t_ptr, f2s_ptr, full_free_ptr, swa_free_ptr, ring_ptr, out_full_ptr,
                   out_swa_ptr, err_ptr,
                   stride_r2t_row, stride_ring_row,
                   page_size, n_full_cap, n_swa_cap, n_lanes, n_ring_cols,
                   VALIDATE, BLOCK_TOKENS, BLOCK_PAGES, BLOCK_PS)


def allocate_meta(page_size: int) -> dict:
    """The allocation body's block sizes (token lanes, mapping tile of at most 2048 slots)."""
    ps_block = block_ps(page_size)
    return dict(BLOCK_TOKENS=64, BLOCK_PAGES=max(2, min(32, 2048 // ps_block)),
                BLOCK_PS=ps_block)


def allocate_tokens(rows, req_to_token, full_to_swa, full_free, swa_free, ring_pages,
                    out_full_slots, out_swa_slots, err, *, page_size: int, n_full_cap: int,
                    n_swa_cap: int, n_lanes: int, validate: bool = False,
                    n_rows: int | None = None, n_chunks: int = 1,
                    num_warps: int | None = None, stamp=None, seen=None) -> None:
    """Launch the allocation kernel over rows ``[0, n_rows)`` of ``rows`` (None: every row),
    ``n_chunks`` programs per row (grid ``n_rows * n_chunks``; the rows past ``n_rows``
    must be padding), ``num_warps`` warps per program (None: Triton's default). Shares the
    twin's signature and results. ``validate`` compiles in
    the range checks of popped ids; ``stamp`` / ``seen``: the step stamp and the seen word
    (:mod:`graphalloc.kernels.stamp`; both or neither). Returns before the device has
    finished; launches nothing for ``n_rows = 0``."""
    check_rows(rows, full_to_swa, "allocation")
    check_tables(req_to_token, ring_pages, err, False, None, (n_full_cap, n_swa_cap))
    check_stamp(stamp, seen, full_to_swa)
    if not (out_full_slots.is_contiguous() and out_swa_slots.is_contiguous()):
        raise TensorSpecError("the output slot buffers must be contiguous")
    n_rows = launch_rows(rows, n_rows, n_chunks, "allocation")
    if n_rows == 0:
        return
    stamp_ptr, seen_ptr, stamped = stamp_args(stamp, seen, err)
    _allocate_kernel[(n_rows * n_chunks,)](
        rows, req_to_token, full_to_swa, full_free, swa_free, ring_pages, out_full_slots,
        out_swa_slots, err, stamp_ptr, seen_ptr,
        req_to_token.stride(0), ring_pages.stride(0),
        page_size, n_full_cap, n_swa_cap, n_lanes, ring_pages.shape[1], n_chunks,
        VALIDATE=bool(validate), STAMP=stamped, **allocate_meta(page_size),
        **warps(num_warps),
    )



def allocate_tokens_torch(rows, req_to_token, full_to_swa, full_free, swa_free, ring_pages,
                          out_full_slots, out_swa_slots, err, *, page_size: int, n_full_cap: int,
                          n_swa_cap: int, n_lanes: int, validate: bool = False,
                          n_rows: int | None = None, n_chunks: int = 1,
                          num_warps: int | None = None, stamp=None, seen=None) -> None:
    """Reference twin of the allocation kernel over ``n_lanes`` flat token lanes of rows
    ``[0, n_rows)`` (``n_chunks`` is checked and otherwise, like ``num_warps``, has no
    effect: lanes are flat).

    ``req_to_token`` has a scratch row past the requests and the output buffers
    a scratch entry past ``n_lanes``: padded lanes write there, with values that depend on
    no descriptor row (so any ``n_rows`` covering the real rows leaves the same state). The
    lanes of an ``AL_NO_OUT`` row write there too (the kernel writes no output for them); a
    launch of such rows covers their tokens with ``n_lanes``.
    """
    check_rows(rows, full_to_swa, "allocation")
    check_tables(req_to_token, ring_pages, err, False, None, (n_full_cap, n_swa_cap))
    check_stamp(stamp, seen, full_to_swa)
    n_rows = launch_rows(rows, n_rows, n_chunks, "allocation")
    if n_rows == 0:  # as the launcher: nothing to run
        return
    record_stamp_torch(stamp, seen)
    if n_rows < rows.shape[0]:
        rows = rows[:n_rows]
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
    admit_bits = torch.where(admit_lane & (popped == 0), FaultCode.SINK_POP, 0)
    if validate:
        admit_oor = admit_lane & ((popped < 0) | (popped > n_swa_cap))
        admit_bits |= torch.where(admit_oor, FaultCode.OUT_OF_RANGE, 0)
        ring_value = torch.where(admit_oor, 0, popped)  # out of range: the ring gets the sink
    else:
        ring_value = popped
    admit_r = torch.where(admit_lane, rows[:, AL_REQ, None], ring_pages.shape[0] - 1)
    ring_pages.index_put_((admit_r.reshape(-1), q.expand_as(admit_r).reshape(-1)),
                          ring_value.reshape(-1).to(ring_pages.dtype))
    row_ids = torch.arange(rows.shape[0], device=device)[:, None].expand_as(admit_lane)

    # --- prefix copies: req_to_token[r, s + t] = req_to_token[src, s + t], t < n_pages*ps --
    copy = (rows[:, AL_FLAGS] & AL_COPY) != 0
    n_cols = req_to_token.shape[1]
    cols = torch.arange(n_cols, device=device)
    copy_end = rows[:, AL_START_POS, None] + rows[:, AL_N_PAGES, None] * ps
    copy_lane = copy[:, None] & (cols[None, :] >= rows[:, AL_START_POS, None]) & (
        cols[None, :] < copy_end)
    src = torch.where(copy, rows[:, AL_FULL_POP], 0).clamp(0, scratch_row)
    # Lanes that copy nothing rewrite the scratch row with its own values (no change: the
    # kernel never touches it, and padded lanes below read it).
    copied = torch.where(copy_lane,
                         req_to_token[src[:, None].expand_as(copy_lane), cols.expand_as(copy_lane)],
                         req_to_token[scratch_row].expand_as(copy_lane))
    dst = torch.where(copy_lane, rows[:, AL_REQ, None], scratch_row)
    req_to_token.index_put_((dst.reshape(-1), cols.expand_as(copy_lane).reshape(-1)),
                            copied.reshape(-1))

    # --- token lanes ------------------------------------------------------------------
    row_of, i, valid = lanes_of_rows(rows[:, AL_N_TOKENS], n_lanes)
    r = torch.where(valid, rows[row_of, AL_REQ], scratch_row)
    s = rows[row_of, AL_START_POS]
    ring = valid & ((rows[row_of, AL_FLAGS] & AL_RING) != 0)  # padded lanes: no row's flags
    no_window = valid & ((rows[row_of, AL_FLAGS] & AL_NO_WINDOW) != 0)  # FULL pages only
    swa_only = valid & ((rows[row_of, AL_FLAGS] & AL_SWA_ONLY) != 0)  # load-back lanes
    no_out = valid & ((rows[row_of, AL_FLAGS] & AL_NO_OUT) != 0)  # ... without output lanes
    t = torch.where(valid, s + i, 0)
    page_no = t // ps
    off = t % ps
    first_new = (s + ps - 1) // ps
    is_new = valid & ~swa_only & (page_no >= first_new)
    k = torch.where(is_new, page_no - first_new, 0)

    new_full = full_free[(rows[row_of, AL_FULL_POP] + k) % n_full_cap].to(torch.int64)
    new_swa_pool = swa_free[(rows[row_of, AL_SWA_POP] + k) % n_swa_cap].to(torch.int64)
    ring_swa = ring_pages[torch.where(ring & valid, r, 0), page_no % n_ring].to(torch.int64)
    old_col = torch.where(valid & ~is_new, page_no * ps, 0)
    old_full = req_to_token[r, old_col].to(torch.int64) // ps
    old_swa_pool = full_to_swa[old_full * ps].to(torch.int64) // ps
    new_swa_pool = torch.where(no_window, 0, new_swa_pool)
    old_swa_pool = torch.where(no_window, 0, old_swa_pool)

    pool_new = is_new & ~ring & ~no_window
    sink = (is_new & (new_full == 0)) | (pool_new & (new_swa_pool == 0))
    if validate:
        full_bad = is_new & ((new_full <= 0) | (new_full > n_full_cap))
        swa_bad = pool_new & ((new_swa_pool <= 0) | (new_swa_pool > n_swa_cap))
        bits = (torch.where(sink, FaultCode.SINK_POP, 0)
                | torch.where((full_bad & (new_full != 0)) | (swa_bad & (new_swa_pool != 0)),
                              FaultCode.OUT_OF_RANGE, 0))
        fault_page = torch.where(full_bad, new_full, new_swa_pool)
        new_full = torch.where(full_bad, 0, new_full)  # a bad id is treated as the sink
        new_swa_pool = torch.where(swa_bad, 0, new_swa_pool)
    else:
        bits = torch.where(sink, FaultCode.SINK_POP, 0)
        fault_page = torch.where(new_full == 0, new_full, new_swa_pool)
    full = torch.where(is_new, new_full, old_full)
    swa = torch.where(ring, ring_swa, torch.where(is_new, new_swa_pool, old_swa_pool))
    # Load-back lanes: FULL page k of the row exists; its SWA page is popped at pop + k.
    k_back = torch.where(swa_only, i // ps, 0)
    back_full = req_to_token[r, torch.where(swa_only, s + k_back * ps, 0)].to(torch.int64) // ps
    back_swa = swa_free[(rows[row_of, AL_SWA_POP] + k_back) % n_swa_cap].to(torch.int64)
    back_bad = swa_only & ((back_swa <= 0) | (back_swa > n_swa_cap))
    bits = torch.where(swa_only, torch.where(swa_only & (back_swa == 0), FaultCode.SINK_POP, 0)
                       | torch.where(back_bad & (back_swa != 0), FaultCode.OUT_OF_RANGE, 0),
                       bits)
    fault_page = torch.where(swa_only, back_swa, fault_page)
    back_map = swa_only & (back_full > 0) & ~back_bad
    if validate:  # the host says these pages have no peer; the device checks it
        still = back_map & (full_to_swa[back_full * ps + off] != 0)
        bits = bits | torch.where(still, FaultCode.MAPPED_PEER, 0)
        back_map = back_map & ~still
    back_swa = torch.where(back_bad, 0, back_swa)
    full = torch.where(swa_only, back_full, full)
    swa = torch.where(swa_only, back_swa, swa)
    # One record for admission and token lanes, claimed in (row, lane) order: a row's
    # admission lanes come before its token lanes, as in the kernel's program.
    width = n_ring + n_lanes
    lane_bits = torch.cat([admit_bits.reshape(-1), bits])
    record = (torch.cat([row_ids.reshape(-1), row_of]),
              torch.cat([rows[:, AL_REQ, None].expand_as(admit_lane).reshape(-1), r]),
              torch.cat([popped.reshape(-1), fault_page]))
    order = torch.cat([(row_ids * width + q).reshape(-1), row_of * width + n_ring + i])
    record_fault_bits_torch(err, lane_bits, STAGE_ALLOC, *record, order=order)

    full_slot = full * ps + off
    r_write = torch.where(swa_only, scratch_row, r)  # load-back leaves req_to_token alone
    req_to_token[r_write, t] = full_slot.to(req_to_token.dtype)
    out_pos = torch.where(valid & ~no_out, rows[row_of, AL_OUT] + i, n_lanes)
    out_full_slots[out_pos] = full_slot.to(out_full_slots.dtype)
    out_swa_slots[out_pos] = (swa * ps + off).to(out_swa_slots.dtype)

    # Whole-page, page-dense mapping for every new page (written at its first token).
    writes_map = is_new & (off == 0) & (full > 0) & (swa > 0)
    offs = torch.arange(ps, device=device)
    map_slot = torch.where(writes_map[:, None], full[:, None] * ps + offs, 0)
    map_value = torch.where(writes_map[:, None], swa[:, None] * ps + offs, 0)
    # Load-back lanes map per slot (validate mode may refuse single slots).
    back_slot = torch.where(back_map, back_full * ps + off, 0)
    back_value = torch.where(back_map, back_swa * ps + off, 0)
    map_slot = torch.cat([map_slot.reshape(-1), back_slot])
    map_value = torch.cat([map_value.reshape(-1), back_value])
    full_to_swa.index_put_((map_slot,), map_value.to(full_to_swa.dtype))
