"""Stage: a step's descriptor rows copied from pinned host memory into device memory, at the
head of the step.

The host writes each step into a pinned descriptor buffer; a kernel that reads it directly
pays a PCIe round trip per program's first load, and every kernel of the step pays it
again. Staging pays it once: the first kernel of the step copies the rows the step's
launches will read -- release rows ``[0, n_release)``, allocation rows ``[0, n_alloc)``, the
attention lanes and the recurrent-state section whole -- and the buffer's stamp word into a
device mirror of the same layout, and the step's kernels read the mirror (the page-table
kernel's lane vectors, loaded by every program, then come from L2). A kernel, not a copy
node: a host-to-device copy node of an 8 KB descriptor measured 10-16 us of GPU time on an
H200 (docs/decisions.md), a kernel's wide loads of pinned memory a few.

One launch, ``sections`` = up to four ``(first_row, n_rows)`` ranges of the buffer (the same
rows of the mirror), plus the stamp::

    programs  cdiv(n_rows, BLOCK_ROWS) per section, in section order (none for an empty one)
    program p of section s copies rows [first_s + p*BLOCK_ROWS, ... + BLOCK_ROWS) & < n_s:
              one [BLOCK_ROWS, 8] tile load from the source, one store to the mirror
    program 0 also copies the stamp word

Every program copies its own rows; nothing is read back. Capture-safe (attribute checks
only); the section sizes are launch arguments, fixed in a captured graph (a graph of a row
bucket stages that bucket's rows). ``stage_rows`` (Triton) and ``stage_rows_torch`` (the
twin: slice copies) share one signature. Cost: ``64 * rows + 8`` bytes read from host memory
and written to the device, in ``sum(cdiv(n_s, BLOCK_ROWS))`` programs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .abi import ROW_WIDTH
from .errors import TensorSpecError

__all__ = ["stage_rows", "stage_rows_torch", "BLOCK_ROWS"]

BLOCK_ROWS = 16  # rows a program copies (1 KB)
_ROW_WIDTH = tl.constexpr(ROW_WIDTH)


@triton.jit(do_not_specialize=["first0", "n0", "first1", "n1", "first2", "n2", "first3", "n3"])
def _stage_kernel(src_ptr, dst_ptr, src_stamp_ptr, dst_stamp_ptr,
                  first0, n0, first1, n1, first2, n2, first3, n3,
                  STAMP: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    if STAMP:
        if pid == 0:
            tl.store(dst_stamp_ptr, tl.load(src_stamp_ptr))
    # This program's section and block (section boundaries are launch arguments).
    b0 = (n0 + BLOCK - 1) // BLOCK
    b1 = (n1 + BLOCK - 1) // BLOCK
    b2 = (n2 + BLOCK - 1) // BLOCK
    first, n, block = first0, n0, pid
    if pid >= b0:
        first, n, block = first1, n1, pid - b0
        if pid >= b0 + b1:
            first, n, block = first2, n2, pid - b0 - b1
            if pid >= b0 + b1 + b2:
                first, n, block = first3, n3, pid - b0 - b1 - b2
    rows = block * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, _ROW_WIDTH)
    offs = (first + rows).to(tl.int64)[:, None] * _ROW_WIDTH + cols[None, :]
    mask = (rows < n)[:, None] & (cols < _ROW_WIDTH)[None, :]
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask, other=0), mask=mask)


def _sections(sections, n_rows_total: int) -> list[tuple[int, int]]:
    out = [(int(a), int(n)) for a, n in sections]
    if len(out) > 4:
        raise TensorSpecError(f"stage_rows takes at most 4 sections, got {len(out)}")
    for a, n in out:
        if a < 0 or n < 0 or a + n > n_rows_total:
            raise TensorSpecError(f"stage_rows: section ({a}, {n}) is outside the buffer's "
                                  f"{n_rows_total} rows")
    return out + [(0, 0)] * (4 - len(out))


def _check(src, dst, src_stamp, dst_stamp):
    for name, t in (("src", src), ("dst", dst)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or t.dim() != 2 or (
                t.shape[1] != ROW_WIDTH) or not t.is_contiguous():
            raise TensorSpecError(f"stage_rows: {name} must be a contiguous int64 "
                                  f"[n, {ROW_WIDTH}] tensor")
    if src.shape != dst.shape:
        raise TensorSpecError(f"stage_rows: src {tuple(src.shape)} and dst {tuple(dst.shape)} "
                              "differ")
    if (src_stamp is None) != (dst_stamp is None):
        raise TensorSpecError("stage_rows: src_stamp and dst_stamp go together")


def stage_rows(src: torch.Tensor, dst: torch.Tensor, sections, src_stamp=None,
               dst_stamp=None) -> None:
    """Copy ``sections`` (``(first_row, n_rows)`` each, at most 4) of ``src`` (a pinned
    descriptor buffer, int64 ``[n, 8]``) into the same rows of ``dst`` (its device mirror),
    and ``src_stamp`` into ``dst_stamp`` (int64 ``[1]`` each, or both None). One launch;
    none when there is nothing to copy. Never synchronises."""
    _check(src, dst, src_stamp, dst_stamp)
    secs = _sections(sections, src.shape[0])
    n_programs = sum(triton.cdiv(n, BLOCK_ROWS) for _, n in secs)
    stamp = src_stamp is not None
    if n_programs == 0 and not stamp:
        return
    _stage_kernel[(max(1, n_programs),)](
        src, dst, src_stamp if stamp else src, dst_stamp if stamp else dst,
        *(v for sec in secs for v in sec), STAMP=stamp, BLOCK=BLOCK_ROWS)


def stage_rows_torch(src: torch.Tensor, dst: torch.Tensor, sections, src_stamp=None,
                     dst_stamp=None) -> None:
    """Twin of :func:`stage_rows`: the same rows copied by slice (non-blocking copies)."""
    _check(src, dst, src_stamp, dst_stamp)
    for a, n in _sections(sections, src.shape[0]):
        if n:
            dst[a:a + n].copy_(src[a:a + n], non_blocking=True)
    if src_stamp is not None:
        dst_stamp.copy_(src_stamp, non_blocking=True)
