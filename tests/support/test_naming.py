"""One meaning per word, counts as the engines count them (graphalloc/deprecations.py).

Every renamed form: the new one does what the old one did (the same config, the same
ledger after the same steps), the old one still works and warns once with a
``DeprecationWarning`` that names its replacement and points at the caller's line, and
giving both is refused. Also the window past the context (clamped by a documented rule).
"""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest
from conftest import assert_same_snapshot

import graphalloc as ga

BASE = dict(page_size=4, num_full_pages=48, num_swa_pages=48, max_reqs=4, max_context_len=64)
ENGINE = dict(max_running_requests=4, chunked_prefill_size=32, max_context_len=64,
              page_size=4, num_full_pages=48, num_swa_pages=48)


def warned(fn, *args, **kw):
    """``(result, [messages])`` of the DeprecationWarnings ``fn`` raised, each checked to
    point at this file (the caller's line, not graphalloc's)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn(*args, **kw)
    deps = [w for w in caught if w.category is DeprecationWarning  # the pools' own rename
            and not str(w.message).startswith("AllocatorConfig's keyword form")]
    assert all(w.filename == __file__ for w in deps), [(w.filename, w.lineno) for w in deps]
    return out, [str(w.message) for w in deps]


def silent(fn, *args, **kw):
    out, messages = warned(fn, *args, **kw)
    assert messages == []
    return out


# ---- k: num_lookahead_tokens (vLLM's num_speculative_tokens), not max_spec_tokens = 1 + k ----
def test_num_lookahead_tokens_counts_k_and_max_spec_tokens_is_derived():
    new = silent(ga.AllocatorConfig, **BASE, model_window=8, num_state_slots=16,
                 num_lookahead_tokens=3)
    assert (new.num_lookahead_tokens, new.max_spec_tokens) == (3, 4)
    old, messages = warned(ga.AllocatorConfig, **BASE, model_window=8, num_state_slots=16,
                           max_spec_tokens=4)
    assert old == new
    assert len(messages) == 1 and "num_lookahead_tokens=3" in messages[0]
    default = silent(ga.AllocatorConfig, **BASE, model_window=8)
    assert (default.num_lookahead_tokens, default.max_spec_tokens) == (7, 8)  # as 0 gave
    assert silent(ga.AllocatorConfig, **BASE, model_window=8,
                  num_lookahead_tokens=0).max_spec_tokens == 1
    assert dataclasses.replace(new, max_reqs=3).max_spec_tokens == 4  # replace keeps it
    with pytest.raises(ga.ConfigError, match="give it once"):
        dataclasses.replace(new, num_lookahead_tokens=5)  # both given, and they disagree
    for bad in (-1, True, 1.5):
        with pytest.raises(ga.ConfigError, match="num_lookahead_tokens"):
            ga.AllocatorConfig(**BASE, model_window=8, num_lookahead_tokens=bad)


def test_for_engine_takes_k_and_sizes_the_same_states():
    cfg = silent(ga.AllocatorConfig.for_engine, **ENGINE, model_window=8,
                 num_lookahead_tokens=2, num_state_slots=40)
    assert (cfg.num_lookahead_tokens, cfg.max_spec_tokens) == (2, 3)
    assert "| num_lookahead_tokens | 2 |" in cfg.describe()


# ---- the window: model_window in the constructor and in for_engine -----------------------
def test_for_engine_takes_model_window_and_the_old_keyword_warns():
    new = silent(ga.AllocatorConfig.for_engine, **ENGINE, model_window=16)
    old, messages = warned(ga.AllocatorConfig.for_engine, **ENGINE, model_sliding_window=16)
    assert old == new and new.sliding_window == 15
    assert len(messages) == 1 and "model_window=W" in messages[0]
    with pytest.raises(ga.ConfigError, match="give model_window only"):
        ga.AllocatorConfig.for_engine(**ENGINE, model_window=16, model_sliding_window=16)
    with pytest.raises(ga.ConfigError, match="model_window=W"):
        ga.AllocatorConfig.for_engine(**ENGINE)
    with pytest.raises(ga.ConfigError, match="model_window"):
        ga.AllocatorConfig.for_engine(**ENGINE, model_window=0)


# ---- accept: the drafts accepted (vLLM's num_accepted_tokens); commit kept 1 + that ----------
def spec_pair():
    """Two equal allocators, each with two requests in a speculative step of 1 + 3."""
    out = []
    for _ in range(2):
        a = ga.HybridAllocator(ga.AllocatorConfig(**BASE, model_window=8))
        rows = [a.admit(), a.admit()]
        a.step(extend=(rows, [6, 9]))
        a.step(decode=rows, lookahead=3)
        out.append((a, rows))
    return out


@pytest.mark.parametrize("api", ["step", "single", "block"])
def test_accept_keeps_the_verified_token_and_the_accepted_drafts(api):
    (new, rows), (old, _) = spec_pair()
    n_accepted = [0, 3]  # none of the drafts; all three
    if api == "step":
        silent(new.step, accept=(rows, n_accepted), decode=rows, lookahead=3)
        _, messages = warned(old.step, commit=(rows, [1, 4]), decode=rows, lookahead=3)
    elif api == "single":
        silent(new.accept, rows, n_accepted)
        _, messages = warned(old.commit, rows, [1, 4])
    else:
        def block(alloc, kind, counts):
            with alloc.scheduler_step() as it:
                getattr(it, kind)(rows, counts)
        silent(block, new, "accept", n_accepted)
        _, messages = warned(block, old, "commit", [1, 4])
    assert len(messages) == 1 and "accept=(rows, n - 1)" in messages[0]
    assert [new.committed_len(r) for r in rows] == [6 + 1, 9 + 4]
    assert_same_snapshot(new.snapshot(), old.snapshot())
    new.check_integrity()


def test_accept_refuses_what_the_step_cannot_keep_and_both_forms_at_once():
    (a, rows), _ = spec_pair()
    before = a.snapshot()
    with pytest.raises(ga.PositionError):
        a.step(accept=(rows, [4, 0]))  # 1 + 4 tokens of a step of 1 + 3
    with pytest.raises(ga.PositionError):
        a.step(accept=(rows, [-1, 0]))  # keeping nothing is not an engine's count
    with pytest.raises(ga.ContractError, match="one kind"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            a.step(accept=(rows, 0), commit=(rows, 1))
    assert_same_snapshot(before, a.snapshot())
    assert "accept" in ga.Step(accept=(rows, 0)).kinds()


# ---- reclaim: a prefix cache's entries are dropped or tombstoned, never "evicted" -------------
def cached_twice():
    out = []
    for _ in range(2):
        a = ga.HybridAllocator(ga.AllocatorConfig(**BASE, model_window=8, max_handles=4),
                               prefix_cache=True)
        r = a.admit()
        a.alloc_extend([r], [16])
        a.prefix_cache.insert(r, list(range(16)))
        a.release([r])
        out.append(a)
    return out


def test_reclaim_is_what_evict_did_and_the_counter_is_dropped_pages():
    new, old = cached_twice()
    silent(new.prefix_cache.reclaim, n_full=4)
    _, messages = warned(old.prefix_cache.evict, n_full=4)
    assert len(messages) == 1 and "reclaim(n_full, n_swa)" in messages[0]
    assert_same_snapshot(new.snapshot(), old.snapshot())
    assert new.prefix_cache.dropped_pages == 4 and len(new.prefix_cache) == 0
    count, messages = warned(lambda: new.prefix_cache.evicted_pages)
    assert count == 4 and len(messages) == 1 and "dropped_pages" in messages[0]
    stats = new.stats()
    assert stats["cache_dropped_pages"] == stats["cache_evicted_pages"] == 4


# ---- a model window past the context: clamped, documented, nothing ever evicted ---------------
def test_a_window_past_the_context_is_clamped_to_the_context():
    ctx = BASE["max_context_len"]
    far = silent(ga.AllocatorConfig, **BASE, model_window=4096)
    assert (far.model_window, far.sliding_window) == (4096, ctx)
    assert "the window is past the context" in far.describe()
    assert ga.AllocatorConfig(**BASE, model_window=ctx + 1).sliding_window == ctx
    assert ga.AllocatorConfig(**BASE, model_window=ctx).sliding_window == ctx - 1  # unclamped
    # a ring as large as the context now serves it (the unclamped window needed 1025 pages)
    ring = ga.AllocatorConfig(**{**BASE, "num_full_pages": 64, "num_swa_pages": 4 * 17},
                              model_window=4096, swa_ring_pages=ctx // 4 + 1)
    assert ring.sliding_window == ctx
    a = ga.HybridAllocator(ring)  # and serves four requests to the context, evicting nothing
    rows = [a.admit() for _ in range(4)]
    a.step(extend=(rows, [10] * 4))
    while a.seq_len(rows[0]) < ctx:
        a.step(evict_all=True, decode=rows)
    assert [a.frontier(r) for r in rows] == [0] * 4 and a.audit() == []
    a.step(release=rows)
    assert (a.n_free("full"), a.n_free("swa")) == (64, 4 * 17)


@pytest.mark.parametrize("ps", [1, 4])
def test_the_clamped_window_never_evicts_like_the_window_just_past_the_context(ps):
    ctx = BASE["max_context_len"]
    cfgs = [ga.AllocatorConfig(**{**BASE, "page_size": ps, "num_full_pages": 2 * ctx,
                                  "num_swa_pages": 2 * ctx}, model_window=w)
            for w in (4096, ctx + 1)]
    allocs = [ga.HybridAllocator(c) for c in cfgs]
    rows = [a.admit() for a in allocs]
    for a, r in zip(allocs, rows, strict=True):
        a.step(extend=([r], [ctx // 2]))
        while a.seq_len(r) < ctx:
            a.step(evict_all=True, decode=[r])
        a.step(evict_all=True)
        assert a.frontier(r) == 0  # every position kept: nothing ever evicted
    assert_same_snapshot(allocs[0].snapshot(), allocs[1].snapshot())


def test_for_engine_sizes_the_swa_pool_for_the_context_not_the_window():
    kw = dict(max_running_requests=4, chunked_prefill_size=32, max_context_len=256,
              page_size=16, kv_bytes=1 << 26, full_bytes_per_token=256,
              swa_bytes_per_token=256)
    far = ga.AllocatorConfig.for_engine(**kw, model_window=32768)
    near = ga.AllocatorConfig.for_engine(**kw, model_window=257)
    assert far.sliding_window == near.sliding_window == 256
    assert (far.num_full_pages, far.num_swa_pages) == (near.num_full_pages,
                                                       near.num_swa_pages)
    assert "the window is past the context" in far.describe()
    assert np.isfinite(far.num_swa_pages)
