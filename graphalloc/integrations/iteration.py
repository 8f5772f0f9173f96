"""One graphalloc step per scheduler iteration: what the seams record, and how it runs.

Engines free, evict and allocate through many small calls per iteration (SGLang:
``release_kv_cache`` per finished request, ``_evict_swa`` per request, one
``alloc_*`` per batch; vLLM: ``free`` and ``allocate_slots`` per request). The
seams (:mod:`.sglang`, :mod:`.vllm`) record those calls in an
:class:`IterationStep` and run them as ONE ``alloc.scheduler_step()`` block --
releases, then frontier advances, then admits (new requests, plain or on a prefix
handle), then allocations, the step's own order, so the pages the frees return are
available to the allocations of the same step.

Host accounting (what lets a seam answer "does it fit" per call without a dry-run
plan): with ``ps = page_size``, extending a request from length L to T takes
``ceil(T / ps) - ceil(L / ps)`` fresh pages from EACH pool (a request admitted on a
handle starts at the handle's whole pages and allocates none for them). So, per pool::

    free after the step = n_free(pool) + freed(pool) - needed   (+ reclaimable(pool))

``freed`` is what the recorded releases, trims and frontier moves return. Without sharing
(``max_handles == 0``) it is O(1) arithmetic: a request at length L and frontier f
returns ``ceil(L / ps)`` FULL and ``ceil(L / ps) - f / ps`` SWA pages, an advance to g
``(g - f) / ps`` SWA pages. With handles, pages may be shared and the count is
:meth:`HybridAllocator.pages_released` over all the recorded frees together (a page
goes only with its last reference), computed when asked and kept until the records,
the steps or the cache change. ``reclaimable`` (with a prefix cache) is what evicting
every unlocked cache entry would add once the frees ran; the allocator runs that
eviction itself inside the step when an allocation needs it.

Only the frozen shape of the *frees* (``max_release_rows``, ``max_step_pages``)
is not predicted here (the cache's eviction inside the step included): a step refused
for it (:class:`BatchTooLargeError`, nothing changed) is rerun as the trims (one step),
the frees through ``alloc.free_group()`` (which splits them into as many steps as the
shape needs), the
cache eviction the allocations need (``PrefixCache.evict``, split the same way), and
then the rest: more than one step that iteration, reported in the step count. Ring mode
is refused: its admit pops ring pages and the per-call accounting above does not cover
it.
"""

from __future__ import annotations

import numpy as np

from ..allocator import AllocResult, HybridAllocator
from ..errors import (
    AlignmentError,
    BatchTooLargeError,
    ConfigError,
    OverlapError,
    UnknownRequestError,
)

