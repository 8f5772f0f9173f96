"""The numpy reference planner's allocations: handle takes, admits (plain and on a handle),
decode and extend, load-back, and the prefix cache's reclaim when an allocation is short.

Ledger of one request's positions (``ps`` page size)::

    extend (L -> L + n):        [L, ceil_page(L))      continues the partial page (no pop)
                                [ceil_page(L), L + n)  new pages, popped in order from both
                                                       rings (FULL ring only in ring mode)
    decode, lookahead k:        [L, L + 1 + k)         like an extend, but one speculative
                                                       step: C stays
    load_back (f -> f' < f):    [f', f)                FULL kept; fresh SWA pages popped and
                                                       mapped (the KV comes back from the host)
    take handle h of row r, n:  [0, n)                 FULL referenced by h too (+1 each)
                                [min(f_r, n), n)       SWA referenced by h too
    admit on handle h, n:       the new request: L = C = n, f = min(swa_start, n), the
                                same references (+1 each), its req_to_token row copied
    admit, ring mode:           one AL_RING_ADMIT row pops the request's R ring pages; it
                                allocates from the next step on (its ring is written by
                                this one: code 23, OverlapError)

Allocation rows: one per decode / extend / load-back row, take, admit on a handle and ring
admit, at most ``max_tokens_per_alloc_row`` tokens each (a load-back of ``[f', f)`` is one
row of ``f - f'`` tokens: longer is refused, code 34, and is split by the caller).

A slot of a page more than one holder references is never written: handles share whole
pages only, so the only way into a shared partial page is a trim, which the frees refuse
(:func:`graphalloc.plan.frees.trim`). Cost: O(rows + pages allocated) numpy per kind.
"""

from __future__ import annotations

import numpy as np

from ..kernels.abi import (
    AL_COPY,
    AL_FLAGS,
    AL_FULL_POP,
    AL_N_PAGES,
    AL_N_TOKENS,
    AL_OUT,
    AL_REQ,
    AL_RING_ADMIT,
    AL_START_POS,
    AL_SWA_ONLY,
    AL_SWA_POP,
    ROW_WIDTH,
)
from .context import PlanContext, first_repeat
from .frees import drop_handles
from .refusals import Kind, Refusal, RefusalCode, kind_id

__all__ = ["take", "admit", "admit_on", "extend", "load_back", "ring_admit", "reclaim"]


