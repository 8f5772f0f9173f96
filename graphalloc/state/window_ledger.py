"""The host slice of one extra window pool: a model's second (third, ...) window pool.

A model with several window pools (two sliding windows of different sizes, a sliding
window beside chunked local attention: :mod:`graphalloc.pools.extra_window`) keeps its
first window pool in the ledger's own arrays (``frontier``, ``h_swa_start``, the ``swa``
ring, ``PageRefs.swa_of`` / ``swa_ref`` / ``swa_ring``) and each further pool p >= 1 in a
:class:`WindowLedger` of the same shape:

=================  ============================  ==========================================
array              shape                         meaning
=================  ============================  ==========================================
``frontier``       [max_reqs] int64              request r's frontier f_p (page-aligned):
                                                 it holds pool p's pages of ``[f_p, L)``
``h_start``        [max_handles] int64           handle h holds pool p's pages of
                                                 ``[h_start, n)`` (n after a tombstone)
``ring``           [2] int64                     the free ring's ``[head, n_free]``
``swa_of``         [num_full_pages + 1] int32    pool p's page paired with a FULL page (0:
                                                 none), the mirror of its ``full_to_swa``
``swa_ref``        [num_pages + 1] int32         holders of each of pool p's pages
``swa_ring``       [num_pages] int32             the free ring's contents
=================  ============================  ==========================================

Every write goes through the ledger's journal (a refused, dry-run or cancelled step leaves
no trace). :meth:`arrays` names them ``window{p}_<name>`` in ``Ledger.arrays()``, so
checkpoints and ``state_dict`` carry them. Only the pooled policy (no rings of pages per
request) and pool mode (the page mirror exists). Cost: O(1) per field, O(pages) per
:meth:`reset` and :meth:`check`.
"""

from __future__ import annotations

import numpy as np

from ..errors import IntegrityError
from .free_ring import HEAD, N_FREE, FreeRing
from .journal import Journal

__all__ = ["WindowLedger"]


class WindowLedger:
    """Host state of extra window pool ``index`` (p >= 1) of ``num_pages`` pages (see the
    module docstring)."""

    NAMES = ("frontier", "h_start", "ring", "swa_of", "swa_ref", "swa_ring")

    def __init__(self, index: int, num_pages: int, max_reqs: int, n_handles: int,
                 num_full_pages: int, journal: Journal):
        self.index, self.num_pages = index, int(num_pages)
        self.prefix = f"window{index}_"
        self.journal = journal
        self.frontier = np.zeros(max_reqs, dtype=np.int64)
        self.h_start = np.zeros(n_handles, dtype=np.int64)
        self.ring = np.zeros(2, dtype=np.int64)  # [head, n_free]
        self.swa_of = np.zeros(num_full_pages + 1, dtype=np.int32)
        self.swa_ref = np.zeros(self.num_pages + 1, dtype=np.int32)
        self.swa_ring = np.zeros(self.num_pages, dtype=np.int32)
        self.free = FreeRing(self.num_pages, self.ring, journal)
        self.reset()

    def reset(self) -> None:
        """No page held, the ring ``1..num_pages`` in order (in place, not journaled)."""
        for name in ("frontier", "h_start", "swa_of", "swa_ref"):
            getattr(self, name)[...] = 0
        self.ring[HEAD], self.ring[N_FREE] = 0, self.num_pages
        self.swa_ring[:] = np.arange(1, self.num_pages + 1)

    def arrays(self) -> dict[str, np.ndarray]:
        """Every array, as views, under ``window{p}_<name>``."""
        return {self.prefix + name: getattr(self, name) for name in self.NAMES}

    # ---- journaled writes ------------------------------------------------------------------
    def put(self, name: str, index, values) -> None:
        """``getattr(self, name)[index] = values``, journaled (no duplicate indices)."""
        self.journal.put(getattr(self, name), index, values)

    def add(self, name: str, index: np.ndarray, delta: int) -> None:
        """``arr[index] += delta`` counting repeated indices, journaled."""
        self.journal.add(getattr(self, name), index, delta)

    # ---- reads -----------------------------------------------------------------------------
    def ring_pages(self, start: int, n: int) -> np.ndarray:
        """The ``n`` pages at ring positions ``start, start + 1, ...`` (mod capacity)."""
        return self.swa_ring[(start + np.arange(n)) % self.num_pages]

    def check(self, live: np.ndarray, committed: np.ndarray, page_size: int) -> None:
        """Raise :class:`IntegrityError` when a live frontier is unaligned or past
        ``floor_page(C)``, or ``free + referenced != num_pages``."""
        f = self.frontier
        bad = live & ((f % page_size != 0) | (f < 0) | (f > committed // page_size * page_size))
        if bad.any():
            r = int(np.flatnonzero(bad)[0])
            raise IntegrityError(
                f"window pool {self.index}, request {r}: frontier {f[r]} breaks '0 <= frontier "
                f"<= floor_page(committed {committed[r]})', page-aligned (page_size "
                f"{page_size})")
        n_free = int(self.ring[N_FREE])
        owned = int(np.count_nonzero(self.swa_ref[1:]))
        if n_free + owned != self.num_pages or not 0 <= n_free <= self.num_pages:
            raise IntegrityError(f"window pool {self.index} not conserved: free {n_free} + "
                                 f"owned {owned} != {self.num_pages} pages")
