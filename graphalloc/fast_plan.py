"""The compiled planner: the hot scheduler step planned in C, the numpy planner its reference.

``HybridAllocator(cfg, planner="auto" | "compiled" | "numpy")`` (default ``"auto"``: the
compiled planner when it was built). A step that :class:`FastPlanner` plans gives the same
descriptor rows, the same ledger and page-mirror arrays and the same results as the numpy
planner (:class:`graphalloc.planner.StepBuilder`, still the one validator and the
reference: ``tests/test_compiled_planner.py`` compares the two byte for byte on random
steps). What it covers, in ``step()`` / ``plan()``::

    release=rows, commit=(rows, n_accepted), trim=(rows, new_len), evict=rows |
    evict_all=True, advance=(rows, pos), decode=rows [, lookahead=k], extend=(rows, n)
                            pool mode (page mirror, reference counts, drop_actions' push
                            order, shared pages) and ring mode

so a speculative engine's round ``step(commit=(rows, n), evict=rows, decode=rows,
lookahead=k)`` is planned in C (the commit and the trim each one drop call, as
release_rows._cut; the window rule and frontier moves on the committed length after them).
Everything else -- handles, admits, load-back, ``AL_COPY`` rows, an open ``free_group()``,
``fits()`` dry runs, ``scheduler_step()``, argument forms other than ``None`` / a Python
int / a list or tuple of Python ints / a 1-D int64 numpy array (``commit`` / ``trim`` /
``advance`` / ``extend`` a tuple or list of two), a negative trim length, and every step
the C code refuses -- runs the numpy planner as before, which plans it or raises its
precise typed error. So behaviour is exactly the numpy planner's; only the cost differs.

How a step is planned (``graphalloc/_cplan.c``): phase A checks every rule that needs no
page mirror (rows live and once, frontier moves aligned / forward / inside the pages that
existed, lengths, the allocation side's frozen shapes, ring spans) and writes nothing;
phase B plans the frees in place -- ledger, page mirror and release rows straight into the
pinned descriptor buffer -- through an undo log, because what a free gives back depends on
reference counts that the step's own frees change (two released rows sharing a page), and
the capacity and release-shape checks need exactly that; a refusal there rolls the log back
and zeroes the rows written before the call returns. Phase C writes the allocations and
cannot fail. A refused call has changed nothing, host or device (the same rule as the numpy
planner's: refuse before you touch, as far as anyone outside the call can see).

The call boundary is lean: the ledger, page-mirror, descriptor and result arrays are bound
once (again only when the ledger object changes, i.e. after a step the numpy planner
committed); a step passes its arguments as they are (no conversion to numpy) and gets one
tuple back. The :class:`~graphalloc.results.PlannedStep` and
:class:`~graphalloc.results.AllocResult` objects and their row arrays are reused per
descriptor buffer when nothing outside holds them (reference counts), else fresh ones are
made; they hold the allocator weakly (no reference cycle through the cache).

Why C as a CPython extension: measured on one 2-core Xeon at B = 256, page size 16,
W = 4096 (the same semantics, byte-identical descriptors and ledger on 30,000 random
steps): numpy planner 213 us per step, restructured numpy 101 us, numba 23 us, C through
ctypes 24 us, a C extension 11 us with the old wrapper and 6-8 us with this call boundary
(the C work itself is under 4 us). numba is a 208 MB dependency with a compile at first
call; Cython adds a build dependency and a second language to read; ctypes pays argument
marshalling per call. A C extension needs only a C compiler at install (setup.py builds it
as an optional extension; without one the install still succeeds and this module warns
once at import and uses the numpy planner). It uses the buffer protocol, not the numpy C
API, so the build needs no numpy headers.

Cost: per step O(rows + pages freed + pages allocated) in C plus a fixed ~2-4 us of Python
(argument unpacking, the result objects); ``benchmarks/bench_planner.py`` measures it.
"""

from __future__ import annotations

import os
import sys
import warnings
import weakref

import numpy as np

from .errors import ConfigError
from .kernels import abi
from .results import AllocResult, PlannedStep

__all__ = ["AVAILABLE", "UNAVAILABLE_REASON", "CompiledPlannerWarning", "FastPlanner",
           "PLANNERS", "resolve_planner"]

PLANNERS = ("auto", "compiled", "numpy")


class CompiledPlannerWarning(RuntimeWarning):
    """The compiled planner could not be loaded; the numpy planner is used."""


def _load():
    try:
        from . import _cplan
    except ImportError as exc:
        return None, f"{type(exc).__name__}: {exc}"
    for name, value in _cplan.ABI.items():
        if name.startswith("ACT_"):
            from . import references
            expected = getattr(references, name)
        else:
            expected = getattr(abi, name)
        if value != expected:
            return None, f"built against another ABI ({name} = {value}, kernels.abi has " \
                         f"{expected}): rebuild with pip install -e ."
    _cplan.set_ndarray_type(np.ndarray)
    return _cplan, ""


