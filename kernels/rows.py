"""Descriptor-row helpers shared by the step kernels, their launchers and their twins.

Device side: :func:`load_row` (one 64-byte vector load of a row), :func:`row_col`
(one column of it, no second memory access) and :func:`chunk_span` (the part of a long
row one of several programs sharing it works on). Host side: the launcher checks
(:func:`check_rows`, :func:`check_tables`, :func:`launch_rows`), the launch options
(:func:`warps`), the page-tile width (:func:`block_ps`) and the twins' flat lane layout
(:func:`lanes_of_rows`). The layout itself is :mod:`graphalloc.kernels.abi`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .abi import ERR_WORDS, ROW_WIDTH
from .errors import TensorSpecError

__all__ = ["load_row", "row_col", "chunk_span", "check_rows", "check_tables", "launch_rows",
           "warps", "block_ps", "lanes_of_rows"]

_ROW_WIDTH = tl.constexpr(ROW_WIDTH)


@triton.jit
def load_row(rows_ptr, pid):
    """One program's descriptor row: a single 64-byte vector load (int64 ``[ROW_WIDTH]``)."""
    cols = tl.arange(0, _ROW_WIDTH)
    return tl.load(rows_ptr + pid * _ROW_WIDTH + cols).to(tl.int64), cols


@triton.jit
def row_col(row, cols, col: tl.constexpr):
    """Column ``col`` of a loaded row, as an int64 scalar (no second memory access)."""
    return tl.sum(tl.where(cols == col, row, 0), axis=0)


@triton.jit
def chunk_span(n_items, BLOCK: tl.constexpr, chunk, n_chunks):
    """``[start, end)`` of a row's ``n_items`` that program ``chunk`` of the ``n_chunks``
    sharing the row works on: whole blocks of ``BLOCK``, contiguous and in order, so chunk c's
    items all precede chunk c + 1's (``n_chunks = 1``: ``[0, n_items)``, the whole row).
    Loop ``for start in range(start, end, BLOCK)``; an empty span runs no iteration."""
    n_blocks = (n_items + BLOCK - 1) // BLOCK
    per_chunk = (n_blocks + n_chunks - 1) // n_chunks
    start = chunk * per_chunk * BLOCK
    return start, tl.minimum(start + per_chunk * BLOCK, n_items)


def check_rows(rows: torch.Tensor, table: torch.Tensor, what: str) -> None:
    """Launcher checks on a descriptor table (attribute reads only: no sync)."""
    if not isinstance(rows, torch.Tensor):
        raise TensorSpecError(f"{what} rows must be a torch.Tensor, got {type(rows).__name__}")
    if rows.dtype != torch.int64 or rows.dim() != 2 or rows.shape[1] != ROW_WIDTH:
        raise TensorSpecError(f"{what} rows must be int64 [n, {ROW_WIDTH}], got {rows.dtype} "
                              f"{tuple(rows.shape)}")
    if not rows.is_contiguous():
        raise TensorSpecError(f"{what} rows must be contiguous (one 64-byte load per row)")
    if rows.device != table.device and not (rows.device.type == "cpu" and rows.is_pinned()):
        raise TensorSpecError(f"{what} rows are on {rows.device} but the tables on "
                              f"{table.device}: pass pinned host memory or a device tensor")


def check_tables(req_to_token, ring_pages, err, validate: bool, epochs, n_caps) -> None:
    """Launcher checks shared by the release, allocation and fused step launchers.
    ``epochs``: validate mode's ``(full_epoch, swa_epoch)`` stamp tables (or None);
    ``n_caps``: the pools' page counts ``(n_full_cap, n_swa_cap)``."""
    if err.dtype != torch.int64 or err.numel() < ERR_WORDS:
        raise TensorSpecError(f"err must be int64 [{ERR_WORDS}], got {err.dtype} "
                              f"{tuple(err.shape)}")
    if req_to_token.stride(1) != 1 or ring_pages.stride(1) != 1:
        raise TensorSpecError("req_to_token and ring_pages need unit column stride")
    if not validate:
        return
    if epochs is None or len(epochs) != 2:
        raise TensorSpecError("validate=True needs epochs=(full_epoch, swa_epoch), int64 "
                              "[n_full_cap + 1] and [n_swa_cap + 1] (DeviceState.*_epoch_buf)")
    for name, t, cap in zip(("full_epoch", "swa_epoch"), epochs, n_caps, strict=True):
        if t is None or t.dtype != torch.int64 or t.numel() < cap + 1:
            got = "None" if t is None else f"{t.dtype} {tuple(t.shape)}"
            raise TensorSpecError(f"validate=True needs {name}, int64 [{cap + 1}], got {got}")


def launch_rows(rows: torch.Tensor, n_rows, n_chunks, what: str) -> int:
    """The launch's row count: ``n_rows`` (None: every row of ``rows``), checked to lie in
    ``[0, rows.shape[0]]``, with ``n_chunks >= 1`` programs per row. The launch runs the
    rows ``[0, n_rows)``; rows past them must be padding (the planner packs real rows at
    the front), so any ``n_rows`` that covers the real rows gives the same state."""
    total = rows.shape[0]
    if n_rows is None:
        n_rows = total
    if isinstance(n_rows, bool) or not isinstance(n_rows, int) or not 0 <= n_rows <= total:
        raise TensorSpecError(f"{what}: n_rows must be an int in [0, {total}] (the rows of the "
                              f"descriptor table), got {n_rows!r}")
    if isinstance(n_chunks, bool) or not isinstance(n_chunks, int) or n_chunks < 1:
        raise TensorSpecError(f"{what}: n_chunks must be an int >= 1 (programs per row), got "
                              f"{n_chunks!r}")
    return n_rows


def warps(num_warps: int | None) -> dict:
    """A launch's ``num_warps`` option (none for None: Triton's default; each value compiles
    its own kernel variant)."""
    return {} if num_warps is None else {"num_warps": int(num_warps)}


def block_ps(page_size: int) -> int:
    """``BLOCK_PS``: the page tile width, the next power of two >= page_size."""
    return triton.next_power_of_2(page_size)


def lanes_of_rows(n_per_row: torch.Tensor, n_lanes: int):
    """Flat lanes over rows, for the twins: (row of lane, index within row, valid mask).
    Fixed-shape and sync-free."""
    ends = torch.cumsum(n_per_row, 0)
    lanes = torch.arange(n_lanes, device=n_per_row.device)
    row_of_lane = torch.searchsorted(ends, lanes, right=True).clamp_(max=len(n_per_row) - 1)
    valid = lanes < ends[-1]
    within = lanes - (ends - n_per_row)[row_of_lane]
    return row_of_lane, torch.where(valid, within, 0), valid
