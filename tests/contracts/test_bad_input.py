"""The bad-input catalogue: each violation raises its typed exception, and nothing changes.

Each case builds an allocator in a known state, snapshots it (every host array
and device table) and its stats, performs one bad call, and checks the
exception type, that every array is identical afterwards, that the stats are
unchanged, and that the allocator still works (a valid step and the integrity
check pass).
"""

from __future__ import annotations

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


PS = 4


def make(ring=0, dtype=torch.int64, **kw) -> HybridAllocator:
    args = dict(page_size=PS, num_full_pages=12, num_swa_pages=12, max_reqs=4,
                max_context_len=32, sliding_window=6, swa_ring_pages=ring, index_dtype=dtype,
                device="cpu", backend="torch", max_handles=0 if ring else 2)
    args.update(kw)
    return HybridAllocator(AllocatorConfig(**args))


def two_requests(**kw):
    """Rows 0 (10 tokens, frontier 4) and 1 (5 tokens); row 2 free; row 3 released."""
    a = make(**kw)
    r, s, _, d = a.admit(), a.admit(), a.admit(), a.admit()
    a.alloc_extend([r, s, d], [10, 5, 1])
    a.advance_frontier([r], [4])
    a.release([2])
    a.release([d])
    return a


def small_two(**kw):
    """Rows 0 and 1 with one token each, allocated one row at a time (tight step shapes)."""
    a = make(**kw)
    for r in (a.admit(), a.admit()):
        a.alloc_decode([r])
    return a


def grouped(*prior):
    """two_requests() with a free_group() left open and ``prior`` calls made inside it; the
    test closes the group after its checks."""
    def setup():
        a = two_requests()
        a.open_group = a.free_group()
        a.open_group.__enter__()
        for call in prior:
            call(a)
        return a
    return setup


def full_pool(**kw):
    a = make(**{"num_full_pages": 3, "num_swa_pages": 12, **kw})
    r = a.admit()
    a.alloc_extend([r], [3 * PS - 1])
    return a


def plan_twice(a):
    a.plan(decode=[0])
    return a


def with_handle(**kw):
    """two_requests() with handle 0 on row 0's first page; handle 1 taken and dropped."""
    a = two_requests(**kw)
    a.take_handle(0, PS)
    a.drop_handle(a.take_handle(0, PS))
    return a


def two_long(**kw):
    """Rows 0 and 1 with 20 tokens (5 pages) each."""
    a = make(**kw)
    r, s = a.admit(), a.admit()
    a.alloc_extend([r], [20])
    a.alloc_extend([s], [20])
    return a


def one_handle(**kw):
    """two_requests() with its only handle held."""
    a = two_requests(max_handles=1, **kw)
    a.take_handle(0, PS)
    return a


