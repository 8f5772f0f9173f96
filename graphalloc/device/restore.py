"""Device tables written again from the host ledger: a failed launch undone, a fault recovered.

The host ledger is the allocator's truth and the device tables are its projection, so the
way back from any divergence is to project again. Two callers:

``undo_launch``   a step (or a split free's parts) whose launch raised after part of its
                  device work was enqueued. The host ledger has been rolled back first; this
                  enqueues, on the current stream and so behind whatever the failed launch
                  enqueued, the writes that make every table the allocator defines equal to
                  the rolled-back ledger, and takes the step's stamps off the device count.
``recover``       after a device fault or a ``SubmissionError``: the device waited for,
                  every table projected, the fault and step words cleared, then audited.

What a step can have written, and where the value before it comes from::

    table           written by                    value before the step
    full_to_swa     allocation (new pages),       pool mode: the page mirror (swa_of);
                    release (clears), load-back   ring mode: derived on the device from
                                                  req_to_token + ring_pages of live rows
    req_to_token    allocation at [s, s + n)      pool mode: the page mirror (page_of) for
                    of its row                    the rows the step allocated to; ring mode:
                                                  the FULL pages this step's own release rows
                                                  pushed (a row cut and grown in one step)
    ring_pages      ring admit of a row           the SWA pages this step's release rows
                    (released in the step)        returned (ring mode)
    free rings      pushes past the tail          nothing: the free window [head, head +
                                                  n_free) of the rolled-back ledger is never
                                                  written by a step
    state table     ST_SET / ST_SPEC rows         the host's slots
    state tensors   copies into popped slots      nothing for a slot free when the step
                                                  began (free again after the rollback,
                                                  contents unspecified); a slot the step
                                                  freed and copies into (the pool was
                                                  short) is saved on the device before the
                                                  launch (``save_held_destinations``)
    further window  their sections (as the       their page mirrors (WindowLedger.swa_of;
    pools' tables   main pool's, pool mode)       free rings by recover() only)
    epoch tables    validate mode's stamps        zeroed (scratch: 0 never equals an epoch)
    outputs, page   the step's slots and tables   not restored: earlier results are made
    tables                                        stale, the next step rewrites the tables

Ring mode keeps no host copy of page ids, so its req_to_token and ring_pages are restored
from the pages the step's own release rows pushed, read back from the free rings on the
device; that is exact when the release launch returned (the allocation launch, which is
what overwrites them, runs only after it), which ``released`` says.

Cost: off the fast path. ``undo_launch``: O(full_to_swa + rows allocated x context) device
writes, a few host-to-device copies; ``recover``: one device synchronisation and every
table written once.
"""

from __future__ import annotations

import numpy as np
import torch

from ..diagnostics.sync_points import sync_allowed
from ..kernels.abi import (
    AL_N_PAGES,
    AL_N_TOKENS,
    AL_REQ,
    REL_FLAGS,
    REL_FULL,
    REL_FULL_PUSH,
    REL_N_PAGES,
    REL_REQ,
    REL_RING_RETURN,
    REL_START_POS,
    REL_SWA_PUSH,
    SEEN_COUNT,
    SEEN_MAX,
)
from ..parts import DeviceParts
from .layout import ALLOCATION, RELEASE

__all__ = ["undo_launch", "project_all", "uncount_stamps", "save_held_destinations"]


def _dev(parts: DeviceParts, arr) -> torch.Tensor:
    return torch.as_tensor(np.ascontiguousarray(arr)).to(parts.config.device)


# ---- one table at a time ---------------------------------------------------------------------
def _holder_lens(parts: DeviceParts, rows: np.ndarray) -> np.ndarray:
    """Tokens each holder row holds (request rows, then handle rows; 0 when not held)."""
    led, n_req = parts.ledger, parts.config.max_reqs
    lens = np.zeros(len(rows), dtype=np.int64)
    req = rows < n_req
    lens[req] = np.where(led.live[rows[req]], led.seq_len[rows[req]], 0)
    h = rows[~req] - n_req
    lens[~req] = np.where(led.h_live[h], led.h_len[h], 0)
    return lens


