"""The host side of one device FIFO free ring: where its head is and how many entries it
holds (the device holds the entries; :class:`~graphalloc.state.ledger.Ledger` and every
window pool's slice, :class:`~graphalloc.state.window_ledger.WindowLedger`, keep one each).
Cost: O(1) per call.
"""

from __future__ import annotations

import numpy as np

from .journal import Journal

__all__ = ["FreeRing", "HEAD", "N_FREE"]

HEAD, N_FREE = 0, 1  # the two words of a ring's row


class FreeRing:
    """Host side of one device FIFO free list of ``capacity`` page ids: a view of a
    ``[head, n_free]`` row (a row of :attr:`Ledger.rings`, or a window pool's own).

    Entries ``[head, head + n_free)`` (mod capacity) are free pages. A pop of k takes
    positions ``head .. head+k-1``; a push of k writes ``head+n_free .. head+n_free+k-1``.
    Pops and pushes of one step touch disjoint positions whenever the pops fit in what was
    free before the step. ``pop`` / ``push`` write through the journal.
    """

    __slots__ = ("capacity", "_row", "_journal")

    def __init__(self, capacity: int, row: np.ndarray, journal: Journal):
        self.capacity = capacity
        self._row = row  # a view: [head, n_free]
        self._journal = journal

    @property
    def head(self) -> int:
        return int(self._row[HEAD])

    @property
    def n_free(self) -> int:
        return int(self._row[N_FREE])

    @property
    def tail(self) -> int:
        """The ring position the next push writes."""
        return (int(self._row[HEAD]) + int(self._row[N_FREE])) % self.capacity

    def pop(self, n: int) -> int:
        """Take ``n`` entries at the head; returns the first position."""
        start = int(self._row[HEAD])
        self._journal.put(self._row, slice(None), ((start + n) % self.capacity,
                                                   int(self._row[N_FREE]) - n))
        return start

    def push(self, n: int) -> int:
        """Add ``n`` entries at the tail; returns the first position."""
        start = self.tail
        self._journal.put(self._row, N_FREE, int(self._row[N_FREE]) + n)
        return start
