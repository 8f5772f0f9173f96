"""The host's mirror of page ids and their reference counts (pool mode): who holds what.

The free rings start as ``1..N`` and every pop and push is planned on the host, so the
host can know, without reading the device, exactly which page each request row and
each handle holds (the end state SGLang's allocator work aims for: host plans, device
tables are write-only projections). This module keeps that knowledge:

====================  =========================  =========================================
array                 shape (int32)              meaning
====================  =========================  =========================================
``page_of``           [n_rows, pages_per_req]    FULL page of row r's page index k (request
                                                 rows, then handle rows); valid for
                                                 ``k < ceil(L / ps)`` of a live row
``swa_of``            [num_full_pages + 1]       SWA page paired with a FULL page, 0 = none
                                                 (the mirror of ``full_to_swa``, per page)
``full_ring``         [num_full_pages]           the FULL free ring's contents
``swa_ring``          [num_swa_pages]            the SWA free ring's contents
``full_ref``          [num_full_pages + 1]       holders of each FULL page
``swa_ref``           [num_swa_pages + 1]        holders of each SWA page (whose window
                                                 still covers it)
====================  =========================  =========================================

Holders: a live request of length L and frontier f holds the FULL pages of ``[0, L)``
and the SWA pages of ``[f, L)``; a handle of n tokens holds FULL ``[0, n)`` and SWA
``[swa_start, n)``. Because sharing is by prefix, the holders of FULL page k of a row
hold every page before it too.

Every write goes through the ledger's :class:`~graphalloc.state.journal.Journal`
(:meth:`PageRefs.put`, :meth:`PageRefs.add`), so a refused, dry-run or cancelled step is
rolled back with the rest of the ledger. Cost: O(pages changed) per step, on the host.

:func:`drop_actions` is the rule of what a drop of references frees (the push order of
the planner's release rows): see its docstring.
"""

from __future__ import annotations

import numpy as np

from .journal import Journal

__all__ = ["PageRefs", "drop_actions", "ACT_NONE", "ACT_FULL", "ACT_SWA", "ACT_BOTH"]

ACT_NONE, ACT_FULL, ACT_SWA, ACT_BOTH = 0, 1, 2, 3  # what freeing a page pushes


class PageRefs:
    """Page ids and reference counts, shared by every copy of one ledger (see module)."""

    NAMES = ("page_of", "swa_of", "full_ring", "swa_ring", "full_ref", "swa_ref")

    def __init__(self, n_rows: int, pages_per_row: int, num_full_pages: int,
                 num_swa_pages: int, journal: Journal):
        self.page_of = np.zeros((n_rows, pages_per_row), dtype=np.int32)
        self.swa_of = np.zeros(num_full_pages + 1, dtype=np.int32)
        self.full_ring = np.zeros(num_full_pages, dtype=np.int32)
        self.swa_ring = np.zeros(num_swa_pages, dtype=np.int32)
        self.full_ref = np.zeros(num_full_pages + 1, dtype=np.int32)
        self.swa_ref = np.zeros(num_swa_pages + 1, dtype=np.int32)
        self.journal = journal

    def reset(self) -> None:
        """No page held, the rings 1..N in order (in place, not journaled)."""
        for name in ("page_of", "swa_of", "full_ref", "swa_ref"):
            getattr(self, name)[...] = 0
        self.full_ring[:] = np.arange(1, len(self.full_ring) + 1)
        self.swa_ring[:] = np.arange(1, len(self.swa_ring) + 1)

    # ---- journaled writes ----------------------------------------------------------------
    def put(self, name: str, index, values) -> None:
        """``getattr(self, name)[index] = values``, journaled (``index``: an int array, or a
        tuple of them for ``page_of``; no duplicate indices)."""
        self.journal.put(getattr(self, name), index, values)

    def add(self, name: str, index: np.ndarray, delta: int) -> None:
        """``arr[index] += delta`` counting repeated indices, journaled."""
        self.journal.add(getattr(self, name), index, delta)

    # ---- reads ---------------------------------------------------------------------------
    def ring_pages(self, pool: str, start: int, n: int) -> np.ndarray:
        """The ``n`` pages at ring positions ``start, start + 1, ...`` (mod capacity)."""
        ring = self.full_ring if pool == "full" else self.swa_ring
        return ring[(start + np.arange(n)) % len(ring)]



def drop_actions(refs: PageRefs, rows: np.ndarray, full_lo: np.ndarray, full_hi: np.ndarray,
                 swa_lo: np.ndarray, swa_hi: np.ndarray):
    """Drop references and say what that frees, in push order.

    Row ``rows[i]`` drops its FULL references of page indices ``[full_lo[i], full_hi[i])``
    and its SWA references of ``[swa_lo[i], swa_hi[i])`` (``[swa_lo, swa_hi)`` lies inside
    the FULL range, or the FULL range is empty: a frontier move). The counts are updated
    (journaled). Returns the freed pages as parallel arrays ``(row, page_index, action)``
    in push order::

        action ACT_FULL  the FULL count reached 0 and the page has no SWA page: push FULL
        action ACT_BOTH  both counts reached 0: push both, clear the mapping
        action ACT_SWA   the SWA count reached 0, FULL holders remain: push SWA, clear

    Order: phase 1 every ACT_FULL page, phase 2 every ACT_BOTH / ACT_SWA page; in a phase,
    rows in call order, each row's pages in index order. A page that several rows of the
    call drop to 0 is freed once, in the first such row's run, with the action of the
    counts after the whole call. Cost: O(pages dropped) numpy.
    """
    n_full = np.maximum(full_hi - full_lo, 0)
    lo = np.where(n_full > 0, full_lo, swa_lo)  # the pages each row examines
    hi = np.where(n_full > 0, full_hi, swa_hi)
    n_exam = np.maximum(hi - lo, 0)
    total = int(n_exam.sum())
    empty = np.zeros(0, dtype=np.int64)
    if total == 0:
        return empty, empty, empty
    seg = np.repeat(np.arange(len(rows)), n_exam)
    k = np.arange(total) - np.repeat(np.cumsum(n_exam) - n_exam, n_exam) + lo[seg]
    r = rows[seg]
    page = refs.page_of[r, k].astype(np.int64)
    drops_full = n_full[seg] > 0
    drops_swa = (k >= swa_lo[seg]) & (k < swa_hi[seg])
    refs.add("full_ref", page[drops_full], -1)
    swa_page = refs.swa_of[page].astype(np.int64)
    refs.add("swa_ref", swa_page[drops_swa], -1)
    # The action of a page, from its counts after the whole call (a page only this call
    # dropped to 0 can have count 0 here: a mapped SWA page always has a holder).
    full_zero = refs.full_ref[page] == 0
    swa_zero = (swa_page > 0) & (refs.swa_ref[swa_page] == 0)
    action = np.where(full_zero, np.where(swa_page > 0, ACT_BOTH, ACT_FULL),
                      np.where(swa_zero, ACT_SWA, ACT_NONE))
    # A page freed by several rows: only its first occurrence (the first row of the call
    # that held it) frees it, with the page's action; every occurrence carries the same.
    hit = np.flatnonzero(action != ACT_NONE)
    _, first = np.unique(page[hit], return_index=True)
    keep = np.sort(hit[first])
    order = keep[np.argsort(np.where(action[keep] == ACT_FULL, 0, 1), kind="stable")]
    return r[order].astype(np.int64), k[order].astype(np.int64), action[order].astype(np.int64)
