"""The one Step accumulator: growable int64 arrays per field of :class:`StepArrays`.

Every front door that builds a step out of several calls records into a
:class:`StepAccumulator`: the ``scheduler_step()`` block (:mod:`graphalloc.plan.recorder`,
which the replicas drive), the ``free_group()`` block (:mod:`graphalloc.plan.free_group`)
and the engine iterations of both seams (:mod:`graphalloc.integrations.iteration`). It holds
one int64 column per field of :class:`~graphalloc.plan.step.StepArrays` -- the step's
normalised form, in the step's order -- and the rows and handles set aside before the step
runs, and it owns the question "which row (handle) is the lowest free one now":

==========================  =========================================================
set aside                   by
==========================  =========================================================
rows reserved for admits    the ``admit`` and ``admit_on_row`` columns (an admit
                            recorded holds its row until the step ran)
handles reserved for takes  the ``take_handle`` column
rows released               ``released`` (a bool mask per row, when the owner keeps one:
                            an open free group, an engine iteration)
handles dropped             ``dropped`` (a bool mask per handle, an open free group)
==========================  =========================================================

:meth:`StepAccumulator.free_row` and :meth:`StepAccumulator.free_handle` ask
:func:`graphalloc.state.free_ids.lowest_free` (the one scan) with those sets.

Contract. :meth:`StepAccumulator.record` converts one call's arguments by the one conversion
path (:func:`graphalloc.plan.step.normalize`: its compiled half for the plain forms, the
same typed errors and messages for the rest), refusing bad input at the call with nothing
recorded, then appends the call's arrays to their columns; :meth:`StepAccumulator.put` and
:meth:`StepAccumulator.put_one` append values a caller has already checked (the seams).
:meth:`StepAccumulator.to_arrays` is the recorded step as :class:`StepArrays`; the kinds'
order is the step's, whatever the calls' order; within a kind, call order.

Invariants: every column is 1-D int64; a column's first array is kept as it was given
(never written: copied into an owned buffer only when a second append comes), and an append
never writes below the length already handed out, so views handed out stay valid until
:meth:`~StepAccumulator.clear` (the buffers are reused for the next step); columns of one
kind have equal lengths; ``evict_all`` is 0 or 1.

Cost: an append is O(values) numpy and amortised O(1) in buffer growth (doubling); a
scalar append O(1); :meth:`~StepAccumulator.record` one conversion (C for the plain forms:
no Python frame per row); :meth:`~StepAccumulator.to_arrays` one tuple of views, no Python
loop over rows or kinds; :meth:`~StepAccumulator.to_kinds` O(kinds) views (a lookahead or
an accept column O(rows) numpy); :meth:`~StepAccumulator.mark` / ``rollback`` O(fields);
the free-id queries O(max_reqs) / O(max_handles) numpy.
"""

from __future__ import annotations

import numpy as np

from ..errors import ContractError
from ..state.free_ids import lowest_free
from .step import (
    ACCEPT_AND_COMMIT,
    EMPTY,
    Step,
    StepArrays,
    filled,
    normalize,
    normalize_fast,
)

__all__ = ["StepAccumulator", "FIELD", "KIND_FIELDS"]

FIELD = {name: i for i, name in enumerate(StepArrays._fields)}  # field name -> index
EVICT_ALL = FIELD["evict_all"]

# the fields a recorded kind fills (evict_all is a flag, not a column)
KIND_FIELDS: dict[str, tuple[int, ...]] = {
    kind: tuple(FIELD[f] for f in fields) for kind, fields in {
        "take": ("take_handle", "take_row", "take_tokens"),
        "release": ("release",),
        "accept": ("commit_row", "commit_n"),
        "commit": ("commit_row", "commit_n"),
        "trim": ("trim_row", "trim_len"),
        "evict": ("evict",),
        "advance": ("advance_row", "advance_pos"),
        "drop": ("drop",),
        "drop_swa": ("drop_swa",),
        "admit": ("admit",),
        "admit_on": ("admit_on_row", "admit_on_handle", "admit_on_tokens"),
        "decode": ("decode", "decode_n", "decode_spec"),
        "extend": ("extend_row", "extend_n"),
        "load_back": ("load_row", "load_pos"),
    }.items()}

