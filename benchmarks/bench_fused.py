"""Fused step vs two launches: the GPU time of one step-graph replay, both ways.

    python benchmarks/bench_fused.py --out results/bench/fused-h200      # GPU, a few minutes
    python benchmarks/bench_fused.py --quick --out /tmp/bench_fused        # CPU smoke run

A step of B requests: each request frees one SWA segment of ``pages`` live
pages (a frontier advance: ``plan(advance=...)``), and with ``+decode`` also
allocates one decode token (request r sits at in-page offset r mod ps, so about
B / ps of the tokens pop a new page). Every such step is fusable: its pops fit
in what was free before it. Three graphs are timed:

    two     the allocator's step graph: release kernel, then allocation kernel
    fused   the fused step graph of the same descriptor buffer: one kernel of R + A programs
    floor   an empty Triton kernel in a graph (measured first and again last)

Each timed sample is a real, distinct step: plan it (host, untimed), write
``--flush-mib`` MiB to evict L2, record an event, replay, record an event.
``two`` and ``fused`` alternate sample by sample on the same allocator (the
order flips every sample), so drift and state affect both alike. Medians (p50)
of ``--samples`` samples after ``--warmup`` untimed ones; p20/p80 in the JSON.

Grid: B in {1, 8, 64, 256, 1024} x page_size {16, 128} x pages {1, 8} x
{frees, frees + decode}. The frozen shape is as tight as the step:
``max_release_rows`` = B x rows per segment (``--row-pages`` pages per row),
``max_alloc_rows`` = B, ``max_step_pages`` = B x pages.

Writes ``bench_fused.json`` and ``bench_fused.md`` into ``--out``. Without CUDA
(``--quick``) the same code runs eagerly on the Torch twins (device times are
CPU wall clock, ``"device_clock": "cpu-wall"``; no verdict is drawn).

The verdict (GPU only) follows a rule fixed in advance, ``VERDICT_RULE``: keep
the fused variant if it saves at least ``KEEP_MIN_SAVING_US`` at the median
over all cases and is nowhere slower by more than ``KEEP_MAX_LOSS_US``;
otherwise drop it (the two-kernel graph is needed anyway, for the steps that
are not fusable).
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
    format_quantiles,
    graph_nodes,
    machine_info,
    measure_floor,
    progress,
    say,
    summarize,
)
from workloads import StepWorkload  # noqa: E402

FULL = dict(b=(1, 8, 64, 256, 1024), ps=(16, 128), pages=(1, 8), decode=(False, True),
            samples=100, warmup=10, flush_mib=256, token_budget=65536)
QUICK = dict(b=(1, 8), ps=(16,), pages=(1, 8), decode=(False, True), samples=5, warmup=2,
             flush_mib=8, token_budget=256)
KEEP_MIN_SAVING_US = 1.0
KEEP_MAX_LOSS_US = 0.5
VERDICT_RULE = (f"keep the fused variant if (two - fused) p50 is >= {KEEP_MIN_SAVING_US} us at "
                f"the median over all cases and >= -{KEEP_MAX_LOSS_US} us in every case; "
                "otherwise drop it (steps that are not fusable need the two-kernel graph anyway)")


# ---- the workload ---------------------------------------------------------------------------
class FusedWorkload(StepWorkload):
    """:class:`workloads.StepWorkload` on an allocator built with ``fused_step=True``:
    ``step_graph.graphs[i]`` / ``step_graph.fused_graphs[i]`` are the two variants for
    descriptor buffer i (empty on the CPU: ``launch(i, fusable=...)`` runs eagerly)."""

    def __init__(self, n_reqs: int, ps: int, n_pages: int, **kwargs):
        super().__init__(n_reqs, ps, n_pages, fused_step=True, **kwargs)
        self.n_not_fusable = 0

    def plan(self, _=None):
        """The next step, planned into a descriptor buffer (host only)."""
        planned = super().plan()
        self.n_not_fusable += not planned.fusable
        return planned

    def runner(self, variant: str):
        """``run(planned)``: replay (or, on the CPU, launch) ``variant`` for the planned step,
        then mark it submitted."""
        alloc, sg = self.alloc, self.step_graph
        graphs = {"two": sg.graphs, "fused": sg.fused_graphs}[variant]
        fusable = variant == "fused"

        def run(planned) -> None:
            if graphs:
                graphs[planned.buffer_index].replay()
            else:
                alloc.launch(planned.buffer_index, fusable=fusable)
            alloc.mark_submitted(planned)
            self.swa_pages_freed += planned.pages_freed["swa"]
        return run

    def verify(self) -> dict:
        """No device fault, and every step freed B x pages SWA pages (reads the device)."""
        out = super().verify(deep=self.alloc.config.device.type != "cuda")
        out["not_fusable_steps"] = self.n_not_fusable
        return out


# ---- tasks --------------------------------------------------------------------------------
def measure_case(ctx, n_reqs: int, ps: int, n_pages: int, decode: bool) -> dict:
    p = ctx.params
    n_steps = 2 * (p["samples"] + p["warmup"]) + 2
    wl = FusedWorkload(n_reqs, ps, n_pages, decode=decode, device=ctx.device,
                       backend=ctx.backend, n_steps=n_steps, token_budget=p["token_budget"],
                       row_pages=p["row_pages"])
    try:
        cfg = wl.config
        rec = {"B": n_reqs, "page_size": ps, "pages": n_pages, "decode": decode,
               "release_rows": cfg.max_release_rows, "alloc_rows": cfg.max_alloc_rows,
               "programs": {"two": [cfg.max_release_rows, cfg.max_alloc_rows],
                            "fused": [cfg.max_release_rows + cfg.max_alloc_rows]}}
        samples = ctx.sampler.alternating({"two": wl.runner("two"), "fused": wl.runner("fused")},
                                          before=wl.plan)
        rec["gpu_us"] = {name: summarize(v) for name, v in samples.items()}
        sg = wl.step_graph
        rec["graph_nodes"] = {
            "two": graph_nodes(sg.graphs[0] if sg.graphs else None),
            "fused": graph_nodes(sg.fused_graphs[0] if sg.fused_graphs else None)}
        rec["verify"] = wl.verify()
        rec["all_fusable"] = rec["verify"]["not_fusable_steps"] == 0
        two, fused = rec["gpu_us"]["two"]["p50"], rec["gpu_us"]["fused"]["p50"]
        rec["saving_us"] = two - fused
        floor = (ctx.results.get("floor") or {}).get("gpu_us") or {}
        if floor.get("p50") is not None and two > floor["p50"]:
            rec["saving_of_work_above_floor"] = (two - fused) / (two - floor["p50"])
        return rec
    finally:
        wl.close()
        ctx.sampler.release_memory()


def verdict(cases: list, is_cuda: bool) -> dict:
    if not is_cuda:
        return {"rule": VERDICT_RULE, "decision": None,
                "note": "CPU run: wall clock of the Torch twins, no decision"}
    savings = [c["saving_us"] for c in cases if "saving_us" in c]
    if not savings:
        return {"rule": VERDICT_RULE, "decision": None, "note": "no case measured"}
    med, worst = float(np.median(savings)), float(min(savings))
    keep = med >= KEEP_MIN_SAVING_US and worst >= -KEEP_MAX_LOSS_US
    return {"rule": VERDICT_RULE, "median_saving_us": med, "worst_saving_us": worst,
            "best_saving_us": float(max(savings)), "decision": "keep fused" if keep else
            "drop fused"}


# ---- reporting ----------------------------------------------------------------------------
def markdown(res: dict) -> str:
    unit = "us GPU" if res["device_clock"] == "cuda-events" else "us CPU wall (Torch twins)"
    lines = ["# Fused step vs two launches", "",
             f"Command: `{res['command']}`  ", f"Machine: {res['machine'].get('summary', '?')}  ",
             f"Clock: {res['device_clock']}; p50 (p20-p80) of {res['params']['samples']} samples "
             f"after {res['params']['warmup']} warm-ups, {res['params']['flush_mib']} MiB L2 "
             "flush before each, outside the interval.", ""]
    floor = res.get("floor") or {}
    floor_end = res.get("floor_end") or {}
    lines.append(f"Floor ({floor.get('kernel', '-')}): {format_quantiles(floor.get('gpu_us'))} "
                 f"{unit} (again at the end: {format_quantiles(floor_end.get('gpu_us'))}).")
    lines += ["", f"| B | ps | pages | decode | programs (two / fused) | two, {unit} | "
              f"fused, {unit} | saving | of work above floor |",
              "|---:|---:|---:|:---:|---|---|---|---:|---:|"]
    for c in res["cases"]:
        if "gpu_us" not in c:
            continue
        share = c.get("saving_of_work_above_floor")
        lines.append(
            f"| {c['B']} | {c['page_size']} | {c['pages']} | {'yes' if c['decode'] else 'no'} | "
            f"{c['release_rows']} + {c['alloc_rows']} / {c['release_rows'] + c['alloc_rows']} | "
            f"{format_quantiles(c['gpu_us']['two'])} | {format_quantiles(c['gpu_us']['fused'])} | "
            f"{c['saving_us']:+.2f} | "
            f"{'-' if share is None else f'{100 * share:.0f}%'} |")
    v = res["verdict"]
    lines += ["", "## Verdict", "", f"Rule: {v['rule']}.", ""]
    if v.get("decision"):
        lines.append(f"**{v['decision']}**: median saving {v['median_saving_us']:+.2f} us, "
                     f"worst {v['worst_saving_us']:+.2f} us, best {v['best_saving_us']:+.2f} us.")
    else:
        lines.append(v.get("note", "no decision"))
    if res["errors"] or res["skipped"]:
        lines += ["", "## Errors and skipped parts", ""]
        lines += [f"- error: {e['case']}: {e['error']}" for e in res["errors"]]
        lines += [f"- skipped: {s}" for s in res["skipped"]]
    return "\n".join(lines) + "\n"


# ---- run ----------------------------------------------------------------------------------
class Context:
    def __init__(self, args, device: torch.device, backend: str):
        self.args, self.params = args, args.params
        self.device, self.is_cuda, self.backend = device, device.type == "cuda", backend
        self.sampler = Sampler(device, n_samples=self.params["samples"],
                               n_warmup=self.params["warmup"], flush_mib=self.params["flush_mib"])
        self.results: dict = {}


def parse_args(argv):
    p = bench_parser(__doc__, os.path.join(REPO, "results", "bench", "fused"),
                     "auto: triton on CUDA, torch (the twins) on the CPU")
    p.add_argument("--b", help="comma-separated request counts (default 1,8,64,256,1024)")
    p.add_argument("--ps", help="comma-separated page sizes (default 16,128)")
    p.add_argument("--pages", help="comma-separated pages per segment (default 1,8)")
    p.add_argument("--decode", choices=("both", "yes", "no"), default="both",
                   help="steps with a decode token per request, without, or both")
    p.add_argument("--samples", type=int, help="timed samples per measurement")
    p.add_argument("--warmup", type=int, help="untimed samples before them")
    p.add_argument("--flush-mib", type=int, help="MiB written before every sample")
    p.add_argument("--row-pages", type=int, default=16, help="max_pages_per_row")
    p.add_argument("--token-budget", type=int, help="max_step_tokens")
    p.add_argument("--time-budget-s", type=float, default=900.0,
                   help="cases not started by then are skipped (outputs are still written)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    params = dict(QUICK if args.quick else FULL)
    for key in ("b", "ps", "pages"):
        if getattr(args, key):
            params[key] = tuple(int(x) for x in getattr(args, key).split(","))
    params["decode"] = {"both": (False, True), "yes": (True,), "no": (False,)}[args.decode]
    for key in ("samples", "warmup", "flush_mib", "token_budget"):
        if getattr(args, key) is not None:
            params[key] = getattr(args, key)
    params["row_pages"] = args.row_pages
    args.params = params
    return args


def main(argv=None) -> int:
    return bench_main(argv, parse_args, _run)


def _run(args, argv, device, backend, note) -> int:
    ctx = Context(args, device, backend)
    p = ctx.params
    res = ctx.results
    res.update({
        "command": " ".join(["python", os.path.relpath(__file__, REPO), *argv]),
        "machine": machine_info(device), "device_clock": ctx.sampler.clock, "backend": backend,
        "backend_note": note,
        "params": {k: list(v) if isinstance(v, tuple) else v for k, v in p.items()},
        "floor": None, "floor_end": None, "cases": [], "errors": [], "skipped": []})
    if device.type != "cuda":
        res["skipped"].append("GPU-only parts (no CUDA device): graphs, CUDA events, the L2 "
                              "flush; device times are CPU wall clock of the Torch twins")
    t_start = time.perf_counter()
    cases = [(b, ps, n, d) for d in p["decode"] for b in p["b"] for ps in p["ps"]
             for n in p["pages"]]
    try:
        res["floor"] = measure_floor(ctx.sampler)
    except Exception as exc:
        res["errors"].append({"case": "floor", "error": f"{type(exc).__name__}: {exc}",
                              "traceback": traceback.format_exc()})
    bar = progress(len(cases), "bench_fused", not args.no_progress)
    for b, ps, n, d in cases:
        label = f"B={b} ps={ps} pages={n}" + (" +decode" * d)
        if time.perf_counter() - t_start > args.time_budget_s:
            res["skipped"].append(f"{label}: time budget of {args.time_budget_s:.0f} s spent")
        else:
            t0 = time.perf_counter()
            try:
                rec = measure_case(ctx, b, ps, n, d)
                rec["wall_s"] = time.perf_counter() - t0
                res["cases"].append(rec)
                q = {name: format_quantiles(stats) for name, stats in rec["gpu_us"].items()}
                say(bar, f"{label}: two {q['two']}  fused {q['fused']}  "
                    f"({rec['wall_s']:.1f} s)")
            except Exception as exc:
                res["errors"].append({"case": label, "error": f"{type(exc).__name__}: {exc}",
                                      "traceback": traceback.format_exc()})
                say(bar, f"{label}: FAILED {type(exc).__name__}: {exc}")
                ctx.sampler.release_memory()
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    try:
        res["floor_end"] = measure_floor(ctx.sampler)
    except Exception as exc:
        res["errors"].append({"case": "floor_end", "error": f"{type(exc).__name__}: {exc}"})
    res["verdict"] = verdict(res["cases"], ctx.is_cuda)
    res["wall_s"] = time.perf_counter() - t_start
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_fused.json"), "w") as f:
        json.dump(res, f, indent=1)
    with open(os.path.join(args.out, "bench_fused.md"), "w") as f:
        f.write(markdown(res))
    print(f"wrote {args.out}/bench_fused.json and bench_fused.md; verdict: "
          f"{res['verdict'].get('decision')}", file=sys.stderr)
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