# (id, set-up, bad call, exception)
CASES = [
    # alignment
    ("unaligned_frontier", two_requests, lambda a: a.advance_frontier([0], [6]),
     E.AlignmentError),
    ("unaligned_frontier_in_group", grouped(), lambda a: a.advance_frontier([0], [5]),
     E.AlignmentError),
    ("unaligned_frontier_in_step", two_requests, lambda a: a.step(advance=([0], [2])),
     E.AlignmentError),
    ("unaligned_handle", two_requests, lambda a: a.take_handle(0, PS + 1),
     E.AlignmentError),
    # overlap: one request twice in one call, or allocating twice in one step
    ("release_twice_in_call", two_requests, lambda a: a.release([0, 1, 0]), E.OverlapError),
    ("decode_twice_in_call", two_requests, lambda a: a.alloc_decode([1, 1]), E.OverlapError),
    ("extend_twice_in_call", two_requests, lambda a: a.alloc_extend([0, 0], [1, 1]),
     E.OverlapError),
    ("evict_twice_in_call", two_requests, lambda a: a.evict_window([0, 0]), E.OverlapError),
    ("advance_twice_in_call", two_requests, lambda a: a.advance_frontier([0, 0], [8, 8]),
     E.OverlapError),
    ("decode_and_extend_one_step", two_requests,
     lambda a: a.step(decode=[0], extend=([0], [2])), E.OverlapError),
    ("group_release_twice_in_call", grouped(), lambda a: a.release([1, 1]), E.OverlapError),
    ("group_evict_twice_in_call", grouped(), lambda a: a.evict_window([0, 0]),
     E.OverlapError),
    # unknown rows
    ("row_out_of_range", two_requests, lambda a: a.alloc_decode([4]), E.UnknownRequestError),
    ("row_negative", two_requests, lambda a: a.alloc_decode([-1]), E.UnknownRequestError),
    ("free_row_decode", two_requests, lambda a: a.alloc_decode([2]), E.UnknownRequestError),
    ("free_row_evict", two_requests, lambda a: a.evict_window([0, 2]), E.UnknownRequestError),
    ("released_row_extend", two_requests, lambda a: a.alloc_extend([3], [1]),
     E.UnknownRequestError),
    ("released_row_advance", two_requests, lambda a: a.advance_frontier([3], [0]),
     E.UnknownRequestError),
    ("double_release", two_requests, lambda a: a.release([3]), E.UnknownRequestError),
    ("double_release_in_group", grouped(lambda a: a.release([1])),
     lambda a: a.release([1]), E.UnknownRequestError),
    ("evict_after_release_in_group", grouped(lambda a: a.release([1])),
     lambda a: a.evict_window([1]), E.UnknownRequestError),
    ("free_row_in_group", grouped(), lambda a: a.release([2]), E.UnknownRequestError),
    ("released_in_step_then_decoded", two_requests,
     lambda a: a.step(release=[1], decode=[1]), E.UnknownRequestError),
    ("released_in_group_then_decoded", grouped(lambda a: a.release([1])),
     lambda a: a.alloc_decode([1]), E.UnknownRequestError),
    ("released_in_group_then_extended", grouped(lambda a: a.release([0])),
     lambda a: a.alloc_extend([1, 0], [1, 1]), E.UnknownRequestError),
    # non-integer rows
    ("float_rows", two_requests, lambda a: a.alloc_decode([0.0]), E.UnknownRequestError),
    ("bool_rows", two_requests, lambda a: a.release([True]), E.UnknownRequestError),
    ("string_rows", two_requests, lambda a: a.evict_window(["0"]), E.UnknownRequestError),
    ("nested_list_rows", two_requests, lambda a: a.alloc_decode([[0], [1]]),
     E.UnknownRequestError),
    # positions
    ("extend_past_context", two_requests, lambda a: a.alloc_extend([0], [32 - 10 + 1]),
     E.PositionError),
    ("decode_past_context", lambda: full_context(), lambda a: a.alloc_decode([0]),
     E.PositionError),
    ("frontier_past_last_whole_page", two_requests, lambda a: a.advance_frontier([1], [8]),
     E.PositionError),
    ("handle_past_length", two_requests, lambda a: a.take_handle(0, 12), E.PositionError),
    ("handle_empty", two_requests, lambda a: a.take_handle(0, 0), E.PositionError),
    ("negative_tokens", two_requests, lambda a: a.alloc_extend([0, 1], [2, -1]),
     E.PositionError),
    ("rows_and_lengths_differ", two_requests, lambda a: a.alloc_extend([0, 1], [2]),
     E.PositionError),
    ("rows_and_frontiers_differ", two_requests, lambda a: a.advance_frontier([0, 1], [4]),
     E.PositionError),
    # frontier backwards
    ("frontier_backwards", two_requests, lambda a: a.advance_frontier([0], [0]),
     E.FrontierError),
    ("frontier_backwards_in_group", grouped(lambda a: a.advance_frontier([0], [8])),
     lambda a: a.advance_frontier([0], [4]), E.FrontierError),
    ("frontier_past_last_whole_page_in_group", grouped(),
     lambda a: a.advance_frontier([1], [8]), E.PositionError),
    # capacity
    ("capacity_full_pool", full_pool, lambda a: a.alloc_extend([0], [2]), E.CapacityError),
    ("capacity_split_over_rows", two_requests,  # 4 + 4 pages, 7 free
     lambda a: a.alloc_extend([0, 1], [4 * PS, 4 * PS]), E.CapacityError),
    ("capacity_swa_short", lambda: full_pool(num_full_pages=12, num_swa_pages=3),
     lambda a: a.alloc_extend([0], [2]), E.CapacityError),
    ("capacity_rows", lambda: all_rows_taken(), lambda a: a.admit(), E.CapacityError),
    ("capacity_ring_admit", lambda: ring_short(), lambda a: a.admit(), E.CapacityError),
    ("ring_overflow", lambda: ring_full(), lambda a: a.alloc_decode([0]), E.RingOverflowError),
    # groups
    ("nested_group", grouped(), lambda a: a.free_group().__enter__(), E.NestedGroupError),
    ("step_release_in_group", grouped(), lambda a: a.step(release=[1]), E.NestedGroupError),
    ("step_evict_in_group", grouped(), lambda a: a.step(evict_all=True), E.NestedGroupError),
    ("step_advance_in_group", grouped(), lambda a: a.step(advance=([0], [8])),
     E.NestedGroupError),
    # caller tensors
    ("rows_on_meta_device", two_requests,
     lambda a: a.release(torch.tensor([0], device="meta")), E.TensorSpecError),
    ("rows_as_float_tensor", two_requests, lambda a: a.release(torch.tensor([0.0])),
     E.UnknownRequestError),
    # handles
    ("admit_dropped_handle", with_handle, lambda a: a.admit(handle=1), E.UnknownHandleError),
    ("drop_handle_twice", with_handle, lambda a: a.drop_handle(1), E.UnknownHandleError),
    ("handle_out_of_range", with_handle, lambda a: a.drop_handle_swa(7),
     E.UnknownHandleError),
    ("handle_not_an_int", with_handle, lambda a: a.admit(handle=0.0), E.UnknownHandleError),
    ("handle_bool", with_handle, lambda a: a.admit(handle=True), E.UnknownHandleError),
    ("handle_of_dead_row", two_requests, lambda a: a.take_handle(2, PS),
     E.UnknownRequestError),
    ("handles_all_taken", one_handle, lambda a: a.take_handle(0, PS), E.CapacityError),
    ("handle_in_ring_mode", lambda: ring_ready(), lambda a: a.drop_handle(0), E.ContractError),
    # frozen step shape
    ("too_many_decode_rows", lambda: small_two(max_alloc_rows=1),
     lambda a: a.alloc_decode([0, 1]), E.BatchTooLargeError),
    ("too_many_tokens_in_a_row", lambda: small_two(max_tokens_per_alloc_row=3),
     lambda a: a.alloc_extend([1], [4]), E.BatchTooLargeError),
    ("too_many_tokens_in_a_step", lambda: small_two(max_step_tokens=3),
     lambda a: a.alloc_extend([0, 1], [2, 2]), E.BatchTooLargeError),
    # (a combined step is refused; release() alone splits over steps: test_scenarios)
    ("too_many_release_rows", lambda: two_requests(max_release_rows=2),
     lambda a: a.step(release=[0, 1], decode=[]), E.BatchTooLargeError),
    ("too_many_freed_pages", lambda: two_long(max_step_pages=8),
     lambda a: a.step(release=[0, 1]), E.BatchTooLargeError),
    # pending steps
    ("plan_twice", lambda: plan_twice(two_requests()), lambda a: a.plan(decode=[1]),
     E.PendingStepError),
    ("step_while_planned", lambda: plan_twice(two_requests()), lambda a: a.alloc_decode([1]),
     E.PendingStepError),
    ("run_stale_plan", lambda: stale_plan(), lambda a: a.run(a.stale), E.PendingStepError),
    # another allocator's handle: a plan made by a second allocator is not this one's step
    ("run_foreign_plan", two_requests,
     lambda a: a.run(two_requests().plan(decode=[0])), E.PendingStepError),
    ("ring_admit_while_planned", lambda: plan_twice(ring_ready()), lambda a: a.admit(),
     E.PendingStepError),
    ("admit_on_handle_while_planned", lambda: plan_twice(with_handle()),
     lambda a: a.admit(handle=0), E.PendingStepError),
]


