"""Contract round 3: one regression test per defect, each written from the rule it broke.

The reproducer configuration is ``CFG`` (page_size 4, 32 + 32 pages, 4 rows, context 64,
window 6, 2 handles). Every refusal must leave host and device state as before
(``snapshot()``, ``stats()``, live handles, committed lengths).

 1. A trim into a page another holder references is refused (``SharedPageError``).
 2. A launch that raises: the step is cancelled, ``LaunchError`` from the cause.
 3. The own-graph protocol: ``mark_submitted(p)`` without a launch or replay is caught by
    ``check()`` (``SubmissionError`` naming the step); correct runs stay clean.
 4. ``try_step``: an (empty) result on success, ``None`` only for lack of room.
 5. Recorder misuse is refused (``RecorderError``); both blocks discard on an exception.
 6, 7. Inside an open ``free_group()``: audits clean, every view the committed state.
 8. Accepted-and-ignored or the wrong class (admit n_tokens, fits in a group, load_back of a
    released row, describe_graph(None), admit past a handle).
 9. Configs and environments that cannot work (Triton on a CPU without the interpreter, an
    SWA pool smaller than a window, a window past the context, a graph executor on a CPU).
 10. Page tables are validated when they are built.
 12. A failed capture raises ``CaptureError`` and leaves the process usable; many allocators
    built, used and dropped in one process capture fine (GPU).
 13. What the module docstrings now state about ring admits, long load-backs and tensors on
    a device holds.
 And: garbage at every public entry point gets a typed error with nothing changed.
"""

from __future__ import annotations

import gc
import inspect
import math
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
from conftest import CORE_DEVICE, HAS_CUDA, assert_same_snapshot
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import graphalloc as ga
from graphalloc import errors as E
from graphalloc.attention.spec import PageTableSpec
from graphalloc.device import graph as graph_module
from graphalloc.device.executor import EagerExecutor
from graphalloc.kernels.abi import SEEN_COUNT

CFG = dict(page_size=4, num_full_pages=32, num_swa_pages=32, max_reqs=4, max_context_len=64,
           model_window=7, max_handles=2)


def config(**kw) -> ga.AllocatorConfig:
    return ga.AllocatorConfig(**{**CFG, **kw})


def state(a) -> tuple:
    """Everything a refusal must leave alone: the snapshot (host arrays and device tables),
    the stats, the live handles and the committed lengths."""
    return a.snapshot(), a.stats(), a.live_handles().tolist(), a.committed_lens().tolist()


def assert_same_state(before: tuple, a) -> None:
    snap, stats, handles, committed = before
    assert_same_snapshot(snap, a.snapshot())
    assert a.stats() == stats
    assert a.live_handles().tolist() == handles
    assert a.committed_lens().tolist() == committed


def two_rows(**kw):
    """Row 0 with 9 tokens, row 1 with 4 (then one speculative step of 2: L 6, C 4), handle 0
    on row 0's first 8 tokens (pages 0 and 1 shared)."""
    a = ga.HybridAllocator(config(**kw.pop("cfg", {})), **kw)
    r, s = a.admit(), a.admit()
    a.alloc_extend([r, s], [9, 4])
    a.take_handle(r, 8)
    a.alloc_decode([s], lookahead=1)
    return a


# ---- 1. a trim into a shared page ------------------------------------------------------------
def test_trim_into_a_shared_page_is_refused_and_changes_nothing():
    """Rule: a slot of a page more than one holder references is never written. Trimming row
    0 to 5 tokens keeps page 1 (shared with handle 0) partial, so its next allocation would
    write into the handle's prefix: refused. A trim to the page boundary is fine."""
    a = two_rows()
    before = state(a)
    for cut in (5, 6, 7):
        with pytest.raises(E.SharedPageError):
            a.trim([0], [cut])
        with pytest.raises(E.SharedPageError):
            a.step(trim=([0], [cut]))
        assert_same_state(before, a)
    a.trim([0], [8])  # whole pages: nothing shared is written later
    a.alloc_decode([0])
    assert a.seq_len(0) == 9 and a.audit() == []


# ---- 2. a launch that raises -----------------------------------------------------------------
class FlakyExecutor(EagerExecutor):
    """The eager executor, raising before it launches anything when told to."""

    name = "flaky"

    def __init__(self):
        super().__init__()
        self.fail_next = False

    def execute(self, planned) -> None:
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("injected launch failure")
        super().execute(planned)


def test_a_launch_that_raises_cancels_the_step_and_raises_launch_error():
    """Rule: a launch that raises leaves the allocator as before the plan and raises
    LaunchError from the cause; the allocator keeps working, and check() expects nothing
    of the cancelled step."""
    ex = FlakyExecutor()
    a = two_rows(executor=ex)
    before, steps = state(a), a.steps_run
    ex.fail_next = True
    with pytest.raises(E.LaunchError) as info:
        a.alloc_extend([0], [5])
    assert isinstance(info.value.__cause__, RuntimeError)
    assert a.pending is None and a.steps_run == steps
    assert_same_state(before, a)
    p = a.plan(release=[1])
    ex.fail_next = True
    with pytest.raises(E.LaunchError):
        a.run(p)
    assert p.cancelled and a.pending is None
    assert_same_state(before, a)
    with pytest.raises(E.PendingStepError):  # a cancelled step is not run later
        a.run(p)
    a.alloc_extend([0], [5])
    assert a.seq_len(0) == 14 and a.audit() == []
    a.check()


