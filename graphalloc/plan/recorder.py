"""One scheduler iteration recorded as ONE :class:`~graphalloc.plan.step.Step`.

::

    with alloc.scheduler_step() as it:
        it.release(finished_rows)             # frees
        it.commit(spec_rows, n_accepted)      # (speculative decoding; it.trim(rows, lens))
        it.evict(decoding_rows)               # (window rule; it.evict_all(), it.advance(...))
        it.drop_handle(h)                     # (it.drop_handle_swa(h), it.take_handle(r, n))
        r = it.admit(handle=cached)           # admits (rows reserved at the call)
        d = it.decode(decoding_rows)          # allocations
        e = it.extend([r], [chunk])
    kv_full, kv_swa = d.full_slots, d.swa_slots   # valid once the step ran

Every call appends its rows to the block's Step (calls of one kind concatenate, in call
order); at the block's end the Step runs as ONE ``alloc.step(...)`` -- in the step's own
order (:mod:`graphalloc.plan.step`), whatever order the calls came in -- refused whole with
nothing changed if any part breaks a rule. Output lanes: the decode calls' rows in call
order, then the extend calls', then the load-backs'. The results (:class:`StepSlots`)
refuse access before the step ran and after a later allocating step overwrote them.

Misuse is refused, not absorbed (:class:`~graphalloc.errors.RecorderError`): a call on a
block that has closed, and any direct allocator operation while the block is open (it would
run as an extra step before the block's). ``None`` where a call names its rows or handles
(``it.release(None)``, ``it.evict(None)``, ...) is refused at the call
(``UnknownRequestError`` / ``UnknownHandleError``) instead of recording nothing. An
exception escaping the block runs nothing: the block is a transaction (``free_group()``
follows the same rule).

Cost: recording is O(rows of the call) (the arguments are kept as given); the step at the
end costs what ``alloc.step`` with the same work costs, plus one concatenation per kind
recorded more than once.
"""

from __future__ import annotations

import numpy as np

from ..errors import (
    CapacityError,
    NestedGroupError,
    PendingStepError,
    PositionError,
    RecorderError,
    UnknownHandleError,
    UnknownRequestError,
)
from ..inputs import as_int64, one_handle
from ..state.free_ids import lowest_free
from .step import Step

__all__ = ["StepRecorder", "StepSlots"]


class StepSlots:
    """The slots one allocation call of a block got: its rows' lanes of the step's result.
    ``rows``, ``n_tokens`` (host), ``full_slots``, ``swa_slots`` (device views)."""

    __slots__ = ("_rec", "_start", "_stop")

    def __init__(self, recorder: StepRecorder, start: int, stop: int):
        self._rec, self._start, self._stop = recorder, start, stop

    def _part(self):
        rec = self._rec
        if rec.result is None:
            raise PendingStepError("the step of this scheduler_step() block has not run yet: "
                                   "read its slots after the block")
        offset = rec.offsets[0 if self._start[0] == "decode" else
                             1 if self._start[0] == "extend" else 2]
        return rec.result, offset + self._start[1], offset + self._stop

    @property
    def rows(self) -> np.ndarray:
        result, a, b = self._part()
        return result.rows[a:b]

    @property
    def n_tokens(self) -> np.ndarray:
        result, a, b = self._part()
        return result.n_tokens[a:b]

    def _lanes(self):
        result, a, b = self._part()
        if b <= a:
            return result, 0, 0
        return result, int(result.first_lane[a]), int(result.first_lane[b - 1]
                                                      + result.n_tokens[b - 1])

    @property
    def full_slots(self):
        """The call's new tokens' full slots, rows in the order given (a device view)."""
        result, lo, hi = self._lanes()
        return result.full_slots[lo:hi]

    @property
    def swa_slots(self):
        """The call's new tokens' SWA slots (a device view)."""
        result, lo, hi = self._lanes()
        return result.swa_slots[lo:hi]


