"""A free group defers every free: ``plan()`` inside one is refused, and so is a load-back
of a row the block froze; its flush never drops accepted frees, split over steps when they
exceed one (regressions found from outside)."""

from __future__ import annotations

import pytest
from conftest import assert_same_snapshot
from small import small

from graphalloc import errors as E


def test_plan_inside_a_free_group_is_refused_with_nothing_changed():
    a = small()
    r, s = a.admit(), a.admit()
    a.alloc_extend([r, s], [6, 6])
    with a.free_group():
        a.release([s])
        before = a.snapshot()
        with pytest.raises(E.NestedGroupError):
            a.plan(release=[r])
        with pytest.raises(E.NestedGroupError):
            a.plan(decode=[r])
        assert_same_snapshot(before, a.snapshot())
    assert not a.is_live(s) and a.is_live(r)
    a.check_integrity()


def test_load_back_of_a_row_frozen_by_the_block_is_refused():
    a = small()
    r = a.admit()
    a.alloc_extend([r], [10])
    a.evict_window()  # frontier 6
    with a.free_group():
        a.release([r])
        with pytest.raises((E.NestedGroupError, E.UnknownRequestError)):
            a.load_back(r, 2)
    a.check_integrity()


def test_a_free_group_flush_never_drops_accepted_frees():
    """Frees far beyond one step's shape: everything accepted is flushed (several steps),
    nothing is lost; an exception in the block discards the block (the rows stay live and
    are released afterwards)."""
    a = small(num_full_pages=40, num_swa_pages=40, max_step_pages=8, max_release_rows=3)
    rows = [a.admit() for _ in range(4)]
    for r in rows:
        a.alloc_extend([r], [16])
    with pytest.raises(RuntimeError):
        with a.free_group():
            a.release(rows[:3])
            raise RuntimeError("the engine failed mid-iteration")
    assert a.n_live == 4 and a.n_free("full") == 40 - 32  # 8 pages each
    steps = a.steps_run
    with a.free_group():
        a.release(rows[:3])
    assert a.n_live == 1 and a.n_free("full") == 40 - 8
    assert a.steps_run - steps > 1  # 24 freed pages, 8 per step
    a.check_integrity()