# ---- 3. the own-graph protocol -------------------------------------------------------------
BACKENDS = ["torch", "triton"]


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("backend", BACKENDS)
def test_mark_submitted_without_a_launch_is_caught_by_check(backend, fused, device):
    """Rule: a submitted step with rows must have run on the device. plan + mark_submitted
    without alloc.launch (or a replay) leaves the host ahead of the device: check() raises
    SubmissionError naming that step and its buffer, the allocator refuses steps (and
    reset_faults()) until recover() rebuilds the device tables."""
    a = two_rows(cfg=dict(backend=backend, device=device), fused_step=fused)
    a.check()  # the set-up's steps all ran
    p = a.plan(extend=([0], [3]))
    step_number, index = a.steps_run + 1, p.buffer_index
    a.mark_submitted(p)  # no launch, no replay
    with pytest.raises(E.SubmissionError) as info:
        a.check()
    assert (info.value.step, info.value.buffer_index) == (step_number, index)
    assert info.value.seen == info.value.expected - 1
    with pytest.raises(E.PendingStepError):
        a.step(decode=[0])
    assert any(f.kind in ("missing_mapping", "req_to_token") for f in a.audit())
    with pytest.raises(E.IntegrityError, match="recover"):  # not while the tables are wrong
        a.reset_faults()
    a.recover()  # the device tables from the host ledger: the step took effect
    assert a.audit() == []
    a.step(decode=[0])
    a.check()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_skipped_launch_among_others_is_caught(backend, device):
    """A step in the middle was not launched, later ones were: the count still misses one."""
    a = two_rows(cfg=dict(backend=backend, device=device))
    for i in range(3):
        p = a.plan(decode=[0])
        if i != 1:
            a.launch(p.buffer_index)
        a.mark_submitted(p)
    with pytest.raises(E.SubmissionError, match="never ran"):
        a.check()


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("executor", ["eager", "graph", "own"])
def test_correct_runs_keep_check_clean(backend, fused, executor, device):
    """Every executor, both launch forms, and the own-graph protocol done right (plan,
    alloc.launch(i) over the whole buffer -- what an engine's captured graph replays --,
    mark_submitted): check() is clean after every step, and the device counted exactly the
    steps with rows (a step's two kernels count once; a step without rows counts nothing,
    even launched over its whole padded buffer)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the graph executor on a CPU
        a = ga.HybridAllocator(config(backend=backend, device=device), fused_step=fused,
                               executor="eager" if executor == "own" else executor)
    cfg = a.config
    steps = [dict(admit=[0, 1]), dict(extend=([0, 1], [9, 3])),  # admits: no rows
             dict(decode=[0, 1], evict_all=True), dict(), dict(release=[1], decode=[0]),
             dict(admit=[1])]
    for kinds in steps:
        if executor == "own":
            p = a.plan(**kinds)
            a.launch(p.buffer_index, n_rows=(cfg.max_release_rows, cfg.max_alloc_rows))
            a.mark_submitted(p)
        else:
            a.step(**kinds)
        a.check()
    assert a.pipeline.submissions.n_expected == 3
    assert int(a.state.seen_buf[SEEN_COUNT]) == 3
    assert a.audit() == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_pending_step_replayed_before_mark_submitted_is_fine_and_a_cancelled_one_is_not(
        backend, device):
    """Between the replay and mark_submitted the device may be one step ahead: clean. A
    cancelled step's buffer that ran anyway changed the device behind the host: refused."""
    a = two_rows(cfg=dict(backend=backend, device=device))
    p = a.plan(decode=[0])
    a.launch(p.buffer_index)
    a.check()  # replayed, not yet marked
    a.mark_submitted(p)
    a.check()
    p = a.plan(decode=[0])
    a.launch(p.buffer_index)
    a.cancel(p)
    with pytest.raises(E.SubmissionError, match="never submitted"):
        a.check()


# ---- 4. try_step ---------------------------------------------------------------------------
def test_try_step_returns_none_only_for_lack_of_room():
    """Rule: None is the back-pressure signal (pages, rows, frozen shape) and nothing else: a
    step that ran returns its result -- an empty one when it allocated nothing --, and a step
    refused for another reason raises as step() would."""
    a = two_rows()
    empty = a.try_step()
    assert empty is not None and len(empty.rows) == 0
    freed = a.try_step(evict=[0])
    assert freed is not None and len(freed.rows) == 0
    got = a.try_step(decode=[0], admit=[2, 3])
    assert got is not None and got.rows.tolist() == [0]
    before = state(a)
    short = dict(extend=([2, 3], [60, 60]))  # 30 pages; 27 are free
    assert a.try_step(**short) is None
    assert not a.fits(**short)
    assert_same_state(before, a)
    for bad in (lambda: a.try_step(decode=[99]), lambda: a.try_step(extend=([0], [-1])),
                lambda: a.try_step(decode=[0, 0])):
        with pytest.raises(E.ContractError):
            bad()
    assert_same_state(before, a)


