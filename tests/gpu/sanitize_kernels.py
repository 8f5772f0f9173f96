"""Run every kernel on every kind of row, for compute-sanitizer (memcheck, racecheck).

    compute-sanitizer --tool memcheck python tests/gpu/sanitize_kernels.py
    compute-sanitizer --tool racecheck python tests/gpu/sanitize_kernels.py

Row kinds exercised: window eviction (SWA+clear), finish above the frontier
(SWA+FULL+clear), finish below the frontier (FULL only), ring eviction (clear),
ring return, ring admission, extend (new pages + partial page), decode, padded
rows; recurrent-state table writes and state copies; prefix sharing (handle
copies, admits on handles, SWA-only and FULL-only drops); an unmapped peer (fault
path) and a sink-marker pop; the single-call op with and without validation; eager
launches and graph replays; the fused one-launch step and validate mode.
"""

from __future__ import annotations

import dataclasses
import sys

import numpy as np
import torch

sys.path.insert(0, "tests/lib")
from workload import random_step  # noqa: E402

import graphalloc as ga  # noqa: E402
from graphalloc.kernels import get_and_clear_swa_pages  # noqa: E402


def config(ring: bool, ps: int, dtype) -> ga.AllocatorConfig:
    return ga.AllocatorConfig(
        page_size=ps, num_full_pages=80, num_swa_pages=40 if not ring else 64, max_reqs=6,
        max_context_len=20 * ps, model_window=2 * ps + 2, index_dtype=dtype, device="cuda",
        backend="triton", swa_ring_pages=4 if ring else 0, max_release_rows=20,
        max_alloc_rows=8, max_step_pages=120, max_step_tokens=20 * ps + 8,
        max_handles=0 if ring else 4)  # pool mode: shared pages (handles, copies) too


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 60
    rng = np.random.default_rng(0)
    variants = [(ring, ps, dtype, False, False) for ring in (False, True)
                for ps, dtype in ((1, torch.int32), (16, torch.int64), (3, torch.int64))]
    variants += [(False, 16, torch.int64, True, False), (True, 4, torch.int32, True, True),
                 (False, 3, torch.int64, False, True)]  # (ring, ps, dtype, fused, validate)
    for ring, ps, dtype, fused, validate in variants:
        cfg = dataclasses.replace(config(ring, ps, dtype), validate=validate)
        for executor in ("eager", "graph"):  # launched eagerly, then replayed from graphs
            alloc = ga.HybridAllocator(cfg, fused_step=fused, executor=executor)
            for _ in range(steps // 2):
                random_step([alloc], rng)
            alloc.check()
            assert alloc.audit() == [], alloc.audit()
    # recurrent-state slots: table writes (slots set, speculative slots) and state copies
    # (snapshots taken and restored), eager and graph-replayed, two tensors (slot dims 0, 1)
    for executor in ("eager", "graph"):
        cfg = dataclasses.replace(config(False, 4, torch.int64), num_state_slots=24,
                                  num_lookahead_tokens=3, max_spec_tokens=None)
        ssm = torch.zeros(25, 3, 600, device="cuda")
        conv = torch.zeros(2, 25, 7, device="cuda")
        alloc = ga.HybridAllocator(cfg, executor=executor, state_tensors=[ssm, (conv, 1)])
        # two copies for certain, checked: a marker in a request's state is snapshotted,
        # then restored into a new request's slot; then the random steps
        r = alloc.admit()
        alloc.alloc_extend([r], [2 * alloc.config.page_size])
        src = int(alloc.req_to_state[r])
        ssm[src].fill_(7.0)
        conv[:, src].fill_(3.0)
        h = alloc.take_handle(r, 2 * alloc.config.page_size)
        row = alloc.admit(handle=h)
        for slot in (int(alloc.handle_to_state[h]), int(alloc.req_to_state[row])):
            assert slot not in (0, src) and bool((ssm[slot] == 7.0).all()), slot
            assert bool((conv[:, slot] == 3.0).all()), slot
        alloc.release([r, row])
        alloc.drop_handle(h)
        for _ in range(steps):
            random_step([alloc], rng)
        alloc.check()
        assert alloc.audit() == [], alloc.audit()
    # fault paths: unmapped peer pushed as sink marker, then popped
    alloc = ga.HybridAllocator(dataclasses.replace(config(False, 4, torch.int64),
                                                   num_swa_pages=8))
    a, b = alloc.admit(), alloc.admit()
    alloc.alloc_extend([a, b], [12, 8])
    page = int(alloc.req_to_token[a, 4]) // 4
    alloc.full_to_swa[page * 4] = 0
    alloc.release([a])
    for _ in range(60):
        try:
            alloc.alloc_decode([b])
        except ga.CapacityError:
            break
    codes = int(alloc.state.err_buf[0])
    assert codes & ga.FaultCode.UNMAPPED_PEER and codes & ga.FaultCode.SINK_POP, codes
    # single-call op, strided representatives, with and without validation
    for ps in (1, 16, 128):
        n_pages = 64
        f2s = torch.zeros((n_pages + 1) * ps, dtype=torch.int64, device="cuda")
        perm = torch.randperm(n_pages, device="cuda") + 1
        offs = torch.arange(ps, device="cuda")
        f2s.view(n_pages + 1, ps)[1:] = perm[:, None] * ps + offs
        reps = (torch.arange(1, n_pages + 1, device="cuda") * ps).repeat_interleave(3)[::3]
        get_and_clear_swa_pages(reps[: n_pages // 2], f2s, ps)
        get_and_clear_swa_pages(reps[n_pages // 2:], f2s, ps, validate=True)
    torch.cuda.synchronize()
    print("sanitize_kernels: all kernels ran on every row kind")


if __name__ == "__main__":
    main()
