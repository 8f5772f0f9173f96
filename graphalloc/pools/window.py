"""The window pool: pages of sliding-window (or chunked local) layers, paired with FULL pages.

A window pool keeps, for each FULL page a request still needs in its window layers, one
page of its own at the same offsets (``full_to_swa``, page-dense; the host mirror
``PageRefs.swa_of``). A request's *frontier* f (page-aligned, forward only) says where its
window pages start: ``[0, f)`` has FULL pages only, ``[f, L)`` both. What moves the frontier
is the pool's **rule** (:class:`SlidingRule` here, :class:`~graphalloc.pools.chunked.
ChunkRule` for chunked local attention): ``needed_from(C)``, the first position a window
layer still reads at committed length C. How its pages are drawn is its **policy**:

=======  ======================================================================================
pooled   one shared FIFO free ring of window pages, pages referenced like FULL pages (prefix
         sharing, handles, load-back); the frontier's move drops references
ring     each request owns a fixed ring of R window pages, popped at admission and returned
         at release; a frontier move only clears the mapping (no sharing, no load-back)
=======  ======================================================================================

Ledger slice (:class:`~graphalloc.state.ledger.Ledger`): ``frontier`` per request,
``h_swa_start`` per handle, the ``swa`` free ring, and in the page mirror ``swa_of``,
``swa_ref``, ``swa_ring``. Device tables: ``full_to_swa``, ``swa_free`` and (ring policy)
``ring_pages``. A model without window layers gets :class:`NoWindow`: the same questions,
answered "nothing to hold".

Ledger of one request (ps the page size)::

    release (L, f)            window refs of [f, ceil_page(L)) dropped (ring: ring returned)
    cut to L' (trim, commit)  window refs of [ceil_page(L'), ceil_page(L)) dropped
    evict (f -> f')           f' = max(f, floor_page(needed_from(min(L0, C))))
    advance (f -> f')         window refs of [f, f') dropped, FULL kept (ring: mapping cleared)
    trim to L'                refused when f > 0 and needed_from(L') < f (pages gone)

Cost: O(rows) numpy per call, as the planner's kinds.
"""

from __future__ import annotations

import numpy as np

from ..kernels.abi import AL_FLAGS, AL_NO_WINDOW, AL_RING, AL_SWA_POP, REL_CLEAR, REL_FULL
from ..kernels.abi import REL_RING_RETURN as _RING_RETURN
from ..plan.allocation import ring_admit
from ..plan.refusals import Kind, Refusal, RefusalCode
from ..plan.release_rows import add_release, drop

__all__ = ["SlidingRule", "WindowPool", "NoWindow", "POOLED", "RING"]

POOLED, RING = "pooled", "ring"


class SlidingRule:
    """A sliding window of W model tokens: the next query (at position C) reads keys from
    ``C - W + 1`` on, so the allocator keeps ``[C - w, C)`` with ``w = max(W - 1, 1)``
    (``AllocatorConfig.sliding_window``). ``reach``: the most positions behind C a window
    layer reads (``w``), which sizes the pool."""

    kind = "window"
    c_kind = 0  # the compiled twin's rule id (_cplan_window.c)

    def __init__(self, model_window: int):
        self.model_window = int(model_window)  # W, Hugging Face's config.sliding_window
        self.tokens = max(self.model_window - 1, 1)  # the allocator's window w
        self.reach = self.tokens

    def needed_from(self, length):
        """First position a window layer reads at committed length ``length`` (an int or
        an int64 array)."""
        return np.maximum(length - self.tokens, 0)

    def min_length(self, frontier):
        """The shortest length whose window starts at or after ``frontier`` (> 0): a trim
        below it would need evicted pages."""
        return frontier + self.tokens

    def lane_start(self, length, query, model_window: int):
        """First position the lane's first query (at ``length - query``) reads, with the
        page tables' model window (``PageTableSpec.model_window``)."""
        return np.maximum(length - (np.maximum(query, 1) - 1) - model_window, 0)

    def describe(self) -> str:
        return f"sliding window W = {self.model_window} (the allocator keeps {self.tokens})"