class StepRecorder:
    """The calls of one ``alloc.scheduler_step()`` block (see the module docstring)."""

    __slots__ = ("alloc", "open", "result", "offsets", "_parts", "_evict_all", "_n",
                 "_admitted", "_taken")

    def __init__(self, alloc):
        self.alloc = alloc
        self.open = False  # calls are recorded between __enter__ and __exit__
        self.result = None
        self.offsets = (0, 0, 0)  # first result row of the decode / extend / load-back rows
        self._parts: dict[str, list] = {}  # kind -> the calls' arguments, in call order
        self._evict_all = False
        self._n = [0, 0, 0]  # rows recorded by decode / extend / load-back calls
        self._admitted: list[int] = []
        self._taken: list[int] = []

    # ---- the block (``with alloc.scheduler_step() as it``) -------------------------------
    def __enter__(self) -> StepRecorder:
        alloc = self.alloc
        if alloc.recorder is not None:
            raise RecorderError("scheduler_step() while a scheduler_step() block is open: "
                                "one block is one step; record into the open block")
        if alloc.group is not None:
            raise NestedGroupError("scheduler_step() inside free_group(): the block is one "
                                   "step of its own; close the free group first")
        pipeline = alloc.pipeline
        if pipeline.pending is not None or pipeline.faulted or not (
                pipeline.executor.plans_locally):
            pipeline.refuse_planning()  # raises
        alloc.recorder, self.open = self, True
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self.open = False
        alloc = self.alloc
        alloc.recorder = None
        if exc_type is None:  # an exception escaping the block runs nothing
            self.result = alloc.pipeline.step(None, self.to_kinds())  # (= alloc.step)
            n_dec, n_ext = self._n[0], self._n[1]
            self.offsets = (0, n_dec, n_dec + n_ext)
        return False

    def _add(self, kind: str, *values) -> None:
        if not self.open:
            raise RecorderError(f"scheduler_step(): {kind}() on a block that has closed; its "
                                "step already ran (or was discarded). Record into a new block")
        calls = self._parts.get(kind)
        if calls is None:
            self._parts[kind] = [values]
        else:
            calls.append(values)

    def _record(self, kind: str, values: tuple, error: type = UnknownRequestError) -> None:
        """Record a call naming rows (or handles): its first value None is refused at the
        call, a closed block too. The hot path: two tests and a dict write."""
        if values[0] is None:
            self._given(kind, None, error)
        if not self.open:
            self._add(kind)  # raises
        calls = self._parts.get(kind)
        if calls is None:
            self._parts[kind] = [values]
        else:
            calls.append(values)

    def _given(self, kind: str, value, error: type) -> None:
        """A recorded call names what it acts on: None is refused at the call."""
        if value is None:
            noun = "handles" if error is UnknownHandleError else "request rows"
            hint = "; it.evict_all() evicts every row" if kind == "evict" else ""
            raise error(f"scheduler_step(): {kind}(None); pass the {noun} (an empty list for "
                        f"none){hint}")

    # ---- frees ---------------------------------------------------------------------------
    def release(self, rows) -> None:
        self._record("release", (rows,))

    def accept(self, rows, n_accepted) -> None:
        """Keep 1 + n_accepted tokens of each row's oldest speculative step (``accept=``)."""
        self._record("accept", (rows, n_accepted))

    def commit(self, rows, n_kept) -> None:
        """Deprecated: :meth:`accept` with ``n_kept - 1`` (warns when the step is built)."""
        self._record("commit", (rows, n_kept))

    def trim(self, rows, new_len) -> None:
        self._record("trim", (rows, new_len))

    def evict(self, rows) -> None:
        self._record("evict", (rows,))

    def evict_all(self) -> None:
        if not self.open:
            self._add("evict_all")  # raises
        self._evict_all = True

    def advance(self, rows, new_frontier_pos) -> None:
        self._record("advance", (rows, new_frontier_pos))

    def drop_handle(self, handle) -> None:
        self._given("drop_handle", handle, UnknownHandleError)
        one_handle(handle, "scheduler_step(): drop_handle")
        self._add("drop", handle)

    def drop_handle_swa(self, handle) -> None:
        self._given("drop_handle_swa", handle, UnknownHandleError)
        one_handle(handle, "scheduler_step(): drop_handle_swa")
        self._add("drop_swa", handle)

    def take_handle(self, row, n_tokens) -> int:
        """Reserve the lowest free handle; the step takes it (a cache insert). Returns it."""
        live = self.alloc.ledger.h_live
        h = lowest_free(live, self._taken)
        if h < 0:
            raise CapacityError(f"take_handle: all {len(live)} handles are held or reserved "
                                "in this block; drop one first")
        self._add("take", h, row, n_tokens)
        self._taken.append(h)
        return h

    # ---- admits and allocations ----------------------------------------------------------
    def admit(self, handle=None, n_tokens=None) -> int:
        """Reserve the lowest free row (the step admits it); returns it."""
        if handle is None and n_tokens is not None:
            raise PositionError("admit(n_tokens=...) shares that much of a handle: pass "
                                "handle= too (a plain admit starts empty)")
        row = self.alloc.free_row(reserved=self._admitted)
        if handle is None:
            self._add("admit", row)
        else:
            self._add("admit_on", row, handle, n_tokens)
        self._admitted.append(row)
        return row

    def _alloc_call(self, kind: str, which: int, values: tuple) -> StepSlots:
        if values[0] is None or not self.open:  # (refused: _record raises)
            self._record(kind, values)
        calls = self._parts.get(kind)
        if calls is None:
            self._parts[kind] = [values]
        else:
            calls.append(values)
        rows, n = values[0], self._n
        start = n[which]
        try:
            n[which] = stop = start + len(rows)
        except TypeError:  # one row given as an int
            n[which] = stop = start + 1
        return StepSlots(self, (kind, start), stop)

    def decode(self, rows, lookahead=None) -> StepSlots:
        """One token per row; ``lookahead=k``: ``1 + k`` speculative tokens per row."""
        return self._alloc_call("decode", 0, (rows, lookahead))

    def extend(self, rows, n_tokens) -> StepSlots:
        return self._alloc_call("extend", 1, (rows, n_tokens))

    def load_back(self, row, new_frontier_pos) -> StepSlots:
        return self._alloc_call("load_back", 2, ([row] if np.ndim(row) == 0 else row,
                                                 new_frontier_pos))

    # ---- the step ------------------------------------------------------------------------
    def to_step(self) -> Step:
        """The block's calls as one :class:`Step` (O(rows recorded); a kind recorded once is
        passed on as it was given). Only the kinds recorded are visited."""
        return Step(**self.to_kinds())

    def to_kinds(self) -> dict:
        """:meth:`to_step`'s keywords (what the block's end hands to ``alloc.step``)."""
        kw = {"evict_all": self._evict_all}
        for kind, calls in self._parts.items():
            _BUILD[kind](kw, kind, calls)
        return kw


