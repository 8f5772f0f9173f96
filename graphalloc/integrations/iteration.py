"""The seams' engine iteration: the records of one iteration, ONE Step per iteration.

Contract. :class:`IterationStep` holds what an engine's calls recorded since the last step
-- cache inserts (``take``), releases, trims, frontier moves, admits (plain or on a cached
prefix), decode and extend rows -- in the one Step accumulator (it is a
:class:`~graphalloc.plan.accumulator.StepAccumulator`: growable int64 columns, the lowest
free handle not reserved by a recorded take), and hands them to the allocator as ONE step
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
full) or O(n) numpy per array; :meth:`run` appends the call's arrays (O(their rows) numpy,
none when nothing is recorded: the first array of a column is used as it is), then one
``alloc.plan`` + ``alloc.run`` plus O(kinds) views; the page queries are one dry run per
version, then O(1).
"""

from __future__ import annotations

import numpy as np

from ..allocator import HybridAllocator
from ..errors import BatchTooLargeError, CapacityError, ConfigError, ContractError
from ..plan.accumulator import FIELD, StepAccumulator
from ..plan.refusals import RefusalCode
from ..plan.step import Step, normalize_fast

__all__ = ["IterationStep"]

_SHAPE = RefusalCode.STEP_OVER_SHAPE  # the frozen step shape


def refusal_code(exc: ContractError) -> RefusalCode | None:
    """The planner's refusal code carried by a typed error (None when none)."""
    refusal = exc.refusal
    return None if refusal is None else refusal.code


def _short_of_room(exc: ContractError) -> bool:
    """Refused for lack of pages, request rows or state slots (frees can make room)."""
    return exc.refusal is not None and exc.refusal.code.room


def _remember(memo: dict, key, value) -> None:
    """Keep ``value`` for ``key``; a few keys at most (older versions are dead)."""
    if len(memo) >= 4:
        memo.clear()
    memo[key] = value


_TAKE_H, _TAKE_ROW, _TAKE_N = FIELD["take_handle"], FIELD["take_row"], FIELD["take_tokens"]
_RELEASE, _TRIM_ROW, _TRIM_LEN = FIELD["release"], FIELD["trim_row"], FIELD["trim_len"]
_ADV_ROW, _ADV_POS = FIELD["advance_row"], FIELD["advance_pos"]
_FREE_KINDS = ("take", "release", "trim", "advance")  # what the page queries dry-run
_CALL_KINDS = ("trim", "advance", "admit", "admit_on", "decode", "extend")


