"""The prefix cache, from its rules: window-aware hits, LRU leaf-first eviction that tombstones
SWA before it evicts FULL, eviction inside the step whose allocation needs the pages, and a
random workload where every hit's shared slots are the cached tokens' own.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import graphalloc as ga
from graphalloc.prefix_cache import page_keys


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


def test_hit_admits_on_the_cached_pages_and_counts():
    a = make()
    prompt = list(range(100, 124))  # 6 pages
    served(a, prompt)
    full_free = a.n_free("full")
    m = a.prefix_cache.match(prompt + [1, 2, 3])
    assert (m.cached_tokens, m.full_tokens, m.recompute_tokens) == (24, 24, 0)
    s = a.admit(handle=m.handle)
    assert a.seq_len(s) == 24 and a.n_free("full") == full_free  # nothing allocated
    a.alloc_extend([s], [3])
    miss = a.prefix_cache.match([7] * 24)
    assert miss.cached_tokens == 0 and miss.handle == -1
    st_ = a.stats()
    assert (st_["cache_hits"], st_["cache_misses"], st_["cache_hit_tokens"]) == (1, 1, 24)
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
