"""Graph-replay microbenchmarks: graphalloc against the eager baselines, in one process.

    python benchmarks/bench_frees.py [--quick] [--out results/bench/NAME]

What runs (each a task of the progress bar; every number is a median of
``--samples`` samples after ``--warmup`` untimed ones, with p20/p80 beside it):

1. ``single``: one SWA segment free, page_size x pages per free, three ways
   (eager 8-op Torch sequence, fused ``get_and_clear_swa_pages``, a graphalloc
   step graph holding that one segment): host enqueue time, GPU interval of a
   graph replay (256 MiB L2 flush before each, outside the interval), launches.
2. ``steps``: a scheduler step of B segment frees from B requests: host time
   per step and GPU time for the eager loop, the fused loop, graphalloc's replay.
3. ``decode``: the same with one decode token for each of the B requests.
4. ``floor`` (an empty kernel in a graph), ``bandwidth`` (device copy), launch
   and graph-node counts, ``profile`` (cProfile of graphalloc's planning) and
   ``traces`` (eight back-to-back one-page frees, baseline and graphalloc).

Writes into ``--out``: ``bench_frees.json``, ``bench_frees.md``, three PNGs and
two Perfetto traces (seven files). Without CUDA (``--quick`` in CI) the same
code paths run on the CPU with the Torch reference twins; device times are then
CPU wall clock and the targets are not judged.
"""

from __future__ import annotations

import os
import sys
import time
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

# None of these defines a Triton kernel at import (graphalloc and its kernels are imported
# inside functions, after main() has settled TRITON_INTERPRET).
import report  # noqa: E402
from baselines import eager_get_and_clear_swa_pages, load_fused  # noqa: E402
from tasks import (  # noqa: E402
    task_bandwidth,
    task_floor,
    task_profile,
    task_single,
    task_step,
    task_traces,
)
from timing import (  # noqa: E402
    Sampler,
    bench_main,
    bench_parser,
    count_launches,
    machine_info,
)
from workloads import StepWorkload  # noqa: E402

FULL = dict(single_ps=(1, 16, 64, 128), single_pages=(1, 8, 64, 1024),
            step_b=(1, 8, 64, 256, 1024), step_ps=(16, 128), step_pages=(1, 8),
            samples=100, warmup=10, flush_mib=256, copy_mib=1024, token_budget=65536,
            profile_steps=100, headline_b=256)
QUICK = dict(single_ps=(1, 16), single_pages=(1, 8), step_b=(1, 8), step_ps=(16,),
             step_pages=(1, 8), samples=5, warmup=2, flush_mib=8, copy_mib=16, token_budget=256,
             profile_steps=5, headline_b=8)
SECTIONS = ("floor", "bandwidth", "single", "steps", "decode", "profile", "traces")


