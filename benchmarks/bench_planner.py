"""Host time of one scheduler step's plan: the numpy reference planner against its compiled twin.

    python benchmarks/bench_planner.py --out results/bench/planner-cpu    # CPU, ~3 min
    python benchmarks/bench_planner.py --quick --out /tmp/bench_planner   # CI smoke run

A continuous-batching decode workload at B in {16, 64, 256, 1024} running requests, page
size 16, a model window of 4096 (``sliding_window = 4095``), pool mode: lengths start
uniform in [W/2, 2W] (most requests are past their window, so the window rule frees SWA
pages as they cross page boundaries); every step releases the longest request, admits a
new one (``admit()``, untimed) and plans ONE step::

    plan(release=[done], evict_all=True, decode=rows, extend=([new], [256]))

-- B - 1 decode rows, the window eviction of every request, one release (its FULL and SWA
pages) and one 256-token prefill chunk -- with the rows passed as int64 numpy arrays, as an
engine's scheduler holds them. The speculative case (B in {16, 256}) is a speculative
engine's round on the same workload: every decoding row drafts ``SPEC_K`` = 3 tokens
(``1 + 3`` verify slots), and the next step accepts each row's drafts (uniform in [0, 3]:
all rejected and all accepted included; the step keeps the verified token and the accepted
drafts, the rejected tail's pages freed)::

    plan(release=[done], accept=(rows, n_accepted), evict=rows, decode=rows, lookahead=3,
         extend=([new], [256]))

Timed per step with ``perf_counter_ns``, garbage collection off: ``plan`` (``alloc.plan``:
normalise, plan, the descriptor written into its pinned buffer) and ``cancel`` (the undo);
then the same step is planned again and ``mark_submitted`` (untimed) so the workload moves
on. The compiled plan's parts: ``C`` (the time inside the extension's ``plan`` call of
that very plan, its own clock) and ``normalize`` (Step -> StepArrays, timed alone on the
same arguments; both planners pay it): Python = plan - C. No kernel runs (host planning
only). Both planners run the same
steps from the same seed; the first 200 steps' descriptor buffers are compared
(``identical``), and the twin must have planned every step (``compiled planned``).

Writes ``bench_planner.json`` and ``bench_planner.md`` into ``--out``: p50 with p20 / p80
over the measured steps (after warm-up), in microseconds. ``--before RUN/bench_planner.json``
(an earlier run of this script, on the same machine) adds its compiled ``plan`` p50 per case
as the "before" column, named by the commit that run measured (its folder's ``stamp.json``):
read from that run's data, never typed here.
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
import provenance  # noqa: E402
from timing import bench_main, bench_parser, machine_info, progress, say, summarize  # noqa: E402

import graphalloc as ga  # noqa: E402
from graphalloc.plan import compiled as twin  # noqa: E402
from graphalloc.plan.step import Step, normalize  # noqa: E402

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
        max_reqs=batch + 2, max_context_len=max_ctx, model_window=w + 1,
        index_dtype=torch.int32, device=device, backend="torch",
        max_tokens_per_alloc_row=MODEL_WINDOW, max_step_tokens=MODEL_WINDOW + 4 * batch + 8)
    return ga.HybridAllocator(cfg, planner=planner, executor="eager")


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
        self.alloc.mark_submitted(planned)  # no kernel: the device tables go stale

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
        accepted = self.rng.integers(0, spec[spec > 0])  # drafts accepted: 0 .. k
        return dict(release=release, accept=(pending, accepted), evict=rows, decode=rows,
                    lookahead=SPEC_K, extend=extend)


def normalize_us(alloc, args: dict) -> float:
    """Step -> StepArrays for ``args`` alone (the part of ``plan`` both planners share)."""
    t0 = time.perf_counter_ns()
    normalize(Step(**args), alloc.config)
    return (time.perf_counter_ns() - t0) / 1e3


def measure(batch: int, planner: str, n_warmup: int, n_steps: int, seed: int, keep: int,
            speculative: bool = False) -> tuple[dict, list]:
    alloc = make_alloc(batch, planner, "cpu", "eager")
    work = Workload(alloc, batch, seed, speculative)
    samples = {"plan": [], "cancel": [], "normalize": [], "C": []}
    bufs = []
    comp = alloc.pipeline.compiled
    planned_before = 0 if comp is None else comp.n_planned
    gc.collect()
    gc.disable()
    try:
        for i in range(n_warmup + n_steps):
            args = work.next_args()
            norm = normalize_us(alloc, args)
            t0 = time.perf_counter_ns()
            planned = alloc.plan(**args)
            t1 = time.perf_counter_ns()
            c_us = None if comp is None else comp._c.last_ns / 1e3  # inside C, this plan
            alloc.cancel(planned)
            t2 = time.perf_counter_ns()
            planned = alloc.plan(**args)
            alloc.mark_submitted(planned)
            if i < keep:
                bufs.append(alloc.ring.np_bufs[planned.buffer_index].copy())
            if i >= n_warmup:
                samples["plan"].append((t1 - t0) / 1e3)
                samples["cancel"].append((t2 - t1) / 1e3)
                samples["normalize"].append(norm)
                if c_us is not None:
                    samples["C"].append(c_us)
    finally:
        gc.enable()
    out = {name: summarize(values) for name, values in samples.items() if values}
    out["steps"] = n_steps
    out["compiled_planned"] = None if comp is None else comp.n_planned - planned_before
    out["release_rows_last"] = int(planned.n_release_rows)
    out["alloc_rows_last"] = int(planned.n_alloc_rows)
    return out, bufs


def _q(stats: dict) -> str:
    return f"{stats['p50']:.1f} ({stats['p20']:.1f} / {stats['p80']:.1f})"


def before_run(path: str | None) -> dict | None:
    """An earlier run's compiled ``plan`` p50 by (case, B), and the commit it measured (its
    folder's stamp, else the commit its machine record names): the "before" column."""
    if not path:
        return None
    with open(path) as f:
        doc = json.load(f)
    folder = os.path.dirname(os.path.abspath(path))
    stamp = provenance.read_stamp(folder)
    commit = (provenance.resolve(stamp, folder)["short"] if stamp else None) or (
        doc.get("machine") or {}).get("graphalloc_commit")
    return {"from": os.path.relpath(os.path.abspath(path), REPO), "commit": commit,
            "plan_p50_us": {f"{r['case']} {r['batch']}": r["compiled"]["plan"]["p50"]
                            for r in doc["results"]}}