# ---- 5. recorder misuse and discarded blocks -------------------------------------------------
def test_recorder_misuse_is_refused_and_blocks_discard_on_an_exception():
    """Rules: a call on a closed scheduler_step() block, and any direct allocator mutation
    while one is open, raise RecorderError with nothing changed; an exception escaping a
    scheduler_step() or free_group() block runs nothing of it."""
    a = two_rows()
    before = state(a)
    with a.scheduler_step() as it:
        d = it.decode([0])
        with pytest.raises(E.PendingStepError):
            d.full_slots  # noqa: B018 -- the step has not run yet
        for direct in (lambda: a.alloc_decode([0]), lambda: a.release([1]), lambda: a.admit(),
                       lambda: a.step(), lambda: a.plan(), lambda: a.take_handle(0, 4),
                       lambda: a.evict_window(), lambda: a.load_back(0, 0)):
            with pytest.raises(E.RecorderError):
                direct()
        with pytest.raises(E.RecorderError):
            with a.scheduler_step():
                pass
        with pytest.raises(E.RecorderError):
            with a.free_group():
                pass
    assert d.rows.tolist() == [0] and a.seq_len(0) == 10
    after = state(a)
    for late in (lambda: it.decode([0]), lambda: it.release([1]), lambda: it.admit(),
                 lambda: it.extend([0], [1]), lambda: it.evict_all()):
        with pytest.raises(E.RecorderError):
            late()
    assert_same_state(after, a)

    class Boom(Exception):
        pass

    for block in ("scheduler_step", "free_group"):
        with pytest.raises(Boom):
            if block == "scheduler_step":
                with a.scheduler_step() as it:
                    it.release([1])
                    it.decode([0])
                    raise Boom
            else:
                with a.free_group():
                    a.release([1])
                    a.evict_window([0])
                    raise Boom
        assert_same_state(after, a)
    assert before[1]["steps_run"] + 1 == a.stats()["steps_run"]


# ---- 6, 7. audits and views inside an open free group ----------------------------------------
def test_audits_and_views_inside_an_open_free_group_show_the_committed_state():
    """Rule: nothing changes until the block ends, so inside it the audit is clean and every
    view (lengths, frontiers, committed lengths, free counts, stats, live rows and handles,
    the snapshot) is the committed state; at the end the recorded frees all run."""
    a = two_rows()
    a.alloc_extend([0], [12])  # L 21: the window rule can evict
    before = state(a)
    views = (a.seq_lens().tolist(), a.frontiers().tolist(), a.n_free("full"),
             a.n_free("swa"), a.live_rows().tolist(), a.n_live)
    with a.free_group():
        a.release([1])
        a.evict_window([0])
        a.drop_handle(0)
        assert a.audit() == []
        a.check_integrity()
        a.check()
        assert_same_state(before, a)
        assert (a.seq_lens().tolist(), a.frontiers().tolist(), a.n_free("full"),
                a.n_free("swa"), a.live_rows().tolist(), a.n_live) == views
        assert a.is_live(1) and a.seq_len(1) == 6 and a.committed_len(1) == 4
    assert not a.is_live(1) and a.frontier(0) > 0 and a.live_handles().tolist() == []
    assert a.audit() == []


# ---- 8. accepted-and-ignored, or the wrong class ---------------------------------------------
def test_admit_arguments_are_never_ignored():
    """admit(n_tokens=) without a handle, and a share longer than the handle, are
    PositionError with nothing changed."""
    a = two_rows()
    before = state(a)
    for call in (lambda: a.admit(n_tokens=4), lambda: a.admit(n_tokens=0),
                 lambda: a.admit(handle=0, n_tokens=12), lambda: a.admit(handle=0, n_tokens=16)):
        with pytest.raises(E.PositionError):
            call()
        assert_same_state(before, a)
    with a.scheduler_step() as it:
        with pytest.raises(E.PositionError):
            it.admit(n_tokens=4)
    assert a.admit(handle=0, n_tokens=4) == 2


def test_fits_with_frees_inside_a_free_group_raises_as_step_does():
    a = two_rows()
    with a.free_group():
        a.release([1])
        before = state(a)
        for call in (a.fits, a.step, a.try_step):
            with pytest.raises(E.NestedGroupError):
                call(release=[0])
            with pytest.raises(E.NestedGroupError):
                call(evict_all=True)
        assert_same_state(before, a)
        assert a.fits(decode=[0])


def test_load_back_of_a_row_released_in_the_open_block_is_an_unknown_request():
    """A row released in the open block is pending release, not live: UnknownRequestError
    (the class of every other use of such a row), not NestedGroupError. A row whose frontier
    the block moves is still a block rule (NestedGroupError)."""
    a = two_rows()
    a.alloc_extend([0], [12])
    a.evict_window([0])
    f = a.frontier(0)
    assert f > 0
    with a.free_group():
        a.release([1])
        a.evict_window([0])
        before = state(a)
        with pytest.raises(E.UnknownRequestError):
            a.load_back(1, 0)
        with pytest.raises(E.NestedGroupError):
            a.load_back(0, 0)
        with pytest.raises(E.UnknownRequestError):
            a.load_back(7, 0)
        assert_same_state(before, a)


