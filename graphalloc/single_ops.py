"""The allocator's single-operation methods: each one step of its own (a free as a block).

A part of :class:`graphalloc.HybridAllocator` (a mixin over its protocol: ``step``,
``_deferred``, ``_plan``, ``run``, ``_group``, ``config``). Every method validates its
inputs in the planner and changes nothing when refused.
"""

from __future__ import annotations

import numpy as np
import torch

from .errors import NestedGroupError
from .inputs import as_index
from .planner import StepBuilder
from .results import AllocResult

__all__ = ["SingleOps"]


class SingleOps:
    """Single operations of :class:`graphalloc.HybridAllocator` (see the module)."""

    def alloc_extend(self, rows, extend_lens) -> AllocResult:
        """Prefill / chunked prefill: ``extend_lens[i]`` new positions for ``rows[i]``.

        Exact page estimate: a request at length L needs ``ceil((L + n) / ps) - ceil(L / ps)``
        new pages in each pool (none from the SWA pool in ring mode). Refused whole if
        either pool is short.
        """
        return self.step(extend=(rows, extend_lens))

    def alloc_decode(self, rows, lookahead=None) -> AllocResult:
        """One token for each request: a new page in both pools only where the position
        starts a page. ``lookahead=k`` (an int, or one per row): ``1 + k`` speculative tokens
        per row instead (see :meth:`step`)."""
        return self.step(decode=rows, lookahead=lookahead)

    def commit(self, rows, n_accepted) -> None:
        """Speculative decoding: keep ``n_accepted[i]`` tokens of each row's oldest
        speculative step and give back the pages wholly past what stays (``step(commit=)``;
        one step, refused whole when its frees exceed the frozen step shape). Cost: O(rows +
        pages freed) host work (the compiled planner where built) and one launch or
        replay."""
        self.step(commit=(rows, n_accepted))

    def trim(self, rows, new_len) -> None:
        """Cut requests to ``new_len`` tokens, giving back the pages wholly past it (a
        partial page stays and is continued); refused below the frontier plus the window
        (``step(trim=)``; one step). Cost: O(rows + pages freed) host work and one launch or
        replay."""
        self.step(trim=(rows, new_len))

    def evict_window(self, rows=None) -> None:
        """Advance frontiers by the window rule (``rows=None``: every live request)."""
        self._deferred(lambda b: self._evict_rows(b, rows))

    def advance_frontier(self, rows, new_frontier_pos) -> None:
        """Move frontiers to the given page-aligned positions, freeing the SWA pages of
        ``[old, new)`` (the low-level form of :meth:`evict_window`)."""
        def op(b):
            arr = b.live_rows(rows, "advance_frontier")
            b.advance_frontier(arr, new_frontier_pos)
            return arr
        self._deferred(op)

    def release(self, rows) -> None:
        """Free everything the requests own (finished or retracted) and return their rows.

        Positions below the frontier free only FULL pages; the rest free both; a partial
        tail page is freed whole; a protected prefix is not freed.
        """
        def op(b):
            arr = b.live_rows(rows, "release")
            b.release(arr)
            return arr
        self._deferred(op)

    def load_back(self, row, new_frontier_pos) -> torch.Tensor:
        """Re-pair the full pages of ``[new_frontier_pos, frontier)`` with fresh SWA pages
        after their KV came back from host memory (pool mode); returns the ``[n * ps]`` SWA
        slots to fill (a view of the output buffer: copy the KV in before the next step).
        One planned step (an ``AL_SWA_ONLY`` descriptor row), refused whole on any broken
        rule. The frontier moves back: the one backward move."""
        if self._group is not None and self._group.touched[
                as_index(row, "load_back row", self.config.max_reqs)]:
            raise NestedGroupError(f"load_back: request {row} is freed or evicted in the open "
                                   "free_group(); load it back after the block")
        results: list = []

        def op(b):
            first = b.load_back(row, new_frontier_pos)
            n = b.n_tokens - first
            results.append((np.array([row], dtype=np.int64), np.array([first]), np.array([n])))
        result = self.run(self._plan(op, results))
        return result.swa_slots[int(result.first_lane[0]):]

    @staticmethod
    def _evict_rows(b: StepBuilder, rows):
        if rows is None:
            live = b.ledger.live if b.pending is None else b.ledger.live & ~b.pending
            arr = np.flatnonzero(live)
        else:
            arr = b.live_rows(rows, "evict_window")
        b.evict(arr)
        return arr
