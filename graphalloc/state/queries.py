"""The cheap host queries a scheduler asks before it acts: counts, lengths, frontiers.

Every query reads the host ledger only (no device read, no dict built): O(1) per row, or one
numpy reduction over the rows. They show the committed state: a step being planned, a
recorded ``scheduler_step()`` and the frees of an open ``free_group()`` are not in them until
they run. What a set of frees would give back (sharing counted) is a dry run of the planner:
:meth:`graphalloc.HybridAllocator.pages_released`. ``stats()`` is for humans.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..errors import ContractError
from ..inputs import as_counts, as_index, as_rows

__all__ = ["HostQueries", "HandleInfo"]


@dataclasses.dataclass(frozen=True)
class HandleInfo:
    """What a handle holds: ``n_tokens`` (FULL ``[0, n)``), ``swa_start`` (SWA held for
    ``[swa_start, n)``; equal to ``n_tokens`` after a tombstone), page counts, and the pages
    dropping it would free (``frees_*``: those it is the last holder of).

    Inside an open ``free_group()`` the holdings are the committed ones (the block has not
    run) and ``frees_*`` count what dropping the handle would ADD to the block's recorded
    frees when it closes (the rule of ``pages_released``): a page the block's releases
    leave to this handle alone counts. A handle dropped in the open block is refused
    (``UnknownHandleError``)."""

    handle: int
    n_tokens: int
    swa_start: int
    n_full_pages: int
    n_swa_pages: int
    frees_full: int
    frees_swa: int


class HostQueries:
    """Queries over one ledger (the allocator delegates to them one line each)."""

    def __init__(self, config, ledger):
        self.config, self.ledger = config, ledger

    def n_free(self, pool: str = "full") -> int:
        """Free pages of ``pool`` (``"full"``, ``"swa"``: the first window pool, or
        ``"window1"``, ``"window2"``, ...: a model's further window pools), or free
        recurrent-state slots (``"state"``). O(1)."""
        if isinstance(pool, str) and pool == "full":
            return self.ledger.full.n_free
        if isinstance(pool, str) and pool == "swa":
            return self.ledger.swa.n_free
        if isinstance(pool, str) and pool == "state":
            return self.ledger.states.n_free if self.config.num_state_slots else 0
        for window in self.ledger.windows:
            if isinstance(pool, str) and pool == f"window{window.index}":
                return window.free.n_free
        further = "".join(f", 'window{w.index}'" for w in self.ledger.windows)
        raise ContractError(f"pool must be 'full', 'swa'{further} or 'state', got {pool!r}")

    def n_live(self) -> int:
        return int(np.count_nonzero(self.ledger.live))

    def live_rows(self) -> np.ndarray:
        return np.flatnonzero(self.ledger.live)

    def _row(self, row) -> int:
        return as_index(row, "row", self.config.max_reqs)

    def is_live(self, row) -> bool:
        return bool(self.ledger.live[self._row(row)])

    def seq_len(self, row) -> int:
        return int(self.ledger.seq_len[self._row(row)])

    def frontier(self, row) -> int:
        return int(self.ledger.frontier[self._row(row)])

    def committed_len(self, row) -> int:
        return int(self.ledger.committed[self._row(row)])

    def spec_len(self, row) -> int:
        r = self._row(row)
        return int(self.ledger.seq_len[r] - self.ledger.committed[r])

    def pages_needed(self, rows, n_tokens) -> int:
        """New pages per pool that extending ``rows`` by ``n_tokens`` needs (the same count
        from each pool; none from the SWA pool in ring mode). O(rows)."""
        rows = as_rows(rows, self.config.max_reqs, "pages_needed")
        n = as_counts(n_tokens, len(rows), "pages_needed token counts")
        ps, length = self.config.page_size, self.ledger.seq_len[rows]
        return int((-(-(length + n) // ps) + (length // -ps)).sum())

    def live_handles(self) -> np.ndarray:
        return np.flatnonzero(self.ledger.h_live)

    def stats(self) -> dict:
        """Host-side counts for humans (no device read; builds dicts over the live rows)."""
        led, cfg = self.ledger, self.config
        live = np.flatnonzero(led.live)
        return {
            "full_free_pages": led.full.n_free,
            "full_used_pages": cfg.num_full_pages - led.full.n_free,
            "swa_free_pages": led.swa.n_free,
            "swa_used_pages": cfg.num_swa_pages - led.swa.n_free,
            "live_requests": len(live),
            "seq_len": {int(r): int(led.seq_len[r]) for r in live},
            "frontier": {int(r): int(led.frontier[r]) for r in live},
            "handles": int(np.count_nonzero(led.h_live)),
            **{f"window{w.index}_free_pages": w.free.n_free for w in led.windows},
        }