def run(args, argv, device, backend, note) -> int:
    if not twin.AVAILABLE:
        print(f"compiled planner unavailable: {twin.UNAVAILABLE_REASON}", file=sys.stderr)
        return 1
    before = before_run(args.before)
    before_commit = before and before["commit"]
    cases = [("decode", b) for b in ((16, 64) if args.quick else BATCHES)] + [
        ("speculative", b) for b in ((16,) if args.quick else SPEC_BATCHES)]
    n_warmup, n_steps = (5, 30) if args.quick else (50, 1000)
    keep = 20 if args.quick else 200
    results = []
    bar = progress(2 * len(cases), "bench_planner", not args.no_progress, unit="run")
    for case, batch in cases:
        row = {"case": case, "batch": batch}
        ref_bufs = None
        for planner in ("numpy", "compiled"):
            out, bufs = measure(batch, planner, n_warmup, n_steps, seed=batch, keep=keep,
                                speculative=case == "speculative")
            row[planner] = out
            if bar is not None:
                bar.update(1)
            if ref_bufs is None:
                ref_bufs = bufs
            else:
                row["identical"] = all(np.array_equal(a, b) for a, b in
                                       zip(ref_bufs, bufs, strict=True))
        n, c = row["numpy"], row["compiled"]
        row["speedup"] = n["plan"]["p50"] / c["plan"]["p50"]
        # every step, its re-plan and the admit before it: planned by the twin
        row["all_compiled"] = c["compiled_planned"] >= 3 * (n_warmup + n_steps)
        results.append(row)
        say(bar, f"{case:11s} B={batch:5d}  numpy plan {_q(n['plan'])}  compiled plan "
            f"{_q(c['plan'])} (C {c['C']['p50']:.1f}, normalize "
            f"{c['normalize']['p50']:.1f})  x{row['speedup']:.0f}  identical "
            f"{row['identical']}")
    if bar is not None:
        bar.close()
    info = machine_info(device)
    doc = {"benchmark": "bench_planner", "command": "python benchmarks/bench_planner.py "
           + " ".join(argv), "device": str(device), "page_size": PAGE_SIZE,
           "model_window": MODEL_WINDOW, "chunk": CHUNK, "spec_k": SPEC_K,
           "warmup_steps": n_warmup, "before": before,
           "machine": info, "results": results}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_planner.json"), "w") as f:
        json.dump(doc, f, indent=1)
    lines = [
        "# Planner host time per step: numpy reference vs compiled twin", "",
        f"`{doc['command']}` on {info['summary']}.", "",
        f"One step = `plan(release=[longest], evict_all=True, decode=B - 1 rows, "
        f"extend=([new], [{CHUNK}]))`, page size {PAGE_SIZE}, model window {MODEL_WINDOW}, "
        f"pool mode; {n_steps} measured steps after {n_warmup} warm-up; microseconds, p50 "
        "(p20 / p80), GC off. Case `speculative`: the same step as a speculative round, "
        f"`plan(release=[longest], accept=(rows, n_accepted), evict=rows, decode=rows, "
        f"lookahead={SPEC_K}, extend=([new], [{CHUNK}]))`, n_accepted uniform in "
        f"[0, {SPEC_K}] (1 + n tokens kept). `plan` = `alloc.plan(...)` (normalise, plan, "
        "descriptor written), `cancel` = `alloc.cancel` (the undo). The compiled plan's parts: "
        "`C` (inside the extension's call of that plan), `normalize` (Step -> StepArrays, "
        "shared by both planners); Python = plan - C. No kernel runs on the CPU. "
        + (f"`before` = the compiled `plan()` p50 of `{before['from']}` (commit "
           f"{before['commit']}), read from that run." if before else
           "No `--before` run given."), "",
        "| case | B | numpy plan | compiled plan | of which C | normalize | Python (plan - C) "
        f"| cancel | speedup | before{f' ({before_commit})' if before else ''} | identical |",
        "|:---|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|"]
    for row in results:
        n, c = row["numpy"], row["compiled"]
        old = (before or {}).get("plan_p50_us", {}).get(f"{row['case']} {row['batch']}")
        lines.append(
            f"| {row['case']} | {row['batch']} | {_q(n['plan'])} | {_q(c['plan'])} | "
            f"{_q(c['C'])} | {c['normalize']['p50']:.1f} | "
            f"{c['plan']['p50'] - c['C']['p50']:.1f} | {c['cancel']['p50']:.1f} | "
            f"{row['speedup']:.0f}x | {'' if old is None else f'{old:.1f}'} | "
            f"{row['identical'] and row['all_compiled']} |")
    with open(os.path.join(args.out, "bench_planner.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    ok = all(r["identical"] and r["all_compiled"] for r in results)
    return 0 if ok else 1


def main(argv=None) -> int:
    parser = bench_parser(__doc__, os.path.join(REPO, "results", "bench", "planner"),
                          "kernels for the GPU run (the CPU run launches none)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--before", default=None, metavar="JSON",
                        help="an earlier bench_planner.json: its compiled plan p50 becomes "
                             "the 'before' column, named by its commit")
    return bench_main(argv, parser.parse_args, run)


if __name__ == "__main__":
    sys.exit(main())
