"""The host ledger: everything the host knows, as numpy arrays that are never rebound.

The host never reads the device. It knows, per request row, the allocated length L, the
committed length C and the SWA eviction frontier f; per handle (a shared prefix kept by a
cache or an engine's tree), its length and SWA start; per pool, where the free ring's head
is and how many entries it holds; and (pool mode) which page every row and handle holds,
with a reference count per page (:mod:`graphalloc.state.references`).

Per request r (positions, half-open ``[a, b)``)::

    [0, f)                   FULL pages held (referenced), SWA already dropped (evicted)
    [f, ceil_page(L))        FULL and SWA pages held (pool mode; ring mode owns R SWA pages)
    [0, C)                   committed tokens (C == L without speculation)
    [C, L)                   the speculative tail: speculative steps not yet committed,
                             oldest first (``spec_steps``, at most ``SPEC_DEPTH`` in flight)

Per handle h: FULL ``[0, n)``, SWA ``[swa_start, n)``. A page is free only when no row and
no handle references it.

Recurrent-state slots (``num_state_slots`` S > 0): ``state_slot[r]`` is request r's slot
(the state after its committed tokens), ``state_slot[max_reqs + h]`` handle h's snapshot
(the state after its n tokens), ``spec_state[r, j, i]`` the slot after token i of r's
speculative step j; free slots sit in a host-only FIFO ring (``state_ring``). Every slot
has one owner: free + owned == S.

Further window pools (a model with several windows, :mod:`graphalloc.pools.extra_window`):
pool p >= 1 keeps its frontiers, handle starts, free ring and page mirror in
``windows[p - 1]`` (:class:`~graphalloc.state.window_ledger.WindowLedger`), journaled with
the rest and named ``window{p}_*`` in :meth:`Ledger.arrays`.

Invariants (``check_host_invariants``): f is page-aligned, ``f <= floor_page(C)``, it only
moves forward (``load_back`` aside), ``L == C + sum(spec_steps)``, and per pool
``free + referenced == pages`` (ring mode: ``free + owned == pages``).

Every array is allocated once and written in place (by the planners, through the journal;
by a checkpoint load or a replica follower through :meth:`Ledger.assign`), so the compiled
planner binds it once. Cost: O(1) per field read; ``check_host_invariants`` O(max_reqs +
pages).
"""

from __future__ import annotations

import numpy as np

from ..config import AllocatorConfig
from ..errors import IntegrityError
from .free_ring import FreeRing
from .journal import Journal
from .references import PageRefs
from .window_ledger import WindowLedger

__all__ = ["FreeRing", "Ledger"]

FULL_RING, SWA_RING, STATE_RING = 0, 1, 2  # rows of Ledger.rings


