"""One transaction from plan to device: a launch that fails anywhere takes the whole step back.

Rule (``graphalloc.plan.pipeline``, ``graphalloc.device.restore``): a step whose launch
raises -- before its first kernel, between any two of its kernels (release, allocation,
page tables, state table, each state tensor's copy), in any part of a split free -- leaves
the host ledger AND every device entry the allocator defines as they were before the step
was planned, the stamp count included, and ``LaunchError`` says so. Retrying the step then
gives what a run without the failure gives.

The random workload (``tests/lib/workload.py``) runs on two allocators built alike: the
faulty one gets a launch failure armed at a random kernel (``tests/lib/launch_faults.py``)
before every operation; when it fires, its defined state must equal the state before the
operation and its audit be empty, and the operation is retried. The other allocator never
fails. After every operation both audits are empty and both hold the same defined state.
"""

from __future__ import annotations

import collections
import warnings

import numpy as np
import pytest
import torch
import workload
from launch_faults import LaunchFaults, defined_state, same_state

import graphalloc as ga
from graphalloc import ChunkedLocal, FullAttention, RecurrentState, SlidingWindow
from graphalloc import errors as E
from graphalloc.attention.spec import PageTableSpec
from graphalloc.plan import compiled

PLANNERS = ["numpy", pytest.param("compiled", marks=pytest.mark.skipif(
    not compiled.AVAILABLE, reason="the compiled planner is not built"))]


