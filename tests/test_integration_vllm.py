"""Scenario tests of graphalloc.integrations.vllm, from vLLM v1's documented scheduler.

``Scheduler.schedule()`` as vLLM documents it: running requests first
(``allocate_slots(request, num_new_tokens, num_lookahead_tokens=...)``; on ``None`` the
lowest-priority running request is preempted with ``free`` and the call retried),
then, when nothing was preempted, waiting requests (``get_computed_blocks``, then
``allocate_slots``; the first ``None`` stops admission), all within a token budget
(chunked prefill). Then the facade's ONE step (``run_step``), the "forward", and
``update_from_output``: computed tokens advance, rejected speculative tokens are
taken back, finished requests are freed. After every iteration: the allocator's
integrity check, page conservation, and exactly one graphalloc step.
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

ROOT = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(eq=False)
class Request:
    """What vLLM's ``Request`` carries that the scheduler below uses."""

    request_id: object
    num_prompt_tokens: int
    max_tokens: int
    num_computed_tokens: int = 0
    num_output_tokens: int = 0

    @property
    def num_tokens(self) -> int:  # prompt + generated (the last one not yet computed)
        return self.num_prompt_tokens + self.num_output_tokens

    def finished(self) -> bool:
        return self.num_output_tokens >= self.max_tokens


def make(ps=4, window=17, n_run=6, budget=32, ctx=160, full=200, swa=90, k=0, rows=None):
    # vLLM allocates the lookahead on prefill chunks too: a row can take budget + k slots
    cfg = ga.AllocatorConfig.for_engine(
        max_running_requests=n_run, chunked_prefill_size=budget + k, max_context_len=ctx,
        page_size=ps, model_sliding_window=window, num_full_pages=full, num_swa_pages=swa,
        num_lookahead_tokens=k, max_reqs=rows or 2 * n_run)
    alloc = ga.HybridAllocator(cfg)
    return alloc, GraphallocKVCacheManager(alloc)


