"""Page tables: the attention batch's FULL and SWA page tables, written from host-planned rows.

Programs over page blocks, not one program per lane. Each lane (row i of a page-table row
table; layout ``PT_*`` in ``graphalloc.kernels.abi``, the lane section of a step's
descriptor buffer planned by ``graphalloc.plan.lanes``) has a span of page columns -- ``[0,
end)`` when a FULL form is written, else its SWA range ``[first, end)`` -- cut into
``ceil(span / BLOCK_COLS)`` page blocks. The work of a launch is one list of units::

    units [0, B)          lane owners (only with a block-table form): lane k's block-table
                          columns that held ids last launch and are outside its range now
                          are zeroed; the ranges are recorded (bt_ranges)
    units [B, B + P)      page blocks, lane by lane: unit B + u belongs to the lane i with
                          excl[i] <= u < excl[i] + blocks[i] (excl: the exclusive prefix sum
                          of blocks over lanes, computed by every program from the lanes'
                          rows in one vector load and a cumsum: no search through memory)

and a fixed grid of programs walks it (``for unit in range(pid, B + P, n_programs)``), so a
long lane is shared by many programs and no program waits behind one. A page block of lane
i (its row: r, L, end, first, foff, soff) over columns ``c in [c0, c0 + BLOCK_COLS) &
c < end``::

    full = req_to_token[r, c*ps] // ps                         (FULL forms; c >= first only
    swa  = full_to_swa[full*ps] // ps   if first <= c                 for SWA-only tables)
    FULL_CSR: full_indices[foff + c] = full;   FULL_BT: full_block_table[i, c] = full
    SWA_CSR:  swa_indices[soff + c - first] = swa   (first <= c)
    SWA_BT:   swa_block_table[i, c] = swa           (first <= c)

Program 0 writes every lane's scalars in vector stores: ``indptr[i+1] = foff + end`` (FULL)
and ``soff + end - first`` (SWA), ``indptr[0] = 0``, ``last_page_len[i] = last`` (SWA: 0 when
``first == end``), ``seq_lens[i] = L``.

Block tables: every entry outside a lane's range is 0 (the null page) after a launch. A
launch writes the ids of the range, and zeroes only what the previous launch's ranges held
outside the new ones (``bt_ranges``, int64 ``[B, 3]``: FULL end, SWA first, SWA end of each
lane, written by the launch): the bytes a step changes, not ``B x width`` zeros. Without
``bt_ranges`` the previous ranges are taken as whole rows, so every row is rewritten whole
(a launch on tables of unknown contents). The owner of lane i is the only unit that reads or
writes ``bt_ranges[i]`` and the columns it zeroes are outside lane i's new range, which the
page blocks write: no two programs touch one entry.

A lane whose row has ``end == 0`` (padded, or a request of length 0) has no page block; it
writes an empty CSR range (indptr[i+1] == indptr[i], last page length 0), seq_len 0, and, with
a block-table form, a zero row. ``kv_indices`` entries past ``indptr[B]`` are left as they were
(FlashInfer never reads them). Entries past a buffer's capacity are not written (the host
planner refuses such a batch first).

The kernel only reads the allocator's tables, so any number of lanes may name the same
pages (prefix sharing) or even the same request. A FULL page whose ``full_to_swa`` entry is
0 (or a slot outside the mapping) gives SWA page 0, the sink: never an out-of-range id.
No fault is recorded (the host planner guarantees the SWA range lies at or past the
frontier, where every page is mapped).

Bytes: every program reads two (SWA-only tables) or one column of all B rows (8 bytes a lane,
from device memory when the descriptor was staged there: ``graphalloc.kernels.stage``), and
per unit its lane's 64-byte row; per FULL page one index read of ``req_to_token`` (stride ps:
one sector per page) and one int32 write per form; per SWA page one index read of
``full_to_swa`` (plus its ``req_to_token`` read when no FULL form is written) and one write
per form; per lane 16-20 bytes of scalars; block-table zeros only where a range shrank or a
lane changed request. Nothing is specialised on lengths, offsets or batch size
(``do_not_specialize``), so a change of lengths never compiles a new variant; the forms
written, the block width, the lane count (``MAX_LANES``) and the page size are fixed per
table set. Grid: :func:`page_table_programs` (a few programs per SM on a GPU).

``write_page_tables`` (Triton) and ``write_page_tables_torch`` (the fixed-shape,
sync-free reference twin: whole rows over a ``[B, width]`` grid) share one signature and write
identical results.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .abi import (
    PT_END_PAGE,
    PT_FULL_OFF,
    PT_LAST_LEN,
    PT_REQ,
    PT_SEQ_LEN,
    PT_SWA_FIRST,
    PT_SWA_OFF,
    ROW_WIDTH,
)
from .errors import TensorSpecError
from .rows import check_rows, load_row, row_col

__all__ = ["write_page_tables", "write_page_tables_torch", "page_table_meta",
           "page_table_programs", "RANGE_COLS", "BLOCK_COLS_MAX", "PROGRAMS_PER_SM"]

RANGE_COLS = 3  # bt_ranges columns: FULL end, SWA first, SWA end (int64)

# Row columns as constexprs (jit code reads only constexpr globals).
_REQ = tl.constexpr(PT_REQ)
_SEQ_LEN = tl.constexpr(PT_SEQ_LEN)
_END_PAGE = tl.constexpr(PT_END_PAGE)
_SWA_FIRST = tl.constexpr(PT_SWA_FIRST)
_FULL_OFF = tl.constexpr(PT_FULL_OFF)
_SWA_OFF = tl.constexpr(PT_SWA_OFF)
_LAST_LEN = tl.constexpr(PT_LAST_LEN)
_ROW_WIDTH = tl.constexpr(ROW_WIDTH)


@triton.jit(do_not_specialize=["stride_r2t_row", "stride_full_bt_row", "stride_swa_bt_row",
                               "n_lanes", "n_r2t_cols", "n_f2s_slots", "n_full_indices",
                               "n_swa_indices", "n_bt_cols"])
def _page_table_kernel(
    # page-table rows (int64 [B, 8]; device memory, or pinned host memory)
    table_ptr,
    # allocator tables (read only)
    r2t_ptr, f2s_ptr,
    # CSR outputs (FlashInfer): indptr [B+1], indices [capacity], last page length [B]
    full_indptr_ptr, full_indices_ptr, full_last_ptr,
    swa_indptr_ptr, swa_indices_ptr, swa_last_ptr,
    # block-table outputs (FlashAttention / vLLM): [B, n_bt_cols] each, seq_lens [B]; the
    # ranges the block tables held ids in (int64 [B, 3], read and rewritten)
    full_bt_ptr, swa_bt_ptr, seq_lens_ptr, ranges_ptr,
    # strides
    stride_r2t_row, stride_full_bt_row, stride_swa_bt_row,
    # sizes
    n_lanes, page_size, n_r2t_cols, n_f2s_slots, n_full_indices, n_swa_indices, n_bt_cols,
    # meta-parameters: which outputs exist, the lane vector and the column tile
    FULL_CSR: tl.constexpr, SWA_CSR: tl.constexpr, FULL_BT: tl.constexpr, SWA_BT: tl.constexpr,
    SEQ_LENS: tl.constexpr, NEED_FULL: tl.constexpr, NEED_SWA: tl.constexpr,
    ANY_BT: tl.constexpr, RANGES: tl.constexpr, MAX_LANES: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    lane_ids = tl.arange(0, MAX_LANES)
    in_batch = lane_ids < n_lanes
    lane_rows = table_ptr + lane_ids.to(tl.int64) * _ROW_WIDTH
    # Every program: the lanes' page blocks and their exclusive prefix sum (one vector load
    # per column, a cumsum; no search through memory).
    ends = tl.load(lane_rows + _END_PAGE, mask=in_batch, other=0).to(tl.int64)
    if NEED_FULL:
        spans = ends
    else:
        firsts = tl.load(lane_rows + _SWA_FIRST, mask=in_batch, other=0).to(tl.int64)
        spans = tl.maximum(ends - firsts, 0)
    blocks = (spans + BLOCK_COLS - 1) // BLOCK_COLS
    excl = tl.cumsum(blocks, 0) - blocks
    n_page_blocks = tl.sum(blocks, 0)

    # Program 0: every lane's scalars, in vector stores.
    if pid == 0:
        last_v = tl.load(lane_rows + _LAST_LEN, mask=in_batch, other=0)
        if FULL_CSR:
            foff_v = tl.load(lane_rows + _FULL_OFF, mask=in_batch, other=0)
            tl.store(full_indptr_ptr, (pid * 0).to(full_indptr_ptr.dtype.element_ty))
            tl.store(full_indptr_ptr + 1 + lane_ids,
                     (foff_v + ends).to(full_indptr_ptr.dtype.element_ty), mask=in_batch)
            tl.store(full_last_ptr + lane_ids, last_v.to(full_last_ptr.dtype.element_ty),
                     mask=in_batch)
        if SWA_CSR:
            soff_v = tl.load(lane_rows + _SWA_OFF, mask=in_batch, other=0)
            first_v = tl.load(lane_rows + _SWA_FIRST, mask=in_batch, other=0)
            tl.store(swa_indptr_ptr, (pid * 0).to(swa_indptr_ptr.dtype.element_ty))
            tl.store(swa_indptr_ptr + 1 + lane_ids,
                     (soff_v + ends - first_v).to(swa_indptr_ptr.dtype.element_ty),
                     mask=in_batch)
            tl.store(swa_last_ptr + lane_ids,
                     tl.where(first_v < ends, last_v, 0).to(swa_last_ptr.dtype.element_ty),
                     mask=in_batch)
        if SEQ_LENS:
            len_v = tl.load(lane_rows + _SEQ_LEN, mask=in_batch, other=0)
            tl.store(seq_lens_ptr + lane_ids, len_v.to(seq_lens_ptr.dtype.element_ty),
                     mask=in_batch)

    if ANY_BT:
        n_owners = n_lanes
    else:
        n_owners = n_lanes * 0
    cols = tl.arange(0, BLOCK_COLS)
    for unit in range(pid, n_owners + n_page_blocks, n_programs):
        if unit < n_owners:
            # Lane owner: zero what the last launch's ranges held outside the new ones.
            lane = (pid * 0 + unit).to(tl.int64)  # (the interpreter loops over ints)
            row, rc = load_row(table_ptr, lane)
            end = row_col(row, rc, _END_PAGE)
            first = row_col(row, rc, _SWA_FIRST)
            swa_lo = tl.where(first < end, first, 0)
            swa_hi = tl.where(first < end, end, 0)
            if RANGES:
                old_end = tl.load(ranges_ptr + lane * 3)
                old_lo = tl.load(ranges_ptr + lane * 3 + 1)
                old_hi = tl.load(ranges_ptr + lane * 3 + 2)
            else:  # unknown contents: every column outside the range
                old_end = n_bt_cols + lane * 0
                old_lo = lane * 0
                old_hi = n_bt_cols + lane * 0
            if FULL_BT:
                bt = full_bt_ptr + lane * stride_full_bt_row
                for z in range(end, tl.minimum(old_end, n_bt_cols), BLOCK_COLS):
                    c = z + cols
                    tl.store(bt + c, tl.zeros_like(c).to(full_bt_ptr.dtype.element_ty),
                             mask=(c < old_end) & (c < n_bt_cols))
            if SWA_BT:
                bt = swa_bt_ptr + lane * stride_swa_bt_row
                for z in range(old_lo, tl.minimum(old_hi, n_bt_cols), BLOCK_COLS):
                    c = z + cols
                    keep = (c >= swa_lo) & (c < swa_hi)
                    tl.store(bt + c, tl.zeros_like(c).to(swa_bt_ptr.dtype.element_ty),
                             mask=(c < old_hi) & (c < n_bt_cols) & ~keep)
            if RANGES:
                tl.store(ranges_ptr + lane * 3, end)
                tl.store(ranges_ptr + lane * 3 + 1, swa_lo)
                tl.store(ranges_ptr + lane * 3 + 2, swa_hi)
        else:
            # A page block: the lane whose blocks hold it, found in the prefix sum.
            u = unit - n_owners
            hit = excl <= u
            lane = (tl.sum(hit.to(tl.int32), 0) - 1).to(tl.int64)
            start = tl.max(tl.where(hit, excl, 0), 0)
            row, rc = load_row(table_ptr, lane)
            r = row_col(row, rc, _REQ)
            end = row_col(row, rc, _END_PAGE)
            first = row_col(row, rc, _SWA_FIRST)
            full_off = row_col(row, rc, _FULL_OFF)
            swa_off = row_col(row, rc, _SWA_OFF)
            if NEED_FULL:
                lo = first * 0
            else:
                lo = first
            c = lo + (u - start) * BLOCK_COLS + cols  # int64: the page column, position // ps
            in_full = c < end
            in_swa = in_full & (c >= first)
            if NEED_FULL:
                gather_full = in_full & (c * page_size < n_r2t_cols)
            else:
                gather_full = in_swa & (c * page_size < n_r2t_cols)
            full = tl.load(r2t_ptr + r * stride_r2t_row + c * page_size, mask=gather_full,
                           other=0).to(tl.int64) // page_size
            if NEED_SWA:
                slot = full * page_size
                swa = tl.load(f2s_ptr + slot, mask=in_swa & (slot < n_f2s_slots),
                              other=0).to(tl.int64) // page_size
                swa = tl.where(in_swa, swa, 0)
            if FULL_CSR:
                tl.store(full_indices_ptr + full_off + c,
                         full.to(full_indices_ptr.dtype.element_ty),
                         mask=in_full & (full_off + c < n_full_indices))
            if SWA_CSR:
                swa_pos = swa_off + c - first
                tl.store(swa_indices_ptr + swa_pos, swa.to(swa_indices_ptr.dtype.element_ty),
                         mask=in_swa & (swa_pos < n_swa_indices))
            if FULL_BT:
                tl.store(full_bt_ptr + lane * stride_full_bt_row + c,
                         full.to(full_bt_ptr.dtype.element_ty), mask=in_full & (c < n_bt_cols))
            if SWA_BT:
                tl.store(swa_bt_ptr + lane * stride_swa_bt_row + c,
                         swa.to(swa_bt_ptr.dtype.element_ty), mask=in_swa & (c < n_bt_cols))


# ---- argument checks and meta-parameters (shared by the launcher and the twin) ----------

def _check_out(t, shape, what: str, device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TensorSpecError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in (torch.int32, torch.int64):
        raise TensorSpecError(f"{what} must be int32 (FlashInfer/FlashAttention) or int64, "
                              f"got {t.dtype}")
    if t.device != device:
        raise TensorSpecError(f"{what} is on {t.device} but the allocator tables on {device}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise TensorSpecError(f"{what} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if not t.is_contiguous():
        raise TensorSpecError(f"{what} must be contiguous")


def _check_args(table, req_to_token, full_to_swa, full_csr, swa_csr, full_block_table,
                swa_block_table, seq_lens, bt_ranges=None) -> int:
    """Attribute checks only (no sync); returns the block-table width (0 without one)."""
    check_rows(table, full_to_swa, "page-table")
    dev = full_to_swa.device
    if req_to_token.device != dev or req_to_token.dim() != 2 or req_to_token.stride(1) != 1:
        raise TensorSpecError("req_to_token must be 2-D with unit column stride, on the "
                              f"device of full_to_swa ({dev})")
    n_lanes = table.shape[0]
    for name, csr in (("full_csr", full_csr), ("swa_csr", swa_csr)):
        if csr is None:
            continue
        if len(csr) != 3:
            raise TensorSpecError(f"{name} must be (kv_indptr, kv_indices, kv_last_page_len)")
        indptr, indices, last = csr
        _check_out(indptr, (n_lanes + 1,), f"{name} kv_indptr", dev)
        _check_out(indices, None, f"{name} kv_indices", dev)
        if indices.dim() != 1:
            raise TensorSpecError(f"{name} kv_indices must be 1-D, got {tuple(indices.shape)}")
        _check_out(last, (n_lanes,), f"{name} kv_last_page_len", dev)
    width = 0
    for name, bt in (("full_block_table", full_block_table),
                     ("swa_block_table", swa_block_table)):
        if bt is None:
            continue
        if bt.dim() != 2 or bt.shape[0] != n_lanes:
            raise TensorSpecError(f"{name} must be [{n_lanes}, max_pages_per_req], got "
                                  f"{tuple(bt.shape)}")
        _check_out(bt, None, name, dev)
        if width and bt.shape[1] != width:
            raise TensorSpecError(f"both block tables need one width, got {width} and "
                                  f"{bt.shape[1]}")
        width = bt.shape[1]
    if seq_lens is not None:
        _check_out(seq_lens, (n_lanes,), "seq_lens", dev)
    if bt_ranges is not None:
        if not isinstance(bt_ranges, torch.Tensor) or bt_ranges.dtype != torch.int64 or tuple(
                bt_ranges.shape) != (n_lanes, RANGE_COLS) or bt_ranges.device != dev or (
                not bt_ranges.is_contiguous()):
            raise TensorSpecError(f"bt_ranges must be a contiguous int64 [{n_lanes}, "
                                  f"{RANGE_COLS}] tensor on {dev}")
    return width


BLOCK_COLS_MAX = 512  # the largest page block (columns a unit covers)


def page_table_meta(page_size: int, n_cols: int, n_lanes: int = 1) -> dict:
    """``BLOCK_COLS``: the page block, a power of two covering ``n_cols`` up to
    ``BLOCK_COLS_MAX``; ``MAX_LANES``: the lane vector, the power of two covering
    ``n_lanes``."""
    del page_size
    block = max(16, min(BLOCK_COLS_MAX, triton.next_power_of_2(max(1, n_cols))))
    return dict(BLOCK_COLS=block, MAX_LANES=triton.next_power_of_2(max(1, n_lanes)))


_SM_COUNT: dict = {}  # device index -> multiprocessors
PROGRAMS_PER_SM = 8  # the grid on a GPU (benchmarks/bench_floor.py sweeps it)


def page_table_programs(device: torch.device, n_lanes: int, n_cols: int) -> int:
    """The launch's programs: on a GPU ``PROGRAMS_PER_SM`` per SM (every page block of a
    large batch in one wave), never more than the units a launch can have (``n_lanes``
    owners plus a block per lane and ``n_lanes * n_cols / BLOCK_COLS`` more); on a CPU (the
    interpreter) 4."""
    bound = 2 * n_lanes + n_lanes * n_cols // page_table_meta(1, n_cols)["BLOCK_COLS"] + 1
    if device.type != "cuda":
        return max(1, min(4, bound))
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return max(1, min(PROGRAMS_PER_SM * _SM_COUNT[index], bound))


def write_page_tables(table, req_to_token, full_to_swa, *, page_size: int, full_csr=None,
                      swa_csr=None, full_block_table=None, swa_block_table=None,
                      seq_lens=None, bt_ranges=None) -> None:
    """Launch the page-table kernel over ``table`` (int64 ``[B, 8]`` lane rows, on the
    device or in pinned host memory): a fixed grid of programs over the lanes' page blocks.
    Shares the twin's signature and results.

    Outputs (each optional, int32 or int64, on the tables' device; ``None`` skips it):
    ``full_csr`` / ``swa_csr`` = ``(kv_indptr [B+1], kv_indices [capacity],
    kv_last_page_len [B])``; ``full_block_table`` / ``swa_block_table`` ``[B, width]``
    (one width); ``seq_lens [B]``. ``bt_ranges`` (int64 ``[B, 3]``, with a block-table form):
    the ranges the previous launch left ids in, read and rewritten, so only what changed is
    zeroed; ``None`` rewrites every block-table row whole. Capture-safe: attribute checks
    only, no sync. Returns before the device has finished.
    """
    width = _check_args(table, req_to_token, full_to_swa, full_csr, swa_csr, full_block_table,
                        swa_block_table, seq_lens, bt_ranges)
    n_lanes = table.shape[0]
    if n_lanes == 0:
        return
    dummy = full_to_swa  # stands in for outputs not written (never dereferenced)
    f_ptr, f_idx, f_last = full_csr if full_csr is not None else (dummy, dummy, dummy)
    s_ptr, s_idx, s_last = swa_csr if swa_csr is not None else (dummy, dummy, dummy)
    f_bt = full_block_table if full_block_table is not None else dummy
    s_bt = swa_block_table if swa_block_table is not None else dummy
    n_cols = width or triton.cdiv(req_to_token.shape[1], page_size)
    grid = (page_table_programs(full_to_swa.device, n_lanes, n_cols),)
    _page_table_kernel[grid](
        table, req_to_token, full_to_swa,
        f_ptr, f_idx, f_last, s_ptr, s_idx, s_last,
        f_bt, s_bt, seq_lens if seq_lens is not None else dummy,
        bt_ranges if bt_ranges is not None else dummy,
        req_to_token.stride(0),
        full_block_table.stride(0) if full_block_table is not None else 0,
        swa_block_table.stride(0) if swa_block_table is not None else 0,
        n_lanes, page_size, req_to_token.shape[1], full_to_swa.numel(),
        f_idx.numel() if full_csr is not None else 0,
        s_idx.numel() if swa_csr is not None else 0,
        width,
        FULL_CSR=full_csr is not None, SWA_CSR=swa_csr is not None,
        FULL_BT=full_block_table is not None, SWA_BT=swa_block_table is not None,
        SEQ_LENS=seq_lens is not None,
        NEED_FULL=full_csr is not None or full_block_table is not None,
        NEED_SWA=swa_csr is not None or swa_block_table is not None,
        ANY_BT=width > 0, RANGES=bt_ranges is not None and width > 0,
        **page_table_meta(page_size, n_cols, n_lanes),
    )


def _scatter_csr(csr, values, valid, pos, ends, last) -> None:
    """Twin of the CSR stores: ``indices[pos] = values`` where valid and inside the buffer
    (the tail past them untouched), ``indptr = [0, ends...]``, ``last_page_len = last``."""
    indptr, indices, last_buf = csr
    cap = indices.numel()
    ok = valid & (pos < cap)
    staged = torch.empty(cap + 1, dtype=indices.dtype, device=indices.device)
    staged[:cap].copy_(indices)
    staged.index_put_((torch.where(ok, pos, cap).reshape(-1),),  # cap: a scratch entry
                      values.reshape(-1).to(indices.dtype))
    indices.copy_(staged[:cap])
    indptr[:1].zero_()
    indptr[1:].copy_(ends)
    last_buf.copy_(last)


def write_page_tables_torch(table, req_to_token, full_to_swa, *, page_size: int,
                            full_csr=None, swa_csr=None, full_block_table=None,
                            swa_block_table=None, seq_lens=None, bt_ranges=None) -> None:
    """Reference twin of the page-table kernel: the same writes over a fixed ``[B, width]``
    grid of (lane, column), ``width`` the block-table width or ``ceil(max_context_len /
    ps)``; block-table rows are written whole (the kernel's result when the rows held zeros
    outside ``bt_ranges``, which both write). Fixed-shape and sync-free (no scalar reads, no
    data-dependent shapes)."""
    width = _check_args(table, req_to_token, full_to_swa, full_csr, swa_csr, full_block_table,
                        swa_block_table, seq_lens, bt_ranges)
    if table.shape[0] == 0:
        return
    ps, dev = page_size, full_to_swa.device
    rows = table.to(dev, non_blocking=True)
    r, seq_len, end = rows[:, PT_REQ], rows[:, PT_SEQ_LEN], rows[:, PT_END_PAGE]
    first, full_off, swa_off = rows[:, PT_SWA_FIRST], rows[:, PT_FULL_OFF], rows[:, PT_SWA_OFF]
    last = rows[:, PT_LAST_LEN]
    n_cols = width or triton.cdiv(req_to_token.shape[1], ps)
    c = torch.arange(n_cols, device=dev)[None, :]
    in_full = c < end[:, None]
    in_swa = in_full & (c >= first[:, None])
    need_full = full_csr is not None or full_block_table is not None
    n_r2t_cols = req_to_token.shape[1]
    gather_full = (in_full if need_full else in_swa) & (c * ps < n_r2t_cols)
    col = torch.where(gather_full, c * ps, 0)
    r_read = torch.where(gather_full, r[:, None], 0)
    full = torch.where(gather_full, req_to_token[r_read, col].to(torch.int64) // ps, 0)
    slot = full * ps
    gather_swa = in_swa & (slot < full_to_swa.numel())
    swa = full_to_swa[torch.where(gather_swa, slot, 0)].to(torch.int64) // ps
    swa = torch.where(gather_swa, swa, 0)
    if full_csr is not None:
        _scatter_csr(full_csr, full, in_full, full_off[:, None] + c, full_off + end, last)
    if swa_csr is not None:
        _scatter_csr(swa_csr, swa, in_swa, swa_off[:, None] + c - first[:, None],
                     swa_off + end - first, torch.where(first < end, last, 0))
    if full_block_table is not None:
        full_block_table.copy_(full)  # 0 past end (gather masked)
    if swa_block_table is not None:
        swa_block_table.copy_(swa)  # 0 outside [first, end)
    if seq_lens is not None:
        seq_lens.copy_(seq_len)
    if bt_ranges is not None and width:
        has_swa = first < end
        bt_ranges.copy_(torch.stack([end, torch.where(has_swa, first, 0),
                                     torch.where(has_swa, end, 0)], dim=1))
