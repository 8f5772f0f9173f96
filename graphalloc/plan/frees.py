"""The numpy reference planner's frees: release, commit, trim, window eviction, frontier
advances and handle drops, turned into release rows.

Ledger of one request's positions (``ps`` page size, ``[a, b)`` half-open)::

    release (len L, frontier f):   [0, f)              FULL references dropped
                                   [f, ceil_page(L))   FULL and SWA references dropped
                                   ring mode:          FULL freed; the R ring pages return
    evict / advance (f -> f'):     [f, f')             SWA references dropped, FULL kept
                                                       (ring mode: mapping cleared only)
    trim (L -> L' <= L):           [ceil_page(L'), ceil_page(L))
                                                       FULL and SWA references dropped; the
                                                       partial page of L' stays, continued
    commit (C, oldest speculative step s, the next s2; n accepted):
                                   [0, C + n)          committed (C' = C + n, n <= s)
                                   [C', C' + s2)       kept: the step still in flight
                                   past C' + s2        a trim to L' = C' + s2
    drop handle h (n, swa_start):  FULL [0, n), SWA [swa_start, n) references dropped
    drop_swa h:                    SWA [swa_start, n) dropped; swa_start becomes n

A model's further window pools (``ctx.windows``) drop their own references in the same
kinds (release, cut, their own rule at evict, handle drops; a tombstone drops every window
pool's), each into its own release section; ``advance`` moves the first pool only
(:mod:`graphalloc.pools.extra_window`).

A page goes back to its free ring in the step where its last reference is dropped, in the
order of :func:`graphalloc.state.references.drop_actions` (one call per kind); every
release row carries absolute free-ring push positions, so rows may be split over
consecutive steps (:func:`split_release_rows`). The window rule and every frontier move use
the committed length C (``floor_page(C)`` caps the frontier), so a rollback never needs an
evicted SWA page. Cost: O(rows + pages freed) numpy per kind.
"""

from __future__ import annotations

import numpy as np

from .context import PlanContext
from .refusals import Kind, Refusal, RefusalCode, kind_id
from .release_rows import drop, renumber_lanes, split_release_rows

__all__ = ["release", "commit", "trim", "evict", "advance", "drop_handles", "window_frontier",
           "renumber_lanes", "split_release_rows", "shared_end"]


