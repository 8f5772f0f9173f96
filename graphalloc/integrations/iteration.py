"""The seams' per-iteration accumulator: int64 arrays per Step kind, ONE Step per iteration.

Contract. :class:`IterationStep` holds what an engine's calls recorded since the last step
-- cache inserts (``take``), releases, trims, frontier moves, admits (plain or on a cached
prefix), decode and extend rows -- as growable int64 arrays, one per field of
:class:`~graphalloc.plan.step.Step`, and hands them to the allocator as ONE step
(:meth:`IterationStep.run`: ``alloc.plan`` + ``alloc.run``) in the Step's own order: the
takes first (a finished request is inserted and released in one step), then the frees, the
admits, the allocations; the prefix cache's reclaiming happens inside that step when an
allocation is short (:mod:`graphalloc.plan.pipeline` replans with ``cache.offer()``).
A step refused for pages or rows returns ``None`` with nothing changed and the records
kept; any other refusal raises its typed error, records kept.

What a set of frees gives back comes from ONE rule site, the planner: :meth:`pages_freed`
is ``alloc.dry_run`` of the recorded frees (takes included: what a new cache entry keeps
is not freed), :meth:`pages_reclaimable` the dry run of those frees plus dropping every
unlocked cache entry. Both are cached per version of the recorded frees (and of the steps
run and the cache), so repeated queries in one iteration cost O(1) after the first.

Invariants: every recorded row was live when recorded (the seams check), a row is
released at most once per step (``released``), each take's handle is free and reserved
for it; after a submitted step every record is cleared and the step's new cache entries
registered (``cache.add_entry``). Two cases take more than one step: frees beyond the
frozen release shape run first (``alloc.free_group()`` splits them), then the rest
(``n_steps`` says so); an insert when every handle is held or reserved drops the cache's
LRU unlocked leaf first, a step of its own (``cache_steps``). A batch over the allocation
shape raises with nothing changed.

Cost: recording is O(1) per scalar (a write into a preallocated array, doubled when
full) or O(n) numpy per array; :meth:`run` is one ``alloc.plan`` + ``alloc.run`` plus
O(kinds) array views; the page queries are one dry run per version, then O(1).
"""

from __future__ import annotations

import numpy as np

from ..allocator import HybridAllocator
from ..errors import BatchTooLargeError, CapacityError, ConfigError, ContractError
from ..plan.refusals import RefusalCode
from ..plan.step import EMPTY, Step
from ..state.free_ids import lowest_free

__all__ = ["IterationStep", "Ints"]

_SHAPE = RefusalCode.STEP_OVER_SHAPE  # the frozen step shape


def refusal_code(exc: ContractError) -> RefusalCode | None:
    """The planner's refusal code carried by a typed error (None when none)."""
    refusal = exc.refusal
    return None if refusal is None else refusal.code


def _short_of_room(exc: ContractError) -> bool:
    """Refused for lack of pages, request rows or state slots (frees can make room)."""
    return exc.refusal is not None and exc.refusal.code.room


class Ints:
    """A growable int64 array: :meth:`append` O(1) amortised, :meth:`view` without a copy."""

    __slots__ = ("buf", "n")

    def __init__(self, capacity: int = 64):
        self.buf = np.empty(max(capacity, 1), dtype=np.int64)
        self.n = 0

    def _grow(self, need: int) -> None:
        buf = np.empty(max(need, 2 * len(self.buf)), dtype=np.int64)
        buf[:self.n] = self.buf[:self.n]
        self.buf = buf

    def append(self, value: int) -> None:
        n = self.n
        if n == len(self.buf):
            self._grow(n + 1)
        self.buf[n] = value
        self.n = n + 1

    def extend(self, values: np.ndarray) -> None:
        n, m = self.n, len(values)
        if n + m > len(self.buf):
            self._grow(n + m)
        self.buf[n:n + m] = values
        self.n = n + m

    def view(self) -> np.ndarray:
        return self.buf[:self.n] if self.n else EMPTY

    def clear(self) -> None:
        self.n = 0


def _remember(memo: dict, key, value) -> None:
    """Keep ``value`` for ``key``; a few keys at most (older versions are dead)."""
    if len(memo) >= 4:
        memo.clear()
    memo[key] = value


