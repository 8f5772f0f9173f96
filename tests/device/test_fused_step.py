"""The fused step (one launch for release + allocation) against the two-launch step.

A fused launch is only correct if, for the steps the planner marks fusable,
no allocation program depends on a release program. The Triton interpreter
runs programs in order, so on the CPU "fused == two launches" alone would
prove little; these tests also run every fusable step with its descriptor rows
executed one program at a time in a random order (allocation rows before
release rows included), which must give the same state. A non-fusable step
is detected by the planner, runs as two launches, and is shown to really
depend on the order (allocation first reads ring entries not yet pushed).
"""

import json

import numpy as np
import pytest
import torch
from workload import apply_all, random_step

import graphalloc as ga
from graphalloc.kernels import (
    allocate_tokens,
    release_pages,
    run_step_fused,
    run_step_fused_torch,
)
from graphalloc.kernels.abi import AL_N_PAGES, AL_N_TOKENS, REL_N_PAGES
from graphalloc.plan.context import PlanContext
from graphalloc.plan.reference import plan_step
from graphalloc.plan.step import Step, normalize
from graphalloc.state.ledger import Ledger


def make_config(backend, *, ring=False, validate=False, ps=3, device="cpu", **overrides):
    """Tight pools, so that some steps pop more pages than were free before them."""
    cfg = dict(page_size=ps, num_full_pages=8 if ring else 16, num_swa_pages=16 if ring else 10,
               max_reqs=4, max_context_len=10 * ps, sliding_window=2 * ps + 1,
               index_dtype=torch.int32 if ring else torch.int64, device=device,
               backend=backend, swa_ring_pages=4 if ring else 0, max_release_rows=12,
               max_alloc_rows=4, max_step_pages=60, max_step_tokens=10 * ps + 4,
               validate=validate)
    cfg.update(overrides)
    return ga.AllocatorConfig(**cfg)


def device_tensors(alloc) -> dict:
    """Every device tensor of the allocator: tables, outputs, error word, epoch stamps."""
    return {k: v for k, v in vars(alloc.state).items() if isinstance(v, torch.Tensor)}


# Tables whose last row / entry is scratch that the Torch twins' padded lanes write to.
SCRATCH = ("req_to_token_buf", "full_free_buf", "swa_free_buf", "ring_pages_buf",
           "out_full_buf", "out_swa_buf")


def assert_same_device_state(ref, other, what, *, scratch=True):
    """Every device tensor equal, element for element; ``scratch=False`` leaves out the
    scratch entries (when a Torch twin is one side)."""
    a, b = device_tensors(ref), device_tensors(other)
    for name in a:
        ta, tb = a[name].cpu(), b[name].cpu()
        if not scratch and name in SCRATCH:
            ta, tb = ta[:-1], tb[:-1]
        torch.testing.assert_close(ta, tb, rtol=0, atol=0,
                                   msg=lambda m, name=name: f"{what}: {name} differs\n{m}")


def random_op(allocs, rng) -> str:
    """One random operation on every allocator: mostly scheduler steps that release some
    requests and extend another by about as many pages as were free before the step (or a
    few more: those steps pop pages the step itself frees, and are not fusable), sometimes
    an admission or one of ``workload.random_step``'s operations."""
    a0 = allocs[0]
    led, cfg = a0.ledger, a0.config
    ps = cfg.page_size
    live = np.flatnonzero(led.live)
    roll = rng.random()
    if roll < 0.25:
        return random_step(allocs, rng)
    if len(live) == 0 or (len(live) < cfg.max_reqs and roll < 0.45):
        n = int(rng.integers(1, 4 * ps))
        row = apply_all(allocs, lambda a: a.admit())
        if row is not None:
            apply_all(allocs, lambda a: a.alloc_extend([row], [n]))
        return "admit+extend"
    finished = live[rng.random(len(live)) < 0.4]
    rest = np.setdiff1d(live, finished)
    evict = bool(rng.random() < 0.5)
    n = np.zeros(len(rest), dtype=np.int64)
    if len(rest):
        free = led.full.n_free if cfg.ring_mode else min(led.full.n_free, led.swa.n_free)
        n[rng.integers(len(rest))] = (free + rng.integers(0, 3)) * ps
        n = np.minimum(n, np.minimum(cfg.max_context_len - led.seq_len[rest],
                                     cfg.max_tokens_per_alloc_row))
    apply_all(allocs, lambda a: a.step(release=finished, evict=evict, extend=(rest, n)))
    return "release+extend"


