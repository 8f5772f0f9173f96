"""graphalloc's side of the benchmark: an allocator whose every step frees B real segments.

``StepWorkload(B, ps, n_pages, decode=...)`` admits B requests and fills each,
once and untimed, far enough that ``n_steps`` steps can each move every
request's SWA frontier forward by ``n_pages`` pages::

    request r, positions                 after the fill      after k steps
    [0, k * n_pages * ps)                FULL + SWA          FULL only (SWA freed)
    [k * n_pages * ps, L)                FULL + SWA          FULL + SWA

A step is ``plan(advance=(rows, frontier + n_pages * ps))`` -- the engine's own
segment frees, one segment of ``n_pages`` live pages per request, B requests --
plus, with ``decode=True``, one decode token per request in the same step.
Request r starts at length ``L0 + r % ps``, so about B / ps decode tokens per
step start a page (pop one FULL and one SWA page) and the rest continue one.

The frozen shape is as tight as the step: ``max_release_rows`` = B rows (times
the rows a segment splits into at ``row_pages`` pages per row),
``max_step_pages`` = B * n_pages. ``fused_step`` is off by default here, so
``bench_frees`` times the two-kernel step graph (``bench_fused`` compares both).
``max_step_tokens`` is a token budget (it
bounds the fill's steps and the decode tokens; the Triton kernels launch one
program per descriptor row, so it does not change the timed grid).
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["StepWorkload"]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class StepWorkload:
    """One allocator (+ :class:`graphalloc.StepGraph`) serving ``n_steps`` timed steps.

    ``plan()`` and ``run(planned)`` are the two host stages of a step (planning with the
    descriptor write, then the replay); ``graph`` is the captured step graph (None on CPU).
    """

    def __init__(self, n_reqs: int, page_size: int, n_pages: int, *, decode: bool, device,
                 backend: str, n_steps: int, token_budget: int, row_pages: int,
                 window_pages: int = 4, fused_step: bool = False):
        from graphalloc import AllocatorConfig, HybridAllocator

        ps = page_size
        self.n_reqs, self.page_size, self.n_pages, self.decode = n_reqs, ps, n_pages, decode
        self.n_steps = n_steps
        self.grow = n_pages * ps  # frontier move per step, tokens
        window = window_pages * ps
        fill = n_steps * self.grow + window
        context = fill + n_steps * int(decode) + 2 * ps
        pages_per_req = _ceil_div(context, ps) + 1
        row_cap = max(1, min(n_pages, row_pages))
        budget = max(token_budget, n_reqs)
        shape = dict(
            page_size=ps, num_full_pages=n_reqs * pages_per_req,
            num_swa_pages=n_reqs * pages_per_req, max_reqs=n_reqs, max_context_len=context,
            sliding_window=window, index_dtype=torch.int64, device=device, backend=backend,
            max_pages_per_row=row_cap, max_alloc_rows=n_reqs,
            max_tokens_per_alloc_row=min(context, budget // min(n_reqs, 16)),
            max_step_tokens=budget)
        # As tight as the step allows, but never below what releasing one request needs (the
        # config refuses shapes that could leave a request unreleasable).
        need = AllocatorConfig(**shape)
        self.config = AllocatorConfig(
            **shape, max_release_rows=max(n_reqs * _ceil_div(n_pages, row_cap),
                                          need.min_release_rows),
            max_step_pages=max(n_reqs * n_pages, need.min_step_pages))
        self.alloc = HybridAllocator(self.config, fused_step=fused_step, executor="graph")
        self.step_graph = self.alloc.executor  # graphalloc.StepGraph
        self.rows = np.array([self.alloc.admit() for _ in range(n_reqs)], dtype=np.int64)
        phase = np.arange(n_reqs, dtype=np.int64) % ps if decode else 0
        self._fill(np.full(n_reqs, fill, dtype=np.int64) + phase)
        self.frontier = np.zeros(n_reqs, dtype=np.int64)  # the engine's own copy
        self.steps_done = 0
        self.swa_pages_freed = 0
        self.fill_steps = self.alloc.steps_run

    @property
    def graph(self):
        graphs = self.step_graph.graphs
        return graphs[0] if graphs else None

    def _fill(self, n_tokens: np.ndarray) -> None:
        """Untimed: extend every request by ``n_tokens[i]``, in steps within the frozen shape."""
        cfg = self.config
        left = n_tokens.copy()
        while left.any():
            piece = np.minimum(left, cfg.max_tokens_per_alloc_row)
            todo = np.flatnonzero(piece)
            take = todo[np.cumsum(piece[todo]) <= cfg.max_step_tokens]
            self.alloc.alloc_extend(self.rows[take], piece[take])
            left[take] -= piece[take]

    def plan(self, _=None):
        """Host stage 1: plan the step (validation, ledger, descriptor write)."""
        if self.steps_done >= self.n_steps:
            raise RuntimeError(f"workload sized for {self.n_steps} steps; raise n_steps")
        new = self.frontier + self.grow
        if self.decode:
            planned = self.alloc.plan(advance=(self.rows, new), decode=self.rows)
        else:
            planned = self.alloc.plan(advance=(self.rows, new))
        self.frontier = new
        self.steps_done += 1
        return planned

    def run(self, planned) -> None:
        """Host stage 2: launch the step (one graph replay on CUDA)."""
        self.alloc.run(planned)
        self.swa_pages_freed += planned.pages_freed["swa"]

    def step(self) -> None:
        self.run(self.plan())

    def verify(self, deep: bool = False) -> dict:
        """Every step freed B * n_pages live SWA pages and no device fault was recorded
        (reads the device error word: a sync). ``deep`` also runs check_integrity()."""
        self.alloc.check()
        if deep:
            self.alloc.check_integrity()
        expected = self.steps_done * self.n_reqs * self.n_pages
        if self.swa_pages_freed != expected:
            raise AssertionError(f"{self.swa_pages_freed} SWA pages freed over "
                                 f"{self.steps_done} steps, expected {expected}")
        return {"steps": self.steps_done, "swa_pages_freed": self.swa_pages_freed,
                "fill_steps": self.fill_steps, "descriptor_stalls": self.alloc.ring.stalls}

    def close(self) -> None:
        self.step_graph.graphs.clear()
        self.step_graph.fused_graphs.clear()
        self.alloc = None


if __name__ == "__main__":  # a module, not a script: --help says what it is and what to run
    import argparse

    _ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=(
            "A module imported by other scripts; run benchmarks/bench_frees.py (and"
            " bench_fused.py) instead (each takes --help)."))
    _ap.parse_args()
    _ap.error("nothing to run here: see --help")
