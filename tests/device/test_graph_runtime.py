"""Graph runtime: replayed steps equal eager steps; zero syncs; ring hazards; graph structure.

The CUDA tests run the loop under ``torch.cuda.set_sync_debug_mode("error")``
and compare device state after *every* step without reading it back: mismatch
counts accumulate on the device and are read once at the end.
"""

from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest
import torch
from conftest import CORE_DEVICE
from workload import random_step

import graphalloc as ga

N_STEPS_GPU = int(os.environ.get("GRAPHALLOC_GRAPH_STEPS", "10000"))


def make_config(device, backend, ring, ps=4, dtype=torch.int64):
    return ga.AllocatorConfig(
        page_size=ps, num_full_pages=96, num_swa_pages=40 if not ring else 64, max_reqs=6,
        max_context_len=24 * ps, sliding_window=3 * ps - 1, index_dtype=dtype, device=device,
        backend=backend, swa_ring_pages=4 if ring else 0, max_release_rows=24,
        max_alloc_rows=8, max_step_pages=160, max_step_tokens=24 * ps + 8)


def state_mismatch(a: ga.HybridAllocator, b: ga.HybridAllocator) -> torch.Tensor:
    """Number of differing entries across all device tables (a device scalar, no sync)."""
    total = torch.zeros((), dtype=torch.int64, device=a.config.device)
    for name, ta in a.state.tables().items():
        tb = b.state.tables()[name]
        total += (ta != tb).sum()
    total += (a.state.out_full_buf != b.state.out_full_buf).sum()
    total += (a.state.out_swa_buf != b.state.out_swa_buf).sum()
    return total


@contextlib.contextmanager
def sync_debug_error():
    old = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(old)


# ---- CPU equivalents ------------------------------------------------------------------------
@pytest.mark.skipif(CORE_DEVICE != "cpu", reason="the CPU behaviour of StepGraph")
@pytest.mark.parametrize("ring", [False, True])
def test_stepgraph_on_cpu_runs_eagerly_and_matches(ring):
    """Without a GPU a StepGraph runs the same steps eagerly with identical results."""
    plain = ga.HybridAllocator(make_config("cpu", "torch", ring))
    graphed = ga.HybridAllocator(make_config("cpu", "torch", ring), executor="graph")
    step_graph = graphed.executor
    assert step_graph.graphs == []
    rng = np.random.default_rng(7)
    for _ in range(300):
        random_step([plain, graphed], rng)
        assert int(state_mismatch(plain, graphed)) == 0
    graphed.check_integrity()
    graphed.check()
    assert graphed.steps_run == plain.steps_run > 0


def test_plan_run_pairing_and_ring_rotation():
    alloc = ga.HybridAllocator(make_config("cpu", "torch", False))
    r = alloc.admit()
    used = []
    for _ in range(5):
        p = alloc.plan(decode=[r])
        used.append(p.buffer_index)
        with pytest.raises(ga.PendingStepError):
            alloc.plan(decode=[r])
        alloc.run(p)
    assert used == [0, 1, 0, 1, 0]


# ---- CUDA -----------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.parametrize("ring,fused", [(False, False), (True, False), (False, True),
                                        (True, True)])
def test_graph_replay_matches_eager_torch_every_step(ring, fused):
    """N random steps replayed through graphs (Triton) equal the eager Torch backend after
    every step, with zero host syncs in the whole loop. ``fused``: fusable steps replay the
    one-kernel graph."""
    graphed = ga.HybridAllocator(make_config("cuda", "triton", ring), fused_step=fused,
                                 executor="graph")
    eager = ga.HybridAllocator(make_config("cuda", "torch", ring))
    step_graph = graphed.executor
    rng = np.random.default_rng(11 + ring)
    mismatches = torch.zeros((), dtype=torch.int64, device="cuda")
    first_bad = torch.full((), -1, dtype=torch.int64, device="cuda")
    kinds: dict = {}
    with sync_debug_error():
        for i in range(N_STEPS_GPU):
            kind = random_step([graphed, eager], rng)
            kinds[kind] = kinds.get(kind, 0) + 1
            m = state_mismatch(graphed, eager)
            first_bad = torch.where((first_bad < 0) & (m > 0), i, first_bad)
            mismatches += m
    assert int(mismatches) == 0, f"first mismatching step {int(first_bad)}"
    graphed.check_integrity()
    eager.check_integrity()
    graphed.check()
    assert step_graph.replays + step_graph.empty_steps == graphed.steps_run  # no-row steps
    assert (step_graph.fused_replays > 0) == fused
    print(f"ring={ring} fused={fused}: {N_STEPS_GPU} ops, {step_graph.replays} replays "
          f"({step_graph.fused_replays} fused), kinds {kinds}")


@pytest.mark.cuda
def test_descriptor_ring_hazard_under_gpu_delay():
    """A spin kernel holds the GPU while the host plans ahead; the ring waits instead of
    overwriting a descriptor the GPU has not read, and results stay identical."""
    graphed = ga.HybridAllocator(make_config("cuda", "triton", False), executor="graph")
    eager = ga.HybridAllocator(make_config("cuda", "torch", False))
    rng = np.random.default_rng(3)
    for _ in range(20):
        random_step([graphed, eager], rng)
    torch.cuda.synchronize()
    stalls_before = graphed.ring.stalls
    for _ in range(6):
        torch.cuda._sleep(50_000_000)  # ~25 ms of GPU time before the next replay
        random_step([graphed, eager], rng)
    assert graphed.ring.stalls > stalls_before  # the host had to wait for the GPU
    torch.cuda.synchronize()
    assert int(state_mismatch(graphed, eager)) == 0
    graphed.check_integrity()


@pytest.mark.cuda
def test_describe_graph_only_kernel_nodes():
    alloc = ga.HybridAllocator(make_config("cuda", "triton", False), executor="graph")
    desc = alloc.executor.describe()
    print("graph nodes:", desc)
    assert desc.get("kernel") == 3, desc  # the rows staged, release, allocation
    for forbidden in ("memcpy", "memset", "host"):
        assert desc.get(forbidden, 0) == 0, desc
    assert desc["total"] == 3
    assert "stage" in desc["kernel_names"][0] or desc["kernel_names"][0].startswith("<"), desc
    unstaged = ga.HybridAllocator(make_config("cuda", "triton", False),
                                  executor=ga.StepGraph(staged=False)).executor.describe()
    assert unstaged.get("kernel") == 2 and unstaged["total"] == 2, unstaged


@pytest.mark.cuda
def test_describe_fused_graph_one_kernel_node():
    alloc = ga.HybridAllocator(make_config("cuda", "triton", False), fused_step=True,
                               executor="graph")
    desc = alloc.executor.describe(fused=True)
    print("fused graph nodes:", desc)
    assert desc.get("kernel") == 2 and desc["total"] == 2, desc  # rows staged, the step
