"""Scenario tests of graphalloc.integrations.vllm, from vLLM v1's documented scheduler.

``Scheduler.schedule()`` as vLLM documents it: running requests first
(``allocate_slots(request, num_new_tokens, num_lookahead_tokens=...)``; on ``None`` the
lowest-priority running request is preempted with ``free`` and the call retried),
then, when nothing was preempted, waiting requests (``get_computed_blocks`` -- the
prefix-cache lookup, at most ``num_tokens - 1`` tokens, whole blocks -- then
``allocate_slots`` with ``num_new_computed_tokens`` / ``new_computed_blocks``; the first
``None`` stops admission), all within a token budget (chunked prefill). Then the facade's
ONE step (``run_step``), the "forward", and ``update_from_output``: computed tokens
advance, rejected speculative tokens are taken back, finished requests are freed (with
caching their full blocks go into the cache; a preempted request's too).

The "forward" writes each position's token id into a fake KV store at the slots
``token_slots`` names (FULL and SWA), so after every iteration each running request must
read back its own computed tokens, every position through the FULL slots and from its
frontier through the SWA slots: a hit on the wrong blocks, or a block freed while still
cached or shared, fails it. Also after every iteration: the allocator's audit, the
cache's check, and exactly one graphalloc step (plus one per new cache entry).
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
from graphalloc.integrations.vllm import NULL_BLOCK_ID, GraphallocKVCacheManager

ROOT = Path(__file__).resolve().parents[2]


@dataclasses.dataclass(eq=False)
class Request:
    """What vLLM's ``Request`` carries that the scheduler below uses."""

    request_id: object
    num_prompt_tokens: int
    max_tokens: int
    num_computed_tokens: int = 0
    num_output_tokens: int = 0
    prompt_token_ids: list = dataclasses.field(default_factory=list)
    seed: int = 0

    def __post_init__(self):
        if not self.prompt_token_ids:
            self.seed = abs(hash(self.request_id)) % 1000
            self.prompt_token_ids = [10_000 + 97 * self.seed + i
                                     for i in range(self.num_prompt_tokens)]
        self.num_prompt_tokens = len(self.prompt_token_ids)

    def token_at(self, pos: int) -> int:
        """The token at ``pos``: the prompt's, then made-up outputs (drafts included)."""
        if pos < self.num_prompt_tokens:
            return self.prompt_token_ids[pos]
        return 50_000 + (self.seed * 7919 + pos * 104_729) % 40_000

    @property
    def all_token_ids(self) -> list:
        return [self.token_at(p) for p in range(self.num_tokens)]

    @property
    def num_tokens(self) -> int:  # prompt + generated (the last one not yet computed)
        return self.num_prompt_tokens + self.num_output_tokens

    def finished(self) -> bool:
        return self.num_output_tokens >= self.max_tokens


def make(ps=4, window=17, n_run=6, budget=32, ctx=160, full=200, swa=90, k=0, rows=None,
         cache=False, handles=16):
    # vLLM allocates the lookahead on prefill chunks too: a row can take budget + k slots
    cfg = ga.AllocatorConfig.for_engine(
        max_running_requests=n_run, chunked_prefill_size=budget + k, max_context_len=ctx,
        page_size=ps, model_sliding_window=window, num_full_pages=full, num_swa_pages=swa,
        num_lookahead_tokens=k, max_reqs=rows or 2 * n_run)
    if cache:  # handles, and a prefix copy row per admitted hit
        cfg = dataclasses.replace(cfg, max_handles=handles,
                                  max_alloc_rows=2 * cfg.max_alloc_rows)
    alloc = ga.HybridAllocator(cfg, prefix_cache=cache)
    return alloc, GraphallocKVCacheManager(alloc, enable_caching=cache)


class KVStore:
    """A fake KV cache: the token id each slot holds (FULL and SWA pools)."""

    def __init__(self, alloc):
        cfg = alloc.config
        self.alloc = alloc
        self.full = torch.full(((cfg.num_full_pages + 1) * cfg.page_size,), -1, dtype=torch.int64)
        self.swa = torch.full(((cfg.num_swa_pages + 1) * cfg.page_size,), -1, dtype=torch.int64)

    def write(self, mgr, req, start, n) -> None:
        full, swa = mgr.token_slots(req.request_id, start, n)
        t = torch.tensor([req.token_at(p) for p in range(start, start + n)], dtype=torch.int64)
        self.full[full.long()] = t
        self.swa[swa.long()] = t

    def check(self, mgr, req) -> None:
        """The request reads its computed tokens: every position, and from its frontier in
        SWA (the window of its computed tokens is there)."""
        c = req.num_computed_tokens
        full, _ = mgr.token_slots(req.request_id, 0, c)
        want = torch.tensor([req.token_at(p) for p in range(c)], dtype=torch.int64)
        assert torch.equal(self.full[full.long()], want), f"{req.request_id}: FULL KV differs"
        f = self.alloc.frontier(mgr.row_of(req.request_id))
        assert f <= max(0, c - self.alloc.config.sliding_window) // 1 or f == 0
        swa = self.alloc.full_to_swa[full[f:]].long()
        assert bool((swa > 0).all()), f"{req.request_id}: a window position has no SWA page"
        assert torch.equal(self.swa[swa], want[f:]), f"{req.request_id}: SWA KV differs"


