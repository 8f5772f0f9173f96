"""The one Step accumulator (graphalloc/plan/accumulator.py) and the front doors on it.

* a ``scheduler_step()`` block of random calls (rows in and out of range, empty calls,
  lookaheads, admits) runs exactly what ``alloc.step`` runs with the calls' arguments
  concatenated by hand, kind by kind, in call order: the same result, the same state, or
  the same typed error with nothing changed;
* the columns grow by doubling, never write an array they were given, and keep every view
  handed out valid across later appends; ``mark`` / ``rollback`` restore the records;
* the lowest free row / handle skips exactly what is reserved (admits, takes) or set aside
  (released, dropped), against a scan written here.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_same_snapshot
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from small import small

from graphalloc import errors as E
from graphalloc.plan.accumulator import FIELD, KIND_FIELDS, StepAccumulator
from graphalloc.plan.step import Step, StepArrays, normalize

N_REQS = 12
LIVE = [0, 2, 3, 4, 5, 6, 7, 8]


def _alloc():
    a = small(max_reqs=N_REQS, num_full_pages=160, num_swa_pages=100, max_context_len=32,
              max_handles=4, max_step_tokens=96)
    rows = [a.admit() for _ in range(9)]
    a.alloc_extend(rows, [5, 3, 8, 2, 7, 1, 4, 6, 9])
    a.release([rows[1]])  # row 1 free again: admits take it first
    return a


# a call: (kind, how many rows, its int argument, a bad row added: 0 none, 1 out of range,
# 2 a row an earlier call named); the rows come from one permutation of the live rows, so
# most blocks are valid and several calls of one kind are common
_call = st.tuples(st.sampled_from(["release", "evict", "evict_all", "admit", "decode",
                                   "decode_k", "extend", "trim"]),
                  st.integers(0, 3), st.integers(0, 4),
                  st.sampled_from([0] * 8 + [1, 2]))


def _calls(spec, order):
    """The block's calls from their specs, rows drawn in turn from ``order``."""
    calls, used = [], []
    for kind, n, k, bad in spec:
        rows = [order[(len(used) + j) % len(order)] for j in range(n)]
        used += rows
        if bad == 1:
            rows.append(N_REQS)
        elif bad == 2 and used:
            rows.append(used[0])
        if kind in ("evict_all", "admit"):
            calls.append((kind,))
        elif kind in ("release", "evict"):
            calls.append((kind, rows))
        elif kind == "decode":
            calls.append(("decode", rows, None))
        elif kind == "decode_k":  # (a lookahead names rows: see the test below)
            calls.append(("decode", rows or [order[0]], k % 3))
        else:
            calls.append((kind, rows, k))
    return calls


def _reference(a, calls):
    """The calls' Step keywords, concatenated here in call order; admits take the lowest
    row that is not live and not admitted earlier in the list (a scan of is_live)."""
    kw, admitted = {}, []
    look = []
    for call in calls:
        kind = call[0]
        if kind == "evict_all":
            kw["evict_all"] = True
        elif kind == "admit":
            free = [r for r in range(N_REQS) if not a.is_live(r) and r not in admitted]
            if not free:
                return None  # refused at the call
            admitted.append(free[0])
            kw.setdefault("admit", []).append(free[0])
        elif kind in ("release", "evict"):
            kw.setdefault(kind, []).extend(call[1])
        elif kind == "decode":
            kw.setdefault("decode", []).extend(call[1])
            look.append((len(call[1]), call[2]))
        else:  # (rows, n): an int broadcast to the call's rows
            rows, n = kw.setdefault(kind, ([], []))
            rows.extend(call[1])
            n.extend([call[2]] * len(call[1]))
    if any(k is not None for _, k in look):
        kw["lookahead"] = [(-1 if k is None else k) for m, k in look for _ in range(m)]
    return kw


def _outcome(fn):
    try:
        return fn(), None
    except E.ContractError as exc:
        return None, type(exc)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_call, max_size=6), st.permutations(LIVE))
def test_a_block_of_random_calls_runs_what_alloc_step_runs(spec, order):
    calls = _calls(spec, order)
    a, b = _alloc(), _alloc()
    kw = _reference(b, calls)

    def block():
        with a.scheduler_step() as it:
            slots = []
            for call in calls:
                if call[0] == "evict_all":
                    it.evict_all()
                elif call[0] == "admit":
                    it.admit()
                elif call[0] == "decode":
                    slots.append(it.decode(call[1], lookahead=call[2]))
                elif call[0] in ("release", "evict"):
                    getattr(it, call[0])(call[1])
                else:
                    out = getattr(it, call[0])(call[1], call[2])
                    if call[0] == "extend":
                        slots.append(out)
        return it.result

    before_a = a.snapshot()
    got, got_error = _outcome(block)
    if kw is None:  # an admit with every row live or reserved: refused at the call
        assert got_error is E.CapacityError
        assert_same_snapshot(before_a, a.snapshot())
        return
    want, want_error = _outcome(lambda: b.step(**kw))
    assert got_error is want_error, (calls, kw)
    assert_same_snapshot(a.snapshot(), b.snapshot())
    if want is not None:
        assert np.array_equal(got.rows, want.rows)
        assert np.array_equal(got.n_tokens, want.n_tokens)
        assert np.array_equal(got.full_slots.numpy(), want.full_slots.numpy())
    assert a.audit() == [] and b.audit() == []