class WindowPool:
    """One window pool: a :class:`SlidingRule` or chunk rule, a policy, its pages.

    ``index`` is its place among the model's window pools (stage one serves one, index 0).
    The planner asks it, kind by kind, what the window layers hold; it answers with ranges
    the planner's page mirror drops (``ctx.drop``) or with rows of its own (ring policy).
    """

    has_window = True

    def __init__(self, rule, num_pages: int, ring_pages: int = 0, index: int = 0):
        self.rule = rule
        self.num_pages = int(num_pages)
        self.ring_pages = int(ring_pages)
        self.policy = RING if self.ring_pages else POOLED
        self.index = index
        self.shares = self.policy == POOLED  # prefix sharing, handles, load-back

    # ---- sizing ---------------------------------------------------------------------------
    @staticmethod
    def descriptor_sections(config) -> tuple:
        """None of its own: the first window pool is planned in the step's main rows
        (:meth:`~graphalloc.pools.full.FullPool.descriptor_sections`)."""
        return ()

    def min_pages(self, page_size: int, request_pages: int) -> int:
        """Pages one request can hold at its window (pooled: ``ceil(reach / ps) + 1``, capped
        by the pages one request can own; ring: its ring)."""
        if self.policy == RING:
            return self.ring_pages
        return min(-(-self.rule.reach // page_size) + 1, request_pages)

    # ---- the window rule ------------------------------------------------------------------
    def targets(self, ledger, rows: np.ndarray, len_at_start=None) -> np.ndarray:
        """The rule's frontier for ``rows``: ``max(f, floor_page(needed_from(min(L0, C))))``
        (L0 the length when the step began: a row is evicted before it allocates)."""
        length = (ledger.seq_len if len_at_start is None else len_at_start)[rows]
        length = np.minimum(length, ledger.committed[rows])
        ps = ledger.config.page_size
        return np.maximum(ledger.frontier[rows], self.rule.needed_from(length) // ps * ps)

    def check_trim(self, ctx, rows: np.ndarray, new_len: np.ndarray) -> None:
        """Refuse a trim whose new length's window would need pages already evicted."""
        frontier = ctx.ledger.frontier[rows]
        limit = self.rule.min_length(frontier)
        low = (frontier > 0) & (new_len < limit)
        if low.any():
            i = int(np.flatnonzero(low)[0])
            raise Refusal(RefusalCode.TRIM_BELOW_WINDOW, Kind.TRIM, int(rows[i]),
                          int(new_len[i]), int(limit[i]))

    # ---- frees ------------------------------------------------------------------------------
    def release(self, ctx, rows: np.ndarray, frontier: np.ndarray, end_page: np.ndarray) -> None:
        """A release: FULL ``[0, ceil_page(L))`` and the window's ``[f, ceil_page(L))``."""
        ps = ctx.ps
        zero = np.zeros(len(rows), dtype=np.int64)
        if self.policy == RING:
            add_release(ctx, rows, zero, frontier // ps, REL_FULL)
            add_release(ctx, rows, frontier, end_page - frontier // ps, REL_FULL | REL_CLEAR)
            add_release(ctx, rows, zero, np.full(len(rows), self.ring_pages, dtype=np.int64),
                            _RING_RETURN)
        else:
            drop(ctx, rows, zero, end_page, frontier // ps, end_page)

    def cut(self, ctx, rows: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> None:
        """A cut of pages ``[lo, hi)`` (trim, commit): FULL and window references."""
        if self.policy == RING:
            add_release(ctx, rows, lo * ctx.ps, hi - lo, REL_FULL | REL_CLEAR)
        else:
            drop(ctx, rows, lo, hi, lo, hi)

    def advance(self, ctx, rows: np.ndarray, old: np.ndarray, new: np.ndarray) -> int:
        """Frontiers from ``old`` to ``new``: the window's pages of ``[old, new)`` go (ring:
        only their mapping). Returns the window pages freed."""
        ps = ctx.ps
        n_pages = (new - old) // ps
        if self.policy == RING:
            add_release(ctx, rows, old, n_pages, REL_CLEAR)
            return int(n_pages.sum())
        empty = np.zeros(len(rows), dtype=np.int64)
        return drop(ctx, rows, empty, empty, old // ps, new // ps)

    # ---- allocations ------------------------------------------------------------------------
    def check_admit(self, ctx, rows: np.ndarray) -> None:
        """Ring policy: each admitted request pops its ring (refused when short)."""
        if self.policy == RING:
            need = self.ring_pages * len(rows)
            free = ctx.ledger.swa.n_free
            if need > free:
                raise Refusal(RefusalCode.RING_ADMIT_SHORT, Kind.ADMIT, int(rows[0]), free,
                              need)

    def admit(self, ctx, rows: np.ndarray) -> None:
        """Ring policy: one ``AL_RING_ADMIT`` row per request pops its ring pages."""
        if self.policy == RING:
            ring_admit(ctx, rows, self.ring_pages)

    def pages_needed(self, n_new_pages: int) -> int:
        """Window pages an allocation of ``n_new_pages`` FULL pages pops (ring: none)."""
        return 0 if self.policy == RING else n_new_pages

    def check_span(self, ctx, rows: np.ndarray, end: np.ndarray, kind: Kind) -> None:
        """Ring policy: a request's pages from its frontier must fit its ring."""
        if self.policy != RING:
            return
        span = -(-end // ctx.ps) - ctx.ledger.frontier[rows] // ctx.ps
        if (span > self.ring_pages).any():
            i = int(np.flatnonzero(span > self.ring_pages)[0])
            raise Refusal(RefusalCode.RING_SPAN_TOO_LONG, kind, int(rows[i]), int(span[i]),
                          self.ring_pages)

    def pop_columns(self, ctx, out: np.ndarray, need: int, pages_before: np.ndarray) -> int:
        """Fill the allocation rows' window columns (the pooled pops, or the ring flag);
        returns the first popped ring position (0 for the ring policy)."""
        if self.policy == RING:
            out[:, AL_FLAGS] = AL_RING
            return 0
        led = ctx.ledger
        pop = led.swa.pop(need) if need else led.swa.head
        out[:, AL_SWA_POP] = (pop + pages_before) % led.swa.capacity
        return pop

    def take_start(self, ledger, rows: np.ndarray, n: np.ndarray) -> np.ndarray:
        """Where a handle taken on ``rows``' first ``n`` tokens starts holding window pages."""
        return np.minimum(ledger.frontier[rows], n)

    def admitted_frontier(self, swa_start: np.ndarray) -> np.ndarray:
        """The frontier of a request admitted on a handle: where its window pages start."""
        return swa_start

    def lane_window(self, length, query, model_window: int, frontier, end_page, ps: int):
        """``(window start, first window page)`` of attention lanes (the page tables): the
        first position the lane's first query reads, never below the frontier."""
        start = np.maximum(self.rule.lane_start(length, query, model_window), frontier)
        return start, start // ps

    def load_back_allowed(self) -> None:
        if self.policy == RING:
            raise Refusal(RefusalCode.LOAD_BACK_IN_RING_MODE, Kind.LOAD_BACK)

    def moves_allowed(self, kind: Kind) -> None:
        """An explicit frontier move (advance) needs a window pool."""
        return None

    def present(self, swa_start: int, n_tokens: int, page_size: int) -> bool:
        """Whether a holder whose window pages start at ``swa_start`` still has the window
        of a request admitted on its first ``n_tokens``."""
        return swa_start <= int(self.rule.needed_from(n_tokens)) // page_size * page_size

    def held_from(self, starts: np.ndarray, lengths: np.ndarray, ps: int) -> np.ndarray:
        """Where holders (frontiers, handles' starts) hold window pages from."""
        return starts

    def owned_on_device(self, snap: dict, row: int, first_page: int, end_page: int,
                        ps: int) -> np.ndarray:
        """The window pages request ``row`` holds by the device tables of ``snap`` (an
        audit): its ring (ring policy), or the peers of its FULL pages from its frontier."""
        if self.policy == RING:
            return snap["ring_pages"][row, :self.ring_pages]
        full = snap["req_to_token"][row, np.arange(first_page, end_page) * ps] // ps
        return snap["full_to_swa"][np.clip(full, 0, None) * ps] // ps


class NoWindow:
    """A model without window layers: frontiers stay 0, nothing is held, nothing evicted.
    Allocation rows carry ``AL_NO_WINDOW`` (the kernels pop and map no window page)."""

    has_window = False
    shares = True
    policy = None
    ring_pages = 0
    num_pages = 0
    rule = None
    index = -1

    @staticmethod
    def descriptor_sections(config) -> tuple:
        return ()

    def min_pages(self, page_size: int, request_pages: int) -> int:
        return 0

    def targets(self, ledger, rows, len_at_start=None):
        return ledger.frontier[rows]

    def check_trim(self, ctx, rows, new_len) -> None:
        return None

    def release(self, ctx, rows, frontier, end_page) -> None:
        drop(ctx, rows, np.zeros(len(rows), dtype=np.int64), end_page, end_page, end_page)

    def cut(self, ctx, rows, lo, hi) -> None:
        drop(ctx, rows, lo, hi, hi, hi)

    def advance(self, ctx, rows, old, new) -> int:
        return 0

    def check_admit(self, ctx, rows) -> None:
        return None

    def admit(self, ctx, rows) -> None:
        return None

    def pages_needed(self, n_new_pages: int) -> int:
        return 0

    def check_span(self, ctx, rows, end, kind) -> None:
        return None

    def pop_columns(self, ctx, out, need, pages_before) -> int:
        out[:, AL_FLAGS] = AL_NO_WINDOW
        return 0

    def take_start(self, ledger, rows, n):
        return n  # nothing held: [n, n)

    def admitted_frontier(self, swa_start):
        return np.zeros(len(swa_start), dtype=np.int64)  # no frontier: it stays 0

    def lane_window(self, length, query, model_window, frontier, end_page, ps):
        return np.maximum(length, frontier), end_page  # no window pages: an empty range

    def load_back_allowed(self) -> None:
        raise Refusal(RefusalCode.NO_WINDOW_POOL, Kind.LOAD_BACK)

    def moves_allowed(self, kind: Kind) -> None:
        raise Refusal(RefusalCode.NO_WINDOW_POOL, kind)

    def present(self, swa_start: int, n_tokens: int, page_size: int) -> bool:
        return True

    def held_from(self, starts, lengths, ps):
        return -(-lengths // ps) * ps  # nothing held: from past the last page

    def owned_on_device(self, snap, row, first_page, end_page, ps):
        return np.zeros(0, dtype=np.int64)
