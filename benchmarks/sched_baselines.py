"""The scheduler benchmark's two baselines, written from the engines' documented behaviour.

Both replay a :class:`sched_workload.TraceStep` per scheduler iteration, keep their own
lengths and frontiers, and report the pages they allocated and freed
(``last_counts`` = FULL allocated, SWA allocated, FULL freed, SWA freed), which the
benchmark compares with graphalloc's and the trace's step by step.

The two live in their own modules; this one gathers them (and the shared kernels) under
the names the benchmark and its tests import:

    sched_sglang_style.SGLangStyle   SGLang's paged SWA allocator, as eager calls
    sched_vllm_style.VLLMStyle       vLLM v1's CPU block manager and block-table upload
    sched_baseline_kernels           the clock protocol, the SGLang-style allocation
                                     kernels and their Torch twins, pinned host buffers

Each module's docstring says what its baseline does per iteration and where it departs
from the engine (always in the baseline's favour, or stated).
"""

from __future__ import annotations

from sched_baseline_kernels import (
    BLOCK_T,
    M_LANE,
    M_N,
    M_PAGE,
    M_PRE,
    M_PREV,
    M_ROW,
    N_META,
    NULL_CLOCK,
    NullClock,
    alloc_slots,
    alloc_slots_torch,
    write_rows,
    write_rows_torch,
)
from sched_sglang_style import SGLangStyle
from sched_vllm_style import VLLMStyle

__all__ = ["SGLangStyle", "VLLMStyle", "NullClock", "NULL_CLOCK", "alloc_slots", "write_rows",
           "alloc_slots_torch", "write_rows_torch", "BLOCK_T", "N_META", "M_ROW", "M_PRE",
           "M_N", "M_PREV", "M_LANE", "M_PAGE"]


if __name__ == "__main__":  # a module, not a script: --help says what it is and what to run
    import argparse

    _ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=(
            "A module imported by other scripts; run benchmarks/bench_scheduler.py "
            "instead (each takes --help)."))
    _ap.parse_args()
    _ap.error("nothing to run here: see --help")
