"""The numpy reference planner: one :class:`~graphalloc.plan.step.StepArrays` in, descriptor
rows out, the ledger updated in place -- or a :class:`~graphalloc.plan.refusals.Refusal`.

This is the reference half of the planner pair (the compiled twin in
:mod:`graphalloc.plan.compiled` takes the same arrays and must give the same rows, ledger
and refusals, byte for byte; ``tests/planning`` compares them). :func:`plan_step` applies
the kinds in the step's order (:mod:`graphalloc.plan.step`) -- frees
(:mod:`~graphalloc.plan.frees`), then allocations (:mod:`~graphalloc.plan.allocation`) --
then checks the frozen step shape. Every write goes through the ledger's journal; the
caller rolls it back on a refusal. Never captured, never touches the device.

Cost: O(rows + pages freed + pages allocated) numpy calls, about 0.3-0.7 ms per step on a
CPU core (the compiled twin: a few microseconds).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..kernels.abi import ROW_WIDTH
from . import allocation, frees
from .context import PlanContext, first_repeat
from .lanes import plan_lanes
from .refusals import Kind, Refusal, RefusalCode
from .step import StepArrays

__all__ = ["plan_step", "PlanOutcome"]

_EMPTY = np.zeros(0, dtype=np.int64)
# A step whose only rows are a further window pool's carries one padded release row: the
# executors launch a step by its main rows (none would mean nothing to launch), and the
# launch of the main kernels runs the window pools' sections around them
# (graphalloc.device.window_sections). The padded row's programs exit at once.
_PADDED_ROW = np.zeros((1, ROW_WIDTH), dtype=np.int64)
_PADDED_ROW.flags.writeable = False


@dataclasses.dataclass
class PlanOutcome:
    """What a planned step produced (host values; the rows are also in the descriptor)."""

    release_rows: np.ndarray  # [R, ROW_WIDTH] int64
    alloc_rows: np.ndarray  # [A, ROW_WIDTH] int64
    n_tokens: int  # output lanes written
    pages_freed: tuple[int, int]  # FULL, SWA
    pages_allocated: tuple[int, int]
    pages_evicted: int  # SWA pages freed by frontier moves
    fusable: bool
    result_rows: np.ndarray  # allocating rows in lane order (decode, extend, load-back)
    result_first_lane: np.ndarray
    result_n_tokens: np.ndarray
    reclaimed: list  # (handle, tombstone, FULL, SWA freed) the prefix cache's offer gave up
    lanes: object = None  # the attention lanes (plan.lanes.LaneOutcome), with page tables
    state_rows: np.ndarray = None  # ST_SET / ST_COPY rows, with recurrent-state slots
    windows: tuple = ()  # per further window pool: (release rows, allocation rows)


def _drops(ctx: PlanContext, a: StepArrays) -> None:
    if not len(a.drop) and not len(a.drop_swa):
        return
    ctx.live_handles(a.drop, "drop_handle")
    ctx.live_handles(a.drop_swa, "drop_handle_swa")
    both = np.concatenate([a.drop, a.drop_swa])
    i = first_repeat(both)
    if i >= 0:
        raise Refusal(RefusalCode.HANDLE_REPEATED, Kind.DROP_HANDLE_SWA, int(both[i]))
    flags = np.concatenate([np.zeros(len(a.drop), np.int64), np.ones(len(a.drop_swa), np.int64)])
    frees.drop_handles(ctx, both, flags)


def _finish(ctx: PlanContext) -> tuple[np.ndarray, np.ndarray]:
    cfg = ctx.config
    release, alloc = ctx.release_rows(), ctx.alloc_rows()
    checks = [(0, len(release), cfg.max_release_rows), (1, ctx.n_release_pages, cfg.max_step_pages),
              (2, len(alloc), cfg.max_alloc_rows), (3, ctx.n_tokens, cfg.max_step_tokens)]
    for which, have, cap in checks[2 if ctx.oversize else 0:]:
        if have > cap:
            raise Refusal(RefusalCode.STEP_OVER_SHAPE, Kind.STEP, which, have, cap)
    if not ctx.oversize:
        for window in ctx.windows:
            window.check_shape()
    if not len(release) and not len(alloc) and any(p.release_parts for p in ctx.windows):
        release = _PADDED_ROW  # (so that every executor launches the step)
    return release, alloc


def plan_step(ctx: PlanContext, a: StepArrays) -> PlanOutcome:
    """Plan ``a`` on ``ctx`` (see the module docstring); raises :class:`Refusal` with the
    journal holding the writes made so far (the caller rolls them back)."""
    ctx.reclaim_keep = a.admit_on_handle  # (the slot pool's reclaims before admit_on)
    allocation.take(ctx, a.take_handle, a.take_row, a.take_tokens)
    frees.release(ctx, a.release)
    frees.commit(ctx, a.commit_row, a.commit_n)
    frees.trim(ctx, a.trim_row, a.trim_len)
    if a.evict_all or len(a.evict):
        frees.evict(ctx, a.evict, bool(a.evict_all))
    frees.advance(ctx, a.advance_row, a.advance_pos)
    _drops(ctx, a)
    allocation.admit(ctx, a.admit)
    allocation.admit_on(ctx, a.admit_on_row, a.admit_on_handle, a.admit_on_tokens)
    ctx.reclaim_keep = ctx.reclaim_keep[:0]
    allocation.extend(ctx, a.decode, a.decode_n, "decode", speculative=a.decode_spec)
    allocation.extend(ctx, a.extend_row, a.extend_n, "extend")
    allocation.load_back(ctx, a.load_row, a.load_pos)
    release, alloc = _finish(ctx)
    lanes = None
    if ctx.tables is not None:  # the batch: decode rows, then extend rows with new tokens
        keep = a.extend_n > 0
        lanes = plan_lanes(ctx, ctx.tables, np.concatenate([a.decode, a.extend_row[keep]]),
                           np.concatenate([a.decode_n, a.extend_n[keep]]))
    results = ctx.results
    if results:
        rows = np.concatenate([r[0] for r in results])
        first = np.concatenate([r[1] for r in results])
        n_tok = np.concatenate([r[2] for r in results])
    else:
        rows = first = n_tok = _EMPTY
    return PlanOutcome(release, alloc, ctx.n_tokens, tuple(ctx.pages_freed),
                       tuple(ctx.pages_allocated), ctx.pages_evicted, ctx.fusable, rows, first,
                       n_tok, ctx.reclaimed, lanes,
                       ctx.state.finish(ctx), tuple(window.rows() for window in ctx.windows))
