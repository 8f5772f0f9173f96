"""Regression tests for defects found from outside, each written from the rule it broke.

1. A ring-mode release split over descriptor rows returns each ring page exactly once, and
   in validate mode a page pushed twice in one step reaches the error word.
2. Counts and positions are integers, validated, never coerced.
3. No config can make a request unreleasable; a release larger than a step is split.
4. A free group defers every free: ``plan()`` inside one is refused, and so is a load-back of
   a row the block froze.
5. Misuse gets a typed error: wrong step-argument shapes, bad plan handles, launch indices,
   double submission, bad constructors; a double release names itself.
6. A free group's flush never drops accepted frees.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import assert_same_snapshot

import graphalloc as ga
from graphalloc import errors as E
from graphalloc.kernels.abi import ERR_CODES, REL_EPOCH, REL_N_PAGES, ROW_WIDTH, FaultCode


def small(**kw):
    args = dict(page_size=2, num_full_pages=24, num_swa_pages=16, max_reqs=4,
                max_context_len=16, sliding_window=3)
    args.update(kw)
    return ga.HybridAllocator(ga.AllocatorConfig(**args))


# ---- 1 ----------------------------------------------------------------------------------------
def test_ring_release_split_over_rows_returns_each_ring_page_once():
    """The reproducer: 65 ring pages in rows of at most 32 pages (3 rows)."""
    a = ga.HybridAllocator(ga.AllocatorConfig(
        page_size=16, num_full_pages=1024, num_swa_pages=260, max_reqs=4,
        max_context_len=8192, sliding_window=1024, swa_ring_pages=65, max_pages_per_row=32))
    rings = []
    for _ in range(2):
        r = a.admit()
        a.alloc_extend([r], [100])
        rings.append(a.state.ring_pages[r, :65].tolist())
        a.release([r])
        assert a.audit() == []
    assert sorted(rings[0]) == sorted(set(rings[0])) and len(set(rings[1])) == 65
    rows = [a.admit() for _ in range(4)]  # 4 x 65 = all 260 SWA pages: no aliasing
    owned = np.concatenate([a.state.ring_pages[r, :65].numpy() for r in rows])
    assert len(np.unique(owned)) == 260
    a.check_integrity()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_validate_mode_reports_a_page_pushed_twice_in_one_step(backend):
    """Two release rows pushing the same FULL page (a corrupted descriptor): the epoch stamp
    of validate mode sees the second push."""
    a = small(backend=backend, validate=True)
    r = a.admit()
    a.alloc_extend([r], [4])
    p = a.plan(release=[r])
    i = p.buffer_index
    buf = a.ring.np_bufs[i]
    n_rel = p.n_release_rows
    buf[n_rel] = buf[n_rel - 1]  # the same segment again, one row later
    buf[n_rel, 6] = buf[n_rel - 1, 6] + buf[n_rel - 1, REL_N_PAGES]  # its own lanes
    assert buf[n_rel, REL_EPOCH] > 0 and buf.shape[1] == ROW_WIDTH
    p.n_release_rows += 1  # launches cover the step's rows: count the injected one
    a.run(p)
    with pytest.raises(ga.DeviceFaultError) as info:
        a.check()
    assert info.value.codes & FaultCode.DUPLICATE_FREE
    assert int(a.state.err_buf[ERR_CODES]) & FaultCode.DUPLICATE_FREE


# ---- 2 ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [1.5, "2", True, [[1]], np.array([2.5]), None, math.nan,
                                   math.inf, 2**63, torch.tensor([1.0]),
                                   torch.tensor([1], device="meta")])
def test_counts_are_validated_not_coerced(value):
    a = small()
    r = a.admit()
    a.alloc_extend([r], [6])
    before = a.snapshot()
    with pytest.raises(E.ContractError):
        a.alloc_extend([r], value if isinstance(value, list) else [value])
    with pytest.raises(E.ContractError):
        a.advance_frontier([r], [value] if not isinstance(value, (list, np.ndarray,
                                                                   torch.Tensor)) else value)
    assert_same_snapshot(before, a.snapshot())


def test_rows_on_a_cuda_like_device_say_pass_the_host_copy():
    a = small()
    r = a.admit()
    with pytest.raises(E.TensorSpecError, match="host copy"):
        a.alloc_decode(torch.tensor([r], device="meta"))


# ---- 3 ----------------------------------------------------------------------------------------
def test_config_refuses_shapes_that_strand_a_request():
    with pytest.raises(E.ConfigError, match="could never be released"):
        ga.AllocatorConfig(page_size=2, num_full_pages=24, num_swa_pages=16, max_reqs=4,
                           max_context_len=16, sliding_window=3, max_step_pages=4)


# ---- 4 ----------------------------------------------------------------------------------------
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


# ---- 5 ----------------------------------------------------------------------------------------
def test_misuse_gets_typed_errors():
    a = small()
    r = a.admit()
    a.alloc_extend([r], [3])
    before = a.snapshot()
    for call in (lambda: a.step(extend=[r]),  # not a (rows, n) pair
                 lambda: a.step(extend=([r], [1], [2])),  # a 3-tuple
                 lambda: a.step(advance=([r], [0], 0)),
                 lambda: a.step(evict=True),  # rows only: evict_all=True for every row
                 lambda: a.run(None), lambda: a.mark_submitted(None),
                 lambda: a.launch(-1), lambda: a.launch(len(a.ring)),
                 lambda: a.launch(0),  # outside a capture: only the pending step's buffer
                 lambda: ga.HybridAllocator(None), lambda: ga.StepGraph(a),
                 lambda: ga.HybridAllocator(a.config, executor="fast"),
                 lambda: ga.HybridAllocator(a.config, fused_step="yes")):
        with pytest.raises(E.GraphallocError):
            call()
    assert_same_snapshot(before, a.snapshot())
    p = a.plan(decode=[r])
    a.run(p)
    with pytest.raises(E.PendingStepError, match="already submitted"):
        a.mark_submitted(p)  # would count the step twice
    assert a.steps_run == 3  # the admit, the extend, the decode


def test_errors_name_the_operation_and_a_double_release():
    a = small()
    r = a.admit()
    with pytest.raises(E.UnknownRequestError, match="decode"):
        a.alloc_decode([9])
    a.release([r])
    with pytest.raises(E.UnknownRequestError, match="already released"):
        a.release([r])


def test_numpy_integers_configure_and_bools_do_not():
    cfg = ga.AllocatorConfig(page_size=np.int64(4), num_full_pages=8, num_swa_pages=8,
                             max_reqs=2, max_context_len=16, sliding_window=np.int32(3))
    assert type(cfg.page_size) is int and cfg.page_size == 4
    for bad in (dict(page_size=True), dict(swa_ring_pages=3.5), dict(validate="yes")):
        with pytest.raises(E.ConfigError):
            ga.AllocatorConfig(**{**dict(page_size=4, num_full_pages=8, num_swa_pages=8,
                                         max_reqs=2, max_context_len=16, sliding_window=3),
                                  **bad})


# ---- 6 ----------------------------------------------------------------------------------------
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
