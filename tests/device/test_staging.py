"""Staged steps (graphalloc.kernels.stage): the rows copied to the buffer's device mirror at
the head of the step, the kernels launched over the mirror, leave exactly what the unstaged
launch over the pinned buffer leaves.

On a CPU the mirror is an ordinary tensor (``StepKernels.stage_anywhere``): the plumbing --
which rows each launch copies, the stamp, the lane and state sections, row buckets and long
rows -- runs as on a GPU. A random workload (prefills, decodes, releases, evictions, shared
handles, speculative rounds, recurrent-state snapshots) drives two allocators that differ
only in staging, with page tables and state slots, on the Torch twins and on the Triton
interpreter, and every device tensor, page table, state tensor and the step counts must be
equal after every operation. A launch that staged nothing would read zero rows and differ.
On a GPU (the ``device`` fixture) the same runs with pinned buffers and device mirrors, the
Triton kernels compiled.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from workload import random_step

import graphalloc as ga
from graphalloc.device.buckets import GridPolicy
from graphalloc.device.executor import Executor, lanes_of, states_of
from graphalloc.kernels.stage import BLOCK_ROWS, stage_rows, stage_rows_torch

SCRATCH = ("req_to_token_buf", "full_free_buf", "swa_free_buf", "ring_pages_buf",
           "out_full_buf", "out_swa_buf")  # the twins' padded lanes write their last entry


class Bucketed(Executor):
    """Launches each step over its graph row bucket (ratio 2, long rows chunked), staged or
    not: what a StepGraph replay runs, on any device."""

    name = "bucketed"

    def __init__(self, staged: bool):
        super().__init__()
        self.staged = staged
        self.policy = None
        self.n_staged = 0

    def execute(self, planned) -> None:
        parts, i = self.parts, planned.buffer_index
        if self.policy is None:
            self.policy = GridPolicy(parts.config, growth=2, long_programs=5)
        grid = self.policy.bucket(planned.n_release_rows, planned.n_alloc_rows,
                                  planned.n_tokens)
        if grid.n_programs == 0:
            if planned.state_counts:
                parts.kernels.launch_states(parts.ring.state_rows(i), planned.state_counts)
            return
        parts.kernels(parts.ring.release_rows(i), parts.ring.alloc_rows(i),
                      fusable=planned.fusable, grid=grid, lane_rows=lanes_of(parts, i),
                      state_rows=states_of(parts, i), staged=self.staged)
        self.n_staged += self.staged
        self.count(planned.fusable and parts.kernels.fused)


def build(backend: str, staged: bool, device: str):
    cfg = ga.AllocatorConfig(page_size=2, num_full_pages=40, num_swa_pages=24, max_reqs=5,
                             max_context_len=24, sliding_window=3, max_handles=3,
                             num_state_slots=6, backend=backend, device=device)
    n = cfg.num_state_slots + 1
    states = [torch.zeros(n, 2, device=device),
              (torch.zeros(3, n, dtype=torch.int64, device=device), 1)]
    alloc = ga.HybridAllocator(cfg, executor=Bucketed(staged), page_tables=ga.PageTableSpec(
        max_batch=6), state_tensors=states)
    alloc.kernels.stage_anywhere = True
    return alloc, states


def state_of(alloc, states) -> dict:
    out = {k: v.clone() for k, v in vars(alloc.state).items() if isinstance(v, torch.Tensor)}
    for k in SCRATCH:
        out[k] = out[k][:-1]
    out.update({f"table_{k}": v.clone() for k, v in alloc.tables.outputs().items()})
    out["bt_ranges"] = alloc.tables.bt_range_buf.clone()
    out["state0"], out["state1"] = states[0].clone(), states[1][0].clone()
    return out


@pytest.mark.parametrize("backend,n_ops", [("torch", 300), ("triton", 60)])
def test_staged_steps_equal_unstaged_ones(backend, n_ops, device):
    (plain, s_plain) = build(backend, False, device)
    (staged, s_staged) = build(backend, True, device)
    rng = np.random.default_rng(34)
    kinds: dict = {}
    for op in range(n_ops):
        kind = random_step([plain, staged], rng)
        kinds[kind] = kinds.get(kind, 0) + 1
        a, b = state_of(plain, s_plain), state_of(staged, s_staged)
        for name in a:
            assert torch.equal(a[name], b[name]), (op, kind, name)
    for alloc in (plain, staged):
        alloc.check()  # the stamps counted every submitted step (the staged stamp too)
    assert staged.executor.n_staged > n_ops // 3 and kinds.get("step", 0) > 5, kinds
    assert plain.steps_run == staged.steps_run


@pytest.mark.parametrize("fn", [stage_rows, stage_rows_torch])
def test_stage_copies_exactly_its_sections(fn, device):
    pin = device == "cuda"
    src = torch.arange(100 * 8, dtype=torch.int64).reshape(100, 8)
    src = src.pin_memory() if pin else src
    dst = torch.full((100, 8), -1, dtype=torch.int64, device=device)
    s_src = torch.tensor([77]).pin_memory() if pin else torch.tensor([77])
    s_dst = torch.tensor([-1], device=device)
    sections = ((0, 3), (10, 2 * BLOCK_ROWS + 1), (50, 0), (90, 10))
    fn(src, dst, sections, s_src, s_dst)
    want = torch.full((100, 8), -1, dtype=torch.int64)
    for a, n in sections:
        want[a:a + n] = src[a:a + n]
    assert torch.equal(dst.cpu(), want) and s_dst.item() == 77
    fn(src, dst, ((5, 1),))  # no stamp given: none copied
    assert torch.equal(dst[5].cpu(), src[5]) and s_dst.item() == 77
    with pytest.raises(ga.TensorSpecError):
        fn(src, dst, ((95, 10),))