def test_describe_graph_refuses_what_is_not_a_graph():
    for value in (None, 0, "graph", object()):
        with pytest.raises(E.ContractError):
            ga.describe_graph(value)


# ---- 9. configs and environments that cannot work -------------------------------------------
def test_triton_on_a_cpu_without_the_interpreter_is_refused_with_the_fix():
    """A fresh process without TRITON_INTERPRET: the kernels are compiled for a GPU, so a
    CPU config with backend='triton' is refused at construction, saying how to fix it."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    code = ("import graphalloc as ga\n"
            f"kw = {CFG!r}\n"
            "try:\n"
            "    ga.AllocatorConfig(backend='triton', device='cpu', **kw)\n"
            "    print('ACCEPTED')\n"
            "except ga.ConfigError as exc:\n"
            "    print('REFUSED', exc)\n"
            "ga.AllocatorConfig(backend='torch', device='cpu', **kw)\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300, check=True).stdout
    assert out.startswith("REFUSED"), out
    assert "TRITON_INTERPRET=1" in out and "backend='torch'" in out


def test_an_swa_pool_smaller_than_one_window_is_refused():
    """Pool mode: a request at its window holds ceil(W / ps) + 1 SWA pages (capped by the
    pages one request can own); a smaller pool could never serve it."""
    need = -(-(CFG["model_window"] - 1) // CFG["page_size"]) + 1  # 3
    with pytest.raises(E.ConfigError, match="window"):
        config(num_swa_pages=need - 1)
    assert config(num_swa_pages=need).num_swa_pages == need
    # a context shorter than the window caps the need at the pages one request owns
    short = dict(max_context_len=8, model_window=41)
    assert config(num_swa_pages=2, **short).num_swa_pages == 2
    with pytest.raises(E.ConfigError):
        config(num_swa_pages=1, **short)


def test_a_window_past_the_context_is_accepted_and_never_evicts():
    """Decision: a window at or past max_context_len is a real configuration (a model's
    window served at a shorter context): accepted, and nothing is ever evicted."""
    a = ga.HybridAllocator(config(model_window=101, num_swa_pages=16))
    r = a.admit()
    a.alloc_extend([r], [63])
    a.alloc_decode([r])
    a.evict_window()
    assert a.frontier(r) == 0 and a.n_free("swa") == 0 and a.audit() == []


@pytest.mark.skipif(CORE_DEVICE == "cuda", reason="the suite's CPU configs run on the GPU")
def test_the_graph_executor_on_a_cpu_warns_once(monkeypatch):
    monkeypatch.setattr(graph_module, "_warned_cpu", False)
    with pytest.warns(UserWarning, match="eager fallback"):
        ga.HybridAllocator(config(), executor="graph")
    cfg = config()  # (built first: only the allocator's warnings are under test)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        a = ga.HybridAllocator(cfg, executor=ga.StepGraph())
    a.step(admit=[0])
    assert a.n_live == 1


# ---- 10. page tables validated when built ----------------------------------------------------
@pytest.mark.parametrize("kw", [dict(max_batch=0), dict(max_batch=True), dict(max_batch=1.5),
                                dict(max_batch=2, forms=("csr", "bogus")),
                                dict(max_batch=2, layers=()),
                                dict(max_batch=2, out_dtype=torch.float32),
                                dict(max_batch=2, max_pages_per_req=-1),
                                dict(max_batch=2, model_window=True)])
def test_a_bad_page_table_spec_is_refused_when_built(kw):
    with pytest.raises(E.ConfigError):
        PageTableSpec(**kw)


def test_page_tables_that_cannot_hold_the_context_are_refused_with_no_allocator():
    with pytest.raises(E.ConfigError, match="max_context_len"):
        ga.HybridAllocator(config(), page_tables=PageTableSpec(max_batch=2,
                                                               max_pages_per_req=1))
    with pytest.raises(E.ConfigError):
        ga.HybridAllocator(config(), page_tables=dict(max_batch=2))


def test_page_table_spec_refuses_bools_and_bad_values():
    """The in-step tables' spec (the standalone PageTables is gone): a bool count, a
    negative window and unknown forms / layers are refused with ConfigError when built."""
    for kw in (dict(max_batch=True), dict(max_batch=0), dict(model_window=-1),
               dict(forms=("dense",)), dict(layers=("moe",))):
        with pytest.raises(E.ConfigError):
            PageTableSpec(**{"max_batch": 2, **kw})


# ---- 12. graph capture -----------------------------------------------------------------------
class FakeGraph:
    def __init__(self, keep_graph: bool = False):
        self.keep_graph = keep_graph

    def pool(self):
        return None


def test_a_failed_capture_raises_capture_error_and_leaves_the_process_usable(monkeypatch):
    """capture_graph collects garbage first, pauses the collector during the capture, asks
    for thread-local capture errors, and turns a failure into CaptureError (the cause
    chained) with the collector running again; afterwards allocators work as before."""
    seen = {}

    class FailingCapture:
        def __init__(self, graph, pool=None, stream=None, **options):
            seen["options"] = options

        def __enter__(self):
            seen["gc_during"] = gc.isenabled()
            return self

        def __exit__(self, *exc):
            raise RuntimeError("operation not permitted when stream is capturing")

    collected = []
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", FailingCapture)
    monkeypatch.setattr(gc, "collect", lambda *a: collected.append(1) or 0)
    assert gc.isenabled()
    with pytest.raises(E.CaptureError) as info:
        ga.capture_graph(lambda: None)
    assert isinstance(info.value.__cause__, RuntimeError)
    assert collected and seen["gc_during"] is False and gc.isenabled()
    assert seen["options"].get("capture_error_mode") == "thread_local"

    def raising_body():
        raise ValueError("a sync inside the captured function")

    class PassingCapture(FailingCapture):
        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(torch.cuda, "graph", PassingCapture)
    with pytest.raises(E.CaptureError) as info:
        ga.capture_graph(raising_body)
    assert isinstance(info.value.__cause__, ValueError) and gc.isenabled()
    monkeypatch.undo()
    a = two_rows()
    a.alloc_decode([0])
    a.check()
    assert a.audit() == []


@pytest.mark.cuda
@pytest.mark.parametrize("backend", BACKENDS)
def test_hundreds_of_graph_allocators_built_used_and_dropped_in_one_process(backend):
    """Capture is not disturbed by other allocators' lifetimes: 150 allocators per backend
    (GRAPHALLOC_STRESS_ALLOCATORS overrides), random geometry and workloads, executor
    'graph', some dropped at once, some left in reference cycles for the collector, some
    kept alive across later captures. Every one captures, runs, audits clean and checks
    clean."""
    rng = np.random.default_rng(12 + len(backend))
    n = int(os.environ.get("GRAPHALLOC_STRESS_ALLOCATORS", "150"))
    kept = []
    for i in range(n):
        ps = int(rng.choice([1, 4, 16]))
        window = int(rng.integers(1, 6 * ps))
        ctx = ps * int(rng.integers(4, 12))
        swa = max(-(-window // ps) + 1, int(rng.integers(4, 24)))
        cfg = ga.AllocatorConfig(
            page_size=ps, num_full_pages=int(rng.integers(8, 40)), num_swa_pages=swa,
            max_reqs=int(rng.integers(1, 5)), max_context_len=ctx, sliding_window=window,
            device="cuda", backend=backend, max_handles=int(rng.integers(0, 3)))
        a = ga.HybridAllocator(cfg, executor="graph", fused_step=bool(rng.integers(0, 2)),
                               n_descriptor_bufs=int(rng.integers(1, 4)))
        for _ in range(int(rng.integers(1, 12))):
            live = a.live_rows().tolist()
            kind = rng.integers(0, 4)
            try:  # a refusal (past the context, say) changes nothing: the workload goes on
                if kind == 0 and a.n_live < cfg.max_reqs:
                    a.try_step(admit=[a.free_row()])
                elif kind == 1 and live:
                    a.try_step(extend=(live, [int(rng.integers(1, ps + 2))] * len(live)))
                elif kind == 2 and live:
                    a.try_step(decode=live, evict_all=True)
                elif live:
                    a.release(live[:1])
            except E.ContractError:
                pass
        a.check()
        assert a.audit() == []
        if i % 3 == 0:
            a.cycle = a  # dies only through the collector, maybe during a later capture
        elif i % 3 == 1:
            kept.append(a)
            if len(kept) > 4:
                kept.pop(0)
        del a
    gc.collect()
    torch.cuda.synchronize()


@pytest.mark.cuda
@pytest.mark.parametrize("backend", BACKENDS)
def test_own_graph_replays_are_counted_and_a_missing_replay_is_caught(backend):
    """The engine's protocol on a GPU: one graph per buffer over alloc.launch(i), replayed
    for each planned step, then mark_submitted. Clean; one step marked without its replay
    is named by check()."""
    a = ga.HybridAllocator(config(backend=backend, device="cuda"))
    r = a.admit()
    a.alloc_extend([r], [5])
    graphs = [ga.capture_graph(lambda i=i: a.launch(i)) for i in range(len(a.ring))]
    for _ in range(6):
        p = a.plan(decode=[r])
        graphs[p.buffer_index].replay()
        a.mark_submitted(p)
    a.check()
    p = a.plan(decode=[r])
    a.mark_submitted(p)
    with pytest.raises(E.SubmissionError) as info:
        a.check()
    assert info.value.buffer_index == p.buffer_index


# ---- 13. what the module docstrings now state ------------------------------------------------
def test_documented_rules_hold():
    """plan.step / plan.allocation / inputs state these; each is checked as written."""
    ring = ga.HybridAllocator(config(max_handles=0, swa_ring_pages=3))
    p = ring.plan(admit=[0, 1])  # a ring admit takes an allocation row each
    assert p.n_alloc_rows == 2
    ring.cancel(p)
    before = state(ring)
    with pytest.raises(E.OverlapError, match="next step"):
        ring.step(admit=[0], extend=([0], [5]))
    assert_same_state(before, ring)
    ring.step(admit=[0])
    ring.step(extend=([0], [5]))
    pool = ga.HybridAllocator(config())
    pool.step(admit=[0], extend=([0], [5]))  # a pool admit may extend in its step
    p = pool.plan(admit=[1])
    assert p.n_alloc_rows == 0
    pool.cancel(p)

    a = ga.HybridAllocator(config(max_tokens_per_alloc_row=8))
    r = a.admit()
    for _ in range(5):
        a.alloc_extend([r], [8])
    a.evict_window()
    f = a.frontier(r)
    before = state(a)
    with pytest.raises(E.BatchTooLargeError, match="in parts"):
        a.load_back(r, f - 12)
    assert a.try_step(load_back=([r], [f - 12])) is None  # a shortage of row room
    assert_same_state(before, a)
    a.load_back(r, f - 8)
    a.load_back(r, f - 16)
    assert a.frontier(r) == f - 16 and a.audit() == []

    for value in (torch.tensor([1.5], device="meta"), torch.tensor([0], device="meta")):
        with pytest.raises(E.TensorSpecError):  # the device is checked before the dtype
            a.alloc_extend([r], value)


# ---- garbage at every public entry point -----------------------------------------------------
def _rec(a, call):
    with a.scheduler_step() as it:
        call(it)


def _group(a, call):
    with a.free_group():
        call()


# name: a call with the garbage x in one argument position (the others valid).
ENTRY_POINTS = {
    # one step, its forms and its protocol
    "step": lambda a, x: a.step(x),
    "step_and_keywords": lambda a, x: a.step(ga.Step(decode=[0]), decode=x),
    "step_unknown_kind": lambda a, x: a.step(**{"bogus": x}),
    "step_release": lambda a, x: a.step(release=x),
    "step_evict": lambda a, x: a.step(evict=x),
    "step_evict_all": lambda a, x: a.step(evict_all=x),
    "step_advance": lambda a, x: a.step(advance=x),
    "step_advance_pos": lambda a, x: a.step(advance=([0], x)),
    "step_decode": lambda a, x: a.step(decode=x),
    "step_lookahead": lambda a, x: a.step(decode=[0], lookahead=x),
    "step_extend": lambda a, x: a.step(extend=x),
    "step_extend_n": lambda a, x: a.step(extend=([0], x)),
    "step_commit": lambda a, x: a.step(commit=x),
    "step_accept": lambda a, x: a.step(accept=x),
    "step_trim": lambda a, x: a.step(trim=x),
    "step_take": lambda a, x: a.step(take=x),
    "step_drop": lambda a, x: a.step(drop=x),
    "step_drop_swa": lambda a, x: a.step(drop_swa=x),
    "step_admit": lambda a, x: a.step(admit=x),
    "step_admit_on": lambda a, x: a.step(admit_on=x),
    "step_load_back": lambda a, x: a.step(load_back=x),
    "try_step": lambda a, x: a.try_step(x),
    "try_step_and_keywords": lambda a, x: a.try_step(ga.Step(), decode=x),
    "fits_and_keywords": lambda a, x: a.fits(ga.Step(), decode=x),
    "plan_and_keywords": lambda a, x: a.plan(ga.Step(), decode=x),
    "try_step_extend": lambda a, x: a.try_step(extend=([0], x)),
    "fits": lambda a, x: a.fits(x),
    "fits_decode": lambda a, x: a.fits(decode=x),
    "plan": lambda a, x: a.plan(x),
    "plan_decode": lambda a, x: a.run(a.plan(decode=x)),
    "dry_run": lambda a, x: a.dry_run(x),
    "dry_run_use_group": lambda a, x: a.dry_run(ga.Step(), use_group=x),
    "run": lambda a, x: a.run(x),
    "cancel": lambda a, x: a.cancel(x),
    "mark_submitted": lambda a, x: a.mark_submitted(x),
    "launch": lambda a, x: a.launch(x),
    "launch_fusable": lambda a, x: a.launch(0, fusable=x),
    "launch_n_rows": lambda a, x: a.launch(0, n_rows=x),
    # single operations
    "admit_handle": lambda a, x: a.admit(handle=x),
    "admit_n_tokens": lambda a, x: a.admit(handle=0, n_tokens=x),
    "admit_n_tokens_alone": lambda a, x: a.admit(n_tokens=x),
    "alloc_extend_rows": lambda a, x: a.alloc_extend(x, [1]),
    "alloc_extend_n": lambda a, x: a.alloc_extend([0], x),
    "alloc_decode": lambda a, x: a.alloc_decode(x),
    "alloc_decode_lookahead": lambda a, x: a.alloc_decode([0], lookahead=x),
    "commit_rows": lambda a, x: a.commit(x, [1]),
    "commit_n": lambda a, x: a.commit([1], x),
    "accept_rows": lambda a, x: a.accept(x, [0]),
    "accept_n": lambda a, x: a.accept([1], x),
    "trim_rows": lambda a, x: a.trim(x, [8]),
    "trim_len": lambda a, x: a.trim([0], x),
    "release": lambda a, x: a.release(x),
    "evict_window": lambda a, x: a.evict_window(x),
    "advance_frontier_rows": lambda a, x: a.advance_frontier(x, [4]),
    "advance_frontier_pos": lambda a, x: a.advance_frontier([0], x),
    "load_back_row": lambda a, x: a.load_back(x, 0),
    "load_back_pos": lambda a, x: a.load_back(0, x),
    "take_handle_row": lambda a, x: a.take_handle(x, 4),
    "take_handle_n": lambda a, x: a.take_handle(0, x),
    "drop_handle": lambda a, x: a.drop_handle(x),
    "drop_handle_swa": lambda a, x: a.drop_handle_swa(x),
    "free_row": lambda a, x: a.free_row(x),
    # the blocks
    "rec_release": lambda a, x: _rec(a, lambda it: it.release(x)),
    "rec_commit": lambda a, x: _rec(a, lambda it: it.commit([1], x)),
    "rec_accept": lambda a, x: _rec(a, lambda it: it.accept([1], x)),
    "rec_trim": lambda a, x: _rec(a, lambda it: it.trim([0], x)),
    "rec_evict": lambda a, x: _rec(a, lambda it: it.evict(x)),
    "rec_advance": lambda a, x: _rec(a, lambda it: it.advance(x, 4)),
    "rec_drop_handle": lambda a, x: _rec(a, lambda it: it.drop_handle(x)),
    "rec_take_handle": lambda a, x: _rec(a, lambda it: it.take_handle(x, 4)),
    "rec_admit": lambda a, x: _rec(a, lambda it: it.admit(handle=x)),
    "rec_decode": lambda a, x: _rec(a, lambda it: it.decode(x)),
    "rec_extend": lambda a, x: _rec(a, lambda it: it.extend([0], x)),
    "rec_load_back": lambda a, x: _rec(a, lambda it: it.load_back(x, 0)),
    "group_release": lambda a, x: _group(a, lambda: a.release(x)),
    "group_evict": lambda a, x: _group(a, lambda: a.evict_window(x)),
    "group_advance": lambda a, x: _group(a, lambda: a.advance_frontier([0], x)),
    "group_drop_handle": lambda a, x: _group(a, lambda: a.drop_handle(x)),
    "group_load_back": lambda a, x: _group(a, lambda: a.load_back(x, 0)),
    # queries
    "n_free": lambda a, x: a.n_free(x),
    "is_live": lambda a, x: a.is_live(x),
    "seq_len": lambda a, x: a.seq_len(x),
    "frontier": lambda a, x: a.frontier(x),
    "committed_len": lambda a, x: a.committed_len(x),
    "spec_len": lambda a, x: a.spec_len(x),
    "pages_needed_rows": lambda a, x: a.pages_needed(x, 1),
    "pages_needed_n": lambda a, x: a.pages_needed([0], x),
    "pages_released": lambda a, x: a.pages_released(x),
    "pages_released_advance": lambda a, x: a.pages_released(advance=x),
    "pages_released_handles": lambda a, x: a.pages_released(handles=x),
    "handle_info": lambda a, x: a.handle_info(x),
    # diagnostics
    "check": lambda a, x: a.check(x),
    "load_state_dict": lambda a, x: a.load_state_dict(x),
}

# Public methods that take no argument (garbage cannot reach them) or whose arguments are
# covered under another name above.
NO_ARGUMENTS = {"audit", "check_integrity", "committed_lens", "frontiers", "live_handles",
                "live_rows", "reset_faults", "recover", "seq_lens", "snapshot", "state_dict",
                "stats",
                "scheduler_step", "free_group"}
COVERED_AS = {"pages_needed": "pages_needed_rows", "trim": "trim_rows",
              "commit": "commit_rows", "accept": "accept_rows", "take_handle": "take_handle_row",
              "advance_frontier": "advance_frontier_rows", "alloc_extend": "alloc_extend_rows",
              "load_back": "load_back_row", "admit": "admit_handle"}

# Malformed for every argument of every entry point above: wrong types, floats, strings,
# nested lists, NaN, ints past int64, CUDA-like (meta) and 2-D tensors, a non-int dict.
MALFORMED = [1.5, math.nan, math.inf, "2", b"0", [[1]], [1.5], ["0"], [None], {0: 1}, object(),
             2**70, -(2**70), np.array([2.5]), np.zeros((2, 2), dtype=np.int64),
             torch.tensor([0], device="meta"), torch.zeros(2, 2, dtype=torch.int64),
             torch.tensor([0.5]), 3 + 0j]
# More that are malformed where these entry points take them: bools (a bool is not a row,
# a count or a position), out-of-range ids, negative counts, pairs of the wrong arity.
BOOLS = [True, False, np.bool_(True)]
BOOL_OK = {"step_evict_all", "dry_run_use_group", "launch_fusable", "check"}
EXTRA = {
    "step_advance": [([0],), ([0], [4], [1])], "step_extend": [([0],), ([0], [1], [1])],
    "step_commit": [([1],), ([1], [1], [1])], "step_trim": [([0],), ([0], [8], [0])],
    "step_accept": [([1],), ([1], [0], [0])], "accept_n": [[-1]],
    "step_take": [([0], [0]), ([0], [0], [4], [4])], "step_admit_on": [([2], [0])],
    "step_load_back": [([0],), ([0], [0], [0])], "step_extend_n": [[-1], -1],
    "alloc_extend_n": [[-5], -5], "pages_needed_n": [[-1]], "take_handle_n": [-4],
    "commit_n": [[-1]], "trim_len": [[-1], [99]], "admit_n_tokens": [-7, 99],
    "admit_n_tokens_alone": [4, 0], "alloc_decode": [[99], [-1], [0, 0]],
    "release": [[99], [0, 0]], "drop_handle": [99, -1], "handle_info": [99, -1],
    "launch": [99, -1], "is_live": [99, -1], "seq_len": [99], "load_back_row": [99],
    "rec_decode": [[99]], "group_release": [[99]], "step_decode": [[0, 0], [99]],
    "advance_frontier_pos": [[-4], [5]], "n_free": ["bogus", "FULL"],
}
ACCEPTS_NONE = {"admit_handle", "admit_n_tokens", "admit_n_tokens_alone",
                "alloc_decode_lookahead", "step_lookahead", "evict_window", "group_evict",
                "step_evict", "step_release", "step_advance", "step_decode", "step_extend",
                "step_commit", "step_accept", "step_trim", "step_take", "step_drop",
                "step_drop_swa",
                "step_admit", "step_admit_on", "step_load_back", "step_and_keywords", "step",
                "try_step", "fits", "plan", "fits_decode", "pages_released",
                "pages_released_advance", "pages_released_handles", "rec_admit",
                "plan_decode", "launch_n_rows"}


def malformed_for(name: str) -> list:
    values = list(MALFORMED) + list(EXTRA.get(name, []))
    if name not in BOOL_OK:
        values += BOOLS
    if name not in ACCEPTS_NONE:
        values.append(None)
    return values


def fresh():
    return two_rows()


def test_every_public_method_gets_garbage():
    """The table covers the allocator's whole public surface (a new method must be added)."""
    public = {n for n, v in vars(ga.HybridAllocator).items()
              if not n.startswith("_") and callable(v) and not isinstance(v, property)}
    covered = set(ENTRY_POINTS) | set(COVERED_AS)
    missing = {n for n in public if n not in covered and n not in NO_ARGUMENTS}
    assert not missing, f"public methods without garbage cases: {sorted(missing)}"
    for name in NO_ARGUMENTS:
        sig = inspect.signature(getattr(ga.HybridAllocator, name))
        assert list(sig.parameters) == ["self"], name