def check_conserved(alloc):
    alloc.check_integrity()
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
    assert live_swa_pos <= cfg.sliding_window + ps + cfg.max_tokens_per_alloc_row
    f_slots, s_slots = mgr.token_slots(req.request_id, 0, length)
    assert (f_slots[::ps] // ps).tolist() == full
    assert (s_slots[::ps] // ps).tolist() == swa
    return first_live


def schedule_loop(mgr, reqs, *, budget, max_seqs, k=0, rng=None, max_iters=600, every=7):
    """vLLM's schedule() / update_from_output() over ``reqs``; returns counters."""
    alloc = mgr.alloc
    waiting, running = deque(reqs), []
    log = dict(iters=0, preempted=0, stopped_admission=0, finished=0, rejected=0,
               max_null_blocks=0)
    for it in range(max_iters):
        if not waiting and not running:
            break
        log["iters"] += 1
        before = alloc.steps_run
        scheduled, tokens_left, preempted = {}, budget, []
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
                mgr.free(victim.request_id)
                victim.num_computed_tokens = 0
                waiting.appendleft(victim)
                preempted.append(victim)
                log["preempted"] += 1
                if victim is req:
                    break
            if blocks is None:
                break
            scheduled[req.request_id] = (req, n)
            tokens_left -= n
            i += 1
        while not preempted and waiting and tokens_left > 0 and len(running) < max_seqs:
            req = waiting[0]
            hit, n_hit = mgr.get_computed_blocks(req.request_id)
            assert n_hit == 0 and hit.num_blocks == 0
            n = min(req.num_tokens - req.num_computed_tokens, tokens_left)
            blocks = mgr.allocate_slots(req.request_id, n, num_lookahead_tokens=k,
                                        num_computed_tokens=req.num_computed_tokens)
            if blocks is None:
                log["stopped_admission"] += 1
                break
            waiting.popleft()
            running.append(req)
            scheduled[req.request_id] = (req, n)
            tokens_left -= n
        mgr.run_step()
        assert alloc.steps_run - before == 1 == mgr.steps_last_run  # ONE step per schedule()
        # the forward ran; update_from_output
        for req, n in scheduled.values():
            was_decoding = req.num_computed_tokens >= req.num_prompt_tokens
            req.num_computed_tokens += n
            assert req.num_computed_tokens <= mgr.num_allocated_tokens(req.request_id)
            if was_decoding and k:  # verify k drafts: accept some, take the rest back
                accepted = int(rng.integers(0, k + 1))
                req.num_computed_tokens -= k - accepted
                req.num_output_tokens += accepted + 1
                log["rejected"] += k - accepted
            elif req.num_computed_tokens >= req.num_tokens:
                req.num_output_tokens += 1
        if it % every == 0:
            for req in running:
                n_null = check_blocks(alloc, mgr, req)
                log["max_null_blocks"] = max(log["max_null_blocks"], n_null)
        for req in [r for r in running if r.finished()]:
            mgr.free(req.request_id)
            running.remove(req)
            log["finished"] += 1
        assert alloc.steps_run - before == 1  # frees are recorded for the next step
        check_conserved(alloc)
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


def test_pressure_preempts_and_stops_admission():
    rng = np.random.default_rng(5)
    alloc, mgr = make(ps=4, full=40, swa=36)
    reqs = [Request(i, int(rng.integers(10, 50)), int(rng.integers(20, 50))) for i in range(10)]
    log = schedule_loop(mgr, reqs, budget=32, max_seqs=6, max_iters=3000)
    assert log["preempted"] > 0 and log["stopped_admission"] > 0
    assert log["finished"] == len(reqs)


def state(alloc, mgr, ids):
    return (alloc.n_free("full"), alloc.n_free("swa"), alloc.n_live, alloc.steps_run,
            mgr.get_num_free_blocks(), len(mgr),
            [(mgr.num_allocated_tokens(i), alloc.frontier(mgr.row_of(i))) for i in ids])


def test_none_is_back_pressure_with_nothing_changed():
    alloc, mgr = make(ps=4, window=9, full=16, swa=12, rows=3, n_run=3)
    assert mgr.allocate_slots("a", 32) is not None  # 8 pages
    mgr.run_step()
    assert mgr.allocate_slots("b", 12) is not None  # 3 pages, recorded
    before = state(alloc, mgr, ["a", "b"])
    # FULL is short for the new request (5 pages free once b is allocated)
    assert mgr.allocate_slots("c", 23) is None  # 6 pages
    assert "c" not in mgr and state(alloc, mgr, ["a", "b"]) == before
    mgr.free("b")  # preempt b: its recorded allocation goes, its row waits for the step
    assert mgr.allocate_slots("c", 16) is not None
    assert mgr.allocate_slots("d", 4) is None  # rows: a, b (pending), c
    mgr.run_step()
    assert alloc.steps_run == before[3] + 1
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
    mgr.free(Key(7))
    mgr.free((1, "a"))
    mgr.free("never-seen")  # unknown ids are a no-op, as vLLM
    mgr.run_step()
    assert len(mgr) == 6 and alloc.n_live == 6
    assert mgr.get_block_ids(Key(7)) == ([], [])
    # dict keys: ids equal under == are one request
    assert mgr.allocate_slots(1, 4) is not None
    assert True in mgr and 1.0 in mgr
    mgr.free(True)
    assert 1 not in mgr
    with pytest.raises(TypeError):
        mgr.allocate_slots(["unhashable"], 1)
    mgr.run_step()
    check_conserved(alloc)


def test_contracts():
    alloc, mgr = make(ps=4)
    with pytest.raises(ValueError, match="greater than 0"):
        mgr.allocate_slots("r", 0)
    with pytest.raises(ga.ContractError, match="not wired"):
        mgr.allocate_slots("r", 4, num_new_computed_tokens=4)
    with pytest.raises(ga.PositionError):
        mgr.allocate_slots("r", 4, num_computed_tokens=4)  # nothing allocated yet
    with pytest.raises(ga.ConfigError, match="not wired"):
        GraphallocKVCacheManager(alloc, enable_caching=True)
    mgr.allocate_slots("r", 8)
    with pytest.raises(ga.PendingStepError):
        mgr.get_block_ids("r")  # recorded, not run
    with pytest.raises(ga.PositionError):
        mgr.token_slots("r", 0, 8)
    mgr.run_step()
    full, swa = mgr.get_block_ids("r")
    assert len(full) == 2 and mgr.token_slots("r", 0, 8)[0].shape == (8,)
    with pytest.raises(ga.BatchTooLargeError):
        mgr.allocate_slots("s", alloc.config.max_tokens_per_alloc_row + 1)
    assert "s" not in mgr
    with pytest.raises(ga.ContractError):
        mgr.row_of("s")
    assert mgr.allocate_slots("np", np.int64(4), num_lookahead_tokens=np.int32(1)).num_blocks == 2
    with pytest.raises(ga.ContractError):
        mgr.allocate_slots("f", 4.0)


def test_example_runs():
    sys.path.insert(0, str(ROOT / "examples"))
    import integrate_vllm

    summary = integrate_vllm.main(["--requests", "8", "--max-seqs", "4", "--quiet"])
    assert summary["finished"] == 8 and summary["steps"] == summary["iterations"]
    assert summary["pages_free_at_end"] == summary["pages_total"]
