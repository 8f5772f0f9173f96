"""State rows: the recurrent-state slot table written, and state tensors copied, per step.

One program per state row (layout ``ST_*`` in :mod:`graphalloc.kernels.abi`)::

    row = rows[pid]                       # one 64-byte load (pinned host memory)
    if row.kind == ST_SET:   table[row.a] = row.b
    if row.kind == ST_SPEC:  table[row.a + i] = row[2 + i] for i < 6 where row[2 + i] != 0
    # ST_COPY rows and padded rows: nothing here (copies: copy_state_rows)

:func:`copy_state_rows` then copies, for every ``ST_COPY`` row and every registered state
tensor ``t`` (``[n_slots + 1, ...]``), ``t[dst] = t[src]``: a gather of every source slot
into a scratch tensor, then a scatter of it, so a slot that is both a source and a
destination in one step is read before it is written (a snapshot taken from a request
released in the same step, whose slot a new request reuses). Padded rows copy the sink
slot 0 onto itself. Both are fixed-shape and sync-free (capturable); neither reads a
device value on the host.

Bytes: 64 per row read; 8 per ``ST_SET`` written; per copy row, twice the state bytes of
one slot per tensor. ``write_state_rows`` (Triton) and ``write_state_rows_torch`` share one
signature and results; the copy has only the Torch form (two fixed-shape ops per tensor).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .abi import ROW_WIDTH, ST_A, ST_B, ST_COPY, ST_KIND, ST_SET, ST_SPEC
from .rows import check_rows, load_row, row_col

__all__ = ["write_state_rows", "write_state_rows_torch", "copy_state_rows"]

_KIND, _A, _B = tl.constexpr(ST_KIND), tl.constexpr(ST_A), tl.constexpr(ST_B)
_SET, _SPEC = tl.constexpr(ST_SET), tl.constexpr(ST_SPEC)


@triton.jit
def _state_kernel(rows_ptr, table_ptr):
    pid = tl.program_id(0).to(tl.int64)
    row, cols = load_row(rows_ptr, pid)
    kind = row_col(row, cols, _KIND)
    index = row_col(row, cols, _A)
    if kind == _SET:
        tl.store(table_ptr + index, row_col(row, cols, _B).to(table_ptr.dtype.element_ty))
    if kind == _SPEC:  # columns 2.. are slots at index, index + 1, ... (a 0 ends them)
        spec_mask = (cols >= _B) & (row != 0)
        tl.store(table_ptr + index + cols - _B, row.to(table_ptr.dtype.element_ty),
                 mask=spec_mask)


def write_state_rows(rows: torch.Tensor, table: torch.Tensor) -> None:
    """Apply the ``ST_SET`` rows of ``rows`` (int64 ``[n, 8]``, may be pinned host memory)
    to ``table`` (the state table, a contiguous 1-D index tensor). One program per row;
    returns before the device has finished."""
    check_rows(rows, table, "state")
    if rows.shape[0]:
        _state_kernel[(rows.shape[0],)](rows, table)


def write_state_rows_torch(rows: torch.Tensor, table: torch.Tensor) -> None:
    """Reference twin of :func:`write_state_rows` (fixed shape: every row writes, a padded
    or copy row the table's scratch entry, its last, with its own value)."""
    check_rows(rows, table, "state")
    if not rows.shape[0]:
        return
    rows = rows.to(table.device, non_blocking=True)
    scratch = table.shape[0] - 1
    kind = rows[:, ST_KIND]
    j = torch.arange(ROW_WIDTH - ST_B, device=table.device)
    slots = rows[:, ST_B:]  # [n, 6]: ST_SET's B first; ST_SPEC's slots
    write = ((kind == ST_SPEC)[:, None] & (slots != 0)) | ((kind == ST_SET)[:, None]
                                                            & (j == 0)[None, :])
    index = torch.where(write, rows[:, ST_A, None] + j[None, :], scratch)
    value = torch.where(write, slots.to(table.dtype), table[scratch])
    table.index_put_((index.reshape(-1),), value.reshape(-1))


def copy_state_rows(rows: torch.Tensor, tensors) -> None:
    """For every ``ST_COPY`` row of ``rows`` and every tensor of ``tensors`` (each
    ``[n_slots + 1, ...]``, slot 0 the sink): ``t[dst] = t[src]``, sources gathered before any
    destination is written. Fixed shape (padded rows copy slot 0 onto itself), sync-free."""
    if not len(tensors) or not rows.shape[0]:
        return
    rows = rows.to(tensors[0].device, non_blocking=True)
    is_copy = rows[:, ST_KIND] == ST_COPY
    src = torch.where(is_copy, rows[:, ST_A], 0)
    dst = torch.where(is_copy, rows[:, ST_B], 0)
    for t in tensors:
        t.index_copy_(0, dst, t.index_select(0, src))
