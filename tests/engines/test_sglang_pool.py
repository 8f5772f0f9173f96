"""graphalloc's SGLang token-to-KV-pool allocator against the behaviours SGLang's own
mem_cache unit tests check (written from the rules, in our words), and against a small
pure-Python model of two paged pools on random calls. SGLang is not needed here; the
conformance run (``make engines-sglang``) drives SGLang's own allocation path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from graphalloc.errors import (
    AlignmentError,
    ContractError,
    IntegrityError,
    NestedGroupError,
    PositionError,
)
from graphalloc.integrations.sglang_pool import GraphallocTokenToKVPoolAllocator as Pool


def pool(ps=4, full=16, swa=8):
    return Pool(size=full * ps, size_swa=None if swa is None else swa * ps, page_size=ps)


def extend(a, pre, seq, last):
    n = sum(s - p for p, s in zip(pre, seq, strict=False))
    return a.alloc_extend(None, torch.tensor(pre), None, torch.tensor(seq),
                          torch.tensor(last), n)


def pages(slots, ps):
    return sorted(set((torch.as_tensor(slots) // ps).tolist()))


def test_extend_fills_the_last_page_then_whole_fresh_pages():
    a = pool(ps=4)
    out = extend(a, [0, 0], [6, 3], [-1, -1])
    assert out.tolist()[:4] == list(range(out[0], out[0] + 4))  # a page's slots in order
    assert out[0] % 4 == 0 and out[4] % 4 == 0 and out[6] % 4 == 0
    more = extend(a, [6], [9], [int(out[5])])  # continues the page after last_loc
    assert more.tolist()[:2] == [int(out[5]) + 1, int(out[5]) + 2] and more[2] % 4 == 0
    assert a.full_available_size() == (16 - 4) * 4 and a.swa_available_size() == (8 - 4) * 4


def test_every_new_full_slot_has_its_swa_peer_page_dense():
    a = pool(ps=4)
    out = extend(a, [0, 0], [7, 5], [-1, -1])
    swa = a.translate_loc_from_full_to_swa(out)
    assert (swa > 0).all()
    assert ((swa % 4) == (out % 4)).all()  # same in-page offset
    by_page = {}
    for f, s in zip(out.tolist(), swa.tolist(), strict=False):
        by_page.setdefault(f // 4, set()).add(s // 4)
    assert all(len(v) == 1 for v in by_page.values())  # one SWA page per full page
    assert int(a.translate_loc_from_full_to_swa(torch.tensor([-1]))) == -1


def test_decode_stays_in_the_page_then_takes_a_fresh_one():
    a = pool(ps=4)
    out = extend(a, [0], [3], [-1])
    d1 = a.alloc_decode(None, torch.tensor([4]), out[2:3])
    assert int(d1) == int(out[2]) + 1
    d2 = a.alloc_decode(None, torch.tensor([5]), d1)
    assert int(d2) % 4 == 0 and int(d2) // 4 != int(d1) // 4


def test_a_short_pool_returns_none_and_changes_nothing():
    a = pool(ps=4, full=16, swa=2)
    before = (a.full_available_size(), a.swa_available_size(), a.n_steps)
    assert extend(a, [0], [12], [-1]) is None  # 3 pages: the SWA pool has 2
    assert (a.full_available_size(), a.swa_available_size(), a.n_steps) == before
    assert extend(a, [0], [8], [-1]) is not None


def test_window_eviction_frees_swa_pages_only_and_clears_their_mapping():
    a = pool(ps=4)
    row = extend(a, [0], [12], [-1])
    a.free_swa_segment(row[:8], start_pos=0)  # positions [0, 8) left the window
    assert a.swa_available_size() == (8 - 1) * 4 and a.full_available_size() == (16 - 3) * 4
    a.flush()
    assert (a.translate_loc_from_full_to_swa(row[:8]) == 0).all()
    assert (a.translate_loc_from_full_to_swa(row[8:]) > 0).all()
    a.free_full_segment(row[:8], start_pos=0)  # the release: FULL of the evicted part
    a.free_segment(row[8:], start_pos=8)       # both pools for the rest
    assert a.available_size() == 8 * 4 and a.full_available_size() == 16 * 4
    a.check()


def test_a_free_group_counts_at_its_end_and_runs_as_one_step():
    a = pool(ps=4)
    r1, r2 = extend(a, [0], [8], [-1]), extend(a, [0], [4], [-1])
    steps = a.n_steps
    a.free_group_begin()
    with pytest.raises(NestedGroupError):
        a.free_group_begin()
    a.free_segment(r1, start_pos=0)
    a.free_segment(r2, start_pos=0)
    assert a.full_available_size() == (16 - 3) * 4  # not before the group's end
    a.free_group_end()
    assert a.full_available_size() == 16 * 4 and a.n_steps == steps  # recorded only
    extend(a, [0], [4], [-1])
    assert a.n_steps == steps + 1  # the frees and the allocation: one step


def test_freed_pages_serve_the_next_allocation_in_the_same_step():
    a = pool(ps=4, full=4, swa=4)
    row = extend(a, [0], [16], [-1])
    assert a.available_size() == 0
    a.free_segment(row, start_pos=0)
    again = extend(a, [0], [16], [-1])
    assert pages(again, 4) == pages(row, 4)
    a.check()


def test_set_shaped_free_frees_each_touched_page_once():
    a = pool(ps=4)
    row = extend(a, [0], [10], [-1])
    a.free(torch.cat([row[:5], row[1:3], row[9:10]]))  # pages 0, 1, 2 of the row, dups
    assert a.full_available_size() == 16 * 4 and a.swa_available_size() == 8 * 4
    assert a.n_host_reads == 1
    a.check()


def test_misaligned_segment_is_refused_before_anything_changes():
    a = pool(ps=4)
    row = extend(a, [0], [8], [-1])
    with pytest.raises(AlignmentError):
        a.free_segment(row[2:], start_pos=2)
    assert a.full_available_size() == 14 * 4


@pytest.mark.parametrize("flush_between", [True, False])
def test_freeing_an_swa_peer_twice_is_reported(flush_between):
    """Across steps the second free finds no peer (a device fault count); within one step
    both look the same peer up and the ring holds it twice. check() raises either way."""
    a = pool(ps=4)
    row = extend(a, [0], [8], [-1])
    a.free_swa_segment(row[:4], start_pos=0)
    if flush_between:
        a.flush()
    a.free_swa_segment(row[:4], start_pos=0)
    with pytest.raises(ContractError if flush_between else IntegrityError):
        a.check()


def test_lengths_that_disagree_are_refused():
    a = pool(ps=4)
    with pytest.raises(PositionError):
        a.alloc_extend(None, torch.tensor([0]), None, torch.tensor([5]), torch.tensor([-1]), 4)


def test_out_of_tree_contract_alloc_returns_whole_pages():
    a = pool(ps=16, full=8, swa=None)
    out = a.alloc(32)
    got = sorted(out.tolist())
    assert len(pages(out, 16)) == 2
    for p in pages(out, 16):
        assert [s for s in got if s // 16 == p] == [p * 16 + i for i in range(16)]
    assert Pool.uses_legacy_real_length_alloc is False
    with pytest.raises(AlignmentError):
        a.alloc(8)


@pytest.mark.parametrize("seed,ps,backend",
                         [(s, ps, "torch") for s in range(6) for ps in (1, 3, 16)]
                         + [(s, ps, "triton") for s in range(2) for ps in (3, 16)])
def test_random_calls_against_a_model_of_two_paged_pools(seed, ps, backend):
    """Requests grow by extends and decodes, slide their window, finish; the model keeps
    each request's pages as lists. Every slot handed out is unique and in a page the
    request holds, the pools' free counts match, and check() passes at the end."""
    rng = np.random.default_rng(seed)
    n_full, n_swa, window = 40, 24, 2 * ps + 1
    a = Pool(size=n_full * ps, size_swa=n_swa * ps, page_size=ps, backend=backend)
    reqs = {}  # id -> {"slots": [...], "front": evicted position}
    free_full, free_swa = n_full, n_swa
    for _ in range(120):
        op = rng.integers(4)
        if op == 0 or not reqs:  # a new request or a chunk of an existing one
            rid = int(rng.integers(10_000)) if not reqs or rng.random() < .5 else \
                int(rng.choice(list(reqs)))
            r = reqs.get(rid, {"slots": [], "front": 0})
            pre, n = len(r["slots"]), int(rng.integers(1, 3 * ps + 2))
            k = -(-(pre + n) // ps) - -(-pre // ps)
            out = extend(a, [pre], [pre + n], [r["slots"][-1] if pre else -1])
            if k > min(free_full, free_swa):
                assert out is None
                continue
            free_full, free_swa = free_full - k, free_swa - k
            r["slots"] += out.tolist()
            reqs[rid] = r
        elif op == 1:  # one decode of every request
            rids = list(reqs)
            lens = [len(reqs[i]["slots"]) + 1 for i in rids]
            k = sum((n - 1) % ps == 0 for n in lens)
            out = a.alloc_decode(None, torch.tensor(lens),
                                 torch.tensor([reqs[i]["slots"][-1] for i in rids]))
            if k > min(free_full, free_swa):
                assert out is None
                continue
            free_full, free_swa = free_full - k, free_swa - k
            for i, s in zip(rids, out.tolist(), strict=False):
                reqs[i]["slots"].append(s)
        elif op == 2:  # the window slides (whole pages below len - window)
            rid = int(rng.choice(list(reqs)))
            r = reqs[rid]
            new_front = max(0, len(r["slots"]) - window) // ps * ps
            if new_front > r["front"]:
                a.free_swa_segment(torch.tensor(r["slots"][r["front"]:new_front]),
                                   start_pos=r["front"])
                free_swa += (new_front - r["front"]) // ps
                r["front"] = new_front
        else:  # a request finishes, in a free group
            rid = int(rng.choice(list(reqs)))
            r = reqs.pop(rid)
            a.free_group_begin()
            if r["front"]:
                a.free_full_segment(torch.tensor(r["slots"][:r["front"]]), start_pos=0)
            if len(r["slots"]) > r["front"]:
                a.free_segment(torch.tensor(r["slots"][r["front"]:]), start_pos=r["front"])
            a.free_group_end()
            n_pages = -(-len(r["slots"]) // ps)
            free_full += n_pages
            free_swa += n_pages - r["front"] // ps
        assert a.full_available_size() == free_full * ps
        assert a.swa_available_size() == free_swa * ps
        held = [s // ps for r in reqs.values() for s in r["slots"]]
        owners = {}
        for rid, r in reqs.items():
            for s in r["slots"]:
                assert owners.setdefault(s // ps, rid) == rid  # one owner per page
        assert len(set(s for r in reqs.values() for s in r["slots"])) == len(held)
        assert 0 not in owners
    a.check()


@pytest.mark.parametrize("ps", [1, 4, 16])
def test_the_step_kernels_equal_their_torch_twins(ps):
    """ring_frees / ring_alloc (Triton; interpreted on the CPU) against the twins, on the
    same random state: the rings, the mapping, the fault count and the slots."""
    from graphalloc.kernels.page_ring import (
        ring_alloc,
        ring_alloc_torch,
        ring_frees,
        ring_frees_torch,
    )
    rng = np.random.default_rng(ps)
    n_pages = 24
    pages = torch.from_numpy(rng.permutation(np.arange(1, n_pages + 1)))
    f2s = torch.zeros((n_pages + 1) * ps + 1, dtype=torch.int64)
    f2s[-1] = -1
    swa_of = torch.from_numpy(rng.permutation(np.arange(1, n_pages + 1)))
    for p, q in zip(pages[:16].tolist(), swa_of[:16].tolist(), strict=True):
        f2s[p * ps:(p + 1) * ps] = q * ps + torch.arange(ps)
    swa_reps = pages[:6] * ps + int(rng.integers(ps))
    swa_reps[5] = pages[20] * ps  # unmapped: a fault
    full_reps = pages[6:10] * ps
    last_loc = torch.tensor([int(pages[12]) * ps + ps // 2, -1, int(pages[13]) * ps])
    desc = torch.tensor([[0, 0, 1, 1, 2], [-1, 0, 1, 2, 3], [0, 0, 0, 0, 0]])
    if ps == 1:
        desc[1, 0] = 0
    results = []
    for frees, alloc in ((ring_frees, ring_alloc), (ring_frees_torch, ring_alloc_torch)):
        m = f2s.clone()
        swa_ring = torch.arange(1, n_pages + 1, dtype=torch.int64)
        full_ring = torch.arange(1, n_pages + 1, dtype=torch.int64)
        faults = torch.zeros((), dtype=torch.int64)
        frees(swa_reps, full_reps, m, swa_ring, full_ring, faults, 6, 4, 20, 21, ps)
        out = torch.empty(5, dtype=torch.int64)
        alloc(desc, last_loc, m, full_ring, swa_ring, out, 5, 3, 7, ps)
        results.append((m, swa_ring, full_ring, faults, out))
    for got, want in zip(results[0], results[1], strict=True):
        assert torch.equal(got, want)
    assert int(results[1][3]) == 1


def test_the_pool_handles_sglangs_radix_cache_reaches_into():
    """SGLang's radix cache frees a tree node's FULL pages through full_attn_allocator
    (its SWA side goes separately, a tombstone); the SWA handle answers queries and
    refuses to take or free SWA slots alone."""
    a = pool(ps=4)
    row = extend(a, [0], [8], [-1])
    a.free_swa_segment(row[:4], start_pos=0)            # the tombstone: SWA first
    a.full_attn_allocator.free_segment(row[:4], start_pos=0)  # then the node's FULL
    assert a.full_attn_allocator.available_size() == a.full_available_size() == 15 * 4
    assert a.swa_attn_allocator.available_size() == a.swa_available_size() == 7 * 4
    assert a.full_attn_allocator.page_size == 4 and a.swa_attn_allocator.size == 8 * 4
    with pytest.raises(ContractError):
        a.swa_attn_allocator.alloc(4)
    with pytest.raises(ContractError):
        a.swa_attn_allocator.free(torch.tensor([4]))
    a.check()
