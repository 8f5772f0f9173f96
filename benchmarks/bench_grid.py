"""Cost follows the work: GPU and host time of a step on the full grid, on row buckets and
with kernel-node grid updates; host time of ``run()`` and of its parts.

    python benchmarks/bench_grid.py --out results/bench/grid-h200       # one GPU, < 2 min
    python benchmarks/bench_grid.py --quick --out /tmp/bench_grid        # CPU smoke run

Cases (page_size 16, ``max_reqs`` 256, so the frozen grid is 768 release + 256
allocation rows, the default shape; every step is fusable)::

    one_segment_free   one request's frontier moves one page: 1 release row
    decode_evict       B = 256: every frontier moves one page and every request
                       decodes one token: 256 release + 256 allocation rows
    prefill            one request extends by 4,096 tokens: 1 allocation row

GPU variants (graphs captured here, per descriptor buffer, on an allocator with
``--window`` descriptor buffers so the host can enqueue a window of steps ahead)::

    full_two, full_fused      the frozen grid: what every replay launched before
    bucket_two, bucket_fused  the smallest row bucket that covers the step (what
                              StepGraph replays: GridPolicy.bucket, long rows chunked)
    bucket_fused_w1           bucket_fused with one warp per program
    bucket_fused_staged       bucket_fused with the rows staged in device memory first
                              (what StepGraph replays now: kernels.stage, then the step)
    tight_fused               (prefill) bucket_fused with as many programs per row as
                              the 4,096-token row has token blocks (the policy sizes
                              chunks for the longest row the config allows)
    update_two                one full_two graph per buffer whose two kernel nodes get
                              the step's row counts as grids before each replay
                              (cuGraphExecKernelNodeSetParams; no chunking)
    floor                     an empty Triton kernel in a graph

GPU time, two ways. ``window`` (the headline, pipelined): spin the GPU, enqueue
``--window`` distinct steps (plan + replay, no sync), CUDA events around them; GPU
time per step back to back, L2 warm; a window whose spin ended before the host had
enqueued it is repeated with a longer spin (``valid`` says whether that worked).
``isolated``: timing.Sampler, one step per event pair after a 256 MiB L2 flush.

Host time of ``run()`` on the library's own path (``HybridAllocator(...,
executor=StepGraph(buckets=True | False))``, two descriptor buffers): ``pipelined``
(plan, then time run(); no sync in the loop) and ``cold`` (plan, then a heavy host-work
loop -- a ``--thrash-mib`` MiB numpy write and a dict walk -- then time run()); the
same split into ``execute`` and ``mark_submitted``; the own-graph runners of the GPU
variants (replay + mark_submitted, and the node updates of update_two); and the parts
of a step's submission one by one (``run_parts_us``: stream queries, event records,
an empty graph's replay), pipelined and cold.

Writes ``bench_grid.json`` and ``bench_grid.md`` into ``--out``. Without CUDA
(``--quick``) the same code runs the Torch twins eagerly: device times are CPU wall
clock (``"device_clock": "cpu-wall"``), no graph, no node update, no target verdict.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if HERE not in sys.path:
    sys.path.insert(0, HERE)
from timing import (  # noqa: E402
    Sampler,
    bench_main,
    bench_parser,
    empty_graph,
    format_quantiles,
    machine_info,
    progress,
    say,
    summarize,
)

CASES = ("one_segment_free", "decode_evict", "prefill")
FULL = dict(ps=16, reqs=256, prefill_tokens=4096, window=16, repeats=6, samples=20, warmup=3,
            host_samples=200, cold_samples=40, runner_samples=60, parts_samples=2000,
            thrash_mib=64, flush_mib=256, max_context=32768)
QUICK = dict(ps=4, reqs=8, prefill_tokens=256, window=4, repeats=2, samples=3, warmup=1,
             host_samples=12, cold_samples=4, runner_samples=6, parts_samples=50,
             thrash_mib=4, flush_mib=8, max_context=1024)
TARGETS = (  # (case, variant, what, limit): GPU time per step, window clock
    ("one_segment_free", "bucket_fused", "x floor", 1.5),
    ("decode_evict", "bucket_fused", "x floor", 2.0),
    ("prefill", "bucket_fused", "us", 10.0),
)
HOST_TARGET_US = 5.0  # a graph replay and an event record


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# ---- the workload -----------------------------------------------------------------------------
class CaseWorkload:
    """One allocator serving ``n_steps`` steps of one case (see the module docstring).

    ``plan()`` plans the next step (host only); ``expected`` is the row counts every step
    of the case has ``(n_release_rows, n_alloc_rows, n_tokens)``; ``drift`` counts steps
    that did not (the GPU variants' graphs are captured for ``expected``).
    """

    def __init__(self, case: str, p: dict, *, device, backend: str, n_steps: int, executor,
                 n_bufs: int):
        from graphalloc import AllocatorConfig, HybridAllocator

        ps, n_reqs = p["ps"], p["reqs"]
        self.case, self.ps, self.n_steps = case, ps, n_steps
        self.prefill_tokens = p["prefill_tokens"]
        window = 4 * ps - 1
        if case == "one_segment_free":
            context = (_ceil_div(n_steps, n_reqs) + 8) * ps
            fill = context - 2 * ps
            pool = n_reqs * (context // ps + 2)
            self.expected = (1, 0, 0)
        elif case == "decode_evict":
            context = (n_steps + 8) * ps + n_steps
            fill = (n_steps + 6) * ps
            pool = n_reqs * (context // ps + 2)
            self.expected = (n_reqs, n_reqs, n_reqs)
        elif case == "prefill":
            context = max(p["max_context"], 2 * self.prefill_tokens)
            fill = 0
            pool = (n_steps + 2) * _ceil_div(self.prefill_tokens, ps) + 16
            self.per_req = context // self.prefill_tokens
            n_reqs = max(n_reqs, _ceil_div(n_steps + 1, self.per_req) + 1)
            self.expected = (0, 1, self.prefill_tokens)
        else:
            raise ValueError(f"unknown case {case!r}")
        row_tokens = min(context, max(8192, self.prefill_tokens))
        self.config = AllocatorConfig(
            page_size=ps, num_full_pages=pool, num_swa_pages=pool, max_reqs=n_reqs,
            max_context_len=context, model_window=window + 1, index_dtype=torch.int32,
            device=device, backend=backend, max_tokens_per_alloc_row=row_tokens,
            max_step_tokens=max(8 * row_tokens, row_tokens + n_reqs))
        self.alloc = HybridAllocator(self.config, executor=executor, fused_step=True,
                                     n_descriptor_bufs=n_bufs)
        self.n_reqs = n_reqs
        if case == "prefill":
            self.rows = np.array([], dtype=np.int64)
            self.current, self.extends = self.alloc.admit(), 0
        else:
            self.rows = np.array([self.alloc.admit() for _ in range(n_reqs)], dtype=np.int64)
            self._fill(np.full(n_reqs, fill, dtype=np.int64))
        self.steps_done = self.drift = self.not_fusable = self.k = 0

    def _fill(self, n_tokens: np.ndarray) -> None:
        """Untimed: extend every request by ``n_tokens[i]``, in steps within the frozen shape."""
        cfg, left = self.config, n_tokens.copy()
        while left.any():
            piece = np.minimum(left, cfg.max_tokens_per_alloc_row)
            todo = np.flatnonzero(piece)
            take = todo[np.cumsum(piece[todo]) <= cfg.max_step_tokens]
            self.alloc.alloc_extend(self.rows[take], piece[take])
            left[take] -= piece[take]

    def plan(self, _=None):
        """The case's next step, planned into a descriptor buffer (host only)."""
        if self.steps_done >= self.n_steps:
            raise RuntimeError(f"{self.case}: workload sized for {self.n_steps} steps")
        alloc, ps = self.alloc, self.ps
        if self.case == "one_segment_free":
            r = self.rows[self.k % self.n_reqs]
            self.k += 1
            planned = alloc.plan(advance=([r], [alloc.frontier(r) + ps]))
        elif self.case == "decode_evict":
            planned = alloc.plan(advance=(self.rows, alloc.frontiers()[self.rows] + ps),
                                 decode=self.rows)
        else:
            if self.extends == self.per_req:
                self.current, self.extends = alloc.admit(), 0  # pool mode: host only
            self.extends += 1
            planned = alloc.plan(extend=([self.current], [self.prefill_tokens]))
        self.steps_done += 1
        got = (planned.n_release_rows, planned.n_alloc_rows, planned.n_tokens)
        self.drift += got != self.expected
        self.not_fusable += not planned.fusable
        return planned

    def verify(self) -> dict:
        """No device fault, device tables equal to the host's mirror (reads the device)."""
        alloc = self.alloc
        alloc.check()
        alloc.check_integrity()
        problems = alloc.audit()
        return {"steps": self.steps_done, "shape_drift": self.drift,
                "not_fusable_steps": self.not_fusable, "audit_problems": len(problems),
                "integrity_ok": not problems, "descriptor_stalls": alloc.ring.stalls}


# ---- GPU variants: graphs per descriptor buffer ------------------------------------------
class NodeGrids:
    """The two kernel nodes (release, allocation) of an instantiated step graph, whose grids
    are set before a replay (``cuGraphExecKernelNodeSetParams``, cuda-python)."""

    def __init__(self, graph):
        try:
            from cuda.bindings import driver
        except ImportError:  # older cuda-python
            from cuda import cuda as driver
        self.driver = driver
        if not hasattr(graph, "raw_cuda_graph_exec"):
            raise RuntimeError("this torch has no CUDAGraph.raw_cuda_graph_exec()")
        self.exec = driver.CUgraphExec(int(graph.raw_cuda_graph_exec()))
        handle = driver.CUgraph(int(graph.raw_cuda_graph()))
        _, n = self._ok(driver.cuGraphGetNodes(handle, 0))
        nodes, _ = self._ok(driver.cuGraphGetNodes(handle, n))
        kernels = []
        for node in nodes[:n]:
            kind = self._ok(driver.cuGraphNodeGetType(node))
            if int(kind) == int(driver.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL):
                params = self._ok(driver.cuGraphKernelNodeGetParams(node))
                kernels.append((self._name(params), node, params))
        named = {("release" if "release" in k else "alloc" if "allocate" in k else k): (n_, p_)
                 for k, n_, p_ in kernels}
        if set(named) != {"release", "alloc"}:  # names unavailable: capture order
            if len(kernels) != 2:
                raise RuntimeError(f"expected two kernel nodes, found {len(kernels)}")
            named = {"release": kernels[0][1:], "alloc": kernels[1][1:]}
        self.release, self.alloc = named["release"], named["alloc"]

    def _ok(self, result):
        err, *rest = result
        if int(err) != 0:
            raise RuntimeError(f"CUDA driver call failed: {err}")
        return rest[0] if len(rest) == 1 else rest

    def _name(self, params) -> str:
        try:
            name = self._ok(self.driver.cuFuncGetName(params.func))
            return name.decode() if isinstance(name, bytes) else str(name)
        except Exception:
            return "?"

    def set(self, n_release_rows: int, n_alloc_rows: int) -> None:
        """Grids of exactly those rows (at least one program: a padded row exits)."""
        for (node, params), n in ((self.release, n_release_rows), (self.alloc, n_alloc_rows)):
            params.gridDimX = max(1, n)
            self._ok(self.driver.cuGraphExecKernelNodeSetParams(self.exec, node, params))


def build_variants(wl: CaseWorkload, is_cuda: bool, errors: list) -> dict:
    """``{variant: run(planned)}``: each replays (CPU: launches) its form for the planned
    step's buffer, then marks it submitted. Captures on CUDA (synchronises)."""
    from graphalloc import capture_graph
    from graphalloc.device.executor import warm_up

    alloc = wl.alloc
    kernels, ring = alloc.kernels, alloc.ring
    grids = kernels.grids
    bucket = grids.bucket(*wl.expected)
    specs = {"full_two": (False, None, None, False), "full_fused": (True, None, None, False),
             "bucket_two": (False, bucket, None, False),
             "bucket_fused": (True, bucket, None, False),
             "bucket_fused_staged": (True, bucket, None, True)}
    tight = tight_grid(wl, bucket)
    if tight != bucket:  # chunks as many as the case's longest row has blocks
        specs["tight_fused"] = (True, tight, None, False)
    if is_cuda:
        specs["bucket_fused_w1"] = (True, bucket, 1, False)
    runners: dict = {}
    if not is_cuda:
        for name, (fused, grid, _, staged) in specs.items():
            runners[name] = _eager_runner(wl, fused, grid, staged)
        return runners
    graphs: dict = {name: [] for name in specs}
    for name, (fused, grid, warps, staged) in specs.items():
        try:
            kernels.num_warps = warps
            if warps is not None:
                warm_up(alloc.parts)  # compile the variant before capturing it
            for i in range(len(ring)):
                rel, al = ring.release_rows(i), ring.alloc_rows(i)
                graphs[name].append(capture_graph(
                    lambda rel=rel, al=al, f=fused, g=grid, st=staged: kernels(
                        rel, al, fusable=f, grid=g, staged=st), keep_graph=False))
        except Exception as exc:
            errors.append({"case": f"{wl.case}: capture {name}",
                           "error": f"{type(exc).__name__}: {exc}"})
            graphs.pop(name)
        finally:
            kernels.num_warps = None
    two_form = {"full_fused": "full_two", "bucket_fused": "bucket_two",
                "bucket_fused_w1": "bucket_two", "tight_fused": "bucket_two",
                "bucket_fused_staged": "bucket_two"}
    for name, gs in graphs.items():
        runners[name] = _graph_runner(wl, gs, graphs.get(two_form.get(name, name)))
    try:
        upd_graphs, updaters = [], []
        for i in range(len(ring)):
            rel, al = ring.release_rows(i), ring.alloc_rows(i)
            g = capture_graph(lambda rel=rel, al=al: kernels(rel, al), keep_graph=True)
            upd_graphs.append(g)
            updaters.append(NodeGrids(g))
        runners["update_two"] = _update_runner(wl, upd_graphs, updaters)
    except Exception as exc:
        errors.append({"case": f"{wl.case}: update_two",
                       "error": f"{type(exc).__name__}: {exc}",
                       "traceback": traceback.format_exc()})
    torch.cuda.synchronize()
    return runners


def tight_grid(wl, bucket):
    """``bucket`` with no more programs per allocation row than the case's longest row
    has token blocks (the policy sizes chunks for the longest row the config allows)."""
    from graphalloc.device.buckets import StepGrid
    from graphalloc.kernels.allocate import allocate_meta

    block = allocate_meta(wl.ps)["BLOCK_TOKENS"]
    longest = wl.prefill_tokens if wl.case == "prefill" else 1
    return StepGrid(bucket.n_release_rows, bucket.n_release_chunks, bucket.n_alloc_rows,
                    min(bucket.n_alloc_chunks, _ceil_div(longest, block)))


def _eager_runner(wl, fused: bool, grid, staged: bool = False):
    alloc = wl.alloc
    kernels, ring = alloc.kernels, alloc.ring

    def run(planned) -> None:
        i = planned.buffer_index
        kernels(ring.release_rows(i), ring.alloc_rows(i), fusable=fused and planned.fusable,
                grid=grid, staged=staged)
        alloc.mark_submitted(planned)
    return run


def _graph_runner(wl, graphs: list, two_form: list | None):
    """Replays ``graphs[i]``; a step that is not fusable replays ``two_form[i]`` instead
    (the two-launch graph of the same grid: a fused graph is only for fusable steps; every
    step of these cases is fusable, ``verify`` counts those that were not)."""
    alloc = wl.alloc
    replays = [g.replay for g in graphs]
    safe = [g.replay for g in (two_form or graphs)]

    def run(planned) -> None:
        (replays if planned.fusable else safe)[planned.buffer_index]()
        alloc.mark_submitted(planned)
    return run


def _update_runner(wl, graphs: list, updaters: list):
    alloc = wl.alloc
    replays = [g.replay for g in graphs]

    def run(planned) -> None:
        i = planned.buffer_index
        updaters[i].set(planned.n_release_rows, planned.n_alloc_rows)
        replays[i]()
        alloc.mark_submitted(planned)
    return run


# ---- clocks -----------------------------------------------------------------------------------
class Spinner:
    """Holds the GPU busy for a given time (``torch.cuda._sleep``, calibrated once)."""

    def __init__(self):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1000)  # load the kernel
        start.record()
        torch.cuda._sleep(2_000_000)
        end.record()
        torch.cuda.synchronize()
        self.cycles_per_ms = 2_000_000 / max(start.elapsed_time(end), 1e-3)

    def spin(self, ms: float) -> None:
        torch.cuda._sleep(int(ms * self.cycles_per_ms))


