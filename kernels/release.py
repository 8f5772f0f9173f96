"""Release: the graph's core node. Lookup the SWA peers of a step's freed pages and clear them.

``n_chunks`` programs per descriptor release row (layout: ``graphalloc.kernels.abi``),
over the launch's first ``n_rows`` rows (grid ``n_rows * n_chunks``)::

    if STAMP and pid == 0: count the step's stamp once (kernels.stamp: one 8-byte load,
                                          # one atomic; before the padded-row exit)
    r_id, chunk = pid // n_chunks, pid % n_chunks
    row = rows[r_id]                      # one 64-byte load from pinned host memory
    if row.n_pages == 0: return           # padded row
    for j in chunk's span of range(n_pages):   # in blocks of BLOCK_PAGES; chunk c takes
                                               # the c-th contiguous share of the blocks
        if RING_RETURN: swa_free[(swa_push + j) % cap] = ring_pages[r, s//ps + j]; continue
        rep  = req_to_token[r, s + j*ps]  # fixed stride, no unique()
        page = rep // ps
        if SWA:  peer = full_to_swa[rep]; push peer // ps (0 + fault when peer == 0)
        barrier                           # rep is one of the slots cleared next
        if CLEAR: full_to_swa[page*ps : page*ps + ps] = 0   # a partial tail page whole
        if FULL:  full_free[(full_push + j) % cap] = page

Lanes past ``n_lanes`` (the row's first lane ``REL_LANE`` + j) are dropped, as
in the twin. Fault recording: ``kernels.error_word``.

Validate mode (``validate=True``: the constexpr ``VALIDATE``; with it off none
of this is compiled, and the twin skips it) adds, per page lane, before the
barrier::

    if rep not in [ps, (n_full_cap + 1) * ps):  OUT_OF_RANGE; the lane reads and
        clears nothing, and pushes the sink marker 0 (FULL and SWA)
    if SWA and peer > 0:
        if peer // ps not in [1, n_swa_cap]:    OUT_OF_RANGE; push 0 instead
        if full_to_swa[page*ps + o] != (peer // ps) * ps + o for some o < ps:
                                                NOT_PAGE_DENSE
    for every page the lane pushes (its SWA peer, its FULL page, its ring page):
        old = atomic_xchg(epoch[pool][page], epoch)   # epoch: the row's REL_EPOCH
        if old == epoch:                        DUPLICATE_FREE (a 2nd push this step)
    RING_RETURN: a ring page outside [1, n_swa_cap] is OUT_OF_RANGE (0 pushed instead)

The epoch stamp is how uniqueness is checked across programs without a sort:
the host writes a step counter (> 0, never reused) into every release row, so
a page stamped with this step's epoch was pushed earlier in this step; rows
with epoch 0 skip the check. Every push is stamped -- SWA peers, FULL pages
and ring pages -- so no page can enter a free ring twice in one step unseen
(a ring release split over rows once pushed the ring's first pages again).
Every lane is counted once in the error word whatever it broke
(``record_fault_bits``). Extra bytes per freed page: ps index reads of the page
tile and one or two 8-byte atomic exchanges.

Bytes per freed page: one index read of req_to_token, one of full_to_swa, ps
index writes for the clear, one or two index writes for the pushes.

Compiled variants: every size, stride and capacity is a ``do_not_specialize``
runtime int, and the descriptor's address never changes, so a new page count,
start position or number of padded rows never compiles a new variant.
``page_size`` stays specialisable (it is fixed per allocator and lets ps = 1 or
a multiple of 16 compile to simpler, aligned code); ``VALIDATE``, ``STAMP``,
``BLOCK_PAGES`` and ``BLOCK_PS`` are constexprs fixed per allocator (``STAMP``: launched
with a step stamp, as every allocator launch is).

Grid. The launcher runs rows ``[0, n_rows)`` of the table (``n_rows=None``: all of
them); the planner packs real rows at the front and marks the rest padded, so any
``n_rows`` covering the real rows leaves the same state, and a step costs programs for
the rows it has, not for the frozen maximum. ``n_chunks`` programs share each row,
each taking a contiguous share of its page blocks (:func:`~graphalloc.kernels.rows.chunk_span`):
a long release runs in parallel instead of one block after another. Pages of one
row are distinct full pages, so the gather-before-clear order is needed only within a
block (the barrier), never across programs. Every ``n_chunks >= 1`` gives the same
state; chunk c's lanes come before chunk c + 1's, so the interpreter (programs in order)
records faults in lane order, as the twin does.

The row's work is the device function ``_release_body``, shared by
``_release_kernel`` and the fused step kernel of ``kernels.step``. ``release_pages``
(Triton) and ``release_pages_torch`` (the reference twin) share one signature and
produce identical state.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .abi import (
    REL_CLEAR,
    REL_EPOCH,
    REL_FLAGS,
    REL_FULL,
    REL_FULL_PUSH,
    REL_LANE,
    REL_N_PAGES,
    REL_REQ,
    REL_RING_RETURN,
    REL_START_POS,
    REL_SWA,
    REL_SWA_PUSH,
    STAGE_RELEASE,
    FaultCode,
)
from .error_word import record_fault_bits, record_fault_bits_torch
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

__all__ = ["release_pages", "release_pages_torch", "release_meta", "epoch_args"]

# Descriptor columns, flags and codes as constexprs (jit code reads only constexpr globals).
_REQ = tl.constexpr(REL_REQ)
_START_POS = tl.constexpr(REL_START_POS)
_N_PAGES = tl.constexpr(REL_N_PAGES)
_FLAGS = tl.constexpr(REL_FLAGS)
_SWA_PUSH = tl.constexpr(REL_SWA_PUSH)
_FULL_PUSH = tl.constexpr(REL_FULL_PUSH)
_LANE = tl.constexpr(REL_LANE)
_EPOCH = tl.constexpr(REL_EPOCH)
_F_SWA, _F_FULL = tl.constexpr(REL_SWA), tl.constexpr(REL_FULL)
_F_CLEAR, _F_RING_RETURN = tl.constexpr(REL_CLEAR), tl.constexpr(REL_RING_RETURN)
_UNMAPPED_PEER = tl.constexpr(FaultCode.UNMAPPED_PEER)
_NOT_PAGE_DENSE = tl.constexpr(FaultCode.NOT_PAGE_DENSE)
_OUT_OF_RANGE = tl.constexpr(FaultCode.OUT_OF_RANGE)
_DUPLICATE_FREE = tl.constexpr(FaultCode.DUPLICATE_FREE)
_STAGE_RELEASE = tl.constexpr(STAGE_RELEASE)


@triton.jit
def _stamp(epoch_ptr, page, mask, epoch):
    """Stamp ``page`` with the step's epoch; True where it already carried it (a second
    push of the page in this step)."""
    old = tl.atomic_xchg(epoch_ptr + page, tl.zeros_like(page) + epoch, mask=mask)
    return mask & (old == epoch)


@triton.jit
def _release_body(
    pid, chunk, n_chunks, rows_ptr,
    r2t_ptr, f2s_ptr, full_free_ptr, swa_free_ptr, ring_ptr, err_ptr, full_epoch_ptr,
    swa_epoch_ptr,
    stride_r2t_row, stride_ring_row,
    page_size, n_full_cap, n_swa_cap, n_lanes, n_ring_cols,
    VALIDATE: tl.constexpr, BLOCK_PAGES: tl.constexpr, BLOCK_PS: tl.constexpr,
):
    """Program ``chunk`` of the ``n_chunks`` sharing release row ``pid`` (int64; the row
    faults name): the body of ``_release_kernel`` and of the fused step kernel
    (``kernels.step``)."""
    row, cols = load_row(rows_ptr, pid)
    n_pages = row_col(row, cols, _N_PAGES)
    if n_pages == 0:  # padded row
        return
    r = row_col(row, cols, _REQ)
    start_pos = row_col(row, cols, _START_POS)
    flags = row_col(row, cols, _FLAGS)
    swa_push = row_col(row, cols, _SWA_PUSH)
    full_push = row_col(row, cols, _FULL_PUSH)
    first_lane = row_col(row, cols, _LANE)
    ring_return = (flags & _F_RING_RETURN) != 0
    reads = (flags & _F_RING_RETURN) == 0
    do_swa = reads & ((flags & _F_SWA) != 0)
    do_clear = reads & ((flags & _F_CLEAR) != 0)
    do_full = reads & ((flags & _F_FULL) != 0)
    first_ring_col = start_pos // page_size  # ring rows: the row's first ring column
    if VALIDATE:
        epoch = row_col(row, cols, _EPOCH)  # 0: no duplicate check for this row
        n_slots = (n_full_cap + 1) * page_size

    lanes = tl.arange(0, BLOCK_PAGES)
    offs_ps = tl.arange(0, BLOCK_PS)
    in_page = offs_ps < page_size
    r2t_row_ptr = r2t_ptr + r * stride_r2t_row
    ring_row_ptr = ring_ptr + r * stride_ring_row
    first_page, end_page = chunk_span(n_pages, BLOCK_PAGES, chunk, n_chunks)
    for start in range(first_page, end_page, BLOCK_PAGES):
        j = start + lanes  # int64: page index within the row
        page_mask = (j < n_pages) & (first_lane + j < n_lanes)
        swa_pos = (swa_push + j) % n_swa_cap

        # Ring release: hand the request's ring pages back to the SWA ring; nothing else.
        ring_mask = page_mask & ring_return
        ring_page = tl.load(ring_row_ptr + tl.minimum(first_ring_col + j, n_ring_cols - 1),
                            mask=ring_mask, other=0).to(tl.int64)
        if VALIDATE:
            ring_ok = (ring_page >= 1) & (ring_page <= n_swa_cap)
            bad_ring = ring_mask & ~ring_ok
            ring_page = tl.where(ring_ok, ring_page, 0)  # out of range: push the sink marker
            dup_ring = _stamp(swa_epoch_ptr, ring_page, ring_mask & ring_ok & (epoch > 0),
                              epoch)
        tl.store(swa_free_ptr + swa_pos, ring_page.to(swa_free_ptr.dtype.element_ty),
                 mask=ring_mask)

        # Gather: representative, full page, SWA peer.
        read_mask = page_mask & reads
        rep = tl.load(r2t_row_ptr + start_pos + j * page_size, mask=read_mask,
                      other=0).to(tl.int64)
        swa_mask = page_mask & do_swa  # lanes that push an SWA page (the sink marker if need be)
        if VALIDATE:
            # A representative outside [ps, n_slots) is masked: nothing is read or written
            # through it, and both pushes get the sink marker.
            fault_page = tl.where(ring_mask, ring_page, rep // page_size)
            rep_ok = (rep >= page_size) & (rep < n_slots)
            bad_rep = read_mask & ~rep_ok
            read_mask = read_mask & rep_ok
            rep = tl.where(rep_ok, rep, 0)
            gather_mask = swa_mask & rep_ok
        else:
            gather_mask = swa_mask
        full_page = rep // page_size
        peer = tl.load(f2s_ptr + rep, mask=gather_mask, other=0).to(tl.int64)
        mapped = peer > 0
        swa_page = tl.where(mapped, peer // page_size, 0)
        if VALIDATE:
            live = gather_mask & mapped
            swa_ok = (swa_page >= 1) & (swa_page <= n_swa_cap)
            bad_swa = live & ~swa_ok
            swa_page = tl.where(swa_ok, swa_page, 0)  # out of range: push the sink marker
            # Page-dense: slot o of the full page holds (peer // ps) * ps + o, every o.
            tile_mask = live[:, None] & in_page[None, :]
            tile = tl.load(f2s_ptr + full_page[:, None] * page_size + offs_ps[None, :],
                           mask=tile_mask, other=0).to(tl.int64)
            expect = (peer // page_size)[:, None] * page_size + offs_ps[None, :]
            n_off = tl.sum((tile_mask & (tile != expect)).to(tl.int32), axis=1)
            # Unique within the step: stamp every pushed page with the step's epoch;
            # finding the stamp already there means it was pushed earlier in this step.
            dup_swa = _stamp(swa_epoch_ptr, swa_page, live & swa_ok & (epoch > 0), epoch)
            dup_full = _stamp(full_epoch_ptr, full_page,
                              read_mask & do_full & (epoch > 0), epoch)
            bits = (tl.where(gather_mask & ~mapped, _UNMAPPED_PEER, 0)
                    | tl.where(live & (n_off > 0), _NOT_PAGE_DENSE, 0)
                    | tl.where(bad_rep | bad_swa | bad_ring, _OUT_OF_RANGE, 0)
                    | tl.where(dup_swa | dup_full | dup_ring, _DUPLICATE_FREE, 0))
            record_fault_bits(err_ptr, bits.to(tl.int64), lanes, _STAGE_RELEASE, pid, r,
                              fault_page, BLOCK_PAGES)
        else:
            bits = tl.where(swa_mask & (peer <= 0), _UNMAPPED_PEER, 0)
            record_fault_bits(err_ptr, bits.to(tl.int64), lanes, _STAGE_RELEASE, pid, r,
                              full_page, BLOCK_PAGES)

        # rep is one of the slots cleared below: every gather must land before any clear.
        tl.debug_barrier()

        clear_mask = (read_mask & do_clear)[:, None] & in_page[None, :]
        slots = full_page[:, None] * page_size + offs_ps[None, :]
        tl.store(f2s_ptr + slots, tl.zeros([BLOCK_PAGES, BLOCK_PS], f2s_ptr.dtype.element_ty),
                 mask=clear_mask)
        tl.store(swa_free_ptr + swa_pos, swa_page.to(swa_free_ptr.dtype.element_ty),
                 mask=swa_mask)
        tl.store(full_free_ptr + (full_push + j) % n_full_cap,
                 full_page.to(full_free_ptr.dtype.element_ty), mask=page_mask & do_full)


@triton.jit(do_not_specialize=["stride_r2t_row", "stride_ring_row", "n_full_cap", "n_swa_cap",
                               "n_lanes", "n_ring_cols", "n_chunks"])
def _release_kernel(
    # descriptor (int64 [n_rows, 8], may be pinned host memory)
    rows_ptr,
    # device tables (*_epoch_ptr: validate mode's stamps; unread otherwise)
    r2t_ptr, f2s_ptr, full_free_ptr, swa_free_ptr, ring_ptr, err_ptr, full_epoch_ptr,
    swa_epoch_ptr,
    # the step stamp (pinned int64 [1]) and the seen word (kernels.stamp; unread unless STAMP)
    stamp_ptr, seen_ptr,
    # strides
    stride_r2t_row, stride_ring_row,
    # sizes (n_chunks: programs per row)
    page_size, n_full_cap, n_swa_cap, n_lanes, n_ring_cols, n_chunks,
    # meta-parameters
    VALIDATE: tl.constexpr, STAMP: tl.constexpr, BLOCK_PAGES: tl.constexpr,
    BLOCK_PS: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    if STAMP:  # program 0 counts the step (before its row: a padded row 0 still counts)
        record_stamp(stamp_ptr, seen_ptr, pid)
    row_id = pid // n_chunks
    _release_body(row_id, pid - row_id * n_chunks, n_chunks, rows_ptr,
                  r2t_ptr, f2s_ptr, full_free_ptr, swa_free_ptr, ring_ptr, err_ptr,
                  full_epoch_ptr, swa_epoch_ptr,
                  stride_r2t_row, stride_ring_row,
                  page_size, n_full_cap, n_swa_cap, n_lanes, n_ring_cols,
                  VALIDATE, BLOCK_PAGES, BLOCK_PS)


def release_meta(page_size: int) -> dict:
    """The release body's block sizes: a ``[BLOCK_PAGES, BLOCK_PS]`` clear tile of at most
    2048 slots (power-of-two dims)."""
    ps_block = block_ps(page_size)
    return dict(BLOCK_PAGES=max(2, min(32, 2048 // ps_block)), BLOCK_PS=ps_block)


def epoch_args(validate: bool, epochs, err):
    """The two stamp-table arguments of a launch (the error word stands in when off)."""
    return (epochs[0], epochs[1]) if validate else (err, err)


def release_pages(rows, req_to_token, full_to_swa, full_free, swa_free, ring_pages, err,
                  *, page_size: int, n_full_cap: int, n_swa_cap: int, n_lanes: int,
                  validate: bool = False, epochs=None, n_rows: int | None = None,
                  n_chunks: int = 1, num_warps: int | None = None, stamp=None,
                  seen=None) -> None:
    """Launch the release kernel over rows ``[0, n_rows)`` of ``rows`` (None: every row),
    ``n_chunks`` programs per row (grid ``n_rows * n_chunks``; see the module docstring:
    the rows past ``n_rows`` must be padding), ``num_warps`` warps per program (None:
    Triton's default; each value compiles its own variant). Shares the twin's signature
    and results.
    ``validate`` compiles in the checks of the module docstring; it needs ``epochs =
    (full_epoch, swa_epoch)`` (int64 ``[n_full_cap + 1]`` and ``[n_swa_cap + 1]``,
    zero-initialised, kept across steps), not read otherwise. ``stamp`` / ``seen``: the
    step stamp and the seen word (:mod:`graphalloc.kernels.stamp`; both or neither).
    Returns before the device has finished; launches nothing for ``n_rows = 0``."""
    check_rows(rows, full_to_swa, "release")
    check_tables(req_to_token, ring_pages, err, validate, epochs, (n_full_cap, n_swa_cap))
    check_stamp(stamp, seen, full_to_swa)
    n_rows = launch_rows(rows, n_rows, n_chunks, "release")
    if n_rows == 0:
        return
    stamp_ptr, seen_ptr, stamped = stamp_args(stamp, seen, err)
    _release_kernel[(n_rows * n_chunks,)](
        rows, req_to_token, full_to_swa, full_free, swa_free, ring_pages, err,
        *epoch_args(validate, epochs, err), stamp_ptr, seen_ptr,
        req_to_token.stride(0), ring_pages.stride(0),
        page_size, n_full_cap, n_swa_cap, n_lanes, ring_pages.shape[1], n_chunks,
        VALIDATE=bool(validate), STAMP=stamped, **release_meta(page_size), **warps(num_warps),
    )



def stamp_epochs_torch(table: torch.Tensor, page: torch.Tensor, epoch: torch.Tensor,
                       active: torch.Tensor) -> torch.Tensor:
    """Twin of the kernel's ``old = atomic_xchg(table[page], epoch)`` over lanes in
    program order: returns ``old == epoch`` per active lane and leaves each page stamped
    with the epoch of its last lane. Fixed-shape and sync-free (one sort).

    A lane's ``old`` is the epoch of the previous active lane with the same page, or the
    table's value for the page's first lane; with one epoch per step that marks the second
    and later pushes of a page in the step.
    """
    n = page.shape[0]
    lane = torch.arange(n, device=page.device)
    key = torch.where(active, page, -1)  # inactive lanes sort first and are ignored
    order = torch.argsort(key * n + lane)  # by page, then lane: a stable grouping
    s_key, s_epoch = key[order], epoch[order]
    s_page = s_key.clamp(min=0)
    same_prev = torch.zeros_like(active)
    same_prev[1:] = s_key[1:] == s_key[:-1]
    prev_epoch = torch.roll(s_epoch, 1)
    old = torch.where(same_prev, prev_epoch, table[s_page])
    s_dup = (s_key >= 0) & (old == s_epoch)
    # Each page ends with its last lane's epoch; every lane of a page writes that same
    # value, so the duplicate indices of the scatter below agree.
    last = torch.searchsorted(s_key, s_key, right=True) - 1
    final = torch.where(s_key >= 0, s_epoch[last], table[s_page])
    table.index_put_((s_page,), final.to(table.dtype))
    return torch.zeros_like(active).scatter_(0, order, s_dup)


def release_pages_torch(rows, req_to_token, full_to_swa, full_free, swa_free, ring_pages, err,
                        *, page_size: int, n_full_cap: int, n_swa_cap: int, n_lanes: int,
                        validate: bool = False, epochs=None, n_rows: int | None = None,
                        n_chunks: int = 1, num_warps: int | None = None, stamp=None,
                        seen=None) -> None:
    """Reference twin of the release kernel over ``n_lanes`` flat page lanes of rows
    ``[0, n_rows)`` (``n_chunks`` is checked and otherwise, like ``num_warps``, has no
    effect: lanes are flat).

    ``req_to_token`` has one scratch row past the requests, ``full_free`` and
    ``swa_free`` one scratch entry past their capacity: padded lanes write there.
    """
    check_rows(rows, full_to_swa, "release")
    check_tables(req_to_token, ring_pages, err, validate, epochs, (n_full_cap, n_swa_cap))
    check_stamp(stamp, seen, full_to_swa)
    n_rows = launch_rows(rows, n_rows, n_chunks, "release")
    if n_rows == 0:  # as the launcher: nothing to run
        return
    record_stamp_torch(stamp, seen)
    if n_rows < rows.shape[0]:
        rows = rows[:n_rows]
    device = full_to_swa.device
    ps = page_size
    rows = rows.to(device, non_blocking=True)
    row_of, j, valid = lanes_of_rows(rows[:, REL_N_PAGES], n_lanes)
    r = rows[row_of, REL_REQ]
    flags = torch.where(valid, rows[row_of, REL_FLAGS], 0)
    ring_return = (flags & REL_RING_RETURN) != 0
    reads = valid & ~ring_return
    col = torch.where(reads, rows[row_of, REL_START_POS] + j * ps, 0)
    r_read = torch.where(reads, r, req_to_token.shape[0] - 1)
    rep = req_to_token[r_read, col].to(torch.int64)
    do_swa = reads & ((flags & REL_SWA) != 0)
    do_full = reads & ((flags & REL_FULL) != 0)

    ring_col = torch.where(ring_return, rows[row_of, REL_START_POS] // ps + j, 0)
    ring_col = ring_col.clamp_(max=ring_pages.shape[1] - 1)
    ring_page = ring_pages[torch.where(ring_return, r, 0), ring_col].to(torch.int64)
    if validate:  # a representative out of range is read and cleared through nowhere
        fault_page = torch.where(ring_return, ring_page, rep // ps)
        ring_ok = (ring_page >= 1) & (ring_page <= n_swa_cap)
        bad_ring = ring_return & ~ring_ok
        ring_page = torch.where(ring_ok, ring_page, 0)
        rep_ok = (rep >= ps) & (rep < (n_full_cap + 1) * ps)
        bad_rep = reads & ~rep_ok
        read_ok = reads & rep_ok
        rep = torch.where(rep_ok, rep, 0)
        gather = do_swa & rep_ok
    else:
        read_ok, gather = reads, do_swa
    full_page = rep // ps
    peer = full_to_swa[rep].to(torch.int64)
    if validate:
        peer = torch.where(gather, peer, 0)
    mapped = peer > 0
    swa_page = torch.where(mapped, peer // ps, 0)
    offs = torch.arange(ps, device=device)
    if validate:
        live = gather & mapped
        swa_ok = (swa_page >= 1) & (swa_page <= n_swa_cap)
        bad_swa = live & ~swa_ok
        swa_page = torch.where(swa_ok, swa_page, 0)
        tile = full_to_swa[torch.where(live[:, None], full_page[:, None] * ps + offs, 0)]
        not_dense = live & (tile.to(torch.int64) != (peer // ps)[:, None] * ps + offs).any(1)
        epoch = rows[row_of, REL_EPOCH]
        # SWA pushes in lane order: a lane pushes its peer or its ring page, never both.
        swa_pushed = torch.where(ring_return, ring_page, swa_page)
        swa_stamp = ((live & swa_ok) | (ring_return & ring_ok)) & (epoch > 0)
        dup = stamp_epochs_torch(epochs[1], torch.where(swa_stamp, swa_pushed, 0), epoch,
                                 swa_stamp)
        full_stamp = read_ok & do_full & (epoch > 0)
        dup |= stamp_epochs_torch(epochs[0], torch.where(full_stamp, full_page, 0), epoch,
                                  full_stamp)
        bits = (torch.where(gather & ~mapped, FaultCode.UNMAPPED_PEER, 0)
                | torch.where(not_dense, FaultCode.NOT_PAGE_DENSE, 0)
                | torch.where(bad_rep | bad_swa | bad_ring, FaultCode.OUT_OF_RANGE, 0)
                | torch.where(dup, FaultCode.DUPLICATE_FREE, 0))
        record_fault_bits_torch(err, bits, STAGE_RELEASE, row_of, r, fault_page)
    else:
        bits = torch.where(do_swa & ~mapped, FaultCode.UNMAPPED_PEER, 0)
        record_fault_bits_torch(err, bits, STAGE_RELEASE, row_of, r, full_page)

    swa_value = torch.where(ring_return, ring_page, swa_page)
    swa_pos = torch.where(do_swa | ring_return,
                          (rows[row_of, REL_SWA_PUSH] + j) % n_swa_cap, n_swa_cap)

    # The gathers above are materialised before the clear below: the twin's barrier.
    do_clear = read_ok & ((flags & REL_CLEAR) != 0)
    clear_slot = torch.where(do_clear[:, None], full_page[:, None] * ps + offs, 0)
    full_to_swa.index_put_((clear_slot.reshape(-1),),
                           torch.zeros((), dtype=full_to_swa.dtype, device=device))
    swa_free.index_put_((swa_pos,), swa_value.to(swa_free.dtype))
    full_pos = torch.where(do_full, (rows[row_of, REL_FULL_PUSH] + j) % n_full_cap, n_full_cap)
    full_free.index_put_((full_pos,), full_page.to(full_free.dtype))