def check_conserved(alloc):
    alloc.check_integrity()
    assert alloc.audit() == []
    if alloc.prefix_cache is not None:
        alloc.prefix_cache.check()
        return
    ps, full, swa = alloc.config.page_size, 0, 0
    for row in alloc.live_rows():
        end = -(-alloc.seq_len(row) // ps)
        full, swa = full + end, swa + end - alloc.frontier(row) // ps
    assert alloc.n_free("full") + full == alloc.config.num_full_pages
    assert alloc.n_free("swa") + swa == alloc.config.num_swa_pages


def check_blocks(alloc, mgr, req):
    """get_block_ids per group against the allocator's queries and token_slots."""
    ps = alloc.config.page_size
    row, length = mgr.row_of(req.request_id), mgr.num_allocated_tokens(req.request_id)
    full, swa = mgr.get_block_ids(req.request_id)
    n = -(-length // ps)
    first_live = alloc.frontier(row) // ps
    assert len(full) == len(swa) == n
    assert NULL_BLOCK_ID not in full and len(set(full)) == n
    assert swa[:first_live] == [NULL_BLOCK_ID] * first_live
    assert NULL_BLOCK_ID not in swa[first_live:]
    cfg = alloc.config  # live SWA blocks: the window of the computed tokens + one step's slots
    live_swa_pos = (len(swa) - first_live - 1) * ps
    if alloc.prefix_cache is None:  # (a hit holds its prefix's window until the next call)
        assert live_swa_pos <= cfg.sliding_window + ps + cfg.max_tokens_per_alloc_row
    f_slots, s_slots = mgr.token_slots(req.request_id, 0, length)
    assert (f_slots[::ps] // ps).tolist() == full
    assert (s_slots[first_live * ps::ps] // ps).tolist() == swa[first_live:]
    return first_live


def schedule_loop(mgr, reqs, *, budget, max_seqs, k=0, rng=None, max_iters=600, every=7,
                  cache_prompts=False, vary_k=False):
    """vLLM's schedule() / update_from_output() over ``reqs``; returns counters."""
    alloc = mgr.alloc
    cache = mgr.enable_caching
    kv = KVStore(alloc)
    waiting, running = deque(reqs), []
    log = dict(iters=0, preempted=0, stopped_admission=0, finished=0, rejected=0,
               max_null_blocks=0, hit_tokens=0, resumed_hits=0)

    def free(req):  # finished or preempted: with caching its computed full blocks stay
        tokens = req.all_token_ids[:req.num_computed_tokens] if cache else None
        mgr.free(req.request_id, tokens)

    for it in range(max_iters):
        if not waiting and not running:
            break
        log["iters"] += 1
        before, cache_before = alloc.steps_run, mgr.cache_steps
        scheduled, tokens_left, preempted = {}, budget, []
        k_full = k
        k = int(rng.integers(0, k_full + 1)) if vary_k else k_full  # lookahead this step
        i = 0
        while i < len(running) and tokens_left > 0:
            req = running[i]
            decoding = req.num_computed_tokens >= req.num_prompt_tokens
            want = 1 + k if decoding else req.num_tokens - req.num_computed_tokens
            if decoding and tokens_left < want:
                break
            n = min(want, tokens_left)
            while True:
                blocks = mgr.allocate_slots(req.request_id, n, num_lookahead_tokens=k,
                                            num_computed_tokens=req.num_computed_tokens)
                if blocks is not None:
                    break
                victim = running.pop()  # lowest priority: the newest
                free(victim)
                victim.num_computed_tokens = 0
                waiting.appendleft(victim)
                preempted.append(victim)
                log["preempted"] += 1
                if victim is req:
                    break
            if blocks is None:
                break
            scheduled[req.request_id] = (req, req.num_computed_tokens, n, k)
            tokens_left -= n
            i += 1
        while not preempted and waiting and tokens_left > 0 and len(running) < max_seqs:
            req = waiting[0]
            hit, n_hit = mgr.get_computed_blocks(req.request_id, req.all_token_ids)
            if not cache:
                assert n_hit == 0 and hit.num_blocks == 0
            assert n_hit < req.num_tokens and n_hit % alloc.config.page_size == 0
            n = min(req.num_tokens - n_hit, tokens_left)
            blocks = mgr.allocate_slots(req.request_id, n, num_lookahead_tokens=k,
                                        num_computed_tokens=req.num_computed_tokens,
                                        num_new_computed_tokens=n_hit,
                                        new_computed_blocks=hit)
            if blocks is None:
                log["stopped_admission"] += 1
                break
            waiting.popleft()
            running.append(req)
            req.num_computed_tokens = n_hit
            log["hit_tokens"] += n_hit
            log["resumed_hits"] += bool(n_hit and req.num_output_tokens)
            scheduled[req.request_id] = (req, n_hit, n, k)
            tokens_left -= n
        work = 1 if mgr.pending_work else 0  # nothing recorded (every target covered): no step
        # the page accounting is exact: free after the step = its prediction (the planner's
        # dry run of the recorded frees, minus the recorded allocations) plus what the
        # cache's eviction gave back inside the step
        predicted = [mgr.free_pages(pool) for pool in ("full", "swa")]
        cached = alloc.prefix_cache
        given = (0, 0) if cached is None else (cached.evicted_pages, cached.tombstoned_pages)
        mgr.run_step()
        if cached is not None:
            given = (cached.evicted_pages - given[0], cached.tombstoned_pages - given[1])
        assert [alloc.n_free("full"), alloc.n_free("swa")] == [predicted[0] + given[0],
                                                                predicted[1] + given[1]]
        assert alloc.steps_run - before == work + mgr.cache_steps - cache_before  # ONE step
        assert mgr.steps_last_run == work
        # the forward ran: the KV of every scheduled position; update_from_output
        for req, start, n, k_req in scheduled.values():
            kv.write(mgr, req, start, n)
            was_decoding = req.num_computed_tokens >= req.num_prompt_tokens
            req.num_computed_tokens += n
            assert req.num_computed_tokens <= mgr.num_allocated_tokens(req.request_id)
            if was_decoding and k_req:  # verify k drafts: accept some, take the rest back
                accepted = int(rng.integers(0, k_req + 1))
                req.num_computed_tokens -= k_req - accepted
                req.num_output_tokens += accepted + 1
                log["rejected"] += k_req - accepted
            elif req.num_computed_tokens >= req.num_tokens:
                req.num_output_tokens += 1
                if cache_prompts and start < req.num_prompt_tokens:  # the prompt completed
                    mgr.cache_blocks(req.request_id, req.all_token_ids[:req.num_prompt_tokens])
        for req in running:
            kv.check(mgr, req)
        if it % every == 0:
            for req in running:
                n_null = check_blocks(alloc, mgr, req)
                log["max_null_blocks"] = max(log["max_null_blocks"], n_null)
        for req in [r for r in running if r.finished()]:
            free(req)
            running.remove(req)
            log["finished"] += 1
        # frees are recorded for the next step (a new cache entry is a step of its own)
        assert alloc.steps_run - before == work + mgr.cache_steps - cache_before
        check_conserved(alloc)
        k = k_full
    return log


@pytest.mark.parametrize("ps,k", [(1, 0), (4, 0), (4, 2), (16, 3)])
def test_schedule_loop_one_step_per_iteration(ps, k):
    rng = np.random.default_rng(10 * ps + k)
    alloc, mgr = make(ps=ps, k=k, full=800 // ps, swa=480 // ps)
    reqs = [Request(f"req-{i}", int(rng.integers(3, 70)), int(rng.integers(1, 30)))
            for i in range(14)]
    log = schedule_loop(mgr, reqs, budget=32, max_seqs=6, k=k, rng=rng)
    assert log["finished"] == len(reqs) and all(r.finished() for r in reqs)
    assert log["rejected"] > 0 or k == 0
    assert log["max_null_blocks"] > 0  # window removal ran
    assert len(mgr) == 0
    mgr.run_step()  # the last frees
    check_conserved(alloc)
    assert alloc.n_free("full") == alloc.config.num_full_pages
    assert alloc.n_free("swa") == alloc.config.num_swa_pages


@pytest.mark.parametrize("ps,cache", [(4, False), (1, True), (4, True)])
def test_a_lookahead_that_shrinks_gives_pages_back(ps, cache):
    """Speculative decoding with a lookahead drawn per step (0..4): when a request's target
    falls a whole page below what it holds, the pages past it are given back in the step
    (trim); every request still reads its own KV, one step per schedule()."""
    rng = np.random.default_rng(ps)
    alloc, mgr = make(ps=ps, k=4, full=800 // ps, swa=480 // ps, cache=cache)
    reqs = [Request(f"req-{i}", int(rng.integers(3, 70)), int(rng.integers(5, 40)))
            for i in range(12)]
    trims, run = [], mgr.run_step

    def counting_run():  # how many trims each step carried
        out = run()
        step = mgr.pending.last_step
        trims.append(0 if step is None or step.trim is None else len(step.trim[0]))
        return out

    mgr.run_step = counting_run
    log = schedule_loop(mgr, reqs, budget=32, max_seqs=6, k=4, rng=rng, vary_k=True)
    assert log["finished"] == len(reqs) and log["rejected"] > 0
    assert sum(trims) > 5  # lookaheads shrank a page or more, many times
    mgr.run_step()
    check_conserved(alloc)
    if cache:
        alloc.prefix_cache.drop_all()
    assert alloc.n_free("full") == alloc.config.num_full_pages


def test_trim_gives_back_whole_pages_past_the_target_and_keeps_the_rest():
    ps, k = 4, 6
    alloc, mgr = make(ps=ps, k=k, window=65)
    mgr.allocate_slots("r", 8, num_lookahead_tokens=k)  # 14 positions: 4 blocks
    mgr.run_step()
    row = mgr.row_of("r")
    slots = alloc.req_to_token[row, :14].clone()
    free0 = alloc.n_free("full")
    # computed 8, one token, no lookahead: 9 needed; blocks [3, 4) are wholly past it
    b = mgr.allocate_slots("r", 1, num_computed_tokens=8)
    assert b.num_blocks == 0 and mgr.num_allocated_tokens("r") == 9
    assert mgr.get_num_free_blocks() == min(alloc.n_free("full"), alloc.n_free("swa")) + 1
    mgr.run_step()
    assert alloc.seq_len(row) == 9 and alloc.n_free("full") == free0 + 1
    assert torch.equal(alloc.req_to_token[row, :9], slots[:9])  # the partial block stays
    # the next tokens continue the partial block, then take a fresh one
    mgr.allocate_slots("r", 4, num_computed_tokens=9)
    mgr.run_step()
    assert torch.equal(alloc.req_to_token[row, :12], slots[:12])
    check_conserved(alloc)


def test_no_trim_below_the_window_of_a_moved_frontier():
    """A trim to below frontier + window is refused by the allocator: the facade keeps the
    slots instead (the request holds more than it needs, nothing fails)."""
    ps, w = 4, 8
    alloc, mgr = make(ps=ps, k=8, window=w + 1)
    mgr.allocate_slots("r", 24)
    mgr.run_step()
    mgr.allocate_slots("r", 1, num_lookahead_tokens=8, num_computed_tokens=24)  # 33 slots
    mgr.run_step()
    row = mgr.row_of("r")
    f = alloc.frontier(row)
    assert f == 16
    # computed 25 (one accepted), target 26 < f + W = 24? no: 26 >= 24, trimmed
    mgr.allocate_slots("r", 1, num_computed_tokens=25)
    mgr.run_step()
    assert alloc.seq_len(row) == 26
    check_conserved(alloc)
    alloc2, mgr2 = make(ps=ps, k=8, window=w + 1)
    mgr2.allocate_slots("r", 20)
    mgr2.run_step()
    mgr2.allocate_slots("r", 1, num_lookahead_tokens=8, num_computed_tokens=20)  # 29 slots
    mgr2.run_step()
    row2 = mgr2.row_of("r")
    assert alloc2.frontier(row2) == 12
    # the engine lowers computed to 12 (all but a few rejected): target 13 < 12 + 8
    mgr2.allocate_slots("r", 1, num_computed_tokens=12)
    mgr2.run_step()
    assert alloc2.seq_len(row2) == 29 and alloc2.frontier(row2) == 12  # kept, no trim
    check_conserved(alloc2)


def test_pressure_preempts_and_stops_admission():
    rng = np.random.default_rng(5)
    alloc, mgr = make(ps=4, full=40, swa=36)
    reqs = [Request(i, int(rng.integers(10, 50)), int(rng.integers(20, 50))) for i in range(10)]
    log = schedule_loop(mgr, reqs, budget=32, max_seqs=6, max_iters=3000)
    assert log["preempted"] > 0 and log["stopped_admission"] > 0
    assert log["finished"] == len(reqs)


def frontier_of(alloc, mgr, rid):
    try:
        return alloc.frontier(mgr.row_of(rid))
    except ga.PendingStepError:  # admitted by the next step
        return None


def state(alloc, mgr, ids):
    return (alloc.n_free("full"), alloc.n_free("swa"), alloc.n_live, alloc.steps_run,
            mgr.get_num_free_blocks(), len(mgr),
            [(mgr.num_allocated_tokens(i), frontier_of(alloc, mgr, i)) for i in ids])


def test_none_is_back_pressure_with_nothing_changed():
    alloc, mgr = make(ps=4, window=9, full=16, swa=16, rows=3, n_run=3)
    assert mgr.allocate_slots("a", 32) is not None  # 8 pages
    mgr.run_step()
    assert mgr.allocate_slots("b", 12) is not None  # 3 pages, recorded
    before = state(alloc, mgr, ["a", "b"])
    # FULL is short for the new request (5 pages free once b is allocated)
    assert mgr.allocate_slots("c", 23) is None  # 6 pages
    assert "c" not in mgr and state(alloc, mgr, ["a", "b"]) == before
    mgr.free("b")  # b was new in this iteration: its admission is cancelled, no row taken
    assert "b" not in mgr and alloc.n_live == 1
    assert mgr.allocate_slots("c", 16) is not None
    assert mgr.allocate_slots("d", 4) is not None  # rows: a, c, d (admitted by the step)
    assert mgr.allocate_slots("e", 4) is None  # rows short: 3
    with pytest.raises(ga.PendingStepError):
        mgr.row_of("c")  # its row is the step's
    mgr.run_step()
    assert alloc.steps_run == before[3] + 1 and alloc.n_live == 3
    assert sorted(mgr.row_of(r) for r in "acd") == [0, 1, 2]
    check_conserved(alloc)


def test_window_removal_before_allocation_uses_computed_tokens():
    ps = 4
    alloc, mgr = make(ps=ps, window=9)  # allocator window 8: blocks below computed - 8
    mgr.allocate_slots("r", 30)
    mgr.run_step()
    row = mgr.row_of("r")
    assert alloc.frontier(row) == 0
    mgr.allocate_slots("r", 1, num_computed_tokens=30)
    mgr.run_step()
    assert alloc.frontier(row) == (30 - 8) // ps * ps
    full, swa = mgr.get_block_ids("r")
    assert swa[:5] == [NULL_BLOCK_ID] * 5 and NULL_BLOCK_ID not in swa[5:]
    check_conserved(alloc)


def test_lookahead_slots_are_reused_not_freed():
    ps, k = 4, 3
    alloc, mgr = make(ps=ps, k=k, window=65)
    b = mgr.allocate_slots("r", 8, num_lookahead_tokens=k)  # 8 + 3 = 11: 3 blocks
    assert (b.first_block, b.num_blocks) == (0, 3)
    mgr.run_step()
    row = mgr.row_of("r")
    slots_11 = alloc.req_to_token[row, :11].clone()
    free = alloc.n_free("full")
    # decode with 3 drafts: computed 8, new 1 + 3, lookahead 3 -> 15 positions
    b = mgr.allocate_slots("r", 1 + k, num_lookahead_tokens=k, num_computed_tokens=8)
    assert (b.first_block, b.num_blocks) == (3, 1)
    mgr.run_step()
    assert mgr.num_allocated_tokens("r") == 15 and alloc.n_free("full") == free - 1
    # one draft accepted: computed 8 + 4 - 2 = 10; positions 10..14 are reused
    slots_15 = alloc.req_to_token[row, :15].clone()
    b = mgr.allocate_slots("r", 1 + k, num_lookahead_tokens=k, num_computed_tokens=10)
    mgr.run_step()
    assert mgr.num_allocated_tokens("r") == 17 and alloc.n_free("full") == free - 2
    assert torch.equal(alloc.req_to_token[row, :15], slots_15)
    assert torch.equal(slots_15[:11], slots_11)
    assert b.get_block_ids()[0] == mgr.get_block_ids("r")[0][4:5]
    # nothing rejected: no new pages when the lookahead already covers it
    b = mgr.allocate_slots("r", 1, num_computed_tokens=16)
    assert b.num_blocks == 0
    mgr.run_step()
    assert mgr.num_allocated_tokens("r") == 17
    check_conserved(alloc)


class Key:
    def __init__(self, v):
        self.v = v

    def __hash__(self):
        return hash(("key", self.v))

    def __eq__(self, other):
        return isinstance(other, Key) and other.v == self.v


def test_request_ids_of_any_hashable_type():
    alloc, mgr = make(ps=4, n_run=8, budget=64)
    ids = [None, (1, "a"), frozenset({2, 3}), b"x", 2.5, Key(7), "7", 10 ** 30]
    for rid in ids:
        assert mgr.allocate_slots(rid, 5) is not None
    mgr.run_step()
    rows = [mgr.row_of(rid) for rid in ids]
    assert len(set(rows)) == len(ids) and Key(7) in mgr and Key(8) not in mgr
    for rid in ids:
        assert mgr.num_allocated_tokens(rid) == 5
    assert mgr.free(Key(7)) and mgr.free((1, "a"))
    assert mgr.free("never-seen") is False  # a free of an unknown id is a no-op, as vLLM
    assert mgr.free(Key(7)) is False  # freed already: unknown
    mgr.run_step()
    assert len(mgr) == 6 and alloc.n_live == 6
    with pytest.raises(ga.UnknownRequestError):  # every other call: a typed error
        mgr.get_block_ids(Key(7))
    # dict keys: ids equal under == are one request
    assert mgr.allocate_slots(1, 4) is not None
    assert True in mgr and 1.0 in mgr
    mgr.free(True)
    assert 1 not in mgr
    with pytest.raises(ga.UnknownRequestError, match="hashable"):
        mgr.allocate_slots(["unhashable"], 1)
    mgr.run_step()
    check_conserved(alloc)


def test_contracts():
    alloc, mgr = make(ps=4)
    with pytest.raises(ValueError, match="greater than 0"):
        mgr.allocate_slots("r", 0)
    with pytest.raises(ga.ContractError, match="get_computed_blocks"):
        mgr.allocate_slots("r", 4, num_new_computed_tokens=4)  # a hit it was never given
    with pytest.raises(ga.PositionError):
        mgr.allocate_slots("r", 4, num_computed_tokens=4)  # nothing allocated yet
    with pytest.raises(ga.ConfigError, match="prefix cache"):
        GraphallocKVCacheManager(alloc, enable_caching=True)  # the allocator has none
    assert mgr.get_computed_blocks("r", [1, 2, 3, 4, 5])[1] == 0  # caching off
    mgr.allocate_slots("r", 8)
    with pytest.raises(ga.PendingStepError):
        mgr.get_block_ids("r")  # recorded, not run
    with pytest.raises(ga.PendingStepError):
        mgr.token_slots("r", 0, 8)  # admitted by the next step
    mgr.run_step()
    full, swa = mgr.get_block_ids("r")
    assert len(full) == 2 and mgr.token_slots("r", 0, 8)[0].shape == (8,)
    mgr.allocate_slots("r", 4, num_computed_tokens=8)
    with pytest.raises(ga.PositionError):
        mgr.token_slots("r", 0, 12)  # recorded, not run
    mgr.run_step()
    with pytest.raises(ga.BatchTooLargeError):
        mgr.allocate_slots("s", alloc.config.max_tokens_per_alloc_row + 1)
    assert "s" not in mgr
    with pytest.raises(ga.ContractError):
        mgr.row_of("s")
    assert mgr.allocate_slots("np", np.int64(4), num_lookahead_tokens=np.int32(1)).num_blocks == 2
    with pytest.raises(ga.ContractError):
        mgr.allocate_slots("f", 4.0)


def test_example_help(capsys):
    sys.path.insert(0, str(ROOT / "examples"))
    import integrate_vllm

    with pytest.raises(SystemExit) as exc:
        integrate_vllm.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "usage" in out and "--max-seqs" in out and "ONE graphalloc step" in out


def test_example_runs():
    sys.path.insert(0, str(ROOT / "examples"))
    import integrate_vllm

    summary = integrate_vllm.main(["--requests", "8", "--max-seqs", "4", "--quiet",
                                   "--no-cache"])
    assert summary["finished"] == 8 and summary["steps"] == summary["iterations"]
    assert summary["pages_free_at_end"] == summary["pages_total"]


# ---- prefix caching --------------------------------------------------------------------
def shared_prompt_requests(rng, n, system_len, *, suffix=(4, 40), out=(1, 30), start=0):
    system = [1 + i for i in range(system_len)]
    return [Request(f"req-{start + i}", 0, int(rng.integers(*out)),
                    prompt_token_ids=system + [20_000 + 1000 * (start + i) + j
                                               for j in range(int(rng.integers(*suffix)))],
                    seed=start + i)
            for i in range(n)]


@pytest.mark.parametrize("ps,k", [(1, 0), (4, 2), (16, 0)])
def test_schedule_loop_serves_a_shared_system_prompt_from_the_cache(ps, k):
    """Requests with a shared system prompt: the first one's prompt is cached when its
    prefill completes (cache_blocks) and every finished request's blocks at free; later
    requests get their hits from get_computed_blocks and are admitted on them in the one
    step; every request reads back its own tokens through the shared blocks."""
    rng = np.random.default_rng(ps + 10 * k)
    alloc, mgr = make(ps=ps, k=k, full=1600 // ps, swa=800 // ps, cache=True)
    reqs = shared_prompt_requests(rng, 14, system_len=40)
    log = schedule_loop(mgr, reqs, budget=32, max_seqs=5, k=k, rng=rng, cache_prompts=True)
    assert log["finished"] == len(reqs)
    stats = mgr.prefix_cache_stats()
    assert stats["requests"] >= len(reqs) and stats["hits"] == log["hit_tokens"]
    assert log["hit_tokens"] >= 8 * (40 // ps * ps) and stats["hit_rate"] > 0.3
    mgr.run_step()
    check_conserved(alloc)
    assert alloc.n_live == 0 and len(alloc.prefix_cache) > 0
    alloc.prefix_cache.drop_all()
    assert alloc.n_free("full") == alloc.config.num_full_pages
    assert alloc.n_free("swa") == alloc.config.num_swa_pages


def test_preempted_requests_resume_from_their_cached_blocks():
    """Under pressure a preempted request's computed blocks go into the cache when it is
    freed; rescheduled, it finds them (vLLM's recomputation after preemption, served from
    the cache), and the steps evict what the cache must give back."""
    rng = np.random.default_rng(11)
    alloc, mgr = make(ps=4, full=48, swa=40, cache=True, handles=10)
    reqs = [Request(f"r{i}", int(rng.integers(10, 50)), int(rng.integers(20, 50)))
            for i in range(10)]
    log = schedule_loop(mgr, reqs, budget=32, max_seqs=6, max_iters=3000)
    assert log["finished"] == len(reqs) and log["preempted"] > 0
    assert log["resumed_hits"] > 0
    cache = alloc.prefix_cache
    assert cache.evicted_pages + cache.tombstoned_pages > 0
    mgr.run_step()
    cache.drop_all()
    assert alloc.n_free("full") == alloc.config.num_full_pages
    check_conserved(alloc)


def test_a_hit_is_full_blocks_short_of_the_last_token_and_shares_the_blocks():
    ps = 4
    alloc, mgr = make(ps=ps, window=65, cache=True)
    a = Request("a", 16, 1)
    mgr.allocate_slots("a", 16)
    mgr.run_step()
    a_blocks = mgr.get_block_ids("a")
    free0, steps = alloc.n_free("full"), alloc.steps_run
    mgr.free("a", a.all_token_ids[:16])  # 4 full blocks go into the cache: a take, recorded
    assert alloc.steps_run == steps and mgr.cache_steps == 0
    mgr.run_step()  # ONE step: the take, then the release
    assert alloc.steps_run == steps + 1 and len(alloc.prefix_cache) == 1
    assert alloc.n_free("full") == free0  # every block of a is the cache's
    assert mgr.get_num_free_blocks() == min(alloc.n_free("full"), alloc.n_free("swa")) + 4
    b = Request("b", 0, 1, prompt_token_ids=a.prompt_token_ids)  # the same prompt
    hit, n = mgr.get_computed_blocks("b", b.all_token_ids)
    assert n == 12 and hit.num_blocks == 3  # the last token is recomputed: 15 -> 3 blocks
    assert hit.get_block_ids()[0] == a_blocks[0][:3]
    blocks = mgr.allocate_slots("b", 16 - n, num_new_computed_tokens=n, new_computed_blocks=hit)
    assert (blocks.first_block, blocks.num_blocks) == (3, 1)
    free_before = alloc.n_free("full")
    mgr.run_step()
    assert alloc.n_free("full") == free_before - 1  # only the recomputed block is new
    full, _ = mgr.get_block_ids("b")
    assert full[:3] == a_blocks[0][:3] and full[3] != a_blocks[0][3]
    assert mgr.prefix_cache_stats() == {"requests": 1, "queries": 16, "hits": 12,
                                        "hit_rate": 0.75}
    check_conserved(alloc)


def test_a_hit_needs_the_window_blocks_of_its_end():
    """A finished request whose window moved on: its cached entry holds SWA blocks only
    from its frontier, so a request sharing only its beginning gets no hit (no group can
    serve the SWA layers' window there), a continuation of it does."""
    ps, w = 4, 8
    alloc, mgr = make(ps=ps, window=w + 1, cache=True)
    a = Request("a", 12, 1)
    mgr.allocate_slots("a", 12)
    mgr.run_step()
    for c in range(12, 40):  # decode to 41 tokens
        mgr.allocate_slots("a", 1, num_computed_tokens=c)
        mgr.run_step()
        a.num_output_tokens += 1
    tokens = a.all_token_ids
    f = alloc.frontier(mgr.row_of("a"))
    mgr.free("a", tokens[:40])
    mgr.run_step()
    assert f > 12
    short = mgr.get_computed_blocks("s", a.prompt_token_ids + [9] * 5)
    assert short[1] == 0
    cont = mgr.get_computed_blocks("c", tokens + [3, 3])
    assert cont[1] == 40
    check_conserved(alloc)


def test_hits_are_locked_until_the_step_and_evictable_blocks_count_as_free():
    """A hit's entry cannot be evicted before the step that admits on it: a request that
    would need its blocks is refused (None), not served by evicting them; after run_step
    the unused lock is gone and the same allocation succeeds by evicting in its step."""
    ps = 4
    alloc, mgr = make(ps=ps, window=65, full=12, swa=12, rows=4, n_run=3, budget=32,
                      cache=True)
    a = Request("a", 24, 1)
    mgr.allocate_slots("a", 24)  # 6 blocks
    mgr.run_step()
    mgr.free("a", a.all_token_ids[:24])
    mgr.run_step()
    assert alloc.n_free("full") == 6 and mgr.get_num_free_blocks() == 12
    hit, n = mgr.get_computed_blocks("b", a.all_token_ids)  # locks the entry
    assert n == 20
    assert mgr.get_num_free_blocks() == 6  # a locked entry is not evictable
    state0 = state(alloc, mgr, [])
    assert mgr.allocate_slots("big", 28) is None  # 7 blocks: only 6 free without the hit
    assert state(alloc, mgr, []) == state0 and len(alloc.prefix_cache) == 1
    mgr.run_step()  # b was never allocated: its lock ends with the iteration
    assert not alloc.prefix_cache.is_locked(hit.handle)
    assert mgr.allocate_slots("big", 28) is not None
    mgr.run_step()  # the cache's entry is evicted inside this step
    assert len(alloc.prefix_cache) == 0 and alloc.prefix_cache.evicted_pages == 6
    check_conserved(alloc)


def test_prefix_caching_contracts():
    alloc, mgr = make(ps=4, window=65, cache=True)
    a = Request("a", 16, 1)
    mgr.allocate_slots("a", 16)
    mgr.run_step()
    with pytest.raises(ga.ContractError, match="waiting"):
        mgr.get_computed_blocks("a", a.all_token_ids)  # a running request
    mgr.free("a", a.all_token_ids)
    assert mgr.get_computed_blocks("b", a.all_token_ids)[1] == 0  # cached by the next step
    mgr.run_step()
    hit, n = mgr.get_computed_blocks("b", a.all_token_ids)
    assert n == 12
    before = state(alloc, mgr, [])
    with pytest.raises(ga.ContractError, match="get_computed_blocks"):
        mgr.allocate_slots("c", 4, num_new_computed_tokens=n, new_computed_blocks=hit)
    with pytest.raises(ga.ContractError, match="whole hit"):
        mgr.allocate_slots("b", 8, num_new_computed_tokens=n - 4, new_computed_blocks=hit)
    with pytest.raises(ga.PositionError):
        mgr.allocate_slots("b", 4, num_computed_tokens=4, num_new_computed_tokens=n,
                           new_computed_blocks=hit)
    assert state(alloc, mgr, []) == before
    assert mgr.allocate_slots("b", 4, num_new_computed_tokens=n,
                              new_computed_blocks=hit) is not None
    assert mgr.num_allocated_tokens("b") == n + 4
    mgr.run_step()
    assert mgr.cache_blocks("b", a.all_token_ids[:12]) == 12  # cached already: no step
    with pytest.raises(ga.ConfigError):
        GraphallocKVCacheManager(alloc, enable_caching=1)
    check_conserved(alloc)


def test_example_with_a_shared_prompt_hits():
    sys.path.insert(0, str(ROOT / "examples"))
    import integrate_vllm

    s = integrate_vllm.main(["--requests", "10", "--max-seqs", "4", "--quiet"])
    assert s["finished"] == 10 and s["audit_findings"] == 0
    assert s["cache_hit_rate"] > 0.2
    assert s["steps"] == s["iterations"] + s["cache_steps"]


def test_a_call_whose_own_window_removal_frees_what_it_needs_is_not_refused():
    """The SWA pool is full; a decode whose window removal (in the same step, before its
    allocation) frees SWA pages fits -- the facade's last tier counts the call's own frees
    -- while a request with nothing to remove is refused (None, nothing changed)."""
    cfg = ga.AllocatorConfig(page_size=4, num_full_pages=20, num_swa_pages=8, max_reqs=4,
                             max_context_len=64, sliding_window=8,
                             max_tokens_per_alloc_row=32)
    alloc = ga.HybridAllocator(cfg)
    mgr = GraphallocKVCacheManager(alloc)
    assert mgr.allocate_slots("r", 24) is not None  # 6 pages per pool
    mgr.run_step()
    assert mgr.allocate_slots("fill", 8) is not None  # 2 more: the SWA pool is full
    mgr.run_step()
    assert alloc.n_free("swa") == 0 and alloc.n_free("full") == 12
    before = state(alloc, mgr, ["r", "fill"])
    assert mgr.allocate_slots("fill", 1, num_computed_tokens=8) is None  # 8 - 8: no page
    assert state(alloc, mgr, ["r", "fill"]) == before
    blocks = mgr.allocate_slots("r", 1, num_computed_tokens=24)  # frees SWA [0, 16)
    assert blocks is not None and blocks.num_blocks == 1
    assert mgr.free_pages("swa") == 4 - 1
    mgr.run_step()
    assert alloc.frontier(mgr.row_of("r")) == 16 and alloc.n_free("swa") == 3
    check_conserved(alloc)