def project_token_rows(parts: DeviceParts, rows) -> None:
    """Pool mode: ``req_to_token[row, :L]`` of each holder row from the page mirror (entries
    past L are left as they are)."""
    cfg, refs, ps = parts.config, parts.ledger.refs, parts.config.page_size
    rows = np.unique(np.asarray(rows, dtype=np.int64))
    lens = _holder_lens(parts, rows)
    rows, lens = rows[lens > 0], lens[lens > 0]
    if not len(rows):
        return
    width = int(lens.max())
    pos = np.arange(width)
    pages = refs.page_of[rows][:, pos // ps].astype(np.int64)
    values = pages * ps + pos % ps
    keep = pos[None, :] < lens[:, None]
    table = parts.state.req_to_token_buf
    index = _dev(parts, rows)
    current = table[index, :width]
    new = torch.where(_dev(parts, keep), _dev(parts, values).to(table.dtype), current)
    table[index, :width] = new
    del cfg


def project_mapping(parts: DeviceParts) -> None:
    """``full_to_swa`` whole: pool mode from the page mirror; ring mode derived on the device
    from the live rows' req_to_token and ring_pages (the window's pages ``[f, L)`` are mapped
    to their ring page, every other entry is 0)."""
    cfg, led, ps = parts.config, parts.ledger, parts.config.page_size
    table = parts.state.full_to_swa_buf
    if not cfg.ring_mode:
        _project_page_mirror(parts, table, led.refs.swa_of)
        return
    rows = np.flatnonzero(led.live)
    lo, hi = led.frontier[rows] // ps, -(-led.seq_len[rows] // ps)
    n = np.maximum(hi - lo, 0)
    seg = np.repeat(np.arange(len(rows)), n)
    k = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n) + lo[seg]
    r = rows[seg]
    table.zero_()
    if not len(r):
        return
    st = parts.state
    r_t, k_t = _dev(parts, r), _dev(parts, k)
    full = st.req_to_token_buf[r_t, k_t * ps] // ps
    swa = st.ring_pages_buf[r_t, k_t % cfg.swa_ring_pages].to(table.dtype)
    off = torch.arange(ps, device=table.device, dtype=table.dtype)
    table[(full[:, None] * ps + off).reshape(-1)] = (swa[:, None] * ps + off).reshape(-1)


def _project_page_mirror(parts: DeviceParts, table: torch.Tensor, swa_of: np.ndarray) -> None:
    """A page-dense ``full_to_swa`` table written whole from its page mirror (``swa_of``:
    the window page paired with each FULL page, 0 for none)."""
    ps = parts.config.page_size
    swa = swa_of.astype(np.int64)[:, None]
    values = np.where(swa > 0, swa * ps + np.arange(ps), 0).reshape(-1)
    table.copy_(_dev(parts, values).to(table.dtype))


def project_windows(parts: DeviceParts, rings: bool) -> None:
    """A model's further window pools (pool mode only): each pool's ``full_to_swa`` from its
    page mirror (``WindowLedger.swa_of``), its epoch table zeroed and, with ``rings``, its
    free ring from the ring mirror (a failed step never writes a free window, so an undo
    needs no rings)."""
    for window, tables in zip(parts.ledger.windows, parts.state.windows, strict=True):
        _project_page_mirror(parts, tables.full_to_swa_buf, window.swa_of)
        tables.swa_epoch_buf.zero_()
        if rings:
            buf = tables.swa_free_buf
            buf[:-1].copy_(_dev(parts, window.swa_ring.astype(np.int64)).to(buf.dtype))


def project_free_rings(parts: DeviceParts) -> None:
    """Pool mode: both free rings from the mirror (every position)."""
    refs, st = parts.ledger.refs, parts.state
    for buf, mirror in ((st.full_free_buf, refs.full_ring), (st.swa_free_buf, refs.swa_ring)):
        buf[:-1].copy_(_dev(parts, mirror.astype(np.int64)).to(buf.dtype))