def test_a_lookahead_without_decode_rows_is_refused_in_any_block():
    """``it.decode([], lookahead=k)`` is the block's refusal whatever else the block
    records (as ``alloc.step(decode=[], lookahead=k)`` is), nothing changed."""
    for more in ([], [0]):
        a = _alloc()
        before = a.snapshot()
        with pytest.raises(E.SpeculativeStateError), a.scheduler_step() as it:
            it.decode([], lookahead=1)
            if more:
                it.decode(more)
        assert_same_snapshot(before, a.snapshot())


def test_bad_input_is_the_blocks_refusal_first_kind_in_the_steps_order():
    """Bad input is kept to the block's end; the refusal raised is the first kind's in the
    step's order (release before decode), whatever the order of the calls."""
    a = _alloc()
    before = a.snapshot()
    with pytest.raises(E.UnknownRequestError, match="release"), a.scheduler_step() as it:
        it.decode([N_REQS])
        it.release([N_REQS + 1])
        it.decode([0])  # recording goes on: the block decides at its end
    assert_same_snapshot(before, a.snapshot())


def test_columns_grow_by_doubling_and_never_write_what_they_were_given():
    acc = StepAccumulator(_alloc().config)
    i = FIELD["release"]
    given = np.arange(5, dtype=np.int64)
    given.flags.writeable = False  # a write into it would raise
    acc.put(i, given, copy=False)
    assert acc.fields[i] is given  # the first array, as it was given
    views, expect = [acc.fields[i]], list(range(5))
    capacities = set()
    for k in range(300):
        if k % 3:
            acc.put_one(i, 100 + k)
            expect.append(100 + k)
        else:
            more = np.full(k % 7, k, dtype=np.int64)
            acc.put(i, more)
            expect.extend(more.tolist())
        views.append(acc.fields[i].copy())
        buf = acc._bufs[i]  # noqa: SLF001 (the growth under test)
        if buf is not None:
            capacities.add(len(buf))
            assert len(expect) <= len(buf) <= max(64, 2 * len(expect))
    assert acc.fields[i].tolist() == expect
    assert np.array_equal(given, np.arange(5))
    assert len(capacities) <= 4  # 64, 128, 256, 512: doubling, not one per append
    for view in views:  # every prefix handed out is still a prefix
        assert acc.fields[i][:len(view)].tolist() == view.tolist()


def test_a_copied_put_is_a_copy():
    acc = StepAccumulator(_alloc().config)
    mine = np.array([1, 2], dtype=np.int64)
    acc.put(FIELD["release"], mine)
    mine[0] = 3  # the caller writes its array afterwards
    assert acc.column("release").tolist() == [1, 2]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["release", "extend", "decode", "take"]),
                          st.integers(0, N_REQS - 1), st.integers(0, 3)), max_size=12),
       st.integers(0, 12))
def test_rollback_restores_the_records_at_the_mark(ops, cut):
    acc = StepAccumulator(_alloc().config)

    def apply(op):
        kind, row, n = op
        value = ([row] * n if kind in ("release", "decode") else
                 ([row] * n, n) if kind == "extend" else ([row], [row], [n]))
        acc.record(kind, (value, None) if kind == "decode" else value)

    for op in ops[:cut]:
        apply(op)
    at_mark = [np.array(f).copy() for f in acc.fields]
    mark = acc.mark()
    for op in ops[cut:]:
        apply(op)
    acc.rollback(mark)
    assert all(np.array_equal(np.array(f), g) for f, g in zip(acc.fields, at_mark,
                                                               strict=True))
    for op in ops[cut:]:  # and appending again gives what it gave the first time
        apply(op)
    whole = StepAccumulator(acc.config)
    for op in ops:
        acc2, acc = acc, whole
        apply(op)
        acc = acc2
    assert all(np.array_equal(np.array(f), np.array(g))
               for f, g in zip(acc.fields, whole.fields, strict=True))