def _ceil_div(a, b):
    return -(-a // b)


def _copy_row(ctx: PlanContext, dst_row: int, src_row: int, n_pages: int) -> None:
    """An AL_COPY row: ``req_to_token[dst, :n_pages*ps] = req_to_token[src, same]``."""
    out = np.zeros((1, ROW_WIDTH), dtype=np.int64)
    out[0, AL_REQ] = dst_row
    out[0, AL_FULL_POP] = src_row
    out[0, AL_FLAGS] = AL_COPY
    out[0, AL_N_PAGES] = n_pages
    ctx.alloc_parts.append(out)


def _hold(ctx: PlanContext, dst_row: int, src_row: int, n_tokens: int, swa_start: int) -> None:
    """``dst_row`` takes references to ``src_row``'s pages of ``[0, n_tokens)`` (SWA:
    ``[swa_start, n_tokens)``): the host mirror, the counts, and one AL_COPY row."""
    refs, ps = ctx.refs, ctx.ps
    n_pages = n_tokens // ps
    pages = refs.page_of[src_row, :n_pages].astype(np.int64)
    refs.put("page_of", (np.full(n_pages, dst_row), np.arange(n_pages)), pages)
    refs.add("full_ref", pages, 1)
    refs.add("swa_ref", refs.swa_of[pages[swa_start // ps:]].astype(np.int64), 1)
    if n_pages:
        _copy_row(ctx, dst_row, src_row, n_pages)


def take(ctx: PlanContext, handles: np.ndarray, rows: np.ndarray, n: np.ndarray) -> None:
    """Handle ``handles[i]`` (a free one) takes references to ``rows[i]``'s first ``n[i]``
    tokens (whole pages, at most the committed length when the step began): FULL
    ``[0, n)``, SWA ``[min(frontier, n), n)``."""
    if not len(handles):
        return
    k = Kind.TAKE_HANDLE
    cfg, led, ps = ctx.config, ctx.ledger, ctx.ps
    if not ctx.window.shares:
        raise Refusal(RefusalCode.SHARING_NEEDS_POOL_MODE, k)
    n_h = led.n_handles
    out = (handles < 0) | (handles >= n_h)
    if out.any():
        raise Refusal(RefusalCode.HANDLE_NOT_HELD, k, int(handles[np.flatnonzero(out)[0]]), 0, n_h)
    held = led.h_live[handles]
    if held.any():
        raise Refusal(RefusalCode.HANDLE_HELD, k, int(handles[np.flatnonzero(held)[0]]))
    i = first_repeat(handles)
    if i >= 0:
        raise Refusal(RefusalCode.HANDLE_REPEATED, k, int(handles[i]))
    ctx.live_rows(rows, "take_handle", repeats=True)  # one row may give several handles
    if (n % ps != 0).any():
        i = int(np.flatnonzero(n % ps)[0])
        raise Refusal(RefusalCode.NOT_WHOLE_PAGES, k, int(rows[i]), int(n[i]), ps)
    limit = np.minimum(ctx.len_at_start[rows], led.committed[rows])
    bad = (n <= 0) | (n > limit)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise Refusal(RefusalCode.TAKE_PAST_COMMITTED, k, int(rows[i]), int(n[i]), int(limit[i]))
    ctx.state.take(ctx, handles, rows, n)
    for window in ctx.windows:
        window.take(handles, rows, n)
    put = ctx.journal.put
    swa_start = ctx.window.take_start(led, rows, n)
    put(led.h_live, handles, True)
    put(led.h_len, handles, n)
    put(led.h_swa_start, handles, swa_start)
    for h, r, m, s in zip(handles.tolist(), rows.tolist(), n.tolist(), swa_start.tolist(),
                          strict=True):
        _hold(ctx, cfg.max_reqs + h, r, m, s)
    ctx.written_handles[handles] = True


def admit(ctx: PlanContext, rows: np.ndarray) -> None:
    """Free rows become empty requests; in ring mode each pops its R ring pages."""
    rows = ctx.free_rows(rows, "admit")
    if not len(rows):
        return
    ctx.window.check_admit(ctx, rows)
    ctx.state.admit(ctx, rows)
    ctx.ledger.reset_rows(rows, live=True)
    ctx.admitted[rows] = True
    ctx.window.admit(ctx, rows)


def ring_admit(ctx: PlanContext, rows: np.ndarray, n_ring: int) -> None:
    """One ``AL_RING_ADMIT`` row per admitted request: it pops the request's ``n_ring`` ring
    pages (a window pool's ring policy); the request allocates from the next step on."""
    led = ctx.ledger
    out = np.zeros((len(rows), ROW_WIDTH), dtype=np.int64)
    out[:, AL_REQ] = rows
    out[:, AL_SWA_POP] = (led.swa.pop(n_ring * len(rows)) + n_ring * np.arange(len(rows))
                          ) % led.swa.capacity
    out[:, AL_FLAGS] = AL_RING_ADMIT
    out[:, AL_N_PAGES] = n_ring
    ctx.pages_allocated[1] += n_ring * len(rows)
    ctx.allocated[rows] = True
    ctx.ring_admitted[rows] = True
    ctx.alloc_parts.append(out)


def admit_on(ctx: PlanContext, rows: np.ndarray, handles: np.ndarray, n: np.ndarray) -> None:
    """Free rows become requests sharing handles' first ``n`` tokens (whole pages; -1: all):
    L = C = n, frontier ``min(swa_start, n)`` (the window below the handle's SWA start must
    be recomputed), the same references, the prefix copied into the row on the device."""
    if not len(rows):
        return
    k = Kind.ADMIT_ON
    cfg, led, ps = ctx.config, ctx.ledger, ctx.ps
    if not ctx.window.shares:
        raise Refusal(RefusalCode.SHARING_NEEDS_POOL_MODE, k)
    rows = ctx.free_rows(rows, "admit(handle=)")
    ctx.live_handles(handles, "admit(handle=)", repeats=True)  # several may share one
    h_len = led.h_len[handles]
    n = np.where(n < 0, h_len, n)
    if (n % ps != 0).any():
        i = int(np.flatnonzero(n % ps)[0])
        raise Refusal(RefusalCode.NOT_WHOLE_PAGES, k, int(handles[i]), int(n[i]), ps)
    bad = (n <= 0) | (n > h_len)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise Refusal(RefusalCode.SHARE_PAST_HANDLE, k, int(handles[i]), int(n[i]), int(h_len[i]))
    ctx.state.admit_on(ctx, rows, handles, n, h_len)
    led.reset_rows(rows, live=True)
    ctx.admitted[rows] = True
    swa_start = np.minimum(led.h_swa_start[handles], n)
    put = ctx.journal.put
    put(led.seq_len, rows, n)
    put(led.frontier, rows, ctx.window.admitted_frontier(swa_start))
    put(led.committed, rows, n)
    for r, h, m, s in zip(rows.tolist(), handles.tolist(), n.tolist(), swa_start.tolist(),
                          strict=True):
        _hold(ctx, r, cfg.max_reqs + h, m, s)
    for window in ctx.windows:
        window.admit_on(rows, handles, n)


def reclaim(ctx: PlanContext, need_full: int, need_swa: int, need_states: int = 0) -> None:
    """Drop the prefix cache's offered entries, in its order, until the pools hold
    ``need_full`` / ``need_swa`` free pages (and ``need_states`` free state slots) or the
    offer runs out: SWA by tombstoning first, then FULL (and state snapshots) by evicting.
    Each drop is its own drop call (push order). A handle the step admits on is kept until
    that admit ran (``ctx.reclaim_keep``): its prefix and snapshot are what the admit reads."""
    led = ctx.ledger
    keep = ctx.reclaim_keep
    for pool, tombstone in ((1, True), (0, False), (2, False)):
        offer = ctx.reclaim[0 if tombstone else 1]
        ring, need = ((led.swa, need_swa) if tombstone else (led.full, need_full) if pool == 0
                      else (led.states, need_states))
        while ((ring.n_free < need or (tombstone and _windows_short(ctx, need_full)))
               and ctx.reclaim_next[int(not tombstone)] < len(offer)):
            h = int(offer[ctx.reclaim_next[int(not tombstone)]])
            ctx.reclaim_next[int(not tombstone)] += 1
            if (not led.h_live[h] or ctx.written_handles[h] or ctx.dropped_handles[h]
                    or (tombstone and _no_window_pages(ctx, h)) or h in keep):
                continue  # gone, busy in this step, already tombstoned, or to be admitted on
            full0, swa0 = led.full.n_free, led.swa.n_free
            drop_handles(ctx, np.array([h], dtype=np.int64),
                         np.array([int(tombstone)], dtype=np.int64), "reclaim")
            ctx.reclaimed.append((h, tombstone, led.full.n_free - full0, led.swa.n_free - swa0))


def _windows_short(ctx: PlanContext, need_full: int) -> bool:
    """Whether a further window pool lacks pages for ``need_full`` new FULL pages."""
    return any(window.short(need_full) for window in ctx.windows)


def _no_window_pages(ctx: PlanContext, h: int) -> bool:
    """Whether handle ``h`` holds no window page in any window pool (a tombstone frees
    nothing)."""
    n = ctx.ledger.h_len[h]
    return (ctx.ledger.h_swa_start[h] >= n
            and all(window.window.h_start[h] >= n for window in ctx.windows))


def extend(ctx: PlanContext, rows: np.ndarray, n_tokens: np.ndarray, kind: str,
           speculative=None) -> None:
    """Allocate ``n_tokens[i]`` positions for ``rows[i]`` (lanes in row order). Refused
    whole when a pool is short. ``speculative`` (one flag per row, or None: none): the
    row's positions are one speculative step (a decode with lookahead); otherwise they are
    committed at once, and a row with a speculative tail is refused."""
    rows = ctx.live_rows(rows, kind)
    if not len(rows):
        return
    cfg, led, ps, k = ctx.config, ctx.ledger, ctx.ps, kind_id(kind)
    busy = ctx.allocated[rows]
    if busy.any():
        r = int(rows[np.flatnonzero(busy)[0]])
        raise Refusal(RefusalCode.RING_ADMIT_ALLOCATES if ctx.ring_admitted[r]
                      else RefusalCode.ROW_ALLOCATES_TWICE, k, r)
    spec = led.spec_steps[rows]
    is_spec = (np.zeros(len(rows), dtype=bool) if speculative is None
               else np.asarray(speculative) != 0)
    full = is_spec & (spec[:, -1] != 0)
    if full.any():
        raise Refusal(RefusalCode.SPECULATION_TOO_DEEP, k, int(rows[np.flatnonzero(full)[0]]), 0,
                      led.SPEC_DEPTH)
    tail = ~is_spec & (spec[:, 0] != 0)
    if tail.any():
        i = int(np.flatnonzero(tail)[0])
        raise Refusal(RefusalCode.SPECULATIVE_TAIL_PENDING, k, int(rows[i]), int(spec[i].sum()))
    start = led.seq_len[rows]
    end = start + n_tokens
    if (end > cfg.max_context_len).any():
        i = int(np.flatnonzero(end > cfg.max_context_len)[0])
        raise Refusal(RefusalCode.PAST_CONTEXT, k, int(rows[i]), int(end[i]), cfg.max_context_len)
    if (n_tokens > cfg.max_tokens_per_alloc_row).any():
        i = int(np.flatnonzero(n_tokens > cfg.max_tokens_per_alloc_row)[0])
        raise Refusal(RefusalCode.ROW_OVER_TOKEN_SHAPE, k, int(rows[i]), int(n_tokens[i]),
                      cfg.max_tokens_per_alloc_row)
    new_pages = _ceil_div(end, ps) - _ceil_div(start, ps)
    need_full = int(new_pages.sum())
    need_swa = ctx.window.pages_needed(need_full)
    if ((need_full > led.full.n_free or need_swa > led.swa.n_free
         or _windows_short(ctx, need_full)) and ctx.reclaim is not None):
        reclaim(ctx, need_full, need_swa)
    for pool, ring, need in ((0, led.full, need_full), (1, led.swa, need_swa)):
        if need > ring.n_free:
            raise Refusal(RefusalCode.PAGES_SHORT, k, pool, need - ring.n_free, ring.n_free)
    for window in ctx.windows:  # a page of each further window pool per new FULL page
        window.check_room(need_full, k)
    ctx.window.check_span(ctx, rows, end, k)
    depth = np.count_nonzero(spec, axis=1)  # each row's new speculative step index
    if is_spec.any():
        ctx.state.speculative(ctx, rows[is_spec], n_tokens[is_spec], depth[is_spec], kind)
    first_lane = ctx.n_tokens + np.cumsum(n_tokens) - n_tokens
    keep = n_tokens > 0
    k_rows, k_start, k_tok, k_pages, k_lane = (rows[keep], start[keep], n_tokens[keep],
                                               new_pages[keep], first_lane[keep])
    if len(k_rows):
        pages_before = np.cumsum(k_pages) - k_pages
        out = np.zeros((len(k_rows), ROW_WIDTH), dtype=np.int64)
        out[:, AL_REQ] = k_rows
        out[:, AL_START_POS] = k_start
        out[:, AL_N_TOKENS] = k_tok
        full_pop = led.full.pop(need_full) if need_full else led.full.head
        out[:, AL_FULL_POP] = (full_pop + pages_before) % led.full.capacity
        swa_pop = ctx.window.pop_columns(ctx, out, need_swa, pages_before)
        out[:, AL_OUT] = k_lane
        out[:, AL_N_PAGES] = k_pages
        ctx.alloc_parts.append(out)
        ctx.n_tokens = int(k_lane[-1] + k_tok[-1])
        if ctx.refs is not None and need_full:
            _hold_new_pages(ctx, k_rows, k_start, k_pages, full_pop, swa_pop, need_full,
                            need_swa)
        for window in ctx.windows:
            window.extend(k_rows, k_start, k_pages, full_pop, need_full)
    put = ctx.journal.put
    put(led.seq_len, rows, end)
    if is_spec.any():  # the step joins the row's speculative steps (first empty slot)
        put(led.spec_steps, (rows[is_spec], depth[is_spec]), n_tokens[is_spec])
        ctx.state.speculative_slots(ctx, rows[is_spec], n_tokens[is_spec], depth[is_spec])
    if not is_spec.all():
        put(led.committed, rows[~is_spec], end[~is_spec])
    ctx.allocated[rows] = True
    ctx.pages_allocated[0] += need_full
    ctx.pages_allocated[1] += need_swa
    ctx.results.append((rows, first_lane, n_tokens))


def _hold_new_pages(ctx, rows, start, n_pages, full_pop: int, swa_pop: int,
                    total: int, total_swa: int) -> None:
    """Mirror the pops of an extension: row ``rows[i]`` gets the next ``n_pages[i]`` pages
    of the FULL ring (and of the window pool's, ``total_swa`` of them: all or none) at page
    indices from ``ceil(start[i] / ps)``; counts 1 each."""
    refs, ps = ctx.refs, ctx.ps
    full = refs.ring_pages("full", int(full_pop), total).astype(np.int64)
    seg = np.repeat(np.arange(len(rows)), n_pages)
    k = np.arange(total) - np.repeat(np.cumsum(n_pages) - n_pages, n_pages)
    refs.put("page_of", (rows[seg], _ceil_div(start, ps)[seg] + k), full)
    refs.put("full_ref", full, 1)
    if total_swa:
        swa = refs.ring_pages("swa", int(swa_pop), total_swa).astype(np.int64)
        refs.put("swa_of", full, swa)
        refs.put("swa_ref", swa, 1)


def load_back(ctx: PlanContext, rows: np.ndarray, new_pos: np.ndarray) -> None:
    """Move each row's frontier back from f to ``new_pos``, re-pairing the FULL pages of
    ``[new_pos, f)`` with fresh SWA pages (one ``AL_SWA_ONLY`` row each; lanes are the SWA
    slots where the caller copies the KV back)."""
    if not len(rows):
        return
    k = Kind.LOAD_BACK
    cfg, led, ps = ctx.config, ctx.ledger, ctx.ps
    ctx.window.load_back_allowed()
    rows = ctx.live_rows(rows, "load_back")
    busy = ctx.allocated[rows]
    if busy.any():
        raise Refusal(RefusalCode.ROW_ALLOCATES_TWICE, k, int(rows[np.flatnonzero(busy)[0]]))
    old = led.frontier[rows]
    if (new_pos % ps != 0).any():
        i = int(np.flatnonzero(new_pos % ps)[0])
        raise Refusal(RefusalCode.FRONTIER_NOT_ALIGNED, k, int(rows[i]), int(new_pos[i]), ps)
    bad = (new_pos < 0) | (new_pos > old)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise Refusal(RefusalCode.LOAD_BACK_OUTSIDE_FRONTIER, k, int(rows[i]), int(new_pos[i]),
                      int(old[i]))
    n_pages = (old - new_pos) // ps
    seen = np.zeros(cfg.num_full_pages + 1, dtype=bool)  # pages an earlier row loads back
    for i, r in enumerate(rows.tolist()):  # pages another holder's window still maps
        pages = ctx.refs.page_of[r, new_pos[i] // ps:old[i] // ps]
        mapped = np.flatnonzero((ctx.refs.swa_of[pages] != 0) | seen[pages])
        if len(mapped):
            raise Refusal(RefusalCode.LOAD_BACK_MAPPED_PAGE, k, r, int(new_pos[i] + mapped[0] * ps))
        seen[pages] = True
    long = n_pages * ps > cfg.max_tokens_per_alloc_row
    if long.any():
        i = int(np.flatnonzero(long)[0])
        raise Refusal(RefusalCode.LOAD_BACK_OVER_TOKEN_SHAPE, k, int(rows[i]), int(n_pages[i] * ps),
                      cfg.max_tokens_per_alloc_row)
    need = int(n_pages.sum())
    if need > led.swa.n_free:
        raise Refusal(RefusalCode.PAGES_SHORT, k, 1, need - led.swa.n_free, led.swa.n_free)
    first_lane = ctx.n_tokens + np.cumsum(n_pages * ps) - n_pages * ps
    keep = n_pages > 0
    if keep.any():
        r_k, p_k, n_k, lane_k = rows[keep], new_pos[keep], n_pages[keep], first_lane[keep]
        swa_pop = led.swa.pop(need)
        before = np.cumsum(n_k) - n_k
        out = np.zeros((len(r_k), ROW_WIDTH), dtype=np.int64)
        out[:, AL_REQ] = r_k
        out[:, AL_START_POS] = p_k
        out[:, AL_N_TOKENS] = n_k * ps
        out[:, AL_SWA_POP] = (swa_pop + before) % led.swa.capacity
        out[:, AL_OUT] = lane_k
        out[:, AL_FLAGS] = AL_SWA_ONLY
        out[:, AL_N_PAGES] = n_k
        ctx.alloc_parts.append(out)
        seg = np.repeat(np.arange(len(r_k)), n_k)
        j = np.arange(need) - np.repeat(before, n_k)
        full = ctx.refs.page_of[r_k[seg], p_k[seg] // ps + j].astype(np.int64)
        swa = ctx.refs.ring_pages("swa", swa_pop, need).astype(np.int64)
        ctx.refs.put("swa_of", full, swa)
        ctx.refs.put("swa_ref", swa, 1)
        ctx.n_tokens = int(lane_k[-1] + n_k[-1] * ps)
        ctx.pages_allocated[1] += need
    ctx.journal.put(led.frontier, rows, new_pos)
    ctx.allocated[rows] = True
    ctx.results.append((rows, first_lane, n_pages * ps))