_cplan, UNAVAILABLE_REASON = _load()
AVAILABLE = _cplan is not None
if not AVAILABLE:
    warnings.warn(f"graphalloc: compiled planner unavailable ({UNAVAILABLE_REASON}), using the "
                  "numpy planner", CompiledPlannerWarning, stacklevel=2)


def resolve_planner(planner) -> str:
    """``"compiled"`` or ``"numpy"`` for a constructor's ``planner=`` argument. ``"auto"``
    picks the compiled planner when it was built (the environment variable
    ``GRAPHALLOC_PLANNER=numpy`` makes ``"auto"`` pick the numpy planner); ``"compiled"``
    without it raises :class:`ConfigError`."""
    if not isinstance(planner, str) or planner not in PLANNERS:
        raise ConfigError(f"planner must be one of {PLANNERS}, got {planner!r}")
    if planner == "auto":
        wanted = os.environ.get("GRAPHALLOC_PLANNER", "auto")
        return "compiled" if AVAILABLE and wanted != "numpy" else "numpy"
    if planner == "compiled" and not AVAILABLE:
        raise ConfigError(f"planner='compiled', but the compiled planner is unavailable "
                          f"({UNAVAILABLE_REASON}); reinstall with a C compiler "
                          "(pip install -e .) or use planner='numpy'")
    return planner


def _dead():
    return None


class _ReusedPlannedStep(PlannedStep):
    """A :class:`PlannedStep` the compiled path reuses; its allocator is held weakly."""

    @property
    def owner(self):
        return self._owner_ref()

    @owner.setter
    def owner(self, alloc):
        self._owner_ref = _dead if alloc is None else weakref.ref(alloc)


class _ReusedAllocResult(AllocResult):
    """An :class:`AllocResult` the compiled path reuses; its allocator is held weakly."""

    @property
    def _alloc(self):
        return self._alloc_ref()

    @_alloc.setter
    def _alloc(self, alloc):
        self._alloc_ref = _dead if alloc is None else weakref.ref(alloc)


_EMPTY = np.zeros(0, dtype=np.int64)


class _Slot:
    """One reusable set of result objects for one descriptor buffer."""

    __slots__ = ("planned", "result", "bases", "n")

    def __init__(self, alloc, index: int, n_rows: int):
        self.bases = tuple(np.zeros(n_rows, dtype=np.int64) for _ in range(3))
        self.n = 0
        rows, first, n_tok = (b[:0] for b in self.bases)
        state = alloc.state
        self.result = _ReusedAllocResult(rows, first, n_tok, state.out_full_buf,
                                         state.out_swa_buf, 0, 0, alloc)
        self.planned = _ReusedPlannedStep(index, 0, 0, 0, {}, {}, None, False, 0, owner=alloc)

    def held(self, bound: bool) -> bool:
        """Whether anything outside this slot (and the compiled planner's binding) holds
        one of its objects: then it must not be rewritten."""
        # Counts with no local names bound to the objects: the argument of getrefcount is
        # the only temporary reference.
        rc = sys.getrefcount
        if rc(self.planned) > 2 or rc(self.result) > 2 + (self.planned.result is self.result):
            return True  # (the slot, the planned step's result, the argument)
        if rc(self.result.rows) > 2 or rc(self.result.first_lane) > 2 or (
                rc(self.result.n_tokens) > 2):
            return True  # (the result's attribute, the argument)
        limit = 3 + bound  # the tuple, the result's view, the argument (+ the C binding)
        bases = self.bases
        return rc(bases[0]) > limit or rc(bases[1]) > limit or rc(bases[2]) > limit


