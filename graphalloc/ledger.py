"""The host ledger: everything the host knows, as plain ints and numpy arrays.

The host never reads the device. It knows, per request row, the allocated length
and the SWA eviction frontier; per handle (a shared prefix kept by a cache or an
engine's tree), its length and SWA start; per pool, where the free ring's head is
and how many entries it holds; and (pool mode) which page every row and handle
holds, with a reference count per page (:mod:`graphalloc.references`).

Per request r (positions, half-open ``[a, b)``)::

    [0, frontier)            FULL pages held (referenced), SWA already dropped (evicted)
    [frontier, ceil_page(L)) FULL and SWA pages held (pool mode; ring mode owns R SWA pages)
    [0, C)                   committed tokens (C = ``committed``; C == L without speculation)
    [C, L)                   the speculative tail: the slots of speculative steps not yet
                             committed, oldest first (``spec_steps``, at most two in flight)

Per handle h: FULL ``[0, n)``, SWA ``[swa_start, n)``. A page is free only when no
row and no handle references it.

Invariants (checked by ``check_host_invariants``): the frontier is page-aligned,
``frontier <= floor_page(C)`` (the window follows the committed length only, so a
rollback never needs an evicted SWA page), it only moves forward (``load_back`` aside),
``L == C + sum(spec_steps)``, and per pool ``free + referenced == pages`` (ring mode:
``free + owned == pages``).
``protected`` is always 0 (the protected-prefix form of sharing was replaced by
handles); it stays in the wire format of replicas and checkpoints.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .config import AllocatorConfig
from .errors import IntegrityError
from .references import PageRefs

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

    ROW_ARRAYS = ("live", "admitted_once", "seq_len", "frontier", "protected", "committed",
                  "spec_steps")

    SPEC_DEPTH = 2  # speculative steps in flight per request (overlap scheduling: 2)

    HANDLE_ARRAYS = ("h_live", "h_len", "h_swa_start")

    def __init__(self, config: AllocatorConfig):
        self.config = config
        n = config.max_reqs
        n_handles = getattr(config, "max_handles", 0)
        self.n_handles = n_handles
        # Handles (prefix sharing): handle h is row max_reqs + h of req_to_token and page_of.
        self.h_live = np.zeros(n_handles, dtype=bool)
        self.h_len = np.zeros(n_handles, dtype=np.int64)  # tokens held: FULL [0, h_len)
        self.h_swa_start = np.zeros(n_handles, dtype=np.int64)  # SWA held: [start, h_len)
        # Page ids and reference counts (pool mode): shared by every copy of this ledger.
        self.refs = None if config.ring_mode else PageRefs(
            n + n_handles, config.pages_per_request, config.num_full_pages,
            config.num_swa_pages)
        self.live = np.zeros(n, dtype=bool)
        self.admitted_once = np.zeros(n, dtype=bool)  # for messages: "already released"
        self.seq_len = np.zeros(n, dtype=np.int64)
        self.frontier = np.zeros(n, dtype=np.int64)
        self.protected = np.zeros(n, dtype=np.int64)
        self.committed = np.zeros(n, dtype=np.int64)  # C: tokens no rollback may remove
        self.spec_steps = np.zeros((n, self.SPEC_DEPTH), dtype=np.int64)  # oldest first
        self.full = FreeRing(config.num_full_pages, 0, config.num_full_pages)
        self.swa = FreeRing(config.num_swa_pages, 0, config.num_swa_pages)

    def reset_rows(self, rows, live: bool) -> None:
        """Rows ``rows`` become empty requests (``live=True``: admitted, length 0) or free
        rows (``live=False``): every length, frontier and speculative step 0. The page
        mirror is not touched (an empty request holds nothing; a release drops its
        references first). O(len(rows))."""
        self.live[rows] = live
        if live:
            self.admitted_once[rows] = True
        for name in ("seq_len", "frontier", "protected", "committed", "spec_steps"):
            getattr(self, name)[rows] = 0

    @property
    def full_ref(self) -> np.ndarray:
        """Pool mode: the FULL pages' reference counts (``refs.full_ref``, the same array)."""
        return self.refs.full_ref

    @property
    def swa_ref(self) -> np.ndarray:
        """Pool mode: the SWA pages' reference counts (``refs.swa_ref``, the same array)."""
        return self.refs.swa_ref

    def assign_rows(self, other: Ledger, rows: np.ndarray) -> None:
        """Take ``other``'s per-request state for ``rows`` (the free rings are not touched)."""
        for name in self.ROW_ARRAYS:
            getattr(self, name)[rows] = getattr(other, name)[rows]

    def copy(self) -> Ledger:
        other = Ledger.__new__(Ledger)
        other.config = self.config
        for name in self.ROW_ARRAYS + self.HANDLE_ARRAYS:
            setattr(other, name, getattr(self, name).copy())
        other.n_handles, other.refs = self.n_handles, self.refs  # shared: journaled writes
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
                             & (self.frontier <= self.committed // ps * ps))
        bad_spec = live & ((self.committed + self.spec_steps.sum(axis=1) != self.seq_len)
                           | (self.spec_steps < 0).any(axis=1))
        if bad_align.any() or bad_order.any() or bad_spec.any():
            r = int(np.flatnonzero(bad_align | bad_order | bad_spec)[0])
            raise IntegrityError(
                f"request {r}: protected={self.protected[r]} frontier={self.frontier[r]} "
                f"committed={self.committed[r]} len={self.seq_len[r]} speculative steps "
                f"{list(map(int, self.spec_steps[r]))} break 'protected <= frontier <= "
                f"floor_page(committed)', page-aligned (page_size {ps}), 'len == committed + "
                "speculative'")
        if self.refs is not None:
            owned_full = int(np.count_nonzero(self.refs.full_ref[1:]))
            owned_swa = int(np.count_nonzero(self.refs.swa_ref[1:]))
        else:
            owned_full = self.full_pages_owned().sum()
            owned_swa = self.swa_pages_owned().sum()
        for name, ring, owned, total in (
            ("FULL", self.full, owned_full, cfg.num_full_pages),
            ("SWA", self.swa, owned_swa, cfg.num_swa_pages),
        ):
            if ring.n_free + owned != total or not 0 <= ring.n_free <= total:
                raise IntegrityError(
                    f"{name} pool not conserved: free {ring.n_free} + owned {owned} "
                    f"!= {total} pages")
