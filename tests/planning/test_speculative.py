"""Speculative decoding: lookahead slots, commit, rollback, trim -- one scenario per rule.

Each scenario checks what the rule says against values computed here by hand (page ids,
lengths, free counts), the integrity audit (no page leaked, none held twice, the mapping
page-dense), and, for refusals, that nothing changed (snapshot and stats). The random
interleaving with every other operation is in ``test_model_vs_allocator.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import assert_same_snapshot

from graphalloc import AllocatorConfig, HybridAllocator
from graphalloc import errors as E

PS = 4


def make(ps=PS, window=8, ring=0, handles=0, **kw):
    cfg = AllocatorConfig(page_size=ps, num_full_pages=32, num_swa_pages=32 if not ring else 40,
                          max_reqs=4, max_context_len=64, sliding_window=window,
                          swa_ring_pages=ring, max_handles=handles, device="cpu",
                          backend="torch", index_dtype=torch.int64, **kw)
    return HybridAllocator(cfg)


def pages_of(alloc, row) -> list[int]:
    """The row's FULL page ids, read from the device table (test-only)."""
    ps, n = alloc.config.page_size, alloc.seq_len(row)
    return [int(alloc.req_to_token[row, p * ps]) // ps for p in range(-(-n // ps))]


def healthy(alloc) -> None:
    alloc.check_integrity()
    assert alloc.audit() == []


def prefilled(alloc, n):
    r = alloc.admit()
    alloc.alloc_extend([r], [n])
    return r


def test_rollback_across_a_page_boundary():
    """C = 6, draft 4 (L = 10, a third page); accept 1: L = C = 7, the third page is given
    back in both pools, the second (partial) stays and the next token continues it."""
    a = make()
    r = prefilled(a, 6)
    out = a.alloc_decode([r], lookahead=3)
    assert out.n_tokens.tolist() == [4] and len(out.full_slots) == 4
    assert (a.seq_len(r), a.committed_len(r), a.spec_len(r)) == (10, 6, 4)
    third = pages_of(a, r)[2]
    free_full, free_swa = a.n_free("full"), a.n_free("swa")
    a.commit([r], [1])
    assert (a.seq_len(r), a.committed_len(r), a.spec_len(r)) == (7, 7, 0)
    assert (a.n_free("full"), a.n_free("swa")) == (free_full + 1, free_swa + 1)
    assert a.state.full_free.tolist()[(a.ledger.full.head + a.n_free("full") - 1)
                                      % a.config.num_full_pages] == third
    second = pages_of(a, r)[1]
    nxt = a.alloc_decode([r])
    assert int(nxt.full_slots[0]) == second * PS + 3  # position 7 continues page 1
    healthy(a)


def test_rollback_to_exactly_a_page_boundary():
    """Accepting up to a page boundary frees every page past it; the next token pops."""
    a = make()
    r = prefilled(a, 6)
    a.alloc_decode([r], lookahead=5)  # L = 12: pages 0, 1, 2
    before = a.n_free("full")
    a.commit([r], [2])  # C = 8: two whole pages
    assert a.seq_len(r) == 8 and a.n_free("full") == before + 1
    nxt = a.alloc_decode([r])
    assert a.n_free("full") == before  # position 8 starts a new page
    assert int(nxt.full_slots[0]) % PS == 0
    healthy(a)


def test_all_drafts_rejected_and_all_accepted():
    a = make()
    r, q = prefilled(a, 5), prefilled(a, 5)
    free = a.n_free("full")
    a.step(decode=[r, q], lookahead=6)  # 7 verify tokens each: L = 12, a third page each
    assert a.n_free("full") == free - 2
    a.commit([r, q], [0, 7])  # r: every draft rejected; q: every one accepted
    assert (a.seq_len(r), a.committed_len(r)) == (5, 5)
    assert (a.seq_len(q), a.committed_len(q)) == (12, 12)
    assert a.n_free("full") == free - 1  # r gave its new page back, q kept its own
    healthy(a)


def test_overlap_two_steps_in_flight():
    """Plan step k+1 before step k's accepted counts are known: both stay allocated; the
    commit of step k keeps step k+1's reservation, compacted behind the new committed
    length, and every position the device can touch stays mapped."""
    a = make(ps=4)
    r = prefilled(a, 8)
    k = 2
    a.alloc_decode([r], lookahead=k)  # step k: [8, 11)
    a.alloc_decode([r], lookahead=k)  # step k+1, planned before step k's counts: [11, 14)
    assert a.ledger.spec_steps[r].tolist() == [3, 3]
    with pytest.raises(E.SpeculativeStateError):  # a third step in flight is refused
        a.alloc_decode([r], lookahead=k)
    a.commit([r], [1])  # step k accepted 1: C = 9; step k+1 runs at [9, 12) on the device
    assert (a.committed_len(r), a.seq_len(r)) == (9, 12)
    assert a.ledger.spec_steps[r].tolist() == [3, 0]
    # the reservation rule: every position the in-flight step can write is mapped
    assert (a.req_to_token[r, :12] > 0).all()
    a.commit([r], [3])
    assert (a.committed_len(r), a.seq_len(r), a.spec_len(r)) == (12, 12, 0)
    healthy(a)


def test_trim_below_the_window_is_refused_with_nothing_changed():
    a = make(window=8)
    r = prefilled(a, 20)
    a.evict_window([r])  # frontier floor_page(20 - 8) = 12
    assert a.frontier(r) == 12
    before, stats = a.snapshot(), a.stats()
    with pytest.raises(E.FrontierError):
        a.trim([r], [19])  # 19 < 12 + 8: the window of 19 would need evicted pages
    assert_same_snapshot(before, a.snapshot())
    assert a.stats() == stats
    with pytest.raises(E.PositionError):  # a negative length
        a.trim([r], [-1])
    assert_same_snapshot(before, a.snapshot())
    a.trim([r], [20])  # exactly frontier + window: allowed
    with pytest.raises(E.PositionError):
        a.trim([r], [21])  # a trim only shortens
    healthy(a)


def test_the_window_follows_the_committed_length():
    """Speculative tokens never move the frontier: the window rule reads C, not L."""
    a = make(window=4)
    r = prefilled(a, 8)
    a.step(decode=[r], lookahead=7)  # L = 16, C = 8
    a.evict_window([r])
    assert a.frontier(r) == 4  # floor_page(8 - 4), not floor_page(16 - 4) = 12
    with pytest.raises(E.PositionError):  # an explicit move past floor_page(C) is refused
        a.advance_frontier([r], [12])
    a.commit([r], [0])  # everything rejected: nothing the window needs was evicted
    assert a.seq_len(r) == 8
    healthy(a)


def test_a_round_as_one_step_commit_evict_draft():
    """The engine's round: commit the accepted counts, evict by the window, draft the next
    verify tokens -- one step; the commit's frees and the draft's pops of the same row are
    not fused into one launch (the release must read the table first)."""
    a = make(window=4)
    r = prefilled(a, 6)
    a.alloc_decode([r], lookahead=3)  # [6, 10): pages 1 and 2
    planned = a.plan(commit=([r], [1]), evict=[r], decode=[r], lookahead=3)
    assert not planned.fusable
    out = a.run(planned)
    assert (a.committed_len(r), a.seq_len(r)) == (7, 11)
    assert a.frontier(r) == 0  # floor_page(7 - 4) = 0 with ps 4
    assert out.n_tokens.tolist() == [4]
    healthy(a)


def test_per_row_lookahead_and_lanes():
    a = make()
    r, q = prefilled(a, 3), prefilled(a, 4)
    out = a.step(decode=[q, r], lookahead=[2, 0])
    assert out.rows.tolist() == [q, r] and out.n_tokens.tolist() == [3, 1]
    assert out.first_lane.tolist() == [0, 3]
    assert (a.spec_len(q), a.spec_len(r)) == (3, 1)
    healthy(a)


def test_speculative_refusals_change_nothing():
    a = make()
    r = prefilled(a, 5)
    cases = [
        lambda: a.commit([r], [0]),  # nothing to commit
        lambda: a.step(lookahead=2),  # lookahead without decode rows
    ]
    a2 = make()
    for case in cases:
        before = a.snapshot()
        with pytest.raises(E.SpeculativeStateError):
            case()
        assert_same_snapshot(before, a.snapshot())
    a.alloc_decode([r], lookahead=1)
    for case, err in [(lambda: a.alloc_decode([r]), E.SpeculativeStateError),
                      (lambda: a.alloc_extend([r], [3]), E.SpeculativeStateError),
                      (lambda: a.commit([r], [3]), E.PositionError),
                      (lambda: a.commit([r], [-1]), E.PositionError),
                      (lambda: a.step(commit=[r]), E.ContractError)]:
        before = a.snapshot()
        with pytest.raises(err):
            case()
        assert_same_snapshot(before, a.snapshot())
    with a2.free_group(), pytest.raises(E.NestedGroupError):
        a2.step(trim=([prefilled(a2, 4)], [2]))
    healthy(a)
    healthy(a2)


def test_a_trim_never_frees_a_page_another_holder_references():
    a = make(window=64, handles=2)
    r = prefilled(a, 16)  # four pages
    h = a.take_handle(r, 12)  # the handle holds pages 0..2
    shared = pages_of(a, r)
    free_full, free_swa = a.n_free("full"), a.n_free("swa")
    with pytest.raises(E.SharedPageError):  # the next decode would write shared page 1
        a.trim([r], [5])
    a.trim([r], [8])  # pages 2 and 3 past: page 3 is freed, page 2 is the handle's too
    assert (a.n_free("full"), a.n_free("swa")) == (free_full + 1, free_swa + 1)
    assert a.ledger.full_ref[shared[2]] == 1 and a.ledger.full_ref[shared[3]] == 0
    info = a.handle_info(h)
    assert (info.n_tokens, info.n_full_pages) == (12, 3)
    q = a.admit(handle=h)  # the handle's pages are intact
    assert pages_of(a, q) == shared[:3]
    healthy(a)
    a.alloc_decode([r], lookahead=6)  # L = 14, C = 8
    with pytest.raises(E.PositionError):  # a handle covers committed tokens only
        a.take_handle(r, 12)
    assert a.take_handle(r, 8) >= 0


@pytest.mark.parametrize("ps", [1, 3, 16])
def test_ring_mode_trim_and_commit(ps):
    """Ring mode: a cut frees the FULL pages past the new length and clears their mapping;
    the ring pages stay with the request."""
    cfg = AllocatorConfig(page_size=ps, num_full_pages=40, num_swa_pages=16, max_reqs=2,
                          max_context_len=16 * ps, sliding_window=2 * ps, swa_ring_pages=6,
                          device="cpu", backend="torch")
    a = HybridAllocator(cfg)
    r = a.admit()
    a.alloc_extend([r], [ps + 1])
    free = a.n_free("full")
    a.alloc_decode([r], lookahead=2 * ps)  # 2 ps + 1 tokens: two more pages
    a.commit([r], [0])
    assert a.seq_len(r) == ps + 1 and a.n_free("full") == free
    a.trim([r], [1])
    assert a.n_free("full") == free + 1
    healthy(a)


def test_checkpoint_keeps_the_speculative_state():
    a = make()
    r = prefilled(a, 5)
    a.alloc_decode([r], lookahead=2)
    a.alloc_decode([r], lookahead=1)
    sd = a.state_dict()
    b = make()
    b.load_state_dict(sd)
    assert b.ledger.spec_steps[r].tolist() == [3, 2] and b.committed_len(r) == 5
    b.commit([r], [3])
    assert (b.committed_len(r), b.seq_len(r)) == (8, 10)
    bad = {**sd, "host": {**sd["host"], "committed": np.full_like(sd["host"]["committed"], 99)}}
    with pytest.raises(E.StateError):
        make().load_state_dict(bad)
    healthy(b)


def test_negative_trim_is_refused_before_the_window_rule():
    a = make()
    r = prefilled(a, 5)
    before = a.snapshot()
    with pytest.raises(E.PositionError):
        a.trim([r], [-1])
    assert_same_snapshot(before, a.snapshot())
    healthy(a)
