"""Host time of one scheduler step's plan: the numpy planner against the compiled planner.

    python benchmarks/bench_planner.py --out results/bench/planner-cpu            # CPU, ~2 min
    python benchmarks/bench_planner.py --quick --out /tmp/bench_planner         # CI smoke run
    python benchmarks/bench_planner.py --device cuda --out results/bench/planner-h200  # GPU

A continuous-batching decode workload at B in {16, 64, 256, 1024} running requests, page
size 16, a model window of 4096 (``sliding_window = 4095``), pool mode: lengths start
uniform in [W/2, 2W] (most requests are past their window, so the window rule frees SWA
pages as they cross page boundaries); every step releases the longest request, admits a
new one (``admit()``, outside the timed call) and plans ONE step::

    plan(release=[done], evict_all=True, decode=rows, extend=([new], [256]))

-- B decode rows, the window eviction of every request, one release (its FULL and SWA
pages) and one 256-token prefill chunk -- with the rows passed as int64 numpy arrays, as an
engine's scheduler holds them. The speculative case (B in {16, 256}) is a speculative
engine's round on the same workload: every decoding row drafts ``SPEC_K`` = 3 tokens
(``1 + 3`` verify slots), and the next step commits each row's accepted count (uniform in
[0, 4]: all rejected and all accepted included; the rejected tail's pages freed)::

    plan(release=[done], commit=(rows, n_accepted), evict=rows, decode=rows, lookahead=3,
         extend=([new], [256]))
 Timed per step with ``perf_counter_ns``, garbage collection
off: ``plan`` (host planning, the descriptor written into its pinned buffer: what this
benchmark is about), ``submit`` (``mark_submitted``: the bookkeeping after a launch) and,
on a GPU, ``run`` (the launch of a captured graph, ``executor="graph"``). On a CPU device
no kernel runs at all (``mark_submitted`` stands in for the launch: the device tables go
stale, which a host benchmark never reads). Both planners run the same steps from the same
seed; the first 200 steps' descriptor buffers are compared (``identical``), and the
compiled planner must have planned every step itself (``fallbacks`` = 0).

Writes ``bench_planner.json`` and ``bench_planner.md`` into ``--out``. Reported: p50 and
p90 over the measured steps (after warm-up), in microseconds.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from timing import bench_main, bench_parser, machine_info  # noqa: E402

import graphalloc as ga  # noqa: E402
from graphalloc import fast_plan  # noqa: E402

PAGE_SIZE = 16
MODEL_WINDOW = 4096
CHUNK = 256
BATCHES = (16, 64, 256, 1024)
SPEC_BATCHES = (16, 256)  # the speculative round
SPEC_K = 3  # draft tokens per row and step: 1 + 3 verify slots


def make_alloc(batch: int, planner: str, device, executor: str) -> ga.HybridAllocator:
    w = MODEL_WINDOW - 1
    max_ctx = 2 * MODEL_WINDOW + 2048
    per_req_full = -(-max_ctx // PAGE_SIZE)
    per_req_swa = -(-w // PAGE_SIZE) + 2
    cfg = ga.AllocatorConfig(
        page_size=PAGE_SIZE, num_full_pages=int((batch + 2) * per_req_full * 0.8) + 64,
        num_swa_pages=(batch + 2) * (per_req_swa + CHUNK // PAGE_SIZE + 1),
        max_reqs=batch + 2, max_context_len=max_ctx, sliding_window=w,
        index_dtype=torch.int32, device=device, backend="torch" if device == "cpu" else
        "triton", max_tokens_per_alloc_row=MODEL_WINDOW, max_step_tokens=MODEL_WINDOW + batch + 8)
    return ga.HybridAllocator(cfg, planner=planner, executor=executor)


class Workload:
    """The steps of one run: lengths, who finishes, who is admitted (see the module)."""

    def __init__(self, alloc: ga.HybridAllocator, batch: int, seed: int,
                 speculative: bool = False):
        self.alloc, self.rng = alloc, np.random.default_rng(seed)
        self.speculative = speculative
        cfg = alloc.config
        lengths = self.rng.integers(MODEL_WINDOW // 2, 2 * MODEL_WINDOW, batch)
        for n in lengths:  # prefill in chunks, the window evicted as it goes (untimed)
            r = alloc.admit()
            left = int(n)
            while left:
                k = min(left, cfg.max_tokens_per_alloc_row)
                self._submit(alloc.plan(evict=[r], extend=([r], [k])))
                left -= k
            self._submit(alloc.plan(evict=[r]))

    def _submit(self, planned) -> None:
        if self.alloc.config.device.type == "cpu":
            self.alloc.mark_submitted(planned)
        else:
            self.alloc.run(planned)

    def next_args(self) -> dict:
        """Release the longest request, admit one: the next step's arguments (untimed)."""
        alloc = self.alloc
        live = alloc.live_rows()
        done = int(live[np.argmax(alloc.ledger.seq_len[live])])
        new = alloc.admit()
        rows = live[live != done]
        release = np.array([done], dtype=np.int64)
        extend = (np.array([new], dtype=np.int64), np.array([CHUNK]))
        if not self.speculative:
            return dict(release=release, evict_all=True, decode=rows, extend=extend)
        spec = alloc.ledger.spec_steps[rows, 0]  # the step drafted last round (0: none)
        pending = rows[spec > 0]
        accepted = self.rng.integers(0, spec[spec > 0] + 1)
        return dict(release=release, commit=(pending, accepted), evict=rows, decode=rows,
                    lookahead=SPEC_K, extend=extend)


