"""The one-step redesign's own contract: one Step value, one recorder, one rule site for
what frees give back, one transaction (refuse, cancel, a launch that raises)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import assert_same_snapshot

import graphalloc as ga
from graphalloc import errors as E
from graphalloc.device.executor import EagerExecutor


def small(**kw):
    args = dict(page_size=4, num_full_pages=32, num_swa_pages=32, max_reqs=4,
                max_context_len=64, sliding_window=6, max_handles=2)
    args.update(kw)
    return ga.HybridAllocator(ga.AllocatorConfig(**args))


def test_keywords_are_sugar_for_one_step_value():
    a, b = small(), small()
    for alloc in (a, b):
        r = alloc.admit()
        alloc.alloc_extend([r], [9])
    out_a = a.step(evict_all=True, decode=[0])
    out_b = b.step(ga.Step(evict_all=True, decode=[0]))
    assert out_a.full_slots.tolist() == out_b.full_slots.tolist()
    assert_same_snapshot(a.snapshot(), b.snapshot())
    with pytest.raises(E.ContractError, match="not both"):
        a.step(ga.Step(decode=[0]), release=[0])
    assert ga.Step(release=[1], decode=[0]).kinds() == ["release", "decode"]


def test_what_frees_give_back_has_one_rule_site():
    """The drift of the first build: after a lookahead decode (L = 24, C = 16) a frontier
    move to 20 is past the committed pages; the query, the dry run and the step agree,
    because the query IS a dry run of the planner's frees."""
    a = small(max_handles=0, sliding_window=40)
    r = a.admit()
    a.alloc_extend([r], [16])
    a.step(decode=[r], lookahead=7)
    assert (a.seq_len(r), a.committed_len(r)) == (24, 16)
    before = a.snapshot()
    for call in (lambda: a.pages_released([], advance=([r], [20])),
                 lambda: a.fits(advance=([r], [20])),
                 lambda: a.step(advance=([r], [20]))):
        with pytest.raises(E.PositionError):
            call()
    assert_same_snapshot(before, a.snapshot())
    assert a.pages_released([], advance=([r], [16])) == (0, 4)
    assert a.fits(advance=([r], [16]))


def test_a_planned_step_can_be_cancelled():
    a = small()
    r = a.admit()
    a.alloc_extend([r], [10])
    before = a.snapshot()
    p = a.plan(release=[r])
    assert not a.is_live(r)  # the ledger holds the plan (journaled) ...
    a.cancel(p)  # ... until it is taken back
    assert_same_snapshot(before, a.snapshot())
    with pytest.raises(E.PendingStepError, match="cancelled"):
        a.run(p)
    a.run(a.plan(release=[r]))  # the allocator plans again
    assert not a.is_live(r) and a.audit() == []


class Flaky(EagerExecutor):
    """An eager executor whose launch raises now and then (a driver error, an OOM)."""

    def __init__(self, rng):
        super().__init__()
        self.rng, self.raised = rng, 0

    def execute(self, planned) -> None:
        if self.rng.random() < 0.2:
            self.raised += 1
            raise RuntimeError("injected launch failure")
        super().execute(planned)


def _random_step(alloc, rng) -> ga.Step:
    """One random scheduler step over ``alloc``'s live rows (admits, releases, evictions,
    decodes with and without lookahead, prefill chunks)."""
    led = alloc.ledger
    live = np.flatnonzero(led.live)
    free = np.flatnonzero(~led.live)
    plain = live[led.committed[live] == led.seq_len[live]]
    kw: dict = {}
    if len(free) and rng.random() < 0.4:
        kw["admit"] = free[:1]  # (ring mode: it allocates from the next step on)
        if not alloc.config.ring_mode:
            kw["extend"] = (free[:1], [int(rng.integers(1, 20))])
    elif len(live) and rng.random() < 0.3 and led.seq_len[live[-1]] == 0:
        kw["extend"] = (live[-1:], [int(rng.integers(1, 20))])
    if len(live) > 2 and rng.random() < 0.3:
        kw["release"] = live[:1]
    rest = [r for r in plain if r not in kw.get("release", ()) and led.seq_len[r] > 0
            and r not in kw.get("extend", ((),))[0]]
    if rest:
        kw["evict"] = rest
        kw["decode"] = rest
        if rng.random() < 0.3:
            kw["lookahead"] = int(rng.integers(0, 3))
    spec = [r for r in live if led.spec_steps[r, 0] and r not in kw.get("release", ())]
    if spec and "lookahead" not in kw:
        kw["commit"] = (spec, [0] * len(spec))
    return ga.Step(**kw)


