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
goes only with its last reference), kept as per-page counts of the references the
recorded frees drop: O(pages of a record) per record, recounted once when a step ran or
the cache changed. ``reclaimable`` (with a prefix cache) is what evicting
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


def _record(name: str, key: int, value) -> tuple:
    """The free counter's record of ``releases`` / ``advances`` / ``trims`` entries."""
    if name == "rel":
        return ("rel", key)
    return (name, key, value[0] if name == "adv" else value)


class _FreedPages:
    """What the recorded frees return, kept up to date as records come and go.

    A record is ``("rel", row)``, ``("adv", row, new_frontier)`` or ``("trim", row,
    new_len)``. Without sharing each record's (FULL, SWA) count is arithmetic. With
    sharing, the references each record drops are added to per-page counts (``drop``, one
    dense array per pool), next to the references the unlocked cache entries hold
    (``cache``); a page is freed when ``drop == refs``, reclaimable when ``drop + cache
    == refs``, and both totals move by the pages a record touches. :meth:`toggle` costs
    O(pages of the record); :meth:`counts` is O(1) unless a step ran (the references
    changed) or the cache changed since, which rebuilds it (O(pages of every record and
    entry + pool size)). ``journal`` lets the recorder undo a refused batch.
    """

    def __init__(self, alloc, shared: bool):
        self.alloc, self.shared, self.ps = alloc, shared, alloc.config.page_size
        cfg = alloc.config
        sizes = (cfg.num_full_pages + 1, cfg.num_swa_pages + 1)
        self.drop = [np.zeros(n, dtype=np.int64) for n in sizes]
        self.cache = [np.zeros(n, dtype=np.int64) for n in sizes]
        self.applied: dict = {}  # record -> its (FULL, SWA) pages (or counts)
        self.journal: list = []  # (record, +1 | -1), for undo
        self.freed, self.both = [0, 0], [0, 0]
        self.state = None

    def toggle(self, key, sign: int) -> None:
        """Add (``sign`` 1) or remove (-1) a record."""
        self.journal.append((key, sign))
        if sign > 0:
            self.applied[key] = self._pages(key)
            self._apply(self.applied[key], 1)
        else:
            self._apply(self.applied.pop(key), -1)

    def undo(self, mark: int) -> None:
        while len(self.journal) > mark:
            key, sign = self.journal.pop()
            self.toggle(key, -sign)
            self.journal.pop()

    def clear(self) -> None:
        self.applied, self.journal, self.state = {}, [], None

    def counts(self, cache_handles, state):
        """((freed FULL, SWA), (reclaimable FULL, SWA)); ``cache_handles()`` lists the
        entries' handles to count when ``state`` (the references' and the cache's)
        changed since the last call."""
        if state != self.state:
            self._rebuild(cache_handles() if self.shared else ())
            self.state = state
        return tuple(self.freed), (self.both[0] - self.freed[0], self.both[1] - self.freed[1])

    def _rebuild(self, handles) -> None:
        keys, self.freed, self.both = list(self.applied), [0, 0], [0, 0]
        if self.shared:
            refs, cfg, led = self.alloc.ledger.refs, self.alloc.config, self.alloc.ledger
            for arr in self.drop + self.cache:
                arr[:] = 0
            for h in handles:
                n, start = int(led.h_len[h]) // self.ps, int(led.h_swa_start[h]) // self.ps
                pages = refs.page_of[cfg.max_reqs + h, :n].astype(np.int64)
                np.add.at(self.cache[0], pages, 1)
                np.add.at(self.cache[1], refs.swa_of[pages[start:]].astype(np.int64), 1)
            for i, ref in enumerate((refs.full_ref, refs.swa_ref)):
                c = self.cache[i]
                self.both[i] = int(np.count_nonzero((c > 0) & (c == ref)))
        for key in keys:
            self.applied[key] = self._pages(key)
            self._apply(self.applied[key], 1)

    def _pages(self, key):
        """The record's dropped references: (FULL pages, SWA pages), or its counts."""
        alloc, ps = self.alloc, self.ps
        kind, row = key[0], key[1]
        end, front = _ceil_div(alloc.seq_len(row), ps), alloc.frontier(row) // ps
        if kind == "rel":
            lo, hi, slo, shi = 0, end, front, end
        elif kind == "adv":
            lo, hi, slo, shi = 0, 0, front, key[2] // ps
        else:  # trim: [ceil_page(new), end) of both pools (above the frontier)
            lo = _ceil_div(key[2], ps)
            hi, slo, shi = end, lo, end
        if not self.shared:
            return max(hi - lo, 0), max(shi - slo, 0)
        refs = alloc.ledger.refs
        full = refs.page_of[row, lo:hi].astype(np.int64)
        swa = refs.swa_of[refs.page_of[row, slo:shi].astype(np.int64)].astype(np.int64)
        return full, swa

    def _apply(self, pages, sign: int) -> None:
        if not self.shared:
            self.freed = [self.freed[0] + sign * pages[0], self.freed[1] + sign * pages[1]]
            self.both = list(self.freed)
            return
        refs = self.alloc.ledger.refs
        for i, ref in enumerate((refs.full_ref, refs.swa_ref)):
            if not len(pages[i]):
                continue
            u = pages[i]  # distinct: one row's pages
            d, c, r = self.drop[i], self.cache[i], ref[u]
            du, cu = d[u], c[u]
            before = (du > 0) & (du == r), (du + cu > 0) & (du + cu == r)
            du += sign
            d[u] = du
            after = (du > 0) & (du == r), (du + cu > 0) & (du + cu == r)
            self.freed[i] += int(after[0].sum()) - int(before[0].sum())
            self.both[i] += int(after[1].sum()) - int(before[1].sum())