__all__ = ["IterationStep"]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class IterationStep:
    """The frees, frontier moves, admits and allocations recorded for the next step.

    Keys: a live request row (an int >= 0), or, for a request admitted by the next step,
    a negative key handed out by :meth:`reserve` (its row is known once :meth:`run` ran:
    ``admitted[key]``). Owns four host dicts (insertion order = lane order of the
    allocations) and running totals. Invariants: a row is in at most one of ``releases``
    and ``extends``/``advances`` (a release cancels the row's other records); every
    recorded row is live in ``alloc``; ``needed`` / ``n_tokens`` / ``n_rows`` equal the
    sums over the records. Cost: every record is O(1) per row; the queries are O(1)
    without sharing, :meth:`HybridAllocator.pages_released` (O(pages of the recorded
    frees and the cache's entries)) once per change with it; :meth:`run` is one step.
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
        self.cache = alloc.prefix_cache
        self.shared = alloc.ledger.n_handles > 0  # pages may be shared: count by references
        self.releases: dict[int, tuple[int, int]] = {}  # row -> (FULL, SWA) pages it holds
        self.advances: dict[int, tuple[int, int]] = {}  # row -> (new frontier, SWA pages)
        self.trims: dict[int, int] = {}  # row -> new length (pages wholly past it given back)
        self.extends: dict[int, tuple[int, int]] = {}  # key -> (tokens, pages per pool)
        self.admits: dict[int, tuple[int | None, int]] = {}  # key < 0 -> (handle, prefix)
        self.admitted: dict[int, int] = {}  # after run(): key -> the row it got
        self.needed = self.n_tokens = self.n_rows = 0  # pages per pool, tokens, alloc rows
        self._next_key = -1
        self._version = 0  # bumped by every change of the frees
        self._counted = None  # (state key, (freed FULL, SWA), (reclaimable FULL, SWA))

    # ---- queries ---------------------------------------------------------------------
    def __bool__(self) -> bool:
        return bool(self.releases or self.advances or self.trims or self.extends
                    or self.admits)

    def free_pages(self, pool: str, *, with_cache: bool = False) -> int:
        """Pages of ``pool`` free once the recorded step has run (``with_cache``: plus
        what evicting the unlocked cache entries would give back)."""
        freed, reclaimable = self._counts()
        i = 0 if pool == "full" else 1
        extra = reclaimable[i] if with_cache else 0
        return self.alloc.n_free(pool) + freed[i] + extra - self.needed

    def fits(self) -> bool:
        """Whether the recorded work fits the pools, counting what the prefix cache could
        give back (a lock taken after a reservation may withdraw pages it counted on)."""
        cached = self.cache is not None
        return (self.free_pages("full", with_cache=cached) >= 0
                and self.free_pages("swa", with_cache=cached) >= 0)

    def reclaimable_pages(self, pool: str) -> int:
        """Pages of ``pool`` the prefix cache could give back once the recorded frees ran
        (0 without a cache)."""
        return self._counts()[1][0 if pool == "full" else 1]

    def length(self, key: int) -> int:
        """The request's length once the recorded step has run."""
        rec = self.extends.get(key)
        base = self.admits[key][1] if key < 0 else self.trims.get(key, self.alloc.seq_len(key))
        return base + (rec[0] if rec else 0)

    def frontier(self, key: int) -> int:
        """The request's frontier once the recorded step has run."""
        if key < 0:
            handle, prefix = self.admits[key]
            return 0 if handle is None else min(self.alloc.handle_info(handle).swa_start,
                                                prefix)
        rec = self.advances.get(key)
        return rec[0] if rec else self.alloc.frontier(key)

    def held_pages(self, row: int) -> tuple[int, int]:
        """(FULL, SWA) pages ``row`` holds now (before the recorded step), shared or not."""
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

    def _counts(self):
        """(freed FULL, SWA) by the recorded frees, (reclaimable FULL, SWA) after them."""
        cache = self.cache
        state = (self._version, self.alloc.steps_run, id(self.alloc.ledger),
                 None if cache is None else cache.version)
        if self._counted is not None and self._counted[0] == state:
            return self._counted[1:]
        cut = self._trimmed_pages()
        if not self.shared:
            freed = (sum(v[0] for v in self.releases.values()) + cut[0],
                     sum(v[1] for v in self.releases.values())
                     + sum(v[1] for v in self.advances.values()) + cut[1])
            reclaim = (0, 0)
        else:
            rel = list(self.releases)
            adv = (list(self.advances), [v[0] for v in self.advances.values()])
            freed = self.alloc.pages_released(rel, advance=adv)
            freed = (freed[0] + cut[0], freed[1] + cut[1])
            reclaim = (0, 0)
            if cache is not None:
                busy = {h for h, _ in self.admits.values() if h is not None}
                handles = [h for h in cache.reclaimable_handles() if h not in busy]
                if handles:
                    both = self.alloc.pages_released(rel, advance=adv, handles=handles)
                    reclaim = (both[0] - freed[0], both[1] - freed[1])
        self._counted = (state, freed, reclaim)
        return freed, reclaim

    def _trimmed_pages(self) -> tuple[int, int]:
        """(FULL, SWA) pages the recorded trims give back: the rows' pages wholly past
        their new lengths that nobody else references (a request's own tail)."""
        if not self.trims:
            return 0, 0
        ps, refs, full, swa = self.ps, self.alloc.ledger.refs, 0, 0
        for row, new_len in self.trims.items():
            lo, hi = _ceil_div(new_len, ps), _ceil_div(self.alloc.seq_len(row), ps)
            if refs is None or not self.shared:
                full, swa = full + hi - lo, swa + hi - lo
                continue
            pages = refs.page_of[row, lo:hi].astype(np.int64)
            full += int(np.count_nonzero(refs.full_ref[pages] == 1))
            swa += int(np.count_nonzero(refs.swa_ref[refs.swa_of[pages]] == 1))
        return full, swa

    # ---- recording ---------------------------------------------------------------------
    def release(self, key: int) -> None:
        """Record the release of live ``row`` (cancels its recorded advance/extension); a
        negative key (a request admitted by the next step) is cancelled instead."""
        self._drop(key)
        if key < 0:
            del self.admits[key]
            self._version += 1
            return
        self.releases[key] = self.held_pages(key)
        self._version += 1

    def reserve(self, items, *, trim: bool = False) -> list[int] | None:
        """Record a batch, whole or not at all.

        ``items``: ``(key or None, target_len, new_frontier or None)`` per request, keys
        distinct; ``None`` admits a new request with the next step, ``(None, target_len,
        None, handle, prefix_len)`` admits it on ``prefix_len`` tokens (whole pages) of
        prefix handle ``handle`` (shared, not allocated). The request grows to
        ``target_len`` (never shrinks) and its frontier moves to ``new_frontier``
        (forward, page-aligned; existing rows only). With ``trim``, a live request holding
        a whole page or more past ``target_len`` gives those pages back in the step
        (``it.trim``; not when its frontier has moved and ``target_len`` is below it plus
        the window, which a trim refuses). Returns the keys (negative for new
        requests), or ``None`` when a pool (counting what the prefix cache could give
        back, when there is one) or the request rows are short, with nothing changed. A
        batch over the frozen allocation shape raises :class:`BatchTooLargeError`, a bad
        handle or prefix its typed error, nothing changed.
        """
        cfg, ps = self.alloc.config, self.ps
        items = [tuple(item) + (None, 0)[len(item) - 3:] for item in items]
        named = [key for key, *_ in items if key is not None]
        if len(set(named)) != len(named):
            raise OverlapError("a request appears twice in one batch; pass each once")
        for key, target, _, handle, prefix in items:
            if key is None and handle is not None:
                info = self.alloc.handle_info(handle)  # UnknownHandleError if not held
                if prefix % ps or not 0 < prefix <= info.n_tokens or prefix > target:
                    raise AlignmentError(
                        f"admit on handle {handle}: a shared prefix of {prefix} tokens; share "
                        f"whole pages (page_size {ps}) of the handle's {info.n_tokens}, at "
                        f"most the request's {target}")
            n = max(int(target) - (prefix if key is None else self.length(key)), 0)
            if n > cfg.max_tokens_per_alloc_row:
                raise BatchTooLargeError(
                    f"request {key} would allocate {n} tokens in one step; the frozen "
                    f"max_tokens_per_alloc_row is {cfg.max_tokens_per_alloc_row}: schedule "
                    "smaller chunks, or size the allocator with AllocatorConfig.for_engine")
        saved = (dict(self.releases), dict(self.advances), dict(self.extends),
                 dict(self.admits), dict(self.trims), self.needed, self.n_tokens, self.n_rows,
                 self._next_key)
        keys = [self._record(*item, trim) for item in items]
        self._version += 1
        short = None
        for have, cap, name in ((self.n_rows, cfg.max_alloc_rows, "max_alloc_rows"),
                                (self.n_tokens, cfg.max_step_tokens, "max_step_tokens")):
            if have > cap:
                short = BatchTooLargeError(
                    f"this iteration's step would need {have} for the frozen {name} {cap}: "
                    "schedule less per iteration, or size the allocator with "
                    "AllocatorConfig.for_engine from the engine's budgets")
        if short is None and not (self.fits()
                                  and len(self.admits) <= cfg.max_reqs - self.alloc.n_live):
            short = False
        if short is None:
            return keys
        (self.releases, self.advances, self.extends, self.admits, self.trims, self.needed,
         self.n_tokens, self.n_rows, self._next_key) = saved
        self._version += 1
        if short is False:
            return None
        raise short

    def _record(self, key, target, new_front, handle, prefix, trim=False) -> int:
        if key is None:
            key, self._next_key = self._next_key, self._next_key - 1
            self.admits[key] = (handle, prefix if handle is not None else 0)
            self.n_rows += handle is not None  # the prefix copy is an allocation row
        elif key >= 0 and new_front is not None and new_front > self.frontier(key):
            old = self.alloc.frontier(key)
            self.advances[key] = (int(new_front), (int(new_front) - old) // self.ps)
        length = self.admits[key][1] if key < 0 else self.alloc.seq_len(key)
        self.trims.pop(key, None)
        ps, window = self.ps, self.alloc.config.sliding_window
        if trim and key >= 0 and _ceil_div(int(target), ps) < _ceil_div(length, ps) and (
                self.alloc.frontier(key) == 0 or target >= self.alloc.frontier(key) + window):
            self.trims[key] = int(target)
            length = int(target)
        n, pages = self.extends.pop(key, (0, 0))
        self.needed -= pages
        self.n_tokens -= n
        self.n_rows -= n > 0
        n = max(int(target) - length, 0)
        pages = _ceil_div(length + n, self.ps) - _ceil_div(length, self.ps)
        if n:
            self.extends[key] = (n, pages)
            self.needed += pages
            self.n_tokens += n
            self.n_rows += 1
        return key

    def _drop(self, key: int) -> None:
        n, pages = self.extends.pop(key, (0, 0))
        self.needed -= pages
        self.n_tokens -= n
        self.n_rows -= n > 0
        self.advances.pop(key, None)
        self.trims.pop(key, None)
        if key < 0 and self.admits[key][0] is not None:
            self.n_rows -= 1

    # ---- the step ----------------------------------------------------------------------
    def run(self) -> tuple[AllocResult | None, int]:
        """Run the recorded work: ONE step (more only when the frees exceed the frozen
        release shape, see the module docstring). Returns ``(result, steps_run)``;
        ``result`` is ``None`` when nothing was allocated. Lanes: the extensions in
        recording order; ``admitted`` maps each new request's key to its row. A step
        refused for pages (the accounting was off) raises with the records kept."""
        alloc = self.alloc
        self.admitted = {}
        if not self:
            return None, 0
        before = alloc.steps_run
        release = list(self.releases)
        advance = (list(self.advances), [v[0] for v in self.advances.values()])
        trims = (list(self.trims), list(self.trims.values()))
        try:
            result, admitted = self._one_step(release, advance, trims)
        except BatchTooLargeError:
            short = [-self.free_pages(pool) for pool in ("full", "swa")]  # after the frees
            evict = self.cache is not None and max(short) > 0
            if not (release or advance[0] or trims[0] or evict):
                raise
            if trims[0]:  # a step of its own (a trim is not a free_group() free)
                alloc.trim(*trims)
            if release or advance[0]:
                with alloc.free_group():  # splits the frees into as many steps as they need
                    if release:
                        alloc.release(release)
                    if advance[0]:
                        alloc.advance_frontier(*advance)
            if evict:  # the cache's drops in steps of their own (split like any free)
                self.cache.evict(max(short[0], 0), max(short[1], 0))
            result, admitted = self._one_step([], ([], []), ([], [])) if (
                self.admits or self.extends) else (None, {})
        self.admitted = admitted
        self.releases.clear()
        self.advances.clear()
        self.trims.clear()
        self.extends.clear()
        self.admits.clear()
        self.needed = self.n_tokens = self.n_rows = 0
        self._version += 1
        return result, alloc.steps_run - before

    def _one_step(self, release, advance, trims):
        with self.alloc.scheduler_step() as it:
            if release:
                it.release(release)
            if trims[0]:
                it.trim(*trims)
            if advance[0]:
                it.advance(*advance)
            admitted = {}
            for key, (handle, prefix) in self.admits.items():
                admitted[key] = it.admit(handle=handle, n_tokens=prefix if handle is not None
                                         else None)
            if self.extends:
                rows = [admitted.get(key, key) for key in self.extends]
                it.extend(rows, [v[0] for v in self.extends.values()])
        return it.result, admitted
