"""The fused step: release and allocation of one step in ONE launch.

Why it is allowed. The free lists are FIFO rings whose positions the host
owns (``graphalloc.state.ledger.FreeRing``): a step pushes the pages it frees at the
tail and pops the pages it allocates from the head. When the step's pops of
each ring fit in what was free *before* the step, the pop positions
``[head, head + pops)`` and the push positions ``[head + n_free, ...)`` are
disjoint, so no allocation program reads a ring entry a release program
writes. The other tables are disjoint by the host contracts: a released
request does not allocate in its step, a frontier advance frees only whole
pages below the allocated length (never the partial page an allocation
continues), and the pages popped are pages free before the step, never the
pages cleared by this step's releases. Then the programs of both bodies have
no dependency on each other and may run in any order, concurrently.
``StepBuilder.fusable`` is that condition; a step without it must run as two
launches (``kernels.release`` then ``kernels.allocate``).

``n_release_chunks`` programs per release row and ``n_alloc_chunks`` per allocation
row, over the launch's first R release and A allocation rows (the rest of each table
must be padding: a step launches programs for the rows it has)::

    P = R * n_release_chunks
    pid == 0 (STAMP): count the step's stamp once (kernels.stamp)
    pid < P:  _release_body(pid // n_release_chunks, pid % n_release_chunks)
    else:     q = pid - P; _allocate_body(q // n_alloc_chunks, q % n_alloc_chunks)

The bodies are the same device functions the two single kernels run, so both
variants execute the same instructions per row; only the launch differs (one
grid of ``R * n_release_chunks + A * n_alloc_chunks`` programs instead of two grids
and the dependency between them).
Faults go to the same error word; on a GPU the first record may then come from
either stage (bits and counts are exact either way); the interpreter runs
programs in order, so there it equals the two-launch record.

``run_step_fused`` (Triton) and ``run_step_fused_torch`` (the twin: the two
twins in order, which is what the fused launch must equal) share one signature.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .allocate import _allocate_body, allocate_meta, allocate_tokens_torch
from .errors import TensorSpecError
from .release import _release_body, epoch_args, release_meta, release_pages_torch
from .rows import check_rows, check_tables, launch_rows, warps
from .stamp import check_stamp, record_stamp, stamp_args

__all__ = ["run_step_fused", "run_step_fused_torch"]


@triton.jit(do_not_specialize=["stride_r2t_row", "stride_ring_row", "n_full_cap", "n_swa_cap",
                               "n_release_rows", "n_release_lanes", "n_alloc_lanes",
                               "n_ring_cols", "n_release_chunks", "n_alloc_chunks"])
def _step_kernel(
    # descriptor tables (int64 [R, 8] and [A, 8], may be pinned host memory)
    rel_rows_ptr, al_rows_ptr,
    # device tables and outputs (*_epoch_ptr: validate mode's stamps; unread otherwise)
    r2t_ptr, f2s_ptr, full_free_ptr, swa_free_ptr, ring_ptr, out_full_ptr, out_swa_ptr, err_ptr,
    full_epoch_ptr, swa_epoch_ptr,
    # the step stamp (pinned int64 [1]) and the seen word (kernels.stamp; unread unless STAMP)
    stamp_ptr, seen_ptr,
    # strides
    stride_r2t_row, stride_ring_row,
    # sizes
    page_size, n_full_cap, n_swa_cap, n_release_rows, n_release_lanes, n_alloc_lanes,
    n_ring_cols, n_release_chunks, n_alloc_chunks,
    # meta-parameters
    VALIDATE: tl.constexpr, STAMP: tl.constexpr, REL_BLOCK_PAGES: tl.constexpr,
    AL_BLOCK_TOKENS: tl.constexpr, AL_BLOCK_PAGES: tl.constexpr, BLOCK_PS: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    if STAMP:  # program 0 counts the step once
        record_stamp(stamp_ptr, seen_ptr, pid)
    n_release_progs = n_release_rows * n_release_chunks
    if pid < n_release_progs:
        rel_row = pid // n_release_chunks
        _release_body(rel_row, pid - rel_row * n_release_chunks, n_release_chunks,
                      rel_rows_ptr,
                      r2t_ptr, f2s_ptr, full_free_ptr, swa_free_ptr, ring_ptr, err_ptr,
                      full_epoch_ptr, swa_epoch_ptr,
                      stride_r2t_row, stride_ring_row,
                      page_size, n_full_cap, n_swa_cap, n_release_lanes, n_ring_cols,
                      VALIDATE, REL_BLOCK_PAGES, BLOCK_PS)
    else:
        q = pid - n_release_progs
        al_row = q // n_alloc_chunks
        _allocate_body(al_row, q - al_row * n_alloc_chunks, n_alloc_chunks, al_rows_ptr,
                       r2t_ptr, f2s_ptr, full_free_ptr, swa_free_ptr, ring_ptr, out_full_ptr,
                       out_swa_ptr, err_ptr,
                       stride_r2t_row, stride_ring_row,
                       page_size, n_full_cap, n_swa_cap, n_alloc_lanes, n_ring_cols,
                       VALIDATE, AL_BLOCK_TOKENS, AL_BLOCK_PAGES, BLOCK_PS)


def run_step_fused(release_rows, alloc_rows, req_to_token, full_to_swa, full_free, swa_free,
                   ring_pages, out_full_slots, out_swa_slots, err, *, page_size: int,
                   n_full_cap: int, n_swa_cap: int, n_release_lanes: int, n_alloc_lanes: int,
                   validate: bool = False, epochs=None, n_release_rows: int | None = None,
                   n_alloc_rows: int | None = None, n_release_chunks: int = 1,
                   n_alloc_chunks: int = 1, num_warps: int | None = None, stamp=None,
                   seen=None) -> None:
    """Launch one step as a single grid of ``R * n_release_chunks + A * n_alloc_chunks``
    programs over release rows ``[0, R)`` and allocation rows ``[0, A)`` (``R =
    n_release_rows``, ``A = n_alloc_rows``; None: every row of the table). Only for a step
    whose pops fit in what was free before it (``StepBuilder.fusable``); the caller
    guarantees it, nothing here can check it.

    Arguments are those of ``release_pages`` and ``allocate_tokens`` together
    (``n_release_lanes`` / ``n_alloc_lanes`` are their ``n_lanes``, the row counts and
    chunks their ``n_rows`` / ``n_chunks``, ``num_warps``, ``stamp`` and ``seen`` theirs);
    ``validate`` needs ``epochs``. Returns before the device has finished.
    """
    check_rows(release_rows, full_to_swa, "release")
    check_rows(alloc_rows, full_to_swa, "allocation")
    check_tables(req_to_token, ring_pages, err, validate, epochs, (n_full_cap, n_swa_cap))
    check_stamp(stamp, seen, full_to_swa)
    if not (out_full_slots.is_contiguous() and out_swa_slots.is_contiguous()):
        raise TensorSpecError("the output slot buffers must be contiguous")
    n_rel = launch_rows(release_rows, n_release_rows, n_release_chunks, "release")
    n_al = launch_rows(alloc_rows, n_alloc_rows, n_alloc_chunks, "allocation")
    n_progs = n_rel * n_release_chunks + n_al * n_alloc_chunks
    if n_progs == 0:
        return
    rel_meta, al_meta = release_meta(page_size), allocate_meta(page_size)
    stamp_ptr, seen_ptr, stamped = stamp_args(stamp, seen, err)
    _step_kernel[(n_progs,)](
        release_rows, alloc_rows, req_to_token, full_to_swa, full_free, swa_free, ring_pages,
        out_full_slots, out_swa_slots, err, *epoch_args(validate, epochs, err),
        stamp_ptr, seen_ptr,
        req_to_token.stride(0), ring_pages.stride(0),
        page_size, n_full_cap, n_swa_cap, n_rel, n_release_lanes, n_alloc_lanes,
        ring_pages.shape[1], n_release_chunks, n_alloc_chunks,
        VALIDATE=bool(validate), STAMP=stamped, REL_BLOCK_PAGES=rel_meta["BLOCK_PAGES"],
        AL_BLOCK_TOKENS=al_meta["BLOCK_TOKENS"], AL_BLOCK_PAGES=al_meta["BLOCK_PAGES"],
        BLOCK_PS=rel_meta["BLOCK_PS"], **warps(num_warps),
    )


def run_step_fused_torch(release_rows, alloc_rows, req_to_token, full_to_swa, full_free,
                         swa_free, ring_pages, out_full_slots, out_swa_slots, err, *,
                         page_size: int, n_full_cap: int, n_swa_cap: int, n_release_lanes: int,
                         n_alloc_lanes: int, validate: bool = False, epochs=None,
                         n_release_rows: int | None = None, n_alloc_rows: int | None = None,
                         n_release_chunks: int = 1, n_alloc_chunks: int = 1,
                         num_warps: int | None = None, stamp=None, seen=None) -> None:
    """Reference twin of :func:`run_step_fused`: the release twin, then the allocation twin
    (the order the fused launch must be indistinguishable from; the step stamp counts the
    step once, as the fused kernel's program 0 does)."""
    common = dict(page_size=page_size, n_full_cap=n_full_cap, n_swa_cap=n_swa_cap,
                  validate=validate, stamp=stamp, seen=seen)
    release_pages_torch(release_rows, req_to_token, full_to_swa, full_free, swa_free,
                        ring_pages, err, n_lanes=n_release_lanes, epochs=epochs,
                        n_rows=n_release_rows, n_chunks=n_release_chunks, **common)
    allocate_tokens_torch(alloc_rows, req_to_token, full_to_swa, full_free, swa_free,
                          ring_pages, out_full_slots, out_swa_slots, err, n_lanes=n_alloc_lanes,
                          n_rows=n_alloc_rows, n_chunks=n_alloc_chunks, **common)
