"""graphalloc's side of the scheduler benchmark: one allocator step per scheduler iteration.

:class:`GraphallocDriver` replays a :class:`sched_workload.TraceStep` through the public
API only::

    rows of new requests      alloc.admit()                 host only (pool mode)
    the iteration             p = alloc.plan(release=, evict=, decode=, extend=)
                              alloc.run(p)                  ONE graph replay (CUDA)

``plan`` + ``run`` is ``alloc.step(...)`` split in two, so the benchmark can put its CUDA
events around the replay alone. With ``tables=True`` the step also writes the attention
block tables of the step's batch (``graphalloc.page_tables.PageTables``, block-table form,
FULL and SWA layers, like the vLLM baseline's upload): the allocator's launch and the
tables' launch are captured into one CUDA graph per descriptor buffer (and per launch form,
fused or not), so the step is still one replay; the host adds ``PageTables.plan`` over the
batch (``alloc.seq_lens()``, ``alloc.frontiers()``). On a CPU both run eagerly.

The allocator is sized from the trace with :meth:`graphalloc.AllocatorConfig.for_engine`
(:func:`engine_config`): the engine's budgets (B running requests, the chunked-prefill
budget, context, page size, the model window), pools of the trace's peak usage plus a
margin, ``max_reqs`` = B + the most releases of one step; where the trace needs more
release lanes or rows in one step than ``for_engine``'s every-step-eviction sizing gives
(eviction every 128 tokens frees more per step), those two shapes are raised to the
trace's need (``AllocatorConfig`` is a dataclass; ``dataclasses.replace`` re-validates).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

__all__ = ["engine_config", "GraphallocDriver", "pool_pages"]

SHAPES = ("num_full_pages", "num_swa_pages", "max_reqs", "max_release_rows",
          "max_pages_per_row", "max_alloc_rows", "max_tokens_per_alloc_row", "max_step_pages",
          "max_step_tokens", "sliding_window")


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
    if bump:
        notes["raised_from_for_engine"] = {k: [getattr(cfg, k), v] for k, v in bump.items()}
        cfg = dataclasses.replace(cfg, **bump)
    return cfg, notes


class GraphallocDriver:
    """One allocator replaying the trace (module docstring). ``last_counts`` = (FULL
    allocated, SWA allocated, FULL freed, SWA freed) of the last step, from its
    ``PlannedStep``."""

    def __init__(self, cfg, *, n_requests: int, tables: bool = False):
        from graphalloc import HybridAllocator

        self.name = "graphalloc_tables" if tables else "graphalloc"
        self.config = cfg
        self.is_cuda = cfg.device.type == "cuda"
        self.row_of = np.full(n_requests, -1, dtype=np.int64)
        self.tables = None
        self.graphs: dict = {}
        self.table_mode = None
        # Without tables the allocator's own graph executor replays each step; with them
        # the driver captures allocator + tables into its own graphs (the eager executor
        # compiles every kernel at construction).
        self.alloc = HybridAllocator(cfg, executor="eager" if tables else "graph")
        if tables:
            from graphalloc.page_tables import PageTables

            self.tables = PageTables.for_allocator(
                self.alloc, cfg.max_alloc_rows, forms=("block_table",),
                layers=("full", "swa"), n_bufs=len(self.alloc.ring))
            self.table_mode = "eager launches (no CUDA)"
            if self.is_cuda:
                self._capture()
        self._planned = None

    # ---- tables: one graph per (descriptor buffer, launch form) -------------------------
    def _body(self, i: int, fusable: bool) -> None:
        self.alloc.launch(i, fusable=fusable)
        self.tables.launch(i)

    def _capture(self) -> None:
        from graphalloc import capture_graph

        alloc, pt = self.alloc, self.tables
        empty = np.zeros(0, dtype=np.int64)
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: empty steps (all rows padded), both rings
            for _ in range(2 * len(alloc.ring)):
                p = alloc.plan()
                tp = pt.plan(empty, alloc.seq_lens(), alloc.frontiers())
                self._body(p.buffer_index, False)
                alloc.mark_submitted(p)
                pt.mark_submitted(tp)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        forms = (False, True) if alloc.kernels.fused else (False,)
        pool = None
        for i in range(len(alloc.ring)):
            for fusable in forms:
                g = capture_graph(lambda i=i, f=fusable: self._body(i, f), pool=pool)
                pool = g.pool()
                self.graphs[(i, fusable)] = g
        torch.cuda.synchronize()
        if pt.next_index != alloc.ring.next_index:
            raise RuntimeError("page-table ring and descriptor ring out of step after capture")
        self.table_mode = (f"allocator + tables in one CUDA graph per descriptor buffer and "
                           f"launch form ({len(self.graphs)} graphs)")

    # ---- one scheduler iteration -----------------------------------------------------
    def step(self, st, clock) -> None:
        alloc, row_of = self.alloc, self.row_of
        for rid in st.admit.tolist():
            row_of[rid] = alloc.admit()
        release = row_of[st.release] if len(st.release) else None
        evict = row_of[st.evict] if len(st.evict) else None
        decode = row_of[st.decode] if len(st.decode) else None
        extend = (row_of[st.extend_ids], st.extend_n) if len(st.extend_ids) else None
        p = alloc.plan(release=release, evict=evict, decode=decode, extend=extend)
        pt = self.tables
        if pt is None:
            clock.device_begin()
            alloc.run(p)
            clock.device_end()
        else:
            parts = [a for a in (decode, None if extend is None else extend[0])
                     if a is not None]
            batch = parts[0] if len(parts) == 1 else (
                np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64))
            tp = pt.plan(batch, alloc.seq_lens(), alloc.frontiers())
            i = p.buffer_index
            if tp.buffer_index != i:
                raise RuntimeError(f"page tables planned into buffer {tp.buffer_index}, the "
                                   f"step into {i}: the rings must move together")
            clock.device_begin()
            if self.graphs:
                self.graphs[(i, p.fusable and alloc.kernels.fused)].replay()
            else:
                self._body(i, p.fusable)
            clock.device_end()
            alloc.mark_submitted(p)
            pt.mark_submitted(tp)
        for rid in st.release.tolist():
            row_of[rid] = -1
        self._planned = p

    @property
    def last_counts(self) -> tuple:
        p = self._planned
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
        self.graphs.clear()
        executor = self.alloc.executor
        for name in ("graphs", "fused_graphs"):
            if hasattr(executor, name):
                getattr(executor, name).clear()
