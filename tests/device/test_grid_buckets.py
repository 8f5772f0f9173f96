"""Launch grids that follow the step (graphalloc.device.buckets): row buckets, exact eager grids
and long rows shared by several programs, against the full grid.

A step's rows are packed at the front of each descriptor table and the rest are padding,
so a launch over any prefix that covers the real rows -- and any number of programs per
row -- must leave exactly the state of the full-grid launch. These tests run the same
random workload on allocators that differ only in the grid their steps launch (full,
exact, graph buckets of ratio 2, forced chunks), on the Triton interpreter and on the
Torch twins, and compare every device tensor after every operation.
"""

from __future__ import annotations

import inspect
import json

import numpy as np
import pytest
import torch
from workload import apply_all, random_step

import graphalloc as ga
from graphalloc.device.buckets import LONG_EXTRA_TOKENS, GridPolicy, StepGrid, ladder
from graphalloc.device.executor import Executor
from graphalloc.errors import ConfigError, TensorSpecError
from graphalloc.kernels import allocate_tokens, release_pages

# Tables whose last entry (row) is scratch the Torch twins' padded lanes write to.
SCRATCH = ("req_to_token_buf", "full_free_buf", "swa_free_buf", "ring_pages_buf",
           "out_full_buf", "out_swa_buf")


class GridExecutor(Executor):
    """Launches every step eagerly on the grid ``choose(alloc, planned)`` returns (None: the
    full grid): what a graph of that bucket would replay, on any device."""

    name = "grid-test"

    def __init__(self, choose):
        super().__init__()
        self.choose = choose
        self.grids: list = []

    def execute(self, planned) -> None:
        parts, i = self.parts, planned.buffer_index
        grid = self.choose(parts, planned)
        self.grids.append(grid)
        if grid is None or grid.n_programs:
            parts.kernels(parts.ring.release_rows(i), parts.ring.alloc_rows(i),
                          fusable=planned.fusable, grid=grid)
        self.count(planned.fusable and parts.kernels.fused)


def full_grid(alloc, planned):
    return None


def buckets_of(growth: int, long_programs: int = 6):
    policies: dict = {}

    def choose(alloc, planned):
        policy = policies.setdefault(id(alloc), GridPolicy(alloc.config, growth=growth,
                                                           long_programs=long_programs))
        return policy.bucket(planned.n_release_rows, planned.n_alloc_rows, planned.n_tokens)
    return choose


def chunked(rel_chunks: int, al_chunks: int):
    def choose(alloc, planned):
        return StepGrid(planned.n_release_rows, rel_chunks, planned.n_alloc_rows, al_chunks)
    return choose


def device_tensors(alloc) -> dict:
    return {k: v for k, v in vars(alloc.state).items() if isinstance(v, torch.Tensor)}


def assert_same_state(ref, other, what: str) -> None:
    """Every device tensor equal, scratch entries left out (the twins write padded lanes
    there)."""
    a, b = device_tensors(ref), device_tensors(other)
    for name in a:
        ta, tb = a[name].cpu(), b[name].cpu()
        if name in SCRATCH:
            ta, tb = ta[:-1], tb[:-1]
        torch.testing.assert_close(ta, tb, rtol=0, atol=0,
                                   msg=lambda m, name=name: f"{what}: {name} differs\n{m}")


def small_config(backend, *, ring=False, ps=3, **overrides):
    cfg = dict(page_size=ps, num_full_pages=120, num_swa_pages=60 if not ring else 80,
               max_reqs=4, max_context_len=200, sliding_window=2 * ps + 1, device="cpu",
               backend=backend, swa_ring_pages=4 if ring else 0, max_release_rows=12,
               max_alloc_rows=4, max_step_pages=200, max_step_tokens=210, max_pages_per_row=8)
    cfg.update(overrides)
    return ga.AllocatorConfig(**cfg)


