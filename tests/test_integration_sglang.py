"""Scenario tests of graphalloc.integrations.sglang, from SGLang's documented scheduler.

The loop below follows SGLang's non-overlap event loop: form a batch (prefill first,
chunked to a token budget, admitted only while ``available_size()`` covers it; else a
decode batch, retracting the newest request while the decode does not fit), run
``prepare_for_extend`` / ``prepare_for_decode``, "run the model", then
``process_batch_result``: finished requests released with ``release_kv_cache``
between ``free_group_begin`` / ``free_group_end``. After every iteration: the
allocator's integrity check, page conservation through the public queries, and
exactly ONE graphalloc step for the iteration.
"""

from __future__ import annotations

import dataclasses
import sys
from collections import deque
from pathlib import Path

import numpy as np
import pytest
import torch

import graphalloc as ga
from graphalloc.integrations.sglang import SGLangAllocator

ROOT = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(eq=False)
class Req:
    """The attributes of SGLang's ``Req`` the seam reads, plus the test's bookkeeping."""

    rid: int
    prompt_len: int
    max_new_tokens: int
    req_pool_idx: int | None = None
    kv_len: int = 0  # tokens with KV: len(prefix_indices) in SGLang
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


def make(ps=4, window=17, n_run=6, chunk=24, ctx=128, full=160, swa=70, rows=None, **kw):
    cfg = ga.AllocatorConfig.for_engine(
        max_running_requests=n_run, chunked_prefill_size=chunk, max_context_len=ctx,
        page_size=ps, model_sliding_window=window, num_full_pages=full, num_swa_pages=swa,
        max_reqs=rows or 2 * n_run)
    alloc = ga.HybridAllocator(cfg)
    return alloc, SGLangAllocator(alloc, **kw)


def held(alloc, row):
    ps = alloc.config.page_size
    end = -(-alloc.seq_len(row) // ps)
    return end, end - alloc.frontier(row) // ps


def check_conserved(alloc):
    """Per pool: free + held by live requests == pages (page 0 is the sink)."""
    alloc.check_integrity()
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
    ps = alloc.config.page_size
    waiting, running, chunked = deque(reqs), [], None
    log = {"extend": 0, "decode": 0, "refused": 0, "retracted": 0, "evicted_pages": 0,
           "released": 0, "iters": 0}
    for _ in range(max_iters):
        if not waiting and not running and chunked is None:
            break
        log["iters"] += 1
        before = alloc.steps_run
        # get_new_batch_prefill: the chunked request first, then waiting ones (PrefillAdder)
        batch_reqs, ext, budget, need = [], [], chunk, len(running) * ps
        cands = ([chunked] if chunked is not None else []) + list(waiting)
        for req in cands:
            if budget <= 0 or len(running) + len(batch_reqs) >= max_running:
                break
            n = min(req.prompt_len - req.kv_len, budget)
            need += n + ps
            if adder_checks and seam.available_size() < need:
                break
            batch_reqs.append(req)
            ext.append(n)
            budget -= n
        out = None
        if batch_reqs:
            batch = Batch(batch_reqs, [r.kv_len for r in batch_reqs], ext)
            out = seam.prepare_for_extend(batch)
            if out is None:
                log["refused"] += 1
            else:
                log["extend"] += 1
                for r in batch_reqs:
                    if r is not chunked:
                        waiting.remove(r)
        if out is None and running:
            while running and seam.available_size() < len(running) * ps:  # check_decode_mem
                victim = running.pop()  # retract_decode: newest first
                seam.release_kv_cache(victim)
                victim.kv_len = victim.n_out = 0
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
        assert alloc.steps_run - before == 1 == out.n_steps  # ONE step per iteration
        log["evicted_pages"] += out.n_evicted_pages
        reqs_b = batch.reqs
        if check_slots:
            loc, swa_loc = out.out_cache_loc, out.swa_out_cache_loc
            assert torch.equal(seam.translate_loc_from_full_to_swa(loc), swa_loc)
            assert bool((swa_loc > 0).all()) and len(torch.unique(loc)) == len(loc)
            lens = ext if batch.extend_lens is not None else [1] * len(reqs_b)
            starts = np.cumsum([0, *lens])
            for i, r in enumerate(reqs_b):
                pos = r.kv_len
                got = alloc.req_to_token[r.req_pool_idx, pos:pos + lens[i]]
                assert torch.equal(got, loc[starts[i]:starts[i + 1]])
        # "forward" + process_batch_result
        if batch.extend_lens is not None:
            chunked = None
            for r, n in zip(reqs_b, ext, strict=True):
                r.kv_len += n
                if r.kv_len == r.prompt_len:
                    r.n_out = 1  # prefill samples the first token
                    running.append(r)
                else:
                    chunked = r
        else:
            for r in reqs_b:
                r.kv_len += 1
                r.n_out += 1
        done = [r for r in running if r.finished()]
        log["released"] += seam.release_finished(running)
        running = [r for r in running if not r.finished()]
        assert all(r.req_pool_idx is None for r in done)
        assert alloc.steps_run - before == 1  # the frees are recorded, not run
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
    with pytest.raises(ga.ContractError, match="prefix cache"):
        seam.prepare_for_extend(Batch([r], [4], [4]))
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
    with pytest.raises(NotImplementedError, match="not wired"):
        seam.insert_into_prefix_cache(r)
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


def test_example_runs():
    sys.path.insert(0, str(ROOT / "examples"))
    import integrate_sglang

    summary = integrate_sglang.main(["--requests", "8", "--max-running", "4", "--quiet"])
    assert summary["finished"] == 8 and summary["steps"] == summary["iterations_with_batch"]
    assert summary["pages_free_at_end"] == summary["pages_total"]