def full_context():
    a = make(max_context_len=8)
    r = a.admit()
    a.alloc_extend([r], [8])
    return a


def all_rows_taken():
    a = make(max_reqs=2)
    a.admit()
    a.admit()
    return a


def ring_short():
    a = make(ring=3, num_swa_pages=5)  # ceil(6 / 4) + 1 = 3 ring pages
    a.admit()
    return a


def ring_full():
    a = make(ring=3)
    r = a.admit()
    a.alloc_extend([r], [3 * PS])  # pages 0..2 live: page 3 would reuse ring[0]
    return a


def ring_ready():
    a = make(ring=3)
    a.alloc_extend([a.admit()], [PS + 1])
    return a


def stale_plan():
    a = two_requests()
    a.stale = a.plan(decode=[0])
    a.run(a.stale)
    return a




@pytest.mark.parametrize("setup, action, error", [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_bad_input_raises_typed_error_and_changes_nothing(setup, action, error):
    a = setup()
    before, stats = a.snapshot(), a.stats()
    with pytest.raises(error) as info:
        action(a)
    assert isinstance(info.value, E.ContractError)
    assert str(info.value)  # every error carries a message
    assert_same_snapshot(before, a.snapshot())
    assert a.stats() == stats
    # still usable: close what the set-up left open, then one more step
    if getattr(a, "open_group", None) is not None:
        a.open_group.__exit__(None, None, None)
    if a.pending is not None:
        a.run(a.pending)
    a.check_integrity()
    a.step()
    a.check_integrity()


def test_catalogue_covers_every_contract_error():
    raised = {c[3] for c in CASES}
    expected = {E.AlignmentError, E.OverlapError, E.UnknownRequestError, E.PositionError,
                E.FrontierError, E.CapacityError, E.NestedGroupError, E.TensorSpecError,
                E.BatchTooLargeError, E.PendingStepError, E.RingOverflowError,
                E.UnknownHandleError}
    assert expected <= raised
