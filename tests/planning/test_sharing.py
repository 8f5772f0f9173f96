"""Shared pages: one scenario test per reference-counting rule, values worked out by hand.

Both free lists start as FIFO queues holding pages ``1..N`` in order (pop from the
front, push to the back), so every expected page id follows from the order of
operations. Slot of page p, offset o: ``p * ps + o``. The rules (see tests/lib/model.py):

1. every FULL and SWA page has a reference count; holders are live requests (FULL
   ``[0, L)``, SWA ``[frontier, L)``) and handles (FULL ``[0, n)``, SWA
   ``[swa_start, n)``); a page goes back to its queue only when its last reference
   goes, and a non-last drop changes nothing on the device;
2. eviction / release drop a request's references (window rule
   ``floor_page(max(old, L - W))``);
3. push order of one call: "FULL only" pages first, then "FULL and SWA" / "SWA only";
   rows in call order, pages in position order; a page several rows of the call drop is
   pushed once, in the first such row's segment, with the combined action;
4. a step: releases, drops, evictions, advances, then allocations; take_handle and
   admit(handle) are steps of their own; free_group() decides at the call, pushes at exit;
5. conservation: free + referenced == pool size, page 0 never referenced.

Only the public API is used, plus ``snapshot()``, ``audit()``, ``check_integrity()`` and
(for the corruption test) ``alloc.ledger.full_ref`` / ``alloc.ledger.swa_ref``.
The two hazard scenarios of issue 12 (``test_regression_*``) share pages through
``take_handle`` + ``admit(handle=)`` where the allocator has them and through the old
``admit(prefix_slots)`` where it does not, so they fail on the old code for the hazard
itself, not for a missing method.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from conftest import assert_same_snapshot

import graphalloc
from graphalloc import AllocatorConfig, HybridAllocator
from graphalloc import errors as E


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


HAS_HANDLES = "max_handles" in {f.name for f in dataclasses.fields(AllocatorConfig)}


def make(ps=4, n_full=16, n_swa=16, max_reqs=4, ctx=64, window=4, handles=4, ring=0,
         dtype=torch.int64, **kw) -> HybridAllocator:
    if HAS_HANDLES:
        kw["max_handles"] = handles
    cfg = AllocatorConfig(page_size=ps, num_full_pages=n_full, num_swa_pages=n_swa,
                          max_reqs=max_reqs, max_context_len=ctx, sliding_window=window,
                          swa_ring_pages=ring, index_dtype=dtype, device="cpu",
                          backend="torch", **kw)
    return HybridAllocator(cfg)


def queue(alloc: HybridAllocator, pool: str) -> list[int]:
    """The free list in FIFO order (head first), from a snapshot."""
    snap = alloc.snapshot()
    head, n_free = snap[f"host_{pool}_ring"]
    table = snap[f"{pool}_free"]
    return [int(table[(head + i) % len(table)]) for i in range(n_free)]


def page_map(alloc, full_page) -> list[int]:
    ps = alloc.config.page_size
    return alloc.full_to_swa[full_page * ps:(full_page + 1) * ps].tolist()


def mapped(swa_page, ps) -> list[int]:
    return [swa_page * ps + o for o in range(ps)]


def slots(alloc, row, n) -> list[int]:
    return alloc.req_to_token[row, :n].tolist()


def pages_of(alloc, row) -> list[int]:
    """The FULL pages of a live row, read from req_to_token."""
    ps, n = alloc.config.page_size, alloc.seq_len(row)
    return [int(alloc.req_to_token[row, k * ps]) // ps for k in range(-(-n // ps))]


DEVICE_TABLES = ("full_to_swa", "req_to_token", "full_free", "swa_free", "ring_pages")


def device_view(alloc) -> dict:
    """The device tables and the free rings' positions: what a non-last drop must not
    change."""
    snap = alloc.snapshot()
    return {k: snap[k] for k in DEVICE_TABLES + ("host_full_ring", "host_swa_ring")}


def healthy(alloc) -> None:
    assert alloc.audit() == []
    alloc.check_integrity()


def share(alloc, donor: int, n: int) -> int:
    """A request sharing the first ``n`` tokens of ``donor`` and nothing else: through a
    handle dropped at once (the sharer's references keep the pages), or on an allocator
    without handles through the old ``admit(prefix_slots)``."""
    if hasattr(alloc, "take_handle"):
        h = alloc.take_handle(donor, n)
        row = alloc.admit(handle=h)
        alloc.drop_handle(h)
        return row
    return alloc.admit(alloc.req_to_token[donor, :n].clone())


def info(alloc, h) -> dict:
    i = alloc.handle_info(h)
    return {f: int(getattr(i, f)) for f in ("n_tokens", "swa_start", "n_full_pages",
                                            "n_swa_pages", "frees_full", "frees_swa")}


# ---- rule 1: references; a page returns only with its last reference -----------------------
def test_system_prompt_shared_by_64_requests_finishing_in_random_order():
    ps, prompt, n_req = 4, 12, 64  # a 3-page system prompt
    a = make(ps=ps, n_full=200, n_swa=200, max_reqs=n_req, ctx=32, window=8, handles=1)
    donor = a.admit()
    a.alloc_extend([donor], [prompt])  # pages 1, 2, 3 in both pools
    h = a.take_handle(donor, prompt)
    assert info(a, h) == dict(n_tokens=12, swa_start=0, n_full_pages=3, n_swa_pages=3,
                              frees_full=0, frees_swa=0)
    a.release([donor])  # the handle keeps the prompt: nothing is pushed
    assert queue(a, "full") == list(range(4, 201)) and queue(a, "swa") == list(range(4, 201))
    assert info(a, h)["frees_full"] == 3 and info(a, h)["frees_swa"] == 3
    rng = np.random.default_rng(12)
    rows = [a.admit(handle=h) for _ in range(n_req)]
    assert rows == list(range(n_req))
    for r in rows:
        assert a.seq_len(r) == prompt and a.frontier(r) == 0
        assert slots(a, r, prompt) == list(range(4, 16))
    for r, n in zip(rows, rng.integers(1, 13, size=n_req).tolist(), strict=True):
        a.alloc_extend([r], [n])  # each request's own tokens, on pages of its own
    a.drop_handle(h)  # not the last reference of any page: nothing pushed
    assert len(queue(a, "full")) == 200 - 3 - sum(len(pages_of(a, r)) - 3 for r in rows)
    a.evict_window()  # some requests pass the window: their SWA references of the prompt go
    healthy(a)
    prompt_pages = {1, 2, 3}
    order = rng.permutation(n_req).tolist()
    seen_full: list[int] = []
    seen_swa: list[int] = []
    for i, r in enumerate(order):
        full_before, swa_before = queue(a, "full"), queue(a, "swa")
        own = set(pages_of(a, r)) - prompt_pages
        a.release([r])
        full_new = queue(a, "full")[len(full_before):]
        swa_new = queue(a, "swa")[len(swa_before):]
        seen_full += full_new
        seen_swa += swa_new
        if i < n_req - 1:  # others still hold the prompt: only the request's own pages
            assert set(full_new) == own and len(full_new) == len(own)
        else:  # the last holder: its own pages and the prompt, each once
            assert set(full_new) == own | prompt_pages and len(full_new) == len(own) + 3
        healthy(a)
    # every page pushed exactly once over the whole run, the prompt at the last release
    assert sorted(seen_full) == sorted(set(seen_full))
    assert sorted(seen_swa) == sorted(set(seen_swa))
    assert sorted(queue(a, "full")) == list(range(1, 201))
    assert sorted(queue(a, "swa")) == list(range(1, 201))
    assert a.full_to_swa.tolist() == [0] * (201 * ps)
    assert list(a.live_handles()) == [] and a.stats()["live_requests"] == 0


# ---- rule 2 (hazard 1): the donor's window slides, the sharer's window keeps its pages -----
def test_donor_decodes_far_past_the_window_while_a_sharer_reads_the_shared_pages():
    ps = 4
    a = make(ps=ps, n_full=16, n_swa=16, window=4, ctx=64)
    d = a.admit()
    a.alloc_extend([d], [8])  # FULL 1, 2; SWA 1, 2
    s = share(a, d, 8)  # s: L = 8, frontier 0, positions [0, 8) on pages 1, 2
    assert (a.seq_len(s), a.frontier(s)) == (8, 0)
    view = slots(a, s, 8)
    assert view == list(range(4, 12))
    for _ in range(24):  # the donor decodes to L = 32 and evicts its own window every step
        a.step(evict=[d], decode=[d])
        assert slots(a, s, 8) == view
        assert page_map(a, 1) == mapped(1, ps) and page_map(a, 2) == mapped(2, ps)
        assert not {1, 2} & set(queue(a, "swa")) and not {1, 2} & set(queue(a, "full"))
        healthy(a)
    assert a.frontier(d) == 24  # floor_page(31 - 4): far past the shared pages
    # the donor's own pages that left its window were freed (SWA only), in page order
    assert queue(a, "swa")[-4:] == [3, 4, 5, 6]
    out = a.alloc_decode([s])  # the sharer goes on: position 8 starts a new page
    assert out.full_slots.tolist() == [9 * ps] and out.swa_slots.tolist() == [9 * ps]
    a.evict_window([s])  # L = 9: floor_page(5) = 4, s drops SWA page 1: its last reference
    assert a.frontier(s) == 4
    assert page_map(a, 1) == [0] * ps and page_map(a, 2) == mapped(2, ps)
    assert queue(a, "swa")[-1] == 1 and 1 not in queue(a, "full")  # FULL page 1 kept
    full_before = queue(a, "full")
    a.release([d])  # pages 1, 2 stay (s holds them); the donor's own pages go: FULL only
    # first (3..6, below its frontier 24), then FULL and SWA (7, 8)
    assert queue(a, "full")[len(full_before):] == [3, 4, 5, 6, 7, 8]
    assert queue(a, "swa")[-2:] == [7, 8]
    assert slots(a, s, 8) == view and page_map(a, 2) == mapped(2, ps)
    healthy(a)
    a.release([s])  # the last holder: now pages 1, 2 come back
    # FULL only first (page 1: below s's frontier), then FULL and SWA (pages 2, 9)
    assert queue(a, "full")[-3:] == [1, 2, 9]
    assert queue(a, "swa")[-2:] == [2, 9]
    assert sorted(queue(a, "full")) == list(range(1, 17))
    assert sorted(queue(a, "swa")) == list(range(1, 17))
    healthy(a)


def test_donor_released_while_a_sharer_lives_new_request_gets_other_pages():
    ps = 4
    a = make(ps=ps, n_full=4, n_swa=4, window=16, ctx=32)
    d = a.admit()
    a.alloc_extend([d], [8])  # pages 1, 2
    s = share(a, d, 8)
    a.release([d])  # s still holds pages 1 and 2: nothing pushed
    assert queue(a, "full") == [3, 4] and queue(a, "swa") == [3, 4]
    t = a.admit()
    before = a.snapshot()
    with pytest.raises(E.CapacityError):
        a.alloc_extend([t], [12])  # 3 pages; only 2 are free
    assert_same_snapshot(before, a.snapshot())
    out = a.alloc_extend([t], [8])
    assert out.full_slots.tolist() == list(range(12, 20))  # pages 3 and 4, not 1 and 2
    assert out.swa_slots.tolist() == list(range(12, 20))
    assert slots(a, s, 8) == list(range(4, 12))
    assert page_map(a, 1) == mapped(1, ps) and page_map(a, 2) == mapped(2, ps)
    healthy(a)
    a.release([s])
    assert queue(a, "full") == [1, 2] and queue(a, "swa") == [1, 2]
    healthy(a)


# ---- the two hazards of issue 12, as regression tests (fail on the old code) ----------------
def test_regression_sharer_swa_slots_not_zeroed_when_the_donor_window_slides():
    ps, w = 4, 4
    a = make(ps=ps, n_full=16, n_swa=16, window=w, ctx=64)
    d = a.admit()
    a.alloc_extend([d], [8])
    s = share(a, d, 8)
    a.alloc_decode([s])  # s: L = 9, its window [5, 9) reads position 5..7 on page 2
    window_pages = [2]
    before = {p: page_map(a, p) for p in window_pages}
    assert all(m != [0] * ps for m in before.values())
    for _ in range(16):
        a.step(evict=[d], decode=[d])  # the donor's frontier passes 8
    assert a.frontier(d) >= 8
    for p in window_pages:  # old code: 0 (the donor freed the SWA page s still reads)
        assert page_map(a, p) == before[p], f"sharer's SWA page of full page {p} was freed"
    swa_free = set(queue(a, "swa"))
    assert not {m[0] // ps for m in before.values()} & swa_free
    healthy(a)


def test_regression_donor_release_does_not_hand_the_sharers_pages_to_a_new_request():
    ps = 4
    a = make(ps=ps, n_full=4, n_swa=4, window=16, ctx=32)
    d = a.admit()
    a.alloc_extend([d], [8])
    s = share(a, d, 8)
    shared = set(pages_of(a, s))
    a.release([d])
    t = a.admit()
    try:
        out = a.alloc_extend([t], [16])  # old code: pages 1, 2 (still s's) are handed out
    except E.CapacityError:
        out = a.alloc_extend([t], [8])
    got = {int(x) // ps for x in out.full_slots.tolist()}
    assert not got & shared, f"new request got pages {sorted(got & shared)} the sharer reads"
    assert set(pages_of(a, s)) == shared
    healthy(a)


# ---- a handle dropped twice; unknown handles ------------------------------------------------
def test_handle_dropped_twice_is_refused_with_nothing_changed():
    a = make(ps=2, n_full=8, n_swa=8, window=3, handles=2)
    r = a.admit()
    a.alloc_extend([r], [5])
    h = a.take_handle(r, 4)
    a.drop_handle(h)
    assert issubclass(E.UnknownHandleError, E.ContractError)
    for call in (lambda: a.drop_handle(h), lambda: a.drop_handle_swa(h),
                 lambda: a.handle_info(h), lambda: a.admit(handle=h),
                 lambda: a.drop_handle(1), lambda: a.drop_handle(2), lambda: a.drop_handle(-1),
                 lambda: a.admit(handle=7)):
        before, stats = a.snapshot(), a.stats()
        with pytest.raises(E.UnknownHandleError):
            call()
        assert_same_snapshot(before, a.snapshot())
        assert a.stats() == stats
    assert list(a.live_handles()) == []
    healthy(a)


def test_dropped_handle_id_is_reused_lowest_first_and_slots_are_bounded():
    a = make(ps=2, n_full=8, n_swa=8, window=3, handles=2)
    r = a.admit()
    a.alloc_extend([r], [4])
    assert [a.take_handle(r, 2), a.take_handle(r, 4)] == [0, 1]
    before = a.snapshot()
    with pytest.raises(E.CapacityError):
        a.take_handle(r, 2)  # both slots taken
    assert_same_snapshot(before, a.snapshot())
    a.drop_handle(0)
    assert a.take_handle(r, 4) == 0
    assert sorted(int(x) for x in a.live_handles()) == [0, 1]
    healthy(a)


@pytest.mark.parametrize("n,error", [(3, E.AlignmentError), (0, E.PositionError),
                                     (8, E.PositionError), (-2, E.PositionError)])
def test_take_handle_needs_whole_pages_within_the_length(n, error):
    a = make(ps=2, n_full=8, n_swa=8, window=3, handles=2)
    r = a.admit()
    a.alloc_extend([r], [7])  # whole pages: 6 tokens
    before = a.snapshot()
    with pytest.raises(error):
        a.take_handle(r, n)
    with pytest.raises(E.UnknownRequestError):
        a.take_handle(r + 1, 2)  # not admitted
    assert_same_snapshot(before, a.snapshot())
    assert info(a, a.take_handle(r, 6))["n_tokens"] == 6


# ---- drop_handle_swa: a tombstone; admit on it starts with frontier n ----------------------
def test_tombstoned_handle_admits_a_request_that_must_recompute_its_window():
    ps = 4
    a = make(ps=ps, n_full=16, n_swa=16, window=6, ctx=64)
    d = a.admit()
    a.alloc_extend([d], [12])  # pages 1, 2, 3 (both pools)
    h = a.take_handle(d, 8)
    assert info(a, h) == dict(n_tokens=8, swa_start=0, n_full_pages=2, n_swa_pages=2,
                              frees_full=0, frees_swa=0)
    view = device_view(a)
    a.drop_handle_swa(h)  # d still holds SWA pages 1, 2: nothing changes on the device
    assert_same_snapshot(view, device_view(a))
    assert info(a, h) == dict(n_tokens=8, swa_start=8, n_full_pages=2, n_swa_pages=0,
                              frees_full=0, frees_swa=0)
    s = a.admit(handle=h)
    assert (a.seq_len(s), a.frontier(s)) == (8, 8)  # no SWA page for its last window
    assert slots(a, s, 8) == list(range(4, 12))
    out = a.alloc_decode([s])  # position 8: a new page in both pools
    assert out.full_slots.tolist() == [4 * ps] and out.swa_slots.tolist() == [4 * ps]
    a.evict_window([d])  # L = 12: floor_page(6) = 4: SWA page 1's last reference
    assert queue(a, "swa")[-1] == 1 and page_map(a, 1) == [0] * ps
    assert page_map(a, 2) == mapped(2, ps)
    a.release([d])  # page 2: SWA only (h and s keep FULL); page 3: FULL and SWA
    assert queue(a, "full")[-1] == 3 and queue(a, "swa")[-3:] == [1, 2, 3]
    assert page_map(a, 2) == [0] * ps and page_map(a, 4) == mapped(4, ps)
    assert info(a, h)["frees_full"] == 0  # s holds pages 1, 2 too
    a.release([s])
    assert info(a, h)["frees_full"] == 2 and info(a, h)["frees_swa"] == 0
    assert queue(a, "full")[-2:] == [3, 4]
    a.drop_handle(h)  # FULL only: the tombstone has no SWA page left
    assert queue(a, "full")[-2:] == [1, 2] and queue(a, "swa")[-4:] == [1, 2, 3, 4]
    assert sorted(queue(a, "full")) == list(range(1, 17))
    healthy(a)


# ---- rule 1: a non-last drop touches nothing on the device -----------------------------------
def test_dropping_a_reference_that_is_not_the_last_changes_nothing_on_the_device():
    ps = 2
    a = make(ps=ps, n_full=12, n_swa=12, window=2, ctx=32, handles=3)
    d = a.admit()
    a.alloc_extend([d], [6])  # pages 1, 2, 3
    h1 = a.take_handle(d, 6)
    h2 = a.take_handle(d, 4)
    s = a.admit(handle=h2)  # s: L = 4, pages 1, 2, no page of its own
    for op in (lambda: a.drop_handle_swa(h1),  # d holds those SWA pages
               lambda: a.drop_handle(h2),  # d, s and h1 hold its pages
               lambda: a.evict_window([s]),  # L = 4: frontier 2; d holds SWA page 1
               lambda: a.release([s]),  # d and h1 hold pages 1, 2
               ):
        view = device_view(a)
        op()
        assert_same_snapshot(view, device_view(a))
        healthy(a)
    assert queue(a, "full") == list(range(4, 13)) and queue(a, "swa") == list(range(4, 13))
    a.release([d])  # h1 (a tombstone) keeps FULL 1..3; SWA 1..3 lose their last reference
    assert queue(a, "full") == list(range(4, 13)) and queue(a, "swa")[-3:] == [1, 2, 3]
    assert a.full_to_swa.tolist() == [0] * (13 * ps)
    a.drop_handle(h1)
    assert queue(a, "full")[-3:] == [1, 2, 3]
    healthy(a)


# ---- rule 3: push order ---------------------------------------------------------------------
def test_push_order_two_phases_and_a_page_of_several_rows_pushed_once_in_the_first():
    ps = 2
    a = make(ps=ps, n_full=12, n_swa=12, window=100, ctx=32)
    d = a.admit()
    a.alloc_extend([d], [8])  # d: pages 1, 2, 3, 4 (both pools)
    s = share(a, d, 4)  # s: pages 1, 2
    a.alloc_extend([s], [2])  # s: page 5
    a.advance_frontier([d], [6])  # d drops SWA 1, 2 (s holds them) and SWA 3 (its last)
    assert queue(a, "swa")[-1] == 3 and page_map(a, 1) == mapped(1, ps)
    a.release([d, s])
    # phase 1 (FULL only): d's page 3. Phase 2: d's pages 1, 2 (FULL reaches 0 through d and
    # s, SWA through s: pushed once, in d's segment, FULL and SWA), 4; then s's page 5.
    assert queue(a, "full")[-5:] == [3, 1, 2, 4, 5]
    assert queue(a, "swa")[-5:] == [3, 1, 2, 4, 5]
    assert a.full_to_swa.tolist() == [0] * (13 * ps)
    healthy(a)


def test_push_order_of_an_eviction_is_rows_in_call_order_pages_in_position_order():
    ps = 2
    a = make(ps=ps, n_full=12, n_swa=12, window=2, ctx=32)
    d = a.admit()
    a.alloc_extend([d], [6])  # d: pages 1, 2, 3
    s = share(a, d, 4)  # s: pages 1, 2
    a.alloc_extend([s], [4])  # s: pages 4, 5 (L = 8)
    a.evict_window([s, d])  # s: 8 - 2 = 6: drops SWA 1, 2, 4; d: 6 - 2 = 4: drops SWA 1, 2
    # every count reaches 0 in this call; s is the first row dropping pages 1 and 2, so its
    # segment holds 1, 2 and 4 in position order (not 4, then d's 1, 2), each pushed once
    assert queue(a, "swa")[-3:] == [1, 2, 4]
    assert (a.frontier(s), a.frontier(d)) == (6, 4)
    assert page_map(a, 1) == [0] * ps and page_map(a, 3) == mapped(3, ps)
    healthy(a)


def test_swa_only_page_is_pushed_in_the_segment_of_the_first_row_holding_it():
    """Rule 3 read literally: the first row of the call that held the page (here a FULL
    reference, not the last) decides the segment, not the first row that dropped an SWA
    reference."""
    ps = 2
    a = make(ps=ps, n_full=12, n_swa=8, window=100, ctx=14)
    d = a.admit()
    a.alloc_extend([d], [4])  # d: pages 1, 2
    h = a.take_handle(d, 2)
    s = a.admit(handle=h)  # s: page 1, SWA from 0
    a.advance_frontier([d], [2])  # d drops SWA 1 (h and s hold it)
    a.drop_handle_swa(h)  # h keeps FULL 1
    a.release([d, s])  # page 1: FULL kept by h, SWA 1's last reference (s): "SWA only"
    # d held page 1 (FULL): d's segment, position 0, before d's page 2
    assert queue(a, "swa")[-2:] == [1, 2]
    assert queue(a, "full")[-1:] == [2]
    healthy(a)


# ---- rule 4: steps ---------------------------------------------------------------------------
def test_step_reuses_pages_whose_last_reference_a_release_or_eviction_dropped():
    ps = 2
    a = make(ps=ps, n_full=4, n_swa=3, window=2, ctx=16)
    d = a.admit()
    a.alloc_extend([d], [4])  # pages 1, 2 (both pools)
    s = share(a, d, 4)
    a.alloc_extend([s], [1])  # s: page 3 (both pools): the SWA pool is exhausted
    t = a.admit()
    with pytest.raises(E.CapacityError):
        a.alloc_decode([t])
    # release d (not the last reference of anything), evict s (5 - 2 = 3 -> 2: SWA 1's
    # last reference), then t decodes onto the SWA page freed in this step
    steps = a.steps_run
    out = a.step(release=[d], evict=[s], decode=[t])
    assert a.steps_run == steps + 1
    assert out.full_slots.tolist() == [4 * ps] and out.swa_slots.tolist() == [1 * ps]
    healthy(a)


def test_take_handle_and_admit_on_a_handle_are_steps_of_their_own():
    a = make(ps=2, n_full=8, n_swa=8, window=3)
    r = a.admit()
    assert a.steps_run == 1  # a plain admit is one step (no device work in pool mode)
    a.alloc_extend([r], [4])
    h = a.take_handle(r, 4)
    assert a.steps_run == 3
    s = a.admit(handle=h)
    assert a.steps_run == 4
    assert slots(a, s, 4) == slots(a, r, 4) == [2, 3, 4, 5]
    healthy(a)


def test_free_group_defers_handle_drops_to_its_exit():
    ps = 2
    a = make(ps=ps, n_full=8, n_swa=8, window=3, handles=3)
    r = a.admit()
    a.alloc_extend([r], [4])  # pages 1, 2
    h0, h1 = a.take_handle(r, 2), a.take_handle(r, 4)
    a.release([r])
    stats = a.stats()
    with a.free_group():
        a.drop_handle(h1)  # page 2's last references: deferred
        assert a.stats()["full_free_pages"] == stats["full_free_pages"]
        with pytest.raises(E.UnknownHandleError):
            a.drop_handle(h1)  # dropped in this block
        a.drop_handle(h0)
        assert queue(a, "full") == list(range(3, 9))
    # at the exit, one step whose drops are one drop call (handles in call order): page 1,
    # held by both, is freed in the run of its first holder, h1, before page 2
    assert queue(a, "full") == [3, 4, 5, 6, 7, 8, 1, 2]
    assert queue(a, "swa") == [3, 4, 5, 6, 7, 8, 1, 2]
    assert list(a.live_handles()) == []
    healthy(a)


def test_free_group_handle_dropped_in_the_block_keeps_its_id_until_the_exit():
    a = make(ps=2, n_full=8, n_swa=8, window=3, handles=2)
    r = a.admit()
    a.alloc_extend([r], [4])
    h0, h1 = a.take_handle(r, 2), a.take_handle(r, 4)
    with a.free_group():
        a.drop_handle(h0)
        before = a.snapshot()
        with pytest.raises(E.CapacityError):
            a.take_handle(r, 2)  # slot 0 is freed only at the exit
        assert_same_snapshot(before, a.snapshot())
    assert a.take_handle(r, 2) == h0
    assert sorted(int(x) for x in a.live_handles()) == [h0, h1]
    healthy(a)


def test_free_group_take_handle_sees_the_committed_state_not_the_blocks_eviction():
    """Recorded at the call, applied at the exit: an operation that runs at once inside the
    block (take_handle) sees the committed state (the frontier has not moved yet), so the
    handle holds the SWA page the block's eviction lets go, and the exit frees nothing."""
    ps = 4
    a = make(ps=ps, n_full=10, n_swa=6, window=1, ctx=24)
    r = a.admit()
    a.alloc_extend([r], [8])  # pages 1, 2
    with a.free_group():
        a.evict_window([r])  # 8 - 1 = 7 -> 4: r lets SWA page 1 go at the exit
        assert a.frontier(r) == 0  # the live views: the committed state
        h = a.take_handle(r, 8)
        assert info(a, h)["swa_start"] == 0 and info(a, h)["n_swa_pages"] == 2
    assert a.frontier(r) == 4 and queue(a, "swa") == [3, 4, 5, 6]  # the handle holds page 1
    assert info(a, h) == dict(n_tokens=8, swa_start=0, n_full_pages=2, n_swa_pages=2,
                              frees_full=0, frees_swa=1)
    healthy(a)
    s = a.admit(handle=h)
    assert a.frontier(s) == 0
    healthy(a)


def test_free_group_tombstone_then_drop_of_one_handle():
    """Same rules as outside a block: a handle tombstoned in the block is still live (its
    FULL pages are held), so its info, an admit on it and its drop are accepted."""
    ps = 2
    a = make(ps=ps, n_full=8, n_swa=8, window=3)
    r = a.admit()
    a.alloc_extend([r], [4])  # pages 1, 2
    h = a.take_handle(r, 4)
    a.release([r])
    with a.free_group():
        a.drop_handle_swa(h)  # SWA 1, 2: last references (deferred)
        assert info(a, h)["swa_start"] == 0 and info(a, h)["n_swa_pages"] == 2  # committed
        a.drop_handle_swa(h)  # again: accepted (one tombstone at the exit)
        a.drop_handle(h)  # FULL 1, 2 (deferred); supersedes the tombstone
    assert queue(a, "swa") == [3, 4, 5, 6, 7, 8, 1, 2]
    assert queue(a, "full") == [3, 4, 5, 6, 7, 8, 1, 2]
    healthy(a)


def test_a_free_exceeding_the_step_shape_is_split_not_refused():
    """Rule 4 / the API: a release (like drop_handle) outside a free_group() runs as a block of
    its own: one step when it fits, several consecutive steps when it needs more release rows
    than the frozen shape holds -- never refused for size (no request can be stranded). A
    combined step() with the same frees is refused whole (BatchTooLargeError, nothing
    changed)."""
    a = make(ps=2, n_full=12, n_swa=12, max_reqs=3, ctx=14, window=5, handles=2,
             max_release_rows=4, max_pages_per_row=2, max_alloc_rows=2,
             max_tokens_per_alloc_row=6, max_step_tokens=8, max_step_pages=9)
    r, s = a.admit(), a.admit()
    for row, n in ((r, 5), (s, 5), (r, 5), (s, 1)):
        a.alloc_extend([row], [n])  # r: 10 tokens (pages 1..5), s: 6 tokens (3 pages)
    a.advance_frontier([r, s], [6, 4])
    # rows: r FULL only 3 pages (2 rows) + FULL and SWA 2 (1); s 2 (1) + 1 (1): 5 > 4
    before = a.snapshot()
    with pytest.raises(E.BatchTooLargeError):
        a.step(release=[r, s])
    assert_same_snapshot(before, a.snapshot())
    steps = a.steps_run
    a.release([r, s])
    assert a.steps_run == steps + 2 and a.stats()["live_requests"] == 0
    healthy(a)


# ---- refusals: ring mode, no handle slots ---------------------------------------------------
@pytest.mark.parametrize("handles", [0, 2])
def test_ring_mode_refuses_every_sharing_call(handles):
    """A ring keeps each request's window to itself: no sharing. Handle slots with a ring
    may be refused by the config already (a ConfigError); otherwise every call is."""
    try:
        a = make(ps=2, n_full=12, n_swa=12, window=3, ring=3, handles=handles)
    except E.ConfigError:
        assert handles > 0
        return
    r = a.admit()
    a.alloc_extend([r], [4])
    for call in (lambda: a.take_handle(r, 2), lambda: a.admit(handle=0),
                 lambda: a.drop_handle(0), lambda: a.drop_handle_swa(0),
                 lambda: a.handle_info(0)):
        before, stats = a.snapshot(), a.stats()
        with pytest.raises(E.ContractError):
            call()
        assert_same_snapshot(before, a.snapshot())
        assert a.stats() == stats
    healthy(a)


def test_max_handles_zero_refuses_take_handle():
    a = make(ps=2, n_full=8, n_swa=8, window=3, handles=0)
    r = a.admit()
    a.alloc_extend([r], [4])
    before = a.snapshot()
    with pytest.raises(E.CapacityError):
        a.take_handle(r, 2)
    assert_same_snapshot(before, a.snapshot())
    assert list(a.live_handles()) == []
    healthy(a)


def test_prefix_slots_admit_is_gone():
    a = make(ps=2, n_full=8, n_swa=8, window=3)
    r = a.admit()
    a.alloc_extend([r], [4])
    before = a.snapshot()
    with pytest.raises((TypeError, E.ContractError)):
        a.admit(a.req_to_token[r, :2].clone())  # shared pages without a reference
    with pytest.raises(TypeError):
        a.admit(prefix_slots=a.req_to_token[r, :2].clone())
    assert_same_snapshot(before, a.snapshot())


# ---- rule 5: conservation, and an integrity check that catches a corrupted count ------------
def test_conservation_with_references_over_a_random_sharing_workload():
    """After every operation, per pool: free + referenced == pages, each exactly once;
    page 0 never referenced; every page a window needs is mapped. The handles' pages are
    tracked by the test (read from the donor's row when taken)."""
    ps, n_full, n_swa = 2, 40, 24
    a = make(ps=ps, n_full=n_full, n_swa=n_swa, max_reqs=6, ctx=24, window=3, handles=4)
    rng = np.random.default_rng(5)
    handle_pages: dict[int, list[int]] = {}
    for _ in range(300):
        live = [int(x) for x in a.live_rows()]
        op = rng.integers(0, 8)
        try:
            if op == 0 or not live:
                r = a.admit()
                a.alloc_extend([r], [int(rng.integers(0, 9))])
            elif op == 1:
                r = int(rng.choice(live))
                k = a.seq_len(r) // ps
                if k:
                    n = int(rng.integers(1, k + 1)) * ps
                    h = a.take_handle(r, n)
                    handle_pages[h] = pages_of(a, r)[:n // ps]
            elif op == 2 and handle_pages:
                a.admit(handle=int(rng.choice(list(handle_pages))))
            elif op == 3 and handle_pages:
                h = int(rng.choice(list(handle_pages)))
                if rng.random() < 0.5:
                    a.drop_handle_swa(h)
                else:
                    a.drop_handle(h)
                    del handle_pages[h]
            elif op == 4:
                a.step(evict_all=True, decode=live)
            elif op == 5:
                a.release([int(rng.choice(live))])
            elif op == 6:
                with a.free_group():
                    a.evict_window()
                    a.release(live[:1])
                    if handle_pages:
                        h = min(handle_pages)
                        a.drop_handle(h)
                        del handle_pages[h]
            else:
                a.alloc_extend(live, rng.integers(0, 3, size=len(live)).tolist())
        except (E.CapacityError, E.PositionError):  # pools, rows, handle slots, context
            pass
        assert sorted(int(x) for x in a.live_handles()) == sorted(handle_pages)
        full_held, swa_held = set(), set()
        f2s = a.full_to_swa.tolist()
        for r in (int(x) for x in a.live_rows()):
            pages = pages_of(a, r)
            full_held |= set(pages)
            window = pages[a.frontier(r) // ps:]
            assert all(f2s[p * ps] > 0 for p in window), "a window page has no SWA page"
            swa_held |= {f2s[p * ps] // ps for p in window}
        for h, pages in handle_pages.items():
            full_held |= set(pages)
            tail = pages[info(a, h)["swa_start"] // ps:]
            assert all(f2s[p * ps] > 0 for p in tail)
            swa_held |= {f2s[p * ps] // ps for p in tail}
        free_full, free_swa = queue(a, "full"), queue(a, "swa")
        assert 0 not in full_held and 0 not in swa_held
        assert sorted(list(full_held) + free_full) == list(range(1, n_full + 1))
        assert sorted(list(swa_held) + free_swa) == list(range(1, n_swa + 1))
        assert a.audit() == []
    a.check_integrity()


def _shared_state():
    ps = 2
    a = make(ps=ps, n_full=10, n_swa=10, window=3, handles=2)
    d = a.admit()
    a.alloc_extend([d], [6])  # pages 1, 2, 3
    h = a.take_handle(d, 4)
    a.admit(handle=h)
    healthy(a)
    return a


@pytest.mark.parametrize("pool,page,delta", [("full", 1, +1), ("full", 2, -1), ("full", 3, -1),
                                             ("full", 5, +1), ("swa", 1, -1), ("swa", 3, +1),
                                             ("full", 0, +1), ("swa", 0, +1)])
def test_integrity_check_fails_when_a_reference_count_is_corrupted(pool, page, delta):
    """The counts live in ``alloc.ledger.full_ref`` / ``alloc.ledger.swa_ref`` (numpy int
    arrays indexed by page id). One count off by one anywhere -- a shared page, a page of
    one holder, a free page, the sink -- must make audit() report it and
    check_integrity() raise."""
    a = _shared_state()
    refs = a.ledger.full_ref if pool == "full" else a.ledger.swa_ref
    assert isinstance(refs, np.ndarray) and refs[0] == 0
    refs[page] += delta
    findings = a.audit()
    assert findings, f"corrupted {pool} count of page {page} not reported"
    with pytest.raises(graphalloc.IntegrityError):
        a.check_integrity()
    refs[page] -= delta
    healthy(a)


def test_two_rows_loading_back_one_shared_page_in_one_step_are_refused():
    """Rule: a FULL page is paired with one SWA page at a time, so a load-back re-pairs only
    pages nobody maps (code 33). Two rows sharing a FULL page that both load it back in one
    step would each pop a fresh SWA page for it -- the second pairing overwriting the
    first, one SWA page lost and the other counted once for two holders (found by the
    compiled twin's random steps). Refused, nothing changed; one row at a time works, and
    the other is then refused (its page is mapped)."""
    a = make(ps=4, n_full=32, n_swa=16, window=4)
    r = a.admit()
    a.alloc_extend([r], [16])
    s = share(a, r, 16)  # the four FULL pages shared, the SWA ones too
    a.alloc_extend([r, s], [4, 4])
    a.evict_window()
    assert a.frontier(r) == a.frontier(s) == 16
    before = a.snapshot()
    with pytest.raises(E.ContractError, match="another row of this step loads it back"):
        a.step(load_back=([r, s], [12, 12]))
    assert_same_snapshot(before, a.snapshot())
    a.load_back(r, 12)
    with pytest.raises(E.ContractError, match="still has an SWA page"):
        a.load_back(s, 12)
    healthy(a)
