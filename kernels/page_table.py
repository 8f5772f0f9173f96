"""Page tables: the attention batch's FULL and SWA page tables, written from host-planned rows.

One program per attention lane i, reading row i of a page-table row table (layout:
``PT_*`` in ``graphalloc.kernels.abi``; the lane section of a step's descriptor buffer,
planned with the step by ``graphalloc.plan.lanes``)::

    row = table[i]                                    # one 64-byte load (pinned host memory)
    r, L, end, first, foff, soff, last = row[...]     # end = ceil(L/ps), first = SWA's first page
    if FULL_CSR: full_indptr[i+1] = foff + end;  full_last_page_len[i] = last
    if SWA_CSR:  swa_indptr[i+1]  = soff + end - first
                 swa_last_page_len[i] = last if first < end else 0
    (program 0 also writes indptr[0] = 0);  if SEQ_LENS: seq_lens[i] = L
    for c in [lo, hi), BLOCK_COLS at a time:          # lo = 0, or first for SWA-CSR-only;
        full = req_to_token[r, c*ps] // ps   if c < end      # hi = block-table width, or end
        swa  = full_to_swa[full*ps] // ps    if first <= c < end
        FULL_CSR: full_indices[foff + c]        = full        (c < end)
        SWA_CSR:  swa_indices[soff + c - first] = swa         (first <= c < end)
        FULL_BT:  full_block_table[i, c] = full if c < end else 0
        SWA_BT:   swa_block_table[i, c]  = swa if first <= c < end else 0

A lane whose row has ``end == 0`` (padded, or a request of length 0) reads nothing: every
gather is masked off; it writes an empty CSR range (indptr[i+1] == indptr[i], last page
length 0), seq_len 0, and, with a block-table form, a zero row. Each block-table row is
written whole on every launch (page ids, then zeros to the fixed width), so no stale id
from an earlier step survives in any column. ``kv_indices`` entries past ``indptr[B]`` are
left as they were (FlashInfer never reads them). Entries past a buffer's capacity are not
written (the host planner refuses such a batch first).

The kernel only reads the allocator's tables, so any number of lanes may name the same
pages (prefix sharing) or even the same request. A FULL page whose ``full_to_swa`` entry is
0 (or a slot outside the mapping) gives SWA page 0, the sink: never an out-of-range id.
No fault is recorded (the host planner guarantees the SWA range lies at or past the
frontier, where every page is mapped).

Bytes per lane: 64 (its row, from host memory); per FULL page, one index read of
``req_to_token`` (stride ps: one sector per page) and one int32 write per CSR; per SWA
page, one index read of ``full_to_swa`` (plus its ``req_to_token`` read when no FULL form
is written) and one int32 write per CSR; per block-table form, ``4 * width`` bytes of
writes; 16-20 bytes of scalars. Nothing is specialised on lengths, offsets or batch size
(``do_not_specialize``), so a change of lengths never compiles a new variant; the forms
written, the block width and the page size are fixed per table set.

``write_page_tables`` (Triton) and ``write_page_tables_torch`` (the fixed-shape,
sync-free reference twin) share one signature and write identical results.
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
)
from .errors import TensorSpecError
from .rows import check_rows, load_row, row_col

__all__ = ["write_page_tables", "write_page_tables_torch", "page_table_meta"]

# Row columns as constexprs (jit code reads only constexpr globals).
_REQ = tl.constexpr(PT_REQ)
_SEQ_LEN = tl.constexpr(PT_SEQ_LEN)
_END_PAGE = tl.constexpr(PT_END_PAGE)
_SWA_FIRST = tl.constexpr(PT_SWA_FIRST)
_FULL_OFF = tl.constexpr(PT_FULL_OFF)
_SWA_OFF = tl.constexpr(PT_SWA_OFF)
_LAST_LEN = tl.constexpr(PT_LAST_LEN)


@triton.jit(do_not_specialize=["stride_r2t_row", "stride_full_bt_row", "stride_swa_bt_row",
                               "n_r2t_cols", "n_f2s_slots", "n_full_indices", "n_swa_indices",
                               "n_bt_cols"])
def _page_table_kernel(
    # page-table rows (int64 [B, 8], may be pinned host memory)
    table_ptr,
    # allocator tables (read only)
    r2t_ptr, f2s_ptr,
    # CSR outputs (FlashInfer): indptr [B+1], indices [capacity], last page length [B]
    full_indptr_ptr, full_indices_ptr, full_last_ptr,
    swa_indptr_ptr, swa_indices_ptr, swa_last_ptr,
    # block-table outputs (FlashAttention / vLLM): [B, n_bt_cols] each, seq_lens [B]
    full_bt_ptr, swa_bt_ptr, seq_lens_ptr,
    # strides
    stride_r2t_row, stride_full_bt_row, stride_swa_bt_row,
    # sizes
    page_size, n_r2t_cols, n_f2s_slots, n_full_indices, n_swa_indices, n_bt_cols,
    # meta-parameters: which outputs exist, and the column tile
    FULL_CSR: tl.constexpr, SWA_CSR: tl.constexpr, FULL_BT: tl.constexpr, SWA_BT: tl.constexpr,
    SEQ_LENS: tl.constexpr, NEED_FULL: tl.constexpr, NEED_SWA: tl.constexpr,
    ANY_BT: tl.constexpr, BLOCK_COLS: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    row, cols = load_row(table_ptr, pid)
    r = row_col(row, cols, _REQ)
    seq_len = row_col(row, cols, _SEQ_LEN)
    end = row_col(row, cols, _END_PAGE)
    first = row_col(row, cols, _SWA_FIRST)
    full_off = row_col(row, cols, _FULL_OFF)
    swa_off = row_col(row, cols, _SWA_OFF)
    last = row_col(row, cols, _LAST_LEN)

    # Scalars of the lane, straight from its row (no copy node for indptr and lengths).
    if FULL_CSR:
        if pid == 0:
            tl.store(full_indptr_ptr, (pid * 0).to(full_indptr_ptr.dtype.element_ty))
        tl.store(full_indptr_ptr + pid + 1, (full_off + end).to(full_indptr_ptr.dtype.element_ty))
        tl.store(full_last_ptr + pid, last.to(full_last_ptr.dtype.element_ty))
    if SWA_CSR:
        if pid == 0:
            tl.store(swa_indptr_ptr, (pid * 0).to(swa_indptr_ptr.dtype.element_ty))
        tl.store(swa_indptr_ptr + pid + 1,
                 (swa_off + end - first).to(swa_indptr_ptr.dtype.element_ty))
        tl.store(swa_last_ptr + pid,
                 tl.where(first < end, last, 0).to(swa_last_ptr.dtype.element_ty))
    if SEQ_LENS:
        tl.store(seq_lens_ptr + pid, seq_len.to(seq_lens_ptr.dtype.element_ty))

    # Columns: a block table is written whole (ids, then zeros to its width); CSR-only
    # tables visit just the lane's pages. A lane with end == 0 gathers nothing.
    if ANY_BT:
        hi = n_bt_cols
    else:
        hi = end
    if NEED_FULL or ANY_BT:
        lo = first * 0
    else:
        lo = first
    r2t_row_ptr = r2t_ptr + r * stride_r2t_row
    full_bt_row_ptr = full_bt_ptr + pid * stride_full_bt_row
    swa_bt_row_ptr = swa_bt_ptr + pid * stride_swa_bt_row
    lanes = tl.arange(0, BLOCK_COLS)
    for start in range(lo, hi, BLOCK_COLS):
        c = start + lanes  # int64: the page column, position // ps
        in_full = c < end
        in_swa = in_full & (c >= first)
        if NEED_FULL:
            gather_full = in_full & (c * page_size < n_r2t_cols)
        else:
            gather_full = in_swa & (c * page_size < n_r2t_cols)
        full = tl.load(r2t_row_ptr + c * page_size, mask=gather_full,
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
        bt_mask = c < n_bt_cols
        if FULL_BT:
            tl.store(full_bt_row_ptr + c,
                     tl.where(in_full, full, 0).to(full_bt_ptr.dtype.element_ty), mask=bt_mask)
        if SWA_BT:
            tl.store(swa_bt_row_ptr + c, swa.to(swa_bt_ptr.dtype.element_ty), mask=bt_mask)


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
                swa_block_table, seq_lens) -> int:
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
    return width


def page_table_meta(page_size: int, n_cols: int) -> dict:
    """``BLOCK_COLS``: the column tile, a power of two covering ``n_cols`` up to 256."""
    return dict(BLOCK_COLS=max(16, min(256, triton.next_power_of_2(max(1, n_cols)))))


def write_page_tables(table, req_to_token, full_to_swa, *, page_size: int, full_csr=None,
                      swa_csr=None, full_block_table=None, swa_block_table=None,
                      seq_lens=None) -> None:
    """Launch the page-table kernel: one program per row of ``table`` (int64 ``[B, 8]``,
    pinned host memory or on the device). Shares the twin's signature and results.

    Outputs (each optional, int32 or int64, on the tables' device; ``None`` skips it):
    ``full_csr`` / ``swa_csr`` = ``(kv_indptr [B+1], kv_indices [capacity],
    kv_last_page_len [B])``; ``full_block_table`` / ``swa_block_table`` ``[B, width]``
    (one width); ``seq_lens [B]``. Capture-safe: attribute checks only, no sync. Returns
    before the device has finished.
    """
    width = _check_args(table, req_to_token, full_to_swa, full_csr, swa_csr, full_block_table,
                        swa_block_table, seq_lens)
    n_lanes = table.shape[0]
    if n_lanes == 0:
        return
    dummy = full_to_swa  # stands in for outputs not written (never dereferenced)
    f_ptr, f_idx, f_last = full_csr if full_csr is not None else (dummy, dummy, dummy)
    s_ptr, s_idx, s_last = swa_csr if swa_csr is not None else (dummy, dummy, dummy)
    f_bt = full_block_table if full_block_table is not None else dummy
    s_bt = swa_block_table if swa_block_table is not None else dummy
    n_cols = width or triton.cdiv(req_to_token.shape[1], page_size)
    _page_table_kernel[(n_lanes,)](
        table, req_to_token, full_to_swa,
        f_ptr, f_idx, f_last, s_ptr, s_idx, s_last,
        f_bt, s_bt, seq_lens if seq_lens is not None else dummy,
        req_to_token.stride(0),
        full_block_table.stride(0) if full_block_table is not None else 0,
        swa_block_table.stride(0) if swa_block_table is not None else 0,
        page_size, req_to_token.shape[1], full_to_swa.numel(),
        f_idx.numel() if full_csr is not None else 0,
        s_idx.numel() if swa_csr is not None else 0,
        width,
        FULL_CSR=full_csr is not None, SWA_CSR=swa_csr is not None,
        FULL_BT=full_block_table is not None, SWA_BT=swa_block_table is not None,
        SEQ_LENS=seq_lens is not None,
        NEED_FULL=full_csr is not None or full_block_table is not None,
        NEED_SWA=swa_csr is not None or swa_block_table is not None,
        ANY_BT=width > 0, **page_table_meta(page_size, n_cols),
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
                            swa_block_table=None, seq_lens=None) -> None:
    """Reference twin of the page-table kernel: the same writes over a fixed ``[B, width]``
    grid of (lane, column), ``width`` the block-table width or ``ceil(max_context_len /
    ps)``. Fixed-shape and sync-free (no scalar reads, no data-dependent shapes)."""
    width = _check_args(table, req_to_token, full_to_swa, full_csr, swa_csr, full_block_table,
                        swa_block_table, seq_lens)
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
