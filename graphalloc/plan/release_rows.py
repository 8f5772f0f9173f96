"""Release rows: how the planner turns freed pages into descriptor rows.

:func:`add_release` writes rows for segments of one request (split every
``max_pages_per_row`` pages), with their page lanes (an exclusive prefix sum) and absolute
free-ring push positions; :func:`drop` drops references through the page mirror
(:func:`graphalloc.state.references.drop_actions`) and emits the freed pages in push order
(:func:`emit`: consecutive pages of one row with one action are one segment). Rows carry
absolute positions, so they may be split over consecutive steps
(:func:`split_release_rows`). Used by every kind that frees and by the pools' rules.
Cost: O(rows + pages freed) numpy.
"""

from __future__ import annotations

import numpy as np

from ..kernels.abi import (
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
    ROW_WIDTH,
)
from ..state.references import ACT_BOTH, ACT_FULL, ACT_SWA, drop_actions

__all__ = ["add_release", "emit", "drop", "renumber_lanes", "split_release_rows"]


def _ceil_div(a, b):
    return -(-a // b)


def renumber_lanes(release_rows: np.ndarray) -> np.ndarray:
    """Release rows with ``REL_LANE`` made the exclusive prefix sum of their pages (in
    place), as a step's release rows must be."""
    if len(release_rows):
        pages = release_rows[:, REL_N_PAGES]
        release_rows[:, REL_LANE] = np.cumsum(pages) - pages
    return release_rows


def split_release_rows(rows: np.ndarray, max_rows: int, max_pages: int) -> list[np.ndarray]:
    """Cut release rows, in order, into parts of at most ``max_rows`` rows and ``max_pages``
    pages each (lanes renumbered per part). Every row carries absolute push positions, so
    running the parts as consecutive steps pushes the same pages to the same positions as
    one step would. One row never exceeds ``max_pages`` (the config guarantees it)."""
    parts, start = [], 0
    pages = rows[:, REL_N_PAGES]
    while start < len(rows):
        ends = start + np.flatnonzero(np.cumsum(pages[start:start + max_rows]) <= max_pages)
        stop = int(ends[-1]) + 1 if len(ends) else start + 1
        parts.append(renumber_lanes(rows[start:stop].copy()))
        start = stop
    return parts


def add_release(ctx, rows, start_pos, n_pages, flags) -> None:
    """Release rows for segments (split every ``max_pages_per_row`` pages), lanes and push
    positions assigned in row order. ``flags``: one int, or one per row."""
    flags = np.broadcast_to(np.asarray(flags, dtype=np.int64), np.shape(rows))
    keep = n_pages > 0
    if not keep.all():
        if not keep.any():
            return
        rows, start_pos, n_pages, flags = rows[keep], start_pos[keep], n_pages[keep], flags[keep]
    cap = ctx.config.max_pages_per_row
    if n_pages.max() > cap:  # split long segments into rows of at most cap pages
        n_chunks = _ceil_div(n_pages, cap)
        seg = np.repeat(np.arange(len(rows)), n_chunks)
        chunk = np.arange(len(seg)) - np.repeat(np.cumsum(n_chunks) - n_chunks, n_chunks)
        rows, n_pages, flags = rows[seg], np.minimum(cap, n_pages[seg] - chunk * cap), flags[seg]
        start_pos = start_pos[seg] + chunk * cap * ctx.ps  # ring rows: column = pos // ps
    out = np.empty((len(rows), ROW_WIDTH), dtype=np.int64)
    out[:, REL_REQ] = rows
    out[:, REL_START_POS] = start_pos
    out[:, REL_N_PAGES] = n_pages
    out[:, REL_FLAGS] = flags
    ends = np.cumsum(n_pages)
    out[:, REL_LANE] = ends - n_pages + ctx.n_release_pages
    ctx.n_release_pages += int(ends[-1])
    led = ctx.ledger
    for pool, ring, col, mask in (
            (1, led.swa, REL_SWA_PUSH, (flags & (REL_SWA | REL_RING_RETURN)) != 0),
            (0, led.full, REL_FULL_PUSH, (flags & REL_FULL) != 0)):
        pushed = np.where(mask, n_pages, 0)
        ends = np.cumsum(pushed)
        total = int(ends[-1])
        start = ring.push(total) if total else ring.tail
        out[:, col] = np.where(mask, (start + ends - pushed) % ring.capacity, 0)
        ctx.pages_freed[pool] += total
    out[:, REL_EPOCH] = ctx.epoch
    ctx.release_parts.append(out)


def emit(ctx, r: np.ndarray, k: np.ndarray, action: np.ndarray) -> int:
    """Release rows for freed pages ``(row, page index, action)`` in push order: consecutive
    pages of one row with one action are one segment. Updates the host mirror (rings,
    mapping). Returns the SWA pages freed."""
    if not len(r):
        return 0
    refs, led, ps = ctx.refs, ctx.ledger, ctx.ps
    brk = np.ones(len(r), dtype=bool)
    brk[1:] = (r[1:] != r[:-1]) | (action[1:] != action[:-1]) | (k[1:] != k[:-1] + 1)
    starts = np.flatnonzero(brk)
    n_pages = np.diff(np.append(starts, len(r)))
    act = action[starts]
    flags = np.where(act == ACT_FULL, REL_FULL,
                     np.where(act == ACT_BOTH, REL_SWA | REL_FULL | REL_CLEAR,
                              REL_SWA | REL_CLEAR))
    pages = refs.page_of[r, k].astype(np.int64)
    full_pages = pages[action != ACT_SWA]
    swa_pages = refs.swa_of[pages[action != ACT_FULL]].astype(np.int64)
    full_tail, swa_tail = led.full.tail, led.swa.tail
    add_release(ctx, r[starts], k[starts] * ps, n_pages, flags)
    refs.put("full_ring", (full_tail + np.arange(len(full_pages))) % led.full.capacity,
             full_pages)
    refs.put("swa_ring", (swa_tail + np.arange(len(swa_pages))) % led.swa.capacity, swa_pages)
    refs.put("swa_of", pages[action != ACT_FULL], 0)
    return len(swa_pages)


def drop(ctx, rows, full_lo, full_hi, swa_lo, swa_hi) -> int:
    """Rows ``rows`` drop their FULL references of page indices ``[full_lo, full_hi)`` and
    window references of ``[swa_lo, swa_hi)``; the pages that frees are emitted as release
    rows. Returns the window pages freed."""
    return emit(ctx, *drop_actions(ctx.refs, rows, full_lo, full_hi, swa_lo, swa_hi))
