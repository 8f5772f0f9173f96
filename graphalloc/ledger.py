"""The host ledger: everything the host knows, as plain ints and numpy arrays.

The host never reads the device. It knows, per request row, the allocated
length, the SWA eviction frontier and the protected prefix; per pool, where the
free ring's head is and how many entries it holds. Page *ids* live only on the
device.

Per request r (positions, half-open ``[a, b)``)::

    [0, protected)           prefix owned by someone else (a prefix cache): never freed here
    [protected, frontier)    FULL page owned, SWA peer already freed (evicted)
    [frontier, ceil_page(L)) FULL and SWA pages owned (pool mode; ring mode owns R SWA pages)

Invariants (checked by ``check_host_invariants``): ``protected`` and
``frontier`` are page-aligned, ``protected <= frontier <= floor_page(L)``,
the frontier only moves forward, and per pool ``free + owned == pages``.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .config import AllocatorConfig
from .errors import IntegrityError

__all__ = ["FreeRing", "Ledger"]


@dataclasses.dataclass
class FreeRing:
    """Host side of one device FIFO free list of ``capacity`` page ids.

    Entries ``[head, head + n_free)`` (mod capacity) are free pages. A pop of
    k takes positions ``head .. head+k-1``; a push of k writes positions
    ``head+n_free .. head+n_free+k-1``. Pops and pushes of one step touch
    disjoint positions whenever the pops fit in what was free before the step.
    """

    capacity: int
    head: int = 0
    n_free: int = 0

    def pop(self, n: int) -> int:
        start = self.head
        self.head = (self.head + n) % self.capacity
        self.n_free -= n
        return start

    def push(self, n: int) -> int:
        start = (self.head + self.n_free) % self.capacity
        self.n_free += n
        return start


class Ledger:
    """Per-request host state and the two free rings. ``copy()`` makes a working copy,
    so a step is planned on the copy and committed only when every check passed."""

    ROW_ARRAYS = ("live", "admitted_once", "seq_len", "frontier", "protected")

    def __init__(self, config: AllocatorConfig):
        self.config = config
        n = config.max_reqs
        self.live = np.zeros(n, dtype=bool)
        self.admitted_once = np.zeros(n, dtype=bool)  # for messages: "already released"
        self.seq_len = np.zeros(n, dtype=np.int64)
        self.frontier = np.zeros(n, dtype=np.int64)
        self.protected = np.zeros(n, dtype=np.int64)
        self.full = FreeRing(config.num_full_pages, 0, config.num_full_pages)
        self.swa = FreeRing(config.num_swa_pages, 0, config.num_swa_pages)

    def assign_rows(self, other: Ledger, rows: np.ndarray) -> None:
        """Take ``other``'s per-request state for ``rows`` (the free rings are not touched)."""
        for name in self.ROW_ARRAYS:
            getattr(self, name)[rows] = getattr(other, name)[rows]

    def copy(self) -> Ledger:
        other = Ledger.__new__(Ledger)
        other.config = self.config
        for name in self.ROW_ARRAYS:
            setattr(other, name, getattr(self, name).copy())
        other.full = FreeRing(self.full.capacity, self.full.head, self.full.n_free)
        other.swa = FreeRing(self.swa.capacity, self.swa.head, self.swa.n_free)
        return other

    # ---- derived counts -------------------------------------------------------------
    def full_pages_owned(self) -> np.ndarray:
        """Per row: FULL pages ``[protected, ceil_page(L))`` (0 for free rows)."""
        ps = self.config.page_size
        owned = -(-self.seq_len // ps) - self.protected // ps
        return np.where(self.live, owned, 0)

    def swa_pages_owned(self) -> np.ndarray:
        """Per row: SWA pages owned (pool: pages at or past the frontier; ring: R)."""
        ps = self.config.page_size
        if self.config.ring_mode:
            return np.where(self.live, self.config.swa_ring_pages, 0)
        owned = -(-self.seq_len // ps) - self.frontier // ps
        return np.where(self.live, owned, 0)

    def check_host_invariants(self) -> None:
        """Raise :class:`IntegrityError` if the host ledger breaks an invariant."""
        cfg = self.config
        ps = cfg.page_size
        live = self.live
        bad_align = live & ((self.frontier % ps != 0) | (self.protected % ps != 0))
        bad_order = live & ~((self.protected <= self.frontier)
                             & (self.frontier <= self.seq_len // ps * ps))
        if bad_align.any() or bad_order.any():
            r = int(np.flatnonzero(bad_align | bad_order)[0])
            raise IntegrityError(
                f"request {r}: protected={self.protected[r]} frontier={self.frontier[r]} "
                f"len={self.seq_len[r]} break 'protected <= frontier <= floor_page(len)', "
                f"page-aligned (page_size {ps})")
        for name, ring, owned, total in (
            ("FULL", self.full, self.full_pages_owned().sum(), cfg.num_full_pages),
            ("SWA", self.swa, self.swa_pages_owned().sum(), cfg.num_swa_pages),
        ):
            if ring.n_free + owned != total or not 0 <= ring.n_free <= total:
                raise IntegrityError(
                    f"{name} pool not conserved: free {ring.n_free} + owned {owned} "
                    f"!= {total} pages")
