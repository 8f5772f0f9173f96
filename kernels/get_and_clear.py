"""get_and_clear_swa_pages: the lookup-and-clear core as one call on any tensor of representatives.

This is the op an engine calls to free one SWA segment (the single fused call
current engines make per free), and what benchmarks compare against. The
step graph does the same work from descriptor rows (``kernels.release``).

One program per BLOCK representatives::

    rep  = reps[i * stride]                  # one per distinct full page, any slot of it
    peer = full_to_swa[rep]
    swa_pages[i] = peer // ps; mapped[i] = peer > 0
    if VALIDATE:                              # the page's ps slots, before they are cleared
        valid[i] = mapped and slot 0 mapped
                   and every nonzero slot o == (peer // ps) * ps + o
    barrier                                   # rep is one of the slots cleared next
    full_to_swa[(rep // ps) * ps + 0..ps-1] = 0

Bytes per representative: one index read of ``reps``, one of ``full_to_swa``
(ps with validation), ps index writes for the clear, one index and one bool
write of results.

Validation (``validate=True``) is a debugging aid and may synchronise: on the
host it refuses representatives outside ``[0, full_to_swa.numel())`` and a full
page given twice, before touching the mapping; after the kernel it marks
invalid every page whose SWA page another page also mapped to. Without it,
the same full page given twice is undefined (a contract violation, as in the
step descriptor).

``get_and_clear_swa_pages`` (Triton) and ``get_and_clear_swa_pages_torch``
(the reference twin) share one signature and give identical results.
"""

from __future__ import annotations

import inspect

import torch
import triton
import triton.language as tl

from .errors import OverlapError, PositionError, TensorSpecError

__all__ = ["get_and_clear_swa_pages", "get_and_clear_swa_pages_torch"]

# The representatives may be any view (a strided column of req_to_token, a slice at
# any offset): their address must not pick a new variant. Triton >= 3.3 separates
# alignment from value specialisation; older versions take do_not_specialize alone.
_NO_SPECIALIZE = ["reps_ptr", "n_reps", "stride_reps", "n_slots"]
_JIT_ARGS = {"do_not_specialize": _NO_SPECIALIZE}
if "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters:
    _JIT_ARGS["do_not_specialize_on_alignment"] = ["reps_ptr"]


