"""Contained faults, audit, recovery and soak.

Faults are injected by corrupting device tables by hand (what a bug elsewhere
in an engine could do); each must be detected at the next ``check()`` or
``audit()``, the process (and on a GPU, the CUDA context) survives, and no
page ends up with two owners.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch
from conftest import DEVICE
from faults import keep_damage
from workload import random_step

import graphalloc as ga
from graphalloc.errors import FaultCode

BACKENDS = ["torch", "triton"]


def make(backend="torch", device="cpu", ring=False, ps=4, executor="eager", **kw):
    cfg = dict(page_size=ps, num_full_pages=64, num_swa_pages=32, max_reqs=4,
               max_context_len=16 * ps, sliding_window=2 * ps + 1, device=device,
               backend=backend, swa_ring_pages=4 if ring else 0, max_release_rows=12,
               max_alloc_rows=4, max_step_pages=80, max_step_tokens=16 * ps + 4)
    cfg.update(kw)
    return ga.HybridAllocator(ga.AllocatorConfig(**cfg), executor=executor)


def kinds(findings):
    return {f.kind for f in findings}


# ---- device faults --------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_unmapped_peer_is_contained_and_reported(backend):
    alloc = make(backend, DEVICE, num_swa_pages=8)
    r, other = alloc.admit(), alloc.admit()
    alloc.alloc_extend([r, other], [12, 8])
    ps = alloc.config.page_size
    page = int(alloc.req_to_token[r, 4]) // ps  # the second page of r
    alloc.full_to_swa[page * ps] = 0  # fault injection: its peer is lost
    alloc.release([r])
    with pytest.raises(ga.DeviceFaultError) as info:
        alloc.check()
    err = info.value
    assert err.code == FaultCode.UNMAPPED_PEER and err.codes & FaultCode.UNMAPPED_PEER
    assert (err.req, err.page, err.stage, err.count) == (r, page, "release", 1)
    with pytest.raises(ga.PendingStepError):  # refuses steps until recovered
        alloc.alloc_decode([other])
    with pytest.raises(ga.IntegrityError):  # the tables are wrong: a reset is refused
        alloc.reset_faults()
    with pytest.raises(ga.PendingStepError):
        alloc.alloc_decode([other])
    keep_damage(alloc)  # go on over the damage, to see the kernels contain it
    found = alloc.audit()
    # the sink marker sits in the SWA free list instead of a page: detected, never re-owned
    assert "bad_free_entry" in kinds(found) and "double_owner" not in kinds(found)
    # an allocation that pops the sink marker records SINK_POP and maps nothing
    for _ in range(24):
        alloc.alloc_decode([other])
        try:
            alloc.check()
        except ga.DeviceFaultError as exc:
            assert exc.code == FaultCode.SINK_POP and exc.stage == "alloc"
            break
    else:
        pytest.fail("the sink marker was never popped")
    assert "double_owner" not in kinds(alloc.audit())


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_full_pages_mapping_to_one_swa_page_is_found(backend):
    alloc = make(backend, DEVICE)
    r = alloc.admit()
    alloc.alloc_extend([r], [12])
    ps = alloc.config.page_size
    a, b = (int(alloc.req_to_token[r, p]) // ps for p in (0, ps))
    alloc.full_to_swa[b * ps:(b + 1) * ps] = alloc.full_to_swa[a * ps:(a + 1) * ps].clone()
    found = alloc.audit()
    assert "double_owner" in kinds(found) or "leak" in kinds(found)
    with pytest.raises(ga.IntegrityError):
        alloc.check_integrity()


def test_duplicate_in_free_ring_is_found():
    alloc = make()
    r = alloc.admit()
    alloc.alloc_extend([r], [12])
    owned = int(alloc.req_to_token[r, 0]) // alloc.config.page_size
    head = alloc.ledger.full.head
    alloc.state.full_free[head] = owned  # a page both free and owned
    found = alloc.audit()
    assert "double_owner" in kinds(found) and "leak" in kinds(found)


def test_corrupt_frontier_is_found():
    alloc = make()
    r = alloc.admit()
    alloc.alloc_extend([r], [30])
    alloc.evict_window()
    alloc.ledger.frontier[r] -= alloc.config.page_size  # host ledger corrupted
    found = alloc.audit()
    assert "missing_mapping" in kinds(found) or "conservation" in kinds(found)


def test_healthy_allocator_audits_clean():
    alloc = make()
    rng = np.random.default_rng(0)
    for _ in range(200):
        random_step([alloc], rng)
    assert alloc.audit() == []


# ---- recovery -------------------------------------------------------------------------------
@pytest.mark.parametrize("ring", [False, True])
def test_state_dict_round_trip(ring):
    src, dst = make(ring=ring), make(ring=ring)
    rng = np.random.default_rng(1)
    for _ in range(120):
        random_step([src], rng)
    dst.load_state_dict(src.state_dict())
    assert dst.audit() == []
    for _ in range(120):  # both continue identically
        random_step([src, dst], rng)
    a, b = src.snapshot(), dst.snapshot()
    for k in a:
        assert np.array_equal(np.asarray(a[k]), np.asarray(b[k])), k


@pytest.mark.parametrize("corrupt", ["dup_free", "not_dense", "bad_count", "geometry"])
def test_bad_state_dict_is_refused_and_state_kept(corrupt):
    src, dst = make(), make()
    rng = np.random.default_rng(2)
    for _ in range(80):
        random_step([src], rng)
    src.step(release=np.flatnonzero(src.ledger.live))
    kept = src.admit()
    src.alloc_extend([kept], [3 * src.config.page_size])
    for _ in range(30):
        random_step([dst], rng)
    sd = src.state_dict()
    ps = src.config.page_size
    if corrupt == "dup_free":
        ring = sd["device"]["full_free"]
        head, n_free = sd["host"]["rings"][0]
        ring[(head + 1) % len(ring)] = ring[head % len(ring)]
    elif corrupt == "not_dense":
        r = kept
        pos = sd["host"]["frontier"][r]
        page = int(sd["device"]["req_to_token"][r, pos]) // ps
        sd["device"]["full_to_swa"][page * ps + ps - 1] += 1 if ps > 1 else 7 * ps
    elif corrupt == "bad_count":
        sd["host"]["rings"][1, 1] += 1  # [SWA][n_free]
    else:
        sd["geometry"]["page_size"] = ps + 1
    before = dst.snapshot()
    with pytest.raises(ga.StateError):
        dst.load_state_dict(sd)
    after = dst.snapshot()
    for k in before:
        assert np.array_equal(np.asarray(before[k]), np.asarray(after[k])), k


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_load_back_repairs_and_refuses_when_mapped(backend):
    """load_back is a planned step: host rules refused up front with nothing changed; a
    full page that (on the device) still has a peer is a fact only the device sees: in
    validate mode it reaches the error word and the stale peer is left alone."""
    alloc = make(backend, validate=True)
    r = alloc.admit()
    alloc.alloc_extend([r], [40])
    alloc.evict_window()
    ps = alloc.config.page_size
    f = alloc.frontier(r)
    assert f >= 3 * ps
    swa_free_before = alloc.n_free("swa")
    slots = alloc.load_back(r, f - 2 * ps).clone()
    assert slots.shape == (2 * ps,) and int(slots.min()) >= ps
    assert alloc.n_free("swa") == swa_free_before - 2
    assert alloc.audit() == []
    full_pages = alloc.req_to_token[r, f - 2 * ps:f:ps] // ps
    assert torch.equal(alloc.full_to_swa[full_pages * ps], slots[::ps])  # mapped, page-dense
    before = alloc.snapshot()
    with pytest.raises(ga.FrontierError):  # a host rule: refused with nothing changed
        alloc.load_back(r, f + ps)
    with pytest.raises(ga.AlignmentError):
        alloc.load_back(r, f - 2 * ps - 1)
    after = alloc.snapshot()
    for k in before:
        assert np.array_equal(np.asarray(before[k]), np.asarray(after[k])), k
    below = int(alloc.req_to_token[r, f - 3 * ps]) // ps
    stale = 5 * ps + torch.arange(ps)
    alloc.full_to_swa[below * ps:(below + 1) * ps] = stale  # a stale peer (device-only fact)
    alloc.load_back(r, f - 3 * ps)
    with pytest.raises(ga.DeviceFaultError) as exc:
        alloc.check()
    assert exc.value.code == FaultCode.MAPPED_PEER
    assert torch.equal(alloc.full_to_swa[below * ps:(below + 1) * ps].cpu(), stale)


# ---- soak -----------------------------------------------------------------------------------
SOAK_STEPS = int(os.environ.get("GRAPHALLOC_SOAK_STEPS", "10000"))


@pytest.mark.parametrize("ring", [False, True])
def test_soak_cpu(ring):
    """Random continuous batching; conservation every 1000 steps, full audit at the end."""
    alloc = make(ring=ring, ps=3)
    rng = np.random.default_rng(99 + ring)
    start = time.monotonic()
    for i in range(SOAK_STEPS // 2):
        random_step([alloc], rng)
        if i % 1000 == 999:
            alloc.ledger.check_host_invariants()
        assert time.monotonic() - start < 240, "soak exceeded its time bound"
    assert alloc.audit() == []
    alloc.check()
    print(f"soak ring={ring}: {alloc.steps_run} steps in {time.monotonic() - start:.1f}s")


@pytest.mark.cuda
def test_soak_gpu_graph_replay():
    """100,000 graph-replayed steps (GRAPHALLOC_SOAK_STEPS_GPU) with an audit every 10,000 and
    host conservation every 1,000."""
    n_steps = int(os.environ.get("GRAPHALLOC_SOAK_STEPS_GPU", "100000"))
    alloc = make("triton", "cuda", ps=16, num_full_pages=512, num_swa_pages=160, max_reqs=16,
                 max_release_rows=48, max_alloc_rows=16, max_step_pages=600,
                 max_step_tokens=16 * 16 + 16, executor="graph")
    graph = alloc.executor
    rng = np.random.default_rng(5)
    start = time.monotonic()
    audits = 0
    while alloc.steps_run < n_steps:
        random_step([alloc], rng)
        if alloc.steps_run % 1000 < 2:
            alloc.ledger.check_host_invariants()
        if alloc.steps_run // 10000 > audits:
            audits += 1
            assert alloc.audit() == []
    alloc.check()
    assert alloc.audit() == []
    print(f"GPU soak: {alloc.steps_run} steps, {graph.replays} replays, {audits} audits, "
          f"{time.monotonic() - start:.1f}s")


@pytest.mark.cuda
def test_fault_injection_gpu_context_survives():
    alloc = make("triton", "cuda", executor="graph")
    r = alloc.admit()
    alloc.alloc_extend([r], [12])
    ps = alloc.config.page_size
    page = int(alloc.req_to_token[r, 0]) // ps
    alloc.full_to_swa[page * ps] = 0
    alloc.release([r])
    with pytest.raises(ga.DeviceFaultError):
        alloc.check()
    assert "double_owner" not in kinds(alloc.audit())
    alloc.recover()
    torch.cuda.synchronize()  # the context is alive
    x = torch.ones(4, device="cuda").sum()
    assert float(x) == 4.0
    assert alloc.audit() == []
