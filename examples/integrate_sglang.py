"""SGLang's scheduler loop through graphalloc.integrations.sglang, on the CPU.

A toy of SGLang's non-overlap event loop (no model: the "forward" only advances
lengths): requests arrive over time; each iteration forms a prefill batch (chunked to
a token budget, admitted while ``available_size()`` covers it) or else a decode batch
(retracting the newest request while ``check_decode_mem`` fails), calls
``prepare_for_extend`` / ``prepare_for_decode``, then releases finished requests in a
free group, as ``process_batch_result`` does. Every iteration with a batch is ONE
graphalloc step: the previous iteration's releases, this one's window evictions and its
allocation. The summary checks that, and that every page comes back.

    python examples/integrate_sglang.py                 # default workload, a few seconds
    python examples/integrate_sglang.py --requests 64 --interval 32 --page-size 16
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from collections import deque

import numpy as np
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import graphalloc as ga  # noqa: E402
from graphalloc.integrations.sglang import SGLangAllocator  # noqa: E402

__all__ = ["main", "Req", "Batch"]


@dataclasses.dataclass(eq=False)
class Req:
    """The fields of SGLang's ``Req`` the seam reads (``req_pool_idx``, ``finished()``)."""

    rid: int
    arrival: int
    prompt_len: int
    max_new_tokens: int
    req_pool_idx: int | None = None
    kv_len: int = 0
    n_out: int = 0

    def finished(self) -> bool:
        return self.n_out >= self.max_new_tokens


@dataclasses.dataclass
class Batch:
    """The host fields of SGLang's ``ScheduleBatch`` the seam reads."""

    reqs: list
    prefix_lens: list | None = None
    extend_lens: list | None = None
    seq_lens_cpu: list | None = None


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("--max-running", type=int, default=8)
    p.add_argument("--chunk", type=int, default=64, help="chunked-prefill token budget")
    p.add_argument("--page-size", type=int, default=4)
    p.add_argument("--window", type=int, default=33, help="the model's sliding window")
    p.add_argument("--interval", type=int, default=8, help="SWA eviction interval (tokens)")
    p.add_argument("--full-pages", type=int, default=300)
    p.add_argument("--swa-pages", type=int, default=120)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse(argv)
    ps = args.page_size
    cfg = ga.AllocatorConfig.for_engine(
        max_running_requests=args.max_running, chunked_prefill_size=args.chunk,
        max_context_len=512, page_size=ps, model_sliding_window=args.window,
        num_full_pages=args.full_pages, num_swa_pages=args.swa_pages,
        max_reqs=2 * args.max_running)  # running + one iteration's releases
    alloc = ga.HybridAllocator(cfg)
    seam = SGLangAllocator(alloc, swa_eviction_interval=args.interval)
    rng = np.random.default_rng(args.seed)
    arrivals = deque(Req(i, 2 * i, int(rng.integers(8, 100)), int(rng.integers(4, 48)))
                     for i in range(args.requests))
    waiting, running, chunked, finished = deque(), [], None, []
    s = dict(iterations=0, iterations_with_batch=0, steps=0, extend_batches=0,
             decode_batches=0, refused=0, retracted=0, evicted_pages=0, peak_swa_used=0,
             peak_full_used=0, idle_flush_steps=0)
    t0 = time.perf_counter()
    it = 0
    while arrivals or waiting or running or chunked is not None:
        while arrivals and arrivals[0].arrival <= it:
            waiting.append(arrivals.popleft())
        it += 1
        s["iterations"] += 1
        before = alloc.steps_run
        batch = out = None
        picks, lens, budget, need = [], [], args.chunk, len(running) * ps
        for req in ([chunked] if chunked is not None else []) + list(waiting):
            if budget <= 0 or len(running) + len(picks) >= args.max_running:
                break
            n = min(req.prompt_len - req.kv_len, budget)
            need += n + ps
            if seam.available_size() < need:  # PrefillAdder's budget check
                break
            picks.append(req)
            lens.append(n)
            budget -= n
        if picks:
            batch = Batch(picks, [r.kv_len for r in picks], lens)
            out = seam.prepare_for_extend(batch)
            if out is None:
                s["refused"] += 1
            else:
                s["extend_batches"] += 1
                for r in picks:
                    if r is not chunked:
                        waiting.remove(r)
        if out is None and running:
            while running and seam.available_size() < len(running) * ps:
                victim = running.pop()  # retract_decode
                seam.release_kv_cache(victim)
                victim.kv_len = victim.n_out = 0
                waiting.appendleft(victim)
                s["retracted"] += 1
            if running:
                batch = Batch(list(running), seq_lens_cpu=[r.kv_len for r in running])
                out = seam.prepare_for_decode(batch)
                s["decode_batches"] += 1
        if out is None:
            s["idle_flush_steps"] += seam.flush()  # idle iteration: the recorded releases
            continue
        s["iterations_with_batch"] += 1
        s["evicted_pages"] += out.n_evicted_pages
        # the model would write KV to out.out_cache_loc / out.swa_out_cache_loc here
        if batch.extend_lens is not None:
            chunked = None
            for r, n in zip(batch.reqs, lens, strict=True):
                r.kv_len += n
                if r.kv_len == r.prompt_len:
                    r.n_out = 1
                    running.append(r)
                else:
                    chunked = r
        else:
            for r in batch.reqs:
                r.kv_len += 1
                r.n_out += 1
        s["peak_full_used"] = max(s["peak_full_used"], cfg.num_full_pages - alloc.n_free("full"))
        s["peak_swa_used"] = max(s["peak_swa_used"], cfg.num_swa_pages - alloc.n_free("swa"))
        finished += [r for r in running if r.finished()]
        seam.release_finished(running)  # free_group_begin / release_kv_cache / end
        running = [r for r in running if not r.finished()]
        s["steps"] += alloc.steps_run - before
    s["idle_flush_steps"] += seam.flush()
    alloc.check_integrity()
    seconds = time.perf_counter() - t0
    s.update(finished=len(finished), pages_total=cfg.num_full_pages + cfg.num_swa_pages,
             pages_free_at_end=alloc.n_free("full") + alloc.n_free("swa"),
             host_ms_per_iteration=1e3 * seconds / max(s["iterations"], 1))
    if not args.quiet:
        print(f"SGLang seam: {s['finished']} requests in {s['iterations']} iterations "
              f"({s['extend_batches']} extend, {s['decode_batches']} decode batches, "
              f"{s['refused']} refused, {s['retracted']} retracted)")
        print(f"  graphalloc steps: {s['steps']} for {s['iterations_with_batch']} iterations "
              f"with a batch (one each), {s['idle_flush_steps']} idle flushes")
        print(f"  SWA pages evicted by the window rule (interval {args.interval}): "
              f"{s['evicted_pages']}; peak pages in use FULL {s['peak_full_used']} / "
              f"{cfg.num_full_pages}, SWA {s['peak_swa_used']} / {cfg.num_swa_pages}")
        print(f"  every page free at the end: {s['pages_free_at_end'] == s['pages_total']}; "
              f"{s['host_ms_per_iteration']:.2f} ms host time per iteration on "
              f"{cfg.device} ({cfg.backend})")
    return s


if __name__ == "__main__":
    main()
