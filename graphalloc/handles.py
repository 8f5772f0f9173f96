"""Prefix sharing by handles: a handle holds references to a whole prefix's pages.

A handle is one of ``max_handles`` extra rows of ``req_to_token`` (and of the host's page
mirror, :mod:`graphalloc.references`): taking one copies a live request's first n slots
into it inside a step (an ``AL_COPY`` descriptor row) and adds a reference to each of its
FULL pages of ``[0, n)`` and SWA pages of ``[min(frontier, n), n)``; admitting on it copies
them into the new request's row and adds the request's references; dropping it removes
them (an SWA tombstone removes only the SWA ones). Pages reach their free ring only when
their last reference goes (:func:`graphalloc.references.drop_actions`).

Ledger of a handle (positions, ``[a, b)``)::

    take_handle(r, n)    [0, n)             FULL referenced (+1 each)
                         [min(f_r, n), n)   SWA referenced (+1 each)
    drop_handle_swa(h)   [swa_start, n)     SWA references dropped; swa_start becomes n
    drop_handle(h)       [0, n)             every reference dropped; the handle is free
    admit(handle=h)      the new request: L = n, frontier = swa_start, the same references

:class:`HandlePlanning` is the planner's half (validation and rows, on the step's ledger
copy); :class:`HandleOps` the allocator's public half. Pool mode only: in ring mode every
request keeps its window in its own ring, so a window cannot be shared.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .errors import (
    AlignmentError,
    CapacityError,
    ContractError,
    OverlapError,
    PositionError,
    UnknownHandleError,
)
from .inputs import as_counts
from .kernels.abi import AL_COPY, AL_FLAGS, AL_FULL_POP, AL_N_PAGES, AL_REQ, ROW_WIDTH
from .references import drop_actions

__all__ = ["HandleInfo", "HandlePlanning", "HandleOps"]


@dataclasses.dataclass(frozen=True)
class HandleInfo:
    """What a handle holds: ``n_tokens`` (FULL ``[0, n)``), ``swa_start`` (SWA held for
    ``[swa_start, n)``; equal to ``n_tokens`` after a tombstone), page counts, and the pages
    dropping it would free now (those it is the last holder of)."""

    handle: int
    n_tokens: int
    swa_start: int
    n_full_pages: int
    n_swa_pages: int
    frees_full: int
    frees_swa: int


class HandlePlanning:
    """The planner's handle operations (a part of :class:`graphalloc.planner.StepBuilder`)."""

    def _sharing(self, what: str) -> None:
        if self.config.ring_mode:
            raise ContractError(
                f"{what}: prefix sharing needs pool mode; in ring mode every request keeps its "
                "window in its own ring of SWA pages, so a shared prefix's window cannot be "
                "shared (build the allocator with swa_ring_pages=0)")

    def live_handle(self, handle, what: str) -> int:
        """``handle`` as an int: a handle taken and not dropped (``UnknownHandleError``)."""
        self._sharing(what)
        led = self.ledger
        n = led.n_handles
        if isinstance(handle, (bool, np.bool_)) or not isinstance(handle, (int, np.integer)):
            raise UnknownHandleError(f"{what}: a handle is an int from take_handle(), got "
                                     f"{handle!r}")
        h = int(handle)
        pending = self.pending_handles
        if not 0 <= h < n or not led.h_live[h] or (pending is not None and pending[h]):
            state = ("outside [0, max_handles)" if not 0 <= h < n else
                     "dropped in the open free_group()" if led.h_live[h] else
                     "not held (never taken, or dropped already)")
            raise UnknownHandleError(f"{what}: handle {h} is {state}")
        if h in self.copied_handles:
            raise OverlapError(f"{what}: handle {h} is written in this step; use it in the "
                               "next step")
        return h

    def _hold(self, dst_row: int, src_row: int, n_tokens: int, swa_start: int) -> None:
        """``dst_row`` takes references to ``src_row``'s pages of ``[0, n_tokens)`` (SWA:
        ``[swa_start, n_tokens)``): the host mirror, the counts, and one AL_COPY row."""
        ps, refs = self.config.page_size, self.ledger.refs
        n_pages = n_tokens // ps
        pages = refs.page_of[src_row, :n_pages].astype(np.int64)
        refs.put("page_of", (np.full(n_pages, dst_row), np.arange(n_pages)), pages)
        refs.add("full_ref", pages, 1)
        refs.add("swa_ref", refs.swa_of[pages[swa_start // ps:]].astype(np.int64), 1)
        if n_pages:
            out = np.zeros((1, ROW_WIDTH), dtype=np.int64)
            out[0, AL_REQ] = dst_row
            out[0, AL_FULL_POP] = src_row
            out[0, AL_FLAGS] = AL_COPY
            out[0, AL_N_PAGES] = n_pages
            self.alloc_parts.append(out)

    def take_handle(self, row: int, n_tokens, handle: int) -> None:
        """Handle ``handle`` (a free one) takes references to ``row``'s first ``n_tokens``
        (whole pages): FULL ``[0, n)``, SWA ``[min(frontier, n), n)``."""
        self._sharing("take_handle")
        cfg, led, ps = self.config, self.ledger, self.config.page_size
        r = int(self.live_rows([row], "take_handle")[0])
        n = int(as_counts(n_tokens, 1, "take_handle n_tokens")[0])
        if n % ps:
            raise AlignmentError(f"take_handle: {n} tokens is not a whole number of pages "
                                 f"(page_size {ps}); share whole pages only")
        held = min(int(self.len_at_start[r]), int(led.committed[r]))
        if not 0 < n <= held:
            raise PositionError(f"take_handle: {n} tokens, request {r} holds {held} committed "
                                "tokens (when the step began); take 1 .. that many, whole "
                                "pages")
        swa_start = min(int(led.frontier[r]), n)
        led.h_live[handle], led.h_len[handle], led.h_swa_start[handle] = True, n, swa_start
        self._hold(cfg.max_reqs + handle, r, n, swa_start)
        self.copied_handles.add(handle)

    def admit_on_handle(self, row: int, handle, n_tokens=None) -> None:
        """Make ``row`` live sharing ``handle``'s pages (its first ``n_tokens``, whole pages;
        default all): length n, frontier ``min(swa_start, n)`` (the window below the handle's
        SWA start must be recomputed)."""
        h = self.live_handle(handle, "admit(handle=)")
        led, ps = self.ledger, self.config.page_size
        n = int(led.h_len[h])
        if n_tokens is not None:
            m = int(as_counts(n_tokens, 1, "admit n_tokens")[0])
            if m % ps or not 0 < m <= n:
                raise AlignmentError(f"admit(handle={h}, n_tokens={m}): share whole pages of "
                                     f"the handle's {n} tokens (page_size {ps})")
            n = m
        self.admit(row)
        swa_start = min(int(led.h_swa_start[h]), n)
        led.seq_len[row], led.frontier[row], led.committed[row] = n, swa_start, n
        self._hold(row, self.config.max_reqs + h, n, swa_start)

    def drop_handle(self, handle, swa_only: bool = False) -> None:
        """Drop ``handle``'s references (``swa_only``: its SWA references only, a tombstone:
        the handle's SWA start becomes its length)."""
        what = "drop_handle_swa" if swa_only else "drop_handle"
        h = self.live_handle(handle, what)
        led, ps = self.ledger, self.config.page_size
        row = np.array([self.config.max_reqs + h], dtype=np.int64)
        n_pages = np.array([led.h_len[h] // ps])
        swa_lo = np.array([led.h_swa_start[h] // ps])
        full_hi = np.zeros(1, dtype=np.int64) if swa_only else n_pages
        self._emit(*drop_actions(led.refs, row, np.zeros(1, dtype=np.int64), full_hi, swa_lo,
                                 n_pages))
        if swa_only:
            led.h_swa_start[h] = led.h_len[h]
        else:
            led.h_live[h], led.h_len[h], led.h_swa_start[h] = False, 0, 0
        self.dropped_handles.add(h)


class HandleOps:
    """The allocator's handle API (a part of :class:`graphalloc.HybridAllocator`)."""

    def take_handle(self, row, n_tokens) -> int:
        """A handle on the first ``n_tokens`` (whole pages) of live request ``row``: it holds
        references to the FULL pages of ``[0, n)`` and the SWA pages of
        ``[min(frontier(row), n), n)``, and keeps them after the request is released, until
        :meth:`drop_handle`. One step (the prefix is copied into the handle's row of the
        device table). Cost: O(n / page_size) host work. Pool mode only."""
        led = self.ledger
        if led.n_handles == 0:
            raise CapacityError("take_handle: the allocator has no handle slots; build it with "
                                "AllocatorConfig(max_handles=...)")
        taken = led.h_live if self._group is None else led.h_live | self._group.pending_handles
        free = np.flatnonzero(~taken)
        if len(free) == 0:
            raise CapacityError(f"take_handle: all {led.n_handles} handles are held; drop one "
                                "first")
        h = int(free[0])
        self._run(lambda b: b.take_handle(row, n_tokens, h))
        if self._group is not None:
            self._group.sync_handles()
        return h

    def drop_handle(self, handle) -> None:
        """Drop every reference ``handle`` holds: pages nobody else references return to the
        free rings (in this step; deferred to the block's end inside ``free_group()``).
        Dropping a reference that is not the last changes nothing on the device. A dropped
        handle raises :class:`UnknownHandleError` with nothing changed."""
        self._drop_handle(handle, False)

    def drop_handle_swa(self, handle) -> None:
        """An SWA tombstone: drop only the handle's SWA references (its FULL pages stay). A
        request admitted on it afterwards starts with its frontier at the handle's end and
        must recompute the last window. One step (deferred inside ``free_group()``)."""
        self._drop_handle(handle, True)

    def handle_info(self, handle) -> HandleInfo:
        """What ``handle`` holds and what dropping it would free now (host only). Cost:
        O(pages of the handle)."""
        b = self._builder()  # the ledger as the open block (if any) has decided it
        h = b.live_handle(handle, "handle_info")
        led, ps = b.ledger, self.config.page_size
        n, start = int(led.h_len[h]), int(led.h_swa_start[h])
        pages = led.refs.page_of[self.config.max_reqs + h, :n // ps].astype(np.int64)
        swa = led.refs.swa_of[pages[start // ps:]].astype(np.int64)
        return HandleInfo(h, n, start, len(pages), len(swa),
                          int(np.count_nonzero(led.refs.full_ref[pages] == 1)),
                          int(np.count_nonzero(led.refs.swa_ref[swa] == 1)))

    def live_handles(self) -> np.ndarray:
        """Handles currently held (a new array). O(max_handles)."""
        return np.flatnonzero(self.ledger.h_live)

    def _drop_handle(self, handle, swa_only: bool) -> None:
        self._deferred(lambda b: b.drop_handle(handle, swa_only))
