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
    PendingStepError,
    PositionError,
    RecorderError,
    UnknownHandleError,
    UnknownRequestError,
)
from ..inputs import as_int64
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

    _PAIRS = ("commit", "trim", "advance", "extend", "load_back")

    def __init__(self, alloc):
        self.alloc = alloc
        self.open = True
        self.result = None
        self.offsets = (0, 0, 0)  # first result row of the decode / extend / load-back rows
        self._parts: dict[str, list] = {}
        self._evict_all = False
        self._n = {"decode": 0, "extend": 0, "load_back": 0}
        self._admitted: list[int] = []
        self._taken: list[int] = []

    def _add(self, kind: str, *values) -> None:
        if not self.open:
            raise RecorderError(f"scheduler_step(): {kind}() on a block that has closed; its "
                                "step already ran (or was discarded). Record into a new block")
        self._parts.setdefault(kind, []).append(values)

    def _given(self, kind: str, value, error: type) -> None:
        """A recorded call names what it acts on: None is refused at the call."""
        if value is None:
            noun = "handles" if error is UnknownHandleError else "request rows"
            hint = "; it.evict_all() evicts every row" if kind == "evict" else ""
            raise error(f"scheduler_step(): {kind}(None); pass the {noun} (an empty list for "
                        f"none){hint}")

    # ---- frees ---------------------------------------------------------------------------
    def release(self, rows) -> None:
        self._given("release", rows, UnknownRequestError)
        self._add("release", rows)

    def commit(self, rows, n_accepted) -> None:
        self._add("commit", rows, n_accepted)

    def trim(self, rows, new_len) -> None:
        self._add("trim", rows, new_len)

    def evict(self, rows) -> None:
        self._given("evict", rows, UnknownRequestError)
        self._add("evict", rows)

    def evict_all(self) -> None:
        self._add("evict_all")
        self._evict_all = True

    def advance(self, rows, new_frontier_pos) -> None:
        self._add("advance", rows, new_frontier_pos)

    def drop_handle(self, handle) -> None:
        self._given("drop_handle", handle, UnknownHandleError)
        self._add("drop", handle)

    def drop_handle_swa(self, handle) -> None:
        self._given("drop_handle_swa", handle, UnknownHandleError)
        self._add("drop_swa", handle)

    def take_handle(self, row, n_tokens) -> int:
        """Reserve the lowest free handle; the step takes it (a cache insert). Returns it."""
        taken = self.alloc.ledger.h_live.copy()
        taken[self._taken] = True
        free = np.flatnonzero(~taken)
        if not len(free):
            raise CapacityError(f"take_handle: all {len(taken)} handles are held or reserved "
                                "in this block; drop one first")
        self._add("take", int(free[0]), row, n_tokens)
        self._taken.append(int(free[0]))
        return int(free[0])

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

    def _alloc_call(self, kind: str, rows, *values) -> StepSlots:
        self._add(kind, rows, *values)
        start = self._n[kind]
        self._n[kind] += len(_listed(rows))
        return StepSlots(self, (kind, start), self._n[kind])

    def decode(self, rows, lookahead=None) -> StepSlots:
        """One token per row; ``lookahead=k``: ``1 + k`` speculative tokens per row."""
        self._given("decode", rows, UnknownRequestError)
        return self._alloc_call("decode", rows, lookahead)

    def extend(self, rows, n_tokens) -> StepSlots:
        return self._alloc_call("extend", rows, n_tokens)

    def load_back(self, row, new_frontier_pos) -> StepSlots:
        return self._alloc_call("load_back", [row] if np.ndim(row) == 0 else row,
                                new_frontier_pos)

    # ---- the step ------------------------------------------------------------------------
    def to_step(self) -> Step:
        """The block's calls as one :class:`Step` (O(rows recorded))."""
        p, kw = self._parts, {}
        rows, handles, values = UnknownRequestError, UnknownHandleError, PositionError
        for kind in ("release", "evict", "admit"):
            if kind in p:
                kw[kind] = _cat([v[0] for v in p[kind]], rows, kind)
        for kind in ("drop", "drop_swa"):
            if kind in p:
                kw[kind] = _cat([v[0] for v in p[kind]], handles, kind)
        for kind in self._PAIRS:
            if kind in p:
                kw[kind] = (_cat([v[0] for v in p[kind]], rows, kind),
                            _cat([_per(v[1], v[0]) for v in p[kind]], values, kind))
        if "take" in p:
            kw["take"] = (_cat([[v[0]] for v in p["take"]], handles, "take_handle"),
                          _cat([[v[1]] for v in p["take"]], rows, "take_handle"),
                          _cat([[v[2]] for v in p["take"]], values, "take_handle"))
        if "admit_on" in p:
            calls = p["admit_on"]
            kw["admit_on"] = (_cat([[v[0]] for v in calls], rows, "admit"),
                              _cat([[v[1]] for v in calls], handles, "admit(handle=)"),
                              _cat([[-1 if v[2] is None else v[2]] for v in calls], values,
                                   "admit n_tokens"))
        if "decode" in p:
            calls = p["decode"]
            kw["decode"] = _cat([v[0] for v in calls], rows, "decode")
            if any(v[1] is not None for v in calls):
                kw["lookahead"] = _cat([_per(-1 if v[1] is None else v[1], v[0])
                                        for v in calls], values, "lookahead")
        kw["evict_all"] = self._evict_all
        return Step(**kw)

    def finish(self, result) -> None:
        self.result = result
        n_dec, n_ext = self._n["decode"], self._n["extend"]
        self.offsets = (0, n_dec, n_dec + n_ext)


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
