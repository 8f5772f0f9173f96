"""One graphalloc step per scheduler iteration: what the seams record, and how it runs.

Engines free, evict and allocate through many small calls per iteration (SGLang:
``release_kv_cache`` per finished request, ``_evict_swa`` per request, one
``alloc_*`` per batch; vLLM: ``free`` and ``allocate_slots`` per request). The
seams (:mod:`.sglang`, :mod:`.vllm`) record those calls in an
:class:`IterationStep` and run them as ONE :meth:`HybridAllocator.step` --
releases, then frontier advances, then allocations, the step's own order, so the
pages the frees return are available to the allocations of the same step.

Host accounting (what lets a seam answer "does it fit" per call, O(1), without a
dry-run plan): with ``ps = page_size``, a request at allocated length L and
frontier f holds ``ceil(L / ps)`` FULL pages and ``ceil(L / ps) - f / ps`` SWA
pages; releasing it returns exactly those, advancing its frontier to g returns
``(g - f) / ps`` SWA pages, and extending it to length T takes
``ceil(T / ps) - ceil(L / ps)`` pages from EACH pool. So, per pool::

    free after the step = n_free(pool) + freed(pool) - needed

This is exact in pool mode while no page is shared (the seams take no prefix
handles yet). Ring mode is refused: its admit is a device step of its own.

Only the frozen shape of the *frees* (``max_release_rows``, ``max_step_pages``)
is not predicted here: a step refused for it (:class:`BatchTooLargeError`,
nothing changed) is rerun as the frees through ``alloc.free_group()`` (which
splits them into as many steps as the shape needs) and then the allocations:
more than one step that iteration, reported in the step count.
"""

from __future__ import annotations

import numpy as np

from ..allocator import AllocResult, HybridAllocator
from ..errors import BatchTooLargeError, ConfigError, OverlapError, UnknownRequestError

