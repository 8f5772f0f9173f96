"""The host step's fixed cost: the Python between a caller and the compiled planner is a
fixed number of calls, whatever the number of rows and whatever form they come in.

Counted, not timed: ``sys.setprofile``'s ``call`` events (every Python frame entered) during
one decode + eviction step through ``alloc.step`` and through a ``scheduler_step()`` block,
rows as a list and as an int64 array, at B = 16 and B = 256 running requests. The counts
must be equal at both sizes (no Python loop over rows) and at most 30 (issue 34's bound;
``benchmarks/bench_host_step.py`` reports them). Needs the compiled planner and the compiled
input conversion (skipped without them: the numpy planner's cost is per row by design).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import graphalloc as ga
from graphalloc.device.executor import Executor
from graphalloc.plan import compiled
from graphalloc.plan import step as step_module

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_host_step import count_calls as frames  # noqa: E402  (the benchmark's counter)

pytestmark = pytest.mark.skipif(
    not compiled.AVAILABLE or step_module.normalize_fast is None,
    reason="the compiled planner or graphalloc._cinputs was not built")

MAX_CALLS = 30


class Null(Executor):
    """Runs nothing: the count is the host path's."""

    name = "null"
    stamps_steps = False

    def execute(self, planned) -> None:
        return None


def running(batch: int, executor=None) -> tuple[ga.HybridAllocator, list[int]]:
    cfg = ga.AllocatorConfig(page_size=4, num_full_pages=batch * 8 + 8,
                             num_swa_pages=batch * 4 + 8, max_reqs=batch + 1,
                             max_context_len=64, model_window=8, device="cpu", backend="torch",
                             max_step_tokens=batch * 10 + 16)
    alloc = ga.HybridAllocator(cfg, executor=Null() if executor is None else executor)
    rows = [alloc.admit() for _ in range(batch)]
    alloc.step(extend=(rows, 10))
    return alloc, rows


def counts(batch: int) -> dict:
    alloc, rows = running(batch)
    out = {}
    for form, r in (("list", list(rows)), ("ndarray", np.array(rows, dtype=np.int64))):
        alloc.step(evict_all=True, decode=r)  # (first-call caches filled)
        out[f"step/{form}"] = frames(lambda r=r: alloc.step(evict_all=True, decode=r))

        def block(r=r):
            with alloc.scheduler_step() as it:
                it.evict_all()
                it.decode(r)
        block()
        out[f"scheduler_step/{form}"] = frames(block)
    assert alloc.seq_len(rows[0]) == 18  # 10 + 8 steps of one token
    return out


def test_a_decode_and_eviction_step_is_a_fixed_number_of_python_calls():
    small, large = counts(16), counts(256)
    assert small == large, (small, large)
    assert max(small.values()) <= MAX_CALLS, small


def test_the_count_sees_a_python_loop_over_rows(monkeypatch):
    """The counter's teeth: the Python conversion path (compiled half off) loops over a
    list's elements, and the count grows with B."""
    from graphalloc import inputs
    from graphalloc.plan import pipeline
    for module, name in ((step_module, "normalize_fast"), (pipeline, "normalize_fast"),
                         (inputs, "_int64_list")):
        monkeypatch.setattr(module, name, None)
    alloc16, rows16 = running(16)
    alloc256, rows256 = running(256)
    n16 = frames(lambda: alloc16.step(evict_all=True, decode=list(rows16)))
    n256 = frames(lambda: alloc256.step(evict_all=True, decode=list(rows256)))
    assert n256 > n16 + 200