def project_states(parts: DeviceParts) -> None:
    """The state table's defined entries from the host: every request's and handle's slot,
    and each request's newest speculative step in flight (``spec_state[r, :k]``; the rest of
    the speculative part is unspecified and left as it is)."""
    cfg, led = parts.config, parts.ledger
    if not cfg.num_state_slots:
        return
    table = parts.state.state_table_buf
    n = cfg.max_reqs + cfg.max_handles
    index, values = [np.arange(n)], [led.state_slot]
    depth = np.count_nonzero(led.spec_steps, axis=1)
    for r in np.flatnonzero(depth):
        newest = led.spec_state[r, depth[r] - 1]
        k = int(np.count_nonzero(newest))
        index.append(n + r * cfg.max_spec_tokens + np.arange(k))
        values.append(newest[:k])
    table[_dev(parts, np.concatenate(index))] = _dev(parts, np.concatenate(values)).to(
        table.dtype)


def _restore_from_pushes(parts: DeviceParts, release_rows: np.ndarray) -> None:
    """Ring mode: the rows this step cut and grew again (req_to_token) or released and
    admitted again (ring_pages) get back, from the free rings, the pages the step's release
    rows pushed (exact once the release launch returned). Only rows live after the
    rollback."""
    cfg, led, st, ps = parts.config, parts.ledger, parts.state, parts.config.page_size
    rows = release_rows[release_rows[:, REL_N_PAGES] > 0]
    rows = rows[led.live[rows[:, REL_REQ]]]
    for row in rows:
        r, s, n, flags = (int(row[c]) for c in (REL_REQ, REL_START_POS, REL_N_PAGES,
                                                 REL_FLAGS))
        if flags & REL_FULL:
            at = (int(row[REL_FULL_PUSH]) + np.arange(n)) % cfg.num_full_pages
            pages = st.full_free_buf[_dev(parts, at)]
            off = torch.arange(ps, device=pages.device, dtype=pages.dtype)
            slots = (pages[:, None] * ps + off).reshape(-1)
            end = min(s + n * ps, cfg.max_context_len)
            st.req_to_token_buf[r, s:end] = slots[:end - s]
        if flags & REL_RING_RETURN:
            at = (int(row[REL_SWA_PUSH]) + np.arange(n)) % cfg.num_swa_pages
            q0 = s // ps
            st.ring_pages_buf[r, q0:q0 + n] = st.swa_free_buf[_dev(parts, at)]


# ---- the stamp count -------------------------------------------------------------------------
def uncount_stamps(parts: DeviceParts, first_stamp: int) -> None:
    """Take the steps stamped ``first_stamp, first_stamp + 1, ...`` (consecutive plans, run
    in stream order, the last possibly not at all) off the device's step count, on the
    stream: ``count -= max(seen_max - first + 1, 0)``, ``seen_max = min(seen_max, first -
    1)``. No host read."""
    if first_stamp <= 0:
        return
    seen = parts.state.seen_buf
    top = seen[SEEN_MAX]
    counted = torch.clamp(top - (first_stamp - 1), min=0)
    seen[SEEN_COUNT] -= counted
    seen[SEEN_MAX] = torch.clamp(top, max=first_stamp - 1)


# ---- state slots a copy overwrites ------------------------------------------------------------
def save_held_destinations(parts: DeviceParts, copies, ring_before) -> list | None:
    """The state copies' destinations that were HELD when the step began (slots the step
    freed and popped again because the pool was short: a released request's, a dropped
    handle's, a speculative step's), saved on the device before the step's launch: per
    state tensor, ``(tensor, slot_dim, index, saved contents)``; None when there are none
    (the usual case: every destination was free when the step began). ``copies``: the
    step's ``[n, 2]`` (source, destination) slots; ``ring_before``: the state free ring's
    ``(head, n_free)`` before the plan. The slots popped past the ring's free window are
    exactly the ones the step pushed first, at ``[head + n_free, head + pops)``. Cost: O(1)
    unless a destination was held; then one gather per state tensor."""
    tensors = parts.kernels.copy_tensors
    if copies is None or not len(copies) or not tensors:
        return None
    led = parts.ledger
    cap, (head0, free0) = led.states.capacity, ring_before
    pops = (led.states.head - head0) % cap or cap  # copies pop, so 0 means a full turn
    if pops <= free0:
        return None
    pushed = led.state_ring[(head0 + free0 + np.arange(pops - free0)) % cap]
    held = np.intersect1d(copies[:, 1], pushed)
    if not len(held):
        return None
    with sync_allowed():  # rare: the pool was short in a step that copies
        out = []
        for t, dim in tensors:
            index = _dev(parts, held).to(t.device)
            out.append((t, dim, index, t.index_select(dim, index)))
    return out