class FastPlanner:
    """The compiled planner of one allocator (see the module docstring). Holds no reference
    to the allocator: every call passes it."""

    MAX_SLOTS = 3  # result-object sets kept per descriptor buffer

    def __init__(self, alloc):
        cfg, ring = alloc.config, alloc.ring
        self._c = _cplan.Planner(
            cfg.page_size, cfg.max_reqs, cfg.swa_ring_pages, cfg.sliding_window,
            cfg.max_context_len, cfg.max_tokens_per_alloc_row, cfg.max_pages_per_row,
            cfg.max_release_rows, cfg.max_step_pages, cfg.max_alloc_rows, cfg.max_step_tokens,
            cfg.num_full_pages, cfg.num_swa_pages, cfg.pages_per_request,
            cfg.max_reqs + cfg.max_handles, len(ring))
        self._ledger = None
        self._refs = None
        self._ledger_ok = self._refs_ok = False
        self._n_rows = cfg.max_reqs
        self._slots: list[list[_Slot]] = [[] for _ in range(len(ring))]
        self._bound: list[_Slot | None] = [None] * len(ring)
        self.n_planned = 0  # steps planned here
        self.n_fallback = 0  # steps handed to the numpy planner

    @classmethod
    def for_allocator(cls, alloc, planner: str = "auto") -> FastPlanner | None:
        """The compiled planner for ``alloc``, or ``None`` when ``planner`` resolves to the
        numpy planner (:func:`resolve_planner`)."""
        if resolve_planner(planner) != "compiled":
            return None
        return cls(alloc)

    @property
    def last_refusal(self) -> int:
        """Why the last step was not planned here (``_cplan.R_*``; 0: it was)."""
        return self._c.last_refusal

    # ---- binding ---------------------------------------------------------------------------
    def _bind_ledger(self, led) -> None:
        """Bind the C planner to ``led``'s arrays (after the numpy planner committed a new
        ledger; the page mirror, shared by every copy, only when it changed). ~1 us."""
        c, refs = self._c, led.refs
        self._ledger, self._ledger_ok = led, False
        try:
            c.bind_ledger(led.live, led.seq_len, led.frontier, led.protected,
                          getattr(led, "committed", None), getattr(led, "spec_steps", None))
            if refs is not self._refs or not self._refs_ok:
                self._refs, self._refs_ok = refs, False
                if refs is None:
                    c.bind_refs(None)
                else:
                    c.bind_refs(refs.page_of, refs.swa_of, refs.full_ring, refs.swa_ring,
                                refs.full_ref, refs.swa_ref)
                self._refs_ok = True
        except (ValueError, BufferError, TypeError):
            return  # a ledger of other arrays (a foreign copy): the numpy planner plans
        self._ledger_ok = True

    def _slot(self, alloc, index: int) -> _Slot:
        bound = self._bound[index]
        if bound is not None and not bound.held(True):
            return bound
        slots = self._slots[index]
        for slot in slots:
            if slot is not bound and not slot.held(False):
                break
        else:
            slot = _Slot(alloc, index, self._n_rows)
            if len(slots) < self.MAX_SLOTS:
                slots.append(slot)
            else:  # every kept set is held: replace one not bound (its holders keep it)
                slots[slots.index(bound) - 1 if bound in slots else 0] = slot
        self._c.bind_buffer(index, alloc.ring.np_bufs[index], *slot.bases)
        self._bound[index] = slot
        return slot

    # ---- one step --------------------------------------------------------------------------
    def plan(self, alloc, release, evict, evict_all, advance, decode, extend, commit=None,
             trim=None, lookahead=None):
        """Plan ``alloc.step(...)``'s arguments here: the :class:`PlannedStep` (set as the
        allocator's pending step), or ``None`` with nothing changed when the numpy planner
        must plan it. The caller has checked that no free group is open."""
        alloc._refuse_planning()
        led = alloc.ledger
        if led is not self._ledger or led.refs is not self._refs:
            self._bind_ledger(led)
        if not self._ledger_ok:
            self.n_fallback += 1
            return None
        if advance is None:
            adv_given, adv_rows, adv_pos = False, None, None
        elif (type(advance) is tuple or type(advance) is list) and len(advance) == 2:
            adv_given, (adv_rows, adv_pos) = True, advance
        else:
            self.n_fallback += 1
            return None
        if extend is None:
            ext_given, ext_rows, ext_n = False, None, None
        elif (type(extend) is tuple or type(extend) is list) and len(extend) == 2:
            ext_given, (ext_rows, ext_n) = True, extend
        else:
            self.n_fallback += 1
            return None
        if commit is None:
            com_given, com_rows, com_n = False, None, None
        elif (type(commit) is tuple or type(commit) is list) and len(commit) == 2:
            com_given, (com_rows, com_n) = True, commit
        else:
            self.n_fallback += 1
            return None
        if trim is None:
            trim_given, trim_rows, trim_len = False, None, None
        elif (type(trim) is tuple or type(trim) is list) and len(trim) == 2:
            trim_given, (trim_rows, trim_len) = True, trim
        else:
            self.n_fallback += 1
            return None
        ring = alloc.ring
        index = ring.acquire()
        slot = self._slot(alloc, index)
        old_rel, old_al = ring.used[index]
        epoch = alloc.steps_run + 1
        out = self._c.step(index, epoch, led.full, led.swa, release, evict, evict_all,
                           adv_rows, adv_pos, decode, ext_rows, ext_n, adv_given, ext_given,
                           old_rel, old_al, com_rows, com_n, trim_rows, trim_len, com_given,
                           trim_given, lookahead)
        if out is None:
            self.n_fallback += 1
            return None
        n_rel, n_al, n_tok, freed_full, freed_swa, alloc_full, alloc_swa, evicted, fusable, \
            n_res, has_result = out
        ring.used[index] = (n_rel, n_al)
        ring.fusable[index] = fusable
        planned = slot.planned
        if has_result:
            result = slot.result
            if slot.n != n_res:
                rows, first, n_tokens = slot.bases
                result.rows, result.first_lane, result.n_tokens = \
                    rows[:n_res], first[:n_res], n_tokens[:n_res]
                slot.n = n_res
            result.n_step_tokens = n_tok
            result.step_index = epoch
            planned.result = result
        else:
            planned.result = None
        planned.n_release_rows = n_rel
        planned.n_alloc_rows = n_al
        planned.n_tokens = n_tok
        planned.pages_freed = {"full": freed_full, "swa": freed_swa}
        planned.pages_allocated = {"full": alloc_full, "swa": alloc_swa}
        planned.fusable = fusable
        planned.pages_evicted = evicted
        planned.submitted = False
        alloc._pending = planned
        self.n_planned += 1
        return planned
