"""vLLM v1's scheduler loop through graphalloc.integrations.vllm, on the CPU.

A toy of ``Scheduler.schedule()`` / ``update_from_output()`` with prefix caching (no
model: the "forward" writes each position's token id into a fake KV store at the slots
``token_slots`` names, and accepts a random number of speculative tokens): requests that
share a system prompt arrive over time; running requests are scheduled first
(``allocate_slots``; on ``None`` the newest running request is preempted with ``free``,
which caches its computed blocks, and the call retried), then waiting ones
(``get_computed_blocks`` -- the cache lookup, whole blocks, never the last token -- then
``allocate_slots`` with the hit; the first ``None`` stops admission), all within a token
budget (chunked prefill), with ``--lookahead`` speculative slots per request. When a
prompt's prefill completes its blocks are cached (``cache_blocks``); a finished request's
go into the cache at ``free``. ``run_step()`` at the end of each ``schedule()`` is the
iteration's ONE graphalloc step: hits admitted on their shared blocks, cache inserts (a
take before the release), frees, window removals and allocations. Request ids are
deliberately odd hashables (tuples). The summary prints the hit rate (vLLM's prefix-cache
stats) and checks that every request read back its own tokens, that the audit is clean
and that every page comes back once the cache is dropped.

    python examples/integrate_vllm.py
    python examples/integrate_vllm.py --lookahead 3 --requests 32 --page-size 16
    python examples/integrate_vllm.py --no-cache        # enable_caching=False
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
    prompt_token_ids: list
    max_tokens: int
    seed: int
    num_computed_tokens: int = 0
    num_output_tokens: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens

    def token_at(self, pos: int) -> int:
        """The prompt's tokens, then made-up outputs (drafts at the same positions)."""
        if pos < self.num_prompt_tokens:
            return self.prompt_token_ids[pos]
        return 50_000 + (self.seed * 7919 + pos * 104_729) % 40_000

    def token_ids(self, n: int) -> list:
        return [self.token_at(p) for p in range(n)]

    def finished(self) -> bool:
        return self.num_output_tokens >= self.max_tokens


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("--max-seqs", type=int, default=8, help="max_num_seqs")
    p.add_argument("--budget", type=int, default=64, help="max_num_batched_tokens")
    p.add_argument("--lookahead", type=int, default=2, help="speculative tokens per step")
    p.add_argument("--system-prompt", type=int, default=96,
                   help="tokens of the system prompt every request starts with")
    p.add_argument("--page-size", type=int, default=4)
    p.add_argument("--window", type=int, default=33, help="the model's sliding window")
    p.add_argument("--full-pages", type=int, default=360)
    p.add_argument("--swa-pages", type=int, default=160)
    p.add_argument("--handles", type=int, default=16, help="prefix-cache entries at most")
    p.add_argument("--no-cache", action="store_true", help="enable_caching=False")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse(argv)
    k, ps, cached = args.lookahead, args.page_size, not args.no_cache
    cfg = ga.AllocatorConfig.for_engine(
        max_running_requests=args.max_seqs, chunked_prefill_size=args.budget + k,
        max_context_len=256, page_size=ps, model_window=args.window,
        num_full_pages=args.full_pages, num_swa_pages=args.swa_pages,
        num_lookahead_tokens=k, max_reqs=2 * args.max_seqs)
    if cached:  # one handle per cache entry, one prefix-copy row per hit admitted
        cfg = dataclasses.replace(cfg, max_handles=args.handles,
                                  max_alloc_rows=2 * cfg.max_alloc_rows)
    alloc = ga.HybridAllocator(cfg, prefix_cache=cached)
    mgr = GraphallocKVCacheManager(alloc, enable_caching=cached)
    rng = np.random.default_rng(args.seed)
    system = list(range(1, args.system_prompt + 1))
    arrivals = deque(
        Request(("user", i % 3, f"r{i}"), 2 * i,
                system + [10_000 + 1000 * i + j for j in range(int(rng.integers(8, 60)))],
                int(rng.integers(4, 48)), seed=i) for i in range(args.requests))
    kv_full = torch.full(((cfg.num_full_pages + 1) * ps,), -1, dtype=torch.int64)
    kv_swa = torch.full(((cfg.num_swa_pages + 1) * ps,), -1, dtype=torch.int64)
    waiting, running, finished = deque(), [], []
    s = dict(iterations=0, steps=0, preempted=0, admission_stops=0, draft_tokens=0,
             rejected_tokens=0, peak_full_used=0, peak_swa_used=0, kv_reads_ok=True)

    def free(req):  # finished or preempted: its computed full blocks go into the cache
        mgr.free(req.request_id, req.token_ids(req.num_computed_tokens) if cached else None)

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
                free(victim)
                victim.num_computed_tokens = 0
                waiting.appendleft(victim)
                preempted = True
                s["preempted"] += 1
                if victim is req:
                    break
            if blocks is None:
                break
            scheduled.append((req, req.num_computed_tokens, n, decoding))
            left -= n
            i += 1
        while not preempted and waiting and left > 0 and len(running) < args.max_seqs:
            req = waiting[0]
            hit, n_hit = mgr.get_computed_blocks(req.request_id, req.token_ids(req.num_tokens))
            n = min(req.num_tokens - n_hit, left)
            if mgr.allocate_slots(req.request_id, n, num_lookahead_tokens=k,
                                  num_new_computed_tokens=n_hit,
                                  new_computed_blocks=hit) is None:
                s["admission_stops"] += 1
                break
            req.num_computed_tokens = n_hit
            running.append(waiting.popleft())
            scheduled.append((req, n_hit, n, False))
            left -= n
        if not scheduled and not mgr.pending_work:
            continue
        mgr.run_step()  # the iteration's ONE graphalloc step
        s["iterations"] += 1
        # ---- the forward: KV of the scheduled positions at the slots of the step ---------
        for req, start, n, _ in scheduled:
            full, swa = mgr.token_slots(req.request_id, start, n)
            tokens = torch.tensor([req.token_at(p) for p in range(start, start + n)])
            kv_full[full.long()] = tokens
            kv_swa[swa.long()] = tokens
        # ---- update_from_output(): computed tokens, speculative acceptance, frees ------
        for req, _, n, decoding in scheduled:
            req.num_computed_tokens += n
            if decoding and k:
                accepted = int(rng.integers(0, k + 1))
                req.num_computed_tokens -= k - accepted
                req.num_output_tokens += accepted + 1
                s["draft_tokens"] += k
                s["rejected_tokens"] += k - accepted
            elif req.num_computed_tokens >= req.num_tokens:
                req.num_output_tokens += 1
                if cached:  # the prompt is computed: cache it while its window is there
                    mgr.cache_blocks(req.request_id, req.token_ids(req.num_prompt_tokens))
        for req in running:  # what attention reads: every computed position, SWA window
            c = req.num_computed_tokens
            full, _ = mgr.token_slots(req.request_id, 0, c)
            want = torch.tensor(req.token_ids(c))
            f = alloc.frontier(mgr.row_of(req.request_id))
            s["kv_reads_ok"] &= bool(torch.equal(kv_full[full.long()], want)) and bool(
                torch.equal(kv_swa[alloc.full_to_swa[full[f:]].long()], want[f:]))
        s["peak_full_used"] = max(s["peak_full_used"], cfg.num_full_pages - alloc.n_free("full"))
        s["peak_swa_used"] = max(s["peak_swa_used"], cfg.num_swa_pages - alloc.n_free("swa"))
        for req in [r for r in running if r.finished()]:
            free(req)
            running.remove(req)
            finished.append(req)
        s["steps"] += alloc.steps_run - before
    mgr.run_step()  # the last iteration's frees
    s["audit_findings"] = len(alloc.audit())
    cache = alloc.prefix_cache
    s["cache_entries_at_end"] = len(cache) if cache is not None else 0
    if cache is not None:
        s.update(cache_tombstoned_pages=cache.tombstoned_pages,
                 cache_dropped_pages=cache.dropped_pages)
        cache.drop_all()
    alloc.check_integrity()
    seconds = time.perf_counter() - t0
    stats = mgr.prefix_cache_stats()
    s.update(finished=len(finished), pages_total=cfg.num_full_pages + cfg.num_swa_pages,
             pages_free_at_end=alloc.n_free("full") + alloc.n_free("swa"),
             cache_steps=mgr.cache_steps, cache_hit_rate=stats["hit_rate"],
             cache_hit_tokens=stats["hits"], cache_query_tokens=stats["queries"],
             host_ms_per_iteration=1e3 * seconds / max(s["iterations"], 1))
    if not args.quiet:
        print(f"vLLM facade: {s['finished']} requests in {s['iterations']} schedule() calls, "
              f"{s['steps']} graphalloc steps (one each, cache inserts included, + "
              f"{s['cache_steps']} where every cache handle was held and the LRU entry was "
              f"dropped first); {s['preempted']} preemptions, {s['admission_stops']} "
              "admission stops (allocate_slots -> None)")
        print(f"  prefix cache: {s['cache_hit_tokens']} of {s['cache_query_tokens']} looked-up "
              f"tokens hit (hit rate {s['cache_hit_rate']:.0%}); {s['cache_entries_at_end']} "
              "entries at the end")
        print(f"  lookahead {k}: {s['draft_tokens']} draft slots, {s['rejected_tokens']} "
              "rejected and reused by later tokens")
        print(f"  peak pages in use FULL {s['peak_full_used']} / {cfg.num_full_pages}, SWA "
              f"{s['peak_swa_used']} / {cfg.num_swa_pages}")
        print(f"  every request read its own KV: {s['kv_reads_ok']}; audit findings: "
              f"{s['audit_findings']}; every page free once the cache is dropped: "
              f"{s['pages_free_at_end'] == s['pages_total']}; {s['host_ms_per_iteration']:.2f} "
              f"ms host time per iteration on {cfg.device} ({cfg.backend})")
    return s


if __name__ == "__main__":
    main()
