"""The prefix cache, from its rules: window-aware hits (served by any entry holding the
window), LRU leaf-first eviction that tombstones SWA before it evicts FULL, eviction inside
the step whose allocation needs the pages and only if that step runs (a dry run or a refused
step keeps every entry), locks, and a random workload where every hit's shared slots are the
cached tokens' own. Also ``pages_released``, the allocator's sharing-aware count of what
frees would free, against the frees themselves.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import graphalloc as ga
from graphalloc.sharing.prefix_cache import page_keys


def make(ps=4, n_full=40, n_swa=24, window=8, ctx=64, handles=8, reqs=4):
    cfg = ga.AllocatorConfig(page_size=ps, num_full_pages=n_full, num_swa_pages=n_swa,
                             max_reqs=reqs, max_context_len=ctx, sliding_window=window,
                             max_handles=handles)
    return ga.HybridAllocator(cfg, prefix_cache=True)


def served(a, tokens):
    """A request that prefilled ``tokens`` and was cached, then released."""
    r = a.admit()
    a.alloc_extend([r], [len(tokens)])
    a.prefix_cache.insert(r, tokens)
    a.release([r])


def test_page_keys_chain_over_the_prefix():
    a, b = page_keys(list(range(12)), 4), page_keys([99] + list(range(1, 12)), 4)
    assert len(a) == 3 and all(x != y for x, y in zip(a, b, strict=True))  # page 0 differs
    assert page_keys(list(range(8)) + [5, 5, 5, 5], 4)[:2] == a[:2]  # equal prefix, equal keys
    assert len(page_keys(list(range(11)), 4)) == 2  # a partial page has no key
    # incremental: the first pages' keys extended in place, only the new pages hashed
    keys = page_keys(list(range(5)), 4)
    assert page_keys(list(range(12)), 4, keys) is keys and keys == a
    assert page_keys(list(range(12)), 4, keys) == a  # nothing new: unchanged


def test_hit_admits_on_the_cached_pages_and_counts():
    a = make()
    prompt = list(range(100, 124))  # 6 pages
    served(a, prompt)
    full_free = a.n_free("full")
    m = a.prefix_cache.match(prompt + [1, 2, 3])
    assert (m.cached_tokens, m.full_tokens, m.recompute_tokens) == (24, 24, 0)
    assert a.prefix_cache.match(keys=page_keys(prompt + [1, 2, 3], 4)) == m  # keys given
    with pytest.raises(ga.errors.ContractError, match="token_ids"):
        a.prefix_cache.match()
    kept = page_keys(prompt[:10], 4)  # a request's keys so far (2 pages), kept by its caller
    again = a.prefix_cache.match(prompt + [1, 2, 3], keys=kept)
    assert again == m and again.keys is kept and kept == page_keys(prompt, 4)  # extended
    s = a.admit(handle=m.handle)
    assert a.seq_len(s) == 24 and a.n_free("full") == full_free  # nothing allocated
    a.alloc_extend([s], [3])
    miss = a.prefix_cache.match([7] * 24)
    assert miss.cached_tokens == 0 and miss.handle == -1
    st_ = a.stats()
    assert (st_["cache_hits"], st_["cache_misses"], st_["cache_hit_tokens"]) == (3, 1, 72)
    a.check_integrity()


def test_hit_whose_window_pages_were_tombstoned_shrinks():
    """Two entries on one prompt (a chunk boundary at 12 tokens, the whole 24); SWA pressure
    tombstones the LRU leaf (the longer one): its window is gone, so the hit shrinks to the
    shorter entry whose window is intact, and the FULL hit reports what to recompute."""
    a = make(n_swa=16, window=8)
    prompt = list(range(200, 224))
    r = a.admit()
    a.alloc_extend([r], [12])
    a.prefix_cache.insert(r, prompt[:12])  # chunk boundary
    a.alloc_extend([r], [12])
    a.prefix_cache.insert(r, prompt)  # end of prefill
    a.release([r])
    assert a.prefix_cache.match(prompt).cached_tokens == 24
    t = a.admit()
    a.alloc_extend([t], [48])  # 12 SWA pages, 10 free: the leaf's window goes
    m = a.prefix_cache.match(prompt)
    assert m.full_tokens == 24 and m.cached_tokens == 12  # the hit shrank
    assert m.recompute_tokens == 8  # the window [16, 24) lost its SWA pages
    assert a.stats()["cache_tombstoned_pages"] == 3 and a.stats()["cache_evicted_pages"] == 0
    a.check_integrity()


def test_swa_pressure_tombstones_before_it_would_evict():
    """SWA short, FULL plentiful: the entry is tombstoned (its FULL pages kept: still a
    full-attention prefix), not evicted."""
    a = make(n_full=40, n_swa=12, window=8)
    prompt = list(range(300, 324))
    served(a, prompt)  # 6 FULL + 6 SWA pages cached
    t = a.admit()
    a.alloc_extend([t], [4 * 9])  # 9 SWA pages: 6 free + 3 reclaimed by one tombstone
    st_ = a.stats()
    assert st_["cache_tombstoned_pages"] == 6 and st_["cache_evicted_pages"] == 0
    assert st_["cache_entries"] == 1
    m = a.prefix_cache.match(prompt)
    assert m.full_tokens == 24 and m.cached_tokens == 0 and m.recompute_tokens == 8
    a.check_integrity()


def test_allocation_succeeds_only_because_the_cache_gives_pages_back_in_the_same_step():
    """FULL short (and SWA): the cache tombstones, then evicts, inside the one step."""
    a = make(n_full=16, n_swa=16)
    served(a, list(range(400, 424)))  # 6 pages of each pool held by the cache
    t = a.admit()
    need = a.n_free("full") + 4  # 4 pages more than free: the cache must give them
    steps = a.steps_run
    out = a.alloc_extend([t], [4 * need])
    assert a.steps_run == steps + 1  # the drops and the allocation are ONE step
    assert out.full_slots.shape[0] == 4 * need
    assert a.stats()["cache_evicted_pages"] == 6 and a.stats()["cache_entries"] == 0
    a.check_integrity()


def test_an_entry_held_by_a_running_request_frees_nothing_when_evicted():
    a = make(n_full=16, n_swa=16)
    prompt = list(range(500, 516))  # 4 pages
    served(a, prompt)
    s = a.admit(handle=a.prefix_cache.match(prompt).handle)  # a sharer holds them too
    free = a.n_free("full")
    a.prefix_cache.evict(n_full=4)  # the cache drops its entry: the sharer keeps the pages
    assert a.n_free("full") == free and len(a.prefix_cache) == 0
    a.release([s])
    assert a.n_free("full") == 16
    a.check_integrity()


@settings(max_examples=150, deadline=None, database=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(ops=st.lists(st.tuples(st.sampled_from(["serve", "hit", "release", "grow"]),
                              st.integers(0, 3), st.integers(1, 40)), min_size=5, max_size=40))
def test_random_workload_hits_share_the_cached_tokens_own_slots(ops):
    """Prompts from 4 families (shared heads); every hit's shared slots equal the slots of the
    request that cached those tokens (recorded when it was cached); integrity after every
    operation; pressure makes the cache tombstone and evict."""
    a = make(ps=4, n_full=48, n_swa=24, window=8, ctx=64, handles=6, reqs=4)
    ps = 4
    heads = [list(range(1000 * f, 1000 * f + 40)) for f in range(4)]
    slots_of: dict = {}  # page key -> the FULL slots of every cached copy of that page
    live: list = []
    for kind, fam, n in ops:
        if kind == "serve" and a.n_live < 4:
            tokens = heads[fam][:n]
            row = a.admit()
            if a.try_step(extend=([row], [n])) is None:
                a.release([row])
                continue
            got = a.prefix_cache.insert(row, tokens)
            keys = page_keys(tokens, ps)[:got // ps]
            for j, key in enumerate(keys):
                page = a.req_to_token[row, j * ps:(j + 1) * ps].tolist()
                slots_of.setdefault(key, []).append(page)
            live.append(row)
        elif kind == "hit" and a.n_live < 4:
            tokens = heads[fam][:n] + [7, 7, 7]
            m = a.prefix_cache.match(tokens)
            if m.cached_tokens:
                row = a.admit(handle=m.handle, n_tokens=m.cached_tokens)
                for j, key in enumerate(page_keys(tokens, ps)[:m.cached_tokens // ps]):
                    assert a.req_to_token[row, j * ps:(j + 1) * ps].tolist() in slots_of[key]
                live.append(row)
        elif kind == "release" and live:
            a.release([live.pop(fam % len(live))])
        elif kind == "grow" and live:
            row = live[fam % len(live)]
            if a.seq_len(row) + n <= 64:
                a.try_step(extend=([row], [n]))
        a.check_integrity()
        a.prefix_cache.check()
    for row in live:
        a.release([row])
    a.prefix_cache.drop_all()
    assert a.n_free("full") == 48 and a.n_free("swa") == 24
    a.check_integrity()


# ---- transactions, locks, window hits through any holder, what frees would free ----------
def test_a_dry_run_or_a_refused_step_keeps_every_entry():
    """fits() and a refused step plan the cache's drops and roll them back: the entries stay
    (found: fits() used to forget an entry whose handle stayed held, leaking its pages)."""
    a = make(n_full=16, n_swa=16, handles=4, ctx=128)
    served(a, list(range(600, 624)))  # 6 pages of each pool held by the cache
    t = a.admit()
    assert a.fits(extend=([t], [4 * 12]))  # 10 free + 6 the cache gives back
    assert not a.fits(extend=([t], [4 * 17]))
    assert a.try_step(extend=([t], [4 * 17])) is None
    cache = a.prefix_cache
    assert len(cache) == 1 and len(a.live_handles()) == 1
    assert (cache.evicted_pages, cache.tombstoned_pages) == (0, 0)
    cache.check()
    assert a.prefix_cache.match(list(range(600, 624))).cached_tokens == 24  # still served
    a.alloc_extend([t], [4 * 12])  # runs: the drops are this step's, and stay
    assert len(cache) == 0 and cache.evicted_pages == 6 and cache.tombstoned_pages == 6
    a.check_integrity()


def test_locked_entries_are_neither_evicted_nor_tombstoned():
    a = make(n_full=16, n_swa=16, handles=2)
    prompt = list(range(700, 724))
    served(a, prompt)
    h = a.prefix_cache.match(prompt).handle
    a.prefix_cache.lock(h)
    assert a.prefix_cache.reclaimable_handles() == [] and a.prefix_cache.is_locked(h)
    t = a.admit()
    assert a.try_step(extend=([t], [4 * 12])) is None  # the locked entry gives nothing
    served(a, list(range(800, 808)))  # a second entry fills the handles
    served(a, list(range(900, 908)))  # the insert gives up the LRU unlocked entry, not h
    assert a.prefix_cache.match(prompt).cached_tokens == 24
    a.prefix_cache.unlock(h)
    assert a.try_step(extend=([t], [4 * 12])) is not None
    assert a.prefix_cache.match(prompt).cached_tokens == 0
    a.check_integrity()
    with pytest.raises(ga.UnknownHandleError):
        a.prefix_cache.lock(h)  # evicted
    a.release([t])
    served(a, list(range(990, 998)))
    with pytest.raises(ga.ContractError):
        a.prefix_cache.unlock(a.prefix_cache.reclaimable_handles()[0])  # not locked


def test_a_hit_is_served_by_any_entry_that_holds_the_window():
    """Three prompts share a 16-token head; the entry that holds the head's pages under the
    longest key lost its window early (cached after its frontier moved), a shorter one
    kept it: the hit on the head is served by the shorter entry (found by the seams'
    shared-system-prompt loop, whose later requests all missed)."""
    a = make(ps=4, n_full=48, n_swa=32, window=8, ctx=64, handles=6)
    head = list(range(1, 17))
    r = a.admit()
    a.alloc_extend([r], [20])
    a.prefix_cache.insert(r, head + [50, 51, 52, 53])  # window intact: SWA from 0
    a.release([r])
    s = a.admit(handle=a.prefix_cache.match(head + [50, 51, 52, 53, 9]).handle)
    a.alloc_extend([s], [28])  # 48 tokens, sharing the first 20
    a.evict_window([s])  # frontier 40: the window moved on
    assert a.frontier(s) == 40
    a.prefix_cache.insert(s, head + [50, 51, 52, 53] + list(range(60, 88)))
    a.release([s])
    hit = a.prefix_cache.match(head + [77, 78])
    assert hit.full_tokens == 16 and hit.cached_tokens == 16  # through the 20-token entry
    a.check_integrity()


def test_drop_all_is_one_step_and_frees_what_reclaimable_pages_said():
    a = make(n_full=40, n_swa=24, handles=6)
    for k in range(4):
        served(a, list(range(1000 * k, 1000 * k + 12 + 4 * k)))
    want = a.prefix_cache.reclaimable_pages()
    free = (a.n_free("full"), a.n_free("swa"))
    steps = a.steps_run
    a.prefix_cache.drop_all()
    assert a.steps_run == steps + 1 and len(a.prefix_cache) == 0
    assert (a.n_free("full") - free[0], a.n_free("swa") - free[1]) == want
    assert a.n_free("full") == 40 and a.n_free("swa") == 24
    a.check_integrity()


@settings(max_examples=60, deadline=None, database=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(ops=st.lists(st.tuples(st.sampled_from(["new", "share", "grow", "evict", "handle",
                                               "free"]),
                              st.integers(0, 7), st.integers(1, 20)), min_size=4, max_size=30))
def test_pages_released_is_what_the_frees_free(ops):
    """Random sharing (requests admitted on handles, handles taken, windows evicted); at each
    "free", a random set of releases, frontier advances and handle drops: the pages
    pages_released predicted are exactly the pages one step of those frees returns."""
    ps = 4
    a = make(ps=ps, n_full=64, n_swa=48, window=6, ctx=64, handles=5, reqs=6)
    rng = np.random.default_rng(len(ops))
    for kind, i, n in ops:
        live = [int(r) for r in a.live_rows()]
        handles = [int(h) for h in a.live_handles()]
        if kind == "new" and a.n_live < 6:
            r = a.admit()
            if a.try_step(extend=([r], [n])) is None:
                a.release([r])
        elif kind == "share" and handles and a.n_live < 6:
            h = handles[i % len(handles)]
            s = a.admit(handle=h)
            a.try_step(extend=([s], [n]))
        elif kind == "grow" and live:
            r = live[i % len(live)]
            if a.seq_len(r) + n <= 64:
                a.try_step(extend=([r], [n]))
        elif kind == "evict" and live:
            a.evict_window([live[i % len(live)]])
        elif kind == "handle" and live and len(handles) < 5:
            r = live[i % len(live)]
            if a.seq_len(r) >= ps:
                a.take_handle(r, (1 + n % (a.seq_len(r) // ps)) * ps)
        elif kind == "free" and (live or handles):
            rel = [r for r in live if rng.random() < 0.4]
            adv_rows = [r for r in live if r not in rel and rng.random() < 0.4
                        and a.frontier(r) < a.seq_len(r) // ps * ps]
            adv_pos = [a.frontier(r) + ps * int(rng.integers(1, (a.seq_len(r) // ps * ps
                                                                 - a.frontier(r)) // ps + 1))
                       for r in adv_rows]
            drops = [h for h in handles if rng.random() < 0.4]
            want = a.pages_released(rel, advance=(adv_rows, adv_pos), handles=drops)
            free = (a.n_free("full"), a.n_free("swa"))
            with a.scheduler_step() as it:
                it.release(rel)
                it.advance(adv_rows, adv_pos)
                for h in drops:
                    it.drop_handle(h)
            assert (a.n_free("full") - free[0], a.n_free("swa") - free[1]) == want
        a.check_integrity()


def test_pages_released_refuses_bad_input_with_nothing_changed():
    a = make(ps=4, n_full=40, n_swa=24, window=8, handles=2)
    r, s = a.admit(), a.admit()
    a.alloc_extend([r, s], [16, 9])
    h = a.take_handle(r, 8)
    assert a.pages_released([r]) == (2, 2)  # the handle keeps pages 0, 1
    assert a.pages_released([r], handles=[h]) == (4, 4)
    assert a.pages_released(advance=([s], [4])) == (0, 1)
    before = a.snapshot()
    for call, err in ((lambda: a.pages_released([r, r]), ga.OverlapError),
                      (lambda: a.pages_released([5]), ga.UnknownRequestError),
                      (lambda: a.pages_released(advance=([s], [2])), ga.AlignmentError),
                      (lambda: a.pages_released(advance=([s], [12])), ga.PositionError),
                      (lambda: a.pages_released([s], advance=([s], [4])), ga.UnknownRequestError),
                      (lambda: a.pages_released(handles=[1]), ga.UnknownHandleError),
                      (lambda: a.pages_released(handles=[h, h]), ga.OverlapError),
                      (lambda: a.pages_released(advance=[s]), ga.ContractError)):
        with pytest.raises(err):
            call()
    a.advance_frontier([s], [4])
    with pytest.raises(ga.FrontierError):
        a.pages_released(advance=([s], [0]))
    with a.free_group():
        a.release([r])
        with pytest.raises(ga.UnknownRequestError):
            a.pages_released([r])  # released in the open block
    assert a.pages_released([s]) == (3, 2)
    _ = before
