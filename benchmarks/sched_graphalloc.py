"""graphalloc's side of the scheduler benchmark: one allocator step per scheduler iteration.

:class:`GraphallocDriver` replays a :class:`sched_workload.TraceStep` through the public
API only, as ONE ``alloc.step(...)`` per iteration (``api="context"`` records the same
step in one ``alloc.scheduler_step()`` block)::

    rows = alloc.free_row(...)                     rows of new requests (host query)
    alloc.step(release=rows, evict=rows,           frees (window rule for the evictions),
               admit=rows, decode=rows,            admits, allocations:
               extend=(rows, chunks))              ONE plan, ONE replay

The executor is graphalloc's :class:`~graphalloc.StepGraph` subclassed only to put the
benchmark's clock (CUDA events) around its ``execute`` -- the replay alone, planning
outside -- and to keep the step's :class:`~graphalloc.PlannedStep` (its page counts).
With ``tables=True`` the same step also writes the attention block tables of its batch
(``HybridAllocator(page_tables=PageTableSpec(forms=("block_table",)))``, FULL and SWA
layers, like the vLLM baseline's upload): the planner writes the batch's lane rows into
the step's descriptor and the tables' kernel is a node of the same graph. Without CUDA
both run eagerly.

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


def _timed_graph():
    """The executor class (defined on first use: graphalloc imports Triton kernels, and the
    scripts settle TRITON_INTERPRET before that)."""
    from graphalloc import StepGraph

    class TimedStepGraph(StepGraph):
        """graphalloc's StepGraph; the driver's clock around each replay (the allocator's
        step and, with page tables, the tables' kernel: one graph)."""

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

    return TimedStepGraph


class GraphallocDriver:
    """One allocator replaying the trace (module docstring). ``last_counts`` = (FULL
    allocated, SWA allocated, FULL freed, SWA freed) of the last step, from its
    ``PlannedStep``; ``plan_ns``: the last step's host work before the executor call
    (normalise + plan + descriptor write)."""

    def __init__(self, cfg, *, n_requests: int, tables: bool = False, api: str = "step",
                 prefix_cache: bool = False):
        from graphalloc import HybridAllocator
        from graphalloc.attention.spec import PageTableSpec

        if api not in ("step", "context"):
            raise ValueError(f"api must be 'step' or 'context', got {api!r}")
        if prefix_cache:
            raise NotImplementedError(
                "graphalloc's prefix cache is not wired into this driver yet: run it with "
                "prefix_cache=False (cached prefixes allocated as fresh tokens)")
        self.api = api
        self.prefix_cache = False
        self.name = "graphalloc_tables" if tables else "graphalloc"
        self.config = cfg
        self.row_of = np.full(n_requests, -1, dtype=np.int64)
        self.executor = _timed_graph()()
        spec = (PageTableSpec(max_batch=cfg.max_alloc_rows, forms=("block_table",),
                              layers=("full", "swa")) if tables else None)
        self.alloc = HybridAllocator(cfg, executor=self.executor, page_tables=spec)
        self.tables = self.alloc.tables
        self.table_mode = (None if not tables else
                           "allocator + tables in one CUDA graph per bucket and descriptor "
                           "buffer" if cfg.device.type == "cuda" else "eager launches (no CUDA)")
        self.plan_ns = 0

    def step(self, st, clock) -> None:
        """The iteration as ONE step: releases, evictions, admits (rows reserved here),
        decodes and the prefill chunks; with page tables, the batch's tables too."""
        alloc, row_of, ex = self.alloc, self.row_of, self.executor
        ex.clock = clock
        new = st.admit.tolist()
        reserved = []
        for rid in new:
            reserved.append(alloc.free_row(reserved))
            row_of[rid] = reserved[-1]
        decode = row_of[st.decode] if len(st.decode) else None
        extend = row_of[st.extend_ids] if len(st.extend_ids) else None
        release = row_of[st.release] if len(st.release) else None
        evict = row_of[st.evict] if len(st.evict) else None
        t_body = time.perf_counter_ns()
        if self.api == "step":
            alloc.step(release=release, evict=evict,
                       admit=np.array(reserved, dtype=np.int64) if reserved else None,
                       decode=decode,
                       extend=None if extend is None else (extend, st.extend_n_nocache))
        else:
            with alloc.scheduler_step() as it:
                if release is not None:
                    it.release(release)
                if evict is not None:
                    it.evict(evict)
                for _ in reserved:
                    it.admit()
                if decode is not None:
                    it.decode(decode)
                if extend is not None:
                    it.extend(extend, st.extend_n_nocache)
                t_body = time.perf_counter_ns()
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
        return self.alloc.ring.stalls

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


if __name__ == "__main__":  # a module, not a script: --help says what it is and what to run
    import argparse

    _ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=(
            "A module imported by other scripts; run benchmarks/bench_scheduler.py "
            "instead (each takes --help)."))
    _ap.parse_args()
    _ap.error("nothing to run here: see --help")