def shuffled_programs(rng):
    """A step executor with the fused launcher's signature that runs each non-padded row as
    its own one-program launch, in a random order over both tables: any interleaving of
    release and allocation rows a GPU could produce at row granularity."""
    def run(release_rows, alloc_rows, *tables, page_size, n_full_cap, n_swa_cap,
            n_release_lanes, n_alloc_lanes, validate=False, epochs=None, stamp=None,
            seen=None, **grid):
        # grid (row counts, chunks): every non-padded row runs whatever the launch's grid;
        # every launch carries the step's stamp (the step counts once, as a fused launch)
        r2t, f2s, full_free, swa_free, ring, out_full, out_swa, err = tables
        common = dict(page_size=page_size, n_full_cap=n_full_cap, n_swa_cap=n_swa_cap,
                      validate=validate, stamp=stamp, seen=seen)
        rel = [i for i in range(len(release_rows)) if release_rows[i, REL_N_PAGES]]
        al = [i for i in range(len(alloc_rows))
              if alloc_rows[i, AL_N_TOKENS] or alloc_rows[i, AL_N_PAGES]]
        jobs = [("rel", i) for i in rel] + [("al", i) for i in al]
        for kind, i in (jobs[k] for k in rng.permutation(len(jobs))):
            if kind == "rel":
                release_pages(release_rows[i:i + 1], r2t, f2s, full_free, swa_free, ring, err,
                              n_lanes=n_release_lanes, epochs=epochs, **common)
            else:
                allocate_tokens(alloc_rows[i:i + 1], r2t, f2s, full_free, swa_free, ring,
                                out_full, out_swa, err, n_lanes=n_alloc_lanes, **common)
    return run


@pytest.mark.parametrize("ring,validate", [(False, False), (False, True), (True, False)],
                         ids=["pool", "pool-validate", "ring"])
def test_random_fusable_steps_fused_equal_two_launches(ring, validate, device):
    """Random continuous-batching steps on four allocators: Triton two launches (the
    reference), Triton fused, Torch fused (the twin) and Triton with the fusable steps'
    programs shuffled. Every device tensor equal after every step."""
    rng = np.random.default_rng(5 + 2 * ring)
    kw = dict(ring=ring, validate=validate, device=device)
    two = ga.HybridAllocator(make_config("triton", **kw), fused_step=False)
    fused = ga.HybridAllocator(make_config("triton", **kw), fused_step=True)
    twin = ga.HybridAllocator(make_config("torch", **kw), fused_step=True)
    shuffled = ga.HybridAllocator(make_config("triton", **kw), fused_step=True)
    shuffled.kernels._step = shuffled_programs(np.random.default_rng(99))
    allocs = [two, fused, twin, shuffled]
    for i in range(36):
        kind = random_op(allocs, rng)
        for other, name in ((fused, "fused"), (shuffled, "shuffled")):
            assert_same_device_state(two, other, f"op {i} ({kind}), {name}")
        assert_same_device_state(two, twin, f"op {i} ({kind}), torch fused", scratch=False)
    assert two.executor.n_fused == 0 and two.executor.n_two_launch == two.steps_run
    assert fused.executor.n_fused + fused.executor.n_two_launch == fused.steps_run
    assert fused.executor.n_fused >= 10, "too few fusable steps ran"
    assert fused.executor.n_two_launch >= 1, "no non-fusable step ran"
    print(f"{fused.executor.n_fused} fused, {fused.executor.n_two_launch} two-launch steps")
    assert shuffled.executor.n_fused == fused.executor.n_fused == twin.executor.n_fused
    for alloc in allocs:
        alloc.check()
        alloc.check_integrity()


