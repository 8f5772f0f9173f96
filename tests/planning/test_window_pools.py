"""Models with several window pools (issue 31): two sliding windows of different sizes, a
sliding window beside chunked local attention.

The state machine (``test_model_vs_allocator``, configurations ``*two_windows*``,
``ps3_window_chunked``, ``ps2_three_windows``) compares them with the model step by step;
here: what the config accepts and refuses, who plans them, each pool's own rule at work, the
refusals that name a further pool, a free that needs more steps for a further pool's
section than for the main one, the prefix cache's window check, checkpoints, and the random
workload (tests/lib/workload.py) with a full audit after every operation.
"""

from __future__ import annotations

import numpy as np
import pytest
from workload import random_step

import graphalloc as ga
from graphalloc.plan.compiled import AVAILABLE
from graphalloc.pools import ChunkedLocal, FullAttention, SlidingWindow

TWO = (FullAttention(40), SlidingWindow(8, 20), SlidingWindow(17, 24))
CHUNKED = (FullAttention(48), SlidingWindow(5, 16), ChunkedLocal(8, 20))


def make(layers=TWO, planner="auto", prefix_cache=False, **kw) -> ga.HybridAllocator:
    args = dict(page_size=4, max_reqs=4, max_context_len=64, max_handles=3, layers=layers)
    args.update(kw)
    return ga.HybridAllocator(ga.AllocatorConfig(**args), planner=planner,
                              prefix_cache=prefix_cache)


# ---- the config ------------------------------------------------------------------------------
def test_several_windows_build_further_pools_and_describe_them():
    cfg = ga.AllocatorConfig(page_size=4, max_reqs=4, max_context_len=64, layers=CHUNKED)
    assert cfg.sliding_window == 4 and cfg.num_swa_pages == 16  # the first window pool
    (extra,) = cfg.pools.extras
    assert extra.index == 1 and extra.num_pages == 20 and extra.rule.chunk == 8
    text = cfg.describe()
    assert "window pool 1: chunked local attention, chunks of 8 tokens, 20 pages" in text
    assert "numpy planner" in text


def test_rings_are_refused_with_several_windows():
    with pytest.raises(ga.ConfigError, match="ring_pages=0"):
        ga.AllocatorConfig(page_size=4, max_reqs=4, max_context_len=64,
                           layers=(FullAttention(40), SlidingWindow(8, 20, ring_pages=4),
                                   SlidingWindow(17, 24)))


def test_a_further_pool_too_small_for_one_window_is_refused():
    # W = 17: the allocator keeps 16 tokens, ceil(16 / 4) + 1 = 5 pages
    with pytest.raises(ga.ConfigError, match="num_pages >= 5"):
        ga.AllocatorConfig(page_size=4, max_reqs=4, max_context_len=64,
                           layers=(FullAttention(40), SlidingWindow(8, 20),
                                   SlidingWindow(17, 4)))
    ga.AllocatorConfig(page_size=4, max_reqs=4, max_context_len=64,
                       layers=(FullAttention(40), SlidingWindow(8, 20), SlidingWindow(17, 5)))


def test_numpy_plans_several_windows_and_compiled_is_refused():
    assert make().pipeline.compiled is None  # "auto": the numpy planner
    if not AVAILABLE:
        pytest.skip("the compiled planner was not built")
    with pytest.raises(ga.ConfigError, match="plans one window pool"):
        make(planner="compiled")


# ---- each pool's own rule ----------------------------------------------------------------------
def test_each_pool_evicts_by_its_own_rule_and_advance_moves_the_first_only():
    a = make(layers=CHUNKED)
    r = a.admit()
    a.step(extend=([r], [30]))
    a.step(evict_all=True)
    window = a.ledger.windows[0]
    assert a.frontier(r) == 24  # sliding W = 5: keeps 4 tokens, floor_page(30 - 4)
    assert int(window.frontier[r]) == 24  # chunks of 8: the chunk of position 30 starts at 24
    a.step(extend=([r], [3]))  # L = 33: chunk 32, window 29
    a.step(evict_all=True)
    assert a.frontier(r) == 28 and int(window.frontier[r]) == 32
    a.advance_frontier([r], [32])
    assert a.frontier(r) == 32 and int(window.frontier[r]) == 32
    a.check_integrity()
    a.release([r])
    assert a.n_free("window1") == 20 and a.n_free("swa") == 16 and a.n_free("full") == 48
    a.check_integrity()


