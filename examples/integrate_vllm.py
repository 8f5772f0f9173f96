"""vLLM v1's scheduler loop through graphalloc.integrations.vllm, on the CPU.

A toy of ``Scheduler.schedule()`` / ``update_from_output()`` (no model: the "forward"
advances computed tokens and accepts a random number of speculative tokens): running
requests first (``allocate_slots``; on ``None`` the newest running request is
preempted with ``free`` and the call retried), then waiting ones
(``get_computed_blocks``, ``allocate_slots``; the first ``None`` stops admission), all
within a token budget (chunked prefill), with ``--lookahead`` speculative slots per
request. ``run_step()`` at the end of each ``schedule()`` is the iteration's ONE
graphalloc step. Request ids are deliberately odd hashables (tuples). The summary
checks one step per iteration and that every page comes back.

    python examples/integrate_vllm.py
    python examples/integrate_vllm.py --lookahead 3 --requests 32 --page-size 16
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
from graphalloc.integrations.vllm import GraphallocKVCacheManager  # noqa: E402

__all__ = ["main", "Request"]


@dataclasses.dataclass(eq=False)
class Request:
    """What vLLM's ``Request`` carries that this scheduler uses."""

    request_id: object
    arrival: int
    num_prompt_tokens: int
    max_tokens: int
    num_computed_tokens: int = 0
    num_output_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens

    def finished(self) -> bool:
        return self.num_output_tokens >= self.max_tokens


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("--max-seqs", type=int, default=8, help="max_num_seqs")
    p.add_argument("--budget", type=int, default=64, help="max_num_batched_tokens")
    p.add_argument("--lookahead", type=int, default=2, help="speculative tokens per step")
    p.add_argument("--page-size", type=int, default=4)
    p.add_argument("--window", type=int, default=33, help="the model's sliding window")
    p.add_argument("--full-pages", type=int, default=300)
    p.add_argument("--swa-pages", type=int, default=120)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse(argv)
    k, ps = args.lookahead, args.page_size
    cfg = ga.AllocatorConfig.for_engine(
        max_running_requests=args.max_seqs, chunked_prefill_size=args.budget + k,
        max_context_len=512, page_size=ps, model_sliding_window=args.window,
        num_full_pages=args.full_pages, num_swa_pages=args.swa_pages,
        num_lookahead_tokens=k, max_reqs=2 * args.max_seqs)
    alloc = ga.HybridAllocator(cfg)
    mgr = GraphallocKVCacheManager(alloc)
    rng = np.random.default_rng(args.seed)
    arrivals = deque(Request(("user", i % 3, f"r{i}"), 2 * i, int(rng.integers(8, 100)),
                             int(rng.integers(4, 48))) for i in range(args.requests))
    waiting, running, finished = deque(), [], []
    s = dict(iterations=0, steps=0, preempted=0, admission_stops=0, draft_tokens=0,
             rejected_tokens=0, peak_full_used=0, peak_swa_used=0)
    t0 = time.perf_counter()
    it = 0
    while arrivals or waiting or running:
        while arrivals and arrivals[0].arrival <= it:
            waiting.append(arrivals.popleft())
        it += 1
        before = alloc.steps_run
        # ---- schedule(): running requests, then waiting ones ---------------------------
        scheduled, left, preempted, i = [], args.budget, False, 0
        while i < len(running) and left > 0:
            req = running[i]
            decoding = req.num_computed_tokens >= req.num_prompt_tokens
            want = 1 + k if decoding else req.num_tokens - req.num_computed_tokens
            if decoding and left < want:
                break
            n = min(want, left)
            while (blocks := mgr.allocate_slots(req.request_id, n, num_lookahead_tokens=k,
                                                num_computed_tokens=req.num_computed_tokens)
                   ) is None:
                victim = running.pop()
                mgr.free(victim.request_id)
                victim.num_computed_tokens = 0
                waiting.appendleft(victim)
                preempted = True
                s["preempted"] += 1
                if victim is req:
                    break
            if blocks is None:
                break
            scheduled.append((req, n, decoding))
            left -= n
            i += 1
        while not preempted and waiting and left > 0 and len(running) < args.max_seqs:
            req = waiting[0]
            _, n_hit = mgr.get_computed_blocks(req.request_id)  # no prefix cache: 0
            n = min(req.num_tokens - req.num_computed_tokens - n_hit, left)
            if mgr.allocate_slots(req.request_id, n, num_lookahead_tokens=k,
                                  num_computed_tokens=req.num_computed_tokens) is None:
                s["admission_stops"] += 1
                break
            running.append(waiting.popleft())
            scheduled.append((req, n, False))
            left -= n
        if not scheduled and not mgr.pending:
            continue
        mgr.run_step()  # the iteration's ONE graphalloc step
        s["iterations"] += 1
        # the model would write KV to mgr.token_slots(...) and read PageTables here
        # ---- update_from_output(): computed tokens, speculative acceptance, frees ------
        for req, n, decoding in scheduled:
            req.num_computed_tokens += n
            if decoding and k:
                accepted = int(rng.integers(0, k + 1))
                req.num_computed_tokens -= k - accepted
                req.num_output_tokens += accepted + 1
                s["draft_tokens"] += k
                s["rejected_tokens"] += k - accepted
            elif req.num_computed_tokens >= req.num_tokens:
                req.num_output_tokens += 1
        s["peak_full_used"] = max(s["peak_full_used"], cfg.num_full_pages - alloc.n_free("full"))
        s["peak_swa_used"] = max(s["peak_swa_used"], cfg.num_swa_pages - alloc.n_free("swa"))
        for req in [r for r in running if r.finished()]:
            mgr.free(req.request_id)
            running.remove(req)
            finished.append(req)
        s["steps"] += alloc.steps_run - before
    mgr.run_step()  # the last iteration's frees
    alloc.check_integrity()
    seconds = time.perf_counter() - t0
    s.update(finished=len(finished), pages_total=cfg.num_full_pages + cfg.num_swa_pages,
             pages_free_at_end=alloc.n_free("full") + alloc.n_free("swa"),
             host_ms_per_iteration=1e3 * seconds / max(s["iterations"], 1))
    if not args.quiet:
        print(f"vLLM facade: {s['finished']} requests in {s['iterations']} schedule() calls, "
              f"{s['steps']} graphalloc steps (one each); {s['preempted']} preemptions, "
              f"{s['admission_stops']} admission stops (allocate_slots -> None)")
        print(f"  lookahead {k}: {s['draft_tokens']} draft slots, {s['rejected_tokens']} "
              "rejected and reused by later tokens")
        print(f"  peak pages in use FULL {s['peak_full_used']} / {cfg.num_full_pages}, SWA "
              f"{s['peak_swa_used']} / {cfg.num_swa_pages}; every page free at the end: "
              f"{s['pages_free_at_end'] == s['pages_total']}")
        print(f"  {s['host_ms_per_iteration']:.2f} ms host time per iteration on {cfg.device} "
              f"({cfg.backend})")
    return s


if __name__ == "__main__":
    main()
