"""The compiled twin of the numpy reference planner (C, ``graphalloc.plan._cplan``).

:class:`CompiledPlanner` takes what :func:`graphalloc.plan.reference.plan_step` takes -- one
:class:`~graphalloc.plan.step.StepArrays`, the epoch, the free group's masks and the prefix
cache's offer -- and gives what it gives: a :class:`~graphalloc.plan.reference.PlanOutcome`
with the same fields and values, the ledger updated in place, or a
:class:`~graphalloc.plan.refusals.Refusal` with the same ``(code, kind, row, value,
limit)`` and nothing changed. The two are compared byte for byte by
``tests/planning/test_compiled_planner.py`` (descriptor sections, every ledger array, outcomes,
refusals, host table copies). The reference is the spec; this is its cost.

Lifecycle, as facts about state:

* Construction binds, once, the ledger's arrays (``Ledger.arrays()``: never rebound), the
  page mirror (pool mode), the recurrent-state arrays (``num_state_slots > 0``), every
  descriptor buffer of ``alloc.ring`` plus one scratch buffer for dry runs, the tables'
  pinned host copies per buffer, and per-buffer result arrays.
* ``plan(arrays, epoch, index, ...)`` writes the release, allocation, lane and state rows
  straight into buffer ``index`` (``None``: the scratch one), zeroes the rows that buffer
  used before as ``DescriptorRing.write`` / ``write_states`` do, updates ``ring.used`` /
  ``ring.fusable`` / ``ring.state_used``, writes the host copies of the tables, and keeps its
  own undo log of every ledger write. A refusal rolls the log back to where the call began
  and puts the overwritten descriptor rows back (lane and state rows are written only once
  nothing can refuse).
* The log stays open until ``commit()`` (the step was submitted) or ``rollback(mark)``
  (cancelled, or a dry run); ``mark()`` gives a position, as ``Journal.mark`` does.

The outcome's ``release_rows`` / ``alloc_rows`` / ``state_rows`` are views of the descriptor
buffer and its
result arrays views of per-buffer arrays: valid until that buffer is planned again (the
ring comes back to it). Result arrays still referenced elsewhere then (an ``AllocResult``
kept by the caller) are replaced, never overwritten. ``lanes`` is a :class:`CompiledLanes`:
the :class:`~graphalloc.plan.lanes.LaneOutcome` fields, read from the lane rows.

``resolve_planner`` decides who plans: ``"auto"`` (the compiled twin when it was built;
``GRAPHALLOC_PLANNER=numpy`` forces numpy), ``"compiled"`` (refused with ``ConfigError``
when it was not built) or ``"numpy"``. A model with several window pools is planned by
numpy (:meth:`CompiledPlanner.for_parts`: ``"auto"`` picks numpy, ``"compiled"`` is
refused). Without the extension this module warns once at
import. At import the C constants are checked against :mod:`graphalloc.kernels.abi`, the
StepArrays fields, the kind ids and the refusal codes.

Cost: a few microseconds of Python per step (argument passing, the outcome) plus the C work,
O(rows + pages freed + pages allocated); ``benchmarks/bench_planner.py`` measures both.
"""

from __future__ import annotations

import os
import sys
import warnings

import numpy as np

from ..device.layout import ALLOCATION, LANES, RELEASE, STATES
from ..errors import ConfigError
from ..kernels import abi
from ..parts import DeviceParts
from ..state import references
from ..state.ledger import Ledger
from .reference import PlanOutcome
from .refusals import Kind, Refusal, RefusalCode
from .step import EMPTY, StepArrays

__all__ = ["AVAILABLE", "UNAVAILABLE_REASON", "CompiledPlanner", "CompiledLanes",
           "CompiledPlannerWarning", "PLANNERS", "resolve_planner"]

PLANNERS = ("auto", "compiled", "numpy")

# the descriptor sections the C writes (device/layout.py), whose first rows Planner() takes
_SECTIONS = (RELEASE, ALLOCATION, LANES, STATES)
_HOST = ("full_kv_indptr", "full_kv_last_page_len", "swa_kv_indptr", "swa_kv_last_page_len",
         "seq_lens")  # the C's host-copy order


class CompiledPlannerWarning(RuntimeWarning):
    """The compiled planner could not be loaded; the numpy planner is used."""


def _expected(name: str):
    if name.startswith("ACT_"):
        return getattr(references, name)
    if name == "SPEC_DEPTH":
        return Ledger.SPEC_DEPTH
    if name == "N_FIELDS":
        return len(StepArrays._fields)
    return getattr(abi, name, None)  # (None: a name this side does not know)


def _refusal_names() -> dict[str, int]:
    """The names the C uses for :class:`Kind` and :class:`RefusalCode` (its
    ``_cplan_refusals.h`` is emitted from them)."""
    names = {f"K_{kind.name}": int(kind) for kind in Kind}
    names.update({f"R_{code.name}": int(code) for code in RefusalCode})
    names["N_KINDS"] = len(Kind)
    return names


