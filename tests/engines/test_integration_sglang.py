"""Scenario tests of graphalloc.integrations.sglang, from SGLang's documented scheduler.

The loop below follows SGLang's non-overlap event loop: form a batch (prefill first,
chunked to a token budget, admitted only while ``available_size()`` -- plus
``evictable_size()`` with a radix cache -- covers it; a new request's prefix is looked up
with ``match_prefix`` there; else a decode batch, retracting the newest request while the
decode does not fit), run ``prepare_for_extend`` / ``prepare_for_decode``, "run the
model", then ``process_batch_result``: a chunked request's prefix cached with
``cache_unfinished_req``, finished requests released with ``release_kv_cache``
(``cache_finished_req`` with a radix cache) between ``free_group_begin`` /
``free_group_end``.

The "model" writes each position's token id into a fake KV store at the slots the seam
returned (FULL and SWA), so after every iteration each running request must read back
its own tokens through ``req_to_token`` (every position) and ``full_to_swa`` (every
position from its frontier): a cache hit that shared the wrong pages, or a page freed
while still shared, fails it. Also after every iteration: the allocator's audit, the
cache's own check, and exactly ONE graphalloc step per iteration (plus one per new cache
entry, which the seam counts).
"""

from __future__ import annotations

import dataclasses
import sys
import types
from collections import deque
from pathlib import Path

import numpy as np
import pytest
import torch

import graphalloc as ga
from graphalloc.integrations.sglang import SGLangAllocator

ROOT = Path(__file__).resolve().parents[2]


def output_token(rid: int, pos: int) -> int:
    return 50_000 + (rid * 7919 + pos * 104_729) % 40_000


@dataclasses.dataclass(eq=False)
class Req:
    """The attributes of SGLang's ``Req`` the seam reads, plus the test's bookkeeping."""

    rid: int
    prompt_len: int
    max_new_tokens: int
    req_pool_idx: int | None = None
    kv_len: int = 0  # tokens with KV: len(prefix_indices) in SGLang
    n_out: int = 0
    origin_input_ids: list = dataclasses.field(default_factory=list)
    output_ids: list = dataclasses.field(default_factory=list)
    last_node: object = None

    def __post_init__(self):
        if not self.origin_input_ids:  # a prompt of its own
            self.origin_input_ids = [10_000 + 100 * self.rid + i for i in range(self.prompt_len)]
        self.prompt_len = len(self.origin_input_ids)

    @property
    def fill_ids(self) -> list:
        return self.origin_input_ids + self.output_ids

    def sample(self) -> None:
        self.output_ids.append(output_token(self.rid, len(self.fill_ids)))
        self.n_out += 1

    def finished(self) -> bool:
        return self.n_out >= self.max_new_tokens


@dataclasses.dataclass
class Batch:
    """The host fields of SGLang's ``ScheduleBatch`` the seam reads."""

    reqs: list
    prefix_lens: list | None = None
    extend_lens: list | None = None
    seq_lens_cpu: list | None = None


def make(ps=4, window=17, n_run=6, chunk=24, ctx=128, full=160, swa=70, rows=None,
         cache=False, handles=16, **kw):
    cfg = ga.AllocatorConfig.for_engine(
        max_running_requests=n_run, chunked_prefill_size=chunk, max_context_len=ctx,
        page_size=ps, model_sliding_window=window, num_full_pages=full, num_swa_pages=swa,
        max_reqs=rows or 2 * n_run)
    if cache:  # handles, and a prefix copy row per admitted hit
        cfg = dataclasses.replace(cfg, max_handles=handles,
                                  max_alloc_rows=2 * cfg.max_alloc_rows)
    alloc = ga.HybridAllocator(cfg, prefix_cache=cache)
    return alloc, SGLangAllocator(alloc, **kw)


class KVStore:
    """A fake KV cache: the token id each slot holds (FULL and SWA pools)."""

    def __init__(self, alloc):
        n = (alloc.config.num_full_pages + 1) * alloc.config.page_size
        m = (alloc.config.num_swa_pages + 1) * alloc.config.page_size
        self.alloc = alloc
        self.full = torch.full((n,), -1, dtype=torch.int64)
        self.swa = torch.full((m,), -1, dtype=torch.int64)

    def write(self, loc, swa_loc, tokens) -> None:
        t = torch.tensor(tokens, dtype=torch.int64)
        self.full[loc.long()] = t
        self.swa[swa_loc.long()] = t

    def check(self, req) -> None:
        """``req`` reads its own tokens: every position, and from its frontier in SWA."""
        a, row, n = self.alloc, req.req_pool_idx, req.kv_len
        slots = a.req_to_token[row, :n].long()
        want = torch.tensor(req.fill_ids[:n], dtype=torch.int64)
        assert torch.equal(self.full[slots], want), f"request {req.rid}: FULL KV differs"
        f = a.frontier(row)
        assert f <= max(0, n - a.config.sliding_window) or f == 0, "window not held"
        swa = a.full_to_swa[slots[f:]].long()
        assert bool((swa > 0).all()), f"request {req.rid}: a window position has no SWA page"
        assert torch.equal(self.swa[swa], want[f:]), f"request {req.rid}: SWA KV differs"