# ---- 1. few rows == full grid -------------------------------------------------------------
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("ring", [False, True], ids=["pool", "ring"])
def test_steps_on_their_rows_equal_the_full_grid(backend, ring):
    """The same random steps on the full grid, on exactly their rows (the eager executor),
    on graph buckets of ratio 2 (long rows chunked) and with forced chunks: every device
    tensor equal after every operation, on both backends."""
    cfg = small_config(backend, ring=ring)
    executors = {"full": GridExecutor(full_grid), "exact": "eager",
                 "buckets": GridExecutor(buckets_of(2)),
                 "chunks": GridExecutor(chunked(2, 3))}
    allocs = {name: ga.HybridAllocator(cfg, executor=ex, fused_step=True)
              for name, ex in executors.items()}
    ref = allocs["full"]
    rng = np.random.default_rng(31 + ring)
    group = list(allocs.values())
    # Ring mode: one step extends at most the ring's pages (no long row there).
    n_long = 150 if not ring else cfg.swa_ring_pages * cfg.page_size
    for i in range(12 if backend == "triton" else 40):
        if i % 7 == 3:  # a long prefill (more than two token blocks beyond one per row)
            kind = "release all, admit, long extend"
            live = np.flatnonzero(ref.ledger.live)
            apply_all(group, lambda a, live=live: a.release(live))
            row = apply_all(group, lambda a: a.admit())
            apply_all(group, lambda a, row=row: a.alloc_extend([row], [n_long]))
        else:
            kind = random_step(group, rng)
        for name, alloc in allocs.items():
            assert_same_state(ref, alloc, f"op {i} ({kind}), {name} vs full grid")
    grids = [g for g in allocs["buckets"].executor.grids if g is not None]
    # The workload reached more than one bucket, and some steps left rows unlaunched.
    assert len({(g.n_release_rows, g.n_alloc_rows) for g in grids}) >= 3
    assert any(g.n_release_rows < cfg.max_release_rows for g in grids)
    assert ring or any(g.n_alloc_chunks > 1 for g in grids), "no long row was chunked"
    for alloc in allocs.values():
        alloc.check()
        alloc.check_integrity()


def test_eager_launches_only_the_step_rows():
    """The eager executor launches programs for the step's rows: a one-segment free is one
    release program and no allocation program; a step with no rows launches nothing."""
    cfg = small_config("torch")
    alloc = ga.HybridAllocator(cfg, fused_step=True)
    calls: list = []
    kernels = alloc.kernels
    for attr in ("_release", "_allocate", "_step"):
        inner = getattr(kernels, attr)

        def spy(*args, _inner=inner, _attr=attr, **kw):
            calls.append((_attr, {k: v for k, v in kw.items() if k.startswith("n_")
                                  and k not in ("n_lanes", "n_full_cap", "n_swa_cap",
                                                "n_release_lanes", "n_alloc_lanes")}))
            return _inner(*args, **kw)
        setattr(kernels, attr, spy)
    rows = [alloc.admit() for _ in range(3)]
    alloc.alloc_extend(rows, [6 * cfg.page_size] * 3)
    calls.clear()
    p = alloc.plan(advance=([rows[1]], [2 * cfg.page_size]))  # one SWA segment of 2 pages
    assert (p.n_release_rows, p.n_alloc_rows, p.fusable) == (1, 0, True)
    alloc.run(p)
    assert calls == [("_step", dict(n_release_rows=1, n_alloc_rows=0, n_release_chunks=1,
                                    n_alloc_chunks=1))]
    alloc.evict_window([rows[0]])
    calls.clear()
    runs = alloc.steps_run
    alloc.evict_window([rows[0]])  # evicted already: a step with no rows
    assert alloc.steps_run == runs + 1 and calls == []
    calls.clear()
    alloc.step(decode=rows[:2])
    assert calls == [("_step", dict(n_release_rows=0, n_alloc_rows=2, n_release_chunks=1,
                                    n_alloc_chunks=1))]


# ---- 2. long rows split over programs -----------------------------------------------------
def long_config(backend, *, ring=False, handles=0):
    ps = 4
    return ga.AllocatorConfig(
        page_size=ps, num_full_pages=260, num_swa_pages=200 if not ring else 260, max_reqs=3,
        max_context_len=600, sliding_window=3 * ps - 1, device="cpu", backend=backend,
        swa_ring_pages=80 if ring else 0,  # a ring as long as one step's longest extend
        max_release_rows=12, max_alloc_rows=4, max_step_pages=400, max_step_tokens=640,
        max_handles=handles)