__all__ = ["IterationStep"]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class IterationStep:
    """The frees, frontier moves and allocations recorded for the next step of ``alloc``.

    Owns three host dicts keyed by request row (insertion order = lane order of the
    allocations), and running page totals. Invariants: a row is in at most one of
    ``releases`` and ``extends``/``advances`` (a release cancels the row's other
    records); every recorded row is live in ``alloc``; ``freed``/``needed`` equal the
    sums over the records. Cost: every method is O(1) per row (host ints, the
    allocator's O(1) queries); :meth:`run` is one step.
    """

    def __init__(self, alloc: HybridAllocator, owner: str):
        if not isinstance(alloc, HybridAllocator):
            raise ConfigError(f"{owner} takes a graphalloc.HybridAllocator, got "
                              f"{type(alloc).__name__}")
        cfg = alloc.config
        if cfg.ring_mode:
            raise ConfigError(
                f"{owner} needs a pool-mode allocator (swa_ring_pages=0): in ring mode every "
                "admit is a device step of its own and the per-call page accounting of the "
                "seam does not hold")
        self.alloc = alloc
        self.ps = cfg.page_size
        self.releases: dict[int, tuple[int, int]] = {}  # row -> (FULL, SWA) pages returned
        self.advances: dict[int, tuple[int, int]] = {}  # row -> (new frontier, SWA pages)
        self.extends: dict[int, tuple[int, int]] = {}  # row -> (tokens, pages per pool)
        self.freed_full = self.freed_swa = self.needed = self.n_tokens = 0
        self.n_rows = 0  # rows of ``extends`` (every record allocates >= 1 token)

    # ---- queries ---------------------------------------------------------------------
    def __bool__(self) -> bool:
        return bool(self.releases or self.advances or self.extends)

    def free_pages(self, pool: str) -> int:
        """Pages of ``pool`` free once the recorded step has run. O(1)."""
        freed = self.freed_full if pool == "full" else self.freed_swa
        return self.alloc.n_free(pool) + freed - self.needed

    def length(self, row: int) -> int:
        """``row``'s length once the recorded step has run."""
        rec = self.extends.get(row)
        return self.alloc.seq_len(row) + (rec[0] if rec else 0)

    def frontier(self, row: int) -> int:
        """``row``'s frontier once the recorded step has run."""
        rec = self.advances.get(row)
        return rec[0] if rec else self.alloc.frontier(row)

    def held_pages(self, row: int) -> tuple[int, int]:
        """(FULL, SWA) pages ``row`` holds now (before the recorded step)."""
        end = _ceil_div(self.alloc.seq_len(row), self.ps)
        return end, end - self.alloc.frontier(row) // self.ps

    def check_row(self, row, what: str) -> int:
        """``row`` as an int, refused unless live and not released in this iteration."""
        if isinstance(row, (bool, np.bool_)) or not isinstance(row, (int, np.integer)):
            raise UnknownRequestError(f"{what}: req_pool_idx must be an int row, got {row!r}")
        r = int(row)
        if not 0 <= r < self.alloc.config.max_reqs or not self.alloc.is_live(r):
            raise UnknownRequestError(f"{what}: request row {r} is not a live request row")
        if r in self.releases:
            raise UnknownRequestError(f"{what}: request row {r} was released in this "
                                      "iteration; its release runs with the next step")
        return r

    # ---- recording ---------------------------------------------------------------------
    def release(self, row: int) -> None:
        """Record the release of live ``row`` (cancels its recorded advance/extension)."""
        self._drop(row)
        full, swa = self.held_pages(row)
        self.releases[row] = (full, swa)
        self.freed_full += full
        self.freed_swa += swa

    def reserve(self, items) -> list[int] | None:
        """Record a batch, whole or not at all.

        ``items``: ``(row or None, target_len, new_frontier or None)`` per request, rows
        distinct; ``None`` admits a new row (length 0) when the batch fits. The row
        grows to ``target_len`` (never shrinks) and its frontier moves to
        ``new_frontier`` (forward, page-aligned). Returns the rows (new ones admitted:
        host only in pool mode), or ``None`` when a pool or the request rows are short,
        with nothing changed. A batch over the frozen allocation shape raises
        :class:`BatchTooLargeError`, nothing changed.
        """
        cfg, ps = self.alloc.config, self.ps
        items = list(items)
        named = [row for row, _, _ in items if row is not None]
        if len(set(named)) != len(named):
            raise OverlapError("a request appears twice in one batch; pass each once")
        d_need = d_swa = d_tokens = d_rows = n_new = 0
        plan = []
        for row, target, new_front in items:
            length = 0 if row is None else self.alloc.seq_len(row)
            prior = self.extends.get(row, (0, 0)) if row is not None else (0, 0)
            n = max(int(target) - length, 0)
            pages = _ceil_div(length + n, ps) - _ceil_div(length, ps)
            if n > cfg.max_tokens_per_alloc_row:
                raise BatchTooLargeError(
                    f"request row {row} would allocate {n} tokens in one step; the frozen "
                    f"max_tokens_per_alloc_row is {cfg.max_tokens_per_alloc_row}: schedule "
                    "smaller chunks, or size the allocator with AllocatorConfig.for_engine")
            d_need += pages - prior[1]
            d_tokens += n - prior[0]
            d_rows += (n > 0) - (prior[0] > 0)
            swa = 0
            if row is None:
                n_new += 1
            elif new_front is not None and new_front > self.frontier(row):
                old = self.advances.get(row, (0, 0))[1]
                swa = (new_front - self.alloc.frontier(row)) // ps
                d_swa += swa - old
            plan.append((row, n, pages, new_front, swa))
        for have, cap, name in ((self.n_rows + d_rows, cfg.max_alloc_rows, "max_alloc_rows"),
                                (self.n_tokens + d_tokens, cfg.max_step_tokens,
                                 "max_step_tokens")):
            if have > cap:
                raise BatchTooLargeError(
                    f"this iteration's step would need {have} for the frozen {name} {cap}: "
                    "schedule less per iteration, or size the allocator with "
                    "AllocatorConfig.for_engine from the engine's budgets")
        if (self.free_pages("full") < d_need or self.free_pages("swa") + d_swa < d_need
                or (n_new and n_new > cfg.max_reqs - self.alloc.n_live)):
            return None
        rows = []
        for row, n, pages, new_front, swa in plan:
            if row is None:
                row = self.alloc.admit()  # pool mode: host only, no device work
            elif swa:
                self.freed_swa += swa - self.advances.get(row, (0, 0))[1]
                self.advances[row] = (int(new_front), swa)
            prior = self.extends.pop(row, (0, 0))
            self.needed += pages - prior[1]
            self.n_tokens += n - prior[0]
            self.n_rows += (n > 0) - (prior[0] > 0)
            if n:
                self.extends[row] = (n, pages)
            rows.append(row)
        return rows

    def _drop(self, row: int) -> None:
        n, pages = self.extends.pop(row, (0, 0))
        self.needed -= pages
        self.n_tokens -= n
        self.n_rows -= n > 0
        self.freed_swa -= self.advances.pop(row, (0, 0))[1]

    # ---- the step ----------------------------------------------------------------------
    def run(self) -> tuple[AllocResult | None, int]:
        """Run the recorded work: ONE step (more only when the frees exceed the frozen
        release shape, see the module docstring). Returns ``(result, steps_run)``;
        ``result`` is ``None`` when nothing was allocated. Lanes: the extensions in
        recording order. A step refused for pages (the accounting was off: shared
        pages) raises with the records kept."""
        alloc = self.alloc
        if not self:
            return None, 0
        before = alloc.steps_run
        release = np.fromiter(self.releases, dtype=np.int64, count=len(self.releases))
        adv_rows = np.fromiter(self.advances, dtype=np.int64, count=len(self.advances))
        adv_pos = np.array([v[0] for v in self.advances.values()], dtype=np.int64)
        ext_rows = np.fromiter(self.extends, dtype=np.int64, count=len(self.extends))
        ext_n = np.array([v[0] for v in self.extends.values()], dtype=np.int64)
        advance = (adv_rows, adv_pos) if len(adv_rows) else None
        extend = (ext_rows, ext_n) if len(ext_rows) else None
        try:
            result = alloc.step(release=release if len(release) else None, advance=advance,
                                extend=extend)
        except BatchTooLargeError:
            if not (len(release) or advance):
                raise
            with alloc.free_group():  # splits the frees into as many steps as they need
                if len(release):
                    alloc.release(release)
                if advance:
                    alloc.advance_frontier(*advance)
            result = alloc.step(extend=extend) if extend else None
        self.releases.clear()
        self.advances.clear()
        self.extends.clear()
        self.freed_full = self.freed_swa = self.needed = self.n_tokens = self.n_rows = 0
        return result, alloc.steps_run - before