def _load():
    try:
        from . import _cplan
    except ImportError as exc:
        return None, f"{type(exc).__name__}: {exc}"
    for name, value in _cplan.ABI.items():
        expected = _expected(name)
        if value != expected:
            return None, (f"built against another ABI ({name} = {value}, the Python side has "
                          f"{expected}): rebuild with pip install -e .")
    if tuple(_cplan.FIELDS) != StepArrays._fields:
        return None, "built for other StepArrays fields: rebuild with pip install -e ."
    if dict(getattr(_cplan, "REFUSALS", {})) != _refusal_names():
        return None, "refusal codes or kinds changed: rebuild with pip install -e ."
    if tuple(getattr(_cplan, "SECTIONS", ())) != _SECTIONS:
        return None, "built for other descriptor sections: rebuild with pip install -e ."
    return _cplan, ""


_cplan, UNAVAILABLE_REASON = _load()
AVAILABLE = _cplan is not None
if not AVAILABLE:
    warnings.warn(f"graphalloc: compiled planner unavailable ({UNAVAILABLE_REASON}), using the "
                  "numpy planner", CompiledPlannerWarning, stacklevel=2)


def resolve_planner(planner) -> str:
    """``"compiled"`` or ``"numpy"`` for a constructor's ``planner=`` argument."""
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


class CompiledLanes:
    """A step's attention lanes as the twin wrote them: the lane rows (a view of the
    descriptor buffer's lane section) and the :class:`~graphalloc.plan.lanes.LaneOutcome`
    fields derived from them on access. ``host_written``: the tables' host copies of the
    buffer hold this step's values already (nothing to copy)."""

    __slots__ = ("rows", "n_lanes", "n_full_pages", "n_swa_pages", "host_written")

    def __init__(self, rows, n_lanes: int, n_full_pages: int, n_swa_pages: int,
                 host_written: bool):
        self.rows, self.n_lanes = rows, n_lanes
        self.n_full_pages, self.n_swa_pages = n_full_pages, n_swa_pages
        self.host_written = host_written

    @property
    def full_indptr(self) -> np.ndarray:
        return np.append(self.rows[:, abi.PT_FULL_OFF], self.n_full_pages)

    @property
    def swa_indptr(self) -> np.ndarray:
        return np.append(self.rows[:, abi.PT_SWA_OFF], self.n_swa_pages)

    @property
    def last_page_len(self) -> np.ndarray:
        return self.rows[:, abi.PT_LAST_LEN].copy()

    @property
    def swa_last_page_len(self) -> np.ndarray:
        rows = self.rows
        return np.where(rows[:, abi.PT_END_PAGE] > rows[:, abi.PT_SWA_FIRST],
                        rows[:, abi.PT_LAST_LEN], 0)

    @property
    def seq_lens(self) -> np.ndarray:
        return self.rows[:, abi.PT_SEQ_LEN].copy()


class _Results:
    """One buffer's result arrays (rows, first lanes, tokens), rebound when still held (each
    base unheld has 3 references: this tuple, the C binding's buffer export, and
    ``sys.getrefcount``'s argument)."""

    __slots__ = ("bases",)

    def __init__(self, n: int):
        self.bases = tuple(np.zeros(n, dtype=np.int64) for _ in range(3))