def parse_args(argv):
    p = bench_parser(__doc__, os.path.join(REPO, "results", "bench", "frees"),
                     "graphalloc backend (auto: triton on CUDA, torch on CPU)")
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help=f"comma-separated subset of {','.join(SECTIONS)}")
    p.add_argument("--samples", type=int, help="timed samples per measurement")
    p.add_argument("--warmup", type=int, help="untimed samples before them")
    p.add_argument("--row-pages", type=int, default=16,
                   help="graphalloc max_pages_per_row (longer segments split into rows)")
    p.add_argument("--token-budget", type=int, help="graphalloc max_step_tokens")
    p.add_argument("--time-budget-s", type=float, default=480.0,
                   help="tasks not started by then are skipped (outputs are still written)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    params = dict(QUICK if args.quick else FULL)
    for key in ("samples", "warmup", "token_budget"):
        if getattr(args, key) is not None:
            params[key] = getattr(args, key)
    params["row_pages"] = args.row_pages
    args.params = params
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = set(args.sections) - set(SECTIONS)
    if unknown:
        p.error(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")
    return args


class Context:
    """What every task needs: device, sampler, implementations, parameters, results."""

    def __init__(self, args, device, backend, backend_note):
        self.args, self.params = args, args.params
        self.device, self.is_cuda = device, device.type == "cuda"
        self.backend = backend
        self.sampler = Sampler(device, n_samples=self.params["samples"],
                               n_warmup=self.params["warmup"], flush_mib=self.params["flush_mib"])
        fused_backend = "triton" if (self.is_cuda or backend == "triton") else "torch"
        self.fused, fused_name, fused_reason = load_fused(fused_backend)
        self.impls = [("eager", eager_get_and_clear_swa_pages)]
        if self.fused is not None:
            self.impls.append(("fused", self.fused))
        self.results = {
            "command": None, "machine": None, "config": None, "floor": None, "floor_end": None,
            "copy_bandwidth": None, "single_free": [], "steps": [], "plan_profile": {},
            "traces": {}, "skipped": [], "errors": [], "notes": [],
        }
        if backend_note:
            self.results["notes"].append(backend_note)
        if fused_reason:
            self.skip(f"fused kernel ({fused_backend}): {fused_reason}")
        else:
            self.results["notes"].append(f"fused kernel: graphalloc.kernels.get_and_clear."
                                         f"{fused_name}(validate=False)")
        if not self.is_cuda:
            self.skip("GPU-only parts (no CUDA device): CUDA graphs, CUDA events, the L2 flush, "
                      "CUDA launch counts and graph nodes, targets. Device times are CPU wall "
                      "clock of eager execution, not GPU intervals")

    def skip(self, what: str) -> None:
        self.results["skipped"].append(what)
        print(f"[skip] {what}", file=sys.stderr)

    def n_steps(self, extra: int = 2) -> int:
        """Steps a workload must hold: host loop + device loop + launch count + spare."""
        return 2 * (self.params["samples"] + self.params["warmup"]) + extra

    def workload(self, n_reqs, ps, n_pages, decode, n_steps=None):
        return StepWorkload(n_reqs, ps, n_pages, decode=decode, device=self.device,
                            backend=self.backend, n_steps=n_steps or self.n_steps(),
                            token_budget=self.params["token_budget"],
                            row_pages=self.params["row_pages"])


def build_tasks(ctx, out_dir):
    """Tasks in order of importance (the headline first), so a run cut short by
    ``--time-budget-s`` keeps what the targets need."""
    p, want = ctx.params, ctx.args.sections
    tasks = []
    if "floor" in want:
        tasks.append(("floor: empty kernel in a graph", lambda: task_floor(ctx)))
    if "bandwidth" in want:
        tasks.append(("bandwidth: device copy", lambda: task_bandwidth(ctx)))
    head = p["headline_b"]
    b_order = [b for b in p["step_b"] if b == head] + [b for b in p["step_b"] if b != head]

    def add_steps(decode):
        for n_reqs in b_order:
            for ps in p["step_ps"]:
                for n_pages in p["step_pages"]:
                    label = f"step B={n_reqs} ps={ps} pages={n_pages}" + (" +decode" * decode)
                    tasks.append((label, lambda b=n_reqs, ps=ps, n=n_pages, d=decode:
                                  task_step(ctx, b, ps, n, d)))

    if "steps" in want:
        add_steps(False)
    if "single" in want:
        cases = [(ps, n) for ps in p["single_ps"] for n in p["single_pages"]]
        cases.sort(key=lambda c: c != (128, 1024))  # the bandwidth target's case first
        for ps, n_pages in cases:
            tasks.append((f"single free ps={ps} pages={n_pages}",
                          lambda ps=ps, n=n_pages: task_single(ctx, ps, n)))
    if "decode" in want:
        add_steps(True)
    if "profile" in want:
        tasks.append(("profile: planning (frees)", lambda: task_profile(ctx, False)))
        tasks.append(("profile: planning (+decode)", lambda: task_profile(ctx, True)))
    if "traces" in want:
        tasks.append(("traces: 8 one-page frees", lambda: task_traces(ctx, out_dir)))
    if "floor" in want:
        tasks.append(("floor again (drift check)", lambda: task_floor(ctx, "floor_end")))
    return tasks


# ---- run -------------------------------------------------------------------------------
def _progress(tasks, enabled: bool):
    if enabled:
        try:
            from tqdm import tqdm
            return tqdm(tasks, desc="bench_frees", unit="task", file=sys.stderr,
                        dynamic_ncols=True)
        except ImportError:
            print("[skip] tqdm not installed: plain progress lines", file=sys.stderr)
    return _PlainProgress(tasks)


class _PlainProgress:
    def __init__(self, tasks):
        self.tasks = tasks

    def __iter__(self):
        for i, task in enumerate(self.tasks):
            print(f"[{i + 1}/{len(self.tasks)}] {task[0]}", file=sys.stderr, flush=True)
            yield task

    def set_postfix_str(self, _):
        pass


def main(argv=None) -> int:
    return bench_main(argv, parse_args, _run)


def _run(args, argv, device, backend, note) -> int:
    t_start = time.perf_counter()
    out_dir = os.path.abspath(args.out)
    os.makedirs(out_dir, exist_ok=True)
    ctx = Context(args, device, backend, note)
    res = ctx.results
    res["command"] = " ".join(["python", "benchmarks/bench_frees.py", *argv])
    res["machine"] = machine_info(device)
    res["config"] = {**args.params, "device": str(device), "backend": backend,
                     "device_clock": ctx.sampler.clock, "index_dtype": "int64",
                     "sections": args.sections, "quick": args.quick,
                     "torch_threads": torch.get_num_threads()}
    if ctx.is_cuda:  # initialise CUPTI before any graph is captured
        count_launches(lambda: torch.zeros(1, device=device).add_(1), True)

    tasks = build_tasks(ctx, out_dir)
    bar = _progress(tasks, not args.no_progress)
    for label, run in bar:
        bar.set_postfix_str(label)
        if time.perf_counter() - t_start > args.time_budget_s:
            ctx.skip(f"{label}: past --time-budget-s {args.time_budget_s:.0f}")
            continue
        try:
            run()
        except Exception as exc:
            tb = traceback.format_exc()
            res["errors"].append({"task": label, "error": f"{type(exc).__name__}: {exc}",
                                  "traceback": tb.splitlines()[-12:]})
            print(f"\n[error] {label}: {type(exc).__name__}: {exc}\n{tb}", file=sys.stderr)
        finally:
            ctx.sampler.release_memory()
            res["wall_s"] = time.perf_counter() - t_start
            report.write_outputs(res, out_dir, plots=False)  # partial results survive a kill
    res["wall_s"] = time.perf_counter() - t_start
    written = report.write_outputs(res, out_dir)
    print(report.summary_text(res))
    print(f"wrote {len(written)} files to {out_dir}: {', '.join(sorted(written))}")
    print(f"total {res['wall_s']:.1f} s; {len(res['errors'])} errors")
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