def long_workload(alloc, ring: bool, handles: bool) -> list:
    """Prefills of 300 and 130 tokens (5 and 3 token blocks), decode, window eviction, a
    second long extend, a long release (FULL-only rows of up to 150 pages, 5 page blocks),
    a load-back of 40 pages (pool), a prefix copy of 256 tokens (handles). Returns the
    slots of every allocating step (host copies)."""
    slots = []

    def keep(out):
        if out is not None:
            slots.append((out.full_slots.clone(), out.swa_slots.clone()))
    a, b = alloc.admit(), alloc.admit()
    keep(alloc.alloc_extend([a, b], [300, 130]))
    keep(alloc.step(decode=[a, b]))
    keep(alloc.step(evict_all=True, decode=[a, b]))
    keep(alloc.alloc_extend([b, a], [200, 7]))
    if not ring:
        alloc.load_back(a, alloc.frontier(a) - 160)
    if handles:
        h = alloc.take_handle(b, 256)
        alloc.release([b])
        c = alloc.admit(handle=h)
        keep(alloc.alloc_extend([c], [70]))
    alloc.release([a])
    keep(alloc.step(evict_all=True, decode=np.flatnonzero(alloc.ledger.live)))
    return slots


@pytest.mark.parametrize("ring,handles", [(False, False), (True, False), (False, True)],
                         ids=["pool", "ring", "shared"])
def test_long_rows_shared_by_programs_give_identical_slots(ring, handles):
    """Long extend, copy, load-back and release rows run by 2, 3 or 8 programs per row
    (Triton interpreter) give the same slots and state as one program per row and as the
    Torch twin."""
    ref = ga.HybridAllocator(long_config("torch", ring=ring, handles=2 * handles))
    ref_slots = long_workload(ref, ring, handles)
    for rel_chunks, al_chunks in ((1, 1), (2, 3), (3, 2), (8, 8)):
        alloc = ga.HybridAllocator(long_config("triton", ring=ring, handles=2 * handles),
                                   executor=GridExecutor(chunked(rel_chunks, al_chunks)))
        slots = long_workload(alloc, ring, handles)
        what = f"{rel_chunks}/{al_chunks} programs per release/allocation row"
        assert len(slots) == len(ref_slots)
        for (f, s), (rf, rs) in zip(slots, ref_slots, strict=True):
            torch.testing.assert_close(f, rf, rtol=0, atol=0, msg=f"{what}: full slots")
            torch.testing.assert_close(s, rs, rtol=0, atol=0, msg=f"{what}: swa slots")
        assert_same_state(ref, alloc, what)
        alloc.check()
        alloc.check_integrity()


def test_chunked_launch_records_faults_in_lane_order():
    """A row whose pops hit the sink marker in two token blocks: two programs per row and
    one record the same error word (the first fault is the row's first faulting lane)."""
    ps = 2
    words = []
    for chunks in (1, 2, 3):
        r2t = torch.zeros(2, 400, dtype=torch.int64)
        f2s = torch.zeros(201 * ps, dtype=torch.int64)
        full_free = torch.arange(1, 202, dtype=torch.int64)
        swa_free = torch.arange(1, 202, dtype=torch.int64)
        # Sink markers at pages 40 (tokens 80-81, block 1) and 70 (tokens 140-141, block 2);
        # two programs split the 3 blocks as [0, 1] and [2]: block 1's fault comes first.
        full_free[40] = 0
        full_free[70] = 0
        ring = torch.zeros(2, 1, dtype=torch.int64)
        out_f = torch.zeros(201, dtype=torch.int64)
        out_s = torch.zeros(201, dtype=torch.int64)
        err = torch.zeros(8, dtype=torch.int64)
        rows = torch.zeros(2, 8, dtype=torch.int64)
        rows[0, 2] = 180  # AL_N_TOKENS: 3 blocks of 64 lanes
        rows[0, 7] = 90  # AL_N_PAGES
        allocate_tokens(rows, r2t, f2s, full_free, swa_free, ring, out_f, out_s, err,
                        page_size=ps, n_full_cap=200, n_swa_cap=200, n_lanes=200, n_rows=1,
                        n_chunks=chunks)
        words.append(err.clone())
    assert int(words[0][1]) == 2 * ps  # ERR_COUNT: both pages' lanes
    assert int(words[0][6]) == 0  # ERR_PAGE: the popped value, the sink marker
    for word in words[1:]:
        torch.testing.assert_close(word, words[0], rtol=0, atol=0)