def test_window_slots_are_the_further_pools_mapping():
    a = make()
    r = a.admit()
    out = a.step(extend=([r], [10]))
    f2s = a.state.windows[0].full_to_swa
    assert out.window_slots(0).tolist() == out.swa_slots.tolist()
    assert out.window_slots(1).tolist() == f2s[out.full_slots].tolist()
    assert (out.window_slots(1) > 0).all()
    with pytest.raises(ga.ContractError, match="further window pool 1 .. 1"):
        out.window_slots(2)


def test_a_short_further_pool_refuses_the_step_and_names_it():
    a = make(layers=(FullAttention(40), SlidingWindow(8, 20), SlidingWindow(17, 6)))
    r = a.admit()
    with pytest.raises(ga.CapacityError, match="window pool 1 pages; 6 are free") as info:
        a.step(extend=([r], [28]))  # 7 pages: FULL and the first window pool have them
    assert info.value.refusal.row == 2  # 0 FULL, 1 the first window pool, p + 1 pool p
    assert a.seq_len(r) == 0 and a.n_free("window1") == 6
    assert not a.fits(extend=([r], [28])) and a.try_step(extend=([r], [28])) is None
    a.step(extend=([r], [24]))


def test_a_trim_below_a_further_pools_window_is_refused():
    # first pool W = 5 (keeps 4), second W = 17 (keeps 16): after the eviction at L = 40
    # the first pool's frontier is 36, the second's 24; a trim to 38 is fine for the first
    # (>= 36 + 4) but the second needs >= 24 + 16 = 40
    a = make(layers=(FullAttention(40), SlidingWindow(5, 20), SlidingWindow(17, 24)))
    r = a.admit()
    a.step(extend=([r], [40]))
    a.step(evict_all=True)
    assert (a.frontier(r), int(a.ledger.windows[0].frontier[r])) == (36, 24)
    with pytest.raises(ga.FrontierError, match="below frontier \\+ window 40") as info:
        a.trim([r], 38)
    assert info.value.refusal.value == 38
    a.trim([r], 40)


def test_a_free_needs_more_steps_for_a_further_pools_section():
    """A release whose main rows fit one step but whose further pool's section does not runs
    as several steps, each carrying a part of that section (a padded main release row where
    the main section has none left). Here tombstoned handles keep the FULL pages, so the main
    section frees only the first pool's last page of each request, while the second pool
    (W = 40: nothing evicted) frees 8 pages of each, 2 pages a row: 12 rows, 4 a step."""
    a = make(layers=(FullAttention(60), SlidingWindow(3, 30), SlidingWindow(40, 40)),
             max_reqs=6, max_context_len=32, max_release_rows=5, max_pages_per_row=2,
             max_step_pages=8)
    rows = [a.admit() for _ in range(3)]
    for r in rows:
        a.step(extend=([r], [32]))
    handles = [a.take_handle(r, 32) for r in rows]
    for h in handles:
        a.drop_handle_swa(h)
    a.evict_window()
    assert [a.frontier(r) for r in rows] == [28] * 3
    steps = a.steps_run
    a.release(rows)
    assert a.steps_run - steps == 3
    assert a.n_free("window1") == 40 and a.n_free("swa") == 30 and a.n_free("full") == 36
    a.check()
    a.check_integrity()


def test_a_step_with_further_pool_rows_only_runs_them():
    """An eviction that frees pages of a further pool only (the first pool's window is the
    larger) is a step of its own: a padded main release row makes every executor launch it,
    and the further pool's release section runs."""
    a = make(layers=(FullAttention(40), SlidingWindow(33, 20), SlidingWindow(5, 24)))
    r = a.admit()
    a.step(extend=([r], [30]))
    before = a.n_free("window1")
    plan = a.plan(evict_all=True)
    assert plan.n_release_rows == 1 and plan.pages_freed == {"full": 0, "swa": 0}
    a.run(plan)
    assert a.n_free("window1") == before + 6  # [0, 24) of W = 5 (keeps 4): floor_page(26)
    a.check()
    a.check_integrity()


