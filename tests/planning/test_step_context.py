"""The scheduler-step context: one block of ordinary calls is ONE step, equal to the same
work done by ``step()``; refused whole; results valid after the block, stale after the next
step; an exception inside runs nothing."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_same_snapshot
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import graphalloc as ga
from graphalloc import errors as E


def make(**kw):
    args = dict(page_size=4, num_full_pages=48, num_swa_pages=32, max_reqs=6,
                max_context_len=64, sliding_window=7, max_handles=3)
    args.update(kw)
    return ga.HybridAllocator(ga.AllocatorConfig(**args))


def same_device(a, b):
    for (name, x), y in zip(a.state.tables().items(), b.state.tables().values(), strict=True):
        assert torch.equal(x, y), name


def test_one_block_is_one_step_equal_to_step():
    a, b = make(), make()
    for alloc in (a, b):
        r, s, t = alloc.admit(), alloc.admit(), alloc.admit()
        alloc.alloc_extend([r, s, t], [10, 20, 5])
    steps = a.steps_run
    with a.scheduler_step() as it:
        it.release([1])
        it.evict([0, 2])
        n = it.admit()
        d = it.decode([0, 2])
        e = it.extend([n], [9])
    assert a.steps_run == steps + 1
    assert n == 3  # row 1 is released by this step: reusable only after it
    # the reference: the same work as one Step
    out = b.step(release=[1], evict=[0, 2], admit=[n], decode=[0, 2], extend=([n], [9]))
    assert b.steps_run == a.steps_run
    assert d.full_slots.tolist() == out.full_slots[:2].tolist()
    assert e.rows.tolist() == [n] and e.full_slots.tolist() == out.full_slots[2:].tolist()
    same_device(a, b)
    a.check_integrity()


def test_admit_on_a_handle_and_prefill_in_one_step():
    a = make()
    r = a.admit()
    a.alloc_extend([r], [16])
    h = a.take_handle(r, 12)
    steps = a.steps_run
    with a.scheduler_step() as it:
        s = it.admit(handle=h)
        e = it.extend([s], [5])
        d = it.decode([r])
    assert a.steps_run == steps + 1
    assert a.seq_len(s) == 17 and a.frontier(s) == 0
    assert a.req_to_token[s, :12].tolist() == a.req_to_token[r, :12].tolist()  # shared
    assert e.full_slots.shape[0] == 5 and d.full_slots.shape[0] == 1
    a.check_integrity()


def test_refused_block_changes_nothing_and_admits_nothing():
    a = make(num_full_pages=8, num_swa_pages=8)
    r = a.admit()
    a.alloc_extend([r], [8])
    before, live = a.snapshot(), a.n_live
    with pytest.raises(E.CapacityError):
        with a.scheduler_step() as it:
            s = it.admit()
            it.extend([s], [40])  # 10 pages: 6 are free
    assert_same_snapshot(before, a.snapshot())
    assert a.n_live == live
    with pytest.raises(RuntimeError):
        with a.scheduler_step() as it:
            it.release([r])
            raise RuntimeError("the engine failed: nothing runs")
    assert_same_snapshot(before, a.snapshot())


def test_results_are_valid_after_the_block_and_stale_after_the_next_step():
    a = make()
    r = a.admit()
    with a.scheduler_step() as it:
        e = it.extend([r], [6])
        with pytest.raises(E.PendingStepError):
            e.full_slots  # noqa: B018 -- not run yet
    assert e.full_slots.shape[0] == 6
    a.alloc_decode([r])
    with pytest.raises(E.StaleResultError):
        e.full_slots  # noqa: B018


def test_inside_a_free_group_is_refused():
    a = make()
    with a.free_group():
        with pytest.raises(E.NestedGroupError):
            with a.scheduler_step() as it:
                it.admit()


@settings(max_examples=30, deadline=None, database=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(ops=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 12), st.booleans(),
                              st.booleans()), min_size=1, max_size=12))
def test_random_blocks_equal_the_same_work_done_by_step(ops):
    """Random iterations through the block on one allocator and, on another, a host admit
    plus ONE ``step()`` with the same work: the same refusals and identical device state
    after every iteration."""
    a, b = make(), make()
    for row_pick, n, finish, new in ops:
        live = a.live_rows()
        rel = [int(live[row_pick % len(live)])] if finish and len(live) > 1 else []
        rest = [int(x) for x in live if int(x) not in rel]
        decode = [x for x in rest if a.seq_len(x) < 64][:3]
        ext = [x for x in rest if x not in decode][:1]
        grow = [max(1, min(n, 64 - a.seq_len(x))) for x in ext]
        new = new and a.n_live < 6
        err_a = err_b = None
        try:
            with a.scheduler_step() as it:
                it.release(rel)
                it.evict_all()
                row = it.admit() if new else None
                it.decode(decode)
                it.extend(ext + ([row] if new else []), grow + ([max(n, 1)] if new else []))
        except E.ContractError as exc:
            err_a = type(exc)
        row_b = b.admit() if new else None
        try:
            b.step(release=rel, evict=[x for x in live if x not in rel], decode=decode,
                   extend=(ext + ([row_b] if new else []), grow + ([max(n, 1)] if new else [])))
        except E.ContractError as exc:
            err_b = type(exc)
            if new:
                b.release([row_b])  # the block admits nothing when refused
        assert err_a == err_b
        same_device(a, b)
        a.check_integrity()


def test_ring_mode_admit_then_extend_in_one_block_is_refused_with_the_reason():
    """Ring mode: a request admitted in a step gets its ring pages from that step, so it
    allocates from the next step on (the refusal says so; nothing is admitted)."""
    cfg = ga.AllocatorConfig(page_size=4, num_full_pages=32, num_swa_pages=24, max_reqs=2,
                             max_context_len=32, sliding_window=4, swa_ring_pages=3,
                             device="cpu", backend="torch")
    a = ga.HybridAllocator(cfg)
    with pytest.raises(ga.OverlapError, match="allocates from the next step"):
        with a.scheduler_step() as it:
            r = it.admit()
            it.extend([r], [5])
    assert a.n_live == 0
    with a.scheduler_step() as it:
        r = it.admit()
    with a.scheduler_step() as it:
        it.extend([r], [5])
    assert a.seq_len(r) == 5