class IterationStep:
    """The frees, frontier moves, admits and allocations recorded for the next step.

    Keys: a live request row (an int >= 0), or, for a request admitted by the next step,
    a negative key handed out by :meth:`reserve` (its row is known once :meth:`run` ran:
    ``admitted[key]``). Owns four host dicts (insertion order = lane order of the
    allocations) and running totals. Invariants: a row is in at most one of ``releases``
    and ``extends``/``advances`` (a release cancels the row's other records); every
    recorded row is live in ``alloc``; ``needed`` / ``n_tokens`` / ``n_rows`` equal the
    sums over the records. Cost: every record is O(1) per row without sharing, O(pages
    it frees) with it; the queries are O(1), except the first after a step ran or the
    cache changed (O(pages of the records and the cache's entries + pool size)); :meth:`run`
    is one step.
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
        self._version = 0  # bumped by every change of the records
        self._freed = _FreedPages(alloc, self.shared)

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
        busy = frozenset(h for h, _ in self.admits.values() if h is not None)

        def handles():
            if cache is None:
                return ()
            return [h for h in cache.reclaimable_handles() if h not in busy]

        state = (self.alloc.steps_run, id(self.alloc.ledger),
                 None if cache is None else (cache.version, busy))
        return self._freed.counts(handles, state)

    def _set(self, records: dict, name: str, key: int, value) -> None:
        """``records[key] = value`` (``None``: delete), told to the free counter."""
        old = records.pop(key, None)
        if old is not None:
            self._freed.toggle(_record(name, key, old), -1)
        if value is not None:
            records[key] = value
            self._freed.toggle(_record(name, key, value), 1)

    # ---- recording ---------------------------------------------------------------------
    def release(self, key: int) -> None:
        """Record the release of live ``row`` (cancels its recorded advance/extension); a
        negative key (a request admitted by the next step) is cancelled instead."""
        self._drop(key)
        if key < 0:
            del self.admits[key]
            self._version += 1
            return
        self._set(self.releases, "rel", key, self.held_pages(key))
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
        mark = len(self._freed.journal)
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
        self._freed.undo(mark)
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
            self._set(self.advances, "adv", key,
                      (int(new_front), (int(new_front) - old) // self.ps))
        length = self.admits[key][1] if key < 0 else self.alloc.seq_len(key)
        self._set(self.trims, "trim", key, None)
        ps, window = self.ps, self.alloc.config.sliding_window
        if trim and key >= 0 and _ceil_div(int(target), ps) < _ceil_div(length, ps) and (
                self.alloc.frontier(key) == 0 or target >= self.alloc.frontier(key) + window):
            self._set(self.trims, "trim", key, int(target))
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
        self._set(self.advances, "adv", key, None)
        self._set(self.trims, "trim", key, None)
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
        self._freed.clear()
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