class Ledger:
    """Per-request and per-handle host state, the two free rings and the page mirror.

    Written only by the planners (through :attr:`journal`, so a refused, dry-run or
    cancelled step leaves no trace), by :meth:`assign` (a checkpoint load, a replica
    follower) and by :meth:`reset`."""

    ROW_ARRAYS = ("live", "admitted_once", "seq_len", "frontier", "committed", "spec_steps")
    HANDLE_ARRAYS = ("h_live", "h_len", "h_swa_start")
    STATE_ARRAYS = ("state_slot", "spec_state", "state_ring")
    SPEC_DEPTH = 2  # speculative steps in flight per request (overlap scheduling: 2)

    def __init__(self, config: AllocatorConfig):
        self.config = config
        n, n_handles = config.max_reqs, config.max_handles
        self.n_handles = n_handles
        self.journal = Journal()
        self.live = np.zeros(n, dtype=bool)
        self.admitted_once = np.zeros(n, dtype=bool)  # for messages: "already released"
        self.seq_len = np.zeros(n, dtype=np.int64)  # L
        self.frontier = np.zeros(n, dtype=np.int64)  # f, page-aligned
        self.committed = np.zeros(n, dtype=np.int64)  # C: tokens no rollback may remove
        self.spec_steps = np.zeros((n, self.SPEC_DEPTH), dtype=np.int64)  # oldest first
        # Handles (prefix sharing): handle h is row max_reqs + h of req_to_token and page_of.
        self.h_live = np.zeros(n_handles, dtype=bool)
        self.h_len = np.zeros(n_handles, dtype=np.int64)  # tokens held: FULL [0, h_len)
        self.h_swa_start = np.zeros(n_handles, dtype=np.int64)  # SWA held: [start, h_len)
        self.rings = np.zeros((3, 2), dtype=np.int64)  # [FULL, SWA, STATE] x [head, n_free]
        self.full = FreeRing(config.num_full_pages, self.rings[FULL_RING], self.journal)
        # (a model without window layers has no window pages: a ring of capacity 1, empty)
        self.swa = FreeRing(max(config.num_swa_pages, 1), self.rings[SWA_RING], self.journal)
        # Recurrent-state slots (num_state_slots S; all empty and unused when S == 0).
        n_slots = config.num_state_slots
        self.state_slot = np.zeros(n + n_handles, dtype=np.int64)  # main slot / snapshot
        self.spec_state = np.zeros((n, self.SPEC_DEPTH, config.max_spec_tokens), dtype=np.int64)
        self.state_ring = np.zeros(max(n_slots, 1), dtype=np.int64)  # free slots (FIFO)
        self.states = FreeRing(max(n_slots, 1), self.rings[STATE_RING], self.journal)
        # Page ids and reference counts (pool mode).
        self.refs = None if not config.pools.window.shares else PageRefs(
            n + n_handles, config.pages_per_request, config.num_full_pages,
            config.num_swa_pages, self.journal)
        # The model's further window pools (p >= 1), each a slice of its own (pool mode).
        self.windows = tuple(WindowLedger(pool.index, pool.num_pages, n, n_handles,
                                          config.num_full_pages, self.journal)
                             for pool in config.pools.extras)
        self.reset()

    def reset(self) -> None:
        """Every row and handle free, every page free in order 1..N (in place)."""
        for name in self.ROW_ARRAYS + self.HANDLE_ARRAYS + self.STATE_ARRAYS:
            getattr(self, name)[...] = 0
        n_slots = self.config.num_state_slots
        self.state_ring[:n_slots] = np.arange(1, n_slots + 1)
        self.rings[:, 0] = 0
        self.rings[:, 1] = (self.config.num_full_pages, self.config.num_swa_pages, n_slots)
        if self.refs is not None:
            self.refs.reset()
        for window in self.windows:
            window.reset()
        self.journal.commit()

    @property
    def full_ref(self) -> np.ndarray:
        """Pool mode: the FULL pages' reference counts (``refs.full_ref``, the same array)."""
        return self.refs.full_ref

    @property
    def swa_ref(self) -> np.ndarray:
        """Pool mode: the SWA pages' reference counts (``refs.swa_ref``, the same array)."""
        return self.refs.swa_ref

    def arrays(self) -> dict[str, np.ndarray]:
        """Every host array by name (rows, handles, rings and, in pool mode, the page
        mirror): the ledger's whole state, as views."""
        out = {name: getattr(self, name) for name in self.ROW_ARRAYS + self.HANDLE_ARRAYS
               + self.STATE_ARRAYS}
        out["rings"] = self.rings
        if self.refs is not None:
            out.update({name: getattr(self.refs, name) for name in self.refs.NAMES})
        for window in self.windows:
            out.update(window.arrays())
        return out

    def assign(self, arrays: dict[str, np.ndarray]) -> None:
        """Copy ``arrays`` (as :meth:`arrays` names them; shapes must match) into this
        ledger in place. The caller checks them first (a checkpoint load, a follower)."""
        own = self.arrays()
        for name, value in arrays.items():
            own[name][...] = value
        self.journal.commit()

    # ---- writes used by the planners --------------------------------------------------
    def reset_rows(self, rows, live: bool) -> None:
        """Rows ``rows`` become empty requests (``live=True``: admitted, length 0) or free
        rows (``live=False``), journaled. The page mirror is not touched (an empty request
        holds nothing; a release drops its references first). O(len(rows))."""
        put = self.journal.put
        put(self.live, rows, live)
        if live:
            put(self.admitted_once, rows, True)
        for name in ("seq_len", "frontier", "committed", "spec_steps"):
            put(getattr(self, name), rows, 0)  # (state slots: the planner's, see states.py)
        for window in self.windows:
            put(window.frontier, rows, 0)

    # ---- checks -----------------------------------------------------------------------
    def check_host_invariants(self) -> None:
        """Raise :class:`IntegrityError` if the host ledger breaks an invariant."""
        cfg = self.config
        ps = cfg.page_size
        live = self.live
        bad_align = live & (self.frontier % ps != 0)
        bad_order = live & ~((self.frontier >= 0)
                             & (self.frontier <= self.committed // ps * ps))
        bad_spec = live & ((self.committed + self.spec_steps.sum(axis=1) != self.seq_len)
                           | (self.spec_steps < 0).any(axis=1))
        if bad_align.any() or bad_order.any() or bad_spec.any():
            r = int(np.flatnonzero(bad_align | bad_order | bad_spec)[0])
            raise IntegrityError(
                f"request {r}: frontier={self.frontier[r]} committed={self.committed[r]} "
                f"len={self.seq_len[r]} speculative steps {list(map(int, self.spec_steps[r]))}"
                f" break '0 <= frontier <= floor_page(committed)', page-aligned (page_size "
                f"{ps}), 'len == committed + speculative'")
        if self.refs is not None:
            owned_full = int(np.count_nonzero(self.refs.full_ref[1:]))
            owned_swa = int(np.count_nonzero(self.refs.swa_ref[1:]))
        else:
            end = -(-self.seq_len // ps)
            owned_full = int(np.where(live, end, 0).sum())
            owned_swa = cfg.pools.window.min_pages(ps, 0) * int(np.count_nonzero(live))
        slots = np.concatenate([self.state_slot, self.spec_state.reshape(-1)])
        owned_states = int(np.count_nonzero(slots))
        for name, ring, owned, total in (
            ("FULL", self.full, owned_full, cfg.num_full_pages),
            ("SWA", self.swa, owned_swa, cfg.num_swa_pages),
            ("state", self.states, owned_states, cfg.num_state_slots),
        ):
            if ring.n_free + owned != total or not 0 <= ring.n_free <= total:
                raise IntegrityError(
                    f"{name} pool not conserved: free {ring.n_free} + owned {owned} "
                    f"!= {total} pages")
        for window in self.windows:
            window.check(live, self.committed, ps)