def _merge(kw: dict, kind: str, value) -> None:
    """Add ``value`` (an array, or a tuple of arrays) to ``kw[kind]``; empty: nothing."""
    if value is None:
        return
    first = value[0] if isinstance(value, tuple) else value
    if not len(first):
        return
    old = kw.get(kind)
    if old is None:
        kw[kind] = value
    elif isinstance(value, tuple):
        kw[kind] = tuple(np.concatenate([a, b]) for a, b in zip(old, value, strict=True))
    else:
        kw[kind] = np.concatenate([old, value])


def _cat(a: np.ndarray, b) -> np.ndarray:
    """Recorded ``a`` followed by a call's ``b`` (either may be empty)."""
    if b is None or not len(b):
        return a
    return b if not len(a) else np.concatenate([a, b])


class IterationStep:
    """The records of one iteration and the step that runs them (see the module docstring).

    ``alloc``: a pool-mode :class:`HybridAllocator`; ``owner`` names the seam in errors.
    ``last_step`` is the :class:`Step` the last :meth:`run` planned (for inspection)."""

    def __init__(self, alloc: HybridAllocator, owner: str):
        if not isinstance(alloc, HybridAllocator):
            raise ConfigError(f"{owner} takes a graphalloc.HybridAllocator, got "
                              f"{type(alloc).__name__}")
        cfg = alloc.config
        if not cfg.pools.window.shares:
            raise ConfigError(
                f"{owner} needs a pool-mode allocator (swa_ring_pages=0): in ring mode an "
                "admit pops ring pages, so a request cannot be admitted on a cached prefix "
                "and the seams' one-step iteration does not hold")
        self.alloc, self.config, self.ledger = alloc, cfg, alloc.ledger
        self.cache = alloc.prefix_cache
        self.ps = cfg.page_size
        self.states = cfg.num_state_slots > 0  # inserts only at the committed length
        n = cfg.max_reqs
        self.take_h, self.take_row, self.take_n = Ints(16), Ints(16), Ints(16)
        self.release, self.trim_row, self.trim_len = Ints(n), Ints(16), Ints(16)
        self.adv_row, self.adv_pos = Ints(n), Ints(n)
        self.admit, self.on_row, self.on_h, self.on_n = Ints(16), Ints(16), Ints(16), Ints(16)
        self.decode, self.ext_row, self.ext_n = Ints(n), Ints(n), Ints(n)
        self.released = np.zeros(n, dtype=bool)  # rows whose release is recorded
        self.inserts: list[tuple[int, list]] = []  # (handle, page keys): entries after the step
        self._ends: dict[bytes, int] = {}  # last page key of a recorded insert -> its handle
        self.frees_version = 0  # bumped by every recorded free (takes included)
        self.cache_steps = 0  # steps the cache ran outside the iteration's step
        self.last_step: Step | None = None
        self._freed: dict = {}  # version key -> pages (a few versions live at once)
        self._reclaim: dict = {}

    # ---- state ------------------------------------------------------------------------
    def has_frees(self) -> bool:
        return bool(self.take_h.n or self.release.n or self.trim_row.n or self.adv_row.n)

    def __bool__(self) -> bool:
        return bool(self.has_frees() or self.admit.n or self.on_row.n or self.decode.n
                    or self.ext_row.n)

    # ---- recording ----------------------------------------------------------------------
    def add_release(self, row: int) -> None:
        self.release.append(row)
        self.released[row] = True
        self.frees_version += 1

    def add_trim(self, row: int, new_len: int) -> None:
        self.trim_row.append(row)
        self.trim_len.append(new_len)
        self.frees_version += 1

    def add_advance(self, row: int, pos: int) -> None:
        self.adv_row.append(row)
        self.adv_pos.append(pos)
        self.frees_version += 1

    def insert(self, row: int, token_ids=None, *, keys: list | None = None, salt=None,
               extra_keys=None) -> int:
        """Record a prefix-cache insert of live ``row``'s whole pages of ``token_ids`` (its
        first positions hold them) as a ``take`` of the next step: FULL pages of the prefix,
        SWA from the row's frontier. ``keys`` / ``salt`` / ``extra_keys``: the request's
        page keys so far (extended in place: only new pages hashed) and namespace, as for
        ``PrefixCache.insert``. Returns the tokens cached (0: nothing to cache, or no
        handle could be freed). A prefix already cached, or recorded in this iteration,
        costs no take. When every handle is held or reserved, the cache drops its LRU
        unlocked leaf first: one step of its own (``cache_steps``). With recurrent-state
        slots only a page-aligned committed length is cached (the state snapshot is the
        state there). O(prefix pages)."""
        cache, ps = self.cache, self.ps
        keys = cache.keys_of(token_ids, keys=keys, salt=salt, extra_keys=extra_keys)
        if token_ids is not None:
            keys = keys[:len(token_ids) // ps]
        committed = int(self.ledger.committed[row])
        n = min(len(keys), committed // ps) * ps
        if n == 0 or (self.states and n != committed):  # a snapshot: the committed length
            return 0
        keys = keys[:n // ps]
        if keys[-1] in self._ends or cache.lookup(keys) >= 0:
            return n
        handle = self._free_handle()
        if handle < 0:
            before = self.alloc.steps_run
            cache.reclaim(n_full=1)  # the LRU unlocked leaf: its handle becomes free
            self.cache_steps += self.alloc.steps_run - before
            handle = self._free_handle()
            if handle < 0:
                return 0
        self.take_h.append(handle)
        self.take_row.append(row)
        self.take_n.append(n)
        self.inserts.append((handle, keys))
        self._ends[keys[-1]] = handle
        self.frees_version += 1
        return n

    def _free_handle(self) -> int:
        return lowest_free(self.ledger.h_live, self.take_h.view())

    # ---- what the recorded frees give back: the planner's dry runs ------------------------
    def frees_step(self, extra: dict | None = None, drop=None) -> Step:
        """The recorded takes and frees as a Step, plus ``extra`` frees (``{"advance": (rows,
        pos), "trim": (rows, lens)}``, a caller's not yet recorded) and ``drop`` handles."""
        kw = self._frees()
        for kind, value in (extra or {}).items():
            _merge(kw, kind, value)
        if drop is not None:
            kw["drop"] = drop
        return Step(**kw)

    def _frees(self) -> dict:
        kw = {}
        if self.take_h.n:
            kw["take"] = (self.take_h.view(), self.take_row.view(), self.take_n.view())
        if self.release.n:
            kw["release"] = self.release.view()
        if self.trim_row.n:
            kw["trim"] = (self.trim_row.view(), self.trim_len.view())
        if self.adv_row.n:
            kw["advance"] = (self.adv_row.view(), self.adv_pos.view())
        return kw

    def _dry_freed(self, step: Step) -> tuple[int, int]:
        try:
            return self.alloc.dry_run(step).pages_freed
        except BatchTooLargeError as exc:  # past the frozen release shape: a free is not
            if refusal_code(exc) != _SHAPE:  # refused for it (it is split), so count past it
                raise
            return self.alloc.dry_run(step, oversize=True).pages_freed

    def pages_freed(self, extra: dict | None = None, extra_key=None) -> tuple[int, int]:
        """``(FULL, SWA)`` pages the recorded frees (plus ``extra``, see :meth:`frees_step`,
        whose version the caller passes as ``extra_key``) give back when the step runs: a
        dry run of the planner, once per version of the records and of the allocator."""
        key = (self.frees_version, self.alloc.steps_run, extra_key)
        value = self._freed.get(key)
        if value is None:
            step = self.frees_step(extra)
            value = self._dry_freed(step) if step.kinds() else (0, 0)
            _remember(self._freed, key, value)
        return value

    def pages_reclaimable(self, extra: dict | None = None, extra_key=None) -> tuple[int, int]:
        """``(FULL, SWA)`` pages dropping every unlocked cache entry would add once the
        recorded frees ran ((0, 0) without a cache); cached as :meth:`pages_freed`, and per
        version of the cache (entries, locks)."""
        cache = self.cache
        if cache is None:
            return 0, 0
        key = (self.frees_version, self.alloc.steps_run, extra_key, cache.version)
        value = self._reclaim.get(key)
        if value is None:
            handles = cache.reclaimable_handles()
            value = (0, 0)
            if handles:
                freed = self.pages_freed(extra, extra_key)
                both = self._dry_freed(self.frees_step(extra, np.array(handles, np.int64)))
                value = (both[0] - freed[0], both[1] - freed[1])
            _remember(self._reclaim, key, value)
        return value

    def free_pages(self, pool: str, *, with_cache: bool = False, extra: dict | None = None,
                   extra_key=None) -> int:
        """Pages of ``pool`` free once the recorded frees ran (``with_cache``: plus what
        the cache could give back); allocations not counted."""
        i = 0 if pool == "full" else 1
        more = self.pages_reclaimable(extra, extra_key)[i] if with_cache else 0
        return self.alloc.n_free(pool) + self.pages_freed(extra, extra_key)[i] + more

    # ---- the step -------------------------------------------------------------------------
    def to_step(self, advance=None, trim=None, admit=None, admit_on=None, decode=None,
                extend=None) -> Step:
        """The records, followed by a call's arrays (``advance`` / ``trim`` / ``admit_on``
        / ``extend`` as tuples of arrays), as one Step; absent kinds left out. O(kinds)."""
        if not self:  # nothing recorded: the call's arrays as they are
            kw = {}
            for kind, value in (("trim", trim), ("advance", advance), ("admit", admit),
                                ("admit_on", admit_on), ("decode", decode),
                                ("extend", extend)):
                if value is not None:
                    kw[kind] = value
            return Step(**kw)
        kw = self._frees()
        _merge(kw, "trim", trim)
        _merge(kw, "advance", advance)
        _merge(kw, "admit", _cat(self.admit.view(), admit))
        _merge(kw, "admit_on", (self.on_row.view(), self.on_h.view(), self.on_n.view()))
        _merge(kw, "admit_on", admit_on)
        _merge(kw, "decode", _cat(self.decode.view(), decode))
        _merge(kw, "extend", (self.ext_row.view(), self.ext_n.view()))
        _merge(kw, "extend", extend)
        return Step(**kw)

    def run(self, **call):
        """Run the records plus ``call``'s arrays (:meth:`to_step`) as ONE step. Returns
        ``(result, pages_evicted, n_steps)``, or ``None`` when a pool or the request rows
        are short (nothing changed, records kept). Other refusals raise their typed error,
        nothing changed. Past the frozen release shape the frees run first (more steps)."""
        alloc = self.alloc
        step = self.last_step = self.to_step(**call)
        before = alloc.steps_run
        try:
            planned = alloc.plan(step)
        except (BatchTooLargeError, CapacityError) as exc:
            if _short_of_room(exc):
                return None
            if refusal_code(exc) != _SHAPE or not self.has_frees():
                raise
            return self._run_split(call, before)
        result = alloc.run(planned)
        self._done()
        return result, planned.pages_evicted, alloc.steps_run - before

    def _run_split(self, call: dict, before: int):
        """The step is over the frozen shape and frees are recorded: check the rest alone
        (over the shape: raise, nothing changed), run the frees (the takes, the trims, then
        the releases and frontier moves through ``alloc.free_group()``, which splits them),
        then the rest as one step."""
        alloc = self.alloc
        whole = self.to_step(**call)
        try:
            alloc.dry_run(Step(advance=call.get("advance"), trim=call.get("trim"),
                               admit=whole.admit,
                               admit_on=whole.admit_on, decode=whole.decode,
                               extend=whole.extend))
        except (BatchTooLargeError, CapacityError) as exc:
            if not _short_of_room(exc):  # short of pages the frees give back: fine
                raise
        if self.take_h.n:
            alloc.step(take=(self.take_h.view(), self.take_row.view(), self.take_n.view()))
            self._register()
        if self.trim_row.n:
            alloc.trim(self.trim_row.view(), self.trim_len.view())
        with alloc.free_group():
            if self.release.n:
                alloc.release(self.release.view())
            if self.adv_row.n:
                alloc.advance_frontier(self.adv_row.view(), self.adv_pos.view())
        if self.release.n:
            self.released[self.release.view()] = False
        for ints in (self.take_h, self.take_row, self.take_n, self.release, self.trim_row,
                     self.trim_len, self.adv_row, self.adv_pos):
            ints.n = 0
        self.frees_version += 1
        out = self.run(**call)
        if out is None:
            return None
        return out[0], out[1], alloc.steps_run - before

    def _register(self) -> None:
        cache = self.cache
        for handle, keys in self.inserts:
            cache.add_entry(handle, keys)
        self.inserts.clear()
        self._ends.clear()

    def _done(self) -> None:
        """The step was submitted: register its cache entries, clear the records."""
        if not self:
            return
        if self.inserts:
            self._register()
        if self.release.n:
            self.released[self.release.view()] = False
        for ints in (self.take_h, self.take_row, self.take_n, self.release, self.trim_row,
                     self.trim_len, self.adv_row, self.adv_pos, self.admit, self.on_row,
                     self.on_h, self.on_n, self.decode, self.ext_row, self.ext_n):
            ints.n = 0
        self.frees_version += 1
