"""The recorder's overhead: a ``scheduler_step()`` block against ``alloc.step()`` of the same work.

    python benchmarks/bench_recorder.py --out results/bench/recorder-cpu   # CPU, ~1 min
    python benchmarks/bench_recorder.py --quick --out /tmp/bench_recorder   # CI smoke run

The workload of ``bench_planner.py`` (B running requests, page size 16, model window 4096;
every step releases the longest request, admits one, evicts every window, decodes the rest
and prefills a 256-token chunk), with an executor that launches nothing, so both sides time
the host path only: normalise, plan (the compiled twin), descriptor write, submit. Per step,
alternating which goes first, the same iteration runs as::

    step      alloc.step(release=[done], evict_all=True, decode=rows, extend=([new], [256]))
    recorder  with alloc.scheduler_step() as it:
                  it.release([done]); it.evict_all(); it.decode(rows); it.extend([new], [256])

each on its own allocator (same seed, so identical ledgers; the admit is untimed on both).
Overhead = recorder - step, per step, p50 with p20 / p80, microseconds. Writes
``bench_recorder.json`` and ``bench_recorder.md`` into ``--out``.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_planner import CHUNK, Workload, make_alloc  # noqa: E402
from timing import bench_main, bench_parser, machine_info, progress, say, summarize  # noqa: E402

from graphalloc.device.executor import Executor  # noqa: E402

BATCHES = (16, 64, 256, 1024)


class NoLaunch(Executor):
    """Enqueues nothing (the host path alone)."""

    name = "no-launch"

    def execute(self, planned) -> None:
        self.count(planned.fusable)


def _allocator(batch: int, seed: int):
    alloc = make_alloc(batch, "auto", "cpu", "eager")
    alloc.executor = NoLaunch()  # the warm-up prefill ran eagerly; from here the host only
    alloc.executor.bind(alloc.parts)
    return alloc, Workload(alloc, batch, seed)


def _by_step(alloc, args) -> float:
    t0 = time.perf_counter_ns()
    alloc.step(**args)
    return (time.perf_counter_ns() - t0) / 1e3


def _by_recorder(alloc, args) -> float:
    done, rows, (new, n) = args["release"], args["decode"], args["extend"]
    t0 = time.perf_counter_ns()
    with alloc.scheduler_step() as it:
        it.release(done)
        it.evict_all()
        it.decode(rows)
        it.extend(new, n)
    return (time.perf_counter_ns() - t0) / 1e3


def measure(batch: int, n_warmup: int, n_steps: int, seed: int) -> dict:
    a, work_a = _allocator(batch, seed)
    b, work_b = _allocator(batch, seed)
    out = {"step": [], "recorder": [], "overhead": []}
    gc.collect()
    gc.disable()
    try:
        for i in range(n_warmup + n_steps):
            args_a, args_b = work_a.next_args(), work_b.next_args()
            if i % 2:
                t_rec = _by_recorder(b, args_b)
                t_step = _by_step(a, args_a)
            else:
                t_step = _by_step(a, args_a)
                t_rec = _by_recorder(b, args_b)
            if i >= n_warmup:
                out["step"].append(t_step)
                out["recorder"].append(t_rec)
                out["overhead"].append(t_rec - t_step)
    finally:
        gc.enable()
    assert np.array_equal(a.ledger.seq_len, b.ledger.seq_len), "the two sides diverged"
    return {k: summarize(v) for k, v in out.items()}


def run(args, argv, device, backend, note) -> int:
    batches = (16, 64) if args.quick else BATCHES
    n_warmup, n_steps = (5, 20) if args.quick else (100, 600)
    rows = []
    bar = progress(len(batches), "bench_recorder", not args.no_progress, unit="batch")
    for batch in batches:
        res = measure(batch, n_warmup, n_steps, seed=batch)
        rows.append({"batch": batch, **res})
        say(bar, f"B={batch:5d}  step {res['step']['p50']:8.1f} us  recorder "
            f"{res['recorder']['p50']:8.1f} us  overhead {res['overhead']['p50']:6.2f} us "
            f"(p20 {res['overhead']['p20']:.2f}, p80 {res['overhead']['p80']:.2f})")
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    os.makedirs(args.out, exist_ok=True)
    result = {"command": "python benchmarks/bench_recorder.py " + " ".join(argv),
              "machine": machine_info("cpu"), "chunk_tokens": CHUNK, "rows": rows}
    with open(os.path.join(args.out, "bench_recorder.json"), "w") as f:
        json.dump(result, f, indent=1)
    lines = ["| B | alloc.step p50 (us) | scheduler_step() p50 (us) | overhead p50 (p20-p80) us |",
             "|---:|---:|---:|---:|"]
    for r in rows:
        o = r["overhead"]
        lines.append(f"| {r['batch']} | {r['step']['p50']:.1f} | {r['recorder']['p50']:.1f} | "
                     f"{o['p50']:.2f} ({o['p20']:.2f} - {o['p80']:.2f}) |")
    with open(os.path.join(args.out, "bench_recorder.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def main(argv=None) -> int:
    parser = bench_parser(__doc__, "results/bench/recorder-cpu", "ignored: no kernel runs")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return bench_main(argv, parser.parse_args, run)


if __name__ == "__main__":
    sys.exit(main())
