"""One test per allocator rule, with expected values worked out from the rules by hand.

Both free lists start as FIFO queues holding pages ``1..N`` in order (pop from the
front, push to the back), so every expected page id below follows from the
order of operations. Slot of page p, offset o: ``p * ps + o``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import assert_same_snapshot

from graphalloc import AllocatorConfig, HybridAllocator
from graphalloc import errors as E


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def make(ps=4, n_full=8, n_swa=8, max_reqs=4, ctx=32, window=4, ring=0,
         dtype=torch.int64, **kw) -> HybridAllocator:
    cfg = AllocatorConfig(page_size=ps, num_full_pages=n_full, num_swa_pages=n_swa,
                          max_reqs=max_reqs, max_context_len=ctx, sliding_window=window,
                          swa_ring_pages=ring, index_dtype=dtype, device="cpu",
                          backend="torch", **kw)
    return HybridAllocator(cfg)


def queue(alloc: HybridAllocator, pool: str) -> list[int]:
    """The free list in FIFO order (head first), read from the device ring."""
    ring = alloc.ledger.full if pool == "full" else alloc.ledger.swa
    table = (alloc.state.full_free if pool == "full" else alloc.state.swa_free).tolist()
    return [table[(ring.head + i) % len(table)] for i in range(ring.n_free)]


def slots(alloc, row, n) -> list[int]:
    return alloc.req_to_token[row, :n].tolist()


def page_map(alloc, full_page) -> list[int]:
    ps = alloc.config.page_size
    return alloc.full_to_swa[full_page * ps:(full_page + 1) * ps].tolist()


def mapped(swa_page, ps) -> list[int]:
    return [swa_page * ps + o for o in range(ps)]


def snap_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        np.array_equal(v, b[k]) if isinstance(v, np.ndarray) else v == b[k]
        for k, v in a.items())


def test_partial_tail_page_is_released_whole():
    a = make(ps=4, n_full=5, n_swa=5)
    r = a.admit()
    out = a.alloc_extend([r], [6])  # pages 0 (full) and 1 (2 of 4 tokens)
    assert out.full_slots.tolist() == [4, 5, 6, 7, 8, 9]
    assert out.swa_slots.tolist() == [4, 5, 6, 7, 8, 9]
    assert page_map(a, 2) == mapped(2, 4)  # the tail page is mapped whole at its first token
    a.release([r])
    assert queue(a, "full") == [3, 4, 5, 1, 2]
    assert queue(a, "swa") == [3, 4, 5, 1, 2]
    assert a.full_to_swa.tolist() == [0] * (6 * 4)
    a.check_integrity()


def test_zero_new_page_extend_succeeds_with_no_free_page():
    a = make(ps=4, n_full=1, n_swa=1)
    r = a.admit()
    a.alloc_extend([r], [1])
    assert a.stats()["full_free_pages"] == 0 and a.stats()["swa_free_pages"] == 0
    out = a.alloc_extend([r], [3])  # continues page 1: no pop
    assert out.full_slots.tolist() == [5, 6, 7] and out.swa_slots.tolist() == [5, 6, 7]
    out = a.alloc_extend([r], [0])  # zero tokens
    assert out.n_tokens.tolist() == [0] and len(out.full_slots) == 0
    before = a.snapshot()
    with pytest.raises(E.CapacityError):
        a.alloc_decode([r])  # position 4 starts a page
    assert snap_equal(before, a.snapshot())
    a.check_integrity()


@pytest.mark.parametrize("short", ["full", "swa"])
@pytest.mark.parametrize("ps", [1, 3, 16])
def test_exact_capacity_succeeds_one_page_over_is_refused(short, ps):
    cap = 3  # an SWA pool of 3 pages serves a window of up to 2 pages (ceil(W / ps) + 1)
    a = make(ps=ps, n_full=cap if short == "full" else 7, n_swa=cap if short == "swa" else 7,
             ctx=8 * ps, window=2 * ps)
    r, s = a.admit(), a.admit()
    before, stats = a.snapshot(), a.stats()
    # one page over, split across two requests (refused whole: nothing allocated for r either)
    with pytest.raises(E.CapacityError):
        a.alloc_extend([r, s], [2 * ps, cap * ps - 2 * ps + 1])
    with pytest.raises(E.CapacityError):
        a.alloc_extend([r], [cap * ps + 1])
    assert snap_equal(before, a.snapshot()) and a.stats() == stats
    out = a.alloc_extend([r, s], [2 * ps, cap * ps - 2 * ps])  # exactly the free pages
    assert out.full_slots.tolist() == list(range(ps, (cap + 1) * ps))
    assert a.stats()[f"{short}_free_pages"] == 0
    assert a.stats()["full_free_pages"] == (0 if short == "full" else 7 - cap)
    a.check_integrity()


@pytest.mark.parametrize("ps", [1, 3, 4])
def test_decode_pops_a_page_only_at_page_start(ps):
    a = make(ps=ps, n_full=6, n_swa=6, ctx=6 * ps)
    r = a.admit()
    for t in range(3 * ps + 1):
        free_before = a.stats()["full_free_pages"]
        out = a.alloc_decode([r])
        page = t // ps + 1  # pages are popped 1, 2, 3, ... in FIFO order
        assert out.full_slots.tolist() == [page * ps + t % ps]
        assert out.swa_slots.tolist() == [page * ps + t % ps]
        assert free_before - a.stats()["full_free_pages"] == (1 if t % ps == 0 else 0)
        assert a.stats()["swa_free_pages"] == a.stats()["full_free_pages"]
    a.check_integrity()


def test_eviction_frees_whole_pages_clears_mapping_keeps_full_slots():
    a = make(ps=4, n_full=6, n_swa=6, window=5)
    r = a.admit()
    a.alloc_extend([r], [14])  # pages 1..4 (page 4 holds positions 12, 13)
    a.evict_window([r])  # L - W = 9, floor to the page: 8. Position 8 keeps its SWA slot
    assert a.stats()["frontier"] == {r: 8}
    assert queue(a, "swa") == [5, 6, 1, 2]  # SWA pages of positions [0, 8), in page order
    assert queue(a, "full") == [5, 6]  # FULL pages stay
    assert slots(a, r, 14) == list(range(4, 18))
    assert page_map(a, 1) == [0] * 4 and page_map(a, 2) == [0] * 4
    assert page_map(a, 3) == mapped(3, 4) and page_map(a, 4) == mapped(4, 4)
    a.evict_window([r])  # nothing more to free
    assert a.stats()["frontier"] == {r: 8} and queue(a, "swa") == [5, 6, 1, 2]
    a.alloc_extend([r], [3])  # L = 17: L - W = 12
    a.evict_window()
    assert a.stats()["frontier"] == {r: 12}
    assert queue(a, "swa") == [6, 1, 2, 3]
    a.check_integrity()


def test_short_request_is_not_evicted():
    a = make(ps=2, window=8)
    r = a.admit()
    a.alloc_extend([r], [7])  # L - W < 0
    a.evict_window()
    assert a.stats()["frontier"] == {r: 0} and a.stats()["swa_free_pages"] == 8 - 4


def test_shared_prefix_by_handle():
    """A request admitted on a handle shares the donor's pages (same slots, same SWA pages),
    evicts by the plain window rule, and its release frees only what nobody else holds."""
    ps, w = 4, 1
    a = make(ps=ps, n_full=12, n_swa=12, window=w, ctx=24, max_handles=2)
    src = a.admit()
    a.alloc_extend([src], [12])  # pages 1, 2, 3
    h = a.take_handle(src, 8)  # pages 1 and 2, shared
    b = a.admit(handle=h)
    c = a.admit()
    assert a.stats()["seq_len"][b] == 8 and a.stats()["frontier"][b] == 0
    assert slots(a, b, 8) == slots(a, src, 8)
    a.alloc_extend([b, c], [5, 13])  # both at L = 13; b pops pages 4, 5; c pops 6..9
    assert slots(a, b, 13) == list(range(4, 12)) + [16, 17, 18, 19, 20]
    # the plain window rule for both: L - W = 12 -> 12
    a.evict_window([b, c])
    assert a.stats()["frontier"][b] == 12 and a.stats()["frontier"][c] == 12
    # b dropped its SWA refs of pages 1, 2 (src and the handle still hold them) and 4 (its
    # own): only 4's SWA page is freed; c's pages 6, 7, 8 too
    assert queue(a, "swa")[-4:] == [4, 6, 7, 8]
    assert page_map(a, 1) == mapped(1, ps) and page_map(a, 2) == mapped(2, ps)
    # release frees b's own pages (4, 5) but not the shared ones
    full_before = queue(a, "full")
    a.release([b])
    assert queue(a, "full") == full_before + [4, 5]
    a.release([src])
    assert queue(a, "full") == full_before + [4, 5, 3]  # pages 1, 2: the handle holds them
    a.drop_handle(h)
    assert queue(a, "full") == full_before + [4, 5, 3, 1, 2]
    a.check_integrity()


def test_handle_frontier_is_the_donors_when_taken_even_with_huge_window():
    """A handle holds the SWA pages of [min(frontier, n), n): taken after the donor freed
    the SWA of its first 4 positions, its sharer starts with frontier 4 and a huge window
    never moves it back."""
    a = make(ps=2, window=100, ctx=20, max_handles=1)
    src = a.admit()
    a.alloc_extend([src], [6])
    a.advance_frontier([src], [4])
    b = a.admit(handle=a.take_handle(src, 4))
    a.alloc_extend([b], [1])
    a.evict_window()
    assert a.stats()["frontier"] == {src: 4, b: 4}
    a.check_integrity()


def test_release_splits_at_the_frontier():
    ps = 2
    a = make(ps=ps, n_full=12, n_swa=12, window=3, ctx=20)
    r, s = a.admit(), a.admit()
    a.alloc_extend([r, s], [9, 5])  # r: pages 1..5, s: pages 6..8 (SWA the same ids)
    a.evict_window()  # r: 9 - 3 = 6 -> pages [0, 3) freed; s: 5 - 3 = 2 -> page [0, 1)
    assert a.stats()["frontier"] == {r: 6, s: 2}
    assert queue(a, "swa") == [9, 10, 11, 12, 1, 2, 3, 6]
    a.release([s, r])
    # FULL: below the frontier of each row in call order, then at/after it of each row
    assert queue(a, "full") == [9, 10, 11, 12, 6, 1, 2, 3, 7, 8, 4, 5]
    # SWA: the peers of the pages at/after the frontier, in the same order
    assert queue(a, "swa") == [9, 10, 11, 12, 1, 2, 3, 6, 7, 8, 4, 5]
    assert a.full_to_swa.tolist() == [0] * (13 * ps)
    a.check_integrity()


def test_retract_mid_way_frees_everything_and_rows_are_reused():
    a = make(ps=3, n_full=6, n_swa=6, max_reqs=2, ctx=12)
    r, s = a.admit(), a.admit()
    a.alloc_extend([r, s], [4, 2])  # r: pages 1, 2; s: page 3
    with pytest.raises(E.CapacityError):
        a.admit()
    a.release([r])  # retracted with a partial page
    assert a.admit() == r  # the lowest free row
    out = a.alloc_decode([s, r])  # s continues page 3; r pops page 4, the FIFO front
    assert out.full_slots.tolist() == [3 * 3 + 2, 4 * 3]
    out = a.alloc_extend([r], [5])  # page 4 continued (positions 1, 2), then page 5
    assert out.full_slots.tolist() == [13, 14, 15, 16, 17]
    out = a.alloc_extend([r], [4])  # page 6, then page 1: r's old page, pushed back
    assert out.full_slots.tolist() == [18, 19, 20, 3]
    assert queue(a, "full") == [2]
    a.check_integrity()


class TestRingMode:
    def make(self, **kw):
        return make(ps=2, n_full=12, n_swa=8, window=3, ring=3, ctx=20, **kw)

    def test_ring_pages_and_slots(self):
        a = self.make()
        r = a.admit()  # pops the ring: SWA pages 1, 2, 3
        assert a.steps_run == 1 and queue(a, "swa") == [4, 5, 6, 7, 8]
        assert a.state.ring_pages[r, :3].tolist() == [1, 2, 3]
        out = a.alloc_extend([r], [6])  # pages 0, 1, 2 -> ring[0], ring[1], ring[2]
        assert out.swa_slots.tolist() == [2, 3, 4, 5, 6, 7]
        assert a.stats()["swa_free_pages"] == 5  # no SWA page popped by allocation
        with pytest.raises(E.RingOverflowError):
            a.alloc_extend([r], [1])  # page 3 would reuse ring[0] while page 0 is mapped
        a.evict_window()  # 6 - 3 = 3 -> 2: page 0 unmapped, nothing pushed
        assert a.stats()["frontier"] == {r: 2} and queue(a, "swa") == [4, 5, 6, 7, 8]
        assert page_map(a, 1) == [0, 0]
        out = a.alloc_decode([r])  # position 6: page 3 -> ring[3 % 3] = SWA page 1
        assert out.full_slots.tolist() == [4 * 2] and out.swa_slots.tolist() == [1 * 2]
        assert page_map(a, 4) == mapped(1, 2)
        a.check_integrity()

    def test_evict_in_the_same_step_makes_room(self):
        a = self.make()
        r = a.admit()
        a.alloc_extend([r], [6])
        out = a.step(evict_all=True, decode=[r])
        assert out.swa_slots.tolist() == [2]
        a.check_integrity()

    def test_release_returns_the_ring(self):
        a = self.make()
        r, s = a.admit(), a.admit()  # rings [1, 2, 3] and [4, 5, 6]
        a.alloc_extend([r, s], [5, 2])
        a.evict_window()  # r: 5 - 3 = 2 -> 2
        a.release([s, r])
        # FULL: r below [1]; then s [4], r [2, 3]; SWA: the rings, whole, in call order
        assert queue(a, "full")[-4:] == [1, 4, 2, 3]
        assert queue(a, "swa") == [7, 8, 4, 5, 6, 1, 2, 3]
        assert a.full_to_swa.tolist() == [0] * (13 * 2)
        a.check_integrity()

    def test_admit_needs_a_whole_ring(self):
        a = make(ps=2, n_full=12, n_swa=7, window=3, ring=3, ctx=20)
        a.admit()
        a.admit()
        before = a.snapshot()
        with pytest.raises(E.CapacityError):
            a.admit()
        assert snap_equal(before, a.snapshot())


class TestFreeGroup:
    def test_deferred_until_exit_and_one_step(self):
        a = make(ps=2, n_full=12, n_swa=12, window=2)
        r, s, t = a.admit(), a.admit(), a.admit()
        a.alloc_extend([r, s, t], [4, 4, 5])  # r: 1, 2; s: 3, 4; t: 5, 6, 7
        steps, stats = a.steps_run, a.stats()
        with a.free_group():
            a.release([r])
            a.evict_window()  # every live request not released in the block: s and t
            a.release([s])
            assert a.stats() == stats and a.steps_run == steps  # capacity unchanged
            with pytest.raises(E.UnknownRequestError):
                a.release([r])  # already released in this block
            with pytest.raises(E.UnknownRequestError):
                a.alloc_decode([s])  # released in this block: cannot allocate
            assert a.admit() == 3  # rows released in the block are not handed out yet
        assert a.steps_run == steps + 2  # the admit (one step), then the block's one step
        # the block is one step in the step's order: the releases (r, s: s's release
        # supersedes its eviction), then the frontier moves (t's SWA page [0, 2))
        assert queue(a, "full") == [8, 9, 10, 11, 12, 1, 2, 3, 4]
        assert queue(a, "swa") == [8, 9, 10, 11, 12, 1, 2, 3, 4, 5]
        assert a.stats()["frontier"] == {t: 2, 3: 0}
        a.check_integrity()

    def test_request_boundaries_are_kept(self):
        a = make(ps=4, n_full=8, n_swa=8, window=4)
        r, s = a.admit(), a.admit()
        a.alloc_extend([r, s], [6, 6])  # equal relative positions: r 1, 2; s 3, 4
        with a.free_group():
            a.release([r])
            a.release([s])
        assert queue(a, "full") == [5, 6, 7, 8, 1, 2, 3, 4]
        assert queue(a, "swa") == [5, 6, 7, 8, 1, 2, 3, 4]
        assert a.stats()["live_requests"] == 0
        a.check_integrity()

    def test_nesting_raises(self):
        a = make()
        r = a.admit()
        a.alloc_extend([r], [5])
        with a.free_group():
            with pytest.raises(E.NestedGroupError):
                with a.free_group():
                    pass
            with pytest.raises(E.NestedGroupError):
                a.step(release=[r])
            a.release([r])  # the outer block is still open and working
        assert a.stats()["live_requests"] == 0
        a.check_integrity()

    def test_a_block_that_raises_runs_nothing(self):
        """A block is a transaction (as a scheduler_step() block): an exception escaping it
        discards what it recorded, so nothing is half done and no page is lost (the rows
        are still live and can be released again)."""
        a = make(ps=2)
        r, s = a.admit(), a.admit()
        a.alloc_extend([r, s], [3, 3])
        steps, before = a.steps_run, a.snapshot()
        with pytest.raises(KeyError):
            with a.free_group():
                a.release([r])
                raise KeyError("boom")
        assert a.steps_run == steps
        assert_same_snapshot(before, a.snapshot())
        a.release([r, s])
        assert a.stats()["full_free_pages"] == 8
        a.check_integrity()

    def test_advance_behind_an_earlier_eviction_in_the_block(self):
        """A deferred eviction is decided at its call (as outside a block), so an advance
        behind it is a backward move, refused with nothing changed, and the block's other
        frees are still flushed."""
        a = make(ps=2, n_full=16, n_swa=16, window=3, ctx=20)
        r, s = a.admit(), a.admit()
        a.alloc_extend([r, s], [10, 4])
        with a.free_group():
            a.release([s])
            a.evict_window([r])  # moves r's frontier to 6 (at the call: window rule)
            with pytest.raises(E.FrontierError):
                a.advance_frontier([r], [2])  # behind the eviction: a backward move
            a.advance_frontier([r], [6])  # where it already is: no page, allowed
        assert a.stats()["live_requests"] == 1  # the release was not lost
        assert a.stats()["frontier"] == {r: 6}
        a.check_integrity()

    def test_advances_accumulate_in_the_block(self):
        a = make(ps=2, n_full=16, n_swa=16, ctx=20)
        r = a.admit()
        a.alloc_extend([r], [9])
        with a.free_group():
            a.advance_frontier([r], [2])
            with pytest.raises(E.FrontierError):
                a.advance_frontier([r], [0])  # behind the pending advance
            with pytest.raises(E.PositionError):
                a.advance_frontier([r], [10])  # past the last whole page (8)
            a.advance_frontier([r], [6])
        assert a.stats()["frontier"] == {r: 6} and queue(a, "swa")[-3:] == [1, 2, 3]
        a.check_integrity()


def test_pages_freed_by_a_step_are_allocated_by_it():
    a = make(ps=2, n_full=2, n_swa=2)
    r, s = a.admit(), a.admit()
    a.alloc_extend([r], [3])  # both pools exhausted
    before = a.snapshot()
    with pytest.raises(E.CapacityError):
        a.alloc_decode([s])
    assert snap_equal(before, a.snapshot())
    steps = a.steps_run
    out = a.step(release=[r], decode=[s])  # r's pages are pushed, then popped: page 1 first
    assert a.steps_run == steps + 1
    assert out.full_slots.tolist() == [2] and out.swa_slots.tolist() == [2]
    assert queue(a, "full") == [2] and queue(a, "swa") == [2]
    a.check_integrity()


def test_swa_pages_evicted_by_a_step_are_allocated_by_it():
    a = make(ps=2, n_full=6, n_swa=3, window=2)
    r, s = a.admit(), a.admit()
    a.alloc_extend([r], [5])  # SWA pool exhausted
    with pytest.raises(E.CapacityError):
        a.alloc_decode([s])
    out = a.step(evict=[r], decode=[s])  # 5 - 2 = 3 -> 2: SWA page 1 is freed and reused
    assert out.full_slots.tolist() == [4 * 2] and out.swa_slots.tolist() == [1 * 2]
    a.check_integrity()


def test_fifo_order_when_free_pages_remain():
    a = make(ps=2, n_full=4, n_swa=4)
    r, s = a.admit(), a.admit()
    a.alloc_extend([r], [2])  # page 1
    out = a.step(release=[r], decode=[s])  # queue [2, 3, 4, 1]: s pops 2, not r's page
    assert out.full_slots.tolist() == [4]
    assert queue(a, "full") == [3, 4, 1]


def test_decode_and_extend_rows_pop_in_call_order():
    a = make(ps=2, n_full=10, n_swa=10)
    r, s, t = a.admit(), a.admit(), a.admit()
    out = a.step(decode=[t, r], extend=([s], [3]))
    # decode rows first, in the order given: t page 1, r page 2; then s pages 3, 4
    assert out.rows.tolist() == [t, r, s]
    assert out.full_slots.tolist() == [2, 4, 6, 7, 8]
    assert out.swa_slots.tolist() == [2, 4, 6, 7, 8]
    assert slots(a, s, 3) == [6, 7, 8]


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_free_ring_wraps_around(dtype):
    a = make(ps=1, n_full=3, n_swa=3, ctx=3, window=1, dtype=dtype)
    expected = [1, 2, 3]
    for _ in range(5):
        r = a.admit()
        out = a.alloc_extend([r], [2])
        assert out.full_slots.tolist() == expected[:2]
        a.release([r])
        expected = expected[2:] + expected[:2]
        assert queue(a, "full") == expected
    assert a.state.full_free.dtype == dtype
    a.check_integrity()


def test_free_group_flush_larger_than_one_step_is_split_not_dropped():
    """Ring mode: evict + release of every request needs more release rows than one
    frozen step holds; the flush splits into several steps and frees everything."""
    cfg = AllocatorConfig(page_size=2, num_full_pages=64, num_swa_pages=64, max_reqs=4,
                          max_context_len=32, sliding_window=3, swa_ring_pages=3,
                          max_release_rows=6)
    a = HybridAllocator(cfg)
    rows = [a.admit() for _ in range(4)]
    a.alloc_extend(rows, [5, 5, 5, 5])
    before = a.steps_run
    with a.free_group():
        a.evict_window()
        a.release(rows)  # supersedes the evictions
    assert a.steps_run - before > 1  # split: 12 release rows > 6 per step
    assert a.stats()["live_requests"] == 0
    assert a.stats()["full_free_pages"] == 64 and a.stats()["swa_free_pages"] == 64
    a.check_integrity()


def test_step_evict_row_zero_inside_group_is_refused():
    a = HybridAllocator(AllocatorConfig(page_size=2, num_full_pages=8, num_swa_pages=8,
                                        max_reqs=2, max_context_len=16, sliding_window=3))
    r = a.admit()
    a.alloc_extend([r], [6])
    with a.free_group():
        with pytest.raises(E.NestedGroupError):
            a.step(evict=0)  # row 0, not "no eviction"
        a.step(evict=[])  # nothing to evict: allowed
    assert a.ledger.frontier[r] == 0


def test_release_larger_than_one_step_is_split_not_refused():
    """release() of requests whose pages exceed the frozen step shape runs as several steps
    (every page returned once, in order); a combined step() with them is refused whole."""
    a = make(ps=2, n_full=24, n_swa=24, max_reqs=3, ctx=20, window=3,
             max_step_pages=10, max_release_rows=4)
    r, s = a.admit(), a.admit()
    a.alloc_extend([r], [20])
    a.alloc_extend([s], [20])
    before = a.snapshot()
    with pytest.raises(E.BatchTooLargeError):
        a.step(release=[r, s])
    assert_same_snapshot(before, a.snapshot())
    full_before, steps = queue(a, "full"), a.steps_run
    pages = [int(a.req_to_token[q, p * 2]) // 2 for q in (r, s) for p in range(10)]
    a.release([r, s])
    assert a.steps_run - steps == 2  # 20 pages, 10 a step
    assert queue(a, "full") == full_before + pages
    assert a.n_free("full") == 24 and a.n_free("swa") == 24
    a.check_integrity()
