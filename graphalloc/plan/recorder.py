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

Every call appends its rows to the block's Step (calls of one kind follow each other, in
call order); at the block's end the Step runs as ONE ``alloc.step(...)`` -- in the step's own
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

The calls record into the one accumulator (:class:`~graphalloc.plan.accumulator.
StepAccumulator`, which this class is): each call's arguments are converted by the step's
one conversion path at the call and appended to growable int64 columns. Bad input is the
block's refusal, not the call's: its typed error (the normaliser's) is kept and raised at
the block's end with nothing run (the first kind in the step's order, its first call), as
a refused step would be (``it.commit`` warns of its deprecation at the call). ``admit``
and ``take_handle`` reserve the lowest free row / handle that the block has not reserved
yet (the accumulator asks :func:`~graphalloc.state.free_ids.lowest_free`). The block's
end plans the columns as they are (no second conversion). Rules between calls (a row
admitted twice, released and decoded, ...) are the planners': the step is refused whole at
the end.

Cost: a call is O(rows of the call) (the conversion in C for the plain forms; appends
amortised O(1) per value); the step at the end costs what ``alloc.step`` with the same
work costs, without its conversion. A few Python calls per recorded call, none per row.
"""

from __future__ import annotations

import numpy as np

from ..errors import (
    CapacityError,
    ContractError,
    NestedGroupError,
    PendingStepError,
    PositionError,
    RecorderError,
    UnknownHandleError,
    UnknownRequestError,
)
from ..inputs import one_handle
from .accumulator import FIELD, StepAccumulator
from .refusals import Kind, Refusal, RefusalCode, to_error
from .step import KINDS, StepArrays

_DECODE, _EXTEND, _LOAD = FIELD["decode"], FIELD["extend_row"], FIELD["load_row"]
_EVICT_ALL = FIELD["evict_all"]
_TAKE_HANDLE, _ADMIT = FIELD["take_handle"], FIELD["admit"]
_ORDER = {kind: i for i, kind in enumerate(KINDS)}  # the step's order of the kinds

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


class StepRecorder(StepAccumulator):
    """The calls of one ``alloc.scheduler_step()`` block (see the module docstring): a
    :class:`~graphalloc.plan.accumulator.StepAccumulator` with the block's rules."""

    __slots__ = ("alloc", "open", "result", "offsets", "_refused")

    def __init__(self, alloc):
        StepAccumulator.__init__(self, alloc.config)
        self.alloc = alloc
        self.open = False  # calls are recorded between __enter__ and __exit__
        self.result = None
        self.offsets = (0, 0, 0)  # first result row of the decode / extend / load-back rows
        self._refused = None  # (kind's order, typed error): bad input, raised at the end

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
            if self._refused is not None:
                raise self._refused[1]
            pipeline = alloc.pipeline  # (= alloc.step of the columns, converted already)
            self.result = pipeline.execute(pipeline.plan(tuple.__new__(StepArrays, self.fields)))
            fields = self.fields
            n_dec = len(fields[_DECODE])
            self.offsets = (0, n_dec, n_dec + len(fields[_EXTEND]))
        return False

    def _closed(self, kind: str) -> RecorderError:
        return RecorderError(f"scheduler_step(): {kind}() on a block that has closed; its "
                             "step already ran (or was discarded). Record into a new block")

    def _record(self, kind: str, value, rows, error: type = UnknownRequestError) -> None:
        """Record a call naming ``rows`` (or handles): None is refused at the call, a
        closed block too. The hot path: two tests and the accumulator's append."""
        if rows is None:
            self._given(kind, None, error)
        if not self.open:
            raise self._closed(kind)
        try:
            self.record(kind, value)
        except ContractError as exc:
            self._refuse(kind, exc)

    def _refuse(self, kind: str, exc: ContractError) -> None:
        """Keep the block's refusal for its end: the first kind in the step's order."""
        order = _ORDER[kind]
        if self._refused is None or order < self._refused[0]:
            self._refused = (order, exc)

    def _given(self, kind: str, value, error: type) -> None:
        """A recorded call names what it acts on: None is refused at the call."""
        if value is None:
            noun = "handles" if error is UnknownHandleError else "request rows"
            hint = "; it.evict_all() evicts every row" if kind == "evict" else ""
            raise error(f"scheduler_step(): {kind}(None); pass the {noun} (an empty list for "
                        f"none){hint}")

    # ---- frees ---------------------------------------------------------------------------
    def release(self, rows) -> None:
        self._record("release", rows, rows)

    def accept(self, rows, n_accepted) -> None:
        """Keep 1 + n_accepted tokens of each row's oldest speculative step (``accept=``)."""
        self._record("accept", (rows, n_accepted), rows)

    def commit(self, rows, n_kept) -> None:
        """Deprecated: :meth:`accept` with ``n_kept - 1`` (warns at the call)."""
        self._record("commit", (rows, n_kept), rows)

    def trim(self, rows, new_len) -> None:
        self._record("trim", (rows, new_len), rows)

    def evict(self, rows) -> None:
        self._record("evict", rows, rows)

    def evict_all(self) -> None:
        if not self.open:
            raise self._closed("evict_all")
        self.fields[_EVICT_ALL] = 1

    def advance(self, rows, new_frontier_pos) -> None:
        self._record("advance", (rows, new_frontier_pos), rows)

    def drop_handle(self, handle) -> None:
        self._given("drop_handle", handle, UnknownHandleError)
        one_handle(handle, "scheduler_step(): drop_handle")
        self._record("drop", handle, handle)

    def drop_handle_swa(self, handle) -> None:
        self._given("drop_handle_swa", handle, UnknownHandleError)
        one_handle(handle, "scheduler_step(): drop_handle_swa")
        self._record("drop_swa", handle, handle)

    def take_handle(self, row, n_tokens) -> int:
        """Reserve the lowest free handle; the step takes it (a cache insert). Returns it."""
        if not self.open:
            raise self._closed("take")
        live = self.alloc.ledger.h_live
        h = self.free_handle(live)
        if h < 0:
            raise CapacityError(f"take_handle: all {len(live)} handles are held or reserved "
                                "in this block; drop one first")
        try:
            self.record("take", ([h], [row], [n_tokens]))
        except ContractError as exc:
            self._refuse("take", exc)
            self.put_one(_TAKE_HANDLE, h)  # (reserved all the same: the block is refused)
        return h

    # ---- admits and allocations ----------------------------------------------------------
    def admit(self, handle=None, n_tokens=None) -> int:
        """Reserve the lowest free row (the step admits it); returns it."""
        if handle is None and n_tokens is not None:
            raise PositionError("admit(n_tokens=...) shares that much of a handle: pass "
                                "handle= too (a plain admit starts empty)")
        if not self.open:
            raise self._closed("admit")
        row = self.free_row(self.alloc.ledger.live)
        if row < 0:
            raise to_error(Refusal(RefusalCode.NO_FREE_ROW, Kind.ADMIT, -1, 0, self.n_reqs))
        try:
            if handle is None:
                self.record("admit", [row])
            else:
                self.record("admit_on", ([row], [handle],
                                         None if n_tokens is None else [n_tokens]))
        except ContractError as exc:
            self._refuse("admit", exc)
            self.put_one(_ADMIT, row)  # (reserved all the same: the block is refused)
        return row

    def _alloc_call(self, kind: str, column: int, value, rows) -> StepSlots:
        if rows is None or not self.open:
            self._record(kind, value, rows)  # raises
        start = len(self.fields[column])
        try:
            self.record(kind, value)
        except ContractError as exc:
            self._refuse(kind, exc)
        return StepSlots(self, (kind, start), len(self.fields[column]))

    def decode(self, rows, lookahead=None) -> StepSlots:
        """One token per row; ``lookahead=k``: ``1 + k`` speculative tokens per row."""
        if rows is None or not self.open:
            self._record("decode", (rows, lookahead), rows)  # raises
        start = len(self.fields[_DECODE])
        try:
            self.record("decode", (rows, lookahead))
        except ContractError as exc:
            self._refuse("decode", exc)
        return StepSlots(self, ("decode", start), len(self.fields[_DECODE]))

    def extend(self, rows, n_tokens) -> StepSlots:
        return self._alloc_call("extend", _EXTEND, (rows, n_tokens), rows)

    def load_back(self, row, new_frontier_pos) -> StepSlots:
        row = [row] if np.ndim(row) == 0 else row
        return self._alloc_call("load_back", _LOAD, (row, new_frontier_pos), row)

    # ---- the step: to_arrays / to_step / to_kinds (the accumulator's) -------------------