def _ceil_div(a, b):
    return -(-a // b)


def release(ctx: PlanContext, rows: np.ndarray) -> None:
    """Free everything the requests hold and return their rows."""
    rows = ctx.live_rows(rows, "release")
    if not len(rows):
        return
    led, ps = ctx.ledger, ctx.ps
    end_page = _ceil_div(led.seq_len[rows], ps)
    ctx.window.release(ctx, rows, led.frontier[rows], end_page)
    for window in ctx.windows:
        window.release(rows, end_page)
    ctx.state.release(ctx, rows)
    led.reset_rows(rows, live=False)
    ctx.released[rows] = True


def shared_end(ctx: PlanContext, row: int) -> int:
    """Positions ``[0, shared_end)`` of ``row`` lie in pages another holder references
    (pool mode; sharing is by prefix, so the shared pages come first)."""
    refs, ps = ctx.refs, ctx.ps
    n_pages = -(-int(ctx.ledger.seq_len[row]) // ps)
    counts = refs.full_ref[refs.page_of[row, :n_pages]]
    alone = np.flatnonzero(counts <= 1)
    return (int(alone[0]) if len(alone) else n_pages) * ps


def _cut(ctx: PlanContext, rows: np.ndarray, new_len: np.ndarray) -> None:
    """Set the rows' lengths to ``new_len`` (<= L), dropping their references to the pages
    wholly past it (ring mode frees the FULL pages and clears their mapping; the ring
    stays). Marks the rows ``cut`` (not fusable with their own allocation)."""
    led, ps = ctx.ledger, ctx.ps
    lo, hi = _ceil_div(new_len, ps), _ceil_div(led.seq_len[rows], ps)
    ctx.window.cut(ctx, rows, lo, hi)
    for window in ctx.windows:
        window.cut(rows, lo, hi)
    ctx.journal.put(led.seq_len, rows, new_len)
    ctx.cut[rows] |= hi > lo


def commit(ctx: PlanContext, rows: np.ndarray, n: np.ndarray) -> None:
    """Resolve each row's oldest speculative step (size s): keep ``n[i] <= s`` of its tokens
    and the next step still in flight (s2), trim the rest: C' = C + n, L' = C' + s2."""
    rows = ctx.live_rows(rows, "commit")
    if not len(rows):
        return
    led, k = ctx.ledger, Kind.COMMIT
    oldest = led.spec_steps[rows, 0]
    if (oldest == 0).any():
        raise Refusal(RefusalCode.NO_SPECULATIVE_STEP, k, int(rows[np.flatnonzero(oldest == 0)[0]]))
    if (n > oldest).any():
        i = int(np.flatnonzero(n > oldest)[0])
        raise Refusal(RefusalCode.ACCEPTED_PAST_STEP, k, int(rows[i]), int(n[i]), int(oldest[i]))
    committed = led.committed[rows] + n
    later = led.spec_steps[rows, 1:]
    _cut(ctx, rows, committed + later.sum(axis=1))
    ctx.state.commit(ctx, rows, n, oldest)
    put = ctx.journal.put
    put(led.committed, rows, committed)
    shifted = np.zeros((len(rows), led.SPEC_DEPTH), dtype=np.int64)
    shifted[:, :-1] = later
    put(led.spec_steps, rows, shifted)


def trim(ctx: PlanContext, rows: np.ndarray, new_len: np.ndarray) -> None:
    """Cut each row to ``new_len[i]`` tokens (the general rollback): pages wholly past it
    lose this row's references; C' = min(C, L'); the speculative steps are cut at L'.
    Refused above L, below ``f + W`` once the frontier f has moved, and inside a page
    another holder references (code 18: a shared page is never written)."""
    rows = ctx.live_rows(rows, "trim")
    if not len(rows):
        return
    led, k = ctx.ledger, Kind.TRIM
    length = led.seq_len[rows]
    if (new_len < 0).any():
        i = int(np.flatnonzero(new_len < 0)[0])
        raise Refusal(RefusalCode.NEGATIVE_LENGTH, k, int(rows[i]), int(new_len[i]))
    if (new_len > length).any():
        i = int(np.flatnonzero(new_len > length)[0])
        raise Refusal(RefusalCode.TRIM_LENGTHENS, k, int(rows[i]), int(new_len[i]), int(length[i]))
    ctx.window.check_trim(ctx, rows, new_len)
    for window in ctx.windows:
        window.check_trim(rows, new_len)
    if ctx.refs is not None:
        inside = np.flatnonzero(new_len % ctx.ps != 0)
        for i in inside:  # a partial page the next allocation would continue
            end = shared_end(ctx, int(rows[i]))
            if new_len[i] < end:
                raise Refusal(RefusalCode.TRIM_INSIDE_SHARED_PAGE, k, int(rows[i]), int(new_len[i]),
                              end)
    ctx.state.trim(ctx, rows, new_len)
    _cut(ctx, rows, new_len)
    committed = led.committed[rows]
    keep = new_len - committed  # speculative tokens kept, cut step by step (oldest first)
    steps = led.spec_steps[rows]
    before = np.cumsum(steps, axis=1) - steps
    kept = np.clip(keep[:, None] - before, 0, steps)
    ctx.state.trim_slots(ctx, rows, kept)
    put = ctx.journal.put
    put(led.spec_steps, rows, kept)
    put(led.committed, rows, np.minimum(committed, new_len))


def window_frontier(ctx: PlanContext, rows: np.ndarray) -> np.ndarray:
    """The window pool's rule (:meth:`graphalloc.pools.window.WindowPool.targets`) on the
    lengths when the step began and C after the step's commits and trims."""
    return ctx.window.targets(ctx.ledger, rows, ctx.len_at_start)


def advance(ctx: PlanContext, rows: np.ndarray, new_pos: np.ndarray, kind: str = "advance",
            checked: bool = False) -> None:
    """Free the SWA pages of ``[frontier, new_pos)`` (page-aligned, forward only, within
    the whole committed pages that existed when the step began)."""
    if not checked:
        rows = ctx.live_rows(rows, kind)
    if not len(rows):
        return
    led, ps, k = ctx.ledger, ctx.ps, kind_id(kind)
    old = led.frontier[rows]
    limit = np.minimum(ctx.len_at_start[rows], led.committed[rows]) // ps * ps
    if (new_pos % ps != 0).any():
        i = int(np.flatnonzero(new_pos % ps)[0])
        raise Refusal(RefusalCode.FRONTIER_NOT_ALIGNED, k, int(rows[i]), int(new_pos[i]), ps)
    if (new_pos < old).any():
        i = int(np.flatnonzero(new_pos < old)[0])
        raise Refusal(RefusalCode.FRONTIER_BACKWARDS, k, int(rows[i]), int(new_pos[i]), int(old[i]))
    if (new_pos > limit).any():
        i = int(np.flatnonzero(new_pos > limit)[0])
        raise Refusal(RefusalCode.FRONTIER_PAST_COMMITTED, k, int(rows[i]), int(new_pos[i]),
                      int(limit[i]))
    moved = new_pos > old
    if moved.any():
        ctx.window.moves_allowed(k)  # (a model without window layers has no frontier to move)
    if not moved.all():
        rows, old, new_pos = rows[moved], old[moved], new_pos[moved]
        if not len(rows):
            return
    n_freed = ctx.window.advance(ctx, rows, old, new_pos)
    ctx.journal.put(led.frontier, rows, new_pos)
    ctx.pages_evicted += n_freed


def evict(ctx: PlanContext, rows: np.ndarray, evict_all: bool) -> None:
    """Advance frontiers by the window rule: ``rows``, or every live row (``evict_all``:
    not released in this step, not in an open free group). Rows named with ``evict_all``
    are checked as without it (codes 1, 2), then evicted with every other."""
    if len(rows):
        rows = ctx.live_rows(rows, "evict")
    if evict_all:
        live = ctx.ledger.live.copy()
        if ctx.excluded_rows is not None:
            live &= ~ctx.excluded_rows
        rows = np.flatnonzero(live)
    advance(ctx, rows, window_frontier(ctx, rows), "evict", checked=True)
    for window in ctx.windows:  # each further window pool by its own rule
        window.evict(rows)


def drop_handles(ctx: PlanContext, handles: np.ndarray, swa_only: np.ndarray,
                 kind: str = "drop_handle") -> None:
    """Drop handles' references, as one drop call in the given order: every reference
    (``swa_only[i] == 0``) or only the SWA ones (a tombstone: SWA start becomes n)."""
    if not len(handles):
        return
    led, ps = ctx.ledger, ctx.ps
    rows = ctx.config.max_reqs + handles
    n_pages = led.h_len[handles] // ps
    swa_lo = led.h_swa_start[handles] // ps
    zero = np.zeros(len(handles), dtype=np.int64)
    drop(ctx, rows, zero, np.where(swa_only != 0, 0, n_pages), swa_lo, n_pages)
    for window in ctx.windows:  # a tombstone drops every window pool's references
        window.drop_handles(handles, swa_only)
    ctx.state.drop(ctx, handles, swa_only)
    put = ctx.journal.put
    tomb, whole = handles[swa_only != 0], handles[swa_only == 0]
    put(led.h_swa_start, tomb, led.h_len[tomb])
    put(led.h_live, whole, False)
    put(led.h_len, whole, 0)
    put(led.h_swa_start, whole, 0)
    ctx.dropped_handles[whole] = True