def build(backend="torch", planner="numpy", fused=True, ring=False, executor="eager",
          layers=None):
    ps = 2
    pools = dict(num_full_pages=48, num_swa_pages=28, sliding_window=2 * ps + 1,
                 num_state_slots=0 if ring else 14)
    if layers == "full_only":
        pools = dict(layers=(FullAttention(48), RecurrentState(14)))
    elif layers == "chunked":
        pools = dict(layers=(FullAttention(48), ChunkedLocal(3 * ps, 28), RecurrentState(14)))
    elif layers == "two_windows":  # a further window pool (graphalloc.pools.extra_window)
        pools = dict(layers=(FullAttention(48), SlidingWindow(2 * ps + 1, 28),
                             SlidingWindow(3 * ps + 1, 20), RecurrentState(14)))
    cfg = ga.AllocatorConfig(
        page_size=ps, max_reqs=4, max_context_len=12 * ps, backend=backend,
        swa_ring_pages=4 if ring else 0, max_release_rows=3, max_alloc_rows=4,
        max_step_pages=16, max_step_tokens=12 * ps + 8, max_handles=0 if ring else 2,
        max_spec_tokens=4, **pools)
    kw = {}
    if not ring:
        slots, dev = cfg.num_state_slots + 1, cfg.device
        kw["state_tensors"] = [torch.zeros(slots, 3, device=dev),
                               (torch.zeros(2, slots, 2, device=dev), 1)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the graph executor on a CPU
        return ga.HybridAllocator(cfg, planner=planner, fused_step=fused, executor=executor,
                                  page_tables=PageTableSpec(max_batch=4, layers=(
                                      ("full",) if layers == "full_only" else ("full", "swa"))),
                                  **kw)


def run_workload(n_ops, seed, monkeypatch, **kw):
    faulty, clean = build(**kw), build(**kw)
    faults = LaunchFaults(faulty)
    rng = np.random.default_rng(seed)
    fault_rng = np.random.default_rng(seed + 1000)
    fired = collections.Counter()
    states = {"failures": 0, "split_failures": 0}

    def apply_all(allocs, fn):
        a, b = allocs
        before = defined_state(a)
        faults.arm(int(fault_rng.integers(0, 7)))
        error = None
        try:
            result = fn(a)
        except E.LaunchError as exc:
            assert isinstance(exc.__cause__, Exception)
            fired[faults.fired] += 1
            states["failures"] += 1
            states["split_failures"] += "of a free" in str(exc)
            assert "nothing of it took effect" in str(exc)
            assert a.pending is None and not a.faulted
            diff = same_state(before, defined_state(a))
            assert diff is None, f"{faults.fired}: {diff} differs from before the step"
            assert a.audit() == [], faults.fired
            faults.disarm()
            try:
                result = fn(a)
            except ga.ContractError as again:
                result, error = None, type(again)
        except ga.ContractError as exc:
            result, error = None, type(exc)
        faults.disarm()
        try:
            other = fn(b)
            other_error = None
        except ga.ContractError as exc:
            other, other_error = None, type(exc)
        assert error == other_error, (error, other_error)
        if isinstance(result, (int, np.integer)):
            assert result == other
        return result

    monkeypatch.setattr(workload, "apply_all", apply_all)
    for i in range(n_ops):
        op = workload.random_step([faulty, clean], rng)
        assert faulty.audit() == [], (i, op)
        diff = same_state(defined_state(faulty), defined_state(clean))
        assert diff is None, (i, op, diff)
    faulty.check()
    clean.check()
    return fired, states, faulty


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("planner", PLANNERS)
def test_a_launch_failing_at_any_kernel_takes_the_step_back(planner, fused, monkeypatch):
    """Every kind of step -- admits, extends, decodes with evictions, speculative rounds,
    sharing, snapshots (state copies), split frees -- failed at a random kernel: the allocator
    is as before the step, the retry equals a clean run, and every failure point was hit."""
    fired, states, alloc = run_workload(500, 7 + fused, monkeypatch, planner=planner,
                                        fused=fused)
    points = {"page_tables", "state_table", "state_copy[0]", "state_copy[1]"}
    points |= {"fused", "release"} if fused else {"release", "allocate"}
    assert points <= set(fired), fired
    assert states["split_failures"] > 0, states
    print(f"planner={planner} fused={fused}: {alloc.steps_run} steps run, "
          f"{states['failures']} launch failures ({dict(fired)}), "
          f"{states['split_failures']} in split frees")


@pytest.mark.parametrize("planner", PLANNERS)
def test_ring_mode_launch_failures_take_the_step_back(planner, monkeypatch):
    """Ring mode keeps no host copy of page ids: a row cut and grown in one step (a
    speculative round) or released and admitted again gets its pages back from what the
    step's own release rows pushed."""
    fired, states, alloc = run_workload(400, 11, monkeypatch, planner=planner, ring=True,
                                        fused=False)
    assert {"release", "allocate", "page_tables"} <= set(fired), fired
    assert states["split_failures"] > 0, states
    print(f"ring mode, planner={planner}: {alloc.steps_run} steps run, {states['failures']} "
          f"launch failures ({dict(fired)}), {states['split_failures']} in split frees")


@pytest.mark.parametrize("layers", ["full_only", "chunked", "two_windows"])
@pytest.mark.parametrize("planner", PLANNERS)
def test_other_layer_pools_launch_failures_take_the_step_back(planner, layers, monkeypatch):
    """A model without window layers, with chunked local attention, with two sliding
    windows (a further window pool: the numpy planner plans it, its tables are projected
    from its ledger slice)."""
    if layers == "two_windows" and planner == "compiled":
        pytest.skip("the compiled twin plans one window pool")
    fired, states, alloc = run_workload(250, 13, monkeypatch, planner=planner, layers=layers)
    assert {"page_tables", "state_table"} <= set(fired), fired
    print(f"layers={layers}, planner={planner}: {alloc.steps_run} steps run, "
          f"{states['failures']} launch failures ({dict(fired)}), "
          f"{states['split_failures']} in split frees")


def test_graph_executor_launch_failures_take_the_step_back(monkeypatch):
    """The graph executor's eager fallback (a CPU device) goes through the same path."""
    fired, states, alloc = run_workload(150, 3, monkeypatch, executor="graph")
    assert states["failures"] > 0
    print(f"graph executor: {alloc.steps_run} steps run, {states['failures']} launch failures "
          f"({dict(fired)})")


def test_triton_backend_launch_failures_take_the_step_back(monkeypatch):
    """The Triton kernels (interpreter on a CPU): a short workload."""
    fired, states, alloc = run_workload(40, 5, monkeypatch, backend="triton")
    assert states["failures"] > 0, states
    print(f"triton: {alloc.steps_run} steps run, {states['failures']} launch failures "
          f"({dict(fired)})")


# ---- the regressions of issue 35, item 1 ---------------------------------------------------
def _pool(**kw):
    args = dict(page_size=4, num_full_pages=32, num_swa_pages=32, max_reqs=4,
                max_context_len=64, model_window=7, max_handles=2)
    args.update(kw)
    return ga.AllocatorConfig(**args)


@pytest.mark.parametrize("planner", PLANNERS)
def test_failure_after_the_page_kernels_leaves_no_device_write(planner):
    """1(a): the page-table launch fails after the allocation ran: full_to_swa and
    req_to_token keep nothing of the step, and the retry neither leaks an SWA page nor
    pushes the sink page."""
    a = ga.HybridAllocator(_pool(), planner=planner, page_tables=PageTableSpec(max_batch=4))
    faults = LaunchFaults(a)
    r = a.admit()
    a.alloc_extend([r], [9])
    before = defined_state(a)
    faults.watch()
    a.alloc_extend([r], [9])
    n_launches = len(faults.seen)
    assert faults.seen[-1] == "page_tables"
    b = ga.HybridAllocator(_pool(), planner=planner, page_tables=PageTableSpec(max_batch=4))
    a2 = LaunchFaults(b)
    r = b.admit()
    b.alloc_extend([r], [9])
    a2.arm(n_launches - 1)  # the page tables: after the allocation
    with pytest.raises(E.LaunchError):
        b.alloc_extend([r], [9])
    assert b.audit() == []
    assert same_state(before, defined_state(b)) is None
    b.alloc_extend([r], [9])  # the retry
    b.release([r])
    assert b.audit() == []
    b.check()
    assert b.n_free("swa") == 32 and b.n_free("full") == 32


@pytest.mark.parametrize("planner", PLANNERS)
def test_failure_in_a_later_part_of_a_split_free_undoes_every_part(planner):
    """1(b): six 8-token requests freed with max_release_rows=3 run as two launches; the
    second fails: no row is released on the host, no mapping is cleared on the device."""
    a = ga.HybridAllocator(_pool(num_full_pages=64, num_swa_pages=64, max_reqs=8,
                                 max_release_rows=3, max_handles=0), planner=planner)
    faults = LaunchFaults(a)
    rows = [a.admit() for _ in range(6)]
    a.alloc_extend(rows, [8] * 6)
    a.check()
    before, steps = defined_state(a), a.steps_run
    faults.arm(1)  # the second part
    with pytest.raises(E.LaunchError, match="part 2 of the 2 launches"):
        a.release(rows)
    assert a.audit() == []
    assert same_state(before, defined_state(a)) is None
    assert a.steps_run == steps and all(a.is_live(r) for r in rows)
    a.check()  # the undone parts' stamps are off the device count
    a.release(rows)
    assert a.audit() == [] and a.n_live == 0
    a.check()


def test_a_failed_launch_makes_earlier_results_stale():
    """The failed step may have written the output buffers: an earlier result refuses
    access, as after any later allocating step."""
    a = ga.HybridAllocator(_pool())
    faults = LaunchFaults(a)
    r = a.admit()
    out = a.alloc_extend([r], [3])
    faults.arm(0)
    with pytest.raises(E.LaunchError):
        a.alloc_extend([r], [3])
    with pytest.raises(E.StaleResultError):
        _ = out.full_slots


@pytest.mark.parametrize("planner", PLANNERS)
def test_a_copy_into_a_slot_the_step_freed_is_undone(planner):
    """The state pool is empty when a step releases request A and admits a request on a
    snapshot: the copy's destination is A's slot, freed by the same step. The second state
    tensor's copy fails: A is live again, and its state in the first tensor is its own."""
    cfg = _pool(num_state_slots=3, max_spec_tokens=2)
    t0, t1 = torch.zeros(4, 2, device=cfg.device), torch.zeros(2, 4, device=cfg.device)
    a = ga.HybridAllocator(cfg, planner=planner, state_tensors=[t0, (t1, 1)])
    faults = LaunchFaults(a)
    r_a, r_b = a.admit(), a.admit()
    a.alloc_extend([r_a, r_b], [4, 4])
    s_a, s_b = int(a.req_to_state[r_a]), int(a.req_to_state[r_b])
    t0[s_a], t1[:, s_a], t0[s_b], t1[:, s_b] = 7.0, 7.0, 5.0, 5.0
    h = a.take_handle(r_b, 4)
    assert a.n_free("state") == 0
    before = defined_state(a)
    faults.watch()
    p = a.plan(release=[r_a], admit_on=([2], [h], [-1]))
    assert p.state_copies.tolist() == [[int(a.handle_to_state[h]), s_a]]
    a.cancel(p)
    faults.arm(3)  # fused, state table, copy into t0: the copy into t1 fails
    with pytest.raises(E.LaunchError):
        a.step(release=[r_a], admit_on=([2], [h], [-1]))
    assert faults.fired == "state_copy[1]"
    assert same_state(before, defined_state(a)) is None and a.audit() == []
    assert float(t0[s_a].min()) == 7.0 and float(t1[:, s_a].min()) == 7.0
    a.step(release=[r_a], admit_on=([2], [h], [-1]))  # the retry copies the snapshot
    assert float(t0[s_a].max()) == 5.0 and int(a.req_to_state[2]) == s_a