# ---- to_step: one builder per recorded kind (the typed error each part raises) ----------
def _rows_kind(kw, kind, calls):
    kw[kind] = _cat([v[0] for v in calls], UnknownRequestError, kind)


def _handles_kind(kw, kind, calls):
    kw[kind] = _cat([v[0] for v in calls], UnknownHandleError, kind)


def _pair_kind(kw, kind, calls):
    if len(calls) == 1:  # as given: the normaliser broadcasts an int
        kw[kind] = calls[0]
        return
    kw[kind] = (_cat([v[0] for v in calls], UnknownRequestError, kind),
                _cat([_per(v[1], v[0]) for v in calls], PositionError, kind))


def _take_kind(kw, kind, calls):
    kw["take"] = (_cat([[v[0]] for v in calls], UnknownHandleError, "take_handle"),
                  _cat([[v[1]] for v in calls], UnknownRequestError, "take_handle"),
                  _cat([[v[2]] for v in calls], PositionError, "take_handle"))


def _admit_on_kind(kw, kind, calls):
    kw["admit_on"] = (_cat([[v[0]] for v in calls], UnknownRequestError, "admit"),
                      _cat([[v[1]] for v in calls], UnknownHandleError, "admit(handle=)"),
                      _cat([[-1 if v[2] is None else v[2]] for v in calls], PositionError,
                           "admit n_tokens"))


def _decode_kind(kw, kind, calls):
    if len(calls) == 1:
        kw["decode"], lookahead = calls[0]
        if lookahead is not None:
            kw["lookahead"] = lookahead
        return
    kw["decode"] = _cat([v[0] for v in calls], UnknownRequestError, "decode")
    if any(v[1] is not None for v in calls):
        kw["lookahead"] = _cat([_per(-1 if v[1] is None else v[1], v[0]) for v in calls],
                               PositionError, "lookahead")


_BUILD = {"release": _rows_kind, "evict": _rows_kind, "admit": _rows_kind,
          "drop": _handles_kind, "drop_swa": _handles_kind, "accept": _pair_kind,
          "commit": _pair_kind,
          "trim": _pair_kind, "advance": _pair_kind, "extend": _pair_kind,
          "load_back": _pair_kind, "take": _take_kind, "admit_on": _admit_on_kind,
          "decode": _decode_kind}


def _per(value, rows):
    """One value per row of ``rows`` (an int broadcast); anything else as it is."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
        return [value] * len(_listed(rows))
    return value


def _listed(rows):
    if isinstance(rows, (int, np.integer)):
        return [rows]
    return rows if hasattr(rows, "__len__") else [rows]


def _cat(parts: list, error: type, what: str):
    """Concatenate recorded arguments: one call's as it is (the normaliser converts and
    checks it), several through the one conversion path (the same typed errors)."""
    if len(parts) == 1:
        return parts[0]
    return np.concatenate([as_int64(x, what, error) for x in parts])