_SPAN = {kind: (idx[0], idx[-1] + 1) for kind, idx in KIND_FIELDS.items()}
assert all(idx == tuple(range(*_SPAN[k])) for k, idx in KIND_FIELDS.items())
_N_FIELDS = len(StepArrays._fields)
_NOT_OWN = [False] * _N_FIELDS
_EMPTY_FIELDS = tuple(0 if i == EVICT_ALL else EMPTY for i in range(_N_FIELDS))
_DECODE, _DECODE_N, _DECODE_SPEC = KIND_FIELDS["decode"]
_ONE, _TUPLE, _DECODE_FORM, _ACCEPT_FORM, _COMMIT_FORM = range(5)  # how to_kinds reads a kind
_BY_KIND = {kind: (kind, idx[0], idx,
                   _DECODE_FORM if kind == "decode" else _ACCEPT_FORM if kind == "accept" else
                   _COMMIT_FORM if kind == "commit" else _ONE if len(idx) == 1 else _TUPLE)
            for kind, idx in KIND_FIELDS.items()}
_TABLE = tuple(_BY_KIND.values())  # the step's order
_ONES, _ZEROS = filled(1, 1024), filled(0, 1024)  # (read-only, sliced for plain decodes)
_MIN_CAPACITY = 64


class StepAccumulator:
    """One step's records as growable int64 columns (see the module docstring).

    ``config``: the allocator's :class:`~graphalloc.config.AllocatorConfig` (rows are
    range-checked against ``max_reqs`` at the call). ``released`` / ``dropped``: bool masks
    of rows released and handles dropped ahead of the step, or ``None`` (the owner sets
    them: a free group, an engine iteration)."""

    __slots__ = ("config", "n_reqs", "fields", "_bufs", "_own", "_commit_form", "_spec",
                 "released", "dropped")

    def __init__(self, config):
        self.config, self.n_reqs = config, config.max_reqs
        self.fields = list(_EMPTY_FIELDS)  # the columns as handed out: StepArrays' order
        self._bufs: list = [None] * _N_FIELDS  # owned buffers (capacity >= len(field))
        self._own = [False] * _N_FIELDS  # whether fields[i] is a prefix of _bufs[i]
        self._commit_form = False  # the speculative kind came as commit= (deprecated)
        self._spec = False  # a decode was recorded with a lookahead
        self.released: np.ndarray | None = None
        self.dropped: np.ndarray | None = None

    # ---- appending -----------------------------------------------------------------------
    def record(self, kind: str, value) -> StepArrays:
        """Convert ``value`` (what ``Step(**{kind: value})`` takes) by the one conversion
        path and append it; returns the call's converted arrays. Raises the normaliser's
        typed error with nothing recorded. ``decode`` takes ``(rows, lookahead)``. O(values)
        (C for the plain forms)."""
        if kind == "decode":
            rows, look = value
            kw = {"decode": rows} if look is None else {"decode": rows, "lookahead": look}
        else:
            kw = {kind: value}
        arrays = None if normalize_fast is None else normalize_fast(kw, self.n_reqs)
        if arrays is None:
            arrays = normalize(Step(**kw), self.config)
        if kind == "accept" or kind == "commit":
            if len(self.fields[FIELD["commit_row"]]) and self._commit_form != (kind == "commit"):
                raise ContractError(ACCEPT_AND_COMMIT)
            self._commit_form = kind == "commit"
        elif kind == "decode" and value[1] is not None:
            self._spec = True
        fields = self.fields
        lo, hi = _SPAN[kind]  # (a kind's fields are adjacent)
        if not len(fields[lo]):  # the kind's first call: its arrays kept as they are
            fields[lo:hi] = arrays[lo:hi]  # (never written; C slices, no loop)
            self._own[lo:hi] = _NOT_OWN[lo:hi]
            return arrays
        for i in KIND_FIELDS[kind]:  # (2-3 fields: the append inline, no frame per field)
            arr = arrays[i]
            m = len(arr)
            if not m:
                continue
            cur = fields[i]
            n = len(cur)
            if not n:  # the first array of the column: kept as it is (never written)
                fields[i], self._own[i] = arr, False
                continue
            buf = self._bufs[i]
            if not self._own[i] or n + m > len(buf):
                buf = self._grow(i, n + m)
            buf[n:n + m] = arr
            fields[i] = buf[:n + m]
        return arrays

    def put(self, i: int, values: np.ndarray, copy: bool = True) -> None:
        """Append checked int64 ``values`` to column ``i`` (a :data:`FIELD` index).
        O(values), amortised O(1) growth. ``copy=False``: the first array of a column is
        kept as it is (the caller does not write it before the step ran)."""
        m = len(values)
        if not m:
            return
        cur = self.fields[i]
        n = len(cur)
        if not n and not copy:
            self.fields[i], self._own[i] = values, False
            return
        buf = self._bufs[i]
        if not self._own[i] or buf is None or n + m > len(buf):
            buf = self._grow(i, n + m)
        buf[n:n + m] = values
        self.fields[i] = buf[:n + m]

    def put_one(self, i: int, value: int) -> None:
        """Append one checked int to column ``i``. O(1) amortised."""
        cur = self.fields[i]
        n = len(cur)
        buf = self._bufs[i]
        if not self._own[i] or buf is None or n == len(buf):
            buf = self._grow(i, n + 1)
        buf[n] = value
        self.fields[i] = buf[:n + 1]

    def put_kinds(self, kinds: dict) -> None:
        """Append checked int64 arrays given as ``Step`` keywords (an array, or a tuple of
        arrays, per kind; ``None`` skipped; ``decode``: plain rows) that the caller does not
        write before the step ran: an empty column takes its array as it is (no copy, no
        Python frame), a column with values gets it appended. O(kinds), plus O(rows) numpy
        where a column already holds values."""
        f, own = self.fields, self._own
        for kind, value in kinds.items():
            if value is None:
                continue
            if kind == "decode":
                if len(f[_DECODE]) or len(value) > len(_ONES):
                    self.put_decode(value)
                elif len(value):
                    m = len(value)
                    f[_DECODE], f[_DECODE_N], f[_DECODE_SPEC] = value, _ONES[:m], _ZEROS[:m]
                    own[_DECODE] = own[_DECODE_N] = own[_DECODE_SPEC] = False
                continue
            idx = KIND_FIELDS[kind]
            for i, arr in zip(idx, value if type(value) is tuple else (value,), strict=True):
                if not len(arr):
                    continue
                if len(f[i]):
                    self.put(i, arr)
                else:
                    f[i], own[i] = arr, False

    def put_decode(self, rows: np.ndarray) -> None:
        """Append checked plain decode rows (one token each, not speculative): the three
        decode columns. O(rows) numpy; the first rows of a step kept as given, O(1)."""
        m = len(rows)
        if not m:
            return
        f = self.fields
        if not len(f[_DECODE]) and m <= len(_ONES):  # (the common case: no frame more)
            f[_DECODE], f[_DECODE_N], f[_DECODE_SPEC] = rows, _ONES[:m], _ZEROS[:m]
            own = self._own
            own[_DECODE] = own[_DECODE_N] = own[_DECODE_SPEC] = False
            return
        self.put(_DECODE, rows)
        self.put(_DECODE_N, filled(1, m))
        self.put(_DECODE_SPEC, filled(0, m))

    def _grow(self, i: int, need: int) -> np.ndarray:
        """Column ``i`` in an owned buffer of capacity >= ``need`` (doubling), its values
        copied in. Amortised O(1) per value appended."""
        cur, buf = self.fields[i], self._bufs[i]
        n = len(cur)
        if buf is None or need > len(buf):
            buf = np.empty(max(need, 2 * (0 if buf is None else len(buf)), _MIN_CAPACITY),
                           dtype=np.int64)
            self._bufs[i] = buf
        if n:
            buf[:n] = cur
        self._own[i] = True
        self.fields[i] = buf[:n]
        return buf

    def set_evict_all(self) -> None:
        self.fields[EVICT_ALL] = 1

    # ---- reading ------------------------------------------------------------------------
    def n(self, i: int) -> int:
        """Values recorded in column ``i``."""
        return len(self.fields[i])

    def column(self, name: str) -> np.ndarray:
        """The column of field ``name`` (a read-only use: never write it)."""
        return self.fields[FIELD[name]]

    def __bool__(self) -> bool:
        """Whether anything is recorded. O(fields)."""
        f = self.fields
        return bool(f[EVICT_ALL] or any(map(len, f[:EVICT_ALL]))
                    or any(map(len, f[EVICT_ALL + 1:])))  # (C: no frame per column)

    def to_arrays(self) -> StepArrays:
        """The recorded step as :class:`StepArrays` (views of the columns). O(1): one tuple
        of the views, no loop over rows or kinds."""
        return tuple.__new__(StepArrays, self.fields)  # (C: no Python frame)

    def to_kinds(self, kinds=None) -> dict:
        """The recorded kinds (``kinds``: only these) as ``Step`` keywords, absent kinds
        left out (``evict_all`` only when set). Arrays are the columns' views. O(kinds)."""
        f, out = self.fields, {}
        for kind, i0, idx, form in (_TABLE if kinds is None else map(_BY_KIND.__getitem__,
                                                                     kinds)):
            col = f[i0]
            if not len(col):
                continue
            if form == _ONE:
                out[kind] = col
            elif form == _TUPLE:
                out[kind] = tuple(map(f.__getitem__, idx))  # (C: no frame)
            elif form == _DECODE_FORM:
                out["decode"] = col
                if self._spec:  # a lookahead was recorded: -1 marks the plain rows
                    out["lookahead"] = np.where(f[idx[2]] != 0, f[idx[1]] - 1, -1)
            elif (form == _COMMIT_FORM) == self._commit_form:  # (one column, two forms)
                out[kind] = (col, f[idx[1]]) if self._commit_form else (col, f[idx[1]] - 1)
        if f[EVICT_ALL] and (kinds is None or "evict_all" in kinds):
            out["evict_all"] = True
        return out

    def to_step(self, kinds=None) -> Step:
        """:meth:`to_kinds` as a :class:`Step`."""
        return Step(**self.to_kinds(kinds))

    # ---- transactions -------------------------------------------------------------------
    def mark(self) -> tuple:
        """The records now (restore with :meth:`rollback`). O(fields)."""
        return tuple(self.fields), self._commit_form, self._spec

    def rollback(self, mark: tuple) -> None:
        """Forget every append after :meth:`mark` (appends only grow the columns, so the
        marked views are still their prefixes). O(fields)."""
        fields, self._commit_form, self._spec = mark
        for i, f in enumerate(fields):
            if i != EVICT_ALL and self._own[i]:
                f = self._bufs[i][:len(f)]  # (a marked view of a buffer since replaced)
            self.fields[i] = f

    def clear(self) -> None:
        """Forget every record (the buffers are kept for the next step). O(fields)."""
        self.fields[:] = _EMPTY_FIELDS
        self._own = [False] * _N_FIELDS
        self._commit_form = self._spec = False

    # ---- the lowest free row or handle --------------------------------------------------
    def free_row(self, live: np.ndarray, *aside) -> int:
        """The lowest row that ``live`` does not hold, not reserved by a recorded admit,
        not released ahead of the step, nor in ``aside``; -1 when none. O(max_reqs)."""
        f = self.fields
        return lowest_free(live, self.released, f[FIELD["admit"]], f[FIELD["admit_on_row"]],
                           *aside)

    def free_handle(self, h_live: np.ndarray) -> int:
        """The lowest handle ``h_live`` does not hold, not reserved by a recorded take, not
        dropped ahead of the step; -1 when none. O(max_handles)."""
        return lowest_free(h_live, self.dropped, self.fields[FIELD["take_handle"]])