class CompiledPlanner:
    """The compiled twin bound to one allocator's parts (see the module docstring):
    ``parts`` (:class:`~graphalloc.parts.DeviceParts`) gives the ledger it plans on, the
    descriptor ring it writes and the attention tables' host copies."""

    def __init__(self, parts: DeviceParts):
        cfg, led, ring = parts.config, parts.ledger, parts.ring
        tables = parts.tables
        spec = None if tables is None else tables.spec
        shape = None if spec is None else (
            spec.max_batch, spec.model_window, spec.max_full_indices, spec.max_swa_indices,
            spec.has("csr", "full"), spec.has("csr", "swa"))
        pools, layout = cfg.pools, ring.layout
        state = pools.state
        states = None if not state.has_states else (state.num_slots, state.max_spec_tokens,
                                                     layout.n_rows_of(STATES))
        window = pools.window
        window = None if not window.has_window else (window.rule.c_kind, window.rule.tokens,
                                                     window.ring_pages)
        self._c = _cplan.Planner(
            cfg.page_size, cfg.max_reqs, cfg.max_handles, cfg.max_context_len,
            cfg.max_tokens_per_alloc_row, cfg.max_pages_per_row, cfg.max_release_rows,
            cfg.max_step_pages, cfg.max_alloc_rows, cfg.max_step_tokens, cfg.num_full_pages,
            cfg.num_swa_pages, cfg.pages_per_request, len(ring), EMPTY, window, shape, states,
            tuple(layout.first_row(name) for name in _SECTIONS))
        self._c.bind_ledger(led.live, led.admitted_once, led.seq_len, led.frontier,
                            led.committed, led.spec_steps, led.h_live, led.h_len,
                            led.h_swa_start, led.rings)
        if states is not None:  # (the state pool's arrays, bound when it exists)
            self._c.bind_states(led.state_slot, led.spec_state, led.state_ring)
        if led.refs is not None:
            refs = led.refs
            self._c.bind_refs(refs.page_of, refs.swa_of, refs.full_ring, refs.swa_ring,
                              refs.full_ref, refs.swa_ref)
        self._ring = ring
        self._n_reqs = cfg.max_reqs
        self._scratch = np.zeros_like(ring.np_bufs[0])
        self._scratch_used = (0, 0, 0)  # release, allocation, state rows
        self._descs = list(ring.np_bufs) + [self._scratch]
        # the outcome's views: the allocation section's first row, the lane section, the
        # state section's first row (from the layout; the twin wrote them there)
        self._alloc_first = layout[ALLOCATION].first_row
        self._lanes = layout.rows(LANES)
        self._states_first = layout.rows(STATES).start
        self._tables = spec is not None
        self._results: list[_Results] = []
        for i, desc in enumerate(self._descs):
            host = None
            if tables is not None and i < len(ring):
                host = tuple(tables.host_np[name][i] if name in tables.host_np else None
                             for name in _HOST)
            res = _Results(cfg.max_reqs)
            self._c.bind_buffer(i, desc, *res.bases, host)
            self._results.append(res)
        self.n_planned = 0  # steps this twin planned (refusals not counted)
        # The undo log's calls, bound to the C methods (no Python frame per step):
        self.mark = self._c.mark  # () -> a position in the undo log (Journal.mark)
        self.commit = self._c.commit  # () -> None: the writes are final, the log forgotten

    @classmethod
    def for_parts(cls, parts, planner: str = "auto") -> CompiledPlanner | None:
        """The twin for an allocator's ``parts``, or ``None`` when ``planner`` resolves to
        numpy. The twin plans one window pool: a model with further window pools
        (``config.pools.extras``) is planned by numpy under ``"auto"`` and refused under
        ``"compiled"``."""
        if resolve_planner(planner) != "compiled":
            return None
        extras = parts.config.pools.extras
        if extras:
            if planner == "compiled":
                raise ConfigError(
                    f"planner='compiled' plans one window pool; this model has "
                    f"{1 + len(extras)} ({', '.join(x.describe() for x in extras)} beside the "
                    "first): use planner='auto' or 'numpy' (the numpy planner plans them)")
            return None
        return cls(parts)

    def _fresh_results(self, i: int) -> _Results:
        """Buffer ``i``'s result arrays, replaced first when something still holds them."""
        res = _Results(self._n_reqs)
        self._c.bind_results(i, *res.bases)
        self._results[i] = res
        return res

    def plan(self, arrays: StepArrays, epoch: int, index: int | None, excluded_rows=None,
             excluded_handles=None, reclaim=None) -> PlanOutcome:
        """Plan ``arrays`` into descriptor buffer ``index`` (``None``: the scratch buffer);
        raises :class:`Refusal` with everything as before."""
        ring = self._ring
        i = len(ring) if index is None else index
        old = self._scratch_used if index is None else (*ring.used[index],
                                                         ring.state_used[index])
        res = self._results[i]
        b = res.bases
        rc = sys.getrefcount
        if rc(b[0]) > 3 or rc(b[1]) > 3 or rc(b[2]) > 3:  # still held: fresh ones
            res = self._fresh_results(i)
        out = self._c.plan(arrays, epoch, -1 if index is None else index, old[0], old[1],
                           old[2], excluded_rows, excluded_handles, reclaim)
        if out[0]:
            raise Refusal(*out)
        (_, n_rel, n_al, n_tok, freed_full, freed_swa, alloc_full, alloc_swa, evicted,
         fusable, n_res, n_lanes, n_full, n_swa, n_reclaimed, n_state) = out
        if index is None:
            self._scratch_used = (n_rel, n_al, n_state)
        else:
            ring.used[index] = (n_rel, n_al)
            ring.fusable[index] = fusable
            ring.state_used[index] = n_state
        desc = self._descs[i]
        base = self._alloc_first
        lanes = None
        if self._tables:
            lanes = CompiledLanes(desc[self._lanes], n_lanes, n_full, n_swa, index is not None)
        b = res.bases
        self.n_planned += 1
        states = desc[self._states_first:self._states_first + n_state] if n_state else None
        return PlanOutcome(desc[:n_rel], desc[base:base + n_al], n_tok, (freed_full, freed_swa),
                           (alloc_full, alloc_swa), evicted, fusable, b[0][:n_res],
                           b[1][:n_res], b[2][:n_res],
                           self._c.reclaimed() if n_reclaimed else [], lanes, states)

    def rollback(self, mark: int = 0) -> None:
        """Undo every ledger write after ``mark`` (newest first)."""
        self._c.rollback(mark)