def _tight_pair(device, backend="triton"):
    """Four FULL and four SWA pages, all owned by two interleaved requests."""
    ps = 2
    cfg = make_config(backend, ps=ps, device=device, num_full_pages=4, num_swa_pages=4,
                      max_reqs=2, max_context_len=6 * ps, max_step_pages=8,
                      max_step_tokens=6 * ps)
    allocs = [ga.HybridAllocator(cfg, fused_step=False), ga.HybridAllocator(cfg, fused_step=True)]
    for alloc in allocs:
        r1, r2 = alloc.admit(), alloc.admit()
        for r in (r1, r2, r1, r2):  # ring order of the pages: r1, r2, r1, r2
            alloc.alloc_extend([r], [ps])
    return allocs, (r1, r2), ps


def test_non_fusable_step_is_detected_and_runs_as_two_launches(device):
    """Release r1 (pushes its 2 pages) and give r2 two new pages in the same step: nothing
    was free before the step, so the pops read the positions the release pushes to."""
    allocs, (r1, r2), ps = _tight_pair(device)
    plans = [alloc.plan(release=[r1], extend=([r2], [2 * ps])) for alloc in allocs]
    assert [p.fusable for p in plans] == [False, False]
    assert allocs[1].ring.fusable[plans[1].buffer_index] is False
    # The hazard is real: allocation before release reads ring entries not pushed yet.
    two = allocs[0]
    i = plans[0].buffer_index
    tables = {k: v.clone() for k, v in device_tensors(two).items()}
    st = tables
    kw = dict(page_size=ps, n_full_cap=4, n_swa_cap=4)
    allocate_tokens(two.ring.alloc_rows(i), st["req_to_token_buf"], st["full_to_swa_buf"],
                    st["full_free_buf"], st["swa_free_buf"], st["ring_pages_buf"],
                    st["out_full_buf"], st["out_swa_buf"], st["err_buf"],
                    n_lanes=two.config.max_step_tokens, **kw)
    release_pages(two.ring.release_rows(i), st["req_to_token_buf"], st["full_to_swa_buf"],
                  st["full_free_buf"], st["swa_free_buf"], st["ring_pages_buf"], st["err_buf"],
                  n_lanes=two.config.max_step_pages, **kw)
    n_fused = allocs[1].executor.n_fused
    for alloc, plan in zip(allocs, plans, strict=True):
        alloc.run(plan)
    assert allocs[1].executor.n_fused == n_fused  # the fused allocator used two launches
    assert_same_device_state(*allocs, "non-fusable step")
    wrong = tables["out_full_buf"][:2 * ps]
    right = two.state.out_full_buf[:2 * ps]
    assert not torch.equal(wrong, right), "allocation-first should have read stale entries"
    for alloc in allocs:
        alloc.check()
        alloc.check_integrity()


def test_fusable_boundary_pops_equal_to_free_before():
    """Pops that exactly use up what was free before the step are still fusable; one more
    page is not. Checked on the planner alone (pure host, every plan rolled back)."""
    cfg = make_config("torch", ps=2, num_full_pages=6, num_swa_pages=6, max_reqs=3)
    ledger = Ledger(cfg)
    plan_step(PlanContext(cfg, ledger, 1), normalize(Step(admit=[0, 1]), cfg))
    plan_step(PlanContext(cfg, ledger, 2), normalize(Step(extend=([0, 1], [4, 4])), cfg))
    ledger.journal.commit()  # 4 of the 6 pages of each pool
    for extra_tokens, fusable in ((4, True), (5, False)):
        ctx = PlanContext(cfg, ledger, 7)
        out = plan_step(ctx, normalize(Step(release=[0], extend=([1], [extra_tokens])), cfg))
        assert ctx.n_free_before == (2, 2)  # 2 pages fit, 3 do not
        assert out.fusable is fusable
        assert (out.release_rows[:, 7] == 7).all()  # REL_EPOCH
        ledger.journal.rollback()