class IterationStep(StepAccumulator):
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
        StepAccumulator.__init__(self, cfg)
        self.alloc, self.ledger = alloc, alloc.ledger
        self.cache = alloc.prefix_cache
        self.ps = cfg.page_size
        self.states = cfg.num_state_slots > 0  # inserts only at the committed length
        self.released = np.zeros(cfg.max_reqs, dtype=bool)  # rows whose release is recorded
        self.n_takes = 0  # cache inserts (takes) recorded: allocation rows of the step
        self.inserts: list[tuple[int, list]] = []  # (handle, page keys): entries after the step
        self._ends: dict[bytes, int] = {}  # last page key of a recorded insert -> its handle
        self.frees_version = 0  # bumped by every recorded free (takes included)
        self.cache_steps = 0  # steps the cache ran outside the iteration's step
        self._last_kw: dict | None = None
        self._freed: dict = {}  # version key -> pages (a few versions live at once)
        self._reclaim: dict = {}

    # ---- state ------------------------------------------------------------------------
    @property
    def last_step(self) -> Step | None:
        """The :class:`Step` the last :meth:`run` planned (its arrays are views of the
        records: read it before the next call records). For inspection."""
        return None if self._last_kw is None else Step(**self._last_kw)

    @property
    def n_releases(self) -> int:
        """Releases recorded for the next step."""
        return len(self.fields[_RELEASE])

    def has_frees(self) -> bool:
        f = self.fields
        return bool(len(f[_TAKE_H]) or len(f[_RELEASE]) or len(f[_TRIM_ROW])
                    or len(f[_ADV_ROW]))

    # ---- recording ----------------------------------------------------------------------
    def add_release(self, row: int) -> None:
        self.put_one(_RELEASE, row)
        self.released[row] = True
        self.frees_version += 1

    def add_trim(self, row: int, new_len: int) -> None:
        self.put_one(_TRIM_ROW, row)
        self.put_one(_TRIM_LEN, new_len)
        self.frees_version += 1

    def add_advance(self, row: int, pos: int) -> None:
        self.put_one(_ADV_ROW, row)
        self.put_one(_ADV_POS, pos)
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
        h_live = self.ledger.h_live
        handle = self.free_handle(h_live)
        if handle < 0:
            before = self.alloc.steps_run
            cache.reclaim(n_full=1)  # the LRU unlocked leaf: its handle becomes free
            self.cache_steps += self.alloc.steps_run - before
            handle = self.free_handle(h_live)
            if handle < 0:
                return 0
        self.put_one(_TAKE_H, handle)
        self.put_one(_TAKE_ROW, row)
        self.put_one(_TAKE_N, n)
        self.n_takes += 1
        self.inserts.append((handle, keys))
        self._ends[keys[-1]] = handle
        self.frees_version += 1
        return n

    # ---- what the recorded frees give back: the planner's dry runs ------------------------
    def frees_step(self, extra: dict | None = None, drop=None) -> Step:
        """The recorded takes and frees as a Step, plus ``extra`` frees (``{"advance": (rows,
        pos), "trim": (rows, lens)}``, a caller's not yet recorded) and ``drop`` handles."""
        if not extra:
            kw = self.to_kinds(_FREE_KINDS)
        else:
            mark = self.mark()
            self.put_kinds(extra)
            kw = self.to_kinds(_FREE_KINDS)
            self.rollback(mark)  # (the views stay valid: nothing is appended before use)
        if drop is not None:
            kw["drop"] = drop
        return Step(**kw)

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
    def to_step(self, **call) -> Step:
        """The records, followed by a call's arrays (``advance`` / ``trim`` / ``admit_on``
        / ``extend`` as tuples of arrays, ``admit`` / ``decode`` arrays), as one Step; absent
        kinds left out. O(kinds), plus the call's rows when something is recorded."""
        mark = self.mark()
        self.put_kinds(call)
        step = Step(**self.to_kinds())
        self.rollback(mark)  # (the step's views stay valid until the next append)
        return step

    def run(self, **call):
        """Run the records plus ``call``'s arrays (:meth:`to_step`) as ONE step. Returns
        ``(result, pages_evicted, n_steps)``, or ``None`` when a pool or the request rows
        are short (nothing changed, records kept). Other refusals raise their typed error,
        nothing changed. Past the frozen release shape the frees run first (more steps)."""
        alloc = self.alloc
        mark = (tuple(self.fields), self._commit_form, self._spec)  # (self.mark(), inline)
        self.put_kinds(call)  # the call's arrays join the records: one step
        kw = self._last_kw = self.to_kinds()
        before = alloc.steps_run
        try:  # (alloc.plan(Step(**kw)): converted in C straight from the keywords when
            # the allocator has no block open, as alloc.step does)
            arrays = (normalize_fast(kw, self.n_reqs) if normalize_fast is not None
                      and alloc.recorder is None and alloc.group is None else None)
            planned = (alloc.plan(Step(**kw)) if arrays is None
                       else alloc.pipeline.plan(arrays))
        except (BatchTooLargeError, CapacityError) as exc:
            self.rollback(mark)  # refused: the records as they were
            if _short_of_room(exc):
                return None
            if refusal_code(exc) != _SHAPE or not self.has_frees():
                raise
            return self._run_split(call, before)
        except BaseException:
            self.rollback(mark)
            raise
        try:
            result = alloc.run(planned)
        except BaseException:
            self.rollback(mark)
            raise
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
        f = self.fields
        if len(f[_TAKE_H]):
            alloc.step(take=(f[_TAKE_H], f[_TAKE_ROW], f[_TAKE_N]))
            self._register()
        if len(f[_TRIM_ROW]):
            alloc.trim(f[_TRIM_ROW], f[_TRIM_LEN])
        with alloc.free_group():
            if len(f[_RELEASE]):
                alloc.release(f[_RELEASE])
            if len(f[_ADV_ROW]):
                alloc.advance_frontier(f[_ADV_ROW], f[_ADV_POS])
        if len(f[_RELEASE]):
            self.released[f[_RELEASE]] = False
        self.clear()  # (only frees were recorded: the call's arrays are not)
        self.n_takes = 0
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
        if self.inserts:
            self._register()
        released = self.fields[_RELEASE]
        if len(released):
            self.released[released] = False
        self.clear()
        self.n_takes = 0
        self.frees_version += 1