def held(alloc, row):
    ps = alloc.config.page_size
    end = -(-alloc.seq_len(row) // ps)
    return end, end - alloc.frontier(row) // ps


def check_conserved(alloc):
    """Audit (references rebuilt from the device); without sharing also per pool:
    free + held by live requests == pages (page 0 is the sink)."""
    alloc.check_integrity()
    assert alloc.audit() == []
    if alloc.prefix_cache is not None:
        alloc.prefix_cache.check()
        return
    full = swa = 0
    for row in alloc.live_rows():
        f, s = held(alloc, row)
        full, swa = full + f, swa + s
    assert alloc.n_free("full") + full == alloc.config.num_full_pages
    assert alloc.n_free("swa") + swa == alloc.config.num_swa_pages


def run_loop(seam, reqs, *, chunk, max_running, check_slots=True, max_iters=400,
             adder_checks=True):
    """SGLang's event loop over ``reqs``; returns per-iteration records."""
    alloc = seam.alloc
    ps, cache = alloc.config.page_size, seam.tree_cache is not None
    kv = KVStore(alloc)
    waiting, running, chunked = deque(reqs), [], None
    log = {"extend": 0, "decode": 0, "refused": 0, "retracted": 0, "evicted_pages": 0,
           "released": 0, "iters": 0, "hit_tokens": 0, "prefill_tokens": 0}
    for _ in range(max_iters):
        if not waiting and not running and chunked is None:
            break
        log["iters"] += 1
        before, cache_before = alloc.steps_run, seam.cache_steps
        # get_new_batch_prefill: the chunked request first, then waiting ones (PrefillAdder)
        batch_reqs, ext, prefix, budget, need = [], [], [], chunk, len(running) * ps
        cands = ([chunked] if chunked is not None else []) + list(waiting)
        for req in cands:
            if budget <= 0 or len(running) + len(batch_reqs) >= max_running:
                break
            p = req.kv_len if req is chunked else (seam.match_prefix(req) if cache else 0)
            n = min(len(req.fill_ids) - p, budget)
            need += n + ps
            room = seam.available_size() + (seam.evictable_size() if cache else 0)
            if adder_checks and room < need:
                break
            batch_reqs.append(req)
            ext.append(n)
            prefix.append(p)
            budget -= n
        out = None
        if batch_reqs:
            batch = Batch(batch_reqs, prefix, ext)
            out = seam.prepare_for_extend(batch)
            if out is None:
                log["refused"] += 1
            else:
                log["extend"] += 1
                for r, p in zip(batch_reqs, prefix, strict=True):
                    if r is not chunked:
                        waiting.remove(r)
                        r.kv_len = p
                        log["hit_tokens"] += p
        if out is None and running:
            while running and seam.available_size() < len(running) * ps:  # check_decode_mem
                victim = running.pop()  # retract_decode: newest first
                seam.release_kv_cache(victim, is_insert=False)
                victim.kv_len = victim.n_out = 0
                victim.output_ids = []
                waiting.appendleft(victim)
                log["retracted"] += 1
            if running:
                batch = Batch(list(running), seq_lens_cpu=[r.kv_len for r in running])
                out = seam.prepare_for_decode(batch)
                assert out is not None  # check_decode_mem said it fits
                log["decode"] += 1
        if out is None:  # idle: run the recorded frees
            seam.flush()
            check_conserved(alloc)
            continue
        # ONE step per iteration (plus one per new cache entry)
        assert alloc.steps_run - before == 1 == out.n_steps
        log["evicted_pages"] += out.n_evicted_pages
        reqs_b = batch.reqs
        lens = ext if batch.extend_lens is not None else [1] * len(reqs_b)
        loc, swa_loc = out.out_cache_loc, out.swa_out_cache_loc
        starts = np.cumsum([0, *lens])
        if check_slots:
            assert torch.equal(seam.translate_loc_from_full_to_swa(loc), swa_loc)
            assert bool((swa_loc > 0).all()) and len(torch.unique(loc)) == len(loc)
            for i, r in enumerate(reqs_b):
                got = alloc.req_to_token[r.req_pool_idx, r.kv_len:r.kv_len + lens[i]]
                assert torch.equal(got, loc[starts[i]:starts[i + 1]])
        # "forward": the KV of the new positions; process_batch_result
        kv.write(loc, swa_loc, [t for i, r in enumerate(reqs_b)
                                for t in r.fill_ids[r.kv_len:r.kv_len + lens[i]]])
        if batch.extend_lens is not None:
            chunked = None
            for r, n in zip(reqs_b, ext, strict=True):
                r.kv_len += n
                log["prefill_tokens"] += n
                if r.kv_len == len(r.fill_ids):
                    r.sample()  # prefill samples the first token
                    running.append(r)
                else:
                    chunked = r
                    if cache:
                        seam.cache_unfinished_req(r)
        else:
            for r in reqs_b:
                r.kv_len += 1
                r.sample()
        for r in running + ([chunked] if chunked is not None else []):
            kv.check(r)
        done = [r for r in running if r.finished()]
        log["released"] += seam.release_finished(running)
        running = [r for r in running if not r.finished()]
        assert all(r.req_pool_idx is None for r in done)
        # the frees are recorded, not run; a new cache entry is a step of its own
        assert alloc.steps_run - before == 1 + seam.cache_steps - cache_before
        check_conserved(alloc)
    return log


@pytest.mark.parametrize("ps,interval", [(1, 1), (4, 1), (4, 9), (16, 20)])
def test_continuous_batching_one_step_per_iteration(ps, interval):
    rng = np.random.default_rng(ps + interval)
    alloc, seam = make(ps=ps, swa_eviction_interval=interval, full=640 // ps,
                       swa=(320 if ps == 1 else 400) // ps)
    reqs = [Req(i, int(rng.integers(3, 60)), int(rng.integers(1, 40))) for i in range(14)]
    log = run_loop(seam, reqs, chunk=24, max_running=6)
    assert log["released"] >= len(reqs) and all(r.finished() for r in reqs)
    assert log["extend"] > len(reqs) // 2 and log["decode"] > 20
    assert log["evicted_pages"] > 0
    seam.flush()
    check_conserved(alloc)
    assert alloc.n_live == 0
    assert alloc.n_free("full") == alloc.config.num_full_pages
    assert alloc.n_free("swa") == alloc.config.num_swa_pages


def test_pressure_refuses_and_retracts_with_nothing_lost():
    """A pool too small for the load: the loop sees refusals and retractions, and every
    request still finishes with every page back."""
    rng = np.random.default_rng(3)
    alloc, seam = make(ps=4, full=48, swa=40)
    reqs = [Req(i, int(rng.integers(10, 40)), int(rng.integers(20, 60))) for i in range(10)]
    log = run_loop(seam, reqs, chunk=24, max_running=6, max_iters=2000, adder_checks=False)
    assert log["retracted"] > 0 and log["refused"] > 0
    assert all(r.finished() for r in reqs)
    seam.flush()
    assert alloc.n_free("full") == alloc.config.num_full_pages


def snapshot(alloc, seam, reqs):
    return (alloc.n_free("full"), alloc.n_free("swa"), alloc.n_live, alloc.steps_run,
            seam.available_size(), seam.n_recorded_releases,
            [(r.req_pool_idx, None if r.req_pool_idx is None else alloc.seq_len(r.req_pool_idx),
              None if r.req_pool_idx is None else alloc.frontier(r.req_pool_idx))
             for r in reqs])


def test_refusal_changes_nothing():
    alloc, seam = make(ps=4, n_run=3, chunk=32, full=12, swa=20, rows=3)
    a, b = Req(0, 40, 4), Req(1, 8, 4)
    assert seam.prepare_for_extend(Batch([a, b], [0, 0], [24, 8])) is not None
    a.kv_len, b.kv_len = 24, 8
    seam.release_kv_cache(b)  # a recorded release rides along
    huge = Req(2, 60, 1)
    state = snapshot(alloc, seam, [a, b, huge])
    # FULL pages short: the new request and a's next chunk are refused together
    assert seam.prepare_for_extend(Batch([a, huge], [24, 0], [16, 16])) is None
    assert snapshot(alloc, seam, [a, b, huge]) == state
    # rows short: 3 rows, a live, b's row pending release, one free: two new requests
    c, d = Req(3, 4, 1), Req(4, 4, 1)
    assert seam.prepare_for_extend(Batch([c, d], [0, 0], [4, 4])) is None
    assert snapshot(alloc, seam, [a, b, huge]) == state
    assert c.req_pool_idx is None and d.req_pool_idx is None
    # what fits runs, with the recorded release first
    out = seam.prepare_for_extend(Batch([c], [0], [4]))
    assert out is not None and out.n_steps == 1 and seam.n_recorded_releases == 0
    assert alloc.steps_run == state[3] + 1
    check_conserved(alloc)


def test_decode_eviction_follows_the_interval_rule():
    ps, interval = 4, 10
    alloc, seam = make(ps=ps, window=9, swa_eviction_interval=interval)  # W = 8
    w = alloc.config.sliding_window
    r = Req(0, 5, 100)
    seam.prepare_for_extend(Batch([r], [0], [5]))
    length, moves = 5, 0
    for _ in range(80):
        old = alloc.frontier(r.req_pool_idx)
        out = seam.prepare_for_decode(Batch([r], seq_lens_cpu=[length]))
        new = alloc.frontier(r.req_pool_idx)
        due = length - w >= old + interval
        assert new == (max(length - w, 0) // ps * ps if due else old), (length, old, new)
        assert out.n_evicted_pages == (new - old) // ps
        moves += new != old
        length += 1
        # held SWA positions never exceed window + interval + one page
        assert length - alloc.frontier(r.req_pool_idx) <= w + interval + ps
    assert moves >= 80 // (interval + ps)
    check_conserved(alloc)


def test_extend_chunks_evict_below_the_window_of_the_prefix():
    ps = 4
    alloc, seam = make(ps=ps, window=9)
    r = Req(0, 70, 1)
    for p in (0, 24, 48):
        out = seam.prepare_for_extend(Batch([r], [p], [min(24, 70 - p)]))
        assert alloc.frontier(r.req_pool_idx) == max(p - 8, 0) // ps * ps
        assert out.n_evicted_pages == (max(p - 8, 0) // ps * ps - max(p - 32, 0) // ps * ps) // ps
    check_conserved(alloc)


def test_release_is_recorded_and_runs_with_the_next_step():
    alloc, seam = make(ps=4, chunk=32)
    a, b = Req(0, 20, 1), Req(1, 12, 1)
    seam.prepare_for_extend(Batch([a, b], [0, 0], [20, 12]))
    free_full, avail = alloc.n_free("full"), seam.available_size()
    row_b = b.req_pool_idx
    steps = alloc.steps_run
    seam.free_group_begin()
    seam.release_kv_cache(b)
    with pytest.raises(ga.NestedGroupError):
        seam.free_group_begin()
    with pytest.raises(ga.NestedGroupError):
        seam.prepare_for_decode(Batch([a], seq_lens_cpu=[20]))
    seam.free_group_end()
    assert alloc.steps_run == steps and alloc.n_free("full") == free_full  # nothing ran
    assert seam.available_size() == avail + 3 * 4 and b.req_pool_idx is None
    assert alloc.is_live(row_b)  # until the step
    with pytest.raises(ga.UnknownRequestError):
        seam.release_kv_cache(Req(9, 1, 1, req_pool_idx=row_b))  # released twice
    out = seam.prepare_for_decode(Batch([a], seq_lens_cpu=[20]))
    assert alloc.steps_run == steps + 1 and out.n_steps == 1 and not alloc.is_live(row_b)
    assert alloc.n_free("full") == free_full + 3 - 1  # b's 3 pages back, a's 21st token: 1
    check_conserved(alloc)


def test_defer_frees_false_runs_the_group_at_its_end():
    alloc, seam = make(ps=4, defer_frees=False)
    reqs = [Req(i, 8, 1) for i in range(3)]
    seam.prepare_for_extend(Batch(reqs, [0] * 3, [8] * 3))
    for r in reqs:
        r.n_out = 1
    steps = alloc.steps_run
    assert seam.release_finished(reqs) == 3
    assert alloc.steps_run == steps + 1 and alloc.n_live == 0  # one step: the group
    check_conserved(alloc)


def test_contracts_raise_with_nothing_changed():
    alloc, seam = make(ps=4)
    r = Req(0, 8, 1)
    with pytest.raises(ga.ContractError, match="match_prefix"):
        seam.prepare_for_extend(Batch([r], [4], [4]))  # a prefix without a cache hit
    for call in (seam.match_prefix, seam.insert_into_prefix_cache, seam.cache_unfinished_req):
        with pytest.raises(ga.ConfigError, match="no prefix cache"):
            call(r)  # ChunkCache: no radix-cache calls
    seam.prepare_for_extend(Batch([r], [0], [8]))
    state = snapshot(alloc, seam, [r])
    with pytest.raises(ga.ContractError, match="allocated"):
        seam.prepare_for_decode(Batch([r], seq_lens_cpu=[7]))
    with pytest.raises(ga.OverlapError):
        seam.prepare_for_decode(Batch([r, r], seq_lens_cpu=[8, 8]))
    with pytest.raises(ga.PositionError):
        seam.prepare_for_extend(Batch([r], [8], [0]))
    with pytest.raises(ga.ContractError, match="flush"):
        seam.prepare_for_decode(Batch([], seq_lens_cpu=[]))
    with pytest.raises(ga.BatchTooLargeError):
        seam.prepare_for_extend(Batch([r], [8], [alloc.config.max_tokens_per_alloc_row + 1]))
    with pytest.raises(ga.TensorSpecError):  # a device tensor of lengths would sync
        seam.prepare_for_decode(Batch([r], seq_lens_cpu=torch.zeros(1, device="meta")))
    with pytest.raises(ga.ConfigError):
        SGLangAllocator(alloc, swa_eviction_interval=0)
    assert snapshot(alloc, seam, [r]) == state


def test_frees_over_the_frozen_release_shape_split_into_more_steps():
    """Recorded releases that exceed max_release_rows run through alloc.free_group()
    (split into steps the shape allows), then the allocation: reported in n_steps."""
    cfg = ga.AllocatorConfig(page_size=4, num_full_pages=64, num_swa_pages=64, max_reqs=8,
                             max_context_len=32, sliding_window=8, max_release_rows=2)
    alloc = ga.HybridAllocator(cfg)
    seam = SGLangAllocator(alloc)
    reqs = [Req(i, 8, 1) for i in range(4)]
    assert seam.prepare_for_extend(Batch(reqs, [0] * 4, [8] * 4)).n_steps == 1
    for r in reqs[:3]:
        r.n_out = 1
    assert seam.release_finished(reqs) == 3  # 3 release rows: one step holds 2
    steps = alloc.steps_run
    out = seam.prepare_for_decode(Batch([reqs[3]], seq_lens_cpu=[8]))
    assert out.n_steps == 3 == alloc.steps_run - steps and alloc.n_live == 1
    check_conserved(alloc)


def test_ring_mode_is_refused():
    cfg = ga.AllocatorConfig(page_size=4, num_full_pages=64, num_swa_pages=64, max_reqs=4,
                             max_context_len=64, sliding_window=8, swa_ring_pages=8)
    with pytest.raises(ga.ConfigError, match="pool-mode"):
        SGLangAllocator(ga.HybridAllocator(cfg))


def test_example_help(capsys):
    sys.path.insert(0, str(ROOT / "examples"))
    import integrate_sglang

    with pytest.raises(SystemExit) as exc:
        integrate_sglang.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "usage" in out and "--max-running" in out and "ONE graphalloc step" in out


def test_example_runs():
    sys.path.insert(0, str(ROOT / "examples"))
    import integrate_sglang

    summary = integrate_sglang.main(["--requests", "8", "--max-running", "4", "--quiet",
                                     "--no-cache"])
    assert summary["finished"] == 8 and summary["steps"] == summary["iterations_with_batch"]
    assert summary["pages_free_at_end"] == summary["pages_total"]


# ---- the radix cache (SGLang's tree_cache calls on graphalloc's prefix cache) ------------
def shared_prompt_reqs(rng, n, system_len, *, suffix=(4, 30), out=(1, 30), start=0):
    """Requests whose prompts share a system prompt of ``system_len`` tokens."""
    system = [1 + i for i in range(system_len)]
    return [Req(start + i, 0, int(rng.integers(*out)),
                origin_input_ids=system + [20_000 + 1000 * (start + i) + j
                                           for j in range(int(rng.integers(*suffix)))])
            for i in range(n)]


@pytest.mark.parametrize("ps,interval", [(1, 1), (4, 3), (16, 8)])
def test_shared_system_prompt_is_served_from_the_cache(ps, interval):
    """A shared system prompt longer than the chunk budget: the first request's chunk
    boundary is cached (cache_unfinished_req), later requests match it and are admitted on
    it in the iteration's one step, prefilling only the rest; every request reads back its
    own tokens (FULL and SWA) through the shared pages; at the end the cache holds entries,
    the audit is clean, and dropping the cache returns every page."""
    rng = np.random.default_rng(ps * 10 + interval)
    alloc, seam = make(ps=ps, window=17, chunk=32, ctx=160, full=1280 // ps, swa=640 // ps,
                       cache=True, swa_eviction_interval=interval)
    reqs = shared_prompt_reqs(rng, 14, system_len=48)
    log = run_loop(seam, reqs, chunk=32, max_running=6)
    assert all(r.finished() for r in reqs) and log["released"] == len(reqs)
    assert log["hit_tokens"] >= 10 * 32  # most requests reuse at least the first chunk
    cache = alloc.prefix_cache
    assert cache.hits >= 10  # the inserts rode in the iterations' steps (run_loop: one each)
    seam.flush()
    assert alloc.n_live == 0 and len(cache) > 0
    check_conserved(alloc)
    cache.drop_all()
    assert alloc.n_free("full") == alloc.config.num_full_pages
    assert alloc.n_free("swa") == alloc.config.num_swa_pages
    assert alloc.audit() == []


def test_cache_pressure_evicts_inside_the_step_with_nothing_lost():
    """Pools too small to keep every cached prefix: admission counts evictable_size(), the
    steps evict (tombstone SWA, then whole entries) by themselves, and every request still
    reads its own KV."""
    rng = np.random.default_rng(7)
    alloc, seam = make(ps=4, window=9, chunk=24, ctx=128, full=64, swa=44, cache=True,
                       handles=12)
    reqs = (shared_prompt_reqs(rng, 8, system_len=28, out=(10, 40))
            + shared_prompt_reqs(rng, 8, system_len=0, suffix=(20, 50), start=8))
    rng.shuffle(reqs)
    log = run_loop(seam, reqs, chunk=24, max_running=5, max_iters=3000)
    assert all(r.finished() for r in reqs)
    cache = alloc.prefix_cache
    assert cache.tombstoned_pages > 0 and cache.evicted_pages > 0
    assert log["hit_tokens"] > 0
    seam.flush()
    cache.drop_all()
    assert alloc.n_free("full") == alloc.config.num_full_pages
    check_conserved(alloc)


def prefill_and_decode(seam, req, n_decode):
    """Prefill ``req`` (one chunk) and decode ``n_decode`` tokens, as the loop does."""
    alloc = seam.alloc
    p = seam.match_prefix(req) if alloc.prefix_cache is not None else 0
    out = seam.prepare_for_extend(Batch([req], [p], [len(req.fill_ids) - p]))
    req.kv_len = len(req.fill_ids)
    req.sample()
    for _ in range(n_decode):
        out = seam.prepare_for_decode(Batch([req], seq_lens_cpu=[req.kv_len]))
        req.kv_len += 1
        req.sample()
    return out


def test_cache_finished_req_keeps_whole_pages_and_frees_the_tail():
    """SGLang's cache_finished_req: the radix tree keeps the request's whole pages, the
    partial last page is freed; a follow-up turn (prompt = the conversation so far) is
    admitted on those pages: its req_to_token prefix is the first request's slots."""
    ps = 4
    alloc, seam = make(ps=ps, window=65, cache=True)  # the window covers everything
    a = Req(0, 10, 4)
    prefill_and_decode(seam, a, 3)
    row, length = a.req_pool_idx, a.kv_len  # 13 positions with KV
    slots = alloc.req_to_token[row, :length].clone()
    free0, steps = alloc.n_free("full"), alloc.steps_run
    seam.release_kv_cache(a)  # insert (a take) and release, both recorded for the next step
    assert alloc.steps_run == steps and seam.cache_steps == 0
    assert len(alloc.prefix_cache) == 0  # the entry exists once its step ran
    assert seam.full_available_size() == (free0 + 1) * ps  # only the partial page [12, 13)
    assert seam.flush() == 1  # ONE step: the take first, then the release
    (h,) = alloc.prefix_cache.reclaimable_handles()
    info = alloc.handle_info(h)
    assert (info.n_tokens, info.swa_start) == (length // ps * ps, 0)
    assert alloc.n_free("full") == free0 + 1
    b = Req(1, 0, 2, origin_input_ids=a.fill_ids + [7, 7, 7])  # the next turn
    p = seam.match_prefix(b)
    assert p == 12 and b.last_node == h and alloc.prefix_cache.is_locked(h)
    out = seam.prepare_for_extend(Batch([b], [p], [len(b.fill_ids) - p]))
    assert out.n_steps == 1 and not alloc.prefix_cache.is_locked(h)  # unlocked after it
    assert torch.equal(alloc.req_to_token[b.req_pool_idx, :12], slots[:12])  # shared
    assert alloc.seq_len(b.req_pool_idx) == len(b.fill_ids)
    assert out.out_cache_loc.shape[0] == len(b.fill_ids) - 12  # only the rest allocated
    check_conserved(alloc)


def test_out_of_window_kv_is_a_tombstone_in_the_cache():
    """For an SWA model the cached entry of a finished request holds SWA pages only from
    its frontier: a follow-up turn hits the whole conversation (its window is there), a
    prompt that shares only the beginning finds the FULL prefix but no usable hit."""
    ps, w = 4, 8
    alloc, seam = make(ps=ps, window=w + 1, cache=True)
    a = Req(0, 12, 30)
    prefill_and_decode(seam, a, 29)
    f = alloc.frontier(a.req_pool_idx)
    assert f >= 28  # the window moved on
    seam.release_finished([a])
    seam.flush()
    (h,) = alloc.prefix_cache.reclaimable_handles()
    info = alloc.handle_info(h)
    assert info.swa_start == f and info.n_swa_pages == info.n_full_pages - f // ps
    turn = Req(1, 0, 1, origin_input_ids=a.fill_ids + [5])
    assert seam.match_prefix(turn) == len(a.fill_ids) // ps * ps
    fresh = Req(2, 0, 1, origin_input_ids=a.origin_input_ids + [9] * 6)
    assert seam.match_prefix(fresh) == 0 and fresh.last_node is None
    hit = alloc.prefix_cache.match(fresh.fill_ids[:-1])
    assert hit.full_tokens == 12 and hit.cached_tokens == 0 and hit.recompute_tokens > 0
    check_conserved(alloc)


def test_an_equal_prefix_cached_twice_keeps_one_copy():
    """Two requests with one prompt prefilled in one batch (both miss): the first finished
    request's insert records the entry's take, the second's finds it recorded (no second
    take) and its own copies of those pages are freed with it, in the same step."""
    alloc, seam = make(ps=4, window=65, chunk=32, cache=True)
    prompt = list(range(100, 116))
    a, b = Req(0, 0, 1, origin_input_ids=prompt), Req(1, 0, 1, origin_input_ids=prompt)
    seam.prepare_for_extend(Batch([a, b], [0, 0], [16, 16]))
    for r in (a, b):
        r.kv_len = 16
        r.sample()
    free0 = alloc.n_free("full")
    assert seam.release_finished([a, b]) == 2
    assert seam.pending.n_takes == 1 and seam.cache_steps == 0
    assert seam.flush() == 1 and len(alloc.prefix_cache) == 1
    assert alloc.n_free("full") == free0 + 4  # b's 4 pages; a's are the entry's
    check_conserved(alloc)


def test_radix_cache_contracts():
    alloc, seam = make(ps=4, cache=True)
    a = Req(0, 8, 2)
    prefill_and_decode(seam, a, 1)
    seam.release_finished([a])
    seam.flush()  # runs the release; the entry stays
    b = Req(1, 0, 1, origin_input_ids=a.fill_ids[:8] + [1, 2, 3])
    p = seam.match_prefix(b)
    assert p == 8
    h = b.last_node
    state = snapshot(alloc, seam, [b])
    with pytest.raises(ga.ContractError, match="match_prefix"):
        seam.prepare_for_extend(Batch([Req(2, 0, 1, origin_input_ids=b.fill_ids)], [8], [3]))
    with pytest.raises(ga.AlignmentError):
        seam.prepare_for_extend(Batch([b], [6], [5]))  # not whole pages
    with pytest.raises(ga.AlignmentError):
        seam.prepare_for_extend(Batch([b], [12], [1]))  # more than the hit
    with pytest.raises(ga.ContractError, match="origin_input_ids"):
        seam.match_prefix(types.SimpleNamespace(req_pool_idx=None, origin_input_ids=None))
    assert snapshot(alloc, seam, [b]) == state and alloc.prefix_cache.is_locked(h)
    assert seam.match_prefix(b) == 8  # a second match replaces the first lock
    assert alloc.prefix_cache.is_locked(h)
    seam.prepare_for_extend(Batch([b], [8], [3]))
    assert not alloc.prefix_cache.is_locked(h)
    with pytest.raises(ga.ContractError, match="already has a row"):
        seam.match_prefix(b)
    check_conserved(alloc)


def test_radix_cache_with_frees_at_free_group_end():
    """defer_frees=False: cache_finished_req inserts at the call, the release runs when
    the group closes (one step for the group)."""
    alloc, seam = make(ps=4, window=65, cache=True, defer_frees=False)
    reqs = [Req(i, 8, 1) for i in range(3)]
    seam.prepare_for_extend(Batch(reqs, [0] * 3, [8] * 3))
    for r in reqs:
        r.kv_len = 8
        r.sample()
    steps = alloc.steps_run
    assert seam.release_finished(reqs) == 3
    # 3 inserts, then the group's one step (its releases free no page: every page is an
    # entry's)
    assert alloc.steps_run == steps + 4 and alloc.n_live == 0
    assert len(alloc.prefix_cache) == 3
    check_conserved(alloc)


def test_example_with_a_shared_prompt_hits():
    sys.path.insert(0, str(ROOT / "examples"))
    import integrate_sglang

    s = integrate_sglang.main(["--requests", "10", "--max-running", "4", "--quiet"])
    assert s["finished"] == 10 and s["audit_findings"] == 0
    assert s["cache_hit_rate"] > 0.2
    assert s["steps"] == s["iterations_with_batch"] + s["cache_steps"]


@pytest.mark.parametrize("ps,window", [(8, 3), (16, 5), (4, 4)])
def test_a_cached_prefix_still_hits_when_the_page_is_longer_than_the_window(ps, window):
    """SGLang's eviction boundary: with a prefix cache the decode eviction keeps
    max(W, page_size) tokens (whole pages) behind the KV length. A request that finishes
    W or more tokens into a page is cached up to that page's start; its last whole page
    keeps its SWA, so a new request sharing the sequence hits all of it (with the
    frontier at floor_page(len - W), that page's SWA was gone and the hit was 0)."""
    alloc, seam = make(ps=ps, window=window, chunk=64, ctx=128, full=64, swa=32, cache=True,
                       handles=8)
    prompt = list(range(1, 3 * ps + 1))  # three whole pages
    first = Req(0, 0, 2 * ps - 1, origin_input_ids=prompt)
    assert seam.prepare_for_extend(Batch([first], [0], [len(prompt)])) is not None
    kv_len = len(prompt)
    while not first.finished():  # decode to ps - 1 tokens into the fifth page
        first.sample()
        assert seam.prepare_for_decode(Batch([first], seq_lens_cpu=[kv_len])) is not None
        kv_len += 1
    assert kv_len % ps == ps - 1 and alloc.frontier(first.req_pool_idx) > 0  # slid
    tokens = first.fill_ids[:kv_len]
    seam.cache_finished_req(first)
    seam.flush()
    second = Req(1, 0, 1, origin_input_ids=tokens + [999])
    assert seam.match_prefix(second) == kv_len // ps * ps


@pytest.mark.parametrize("field", ["extra_key", "cache_salt"])
def test_two_tenants_with_identical_prompts_share_no_page(field):
    """SGLang's extra_key / cache_salt enter every page key's chain: the same prompt from
    another tenant misses (0 tokens, no page shared), from the same tenant it hits."""
    alloc, seam = make(ps=4, window=64, chunk=64, ctx=128, full=64, swa=64, cache=True,
                       handles=8)
    prompt = list(range(1, 33))

    def tenant_req(rid, salt):
        req = Req(rid, 0, 1, origin_input_ids=prompt + [900 + rid])
        setattr(req, field, salt)
        return req

    first = tenant_req(0, "tenant-a")
    assert seam.prepare_for_extend(Batch([first], [0], [len(first.origin_input_ids)]))
    first.sample()
    seam.cache_finished_req(first)
    seam.flush()
    other, same, unsalted = tenant_req(1, "tenant-b"), tenant_req(2, "tenant-a"), \
        tenant_req(3, None)
    assert seam.match_prefix(other) == 0 and other.last_node is None
    assert seam.match_prefix(unsalted) == 0  # no salt is a tenant of its own
    assert seam.match_prefix(same) == 32
    out = seam.prepare_for_extend(Batch([other], [0], [len(other.origin_input_ids)]))
    shared = set(alloc.req_to_token[other.req_pool_idx, :32].tolist()) & set(
        alloc.handle_to_token[same.last_node, :32].tolist())
    assert out is not None and not shared


def test_a_decode_batch_with_req_pool_indices_cpu_reads_its_rows_there():
    """SGLang's ScheduleBatch keeps req_pool_indices_cpu: the seam takes the rows from it
    (no per-request read), the same step as from each req_pool_idx; a row outside the
    pool is refused with nothing changed."""
    alloc, seam = make()
    reqs = [Req(i, 8, 4) for i in range(3)]
    assert seam.prepare_for_extend(Batch(reqs, [0] * 3, [8] * 3)) is not None
    batch = Batch(reqs, seq_lens_cpu=torch.tensor([8, 8, 8]))
    batch.req_pool_indices_cpu = torch.tensor([r.req_pool_idx for r in reqs])
    out = seam.prepare_for_decode(batch)
    assert out is not None and out.rows.tolist() == [r.req_pool_idx for r in reqs]
    before = alloc.n_free("full"), alloc.steps_run
    bad = Batch(reqs, seq_lens_cpu=torch.tensor([9, 9, 9]))
    bad.req_pool_indices_cpu = torch.tensor([reqs[0].req_pool_idx, 10_000, 1])
    with pytest.raises(ga.UnknownRequestError):
        seam.prepare_for_decode(bad)
    assert (alloc.n_free("full"), alloc.steps_run) == before