def measure(batch: int, planner: str, device, n_warmup: int, n_steps: int, seed: int,
            keep: int, speculative: bool = False) -> dict:
    executor = "eager" if torch.device(device).type == "cpu" else "graph"
    alloc = make_alloc(batch, planner, device, executor)
    work = Workload(alloc, batch, seed, speculative)
    on_gpu = alloc.config.device.type == "cuda"
    plan_us, submit_us, run_us, bufs = [], [], [], []
    gc.collect()
    gc.disable()
    try:
        for i in range(n_warmup + n_steps):
            args = work.next_args()
            t0 = time.perf_counter_ns()
            planned = alloc.plan(**args)
            t1 = time.perf_counter_ns()
            if on_gpu:
                alloc.run(planned)
                t2 = t3 = time.perf_counter_ns()
            else:
                t2 = t1
                alloc.mark_submitted(planned)
                t3 = time.perf_counter_ns()
            if i < keep:
                bufs.append(alloc.ring.np_bufs[planned.buffer_index].copy())
            if i >= n_warmup:
                plan_us.append((t1 - t0) / 1e3)
                run_us.append((t2 - t1) / 1e3)
                submit_us.append((t3 - t2) / 1e3)
    finally:
        gc.enable()
    fast = alloc._fast
    out = {"plan_us": _stats(plan_us), "submit_us": _stats(submit_us),
           "run_us": _stats(run_us) if on_gpu else None,
           "fallbacks": None if fast is None else fast.n_fallback,
           "steps": n_steps, "release_rows_last": int(planned.n_release_rows),
           "alloc_rows_last": int(planned.n_alloc_rows)}
    if alloc.config.device.type == "cuda":
        torch.cuda.synchronize()
    return out, bufs


def _stats(samples) -> dict:
    arr = np.asarray(samples, dtype=np.float64)
    return {"p50": float(np.percentile(arr, 50)), "p90": float(np.percentile(arr, 90)),
            "mean": float(arr.mean()), "min": float(arr.min()), "n": int(arr.size)}


