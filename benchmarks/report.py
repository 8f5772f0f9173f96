"""Report of bench_frees: the results dict as JSON, markdown, PNG plots, a stdout summary.

Everything here is a pure function of the results dict, so a committed JSON
regenerates the rest on any machine (no GPU needed)::

    python benchmarks/report.py results/bench/frees-h200/bench_frees.json [--regen]

prints the headline and the targets; ``--regen`` rewrites the markdown, the JSON and
the plots beside it (``python benchmarks/replot.py`` redraws the plots alone). The
plots are drawn by ``frees_plots.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from frees_plots import write_plots  # noqa: E402

__all__ = ["write_outputs", "write_plots", "markdown", "targets", "summary_text"]

IMPLS = (("eager", "eager 8-op Torch"), ("fused", "fused kernel"),
         ("graphalloc", "graphalloc replay"))
IMPL_NAMES = dict(IMPLS)
JSON_NAME, MD_NAME = "bench_frees.json", "bench_frees.md"


# ---- lookups ---------------------------------------------------------------------------
def _find(records, **match):
    for rec in records or ():
        if all(rec.get(k) == v for k, v in match.items()):
            return rec
    return None


def _p50(rec, key="gpu_us"):
    stats = rec.get(key) if rec else None
    return stats["p50"] if stats else None


def _ratio(a, b):
    return a / b if a is not None and b not in (None, 0) else None


def _us(v) -> str:
    if v is None:
        return "–"
    return f"{v:.0f}" if v >= 100 else f"{v:.1f}" if v >= 10 else f"{v:.2f}"


def _x(v) -> str:
    return "–" if v is None else f"{v:.3g}x"


def _g(v) -> str:
    return "–" if v is None else f"{v:.3g}"


def _judged(res) -> bool:
    return (res.get("config") or {}).get("device_clock") == "cuda-events"


def _floor(res, key="gpu_us"):
    return _p50(res.get("floor"), key)


# ---- targets ---------------------------------------------------------------------------
def targets(res) -> list[dict]:
    """The issue's targets, each with its measured value and verdict (None: not judged,
    because the run had no CUDA or the numbers are missing)."""
    cfg = res.get("config") or {}
    n_reqs = cfg.get("headline_b")
    steps = res.get("steps", [])
    floor_gpu = _floor(res)
    out = []

    def add(name, case, value, op, limit):
        ok = None
        if value is not None and _judged(res):
            ok = value <= limit if op == "<=" else value >= limit
        out.append({"target": name, "case": case, "measured": value, "limit": f"{op} {limit}",
                    "ok": ok})

    for ps in cfg.get("step_ps", ()):
        for pages in cfg.get("step_pages", ()):
            case = f"B={n_reqs} ps={ps} pages={pages}"
            found = {impl: _find(steps, impl=impl, B=n_reqs, page_size=ps, pages=pages,
                                 decode=False) for impl, _ in IMPLS}
            g = found["graphalloc"]
            add("graphalloc GPU / floor", case, _ratio(_p50(g), floor_gpu), "<=", 1.5)
            add("graphalloc host us per step", case, _p50(g, "cpu_us"), "<=", 15)
            add("host: fused loop / graphalloc", case,
                _ratio(_p50(found["fused"], "cpu_us"), _p50(g, "cpu_us")), ">=", 100)
            add("GPU: eager loop / graphalloc", case,
                _ratio(_p50(found["eager"]), _p50(g)), ">=", 20)
    copy = (res.get("copy_bandwidth") or {}).get("gb_per_s")
    for impl in ("graphalloc", "fused"):
        rec = _find(res.get("single_free"), impl=impl, page_size=128, pages=1024)
        add(f"{impl} clear bandwidth / copy bandwidth", "1024 pages, ps=128",
            _ratio(rec.get("clear_gb_per_s") if rec else None, copy), ">=", 0.5)
    return out


def _verdict(ok) -> str:
    return "n/a" if ok is None else ("PASS" if ok else "FAIL")


# ---- markdown --------------------------------------------------------------------------
def _table(header, rows) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def headline_table(res, decode=False) -> str:
    cfg = res.get("config") or {}
    n_reqs = cfg.get("headline_b")
    floor_gpu = _floor(res)
    rows = []
    for ps in cfg.get("step_ps", ()):
        for pages in cfg.get("step_pages", ()):
            f = {impl: _find(res.get("steps"), impl=impl, B=n_reqs, page_size=ps, pages=pages,
                             decode=decode) for impl, _ in IMPLS}
            g = f["graphalloc"]
            rows.append([ps, pages, _us(_p50(f["eager"])), _us(_p50(f["fused"])), _us(_p50(g)),
                         _us(floor_gpu), _x(_ratio(_p50(g), floor_gpu)),
                         _us(_p50(f["fused"], "cpu_us")), _us(_p50(g, "cpu_us")),
                         _us(_p50(g, "plan_us")),
                         _x(_ratio(_p50(f["fused"], "cpu_us"), _p50(g, "cpu_us"))),
                         _x(_ratio(_p50(f["eager"]), _p50(g)))])
    return _table(["ps", "pages", "GPU eager loop", "GPU fused loop", "GPU graphalloc",
                   "GPU floor", "graphalloc / floor", "host fused loop", "host graphalloc",
                   "(plan)", "host fused / graphalloc", "GPU eager / graphalloc"], rows)


def _targets_table(res) -> str:
    rows = [[t["target"], t["case"], "–" if t["measured"] is None else f"{t['measured']:.3g}",
             t["limit"], _verdict(t["ok"])] for t in targets(res)]
    return _table(["target", "case", "measured", "limit", "result"], rows)


def _single_table(res) -> str:
    recs = res.get("single_free", [])
    cases = sorted({(r["page_size"], r["pages"]) for r in recs})
    rows = []
    for ps, pages in cases:
        f = {impl: _find(recs, impl=impl, page_size=ps, pages=pages) for impl, _ in IMPLS}
        kernels = "/".join(_g(((f[i] or {}).get("launches") or {}).get("kernels"))
                           for i, _ in IMPLS)
        ops = "/".join(_g(((f[i] or {}).get("launches") or {}).get("aten_ops"))
                       for i, _ in IMPLS)
        bw = "/".join(_g((f[i] or {}).get("clear_gb_per_s")) for i, _ in IMPLS)
        rows.append([ps, pages, *(_us(_p50(f[i], "cpu_us")) for i, _ in IMPLS),
                     _us(_p50(f["graphalloc"], "plan_us")),
                     *(_us(_p50(f[i])) for i, _ in IMPLS), kernels, ops, bw])
    return _table(["ps", "pages", "host eager", "host fused", "host graphalloc", "(plan)",
                   "GPU eager", "GPU fused", "GPU graphalloc", "kernels e/f/g", "aten ops e/f/g",
                   "clear GB/s e/f/g"], rows)


def _steps_table(res, decode) -> str:
    recs = [r for r in res.get("steps", []) if r["decode"] == decode]
    cases = sorted({(r["page_size"], r["pages"], r["B"]) for r in recs})
    floor_gpu = _floor(res)
    rows = []
    for ps, pages, n_reqs in cases:
        f = {impl: _find(recs, impl=impl, page_size=ps, pages=pages, B=n_reqs)
             for impl, _ in IMPLS}
        g = f["graphalloc"]
        rows.append([n_reqs, ps, pages, *(_us(_p50(f[i], "cpu_us")) for i, _ in IMPLS),
                     _us(_p50(g, "plan_us")), *(_us(_p50(f[i])) for i, _ in IMPLS),
                     _x(_ratio(_p50(g), floor_gpu)),
                     _x(_ratio(_p50(f["fused"], "cpu_us"), _p50(g, "cpu_us"))),
                     _x(_ratio(_p50(f["eager"]), _p50(g)))])
    return _table(["B", "ps", "pages", "host eager", "host fused", "host graphalloc", "(plan)",
                   "GPU eager", "GPU fused", "GPU graphalloc", "graphalloc / floor",
                   "host fused / graphalloc", "GPU eager / graphalloc"], rows)


def _launch_table(res) -> str:
    rows = []
    for rec in res.get("steps", []):
        counts = rec.get("launches")
        if not counts:
            continue
        nodes = rec.get("graph") or {}
        node_txt = (f"{nodes.get('total')} ({nodes.get('kernel', 0)} kernel)"
                    if "total" in nodes else nodes.get("error", "–")[:60])
        rows.append([rec["B"], "yes" if rec["decode"] else "no", IMPL_NAMES[rec["impl"]],
                     *(_g(counts.get(k)) for k in ("launch_calls", "graph_launches", "kernels",
                                                   "aten_ops")), node_txt])
    return _table(["B", "decode", "implementation", "kernel launches", "graph launches",
                   "kernels run", "aten ops", "graph nodes"], rows)


def _profile_section(res) -> str:
    parts = []
    for key, prof in (res.get("plan_profile") or {}).items():
        rows = [[f"`{r['function']}`", f"{r['calls_per_step']:.3g}",
                 _us(r["tottime_us_per_step"]), _us(r["cumtime_us_per_step"])]
                for r in prof["top"]]
        parts.append(f"**{key}** ({prof['case']}, {prof['steps']} steps; "
                     f"{_us(prof['profiled_plan_us_per_step'])} us per plan() under cProfile)"
                     f"\n\n" + _table(["function", "calls/step", "own us/step", "cum us/step"],
                                      rows))
    return "\n\n".join(parts) if parts else "(not run)"


def _machine_line(res) -> str:
    """``timing.machine_info``'s record; runs from before it recorded graphalloc's version
    say so rather than print None."""
    m = res.get("machine") or {}
    return (f"GPU {m.get('gpu') or 'none'}, torch {m.get('torch')}, Triton {m.get('triton')}, "
            f"CUDA {m.get('cuda_runtime')}, driver {m.get('driver', '–')}, CPU {m.get('cpu')}, "
            f"graphalloc {m.get('graphalloc') or 'version not recorded'} "
            f"(commit {m.get('graphalloc_commit') or 'not recorded'})")


METHOD = """\
- Host time: `time.perf_counter_ns` around the enqueue (eager: the calls; graphalloc:
  `plan()` + `run()`, i.e. planning, descriptor write and the graph launch), the device
  drained before each sample, outside the interval. No completion wait.