# ---- sharing ---------------------------------------------------------------------------------
def test_a_handle_shares_every_pools_window_and_a_tombstone_drops_them_all():
    a = make()
    r = a.admit()
    a.step(extend=([r], [40]))
    a.step(evict_all=True)  # first pool from 32, second from 24
    h = a.take_handle(r, 36)
    window = a.ledger.windows[0]
    assert (int(a.ledger.h_swa_start[h]), int(window.h_start[h])) == (32, 24)
    r2 = a.admit(handle=h)
    assert (a.frontier(r2), int(window.frontier[r2])) == (32, 24)
    a.check_integrity()
    a.release([r, r2])
    free = a.n_free("window1")
    a.drop_handle_swa(h)  # the tombstone: every window pool's pages
    assert a.n_free("window1") == free + 3 and int(window.h_start[h]) == 36
    a.drop_handle(h)
    assert a.n_free("window1") == 24 and a.n_free("full") == 40
    a.check_integrity()


def test_the_prefix_cache_needs_every_pools_window():
    a = make(prefix_cache=True)
    tokens = list(range(40))
    r = a.admit()
    a.step(extend=([r], [40]))
    a.prefix_cache.insert(r, tokens)
    window = a.ledger.windows[0]
    (h,) = a.live_handles()
    assert a.prefix_cache.match(tokens).cached_tokens == 40
    # the further pool's window of 40 tokens (W = 17: keeps 16) starts at 24: a handle
    # that holds it from 28 on does not serve 40 tokens, only a match ending where its
    # window still is (the first pool's, W = 8, allows any of them)
    window.h_start[h] = 28
    assert a.prefix_cache.match(tokens).cached_tokens == 0
    window.h_start[h] = 24
    assert a.prefix_cache.match(tokens).cached_tokens == 40


def test_the_cache_tombstones_entries_when_a_further_pool_is_short():
    """An allocation short of a further pool's pages only: the step is planned again with
    the cache's offer and the tombstone (every window pool's pages of the entry) makes room,
    inside the same step."""
    a = make(layers=(FullAttention(40), SlidingWindow(8, 20), SlidingWindow(17, 8)),
             prefix_cache=True)
    r0 = a.admit()
    a.step(extend=([r0], [28]))  # 7 of the further pool's 8 pages
    assert a.prefix_cache.insert(r0, list(range(28))) == 28
    a.release([r0])  # the entry's handle holds them now
    assert (a.n_free("window1"), a.n_free("swa")) == (1, 13)
    r1 = a.admit()
    a.step(extend=([r1], [8]))  # 2 pages: the further pool is short, the first is not
    (h,) = a.live_handles()
    assert int(a.ledger.windows[0].h_start[h]) == 28 == int(a.ledger.h_swa_start[h])
    assert (a.n_free("window1"), a.n_free("swa")) == (6, 18)
    assert a.prefix_cache.match(list(range(28))).full_tokens == 28  # FULL still cached
    a.check_integrity()


def test_state_dict_round_trip_carries_the_further_pools():
    src, dst = make(), make()
    rng = np.random.default_rng(3)
    for _ in range(40):
        random_step([src], rng)
    sd = src.state_dict()
    assert "window1_frontier" in sd["host"] and "window1_full_to_swa" in sd["device"]
    dst.load_state_dict(sd)
    assert dst.audit() == []
    for name, value in src.ledger.arrays().items():
        assert np.array_equal(value, dst.ledger.arrays()[name]), name
    sd["device"]["window1_swa_free"][0] = sd["device"]["window1_swa_free"][1]
    with pytest.raises(ga.StateError, match="window1"):
        make().load_state_dict(sd)


@pytest.mark.parametrize("layers", [TWO, CHUNKED], ids=["two_windows", "window_chunked"])
def test_random_workload_audits_clean(layers):
    """The random workload (admits, extends, free groups, advances, sharing, speculative
    rounds, scheduler steps) with the full audit after every operation: every pool's
    references, rings and mappings agree with the device tables."""
    a = make(layers=layers, max_reqs=6)
    rng = np.random.default_rng(7)
    kinds: dict = {}
    for _ in range(150):
        kind = random_step([a], rng)
        kinds[kind] = kinds.get(kind, 0) + 1
        assert a.audit() == [], kind
    a.check()
    assert kinds.get("take_handle", 0) and kinds.get("free_group", 0) and kinds.get("step", 0)
