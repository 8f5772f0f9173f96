"""graphalloc's side of the scheduler benchmark: one allocator step per scheduler iteration.

:class:`GraphallocDriver` replays a :class:`sched_workload.TraceStep` through the public
API only, as ONE ``alloc.step(...)`` per iteration (the compiled planner's fast path;
``api="context"`` uses one ``alloc.scheduler_step()`` block instead, the numpy planner)::

    row = alloc.admit()                            rows of new requests (host only, O(1))
    alloc.step(release=rows, evict=rows,           frees (window rule for the evictions)
               decode=rows, extend=(rows, chunks)) allocations: ONE plan, ONE replay

The executor is graphalloc's :class:`~graphalloc.StepGraph` subclassed only to put the
benchmark's clock (CUDA events) around its ``execute`` -- the replay alone, planning
outside -- and to keep the step's :class:`~graphalloc.PlannedStep` (its page counts).
With ``tables=True`` the step also writes the attention block tables of the step's batch
(``graphalloc.attention.page_tables.PageTables``, block-table form, FULL and SWA layers, like the
vLLM baseline's upload): an executor whose ``execute`` plans the tables
(``PageTables.plan`` over ``alloc.seq_lens()`` / ``alloc.frontiers()``, the ledger
after the step's plan) and replays ONE graph holding the allocator's launch and the
tables' launch, captured per descriptor buffer and launch form (fused or not). Without
CUDA both run eagerly.

The allocator is sized from the trace with :meth:`graphalloc.AllocatorConfig.for_engine`
(:func:`engine_config`): the engine's budgets (B running requests, the chunked-prefill
budget, context, page size, the model window), pools of the trace's peak usage plus a
margin, ``max_reqs`` = B + the most releases of one step; where the trace needs more
release lanes or rows in one step than ``for_engine``'s every-step-eviction sizing gives
(eviction every 128 tokens frees more per step), those two shapes are raised to the
trace's need (``AllocatorConfig`` is a dataclass; ``dataclasses.replace`` re-validates).

Prefix workloads (``sched_workload``'s ``prefix``): the driver runs with its prefix cache
OFF (``prefix_cache=False``, the only value for now): an admission allocates its cached
prefix as fresh tokens with its first chunk (``TraceStep.extend_n_nocache``), and the
trace's sizes are that replay's; where such a chunk needs more tokens per row or per step
than ``for_engine`` gives, ``max_tokens_per_alloc_row`` / ``max_step_tokens`` are raised
to the trace's need as above. graphalloc's own prefix cache (match / insert / admit on a
cached prefix) is wired here later by the API's owner.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import torch

__all__ = ["engine_config", "GraphallocDriver", "pool_pages", "SHAPES"]

SHAPES = ("num_full_pages", "num_swa_pages", "max_reqs", "max_release_rows",
          "max_pages_per_row", "max_alloc_rows", "max_tokens_per_alloc_row", "max_step_pages",
          "max_step_tokens", "sliding_window")


class _NoClock:
    def device_begin(self) -> None:
        pass

    def device_end(self) -> None:
        pass


_NO_CLOCK = _NoClock()
_NO_ROWS = np.zeros(0, dtype=np.int64)


def pool_pages(trace) -> tuple[int, int]:
    """FULL and SWA pool sizes for a trace: its peaks plus 2% (at least 16 pages)."""
    return (trace.peak_full + max(16, trace.peak_full // 50),
            trace.peak_swa + max(16, trace.peak_swa // 50))


def engine_config(trace, device, backend: str):
    """``(config, notes)``: the allocator config for ``trace`` (module docstring)."""
    from graphalloc import AllocatorConfig

    spec = trace.spec
    n_full, n_swa = pool_pages(trace)
    cfg = AllocatorConfig.for_engine(
        max_running_requests=spec.n_running, chunked_prefill_size=spec.chunk_tokens,
        max_context_len=spec.max_context_len, page_size=spec.page_size,
        model_sliding_window=spec.window, num_full_pages=n_full, num_swa_pages=n_swa,
        max_reqs=spec.n_running + max(1, trace.max_releases), device=device, backend=backend)
    notes = {}
    bump = {}
    if trace.max_free_lanes > cfg.max_step_pages:
        bump["max_step_pages"] = trace.max_free_lanes
    if trace.max_release_rows > cfg.max_release_rows:
        bump["max_release_rows"] = trace.max_release_rows
    if trace.max_alloc_row_tokens > cfg.max_tokens_per_alloc_row:  # prefix: hit + chunk
        bump["max_tokens_per_alloc_row"] = trace.max_alloc_row_tokens
    if trace.max_step_tokens > cfg.max_step_tokens:
        bump["max_step_tokens"] = trace.max_step_tokens
    if bump:
        notes["raised_from_for_engine"] = {k: [getattr(cfg, k), v] for k, v in bump.items()}
        cfg = dataclasses.replace(cfg, **bump)
    return cfg, notes


def _executors():
    """The two executor classes (defined on first use: graphalloc imports Triton kernels,
    and the scripts settle TRITON_INTERPRET before that)."""
    from graphalloc import StepGraph
    from graphalloc.device.executor import Executor, warm_up

    class TimedStepGraph(StepGraph):
        """graphalloc's StepGraph; the driver's clock around each replay."""

        def __init__(self):
            super().__init__()
            self.clock, self.last = _NO_CLOCK, None
            self.t_exec = 0

        def execute(self, planned) -> None:
            self.t_exec = time.perf_counter_ns()
            self.last = planned
            self.clock.device_begin()
            super().execute(planned)
            self.clock.device_end()

    class TablesExecutor(Executor):
        """Allocator step + the batch's page tables, one replay per step (module
        docstring). ``batch``: the step's attention rows, set by the driver."""

        name = "graph+tables"

        def __init__(self):
            super().__init__()
            self.clock, self.last, self.tables = _NO_CLOCK, None, None
            self.batch = np.zeros(0, dtype=np.int64)
            self.graphs: dict = {}
            self.mode = "eager launches (no CUDA)"
            self.t_exec = 0

        def bind(self, alloc) -> None:
            super().bind(alloc)
            if alloc.config.device.type == "cuda":
                warm_up(alloc)  # every kernel variant compiled now, as EagerExecutor

        def body(self, i: int, fusable: bool) -> None:
            self.alloc.launch(i, fusable=fusable)
            self.tables.launch(i)

        def attach(self, tables) -> None:
            self.tables = tables
            if self.alloc.config.device.type != "cuda":
                return
            try:
                self._capture()
            except Exception as exc:  # keep going with eager launches, and say so
                self.graphs.clear()
                torch.cuda.synchronize()
                self.mode = (f"eager launches: capturing allocator + tables failed "
                             f"({type(exc).__name__}: {exc})")

        def _capture(self) -> None:
            from graphalloc import capture_graph

            alloc, pt = self.alloc, self.tables
            empty = np.zeros(0, dtype=np.int64)
            torch.cuda.synchronize()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up: empty steps (all rows padded)
                for _ in range(2 * len(alloc.ring)):
                    p = alloc.plan()
                    tp = pt.plan(empty, alloc.seq_lens(), alloc.frontiers())
                    self.body(p.buffer_index, False)
                    alloc.mark_submitted(p)
                    pt.mark_submitted(tp)
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            forms = (False, True) if alloc.kernels.fused else (False,)
            pool = None
            for i in range(len(alloc.ring)):
                for fusable in forms:
                    g = capture_graph(lambda i=i, f=fusable: self.body(i, f), pool=pool)
                    pool = g.pool()
                    self.graphs[(i, fusable)] = g
            torch.cuda.synchronize()
            if pt.next_index != alloc.ring.next_index:
                raise RuntimeError("page-table ring and descriptor ring out of step")
            self.mode = (f"allocator + tables in one CUDA graph per descriptor buffer and "
                         f"launch form ({len(self.graphs)} graphs)")

        def execute(self, planned) -> None:
            self.t_exec = time.perf_counter_ns()
            self.last = planned
            alloc, pt = self.alloc, self.tables
            tp = pt.plan(self.batch, alloc.seq_lens(), alloc.frontiers())
            i = planned.buffer_index
            if tp.buffer_index != i:
                raise RuntimeError(f"page tables planned into buffer {tp.buffer_index}, the "
                                   f"step into {i}: the rings must move together")
            fused = planned.fusable and alloc.kernels.fused
            self.clock.device_begin()
            if self.graphs:
                self.graphs[(i, fused)].replay()
            else:
                self.body(i, planned.fusable)
            self.clock.device_end()
            pt.mark_submitted(tp)
            self.count(fused)

    return TimedStepGraph, TablesExecutor