def run(args, argv, device, backend, note) -> int:
    if not fast_plan.AVAILABLE:
        print(f"compiled planner unavailable: {fast_plan.UNAVAILABLE_REASON}", file=sys.stderr)
        return 1
    cases = [("decode", b) for b in ((16, 64) if args.quick else BATCHES)] + [
        ("speculative", b) for b in ((16,) if args.quick else SPEC_BATCHES)]
    n_warmup, n_steps = (5, 30) if args.quick else (50, 1000)
    keep = 20 if args.quick else 200
    results = []
    for case, batch in cases:
        row = {"case": case, "batch": batch}
        ref_bufs = None
        for planner in ("numpy", "compiled"):
            out, bufs = measure(batch, planner, device, n_warmup, n_steps, seed=batch, keep=keep,
                                speculative=case == "speculative")
            row[planner] = out
            if ref_bufs is None:
                ref_bufs = bufs
            else:
                row["identical"] = all(np.array_equal(a, b) for a, b in
                                       zip(ref_bufs, bufs, strict=True))
        row["speedup"] = row["numpy"]["plan_us"]["p50"] / row["compiled"]["plan_us"]["p50"]
        results.append(row)
        c, n = row["compiled"], row["numpy"]
        print(f"{case:11s} B={batch:5d}  numpy plan {n['plan_us']['p50']:8.1f} us (p90 "
              f"{n['plan_us']['p90']:8.1f})  compiled plan {c['plan_us']['p50']:6.1f} us (p90 "
              f"{c['plan_us']['p90']:6.1f})  x{row['speedup']:.1f}  identical "
              f"{row['identical']}  fallbacks {c['fallbacks']}", flush=True)
    info = machine_info(device)
    doc = {"benchmark": "bench_planner", "command": "python benchmarks/bench_planner.py "
           + " ".join(argv), "device": str(device), "page_size": PAGE_SIZE,
           "model_window": MODEL_WINDOW, "chunk": CHUNK, "spec_k": SPEC_K,
           "warmup_steps": n_warmup,
           "machine": info, "results": results}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_planner.json"), "w") as f:
        json.dump(doc, f, indent=1)
    lines = [
        "# Planner host time per step: numpy vs compiled", "",
        f"`{doc['command']}` on {info['summary']}.", "",
        f"One step = `plan(release=[longest], evict_all=True, decode=B - 1 rows, "
        f"extend=([new], [{CHUNK}]))`, page size {PAGE_SIZE}, model window {MODEL_WINDOW}, "
        f"pool mode; {n_steps} measured steps after {n_warmup} warm-up, microseconds, "
        "GC off. Case `speculative`: the same step as a speculative round, "
        f"`plan(release=[longest], commit=(rows, n_accepted), evict=rows, decode=rows, "
        f"lookahead={SPEC_K}, extend=([new], [{CHUNK}]))`, n_accepted uniform in "
        f"[0, {SPEC_K + 1}]. `submit` = `mark_submitted` (the bookkeeping after a launch)"
        + ("; `run` = graph replay enqueue." if device.type == "cuda" else
           "; no kernel runs on the CPU (host planning only)."), "",
        "| case | B | numpy plan p50 (p90) | compiled plan p50 (p90) | speedup | compiled "
        "plan + submit p50 | fallbacks | descriptors identical |",
        "|:---|---:|---:|---:|---:|---:|---:|:---:|"]
    for row in results:
        n, c = row["numpy"], row["compiled"]
        lines.append(
            f"| {row['case']} | {row['batch']} | "
            f"{n['plan_us']['p50']:.1f} ({n['plan_us']['p90']:.1f}) | "
            f"{c['plan_us']['p50']:.1f} ({c['plan_us']['p90']:.1f}) | "
            f"{row['speedup']:.1f}x | {c['plan_us']['p50'] + c['submit_us']['p50']:.1f} | "
            f"{c['fallbacks']} | {row['identical']} |")
    with open(os.path.join(args.out, "bench_planner.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    ok = all(r["identical"] and r["compiled"]["fallbacks"] == 0 for r in results)
    return 0 if ok else 1


def main(argv=None) -> int:
    parser = bench_parser(__doc__, os.path.join(REPO, "results", "bench", "planner"),
                          "kernels for the GPU run (the CPU run launches none)")
    return bench_main(argv, parser.parse_args, run)


if __name__ == "__main__":
    sys.exit(main())
