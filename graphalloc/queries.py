"""The allocator's cheap host queries: what a scheduler asks before it acts.

Every query reads the host ledger only (no device read, no dict built): O(1) per row, or one
numpy reduction over the rows. ``stats()`` (:mod:`graphalloc.inspection`) is for humans.
"""

from __future__ import annotations

import numpy as np

from .errors import ContractError
from .inputs import as_counts, as_index, as_rows

__all__ = ["HostQueries"]


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