@triton.jit(**_JIT_ARGS)
def _get_and_clear_kernel(
    # inputs
    reps_ptr, f2s_ptr,
    # outputs
    swa_pages_ptr, mapped_ptr, valid_ptr,
    # sizes and strides
    n_reps, stride_reps, n_slots, page_size,
    # meta-parameters
    VALIDATE: tl.constexpr, BLOCK: tl.constexpr, BLOCK_PS: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    lanes = pid * BLOCK + tl.arange(0, BLOCK)
    rep_mask = lanes < n_reps
    rep = tl.load(reps_ptr + lanes * stride_reps, mask=rep_mask, other=0).to(tl.int64)
    peer = tl.load(f2s_ptr + rep, mask=rep_mask, other=0).to(tl.int64)
    mapped = peer > 0
    swa_page = tl.where(mapped, peer // page_size, 0)
    page_base = (rep // page_size) * page_size
    offs_ps = tl.arange(0, BLOCK_PS)
    slots = page_base[:, None] + offs_ps[None, :]
    tile_mask = rep_mask[:, None] & (offs_ps[None, :] < page_size) & (slots < n_slots)
    if VALIDATE:
        values = tl.load(f2s_ptr + slots, mask=tile_mask, other=0).to(tl.int64)
        expect = swa_page[:, None] * page_size + offs_ps[None, :]
        bad = tile_mask & (values != 0) & (values != expect)
        n_bad = tl.sum(bad.to(tl.int32), axis=1)
        anchor = tl.sum(tl.where(offs_ps[None, :] == 0, values, 0), axis=1)
        valid = mapped & (n_bad == 0) & (anchor != 0)
        tl.store(valid_ptr + lanes, valid, mask=rep_mask)

    # rep is one of the slots cleared below: every gather must land before any clear.
    tl.debug_barrier()

    tl.store(f2s_ptr + slots, tl.zeros([BLOCK, BLOCK_PS], f2s_ptr.dtype.element_ty),
             mask=tile_mask)
    tl.store(swa_pages_ptr + lanes, swa_page.to(swa_pages_ptr.dtype.element_ty), mask=rep_mask)
    tl.store(mapped_ptr + lanes, mapped, mask=rep_mask)


def _check_args(representatives: torch.Tensor, full_to_swa: torch.Tensor, page_size: int):
    """Shape, dtype and device checks (attribute reads only: no sync)."""
    for name, t in (("representatives", representatives), ("full_to_swa", full_to_swa)):
        if not isinstance(t, torch.Tensor) or t.dtype not in (torch.int32, torch.int64):
            raise TensorSpecError(f"{name} must be an int32 or int64 tensor, got "
                                  f"{getattr(t, 'dtype', type(t).__name__)}")
        if t.dim() != 1:
            raise TensorSpecError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if not full_to_swa.is_contiguous():
        raise TensorSpecError("full_to_swa must be contiguous")
    if representatives.device != full_to_swa.device:
        raise TensorSpecError(f"representatives are on {representatives.device}, full_to_swa "
                              f"on {full_to_swa.device}: move them to the mapping's device")
    if not isinstance(page_size, int) or page_size < 1:
        raise TensorSpecError(f"page_size must be a positive int, got {page_size!r}")


def _check_representatives(rep: torch.Tensor, n_slots: int, page_size: int) -> None:
    """validate=True host checks, before the mapping is touched. Off the fast path: syncs."""
    bad = (rep < 0) | (rep >= n_slots)
    if bool(bad.any()):  # off the fast path
        i = int(torch.nonzero(bad)[0, 0])  # off the fast path
        raise PositionError(
            f"representative {i} is slot {int(rep[i])}, outside [0, {n_slots}) of full_to_swa; "
            "pass full slots read from req_to_token")  # off the fast path
    pages = rep // page_size
    unique_pages, counts = torch.unique(pages, return_counts=True)  # off the fast path
    if len(unique_pages) != len(pages):  # off the fast path
        page = int(unique_pages[counts > 1][0])  # off the fast path
        raise OverlapError(
            f"full page {page} is given {int(counts.max())} times (page_size {page_size}); "
            "pass one representative per distinct full page")


def _mark_shared_swa_pages(swa_pages: torch.Tensor, mapped: torch.Tensor,
                           valid: torch.Tensor) -> torch.Tensor:
    """``valid`` with every mapped page whose SWA page another mapped page shares set False.
    Fixed-shape (a sort and neighbour compares), no sync."""
    n = swa_pages.shape[0]
    # Unmapped lanes get distinct negative keys so they never match anything.
    key = torch.where(mapped, swa_pages.to(torch.int64),
                      -1 - torch.arange(n, device=swa_pages.device))
    sorted_key, order = torch.sort(key)
    same_next = sorted_key[1:] == sorted_key[:-1]
    shared_sorted = torch.zeros(n, dtype=torch.bool, device=swa_pages.device)
    shared_sorted[1:] |= same_next
    shared_sorted[:-1] |= same_next
    shared = torch.empty_like(shared_sorted).scatter_(0, order, shared_sorted)
    return valid & ~shared


def get_and_clear_swa_pages(representatives: torch.Tensor, full_to_swa: torch.Tensor,
                            page_size: int, *, validate: bool = False):
    """Look up the SWA pages of full pages and clear their mapping, in one launch.

    Args:
        representatives: 1-D int32/int64 tensor (any stride) of full slots, one per distinct
            full page; any slot of the page may stand for it.
        full_to_swa: 1-D contiguous int32/int64 mapping (full slot -> SWA slot, 0 = none),
            on the same device. Each representative's whole full page is zeroed in place.
        page_size: tokens per page.
        validate: also check the pages (may synchronise; see the module docstring).

    Returns:
        ``(swa_pages, mapped)``: SWA page of each representative in the mapping's dtype
        (0 when unmapped) and a bool tensor; with ``validate=True``
        ``(swa_pages, mapped, valid)``. Returns before the device has finished.

    Raises (``validate=True`` only, with the mapping unchanged):
        PositionError: a representative outside ``[0, full_to_swa.numel())``.
        OverlapError: two representatives in one full page.
    """
    _check_args(representatives, full_to_swa, page_size)
    n_reps, n_slots = representatives.shape[0], full_to_swa.numel()
    device = full_to_swa.device
    swa_pages = torch.empty(n_reps, dtype=full_to_swa.dtype, device=device)
    mapped = torch.empty(n_reps, dtype=torch.bool, device=device)
    valid = torch.empty(n_reps, dtype=torch.bool, device=device) if validate else mapped
    if validate:
        _check_representatives(representatives.to(torch.int64), n_slots, page_size)
    if n_reps == 0:
        return (swa_pages, mapped, valid) if validate else (swa_pages, mapped)
    ps_block = triton.next_power_of_2(page_size)
    block = max(16, min(128, 4096 // ps_block))  # a clear tile of at most 4096 slots
    _get_and_clear_kernel[(triton.cdiv(n_reps, block),)](
        representatives, full_to_swa, swa_pages, mapped, valid,
        n_reps, representatives.stride(0), n_slots, page_size,
        VALIDATE=validate, BLOCK=block, BLOCK_PS=ps_block,
    )
    if validate:
        return swa_pages, mapped, _mark_shared_swa_pages(swa_pages, mapped, valid)
    return swa_pages, mapped


def get_and_clear_swa_pages_torch(representatives: torch.Tensor, full_to_swa: torch.Tensor,
                                  page_size: int, *, validate: bool = False):
    """Reference twin of :func:`get_and_clear_swa_pages`: same signature, same results,
    fixed-shape and sync-free (except the ``validate=True`` host checks)."""
    _check_args(representatives, full_to_swa, page_size)
    ps, n_slots, device = page_size, full_to_swa.numel(), full_to_swa.device
    rep = representatives.to(torch.int64)
    if validate:
        _check_representatives(rep, n_slots, ps)
    peer = full_to_swa[rep].to(torch.int64)
    mapped = peer > 0
    swa_page = torch.where(mapped, peer // ps, 0)
    offs = torch.arange(ps, device=device)
    page_base = (rep // ps * ps)[:, None]
    slots = page_base + offs
    # A last page cut short by the tensor's end: its missing slots fold onto the page's
    # first slot, which is cleared anyway (same value, so duplicates are harmless).
    in_range = slots < n_slots
    safe_slots = torch.where(in_range, slots, page_base)
    if validate:
        values = torch.where(in_range, full_to_swa[safe_slots].to(torch.int64), 0)
        expect = swa_page[:, None] * ps + offs
        ok = ((values == 0) | (values == expect)).all(1)
        valid = mapped & ok & (values[:, 0] != 0)
    # The gathers above are materialised before the clear below: the twin's barrier.
    full_to_swa.index_put_((safe_slots.reshape(-1),),
                           torch.zeros((), dtype=full_to_swa.dtype, device=device))
    swa_pages = swa_page.to(full_to_swa.dtype)
    if validate:
        return swa_pages, mapped, _mark_shared_swa_pages(swa_pages, mapped, valid)
    return swa_pages, mapped