def test_launchers_refuse_bad_grids():
    rows = torch.zeros(4, 8, dtype=torch.int64)
    t = torch.zeros(8, dtype=torch.int64)
    r2t = torch.zeros(2, 8, dtype=torch.int64)
    kw = dict(page_size=2, n_full_cap=3, n_swa_cap=3, n_lanes=4)
    for bad in (dict(n_rows=5), dict(n_rows=-1), dict(n_rows=True), dict(n_chunks=0),
                dict(n_chunks=1.5)):
        with pytest.raises(TensorSpecError):
            release_pages(rows, r2t, t, t, t, r2t, t, **kw, **bad)
        with pytest.raises(TensorSpecError):
            allocate_tokens(rows, r2t, t, t, t, r2t, t, t, t, **kw, **bad)


# ---- 3. bucket choice -------------------------------------------------------------------------
def test_ladders():
    assert ladder(768, 4) == (0, 1, 4, 16, 64, 256, 768)
    assert ladder(256, 4) == (0, 1, 4, 16, 64, 256)
    assert ladder(5, 2) == (0, 1, 2, 4, 5)
    assert ladder(1, 4) == (0, 1)
    for bad in (1, 0, True, 2.0):
        with pytest.raises(ConfigError):
            GridPolicy(small_config("torch"), growth=bad)
    with pytest.raises(ConfigError):
        GridPolicy(small_config("torch"), long_programs=-1)


@pytest.mark.parametrize("growth", [2, 3, 4])
def test_bucket_is_the_smallest_covering_shape(growth):
    """For every row count: the bucket covers it, is a ladder size, and the next smaller
    size would not cover it (edges: the sizes themselves and one past each); every bucket
    returned, long or short, is one of the captured shapes."""
    cfg = small_config("torch", max_release_rows=37, max_alloc_rows=10)
    policy = GridPolicy(cfg, growth=growth, long_programs=8)
    shapes = set(policy.shapes())
    assert StepGrid(0, 1, 0, 1) not in shapes and policy.full() in shapes
    for table, sizes, top in (("release", policy.release_sizes, 37),
                              ("alloc", policy.alloc_sizes, 10)):
        assert sizes == ladder(top, growth)
        for n in range(top + 1):
            grid = policy.bucket(n, 0) if table == "release" else policy.bucket(0, n)
            got = grid.n_release_rows if table == "release" else grid.n_alloc_rows
            k = sizes.index(got)
            assert got >= n and (k == 0 or sizes[k - 1] < n), (table, n, got)
    for n_rel in range(38):
        for n_al in range(11):
            for n_tokens in (n_al, n_al + LONG_EXTRA_TOKENS - 1, n_al + LONG_EXTRA_TOKENS):
                grid = policy.bucket(n_rel, n_al, n_tokens)
                assert grid.covers(n_rel, n_al)
                assert grid in shapes or grid.n_programs == 0
                long = n_tokens >= n_al + LONG_EXTRA_TOKENS
                assert grid.n_alloc_chunks == (policy.long_chunks(grid.n_alloc_rows) if long
                                               else 1)
                exact = policy.exact(n_rel, n_al, n_tokens)
                assert (exact.n_release_rows, exact.n_alloc_rows) == (n_rel, n_al)


def test_long_chunks_and_the_long_edge():
    cfg = small_config("torch", max_tokens_per_alloc_row=600, max_context_len=600,
                       max_step_tokens=700, max_pages_per_row=200)
    policy = GridPolicy(cfg, growth=4, long_programs=32)
    assert policy.max_alloc_chunks == 10  # ceil(600 / 64)
    assert [policy.long_chunks(n) for n in (1, 4, 16, 64)] == [10, 8, 2, 1]
    assert policy.bucket(0, 1, 1 + LONG_EXTRA_TOKENS - 1).n_alloc_chunks == 1
    assert policy.bucket(0, 1, 1 + LONG_EXTRA_TOKENS) == StepGrid(0, 1, 1, 10)
    assert policy.bucket(0, 3, 3 + LONG_EXTRA_TOKENS) == StepGrid(0, 1, 4, 8)
    assert GridPolicy(cfg, long_programs=0).bucket(0, 1, 500).n_alloc_chunks == 1
    full = GridPolicy(cfg, growth=None)
    assert full.release_sizes == (0, cfg.max_release_rows)
    assert full.bucket(1, 1) == StepGrid(cfg.max_release_rows, 1, cfg.max_alloc_rows, 1)