class GraphallocDriver:
    """One allocator replaying the trace (module docstring). ``last_counts`` = (FULL
    allocated, SWA allocated, FULL freed, SWA freed) of the last step, from its
    ``PlannedStep``; ``plan_ns``: the last step's planning alone (from the block's end to
    the executor call)."""

    def __init__(self, cfg, *, n_requests: int, tables: bool = False, api: str = "step",
                 prefix_cache: bool = False):
        from graphalloc import HybridAllocator

        if api not in ("step", "context"):
            raise ValueError(f"api must be 'step' or 'context', got {api!r}")
        if prefix_cache:
            raise NotImplementedError(
                "graphalloc's prefix cache is not wired into this driver yet: run it with "
                "prefix_cache=False (cached prefixes allocated as fresh tokens)")
        self.api = api
        self.prefix_cache = False

        timed_graph, tables_executor = _executors()
        self.name = "graphalloc_tables" if tables else "graphalloc"
        self.config = cfg
        self.row_of = np.full(n_requests, -1, dtype=np.int64)
        self.executor = tables_executor() if tables else timed_graph()
        self.alloc = HybridAllocator(cfg, executor=self.executor)
        self.tables = None
        self.table_mode = None
        if tables:
            from graphalloc.attention.page_tables import PageTables

            self.tables = PageTables.for_allocator(
                self.alloc, cfg.max_alloc_rows, forms=("block_table",),
                layers=("full", "swa"), n_bufs=len(self.alloc.ring))
            self.executor.attach(self.tables)
            self.table_mode = self.executor.mode
        self.plan_ns = 0

    def step(self, st, clock) -> None:
        if self.api == "step":
            return self._step_call(st, clock)
        alloc, row_of, ex = self.alloc, self.row_of, self.executor
        ex.clock = clock
        with alloc.scheduler_step() as it:
            if len(st.release):
                it.release(row_of[st.release])
            if len(st.evict):
                it.evict(row_of[st.evict])
            for rid in st.admit.tolist():
                row_of[rid] = it.admit()
            decode = row_of[st.decode] if len(st.decode) else None
            if decode is not None:
                it.decode(decode)
            extend = row_of[st.extend_ids] if len(st.extend_ids) else None
            if extend is not None:
                it.extend(extend, st.extend_n_nocache)
            if self.tables is not None:
                parts = [a for a in (decode, extend) if a is not None]
                ex.batch = (parts[0] if len(parts) == 1 else np.concatenate(parts) if parts
                            else _NO_ROWS)
            t_body = time.perf_counter_ns()
        self.plan_ns = ex.t_exec - t_body
        ex.clock = _NO_CLOCK
        if len(st.release):
            row_of[st.release] = -1

    def _step_call(self, st, clock) -> None:
        """The iteration as admits (host only) and ONE ``alloc.step``."""
        alloc, row_of, ex = self.alloc, self.row_of, self.executor
        ex.clock = clock
        for rid in st.admit.tolist():
            row_of[rid] = alloc.admit()
        decode = row_of[st.decode] if len(st.decode) else None
        extend = row_of[st.extend_ids] if len(st.extend_ids) else None
        if self.tables is not None:
            parts = [a for a in (decode, extend) if a is not None]
            ex.batch = (parts[0] if len(parts) == 1 else np.concatenate(parts) if parts
                        else _NO_ROWS)
        t_body = time.perf_counter_ns()
        alloc.step(release=row_of[st.release] if len(st.release) else None,
                   evict=row_of[st.evict] if len(st.evict) else None, decode=decode,
                   extend=None if extend is None else (extend, st.extend_n_nocache))
        self.plan_ns = ex.t_exec - t_body
        ex.clock = _NO_CLOCK
        if len(st.release):
            row_of[st.release] = -1

    @property
    def last_counts(self) -> tuple:
        p = self.executor.last
        if p is None:
            return (0, 0, 0, 0)
        return (p.pages_allocated["full"], p.pages_allocated["swa"], p.pages_freed["full"],
                p.pages_freed["swa"])

    @property
    def stalls(self) -> int:
        return self.alloc.ring.stalls + (self.tables.stalls if self.tables else 0)

    def verify(self, live_ids, audit: bool = True) -> dict:
        """``check()`` (the device error word) and, when ``audit``, ``audit()`` (every
        device table against the host mirror). Reads the device."""
        self.alloc.check(sync=True)
        out = {"device_faults": 0}
        if audit:
            findings = self.alloc.audit()
            out["audit_findings"] = len(findings)
            out["audit_first"] = [str(f) for f in findings[:3]]
        else:
            out["audit_findings"] = None
        out["live_rows"] = int(self.alloc.n_live)
        out["live_expected"] = len(live_ids)
        out["ok"] = (out["audit_findings"] in (0, None)) and out["live_rows"] == len(live_ids)
        return out

    def shapes(self) -> dict:
        return {k: getattr(self.config, k) for k in SHAPES}

    def close(self) -> None:
        ex = self.executor
        for name in ("graphs", "fused_graphs"):
            graphs = getattr(ex, name, None)
            if graphs is not None:
                graphs.clear()
