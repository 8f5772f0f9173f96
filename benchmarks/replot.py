"""Regenerate the plots of committed results from their JSON (no GPU, no torch).

    python benchmarks/replot.py                      # every plot kept under results/
    python benchmarks/replot.py results/bench/scheduler-h200/bench_scheduler.json
    python benchmarks/replot.py PATH.json --out /tmp/plots   # elsewhere, e.g. to compare

A result is recognised by its file name. Without paths, every result JSON under
``results/`` whose folder keeps at least one of its plots is redrawn, and only the plots
the folder keeps are replaced (a folder that left a plot out on purpose, because another
folder's is identical, stays without it). With paths, or with ``--out``, every plot of
the result is written. Measured numbers are never touched: only PNGs are written.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if HERE not in sys.path:
    sys.path.insert(0, HERE)
import bench_host_step  # noqa: E402
import bench_seams  # noqa: E402
import figures  # noqa: E402
import frees_plots  # noqa: E402
import sched_plots  # noqa: E402
import sglang_path_plot  # noqa: E402

__all__ = ["PLOTTERS", "replot", "main"]


def _one(plotter, name):
    """A plotter of one figure as ``(result, out_dir) -> [names written]``."""
    return lambda res, out_dir: [name] if plotter(res, os.path.join(out_dir, name)) else []


PLOTTERS = {  # result JSON name: (the PNGs it makes, (result, out_dir) -> names written)
    "bench_frees.json": (frees_plots.FILES, frees_plots.write_plots),
    "bench_scheduler.json": (sched_plots.FILES, sched_plots.plot),
    "bench_page_tables.json": (("bench_page_tables.png",),
                               _one(figures.plot_page_tables, "bench_page_tables.png")),
    "bench_decode_loop.json": (("bench_decode_loop.png",),
                               _one(figures.plot_decode_loop_bench, "bench_decode_loop.png")),
    "bench_seams.json": (("bench_seams.png",), _one(bench_seams.plot, "bench_seams.png")),
    "sglang_path.json": (("sglang_path.png",), _one(sglang_path_plot.plot, "sglang_path.png")),
    "vllm_cost.json": (("vllm_cost.png",), _one(figures.plot_vllm_cost, "vllm_cost.png")),
    "bench_host_step.json": (("bench_host_step.png",),
                             _one(bench_host_step.plot, "bench_host_step.png")),
    "decode_loop.json": (("decode_loop.png",),
                         _one(figures.plot_decode_loop_example, "decode_loop.png")),
}


def committed_results(root: str) -> list[str]:
    """Result JSONs under ``root`` whose folder keeps at least one of their plots."""
    found = []
    for folder, _, files in sorted(os.walk(root)):
        for name in sorted(files):
            if name in PLOTTERS and any(p in files for p in PLOTTERS[name][0]):
                found.append(os.path.join(folder, name))
    return found


def replot(json_path: str, out_dir: str | None = None) -> list[str]:
    """Redraw one result's plots; the paths written. Into ``out_dir``: every plot; beside
    the JSON (``out_dir`` None): only the plots already there."""
    name = os.path.basename(json_path)
    if name not in PLOTTERS:
        raise SystemExit(f"{json_path}: not a result with plots (one of {sorted(PLOTTERS)})")
    files, plotter = PLOTTERS[name]
    with open(json_path) as f:
        res = json.load(f)
    folder = os.path.dirname(os.path.abspath(json_path))
    keep = files if out_dir else [p for p in files if os.path.exists(os.path.join(folder, p))]
    dest = out_dir or folder
    os.makedirs(dest, exist_ok=True)
    written = []
    with tempfile.TemporaryDirectory() as tmp:
        for png in plotter(res, tmp):
            if png in keep:
                shutil.copyfile(os.path.join(tmp, png), os.path.join(dest, png))
                written.append(os.path.join(dest, png))
    return written


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="*", help="result JSONs (default: every one under results/)")
    ap.add_argument("--out", help="write the plots here instead of beside each JSON")
    args = ap.parse_args(argv)
    paths = args.paths or committed_results(os.path.join(REPO, "results"))
    for path in paths:
        folder = os.path.dirname(os.path.abspath(path))
        if args.out:  # one subfolder per result when there are several
            out = args.out if len(paths) == 1 else os.path.join(args.out,
                                                                os.path.basename(folder))
        else:
            out = folder if args.paths else None  # named: every plot; found: the kept ones
        written = replot(path, out)
        print(f"{os.path.relpath(path)}: "
              f"{', '.join(os.path.basename(w) for w in written) or 'nothing'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