- GPU time: CUDA events around one CUDA-graph replay (the baselines' eager calls are
  captured into a graph too, which removes their launch gaps: a generous baseline); a
  256 MiB write evicts L2 before each sample, outside the interval; mappings restored
  before each baseline sample, and every graphalloc step frees live pages (checked).
- graphalloc steps: `plan(advance=(rows, frontier + pages * ps))` on B prefilled
  requests (one segment of `pages` live pages per request), `decode=rows` added for
  the decode table; frozen shape as tight as the step (see `frozen_shape` in the JSON).
- Baselines get their representatives precomputed (no per-free slicing); their decode
  allocation is one batched Torch sequence, identical for the eager and fused loops.
- Launches: `torch.profiler` over one step, at the first (ps, pages) case of each B
  (counts do not depend on ps > 1 or on pages). Floor: an empty kernel in a graph."""


def markdown(res) -> str:
    cfg = res.get("config") or {}
    bw = res.get("copy_bandwidth") or {}
    lines = [
        "# graphalloc graph-replay microbenchmarks", "",
        f"Command: `{res.get('command')}`", "",
        f"Machine: {_machine_line(res)}", "",
        f"Device clock: {cfg.get('device_clock')}; {cfg.get('samples')} samples after "
        f"{cfg.get('warmup')} warm-ups, medians (p50) in microseconds; L2 flush "
        f"{cfg.get('flush_mib')} MiB; backend {cfg.get('backend')}; run took "
        f"{res.get('wall_s', 0):.0f} s.", "",
        f"## Headline: one step of B = {cfg.get('headline_b')} segment frees", "",
        headline_table(res), "", "## Targets", "", _targets_table(res), "",
        "## 1. Single segment free", "",
        "Host enqueue time and GPU replay interval per free, launches (CUDA kernels and "
        "top-level aten ops per implementation e/f/g) and clearing bandwidth.", "",
        _single_table(res), "",
        "## 2. A step of B segment frees", "", _steps_table(res, False), "",
        "## 3. A step of B segment frees and B decode tokens", "", _steps_table(res, True), "",
        "## 4. Launches per step and graph nodes", "", _launch_table(res), "",
        "## Bandwidth", "",
        f"Device copy: {_g(bw.get('gb_per_s'))} GB/s (bytes read + written: "
        f"{bw.get('bytes_moved', 0) / 2**20:.0f} MiB per copy). Clearing bandwidth of each "
        "free is in the table of section 1 (bytes: per page one representative read, one "
        "peer read, ps cleared entries, one SWA page write, 8 bytes each).", "",
        f"Floor: {(res.get('floor') or {}).get('kernel')}: GPU {_us(_floor(res))} us, host "
        f"{_us(_floor(res, 'cpu_us'))} us per replay; again at the end: GPU "
        f"{_us(_p50(res.get('floor_end')))} us.", "",
        "## Notes", "", "### Method", "", METHOD, "",
        "### Where graphalloc's planning time goes (cProfile of plan() alone)", "",
        _profile_section(res), "",
    ]
    extra = [f"- {n}" for n in res.get("notes", [])] + [f"- skipped: {s}"
                                                         for s in res.get("skipped", [])]
    extra += [f"- ERROR in {e['task']}: {e['error']}" for e in res.get("errors", [])]
    if res.get("traces"):
        t = res["traces"]
        extra.append(f"- Perfetto traces (ps={t['page_size']}): `{t['eager']}`, "
                     f"`{t['graphalloc']}` (open in ui.perfetto.dev)")
    lines += ["### Run notes", "", *extra, ""]
    return "\n".join(lines)


# ---- outputs ---------------------------------------------------------------------------
def write_outputs(res, out_dir, plots: bool = True) -> list[str]:
    """JSON, markdown and plots into ``out_dir`` (traces are written by their task)."""
    res["targets"] = targets(res)
    written = write_plots(res, out_dir) if plots else []
    with open(os.path.join(out_dir, MD_NAME), "w") as f:
        f.write(markdown(res))
    with open(os.path.join(out_dir, JSON_NAME), "w") as f:
        json.dump(res, f, indent=1, default=str)
    written += [MD_NAME, JSON_NAME]
    written += [v for k, v in (res.get("traces") or {}).items() if k in ("eager", "graphalloc")]
    return written


def summary_text(res) -> str:
    cfg = res.get("config") or {}
    lines = ["", f"== headline: one step of B={cfg.get('headline_b')} segment frees "
                 f"(p50 us; device clock {cfg.get('device_clock')}) =="]
    lines += headline_table(res).splitlines()
    lines += ["", "== targets =="]
    for t in targets(res):
        value = "–" if t["measured"] is None else f"{t['measured']:.3g}"
        lines.append(f"{_verdict(t['ok']):>4}  {t['target']} [{t['case']}]: {value} "
                     f"(want {t['limit']})")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Regenerate reports from a bench_frees JSON.")
    p.add_argument("json_path")
    p.add_argument("--regen", action="store_true", help="rewrite markdown and plots beside it")
    args = p.parse_args(argv)
    with open(args.json_path) as f:
        res = json.load(f)
    if args.regen:
        write_outputs(res, os.path.dirname(os.path.abspath(args.json_path)))
    print(summary_text(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