def test_to_arrays_equals_the_normaliser_of_to_step():
    """The columns as StepArrays (no conversion) equal the normaliser's own conversion of
    the same records as a Step (every kind, a lookahead and the accept form included)."""
    a = _alloc()
    acc = StepAccumulator(a.config)
    acc.record("take", ([0, 2], [0, 2], [2, 4]))
    acc.record("release", [3])
    acc.record("accept", ([0], [1]))
    acc.record("trim", ([2], 6))
    acc.record("evict", [0])
    acc.set_evict_all()
    acc.record("advance", ([2], [2]))
    acc.record("drop", [1])
    acc.record("drop_swa", [2])
    acc.record("admit", [1])
    acc.record("admit_on", ([4], [0], None))
    acc.record("decode", ([0], None))
    acc.record("decode", ([2, 3], 2))
    acc.record("extend", ([5], [3]))
    acc.record("load_back", ([2], [0]))
    acc.record("release", np.array([5], dtype=np.int64))
    mine = acc.to_arrays()
    ref = normalize(acc.to_step(), a.config)
    assert isinstance(mine, StepArrays)
    for name, x, y in zip(StepArrays._fields, mine, ref, strict=True):
        assert np.array_equal(np.asarray(x), np.asarray(y)), name
    assert set(acc.to_kinds()) == set(KIND_FIELDS) - {"commit"} | {"evict_all", "lookahead"}


def test_an_input_refused_by_record_changes_nothing():
    acc = StepAccumulator(_alloc().config)
    acc.record("extend", ([0], [2]))
    before = list(acc.fields)
    for kind, value in (("extend", ([0, 1], [2])), ("release", [N_REQS]),
                        ("release", [1.5]), ("evict", True)):
        with pytest.raises(E.ContractError):
            acc.record(kind, value)
        assert all(x is y for x, y in zip(before, acc.fields, strict=True))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.booleans(), min_size=N_REQS, max_size=N_REQS),
       st.lists(st.booleans(), min_size=N_REQS, max_size=N_REQS),
       st.lists(st.integers(0, N_REQS - 1), max_size=3),
       st.lists(st.integers(0, N_REQS - 1), max_size=3),
       st.lists(st.integers(0, N_REQS - 1), max_size=3))
def test_the_lowest_free_row_skips_what_is_reserved_or_set_aside(live, released, plain, on,
                                                                  aside):
    acc = StepAccumulator(_alloc().config)
    acc.released = np.array(released)
    acc.put(FIELD["admit"], np.array(plain, dtype=np.int64))
    acc.put(FIELD["admit_on_row"], np.array(on, dtype=np.int64))
    taken = {r for r in range(N_REQS) if live[r] or released[r]} | set(plain) | set(on) | set(
        aside)
    want = min(set(range(N_REQS)) - taken, default=-1)
    assert acc.free_row(np.array(live), aside) == want
    acc.released = None
    taken -= {r for r in range(N_REQS) if released[r] and not live[r]} - set(plain) - set(
        on) - set(aside)
    assert acc.free_row(np.array(live), aside) == min(set(range(N_REQS)) - taken, default=-1)


def test_the_lowest_free_handle_skips_takes_and_drops():
    acc = StepAccumulator(_alloc().config)
    h_live = np.array([True, False, False, False])
    assert acc.free_handle(h_live) == 1
    acc.record("take", ([1], [0], [2]))
    assert acc.free_handle(h_live) == 2
    acc.dropped = np.array([False, False, True, False])
    assert acc.free_handle(h_live) == 3
    acc.put_one(FIELD["take_handle"], 3)
    assert acc.free_handle(h_live) == -1


def test_the_recorder_reserves_through_the_accumulator():
    """Two admits and two takes in one block get distinct lowest ids; the step admits
    and takes exactly those."""
    a = _alloc()
    with a.scheduler_step() as it:
        r1, r2 = it.admit(), it.admit()
        h1, h2 = it.take_handle(0, 2), it.take_handle(2, 2)
        assert it.column("admit").tolist() == [r1, r2]
    assert (r1, r2) == (1, 9) and (h1, h2) == (0, 1)
    assert a.is_live(r1) and a.is_live(r2) and set(a.live_handles()) == {0, 1}
    step = Step(admit=[1])  # (a Step is still the plain value)
    assert step.kinds() == ["admit"]


def test_put_kinds_appends_a_calls_arrays_as_the_normaliser_reads_them():
    """The seams' vectorised append: empty columns take the arrays as they are, columns
    with values get them appended; plain decode rows are one token each, none speculative."""
    acc = StepAccumulator(_alloc().config)
    rows = np.array([0, 2], dtype=np.int64)
    acc.put_kinds({"decode": rows, "advance": None, "extend": (np.array([3], np.int64),
                                                                 np.array([4], np.int64))})
    assert acc.column("decode") is rows
    acc.put_kinds({"decode": np.array([5], np.int64),
                   "extend": (np.array([6], np.int64), np.array([1], np.int64))})
    got = acc.to_arrays()
    want = normalize(Step(decode=[0, 2, 5], extend=([3, 6], [4, 1])), acc.config)
    for name, x, y in zip(StepArrays._fields, got, want, strict=True):
        assert np.array_equal(np.asarray(x), np.asarray(y)), name
    assert rows.tolist() == [0, 2]  # the given array was not written