def window_us(ctx, run, plan, n_windows: int) -> dict:
    """GPU time per step over windows of ``ctx.window`` back-to-back steps (module
    docstring); on a CPU the wall time of the ``run`` calls only."""
    W = ctx.window
    per_step, valid = [], []
    for w in range(n_windows + 1):  # the first window warms up, untimed
        if not ctx.is_cuda:
            total = 0
            for _ in range(W):
                p = plan() if plan is not None else None
                t0 = time.perf_counter_ns()
                run(p) if plan is not None else run()
                total += time.perf_counter_ns() - t0
            if w:
                per_step.append(total / 1e3 / W)
            continue
        spin_ms = ctx.spin_ms
        for _attempt in range(3):
            torch.cuda.synchronize()
            ctx.spinner.spin(spin_ms)
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            for _ in range(W):
                run(plan()) if plan is not None else run()
            end.record()
            enqueue_ms = (time.perf_counter() - t0) * 1e3
            ok = not start.query()  # the spin outlasted the host's enqueue
            torch.cuda.synchronize()
            if ok or plan is not None:  # a retry would need fresh steps: a planned window
                break  # is kept (flagged), an unplanned one (the floor) repeated
            spin_ms = max(2 * spin_ms, 2 * enqueue_ms)
        ctx.spin_ms = max(ctx.spin_ms, 1.5 * enqueue_ms)
        if w:
            per_step.append(start.elapsed_time(end) * 1e3 / W)
            valid.append(ok)
    out = {"per_step_us": summarize(per_step), "window_steps": W}
    if ctx.is_cuda:
        out["valid"] = all(valid)
    return out