@pytest.mark.parametrize("ps,ring", [(1, 0), (3, 0), (4, 3)])
def test_a_launch_that_raises_leaves_the_allocator_as_before_the_plan(ps, ring):
    """Launch failures injected at random steps of a random workload: each one raises
    LaunchError with the allocator exactly as before that step (snapshot); the workload
    goes on, and after every step the allocator equals a twin that never failed and ran
    only the steps that succeeded (device tables and host ledger), its audit empty."""
    cfg = ga.AllocatorConfig(page_size=ps, num_full_pages=80, num_swa_pages=80 if not ring
                             else 40, max_reqs=5, max_context_len=60,
                             sliding_window=5 if ring else 7, swa_ring_pages=ring,
                             max_handles=0 if ring else 2)
    flaky = ga.HybridAllocator(cfg, executor=Flaky(np.random.default_rng(ps)))
    steady = ga.HybridAllocator(cfg)
    rng = np.random.default_rng(11)
    ran = 0
    for _ in range(120):
        step = _random_step(flaky, rng)
        before = flaky.snapshot()
        try:
            flaky.step(step)
        except E.LaunchError as exc:
            assert isinstance(exc.__cause__, RuntimeError) and flaky.pending is None
            assert_same_snapshot(before, flaky.snapshot())
            continue
        except (E.CapacityError, E.RingOverflowError, E.PositionError):
            continue  # refused before anything changed (tested elsewhere)
        steady.step(step)
        ran += 1
        assert_same_snapshot(steady.snapshot(), flaky.snapshot())
    assert flaky.executor.raised > 5 and ran > 50
    assert flaky.audit() == [] and steady.audit() == []


def test_recorder_misuse_is_refused_not_absorbed():
    a = small()
    r = a.admit()
    a.alloc_extend([r], [5])
    with a.scheduler_step() as it:
        it.decode([r])
        with pytest.raises(E.RecorderError):
            a.step(decode=[r])  # would run as a step of its own before the block's
        with pytest.raises(E.RecorderError):
            a.admit()
    with pytest.raises(E.RecorderError, match="closed"):
        it.admit()  # the block ran: a row reserved now would never be admitted
    with pytest.raises(KeyError):
        with a.scheduler_step() as it:
            it.release([r])
            raise KeyError("the engine failed mid-iteration")
    assert a.is_live(r)  # the block ran nothing


def test_try_step_tells_back_pressure_from_success():
    a = small(num_full_pages=4, num_swa_pages=4)
    r = a.admit()
    a.alloc_extend([r], [8])
    empty = a.try_step(release=[r])  # a successful step that allocated nothing
    assert empty is not None and len(empty) == 0
    s = a.admit()
    assert a.try_step(extend=([s], [17])) is None  # 5 pages of 4: back-pressure
    assert a.try_step(extend=([s], [16])) is not None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_plan_run_never_synchronises_on_cuda():
    a = ga.HybridAllocator(ga.AllocatorConfig(
        page_size=16, num_full_pages=256, num_swa_pages=128, max_reqs=8,
        max_context_len=1024, sliding_window=63, device="cuda", backend="triton"),
        executor="graph")
    rows = [a.admit() for _ in range(4)]
    a.alloc_extend(rows, [100] * 4)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(20):
            a.cancel(a.plan(evict_all=True, decode=rows))
            a.step(evict_all=True, decode=rows)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    a.check()