def test_stepgraph_picks_the_bucket_of_each_step():
    """A graph executor (eager on a CPU, its policy the same) maps steps of 4 and 5 segment
    rows to the release buckets 4 and 16, and decode rows likewise."""
    ps = 2
    cfg = ga.AllocatorConfig(page_size=ps, num_full_pages=200, num_swa_pages=200,
                             max_reqs=20, max_context_len=20 * ps, sliding_window=ps - 1,
                             device="cpu", backend="torch", max_release_rows=60,
                             max_alloc_rows=20, max_step_tokens=400)
    alloc = ga.HybridAllocator(cfg, executor="graph")
    sg = alloc.executor
    assert sg.policy.release_sizes == (0, 1, 4, 16, 60)
    rows = np.array([alloc.admit() for _ in range(17)])
    alloc.alloc_extend(rows, [10 * ps] * 17)
    for k, want_rel, want_al in ((4, 4, 4), (5, 16, 16), (16, 16, 16), (17, 60, 20)):
        sel = rows[:k]
        p = alloc.plan(advance=(sel, alloc.frontiers()[sel] + ps), decode=sel)
        assert (p.n_release_rows, p.n_alloc_rows) == (k, k)
        assert sg.grid_for(p) == StepGrid(want_rel, 1, want_al, 1)
        assert p.fits_rows(want_rel, want_al) and not p.fits_rows(k - 1, k)
        alloc.run(p)
    alloc.check_integrity()
    full = ga.HybridAllocator(cfg, executor=ga.StepGraph(buckets=False))
    r = full.admit()
    p = full.plan(extend=([r], [3]))
    assert full.executor.grid_for(p) == StepGrid(60, 1, 20, 1)
    full.run(p)


@pytest.mark.parametrize("buckets", [True, False])
def test_stepgraph_lookup_table_replays_the_policy_bucket(buckets):
    """The replay StepGraph's hot path finds by list indexing is the graph captured for
    GridPolicy.bucket of the step (None for a step with no rows), for every row count and
    both forms; with buckets=False always the full grid."""
    cfg = small_config("torch", max_release_rows=37, max_alloc_rows=10)
    sg = ga.HybridAllocator(cfg, executor=ga.StepGraph(buckets=buckets)).executor
    pol = sg.policy
    shapes = pol.shapes() if buckets else [pol.full()]
    sg._index([({g: ("two", b, g) for g in shapes}, {g: ("fused", b, g) for g in shapes})
               for b in range(2)])
    for n_rel in range(38):
        for n_al in range(11):
            for n_tokens in (n_al, n_al + LONG_EXTRA_TOKENS):
                want = pol.bucket(n_rel, n_al, n_tokens) if buckets else pol.full()
                for b in range(2):
                    for fused, form in ((False, "two"), (True, "fused")):
                        got = sg._lookup(b, fused, n_rel, n_al, n_tokens)
                        assert got == (None if want.n_programs == 0 else (form, b, want)), (
                            n_rel, n_al, n_tokens, got, want)


# ---- 4. engines' own graphs: launch(n_rows=) -------------------------------------------------
_LAUNCH_TAKES_N_ROWS = "n_rows" in inspect.signature(ga.HybridAllocator.launch).parameters


@pytest.mark.skipif(not _LAUNCH_TAKES_N_ROWS, reason="HybridAllocator.launch(n_rows=) not in "
                    "this tree")
def test_launch_sized_to_a_bucket():
    """launch(i, n_rows=(R, A)) outside a capture runs the pending step on R + A rows (same
    state as the full grid) and refuses a step with more rows, before anything runs."""
    cfg = small_config("torch")
    ref, alloc = ga.HybridAllocator(cfg), ga.HybridAllocator(cfg)
    for a in (ref, alloc):
        rows = [a.admit() for _ in range(3)]
        a.alloc_extend(rows, [5 * cfg.page_size] * 3)
    p_ref = ref.plan(decode=rows)
    ref.run(p_ref)
    p = alloc.plan(decode=rows)
    with pytest.raises(ga.BatchTooLargeError):
        alloc.launch(p.buffer_index, n_rows=(0, 2))
    with pytest.raises(ga.ContractError):
        alloc.launch(p.buffer_index, n_rows=(0, cfg.max_alloc_rows + 1))
    with pytest.raises(ga.ContractError):
        alloc.launch(p.buffer_index, n_rows=3)
    alloc.launch(p.buffer_index, n_rows=(0, 4))
    alloc.mark_submitted(p)
    assert_same_state(ref, alloc, "launch(n_rows=(0, 4))")