class Thrash:
    """Heavy host work between planning and the timed call: a numpy write over
    ``mib`` MiB (evicts the data caches) and a dict walk (interpreter paths)."""

    def __init__(self, mib: int):
        self.buf = np.ones(max(1, mib) * 2**20 // 8)
        self.table = {i: i for i in range(50_000)}

    def __call__(self) -> None:
        self.buf += 1.0
        total = 0
        for key in self.table:
            total += key
        self.sink = total


def time_calls(fn, n: int, before=None, thrash=None) -> list[float]:
    """Host time (us) of ``fn(before())`` per call, no sync; ``thrash()`` untimed before each."""
    out = []
    for _ in range(n):
        value = before() if before is not None else None
        if thrash is not None:
            thrash()
        t0 = time.perf_counter_ns()
        fn(value) if before is not None else fn()
        out.append((time.perf_counter_ns() - t0) / 1e3)
    return out


# ---- measurements -----------------------------------------------------------------------------
def gpu_case(ctx, case: str) -> dict:
    """Every GPU variant of ``case``: window and isolated GPU time per step, the runners'
    host time, verification."""
    p = ctx.params
    variants_n = 7
    n_steps = (variants_n * ((p["repeats"] + 1) * p["window"] + p["samples"] + p["warmup"]
                             + p["runner_samples"]) + 8)
    wl = CaseWorkload(case, p, device=ctx.device, backend=ctx.backend, n_steps=n_steps,
                      executor="eager", n_bufs=p["window"])
    try:
        runners = build_variants(wl, ctx.is_cuda, ctx.results["errors"])
        grids = wl.alloc.kernels.grids
        bucket = grids.bucket(*wl.expected)
        full = grids.full()
        exact = grids.exact(*wl.expected)
        programs = {"tight_fused": [tight_grid(wl, bucket).n_programs],
                    "full_two": [full.n_release_rows, full.n_alloc_rows],
                    "full_fused": [full.n_programs],
                    "bucket_two": [bucket.n_release_rows * bucket.n_release_chunks,
                                   bucket.n_alloc_rows * bucket.n_alloc_chunks],
                    "bucket_fused": [bucket.n_programs], "bucket_fused_w1": [bucket.n_programs],
                    "bucket_fused_staged": [bucket.n_programs],
                    "update_two": [max(1, exact.n_release_rows), max(1, exact.n_alloc_rows)]}
        rec = {"case": case, "expected_rows": list(wl.expected), "bucket": list(bucket),
               "full_grid": list(full), "variants": {}}
        for name, run in runners.items():
            rec["variants"][name] = {"programs": programs.get(name),
                                     "window": window_us(ctx, run, wl.plan, p["repeats"])}
        iso = ctx.sampler.alternating(runners, before=wl.plan)
        for name, samples in iso.items():
            rec["variants"][name]["isolated_us"] = summarize(samples)
        for name, run in runners.items():
            rec["variants"][name]["runner_host_us"] = summarize(
                time_calls(run, p["runner_samples"], before=wl.plan))
        rec["verify"] = wl.verify()
        floor = ctx.results.get("floor") or {}
        f_win = ((floor.get("window") or {}).get("per_step_us") or {}).get("p50")
        for v in rec["variants"].values():
            w = (v["window"].get("per_step_us") or {}).get("p50")
            if f_win and w is not None:
                v["x_floor_window"] = w / f_win
        return rec
    finally:
        wl.alloc = None
        ctx.sampler.release_memory()


def host_case(ctx, case: str) -> dict:
    """Host time of the library's ``run()`` on StepGraph(buckets=True / False)."""
    from graphalloc import StepGraph

    p = ctx.params
    n = p["host_samples"]
    n_steps = 3 * n + 2 * p["cold_samples"] + 20
    out = {}
    thrash = ctx.thrash
    for label, buckets in (("buckets", True), ("full", False)):
        wl = CaseWorkload(case, p, device=ctx.device, backend=ctx.backend, n_steps=n_steps,
                          executor=StepGraph(buckets=buckets), n_bufs=2)
        alloc = wl.alloc
        try:
            sg = alloc.executor
            time_calls(alloc.run, 10, before=wl.plan)  # warm
            rec = {"n_graphs": sg.n_graphs,
                   "pipelined": summarize(time_calls(alloc.run, n, before=wl.plan)),
                   "cold": summarize(time_calls(alloc.run, p["cold_samples"], before=wl.plan,
                                                thrash=thrash))}
            ex, mark = [], []
            for _ in range(n):
                planned = wl.plan()
                t0 = time.perf_counter_ns()
                sg.execute(planned)
                t1 = time.perf_counter_ns()
                alloc.mark_submitted(planned)
                t2 = time.perf_counter_ns()
                ex.append((t1 - t0) / 1e3)
                mark.append((t2 - t1) / 1e3)
            rec["execute"], rec["mark_submitted"] = summarize(ex), summarize(mark)
            rec["replays"], rec["empty_steps"] = sg.replays, sg.empty_steps
            rec["verify"] = wl.verify()
            out[label] = rec
        finally:
            wl.alloc = None
            ctx.sampler.release_memory()
    return out


def run_parts(ctx) -> dict:
    """Host time of each part of a step's submission, pipelined and cold."""
    from graphalloc import AllocatorConfig
    from graphalloc.device.buckets import GridPolicy
    from graphalloc.device.descriptor import DescriptorRing
    from graphalloc.device.layout import DescriptorLayout

    p = ctx.params
    n, n_cold = p["parts_samples"], p["cold_samples"]
    cfg = AllocatorConfig(page_size=16, num_full_pages=64, num_swa_pages=64, max_reqs=256,
                          max_context_len=1024, model_window=64, device=ctx.device)
    policy = GridPolicy(cfg)
    ring = DescriptorRing(DescriptorLayout.of(cfg), cfg.device, n_bufs=2)
    parts = {"grid_choice (GridPolicy.bucket)": lambda: policy.bucket(256, 256, 256),
             "ring.submitted (event record)": lambda: ring.submitted(0)}
    if ctx.is_cuda:
        dev = torch.cuda.current_device()
        event = torch.cuda.Event()
        stream = torch.cuda.current_stream()
        floor_call, _, _ = empty_graph(ctx.device)
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        parts.update({
            "torch.cuda.current_stream()": torch.cuda.current_stream,
            "Event.record() (default stream lookup)": event.record,
            "Event.record(stream)": lambda: event.record(stream),
            "ring.current_stream() (cached)": ring.current_stream,
            "is_current_stream_capturing()": torch.cuda.is_current_stream_capturing,
            "empty graph replay()": floor_call,
        })
        if raw is not None:
            parts["_cuda_getCurrentRawStream()"] = lambda: raw(dev)
    out = {}
    for name, fn in parts.items():
        try:
            time_calls(fn, 20)
            out[name] = {"pipelined": summarize(time_calls(fn, n)),
                         "cold": summarize(time_calls(fn, n_cold, thrash=ctx.thrash))}
        except Exception as exc:
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
    ctx.sampler.sync()
    return out


def measure_floor(ctx) -> dict:
    call, what, _ = empty_graph(ctx.device)
    return {"kernel": what, "window": window_us(ctx, call, None, ctx.params["repeats"]),
            "isolated_us": summarize(ctx.sampler.device_us(call)),
            "host_us": summarize(time_calls(call, ctx.params["runner_samples"]))}


# ---- reporting --------------------------------------------------------------------------------
def verdicts(res: dict) -> list:
    if res["device_clock"] != "cuda-events":
        return []
    floor = (((res.get("floor") or {}).get("window") or {}).get("per_step_us") or {}).get("p50")
    by_case = {c["case"]: c for c in res["cases"]}
    out = []
    for case, variant, unit, limit in TARGETS:
        v = (by_case.get(case) or {}).get("variants", {}).get(variant)
        got = ((v or {}).get("window", {}).get("per_step_us") or {}).get("p50")
        if got is None or (unit == "x floor" and not floor):
            out.append({"case": case, "variant": variant, "limit": limit, "unit": unit,
                        "measured": None, "pass": None})
            continue
        value = got / floor if unit == "x floor" else got
        out.append({"case": case, "variant": variant, "limit": limit, "unit": unit,
                    "measured": value, "pass": value <= limit})
    return out


def markdown(res: dict) -> str:
    gpu = res["device_clock"] == "cuda-events"
    unit = "us GPU" if gpu else "us CPU wall (Torch twins)"
    p = res["params"]
    lines = ["# Cost follows the work: step grids", "",
             f"Command: `{res['command']}`  ", f"Machine: {res['machine'].get('summary', '?')}  ",
             f"Clock: {res['device_clock']}. Window: p50 over {p['repeats']} windows of "
             f"{p['window']} back-to-back steps (GPU spun first, no sync inside); isolated: "
             f"p50 (p20-p80) of {p['samples']} samples, {p['flush_mib']} MiB L2 flush before "
             "each. Host: p50 (p20-p80).", ""]
    floor = res.get("floor") or {}
    fw = (floor.get("window") or {}).get("per_step_us")
    lines.append(f"Floor ({floor.get('kernel', '-')}): window {format_quantiles(fw)}, isolated "
                 f"{format_quantiles(floor.get('isolated_us'))} {unit}; host replay "
                 f"{format_quantiles(floor.get('host_us'))} us.")
    lines += ["", "## GPU time per step", "",
              f"| case | variant | programs | window, {unit} | x floor | isolated, {unit} | "
              "runner host, us |", "|---|---|---|---|---:|---|---|"]
    for c in res["cases"]:
        for name, v in c.get("variants", {}).items():
            x = v.get("x_floor_window")
            valid = v["window"].get("valid", True)
            lines.append(
                f"| {c['case']} | {name} | {v.get('programs')} | "
                f"{format_quantiles(v['window'].get('per_step_us'))}{'' if valid else ' (!)'} | "
                f"{'-' if x is None else f'{x:.2f}'} | "
                f"{format_quantiles(v.get('isolated_us'))} | "
                f"{format_quantiles(v.get('runner_host_us'))} |")
    lines += ["", "(!): a window whose spin ended before the host had enqueued it (GPU may "
              "have idled inside it).", "", "## Targets (window clock)", ""]
    if res["targets"]:
        lines += ["| case | variant | measured | limit | result |", "|---|---|---:|---:|---|"]
        for t in res["targets"]:
            m = "-" if t["measured"] is None else f"{t['measured']:.2f} {t['unit']}"
            r = "-" if t["pass"] is None else ("PASS" if t["pass"] else "FAIL")
            lines.append(f"| {t['case']} | {t['variant']} | {m} | {t['limit']} {t['unit']} | "
                         f"{r} |")
    else:
        lines.append("No verdict (no GPU).")
    lines += ["", f"## Host time of run() (StepGraph; target about {HOST_TARGET_US} us)", "",
              "| case | StepGraph | graphs | run() pipelined | run() cold | execute | "
              "mark_submitted |", "|---|---|---:|---|---|---|---|"]
    for case, h in res["host"].items():
        for label, r in h.items():
            lines.append(f"| {case} | {label} | {r['n_graphs']} | "
                         f"{format_quantiles(r['pipelined'])} | {format_quantiles(r['cold'])} | "
                         f"{format_quantiles(r['execute'])} | "
                         f"{format_quantiles(r['mark_submitted'])} |")
    lines += ["", "## Parts of a submission (host, us)", "", "| part | pipelined | cold |",
              "|---|---|---|"]
    for name, r in res["run_parts_us"].items():
        if "error" in r:
            lines.append(f"| {name} | {r['error']} | |")
        else:
            lines.append(f"| {name} | {format_quantiles(r['pipelined'])} | "
                         f"{format_quantiles(r['cold'])} |")
    if res["errors"] or res["skipped"]:
        lines += ["", "## Errors and skipped parts", ""]
        lines += [f"- error: {e['case']}: {e['error']}" for e in res["errors"]]
        lines += [f"- skipped: {s}" for s in res["skipped"]]
    return "\n".join(lines) + "\n"


# ---- run --------------------------------------------------------------------------------------
class Context:
    def __init__(self, args, device: torch.device, backend: str):
        self.args, self.params = args, args.params
        self.device, self.is_cuda, self.backend = device, device.type == "cuda", backend
        p = self.params
        self.window = p["window"]
        self.sampler = Sampler(device, n_samples=p["samples"], n_warmup=p["warmup"],
                               flush_mib=p["flush_mib"])
        self.spinner = Spinner() if self.is_cuda else None
        self.spin_ms = 4.0
        self.thrash = Thrash(p["thrash_mib"])
        self.results: dict = {}


def parse_args(argv):
    p = bench_parser(__doc__, os.path.join(REPO, "results", "bench", "grid"),
                     "auto: triton on CUDA, torch (the twins) on the CPU")
    p.add_argument("--cases", help=f"comma-separated subset of {','.join(CASES)}")
    p.add_argument("--window", type=int, help="steps per GPU window (and descriptor buffers)")
    p.add_argument("--repeats", type=int, help="timed windows per variant")
    p.add_argument("--samples", type=int, help="isolated samples per variant")
    p.add_argument("--host-samples", type=int, help="pipelined run() samples")
    p.add_argument("--cold-samples", type=int, help="run() samples after heavy host work")
    p.add_argument("--thrash-mib", type=int, help="MiB the heavy host work writes")
    p.add_argument("--time-budget-s", type=float, default=100.0,
                   help="parts not started by then are skipped (outputs are still written)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    params = dict(QUICK if args.quick else FULL)
    for key in ("window", "repeats", "samples", "host_samples", "cold_samples", "thrash_mib"):
        if getattr(args, key) is not None:
            params[key] = getattr(args, key)
    params["cases"] = tuple(args.cases.split(",")) if args.cases else CASES
    bad = set(params["cases"]) - set(CASES)
    if bad:
        p.error(f"unknown cases {sorted(bad)}; choose from {CASES}")
    args.params = params
    return args


def main(argv=None) -> int:
    return bench_main(argv, parse_args, _run)


def _run(args, argv, device, backend, note) -> int:
    ctx = Context(args, device, backend)
    res = ctx.results
    res.update({
        "command": " ".join(["python", os.path.relpath(__file__, REPO), *argv]),
        "machine": machine_info(device), "device_clock": ctx.sampler.clock, "backend": backend,
        "backend_note": note, "params": {k: list(v) if isinstance(v, tuple) else v
                                         for k, v in ctx.params.items()},
        "floor": None, "cases": [], "host": {}, "run_parts_us": {}, "errors": [],
        "skipped": []})
    if not ctx.is_cuda:
        res["skipped"].append("GPU-only parts (no CUDA device): graphs, node updates, one-warp "
                              "variant, CUDA events, L2 flush; device times are CPU wall clock")
    t_start = time.perf_counter()
    bar = progress(2 + 2 * len(ctx.params["cases"]), "bench_grid", not args.no_progress,
                   unit="part")

    def part(label, fn):
        try:
            return _part(label, fn)
        finally:
            if bar is not None:
                bar.update(1)

    def _part(label, fn):
        if time.perf_counter() - t_start > args.time_budget_s:
            res["skipped"].append(f"{label}: time budget of {args.time_budget_s:.0f} s spent")
            return None
        t0 = time.perf_counter()
        try:
            out = fn()
            say(bar, f"{label}: done ({time.perf_counter() - t0:.1f} s)")
            return out
        except Exception as exc:
            res["errors"].append({"case": label, "error": f"{type(exc).__name__}: {exc}",
                                  "traceback": traceback.format_exc()})
            say(bar, f"{label}: FAILED {type(exc).__name__}: {exc}")
            ctx.sampler.release_memory()
            return None

    res["floor"] = part("floor", lambda: measure_floor(ctx))
    res["run_parts_us"] = part("run parts", lambda: run_parts(ctx)) or {}
    for case in ctx.params["cases"]:
        rec = part(f"{case} (GPU variants)", lambda case=case: gpu_case(ctx, case))
        if rec is not None:
            res["cases"].append(rec)
    for case in ctx.params["cases"]:
        rec = part(f"{case} (host run())", lambda case=case: host_case(ctx, case))
        if rec is not None:
            res["host"][case] = rec
    if bar is not None:
        bar.close()
    res["targets"] = verdicts(res)
    res["wall_s"] = time.perf_counter() - t_start
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_grid.json"), "w") as f:
        json.dump(res, f, indent=1)
    with open(os.path.join(args.out, "bench_grid.md"), "w") as f:
        f.write(markdown(res))
    print(f"wrote {args.out}/bench_grid.json and bench_grid.md ({res['wall_s']:.0f} s)",
          file=sys.stderr)
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
