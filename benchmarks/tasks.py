"""The measurements of bench_frees.py, one function per task; each appends to ``ctx.results``.

``ctx`` is bench_frees' Context: ``sampler`` (timing.Sampler), ``impls`` (the
baseline free callables by name), ``workload()`` (a graphalloc StepWorkload
sized for the sample loops), ``params`` and ``results``.
"""

from __future__ import annotations

import cProfile
import os
import pstats

import numpy as np
from baselines import DecodeTables, FreeTables, eager_get_and_clear_swa_pages
from timing import (
    copy_bandwidth_gbs,
    count_launches,
    graph_nodes,
    measure_floor,
    replayable,
    summarize,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INDEX_BYTES = 8  # int64 indices throughout

__all__ = ["task_floor", "task_bandwidth", "task_single", "task_step", "task_profile",
           "task_traces", "clear_bytes"]


def measure_eager_like(ctx, fn, restore, *, launches=True, nodes=True) -> dict:
    """Host enqueue time, launches and GPU interval (graph replay) of an eager callable."""
    s = ctx.sampler
    rec = {"cpu_us": summarize(s.host_us(fn))}
    if launches:
        rec["launches"] = count_launches(fn, ctx.is_cuda)
    call, graph = replayable(fn, ctx.is_cuda)
    rec["gpu_us"] = summarize(s.device_us(lambda _: call(), before=restore))
    if nodes:
        rec["graph"] = graph_nodes(graph)
    return rec


def measure_graphalloc(ctx, wl, *, launches=True) -> dict:
    """Host time (plan, replay, both), launches and GPU interval of a workload's steps."""
    s = ctx.sampler
    plan_us, run_us = s.host_stages_us([wl.plan, wl.run])
    rec = {"cpu_us": summarize(np.add(plan_us, run_us)), "plan_us": summarize(plan_us),
           "run_us": summarize(run_us)}
    if launches:
        rec["launches"] = count_launches(wl.step, ctx.is_cuda)
    rec["gpu_us"] = summarize(s.device_us(wl.run, before=wl.plan))
    rec["graph"] = graph_nodes(wl.graph)
    rec["workload"] = wl.verify(deep=not ctx.is_cuda)
    rec["frozen_shape"] = {k: getattr(wl.config, k) for k in (
        "max_release_rows", "max_pages_per_row", "max_step_pages", "max_alloc_rows",
        "max_step_tokens")}
    return rec


def task_floor(ctx, key="floor"):
    ctx.results[key] = measure_floor(ctx.sampler)


def task_bandwidth(ctx):
    ctx.results["copy_bandwidth"] = copy_bandwidth_gbs(ctx.sampler,
                                                       ctx.params["copy_mib"] * 2**20)


def clear_bytes(n_pages: int, ps: int) -> int:
    """Bytes a free of n_pages moves: per page one representative read, one peer read,
    ps cleared entries, one SWA page write (index-sized each)."""
    return n_pages * (ps + 3) * INDEX_BYTES


def task_single(ctx, ps, n_pages):
    tables = FreeTables(1, n_pages, ps, ctx.device, seed=ps * 7919 + n_pages)
    reps, f2s = tables.representatives[0], tables.full_to_swa
    for name, free in ctx.impls:
        rec = {"impl": name, "page_size": ps, "pages": n_pages}
        rec.update(measure_eager_like(ctx, lambda free=free: free(reps, f2s, ps), tables.restore))
        ctx.results["single_free"].append(rec)
    tables = reps = f2s = None  # free the baseline tables before the workload's
    wl = ctx.workload(1, ps, n_pages, decode=False)
    try:
        rec = {"impl": "graphalloc", "page_size": ps, "pages": n_pages}
        rec.update(measure_graphalloc(ctx, wl))
        ctx.results["single_free"].append(rec)
    finally:
        wl.close()
    for rec in ctx.results["single_free"]:
        if rec["page_size"] == ps and rec["pages"] == n_pages and rec.get("gpu_us"):
            n_bytes = clear_bytes(n_pages, ps)
            rec["clear_bytes"] = n_bytes
            rec["clear_gb_per_s"] = n_bytes / (rec["gpu_us"]["p50"] * 1e3)


def task_step(ctx, n_reqs, ps, n_pages, decode):
    p = ctx.params
    count = ps == p["step_ps"][0] and n_pages == p["step_pages"][0]  # launches: per B only
    base = {"B": n_reqs, "page_size": ps, "pages": n_pages, "decode": decode}
    _step_baselines(ctx, base, count)  # its tables are freed on return
    ctx.sampler.release_memory()
    wl = ctx.workload(n_reqs, ps, n_pages, decode)
    try:
        rec = {"impl": "graphalloc", **base}
        rec.update(measure_graphalloc(ctx, wl, launches=count))
        ctx.results["steps"].append(rec)
    finally:
        wl.close()


def _step_baselines(ctx, base, count):
    n_reqs, ps, n_pages = base["B"], base["page_size"], base["pages"]
    tables = FreeTables(n_reqs, n_pages, ps, ctx.device, seed=n_reqs * 31 + ps + n_pages)
    dec = DecodeTables(n_reqs, ps, ctx.device) if base["decode"] else None
    for name, free in ctx.impls:
        def step(free=free):
            tables.free_all(free)
            if dec is not None:
                dec.step()
        rec = {"impl": name, **base}
        rec.update(measure_eager_like(ctx, step, tables.restore, launches=count, nodes=count))
        ctx.results["steps"].append(rec)


def task_profile(ctx, decode):
    """cProfile of graphalloc's plan() alone at the headline size (relative cost only:
    the profiler inflates every call)."""
    n_reqs, ps, n_pages = ctx.params["headline_b"], ctx.params["step_ps"][0], 8
    n = ctx.params["profile_steps"]
    wl = ctx.workload(n_reqs, ps, n_pages, decode, n_steps=n + 5)
    try:
        for _ in range(3):
            wl.step()
        prof = cProfile.Profile()
        for _ in range(n):
            prof.enable()
            planned = wl.plan()
            prof.disable()
            wl.run(planned)
        wl.verify()
    finally:
        wl.close()
    stats = pstats.Stats(prof).stats
    rows = []
    for (path, line, func), (_, ncalls, tottime, cumtime, _) in stats.items():
        short = os.path.relpath(path, REPO) if path.startswith(REPO) else os.path.basename(path)
        where = f"{short}:{line}({func})" if line else func
        rows.append({"function": where, "calls_per_step": ncalls / n,
                     "tottime_us_per_step": tottime / n * 1e6,
                     "cumtime_us_per_step": cumtime / n * 1e6})
    rows.sort(key=lambda r: -r["tottime_us_per_step"])
    total = sum(r["tottime_us_per_step"] for r in rows)
    label = f"B={n_reqs} ps={ps} pages={n_pages}" + (" +decode" if decode else "")
    ctx.results["plan_profile"][("decode" if decode else "frees")] = {
        "case": label, "steps": n, "profiled_plan_us_per_step": total, "top": rows[:15]}


def task_traces(ctx, out_dir):
    """Perfetto (Chrome JSON) traces of eight back-to-back one-page frees."""
    from torch.profiler import ProfilerActivity, profile, record_function

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.is_cuda else [])
    ps = 16
    tables = FreeTables(8, 1, ps, ctx.device, seed=8)
    tables.free_all(eager_get_and_clear_swa_pages)  # warm
    tables.restore()
    ctx.sampler.sync()
    with profile(activities=acts) as prof:
        for i, reps in enumerate(tables.representatives):
            with record_function(f"eager free {i} (8-op sequence)"):
                eager_get_and_clear_swa_pages(reps, tables.full_to_swa, ps)
        ctx.sampler.sync()
    eager_path = os.path.join(out_dir, "trace_eager_8frees.json")
    prof.export_chrome_trace(eager_path)

    wl = ctx.workload(1, ps, 1, decode=False, n_steps=12)
    try:
        wl.step()  # warm
        ctx.sampler.sync()
        with profile(activities=acts) as prof:
            for i in range(8):
                with record_function(f"graphalloc step {i}: plan"):
                    planned = wl.plan()
                with record_function(f"graphalloc step {i}: replay"):
                    wl.run(planned)
            ctx.sampler.sync()
        wl.verify()
    finally:
        wl.close()
    graph_path = os.path.join(out_dir, "trace_graphalloc_8frees.json")
    prof.export_chrome_trace(graph_path)
    ctx.results["traces"] = {"eager": os.path.basename(eager_path),
                             "graphalloc": os.path.basename(graph_path), "page_size": ps}


if __name__ == "__main__":  # a module, not a script: --help says what it is and what to run
    import argparse

    _ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=(
            "A module imported by other scripts; run benchmarks/bench_frees.py "
            "instead (each takes --help)."))
    _ap.parse_args()
    _ap.error("nothing to run here: see --help")