@pytest.mark.parametrize("name", sorted(ENTRY_POINTS))
def test_malformed_input_at_every_entry_point_is_refused_with_nothing_changed(name):
    a = fresh()
    call = ENTRY_POINTS[name]
    accepted = []
    for x in malformed_for(name):
        before = state(a)
        try:
            call(a, x)
        except E.GraphallocError as exc:
            assert str(exc), (name, x)
        else:
            accepted.append(x)
            a = fresh()
            continue
        assert a.pending is None and a.recorder is None and a.group is None, (name, x)
        assert_same_state(before, a)
    assert not accepted, f"{name} accepted malformed input: {accepted!r}"
    a.check()
    a.check_integrity()


garbage = (st.sampled_from(MALFORMED + BOOLS + [None, -1, 0, 1, 99, [0], [1], [0, 1], ([0], [1]),
                                                  ([0], [4], [1]), ga.Step(), "full"])
           | st.integers(-(2**66), 2**66) | st.lists(st.integers(-3, 9), max_size=4)
           | st.tuples(st.lists(st.integers(-1, 4), max_size=2),
                       st.lists(st.integers(-2, 70), max_size=2)))


@pytest.mark.parametrize("name", sorted(ENTRY_POINTS))
@settings(max_examples=8, deadline=None, database=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(x=garbage)
def test_generated_garbage_at_every_entry_point(name, x):
    """Generated values, valid ones included: a call either works (and the allocator stays
    consistent) or raises a typed graphalloc error with nothing changed."""
    a = fresh()
    before = state(a)
    try:
        ENTRY_POINTS[name](a, x)
    except E.GraphallocError:
        assert a.recorder is None and a.group is None
        if a.pending is None:
            assert_same_state(before, a)
        return
    if a.pending is not None:
        a.run(a.pending)
    a.check()
    a.check_integrity()


@pytest.mark.skipif(HAS_CUDA, reason="CPU-only: device placement is what is tested")
def test_cuda_like_tensors_say_pass_the_host_copy():
    a = fresh()
    before = state(a)
    meta = torch.tensor([0], device="meta")
    for call in (lambda: a.alloc_decode(meta), lambda: a.release(meta),
                 lambda: a.step(extend=(meta, [1])), lambda: a.step(extend=([0], meta)),
                 lambda: a.advance_frontier([0], meta), lambda: a.pages_needed(meta, 1)):
        with pytest.raises(E.TensorSpecError, match="host copy"):
            call()
    assert_same_state(before, a)
