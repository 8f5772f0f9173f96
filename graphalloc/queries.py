"""The allocator's cheap host queries: what a scheduler asks before it acts.

Every query reads the host ledger only (no device read, no dict built): O(1) per row, or one
numpy reduction over the rows; :meth:`HostQueries.pages_released` reads the host page
mirror, O(pages of the rows it is asked about). ``stats()`` (:mod:`graphalloc.inspection`)
is for humans.
"""

from __future__ import annotations

import numpy as np

from .errors import AlignmentError, ContractError, FrontierError, OverlapError, PositionError
from .inputs import as_counts, as_index, as_positions, as_rows

__all__ = ["HostQueries"]


def _page_runs(holders: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> tuple:
    """``(holder, page index)`` of every page index ``k`` in ``[lo[i], hi[i])`` of holder
    ``holders[i]`` (rows of the page mirror), as two flat int64 arrays."""
    n = np.maximum(hi - lo, 0)
    total = int(n.sum())
    seg = np.repeat(np.arange(len(holders)), n)
    k = np.arange(total) - np.repeat(np.cumsum(n) - n, n) + np.repeat(lo, n)
    return holders[seg], k


def _last_references(pages: np.ndarray, refs: np.ndarray) -> int:
    """How many distinct pages of ``pages`` (one entry per reference dropped) lose every
    reference they have (``refs``: the reference counts)."""
    if not len(pages):
        return 0
    page, dropped = np.unique(pages, return_counts=True)
    return int(np.count_nonzero(dropped == refs[page]))


class HostQueries:
    """A part of :class:`graphalloc.HybridAllocator`."""

    def n_free(self, pool: str = "full") -> int:
        """Free pages of ``pool`` (``"full"`` or ``"swa"``). O(1)."""
        if not isinstance(pool, str):
            raise ContractError(f"pool must be 'full' or 'swa', got {pool!r}")
        if pool == "full":
            return self.ledger.full.n_free
        if pool == "swa":
            return self.ledger.swa.n_free
        raise ContractError(f"pool must be 'full' or 'swa', got {pool!r}")

    @property
    def n_live(self) -> int:
        """Live request rows. O(max_reqs) numpy (one reduction)."""
        return int(np.count_nonzero(self.ledger.live))

    def live_rows(self) -> np.ndarray:
        """The live request rows, ascending (a new array). O(max_reqs)."""
        return np.flatnonzero(self.ledger.live)

    def is_live(self, row) -> bool:
        """Whether ``row`` is live. O(1)."""
        return bool(self.ledger.live[as_index(row, "row", self.config.max_reqs)])

    def seq_len(self, row) -> int:
        """Allocated length (positions) of ``row``. O(1)."""
        return int(self.ledger.seq_len[as_index(row, "row", self.config.max_reqs)])

    def frontier(self, row) -> int:
        """SWA eviction frontier (a position, page-aligned) of ``row``. O(1)."""
        return int(self.ledger.frontier[as_index(row, "row", self.config.max_reqs)])

    def seq_lens(self) -> np.ndarray:
        """Every row's allocated length, indexed by row (a copy; 0 for free rows), e.g. for
        :meth:`graphalloc.page_tables.PageTables.plan`. O(max_reqs)."""
        return self.ledger.seq_len.copy()

    def frontiers(self) -> np.ndarray:
        """Every row's SWA frontier, indexed by row (a copy). O(max_reqs)."""
        return self.ledger.frontier.copy()

    def pages_needed(self, rows, n_tokens) -> int:
        """New pages per pool that extending ``rows`` by ``n_tokens`` needs (the same count
        from each pool; none from the SWA pool in ring mode). O(rows)."""
        rows = as_rows(rows, self.config.max_reqs, "pages_needed")
        n = as_counts(n_tokens, len(rows), "pages_needed token counts")
        ps, length = self.config.page_size, self.ledger.seq_len[rows]
        return int((-(-(length + n) // ps) + (length // -ps)).sum())

    def pages_released(self, rows=(), *, advance=None, handles=()) -> tuple[int, int]:
        """``(FULL, SWA)`` pages that freeing these together, in one step, would return to
        the free rings, counting shared references: releasing ``rows``, moving the frontiers
        of ``advance = (rows, new_frontier_pos)`` forward, and dropping ``handles``. A page
        is freed only when every reference to it is among those dropped: a page that
        another request or a handle still holds is not (an SWA page goes when its last SWA
        holder lets it go, even while FULL holders remain). Without sharing this is
        ``ceil(L / ps)`` FULL and ``ceil(L / ps) - f / ps`` SWA pages per released row and
        ``(new - f) / ps`` SWA pages per advance.

        Inside an open ``free_group()`` it counts from the state the block has decided
        (rows released or handles dropped in it are refused, as a second free would be).
        Ring mode: a release returns ``ceil(L / ps)`` FULL and the R ring pages, an advance
        none (the ring pages stay), and handles do not exist. Bad input raises the
        planner's typed errors; nothing changes. Host only; cost: O(rows + handles +
        the pages they hold) numpy (one ``np.unique`` per pool)."""
        b = self._builder()  # the ledger as an open free group (if any) has decided it
        led, cfg, ps = b.ledger, self.config, self.config.page_size
        rel = b.live_rows(rows, "pages_released")
        adv_rows, adv_pos = np.zeros(0, np.int64), np.zeros(0, np.int64)
        if advance is not None:
            if not isinstance(advance, (tuple, list)) or len(advance) != 2:
                raise ContractError(f"advance takes a pair (rows, new_frontier_pos); got "
                                    f"{advance!r}")
            adv_rows = b.live_rows(advance[0], "pages_released advance")
            adv_pos = as_positions(advance[1], len(adv_rows), "pages_released advance")
            if np.isin(adv_rows, rel).any():
                raise OverlapError("pages_released: a row is both released and advanced; a "
                                   "released row's frontier cannot move in the same step")
            old, limit = led.frontier[adv_rows], led.seq_len[adv_rows] // ps * ps
            if (adv_pos % ps).any():
                i = int(np.flatnonzero(adv_pos % ps)[0])
                raise AlignmentError(f"pages_released: frontier {adv_pos[i]} (row "
                                     f"{adv_rows[i]}) must be a multiple of page_size {ps}")
            if (adv_pos < old).any():
                raise FrontierError("pages_released: a frontier would move backwards")
            if (adv_pos > limit).any():
                raise PositionError("pages_released: a frontier past the last whole page")
        hs = np.array([b.live_handle(h, "pages_released") for h in handles], dtype=np.int64)
        if len(np.unique(hs)) != len(hs):
            raise OverlapError("pages_released: a handle appears twice; pass each once")
        end = -(-led.seq_len[rel] // ps)
        if led.refs is None:  # ring mode: nothing is shared
            return int(end.sum()), len(rel) * cfg.swa_ring_pages
        refs = led.refs
        h_rows = cfg.max_reqs + hs
        h_end = led.h_len[hs] // ps
        zero = np.zeros(len(rel) + len(hs), dtype=np.int64)
        full = refs.page_of[_page_runs(np.concatenate([rel, h_rows]), zero,
                                       np.concatenate([end, h_end]))]
        swa_holders = np.concatenate([rel, adv_rows, h_rows])
        swa_lo = np.concatenate([led.frontier[rel], led.frontier[adv_rows],
                                 led.h_swa_start[hs]]) // ps
        swa_hi = np.concatenate([end, adv_pos // ps, h_end])
        swa = refs.swa_of[refs.page_of[_page_runs(swa_holders, swa_lo, swa_hi)]]
        return (_last_references(full.astype(np.int64), refs.full_ref),
                _last_references(swa.astype(np.int64), refs.swa_ref))

    # ---- speculative decoding --------------------------------------------------------------
    def committed_len(self, row) -> int:
        """Committed length C of ``row`` (``seq_len`` minus the speculative tail). O(1)."""
        return int(self.ledger.committed[as_index(row, "row", self.config.max_reqs)])

    def spec_len(self, row) -> int:
        """Speculative tail ``L - C`` of ``row``: slots of speculative steps not yet committed.
        O(1)."""
        r = as_index(row, "row", self.config.max_reqs)
        return int(self.ledger.seq_len[r] - self.ledger.committed[r])

    def committed_lens(self) -> np.ndarray:
        """Every row's committed length, indexed by row (a copy). O(max_reqs)."""
        return self.ledger.committed.copy()
