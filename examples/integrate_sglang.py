"""SGLang's scheduler loop through graphalloc.integrations.sglang, on the CPU.

A toy of SGLang's non-overlap event loop with its radix cache (no model: the "forward"
writes each position's token id into a fake KV store and samples a made-up token):
requests sharing a system prompt arrive over time; each iteration forms a prefill batch
(chunked to a token budget; a new request's cached prefix looked up with
``match_prefix``; admitted while ``available_size() + evictable_size()`` covers it) or
else a decode batch (retracting the newest request while ``check_decode_mem`` fails),
calls ``prepare_for_extend`` / ``prepare_for_decode``, then, as ``process_batch_result``
does, caches a chunked request's prefix (``cache_unfinished_req``) and releases finished
requests in a free group (``release_kv_cache``: ``cache_finished_req``, the request's
whole pages stay in the cache). Every iteration with a batch is ONE graphalloc step (the
previous iteration's releases, this one's window evictions, its admits -- cache hits
admitted on their shared pages, the cache inserts of the requests that finished -- and
its allocation). The summary prints the cache hit rate and checks that every request read back its
own tokens, that the audit is clean and that every page comes back once the cache is
dropped.

    python examples/integrate_sglang.py                 # default workload, a few seconds
    python examples/integrate_sglang.py --requests 64 --interval 32 --page-size 16
    python examples/integrate_sglang.py --no-cache      # SGLang's ChunkCache behaviour
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
    """The fields of SGLang's ``Req`` the seam reads (``req_pool_idx``, ``finished()``,
    ``origin_input_ids``, ``output_ids``, ``last_node``)."""

    rid: int
    arrival: int
    origin_input_ids: list
    max_new_tokens: int
    req_pool_idx: int | None = None
    output_ids: list = dataclasses.field(default_factory=list)
    last_node: object = None
    kv_len: int = 0

    @property
    def fill_ids(self) -> list:
        return self.origin_input_ids + self.output_ids

    def sample(self) -> None:
        self.output_ids.append(50_000 + (self.rid * 7919 + len(self.fill_ids) * 104_729) % 40_000)

    def finished(self) -> bool:
        return len(self.output_ids) >= self.max_new_tokens


@dataclasses.dataclass
class Batch:
    """The host fields of SGLang's ``ScheduleBatch`` the seam reads."""

    reqs: list
    prefix_lens: list | None = None
    extend_lens: list | None = None
    seq_lens_cpu: list | None = None


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("--max-running", type=int, default=8)
    p.add_argument("--chunk", type=int, default=64, help="chunked-prefill token budget")
    p.add_argument("--system-prompt", type=int, default=96,
                   help="tokens of the system prompt every request starts with")
    p.add_argument("--page-size", type=int, default=4)
    p.add_argument("--window", type=int, default=33, help="the model's sliding window")
    p.add_argument("--interval", type=int, default=8, help="SWA eviction interval (tokens)")
    p.add_argument("--full-pages", type=int, default=300)
    p.add_argument("--swa-pages", type=int, default=160)
    p.add_argument("--handles", type=int, default=16, help="prefix-cache entries at most")
    p.add_argument("--no-cache", action="store_true", help="no radix cache (ChunkCache)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse(argv)
    ps, cached = args.page_size, not args.no_cache
    cfg = ga.AllocatorConfig.for_engine(
        max_running_requests=args.max_running, chunked_prefill_size=args.chunk,
        max_context_len=256, page_size=ps, model_window=args.window,
        num_full_pages=args.full_pages, num_swa_pages=args.swa_pages,
        max_reqs=2 * args.max_running)  # running + one iteration's releases
    if cached:  # one handle per cache entry, one prefix-copy row per hit admitted
        cfg = dataclasses.replace(cfg, max_handles=args.handles,
                                  max_alloc_rows=2 * cfg.max_alloc_rows)
    alloc = ga.HybridAllocator(cfg, prefix_cache=cached)
    seam = SGLangAllocator(alloc, swa_eviction_interval=args.interval)
    rng = np.random.default_rng(args.seed)
    system = list(range(1, args.system_prompt + 1))
    arrivals = deque(
        Req(i, 2 * i, system + [10_000 + 1000 * i + j for j in range(int(rng.integers(4, 60)))],
            int(rng.integers(4, 48))) for i in range(args.requests))
    kv_full = torch.full(((cfg.num_full_pages + 1) * ps,), -1, dtype=torch.int64)
    kv_swa = torch.full(((cfg.num_swa_pages + 1) * ps,), -1, dtype=torch.int64)
    waiting, running, chunked, finished = deque(), [], None, []
    s = dict(iterations=0, iterations_with_batch=0, steps=0, extend_batches=0,
             decode_batches=0, refused=0, retracted=0, evicted_pages=0, peak_swa_used=0,
             peak_full_used=0, idle_flush_steps=0, prompt_tokens=0, cached_tokens=0,
             kv_reads_ok=True)
    t0 = time.perf_counter()
    it = 0
    while arrivals or waiting or running or chunked is not None:
        while arrivals and arrivals[0].arrival <= it:
            waiting.append(arrivals.popleft())
        it += 1
        s["iterations"] += 1
        before = alloc.steps_run
        batch = out = None
        picks, lens, prefix, budget, need = [], [], [], args.chunk, len(running) * ps
        for req in ([chunked] if chunked is not None else []) + list(waiting):
            if budget <= 0 or len(running) + len(picks) >= args.max_running:
                break
            p = req.kv_len if req is chunked else (seam.match_prefix(req) if cached else 0)
            n = min(len(req.fill_ids) - p, budget)
            need += n + ps
            if seam.available_size() + seam.evictable_size() < need:  # PrefillAdder
                break
            picks.append(req)
            lens.append(n)
            prefix.append(p)
            budget -= n
        if picks:
            batch = Batch(picks, prefix, lens)
            out = seam.prepare_for_extend(batch)
            if out is None:
                s["refused"] += 1
            else:
                s["extend_batches"] += 1
                for r, p in zip(picks, prefix, strict=True):
                    if r is not chunked:
                        waiting.remove(r)
                        r.kv_len = p
                        s["prompt_tokens"] += len(r.fill_ids)
                        s["cached_tokens"] += p
        if out is None and running:
            while running and seam.available_size() + seam.evictable_size() < len(running) * ps:
                victim = running.pop()  # retract_decode
                seam.release_kv_cache(victim, is_insert=False)
                victim.kv_len, victim.output_ids = 0, []
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
        # the "forward": the KV of the new positions, at the slots the step returned
        ext = batch.extend_lens or [1] * len(batch.reqs)
        tokens = [t for r, n in zip(batch.reqs, ext, strict=True)
                  for t in r.fill_ids[r.kv_len:r.kv_len + n]]
        kv_full[out.out_cache_loc.long()] = torch.tensor(tokens)
        kv_swa[out.swa_out_cache_loc.long()] = torch.tensor(tokens)
        if batch.extend_lens is not None:
            chunked = None
            for r, n in zip(batch.reqs, ext, strict=True):
                r.kv_len += n
                if r.kv_len == len(r.fill_ids):
                    r.sample()
                    running.append(r)
                else:
                    chunked = r
                    if cached:
                        seam.cache_unfinished_req(r)  # the chunk's prefix, as SGLang does
        else:
            for r in batch.reqs:
                r.kv_len += 1
                r.sample()
        for r in running:  # what attention would read: every position, the window in SWA
            slots = alloc.req_to_token[r.req_pool_idx, :r.kv_len].long()
            want = torch.tensor(r.fill_ids[:r.kv_len])
            f = alloc.frontier(r.req_pool_idx)
            s["kv_reads_ok"] &= bool(torch.equal(kv_full[slots], want)) and bool(
                torch.equal(kv_swa[alloc.full_to_swa[slots[f:]].long()], want[f:]))
        s["peak_full_used"] = max(s["peak_full_used"], cfg.num_full_pages - alloc.n_free("full"))
        s["peak_swa_used"] = max(s["peak_swa_used"], cfg.num_swa_pages - alloc.n_free("swa"))
        finished += [r for r in running if r.finished()]
        seam.release_finished(running)  # free_group_begin / release_kv_cache / end
        running = [r for r in running if not r.finished()]
        s["steps"] += alloc.steps_run - before
    s["idle_flush_steps"] += seam.flush()
    s["audit_findings"] = len(alloc.audit())
    cache = alloc.prefix_cache
    s["cache_entries_at_end"] = len(cache) if cache is not None else 0
    if cache is not None:
        s.update(cache_tombstoned_pages=cache.tombstoned_pages,
                 cache_dropped_pages=cache.dropped_pages)
        cache.drop_all()
    alloc.check_integrity()
    seconds = time.perf_counter() - t0
    s.update(finished=len(finished), pages_total=cfg.num_full_pages + cfg.num_swa_pages,
             pages_free_at_end=alloc.n_free("full") + alloc.n_free("swa"),
             cache_steps=seam.cache_steps,
             cache_hit_rate=s["cached_tokens"] / max(s["prompt_tokens"], 1),
             host_ms_per_iteration=1e3 * seconds / max(s["iterations"], 1))
    if not args.quiet:
        print(f"SGLang seam: {s['finished']} requests in {s['iterations']} iterations "
              f"({s['extend_batches']} extend, {s['decode_batches']} decode batches, "
              f"{s['refused']} refused, {s['retracted']} retracted)")
        print(f"  graphalloc steps: {s['steps']} for {s['iterations_with_batch']} iterations "
              f"with a batch (one each, cache inserts included) + {s['cache_steps']} where "
              f"every cache handle was held and the LRU entry was dropped first, "
              f"{s['idle_flush_steps']} idle flushes")
        print(f"  prefix cache: {s['cached_tokens']} of {s['prompt_tokens']} prompt tokens "
              f"served from it (hit rate {s['cache_hit_rate']:.0%}); "
              f"{s['cache_entries_at_end']} entries at the end")
        print(f"  SWA pages evicted by the window rule (interval {args.interval}): "
              f"{s['evicted_pages']}; peak pages in use FULL {s['peak_full_used']} / "
              f"{cfg.num_full_pages}, SWA {s['peak_swa_used']} / {cfg.num_swa_pages}")
        print(f"  every request read its own KV: {s['kv_reads_ok']}; audit findings: "
              f"{s['audit_findings']}; every page free once the cache is dropped: "
              f"{s['pages_free_at_end'] == s['pages_total']}; "
              f"{s['host_ms_per_iteration']:.2f} ms host time per iteration on "
              f"{cfg.device} ({cfg.backend})")
    return s


if __name__ == "__main__":
    main()
