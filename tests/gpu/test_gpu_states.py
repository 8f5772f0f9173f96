"""Recurrent-state slots on the GPU: graph-replayed steps with the Triton table and copy
kernels equal the eager Torch path after every step (slot tables and the state tensors'
contents), under sync-debug "error" (CUDA only; skipped without a GPU).

Between steps a model writes every slot the tables name (``tests/lib/state_model.py``);
its values depend on the slot, not on the write's position, because ``spec_state``'s
unspecified entries repeat slot ids and CUDA's ``index_copy_`` lands repeated writes in no
fixed order (the earlier per-position values made this test fail from operation 99 on an
H100; ``tests/device/test_state_model_writes.py`` shows it on the CPU)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from state_model import model_writes
from workload import random_step

import graphalloc as ga

pytestmark = pytest.mark.cuda
N_STATE_STEPS = int(os.environ.get("GRAPHALLOC_STATE_STEPS_GPU", "5000"))
N_SLOTS = 40


def config(backend: str) -> ga.AllocatorConfig:
    return ga.AllocatorConfig(page_size=4, num_full_pages=160, num_swa_pages=96, max_reqs=8,
                              max_context_len=96, model_window=10, device="cuda",
                              backend=backend, max_handles=6, num_state_slots=N_SLOTS,
                              max_spec_tokens=4)


def build(backend: str, executor: str):
    conv = torch.zeros(3, N_SLOTS + 1, 5, device="cuda")  # slots on dimension 1
    ssm = torch.zeros(N_SLOTS + 1, 2, 700, device="cuda")  # a slot spans two copy blocks
    alloc = ga.HybridAllocator(config(backend), executor=executor,
                               state_tensors=[(conv, 1), ssm])
    return alloc, conv, ssm


def test_state_graph_replay_matches_eager_every_step():
    graphed, g_conv, g_ssm = build("triton", "graph")
    eager, e_conv, e_ssm = build("torch", "eager")
    rng = np.random.default_rng(25)
    bad = torch.zeros((), dtype=torch.int64, device="cuda")
    first = torch.full((), -1, dtype=torch.int64, device="cuda")
    kinds: dict = {}
    old = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i in range(N_STATE_STEPS):
            kind = random_step([graphed, eager], rng)
            kinds[kind] = kinds.get(kind, 0) + 1
            m = sum(((x != y).sum() for x, y in zip(graphed.state.tables().values(),
                                                      eager.state.tables().values(),
                                                      strict=True)),
                    torch.zeros((), dtype=torch.int64, device="cuda"))
            # slots 1..S (slot 0 is the sink: rows without a slot write it, in no order)
            m = m + (g_conv[:, 1:] != e_conv[:, 1:]).sum() + (g_ssm[1:] != e_ssm[1:]).sum()
            first = torch.where((first < 0) & (m > 0), i, first)
            bad += m
            for alloc, conv, ssm in ((graphed, g_conv, g_ssm), (eager, e_conv, e_ssm)):
                model_writes(alloc, conv, ssm, i)
    finally:
        torch.cuda.set_sync_debug_mode(old)
    assert int(bad) == 0, f"first mismatching operation {int(first)}"
    n = N_STATE_STEPS
    assert kinds.get("take_handle(state)", 0) > n // 200, kinds
    assert kinds.get("admit(handle)", 0) > n // 200, kinds
    assert kinds.get("spec_round", 0) > n // 100, kinds
    graphed.check()
    assert graphed.audit() == [] and eager.audit() == []
    print(f"{n} operations, {graphed.executor.replays} replays, kinds {kinds}")