def test_padded_and_empty_descriptors(device):
    """All-padding rows change nothing; zero rows launch nothing (both backends)."""
    alloc = ga.HybridAllocator(make_config("triton", device=device))
    st = alloc.state
    r = alloc.admit()
    alloc.alloc_extend([r], [5])
    before = {k: v.clone() for k, v in device_tensors(alloc).items()}
    cfg = alloc.config
    for fn in (run_step_fused, run_step_fused_torch):
        for n_rel, n_al in ((cfg.max_release_rows, cfg.max_alloc_rows), (0, 0)):
            fn(torch.zeros((n_rel, 8), dtype=torch.int64, device=device),
               torch.zeros((n_al, 8), dtype=torch.int64, device=device), st.req_to_token_buf,
               st.full_to_swa_buf, st.full_free_buf, st.swa_free_buf, st.ring_pages_buf,
               st.out_full_buf, st.out_swa_buf, st.err_buf, page_size=cfg.page_size,
               n_full_cap=cfg.num_full_pages, n_swa_cap=cfg.num_swa_pages,
               n_release_lanes=cfg.max_step_pages, n_alloc_lanes=cfg.max_step_tokens)
    for name, t in device_tensors(alloc).items():
        if name in SCRATCH:
            t, b = t[:-1], before[name][:-1]  # the twins' scratch entries
        else:
            b = before[name]
        torch.testing.assert_close(t.cpu(), b.cpu(), rtol=0, atol=0, msg=name)


def test_stepgraph_picks_the_variant_per_step_on_cpu():
    """Without a GPU a StepGraph runs steps eagerly; the fused launch is used exactly for
    the steps planned fusable."""
    alloc = ga.HybridAllocator(make_config("torch"), fused_step=True, executor="graph")
    step_graph = alloc.executor
    rng = np.random.default_rng(3)
    fusable = []
    execute = step_graph.execute

    def record(planned):  # the plan's own flag, for every step the executor runs
        fusable.append(planned.fusable)
        execute(planned)
    step_graph.execute = record
    for _ in range(60):
        random_op([alloc], rng)
    assert alloc.executor.n_fused == sum(fusable) > 0
    assert alloc.executor.n_two_launch == len(fusable) - sum(fusable) > 0
    assert step_graph.replays == 0 and step_graph.fused_graphs == []


def test_bench_fused_quick_runs(tmp_path):
    """benchmarks/bench_fused.py --quick end to end (the Torch twins on a CPU, CUDA graphs
    on a GPU): both output files, every step fusable."""
    import importlib.util
    import os

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.path.join(root, "benchmarks", "bench_fused.py")
    spec = importlib.util.spec_from_file_location("bench_fused", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--quick", "--b", "1,4", "--pages", "2", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "bench_fused.json").read_text())
    assert data["device_clock"] == ("cuda-events" if torch.cuda.is_available() else "cpu-wall")
    assert data["cases"] and all(c["all_fusable"] for c in data["cases"])
    assert {"two", "fused"} <= set(data["cases"][0]["gpu_us"])
    assert (tmp_path / "bench_fused.md").read_text().startswith("# ")


# ---- CUDA -----------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.parametrize("ring", [False, True])
def test_stepgraph_fused_replays_match_eager(ring):
    """A StepGraph over a fused allocator: two graphs per buffer (3 and 2 kernel nodes: the
    rows staged, then release and allocation, or the fused step);
    random steps replayed (fused where allowed) equal eager two-launch Torch every step."""
    graphed = ga.HybridAllocator(make_config("triton", ring=ring, device="cuda",
                                             num_full_pages=60, num_swa_pages=40,
                                             max_reqs=6, max_release_rows=24,
                                             max_alloc_rows=8), fused_step=True,
                                 executor="graph")
    eager = ga.HybridAllocator(make_config("torch", ring=ring, device="cuda",
                                           num_full_pages=60, num_swa_pages=40,
                                           max_reqs=6, max_release_rows=24, max_alloc_rows=8))
    step_graph = graphed.executor
    assert len(step_graph.fused_graphs) == len(step_graph.graphs) == len(graphed.ring)
    try:
        assert step_graph.describe()["kernel"] == 3
        assert step_graph.describe(fused=True)["kernel"] == 2
    except ImportError:
        pass  # cuda-python missing: node counts are informative only
    rng = np.random.default_rng(17 + ring)
    mismatches = torch.zeros((), dtype=torch.int64, device="cuda")
    for _ in range(2000):
        random_step([graphed, eager], rng)
        for name, t in eager.state.tables().items():
            mismatches += (graphed.state.tables()[name] != t).sum()
    assert int(mismatches) == 0
    assert 0 < step_graph.fused_replays <= step_graph.replays
    assert step_graph.replays + step_graph.empty_steps == graphed.steps_run  # no-row steps
    graphed.check()
    graphed.check_integrity()