# ---- 5. the benchmark's CPU mode ---------------------------------------------------------------
def test_bench_grid_quick_runs(tmp_path):
    """benchmarks/bench_grid.py --quick end to end (CPU: eager twins, no CUDA graph): both
    output files, every case measured for every variant it has."""
    import importlib.util
    import os

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.path.join(root, "benchmarks", "bench_grid.py")
    spec = importlib.util.spec_from_file_location("bench_grid", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--quick", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "bench_grid.json").read_text())
    assert data["device_clock"] == ("cuda-events" if torch.cuda.is_available() else "cpu-wall")
    cases = {"one_segment_free", "decode_evict", "prefill"}
    assert {c["case"] for c in data["cases"]} == cases == set(data["host"])
    for case in data["cases"]:
        assert {"full_two", "full_fused", "bucket_two", "bucket_fused"} <= set(case["variants"])
        for v in case["variants"].values():
            assert v["window"]["per_step_us"]["n"] > 0 and v["isolated_us"]["n"] > 0
        assert case["verify"]["integrity_ok"] and case["verify"]["shape_drift"] == 0, case
        assert case["bucket"][0] < case["full_grid"][0] or case["bucket"][2] < case[
            "full_grid"][2]
    for host in data["host"].values():
        for r in host.values():
            assert r["pipelined"]["n"] > 0 and r["cold"]["n"] > 0 and r["verify"]["integrity_ok"]
    assert data["run_parts_us"] and not data["errors"]
    assert (tmp_path / "bench_grid.md").read_text().startswith("# ")


def test_random_ops_agree_between_the_graph_executor_and_eager_on_cpu():
    """StepGraph on a CPU (exact grids) equals the eager executor over a random workload
    with shared pages (copy rows) and frees in groups."""
    cfg = small_config("torch", max_handles=3)
    allocs = [ga.HybridAllocator(cfg), ga.HybridAllocator(cfg, executor="graph")]
    rng = np.random.default_rng(8)
    for i in range(120):
        kind = random_step(allocs, rng)
        assert_same_state(allocs[0], allocs[1], f"op {i} ({kind})")
    apply_all(allocs, lambda a: a.check_integrity())


# ---- CUDA ---------------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.parametrize("ring", [False, True], ids=["pool", "ring"])
def test_bucket_graphs_match_the_full_grid_on_cuda(ring):
    """Random steps with long prefills replayed from bucket graphs (StepGraph default),
    from full-grid graphs (buckets=False) and launched eagerly over exact grids (Torch
    twins): every table equal after every step, no host sync in the loop; steps with no
    rows replay nothing."""
    cfg = small_config("triton", ring=ring, device="cuda")
    bucketed = ga.HybridAllocator(cfg, executor="graph")
    full = ga.HybridAllocator(cfg, executor=ga.StepGraph(buckets=False))
    eager = ga.HybridAllocator(small_config("torch", ring=ring, device="cuda"))
    allocs = [bucketed, full, eager]
    assert bucketed.executor.n_graphs > full.executor.n_graphs == 2 * len(bucketed.ring)
    rng = np.random.default_rng(41 + ring)
    n_long = 150 if not ring else cfg.swa_ring_pages * cfg.page_size
    mismatches = torch.zeros((), dtype=torch.int64, device="cuda")
    old = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i in range(1500):
            if i % 25 == 3:
                live = np.flatnonzero(bucketed.ledger.live)
                apply_all(allocs, lambda a, live=live: a.release(live))
                row = apply_all(allocs, lambda a: a.admit())
                apply_all(allocs, lambda a, row=row: a.alloc_extend([row], [n_long]))
            else:
                random_step(allocs, rng)
            for other in (full, eager):
                for name, t in bucketed.state.tables().items():
                    mismatches += (other.state.tables()[name] != t).sum()
    finally:
        torch.cuda.set_sync_debug_mode(old)
    assert int(mismatches) == 0
    sg = bucketed.executor
    assert sg.replays + sg.empty_steps == bucketed.steps_run
    assert full.executor.replays == full.steps_run
    for alloc in allocs:
        alloc.check()
        alloc.check_integrity()