def _restore_saved(saved) -> None:
    for t, dim, index, contents in saved or ():
        t.index_copy_(dim, index, contents)


# ---- the two callers -------------------------------------------------------------------------
def undo_launch(parts: DeviceParts, buffers: list[int], first_stamp: int, released: bool,
                saved=None) -> None:
    """After the host rollback: make the device tables equal to the ledger again, behind
    whatever the failed launch enqueued (see the module docstring). ``buffers``: the
    descriptor buffers the launches read (the failed step's, or every part of a split
    free); ``first_stamp``: the first of their stamps (0: none); ``released``: the last
    buffer's release launch returned (ring mode's restore needs it); ``saved``: what
    :func:`save_held_destinations` saved, written back."""
    cfg, ring = parts.config, parts.ring
    with sync_allowed():  # the failure path may copy from pageable host memory
        last, layout = buffers[-1], ring.layout
        n_rel, n_al = ring.used[last]
        al_rows = ring.np_bufs[last][layout.rows(ALLOCATION, n_al)]
        grows = al_rows[(al_rows[:, AL_N_TOKENS] > 0) | (al_rows[:, AL_N_PAGES] > 0), AL_REQ]
        if cfg.ring_mode:
            if released and len(grows):
                _restore_from_pushes(parts, ring.np_bufs[last][layout.rows(RELEASE, n_rel)].copy())
        else:
            project_token_rows(parts, grows)
        project_mapping(parts)
        project_windows(parts, rings=False)
        project_states(parts)
        parts.state.full_epoch_buf.zero_()
        parts.state.swa_epoch_buf.zero_()
        uncount_stamps(parts, first_stamp)
        _restore_saved(saved)


def project_all(parts: DeviceParts) -> None:
    """Every table the allocator defines, from the host ledger (pool mode: all of them;
    ring mode, which keeps no host copy of page ids: req_to_token and ring_pages are kept,
    full_to_swa is derived from them and the free windows are refilled with the pages no
    live row holds, ascending). Zeroes the validate-mode epoch tables."""
    cfg, led, st = parts.config, parts.ledger, parts.state
    if cfg.ring_mode:
        _refill_ring_mode_windows(parts)
    else:
        project_token_rows(parts, np.arange(cfg.max_reqs + led.n_handles))
        project_free_rings(parts)
    project_mapping(parts)
    project_windows(parts, rings=True)
    project_states(parts)
    st.full_epoch_buf.zero_()
    st.swa_epoch_buf.zero_()


def _refill_ring_mode_windows(parts: DeviceParts) -> None:
    cfg, led, st, ps = parts.config, parts.ledger, parts.state, parts.config.page_size
    rows = np.flatnonzero(led.live)
    r2t = st.req_to_token_buf[:cfg.max_reqs].cpu().numpy()  # sync ok: recover()
    ring_pages = st.ring_pages_buf[:cfg.max_reqs].cpu().numpy()  # sync ok: recover()
    full_owned = [r2t[r, np.arange(-(-int(led.seq_len[r]) // ps)) * ps] // ps for r in rows]
    swa_owned = [ring_pages[r, :cfg.swa_ring_pages] for r in rows]
    for buf, ring, n_pages, owned in ((st.full_free_buf, led.full, cfg.num_full_pages,
                                       full_owned),
                                      (st.swa_free_buf, led.swa, cfg.num_swa_pages, swa_owned)):
        held = np.zeros(n_pages + 1, dtype=bool)
        for pages in owned:
            held[np.clip(pages, 0, n_pages)] = True
        free = np.flatnonzero(~held[1:]) + 1
        if len(free) != ring.n_free:
            continue  # the audit that follows names the conservation failure
        at = (ring.head + np.arange(len(free))) % n_pages
        buf[_dev(parts, at)] = _dev(parts, free).to(buf.dtype)
