"""A step's keyword arguments turned into planner calls, in the step's order.

``step()``, ``plan()`` and ``fits()`` of :class:`graphalloc.HybridAllocator` take the same
arguments; :meth:`StepArguments._apply_step` applies them to a
:class:`~graphalloc.planner.StepBuilder` in this order: ``release``, ``commit``, ``trim``,
``evict`` / ``evict_all``, ``advance``, then ``decode`` (with ``lookahead``) and ``extend``.
One argument shape per kind: rows for ``release`` / ``evict`` / ``decode``, pairs
``(rows, values)`` for ``commit``, ``trim``, ``advance`` and ``extend``, a bool for
``evict_all``. Cost: O(rows) per argument (the planner's cost).
"""

from __future__ import annotations

import numpy as np

from .errors import ContractError, NestedGroupError, SpeculativeStateError
from .inputs import as_counts, is_empty
from .planner import StepBuilder

__all__ = ["StepArguments"]


def _pair(value, what: str, second: str):
    """``(rows, values)`` of a two-part step argument, refused unless exactly two parts."""
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise ContractError(f"{what} takes a pair (rows, {second}); got {value!r}")
    return value


class StepArguments:
    """The step-argument half of :class:`graphalloc.HybridAllocator` (see the module)."""

    def _apply_step(self, b: StepBuilder, release, commit, trim, evict, evict_all, advance,
                    decode, lookahead, extend, results: list) -> None:
        if not is_empty(release):
            b.release(b.live_rows(release, "release"))
        if commit is not None:
            rows, n = _pair(commit, "commit", "n_accepted")
            b.commit(b.live_rows(rows, "commit"), n)
        if trim is not None:
            rows, n = _pair(trim, "trim", "new_len")
            b.trim(b.live_rows(rows, "trim"), n)
        if not isinstance(evict_all, bool):
            raise ContractError(f"evict_all must be a bool, got {evict_all!r}")
        if isinstance(evict, (bool, np.bool_)):
            raise ContractError("evict takes rows; for every live request pass "
                                "evict_all=True (evict=0 would mean row 0)")
        if evict_all:
            b.evict(np.flatnonzero(b.ledger.live if b.pending is None
                                   else b.ledger.live & ~b.pending))
        elif not is_empty(evict):
            b.evict(b.live_rows(evict, "evict"))
        if advance is not None:
            rows, pos = _pair(advance, "advance", "new_frontier_pos")
            b.advance_frontier(b.live_rows(rows, "advance"), pos, "advance")
        if not is_empty(decode):
            d_rows = b.live_rows(decode, "alloc_decode")
            if lookahead is None:
                ones = np.ones(len(d_rows), dtype=np.int64)
                results.append((d_rows, b.extend(d_rows, ones, "alloc_decode"), ones))
            else:
                n = 1 + as_counts(lookahead, len(d_rows), "lookahead")
                results.append((d_rows, b.extend(d_rows, n, "alloc_decode", True), n))
        elif lookahead is not None:
            raise SpeculativeStateError("lookahead= applies to decode rows; none were given")
        if extend is not None:
            rows, n = _pair(extend, "extend", "n_tokens")
            e_rows = b.live_rows(rows, "alloc_extend")
            n = as_counts(n, len(e_rows), "alloc_extend token counts")
            results.append((e_rows, b.extend(e_rows, n), n))

    def _refuse_frees_in_group(self, release, commit, trim, evict, evict_all, advance,
                               *_allocs) -> None:
        if commit is not None or trim is not None:
            raise NestedGroupError("commit / trim inside free_group(): they shorten a request "
                                   "that the block's deferred frees may still read; commit "
                                   "before or after the block")
        if not is_empty(release) or evict_all or (evict is not None and not isinstance(
                evict, bool) and not is_empty(evict)) or advance is not None:
            raise NestedGroupError("inside free_group() call release() / evict_window() / "
                                   "advance_frontier() (deferred to the block's end) instead "
                                   "of step(release=, evict=, advance=)")
