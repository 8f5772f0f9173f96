"""Batched frees, replayed: a continuous-batching workload driven through graphalloc's step graph.

Requests with long-tailed prompt and output lengths (log-normal, like chat
traffic) arrive as others finish, so about ``--concurrency`` run at once. Every
scheduler step is ONE call, ``alloc.step(release=finished, evict_all=True,
decode=running, extend=prefill_chunks)``: the host plans it from host-side
lengths (numpy) and replays the captured step graph (:class:`graphalloc.StepGraph`;
on a CPU machine the same step runs eagerly). Inside that one replay, the SWA
pages of every request whose window slid past a page boundary and all pages of
every finished request are freed together: the batched frees.

At the end the script drains every request and prints a summary: steps,
segments and pages freed, pages allocated, per-step host time (``plan()`` and
the replay's launch, each timed on the host) and GPU time (CUDA events around
the replay only, ``timing.StepEvents``: planning is never inside it),
host synchronisations in the loop (0: on CUDA the loop runs under
``torch.cuda.set_sync_debug_mode("error")``; on a CPU every device read is
counted), and the invariant checks passed (``check_integrity`` every
``--check-every`` steps and at the end, plus the device error word).

    python examples/replay_batched_frees.py                 # defaults: < 1 min on a CPU
    python examples/replay_batched_frees.py --steps 20000 --page-size 1 --window 128
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

if not torch.cuda.is_available():  # Triton kernels (if chosen) run in the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import graphalloc as ga  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import timing  # noqa: E402
from provenance import add_stamp_option, stamp_or_exit  # noqa: E402

__all__ = ["main", "Workload"]


class Workload:
    """Request lengths: log-normal prompts and outputs (median, sigma), clipped."""

    def __init__(self, rng: np.random.Generator, prompt_median: float, output_median: float,
                 sigma: float, max_prompt: int, max_output: int):
        self.rng, self.sigma = rng, sigma
        self.mu_p, self.mu_o = np.log(prompt_median), np.log(output_median)
        self.max_prompt, self.max_output = max_prompt, max_output

    def draw(self) -> tuple[int, int]:
        p = int(np.clip(self.rng.lognormal(self.mu_p, self.sigma), 1, self.max_prompt))
        o = int(np.clip(self.rng.lognormal(self.mu_o, self.sigma), 1, self.max_output))
        return p, o


@contextlib.contextmanager
def count_device_reads():
    """Counts reads of tensor data into Python during the block (``item``, ``tolist``,
    ``cpu``, ``numpy``, ``bool``/``int``/``float`` of a tensor): on a GPU each is a host
    sync. Yields a one-element list holding the count."""
    names = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__")
    saved = {n: getattr(torch.Tensor, n) for n in names}
    count = [0]

    def wrap(fn):
        def counted(self, *a, **k):
            count[0] += 1
            return fn(self, *a, **k)
        return counted

    for n in names:
        setattr(torch.Tensor, n, wrap(saved[n]))
    try:
        yield count
    finally:
        for n, fn in saved.items():
            setattr(torch.Tensor, n, fn)


def build(args) -> ga.HybridAllocator:
    ps, W = args.page_size, args.window
    n_run = args.concurrency
    max_ctx = args.max_prompt + args.max_output
    swa_per_req = -(-(W + args.chunk) // ps) + 2  # window + one prefill chunk, both ends partial
    cfg = ga.AllocatorConfig(
        page_size=ps, model_window=W + 1, max_reqs=n_run + 8, max_context_len=max_ctx,
        num_full_pages=args.full_pages or n_run * -(-int(2.5 * (args.prompt_median
                                                                 + args.output_median)) // ps),
        num_swa_pages=n_run * swa_per_req, device=args.device, backend=args.backend,
        max_alloc_rows=n_run + 8, max_tokens_per_alloc_row=args.chunk,
        max_step_tokens=n_run + args.prefill_budget)
    return ga.HybridAllocator(cfg, executor="graph")


class Scheduler:
    """Host-side request state and the admission policy (FULL pages reserved for a request's
    whole length at admission, SWA pages for its window plus one prefill chunk)."""

    def __init__(self, alloc: ga.HybridAllocator, workload: Workload, args):
        self.alloc, self.workload, self.args = alloc, workload, args
        cfg = alloc.config
        self.ps = cfg.page_size
        self.swa_per_req = -(-(cfg.sliding_window + args.chunk) // self.ps) + 2
        self.waiting = [workload.draw() for _ in range(args.concurrency)]
        self.running: dict[int, dict] = {}  # row -> {"prompt", "out", "done_prefill", ...}
        self.full_reserved = 0
        self.n_admitted = self.n_finished = 0

    def plan_step(self, drain: bool = False) -> dict:
        """Finished rows, admissions, prefill chunks and decode rows of the next step.
        ``drain``: release every running request (finished or not), nothing else."""
        cfg, ps = self.alloc.config, self.ps
        finished = [r for r, q in self.running.items() if drain or q["gen"] >= q["out"]]
        for r in finished:
            q = self.running.pop(r)
            self.full_reserved -= q["full_pages"]
            self.n_finished += 1
            if not drain:
                self.waiting.append(self.workload.draw())  # keep the load steady
        if drain:
            return {"release": finished, "decode": [], "extend": ([], [])}
        live_rows = self.alloc.n_live
        while (self.waiting and live_rows < cfg.max_reqs
               and len(self.running) < self.args.concurrency):
            p, o = self.waiting[0]
            need = -(-(p + o) // ps)
            if (self.full_reserved + need > cfg.num_full_pages
                    or (len(self.running) + 1) * self.swa_per_req > cfg.num_swa_pages):
                break
            self.waiting.pop(0)
            row = self.alloc.admit()
            live_rows += 1
            self.full_reserved += need
            self.running[row] = {"prompt": p, "out": o, "prefilled": 0, "gen": 0,
                                 "full_pages": need}
            self.n_admitted += 1
        budget = self.args.prefill_budget
        ext_rows, ext_lens, dec_rows = [], [], []
        for r, q in self.running.items():
            if q["prefilled"] < q["prompt"]:
                n = min(q["prompt"] - q["prefilled"], self.args.chunk, budget)
                if n > 0:
                    ext_rows.append(r)
                    ext_lens.append(n)
                    budget -= n
            elif q["prefilled"] + q["gen"] < cfg.max_context_len:
                dec_rows.append(r)
        return {"release": finished, "decode": dec_rows, "extend": (ext_rows, ext_lens)}

    def commit(self, plan: dict) -> None:
        for r, n in zip(*plan["extend"], strict=True):
            q = self.running[r]
            q["prefilled"] += n
            if q["prefilled"] == q["prompt"]:
                q["gen"] += 1  # the prefill's last position yields the first token
        for r in plan["decode"]:
            self.running[r]["gen"] += 1


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--steps", type=int, default=1500,
                    help="scheduler steps; one more step then releases every running request")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--window", type=int, default=256, help="sliding window W in tokens")
    ap.add_argument("--concurrency", type=int, default=48, help="requests running at once")
    ap.add_argument("--prompt-median", type=float, default=320.0)
    ap.add_argument("--output-median", type=float, default=160.0)
    ap.add_argument("--sigma", type=float, default=1.0, help="log-normal sigma of both lengths")
    ap.add_argument("--max-prompt", type=int, default=4096)
    ap.add_argument("--max-output", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=512, help="chunked-prefill tokens per request")
    ap.add_argument("--prefill-budget", type=int, default=1024, help="prefill tokens per step")
    ap.add_argument("--full-pages", type=int, default=0, help="FULL pool size (0: auto)")
    ap.add_argument("--check-every", type=int, default=250,
                    help="check_integrity() every N steps (reads the device)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    choices=["cpu", "cuda"])
    ap.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="", help="also write the summary to this JSON file")
    ap.add_argument("--no-progress", action="store_true")
    add_stamp_option(ap)
    args = ap.parse_args(argv)
    args.backend, _ = timing.pick_backend(args.backend, args.device)
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    out_dir = os.path.dirname(os.path.abspath(args.json)) if args.json else ""
    stamp_or_exit(out_dir, __file__, argv, allow_dirty=args.allow_dirty)
    with timing.cpu_threads(args.device):
        return _run(args)


def _run(args) -> dict:
    alloc = build(args)  # executor="graph": one captured graph per descriptor buffer on CUDA
    cfg = alloc.config
    graph = alloc.executor
    sched = Scheduler(alloc, Workload(np.random.default_rng(args.seed), args.prompt_median,
                                      args.output_median, args.sigma, args.max_prompt,
                                      args.max_output), args)
    cuda = cfg.device.type == "cuda"
    print(f"graphalloc replay demo: page_size {cfg.page_size}, window {cfg.sliding_window}, "
          f"{args.concurrency} concurrent requests (log-normal lengths, medians "
          f"{args.prompt_median:.0f}/{args.output_median:.0f}), pools FULL "
          f"{cfg.num_full_pages} / SWA {cfg.num_swa_pages} pages; {args.device}, backend "
          f"{cfg.backend}, {'graph replay' if graph.graphs else 'eager steps (no GPU)'}")
    bar = None
    if not args.no_progress:
        try:
            from tqdm import tqdm
            bar = tqdm(total=args.steps, desc="steps", unit="step", file=sys.stderr)
        except ImportError:
            pass
    tot = {"release_segments": 0, "requests_released": 0, "swa_pages_evicted": 0,
           "freed_full": 0, "freed_swa": 0, "alloc_full": 0, "alloc_swa": 0,
           "tokens_allocated": 0, "steps_with_evictions": 0, "steps_with_releases": 0}
    host_s, checks = [], 0
    events = timing.StepEvents(cuda)
    max_segments = 0
    t_loop = time.perf_counter()
    sync_ctx = contextlib.ExitStack()
    if cuda:
        old_mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        sync_ctx.callback(torch.cuda.set_sync_debug_mode, old_mode)
    with sync_ctx, count_device_reads() as reads:
        for step in range(args.steps + 1):
            drain = step == args.steps
            plan = sched.plan_step(drain=drain)
            t0 = time.perf_counter()
            p = alloc.plan(release=plan["release"], evict_all=True, decode=plan["decode"],
                           extend=plan["extend"] if plan["extend"][0] else None)
            t1 = time.perf_counter()
            with events.interval():  # GPU time: the replay only, never plan()
                t2 = time.perf_counter()
                alloc.run(p)  # one graph replay (or the eager step)
                t3 = time.perf_counter()
            host_s.append((t1 - t0, t3 - t2))  # host: plan, replay launch (no event records)
            sched.commit(plan)
            evicted = p.pages_evicted
            tot["release_segments"] += p.n_release_rows
            tot["requests_released"] += len(plan["release"])
            tot["swa_pages_evicted"] += evicted
            tot["freed_full"] += p.pages_freed["full"]
            tot["freed_swa"] += p.pages_freed["swa"]
            tot["alloc_full"] += p.pages_allocated["full"]
            tot["alloc_swa"] += p.pages_allocated["swa"]
            tot["tokens_allocated"] += p.n_tokens
            tot["steps_with_evictions"] += evicted > 0
            tot["steps_with_releases"] += len(plan["release"]) > 0
            max_segments = max(max_segments, p.n_release_rows)
            if (step + 1) % args.check_every == 0:
                reads_before = reads[0]  # check() and check_integrity() read on purpose
                alloc.check()
                alloc.check_integrity()
                reads[0] = reads_before
                checks += 1
            if bar is not None and not drain:
                bar.update(1)
    loop_s = time.perf_counter() - t_loop
    if bar is not None:
        bar.close()
    gpu_us = events.us()  # one sync, after the loop
    alloc.check()
    alloc.check_integrity()
    checks += 1
    st = alloc.stats()
    host_us = np.array(host_s).reshape(-1, 2) * 1e6
    summary = {
        "steps": args.steps + 1, "drain_segments": p.n_release_rows,
        "drain_pages_freed": dict(p.pages_freed),
        "requests_admitted": sched.n_admitted, "requests_released": tot["requests_released"],
        "release_segments": tot["release_segments"], "max_segments_in_one_step": max_segments,
        "steps_with_evictions": tot["steps_with_evictions"],
        "steps_with_releases": tot["steps_with_releases"],
        "pages_freed": {"full": tot["freed_full"], "swa": tot["freed_swa"],
                        "swa_by_window": tot["swa_pages_evicted"]},
        "pages_allocated": {"full": tot["alloc_full"], "swa": tot["alloc_swa"]},
        "tokens_allocated": tot["tokens_allocated"],
        "free_pages_at_end": {"full": st["full_free_pages"], "swa": st["swa_free_pages"]},
        "pool_pages": {"full": cfg.num_full_pages, "swa": cfg.num_swa_pages},
        "host_us_per_step": timing.summarize(host_us.sum(1)),
        "plan_us_per_step": timing.summarize(host_us[:, 0]),
        "run_us_per_step": timing.summarize(host_us[:, 1]),
        "gpu_us_per_step": timing.summarize(gpu_us),  # None without CUDA
        "host_syncs_in_loop": 0 if cuda else reads[0],
        "sync_check": "sync debug mode 'error' (CUDA)" if cuda else "device reads counted (CPU)",
        "invariant_checks_passed": checks, "ring_stalls": alloc.ring.stalls,
        "graph_replays": graph.replays, "loop_s": loop_s,
        "device": args.device, "backend": cfg.backend, "page_size": cfg.page_size,
        "window": cfg.sliding_window,
    }
    _print_summary(summary)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return summary


def _print_summary(s: dict) -> None:
    h, g = s["host_us_per_step"], s["gpu_us_per_step"]
    pl, ru = s["plan_us_per_step"]["p50"], s["run_us_per_step"]["p50"]
    run_what = "replay launch" if g else "eager step on the CPU"
    rows = [
        ("steps", f"{s['steps']} ({s['steps'] - 1} + one that releases every running "
                  f"request: {s['drain_segments']} segments, FULL "
                  f"{s['drain_pages_freed']['full']} + SWA {s['drain_pages_freed']['swa']} "
                  f"pages), {s['graph_replays']} graph replays"),
        ("requests", f"{s['requests_admitted']} admitted, {s['requests_released']} released"),
        ("segments freed", f"{s['release_segments']} descriptor rows, up to "
                           f"{s['max_segments_in_one_step']} in one step"),
        ("steps with frees", f"{s['steps_with_evictions']} with window evictions, "
                             f"{s['steps_with_releases']} with releases"),
        ("pages freed", f"FULL {s['pages_freed']['full']}, SWA {s['pages_freed']['swa']} "
                        f"({s['pages_freed']['swa_by_window']} by the sliding window)"),
        ("pages allocated", f"FULL {s['pages_allocated']['full']}, "
                            f"SWA {s['pages_allocated']['swa']} "
                            f"({s['tokens_allocated']} tokens)"),
        ("free at end", f"FULL {s['free_pages_at_end']['full']}/{s['pool_pages']['full']}, "
                        f"SWA {s['free_pages_at_end']['swa']}/{s['pool_pages']['swa']}"),
        ("host time/step", f"median {h['p50']:.1f} us (p20 {h['p20']:.1f}, "
                           f"p80 {h['p80']:.1f}): plan {pl:.1f} + {run_what} {ru:.1f}"),
        ("GPU time/step", f"median {g['p50']:.1f} us (p20 {g['p20']:.1f}, p80 {g['p80']:.1f}),"
                          " CUDA events around the replay only" if g else "n/a (no GPU)"),
        ("host syncs", f"{s['host_syncs_in_loop']} ({s['sync_check']})"),
        ("invariants", f"check_integrity + error word passed {s['invariant_checks_passed']} "
                       f"times; {s['ring_stalls']} descriptor-ring stalls"),
    ]
    print("\nsummary")
    for k, v in rows:
        print(f"  {k:<17} {v}")


if __name__ == "__main__":
    main()
