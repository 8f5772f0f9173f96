"""The seams against ``alloc.step`` of the same work, and the seams' contract for bad input.

Identity: a random continuous-batching workload with the prefix cache on (shared system
prompts, chunked prefill, finished requests cached, eviction inside the steps under
pressure) drives a seam on one allocator and, on a second allocator, a direct driver --
this file's own reading of the seam's contract, written against ``alloc.step`` /
``alloc.try_step`` and the cache's public calls (``match``, ``lock``, ``lookup``,
``add_entry``, ``unlock``). After every iteration both allocators' ``snapshot()`` (host
ledger and device tables) and prefix-cache states must be equal, and the seam must have
run exactly one step per iteration. A seam that records a kind in another order, frees
what it should not, or evicts differently fails it.

Contracts: malformed engine objects raise a typed graphalloc error naming the field;
unknown ids follow the one policy (a release of an unknown id is a no-op returning False,
every other call raises UnknownRequestError); every refused call changes nothing
(``alloc.snapshot()`` and the seam's own queries before and after).
"""

from __future__ import annotations

import dataclasses
import types
from collections import deque

import numpy as np
import pytest
import torch

import graphalloc as ga
from graphalloc.integrations.sglang import SGLangAllocator
from graphalloc.integrations.vllm import GraphallocKVCacheManager
from graphalloc.sharing.prefix_cache import page_keys

PS, WINDOW = 4, 17  # the allocator's window: 16


def make_pair(full=110, swa=70, handles=24, rows=12, cache=True):
    cfg = ga.AllocatorConfig(page_size=PS, num_full_pages=full, num_swa_pages=swa,
                             max_reqs=rows, max_context_len=128, sliding_window=WINDOW - 1,
                             max_handles=handles if cache else 0, max_alloc_rows=2 * rows,
                             max_tokens_per_alloc_row=32)
    return (ga.HybridAllocator(cfg, prefix_cache=cache),
            ga.HybridAllocator(cfg, prefix_cache=cache))


def cache_state(alloc):
    cache = alloc.prefix_cache
    if cache is None:
        return None
    d = cache.digest_state()
    return ([(e.handle, e.n_tokens, tuple(e.keys), e.lock_ref,
              None if e.parent is None else e.parent.handle) for e in d["entries"]],
            d["order"], d["counters"])


def assert_same(a, b):
    sa, sb = a.snapshot(), b.snapshot()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert np.array_equal(np.asarray(sa[key]), np.asarray(sb[key])), key
    assert cache_state(a) == cache_state(b)


def snap(alloc) -> dict:
    return {k: np.asarray(v).copy() for k, v in alloc.snapshot().items()}


def assert_unchanged(before: dict, alloc):
    after = alloc.snapshot()
    for key, value in before.items():
        assert np.array_equal(value, np.asarray(after[key])), key


def lowest_free_handle(alloc, reserved) -> int:
    taken = alloc.ledger.h_live.copy()
    taken[list(reserved)] = True
    free = np.flatnonzero(~taken)
    return int(free[0]) if len(free) else -1


class DirectInserts:
    """Cache inserts as takes of the next step, registered after it (the seams' rule)."""

    def __init__(self, alloc):
        self.alloc, self.cache = alloc, alloc.prefix_cache
        self.takes: list = []  # (handle, row, n, keys)
        self.release: list = []

    def insert(self, row, tokens) -> None:
        keys = page_keys(tokens, PS)
        n = min(len(keys), int(self.alloc.ledger.committed[row]) // PS) * PS
        if not n:
            return
        keys = keys[:n // PS]
        if any(t[3][-1] == keys[-1] for t in self.takes) or self.cache.lookup(keys) >= 0:
            return
        h = lowest_free_handle(self.alloc, [t[0] for t in self.takes])
        if h < 0:
            self.cache.evict(n_full=1)
            h = lowest_free_handle(self.alloc, [t[0] for t in self.takes])
            if h < 0:
                return
        self.takes.append((h, row, n, keys))

    def frees(self) -> dict:
        kw = {}
        if self.takes:
            kw["take"] = tuple(np.array([t[i] for t in self.takes], dtype=np.int64)
                               for i in range(3))
        if self.release:
            kw["release"] = np.array(self.release, dtype=np.int64)
        return kw

    def done(self) -> None:
        for h, _, _, keys in self.takes:
            self.cache.add_entry(h, keys)
        self.takes, self.release = [], []


# ---- SGLang ---------------------------------------------------------------------------------
@dataclasses.dataclass(eq=False)
class Req:
    rid: int
    origin_input_ids: list
    max_new: int
    req_pool_idx: int | None = None
    output_ids: list = dataclasses.field(default_factory=list)
    last_node: object = None
    kv_len: int = 0

    def finished(self) -> bool:
        return len(self.output_ids) >= self.max_new

    @property
    def fill_ids(self) -> list:
        return self.origin_input_ids + self.output_ids


@dataclasses.dataclass
class Batch:
    reqs: list
    prefix_lens: list | None = None
    extend_lens: list | None = None
    seq_lens_cpu: list | None = None


class DirectSGLang(DirectInserts):
    """The SGLang seam's iteration written against ``alloc.try_step``."""

    def __init__(self, alloc, interval):
        super().__init__(alloc)
        self.interval, self.rows, self.locks = interval, {}, {}

    def release_req(self, rid, tokens) -> None:
        row = self.rows.pop(rid)
        self.insert(row, tokens)
        self.release.append(row)

    def match(self, rid, tokens) -> int:
        hit = self.cache.match(tokens[:-1])
        if not hit.cached_tokens:
            return 0
        self.cache.lock(hit.handle)
        self.locks[rid] = hit.handle
        return hit.cached_tokens

    def _run(self, kw):
        out = self.alloc.try_step(ga.Step(**kw))
        if out is not None:
            self.done()
            for h in self.locks.values():
                self.cache.unlock(h)
            self.locks = {}
        return out

    def extend(self, items):
        """``items``: (rid, prefix, n, new) in batch order."""
        kw, rows = self.frees(), []
        adv, plain, on = ([], []), [], ([], [], [])
        reserved = []
        for rid, p, _, new in items:
            if new:
                row = self.alloc.free_row(reserved=reserved)
                reserved.append(row)
                rows.append(row)
                if p:
                    for lst, v in zip(on, (row, self.locks[rid], p), strict=True):
                        lst.append(v)
                else:
                    plain.append(row)
            else:
                row = self.rows[rid]
                rows.append(row)
                floor = max(p - (WINDOW - 1), 0) // PS * PS
                if floor > self.alloc.frontier(row):
                    adv[0].append(row)
                    adv[1].append(floor)
        if adv[0]:
            kw["advance"] = adv
        if plain:
            kw["admit"] = plain
        if on[0]:
            kw["admit_on"] = on
        kw["extend"] = (rows, [it[2] for it in items])
        if self._run(kw) is None:
            return None
        for (rid, *_), row in zip(items, rows, strict=True):
            self.rows[rid] = row
        return rows

    def decode(self, items):
        """``items``: (rid, kv_len) in batch order."""
        kw, rows, adv = self.frees(), [], ([], [])
        w = WINDOW - 1
        for rid, n in items:
            row = self.rows[rid]
            rows.append(row)
            f = self.alloc.frontier(row)
            floor = max(n - w, 0) // PS * PS
            if n - w >= f + self.interval and floor > f:
                adv[0].append(row)
                adv[1].append(floor)
        if adv[0]:
            kw["advance"] = adv
        kw["decode"] = rows
        return None if self._run(kw) is None else rows


@pytest.mark.parametrize("seed,interval", [(0, 1), (1, 3), (2, 8)])
def test_sglang_seam_equals_direct_steps_with_the_prefix_cache(seed, interval):
    rng = np.random.default_rng(seed)
    a, b = make_pair()
    seam, direct = SGLangAllocator(a, swa_eviction_interval=interval), DirectSGLang(b, interval)
    systems = [[1 + i for i in range(n)] for n in (12, 24)]
    # prompts drawn from a small pool, outputs a function of the position: equal requests
    # finish together sometimes, and insert one prefix twice in one iteration
    pool = [(systems[i % 2] + [1000 * (i + 1) + j for j in range(int(rng.integers(2, 20)))],
             int(rng.integers(1, 24))) for i in range(8)]
    reqs = deque(Req(i, *pool[int(rng.integers(0, 8))]) for i in range(36))
    waiting, running, chunked = deque(), [], None
    chunk, steps, n_extend = 16, 0, 0
    for _ in range(400):
        if not (reqs or waiting or running or chunked):
            break
        while reqs and rng.random() < 0.5:
            waiting.append(reqs.popleft())
        # process_batch_result's frees: released (inserted) with the next step
        for r in [r for r in running if r.finished()]:
            direct.release_req(r.rid, r.fill_ids[:r.kv_len])
        seam.release_finished(running)
        running = [r for r in running if not r.finished()]
        before, cache_before = a.steps_run, seam.cache_steps
        picks, items, budget = [], [], chunk
        if chunked is not None:
            n = min(len(chunked.fill_ids) - chunked.kv_len, budget)
            picks.append((chunked, chunked.kv_len, n))
            items.append((chunked.rid, chunked.kv_len, n, False))
            budget -= n
        while waiting and budget > 0 and len(running) + len(picks) < 5:
            r = waiting[0]
            p = seam.match_prefix(r)
            assert direct.match(r.rid, r.fill_ids) == p
            n = min(len(r.fill_ids) - p, budget)
            picks.append((waiting.popleft(), p, n))
            items.append((r.rid, p, n, True))
            budget -= n
        if picks:
            batch = Batch([r for r, _, _ in picks], [p for _, p, _ in picks],
                          [n for _, _, n in picks])
            out, rows = seam.prepare_for_extend(batch), direct.extend(items)
            assert (out is None) == (rows is None)
            if out is None:
                for r, _, _ in reversed(picks):
                    if r is not chunked:
                        waiting.appendleft(r)
                continue
            assert out.rows.tolist() == rows
            n_extend += 1
            chunked = None
            for r, p, n in picks:
                r.kv_len = p + n
                if r.kv_len == len(r.fill_ids):
                    r.output_ids.append(50_000 + r.kv_len)
                    running.append(r)
                else:
                    chunked = r
                    direct.insert(direct.rows[r.rid], r.fill_ids[:r.kv_len])
                    seam.cache_unfinished_req(r)
        elif running:
            batch = Batch(list(running), seq_lens_cpu=[r.kv_len for r in running])
            out = seam.prepare_for_decode(batch)
            rows = direct.decode([(r.rid, r.kv_len) for r in running])
            assert out is not None and out.rows.tolist() == rows
            for r in running:
                r.kv_len += 1
                r.output_ids.append(60_000 + r.kv_len)
        else:
            continue
        steps += 1
        # ONE step per iteration, inserts included (the cache's own step only when every
        # handle is held: its LRU leaf dropped to free one)
        assert a.steps_run - before - (seam.cache_steps - cache_before) == 1
        assert_same(a, b)
    assert n_extend > 10 and steps > 40
    assert a.prefix_cache.hits > 5 and len(a.prefix_cache) > 0
    assert a.audit() == []


# ---- vLLM -----------------------------------------------------------------------------------
class DirectVLLM(DirectInserts):
    """The vLLM facade's iteration written against ``alloc.step``."""

    def __init__(self, alloc):
        super().__init__(alloc)
        self.rows, self.computed, self.new, self.hits = {}, {}, set(), {}
        self.slots: dict = {}  # rid -> (row, kind, n, floor, trim, handle, hit), call order

    def free(self, rid, tokens) -> None:
        h = self.hits.pop(rid, None)
        if h is not None:
            self.cache.unlock(h)
        row = self.rows.pop(rid, None)
        if row is None:
            return
        self.slots.pop(rid, None)
        self.computed.pop(rid, None)
        if rid in self.new:
            self.new.remove(rid)
            return
        if tokens is not None:
            self.insert(row, tokens)
        self.release.append(row)

    def lookup(self, rid, tokens) -> int:
        hit = self.cache.match(tokens[:-1])
        if not hit.cached_tokens:
            return 0
        self.cache.lock(hit.handle)
        self.hits[rid] = hit.handle
        return hit.cached_tokens

    def allocate(self, rid, n_new, look, computed, n_hit) -> None:
        w, mml = WINDOW - 1, self.alloc.config.max_context_len
        if rid not in self.rows:
            row = self.alloc.free_row(reserved=[self.rows[r] for r in self.new])
            self.rows[rid] = row
            self.new.add(rid)
        row = self.rows[rid]
        if rid in self.new:
            kind = 2 if n_hit else 1
            length = computed = n_hit
            front, floor = 0, -1
        else:
            kind, length = 0, self.alloc.seq_len(row)
            front = self.alloc.frontier(row)
            floor = (computed - w) // PS * PS if computed > w else -1
            floor = floor if floor > front else -1
        target = min(computed + n_new + look, mml)
        n, trim = max(target - length, 0), -1
        if target < length and -(-target // PS) < -(-length // PS) and (
                front == 0 or target >= front + w):
            trim = target
        self.slots[rid] = (row, kind, n, floor, trim, self.hits.get(rid, -1), n_hit)
        self.computed[rid] = computed + n_new

    def run_step(self) -> None:
        kw, slots = self.frees(), list(self.slots.values())
        pick = {"trim": lambda s: s[4] >= 0, "advance": lambda s: s[3] >= 0}
        for kind, col in (("trim", 4), ("advance", 3)):
            sel = [s for s in slots if pick[kind](s)]
            if sel:
                kw[kind] = ([s[0] for s in sel], [s[col] for s in sel])
        plain = [s[0] for s in slots if s[1] == 1]
        on = [s for s in slots if s[1] == 2]
        ext = [s for s in slots if s[2] > 0]
        if plain:
            kw["admit"] = plain
        if on:
            kw["admit_on"] = ([s[0] for s in on], [s[5] for s in on], [s[6] for s in on])
        if ext:
            kw["extend"] = ([s[0] for s in ext], [s[2] for s in ext])
        if kw:
            self.alloc.step(ga.Step(**kw))
        self.done()
        for h in self.hits.values():
            self.cache.unlock(h)
        self.hits, self.slots, self.new = {}, {}, set()


@dataclasses.dataclass(eq=False)
class Request:
    rid: str
    prompt: list
    max_tokens: int
    computed: int = 0
    n_out: int = 0

    @property
    def tokens(self) -> list:
        return self.prompt + [70_000 + 13 * i for i in range(self.n_out)]


@pytest.mark.parametrize("seed,k", [(0, 0), (1, 2), (2, 3)])
def test_vllm_facade_equals_direct_steps_with_the_prefix_cache(seed, k):
    rng = np.random.default_rng(10 + seed)
    a, b = make_pair(full=120, swa=80, handles=20)
    mgr, direct = GraphallocKVCacheManager(a, enable_caching=True), DirectVLLM(b)
    systems = [[1 + i for i in range(n)] for n in (12, 20)]
    reqs = deque(Request(f"q{i}", systems[i % 2] + [5000 * (i + 1) + j for j in
                                                     range(int(rng.integers(2, 20)))],
                         int(rng.integers(1, 20))) for i in range(30))
    waiting, running, n_steps = deque(), [], 0
    for _ in range(400):
        if not (reqs or waiting or running):
            break
        while reqs and rng.random() < 0.5:
            waiting.append(reqs.popleft())
        before = a.steps_run
        scheduled, budget = [], 24
        kk = int(rng.integers(0, k + 1))
        for r in running:
            want = 1 + kk if r.computed >= len(r.prompt) else len(r.tokens) - r.computed
            n = min(want, budget)
            if n < 1:
                break
            assert mgr.allocate_slots(r.rid, n, kk, num_computed_tokens=r.computed) is not None
            direct.allocate(r.rid, n, kk, r.computed, 0)
            scheduled.append((r, n))
            budget -= n
        while waiting and budget > 0 and len(running) < 5:
            r = waiting.popleft()
            blocks, n_hit = mgr.get_computed_blocks(r.rid, r.tokens)
            assert direct.lookup(r.rid, r.tokens) == n_hit
            n = min(len(r.tokens) - n_hit, budget)
            got = mgr.allocate_slots(r.rid, n, kk, num_new_computed_tokens=n_hit,
                                     new_computed_blocks=blocks)
            assert got is not None
            direct.allocate(r.rid, n, kk, 0, n_hit)
            r.computed = n_hit
            running.append(r)
            scheduled.append((r, n))
            budget -= n
        work = mgr.pending_work
        mgr.run_step()
        direct.run_step()
        assert a.steps_run - before == (1 if work else 0) == mgr.steps_last_run
        n_steps += work
        assert_same(a, b)
        for r, n in scheduled:
            was_decoding = r.computed >= len(r.prompt)
            r.computed += n
            if was_decoding and kk:
                accepted = int(rng.integers(0, kk + 1))
                r.computed -= kk - accepted
                r.n_out += accepted + 1
            elif r.computed >= len(r.tokens):
                r.n_out += 1
        for r in [r for r in running if r.n_out >= r.max_tokens]:
            mgr.free(r.rid, r.tokens[:r.computed])
            direct.free(r.rid, r.tokens[:r.computed])
            running.remove(r)
        if rng.random() < 0.05 and running:  # a preemption: freed, computed blocks cached
            r = running.pop()
            mgr.free(r.rid, r.tokens[:r.computed])
            direct.free(r.rid, r.tokens[:r.computed])
            r.computed = 0
            waiting.appendleft(r)
    assert not running and n_steps > 40
    mgr.run_step()
    direct.run_step()
    assert_same(a, b)
    cache = a.prefix_cache
    assert cache.hits > 5 and cache.evicted_pages + cache.tombstoned_pages > 0
    assert a.audit() == []


# ---- contracts: typed errors, the unknown-id policy, nothing changed --------------------------
def sglang_state(seam):
    return (seam.available_size(), seam.n_recorded_releases, seam.pending.n_takes,
            seam.pending.frees_version)


def test_sglang_malformed_objects_raise_typed_errors_naming_the_field():
    a, _ = make_pair(cache=False)
    seam = SGLangAllocator(a)
    r = Req(0, list(range(8)), 4)
    assert seam.prepare_for_extend(Batch([r], [0], [8])) is not None
    r.kv_len = 8
    done = Req(1, list(range(4)), 1)
    seam.prepare_for_extend(Batch([done], [0], [4]))
    seam.release_kv_cache(done)  # a recorded release rides along, untouched by refusals
    before, state = snap(a), sglang_state(seam)
    cases = [
        (ga.ContractError, "prefix_lens", lambda: seam.prepare_for_extend(
            types.SimpleNamespace(reqs=[Req(2, [1], 1)], extend_lens=[1]))),
        (ga.ContractError, "seq_lens_cpu", lambda: seam.prepare_for_decode(
            types.SimpleNamespace(reqs=[r]))),
        (ga.ContractError, "extend_lens", lambda: seam.prepare_for_extend(
            Batch([r], [8], 59))),
        (ga.ContractError, "extend_lens", lambda: seam.prepare_for_extend(
            Batch([r], [8], [1, 2]))),
        (ga.PositionError, "seq_lens_cpu", lambda: seam.prepare_for_decode(
            Batch([r], seq_lens_cpu=[None]))),
        (ga.PositionError, "seq_lens_cpu", lambda: seam.prepare_for_decode(
            Batch([r], seq_lens_cpu=[8.0]))),
        (ga.ContractError, "reqs", lambda: seam.prepare_for_decode(
            Batch(None, seq_lens_cpu=[8]))),
        (ga.UnknownRequestError, "req_pool_idx", lambda: seam.prepare_for_decode(
            Batch([types.SimpleNamespace()], seq_lens_cpu=[8]))),
        (ga.UnknownRequestError, "req_pool_idx", lambda: seam.prepare_for_decode(
            Batch([types.SimpleNamespace(req_pool_idx=1.0)], seq_lens_cpu=[8]))),
        (ga.UnknownRequestError, "req_pool_idx", lambda: seam.prepare_for_decode(
            Batch([types.SimpleNamespace(req_pool_idx=10 ** 30)], seq_lens_cpu=[8]))),
        (ga.UnknownRequestError, "req_pool_idx", lambda: seam.prepare_for_decode(
            Batch([types.SimpleNamespace(req_pool_idx=-3)], seq_lens_cpu=[8]))),
        (ga.UnknownRequestError, "req_pool_idx", lambda: seam.release_kv_cache(
            types.SimpleNamespace())),
        (ga.UnknownRequestError, "req_pool_idx", lambda: seam.release_kv_cache(
            types.SimpleNamespace(req_pool_idx="0"))),
        (ga.PositionError, "translate_loc_from_full_to_swa", lambda:
            seam.translate_loc_from_full_to_swa(torch.tensor([a.full_to_swa.shape[0]]))),
        (ga.PositionError, "translate_loc_from_full_to_swa", lambda:
            seam.translate_loc_from_full_to_swa([-1])),
        (ga.PositionError, "full_slots", lambda: seam.translate_loc_from_full_to_swa([1.5])),
    ]
    for error, field, call in cases:
        with pytest.raises(error, match=field):
            call()
        assert_unchanged(before, a)
        assert sglang_state(seam) == state
    assert r.req_pool_idx is not None and seam.prepare_for_decode(
        Batch([r], seq_lens_cpu=torch.tensor([8]))) is not None


def test_sglang_unknown_requests_follow_the_one_policy():
    a, _ = make_pair(cache=False)
    seam = SGLangAllocator(a)
    r = Req(0, list(range(8)), 4)
    seam.prepare_for_extend(Batch([r], [0], [8]))
    r.kv_len = 8
    gone = Req(1, list(range(4)), 1)
    assert seam.release_kv_cache(gone) is False  # holds no KV here: a no-op
    assert seam.release_kv_cache(r) is True and r.req_pool_idx is None
    assert seam.release_kv_cache(r) is False  # released already: unknown now, a no-op
    before, state = snap(a), sglang_state(seam)
    stale = Req(2, [1], 1, req_pool_idx=0)  # the row released in this iteration
    for call in (lambda: seam.release_kv_cache(stale),
                 lambda: seam.prepare_for_decode(Batch([stale], seq_lens_cpu=[8])),
                 lambda: seam.prepare_for_decode(Batch([r], seq_lens_cpu=[8])),
                 lambda: seam.prepare_for_decode(
                     Batch([Req(3, [1], 1, req_pool_idx=5)], seq_lens_cpu=[0]))):
        with pytest.raises(ga.UnknownRequestError):
            call()
        assert_unchanged(before, a)
        assert sglang_state(seam) == state


def vllm_state(mgr):
    return (len(mgr), mgr.get_num_free_blocks(), mgr.pending_work, mgr.pending.frees_version)


class Unhashable:
    __hash__ = None


def test_vllm_unknown_and_unhashable_ids_follow_the_one_policy():
    a, _ = make_pair(cache=True)
    mgr = GraphallocKVCacheManager(a, enable_caching=True)
    assert mgr.allocate_slots("a", 8) is not None
    mgr.run_step()
    assert mgr.allocate_slots("a", 1, num_computed_tokens=8) is not None  # recorded work
    before, state = snap(a), vllm_state(mgr)
    assert mgr.free("never-seen") is False and mgr.free("never-seen", [1, 2]) is False
    assert_unchanged(before, a)
    assert vllm_state(mgr) == state
    unknown = [lambda: mgr.get_block_ids("x"), lambda: mgr.token_slots("x", 0, 1),
               lambda: mgr.row_of("x"), lambda: mgr.num_computed_tokens("x"),
               lambda: mgr.num_allocated_tokens("x"), lambda: mgr.cache_blocks("x", [1] * 8)]
    bad = [lambda: mgr.allocate_slots([1], 1), lambda: mgr.free({}),
           lambda: mgr.get_block_ids(Unhashable()), lambda: mgr.token_slots([], 0, 1),
           lambda: mgr.get_computed_blocks([], [1, 2, 3]), lambda: mgr.cache_blocks([], [1]),
           lambda: mgr.num_allocated_tokens([]), lambda: [] in mgr]
    for call in unknown + bad:
        with pytest.raises(ga.UnknownRequestError):
            call()
        assert_unchanged(before, a)
        assert vllm_state(mgr) == state
    for call, error in ((lambda: mgr.allocate_slots("b", "4"), ga.ContractError),
                        (lambda: mgr.allocate_slots("b", 4, num_computed_tokens=-1),
                         ga.ContractError),
                        (lambda: mgr.allocate_slots("b", 4, True), ga.ContractError),
                        (lambda: mgr.token_slots("a", 0, 1.0), ga.ContractError)):
        with pytest.raises(error):
            call()
        assert_unchanged(before, a)
        assert vllm_state(mgr) == state and "b" not in mgr
    mgr.run_step()
    assert mgr.free("a") is True and mgr.free("a") is False


def test_page_queries_are_the_planners_dry_runs_once_per_version():
    """What recorded frees give back is the planner's dry run (takes included: an inserted
    request frees only what its entry does not hold), made once per version of the records:
    SGLang's PrefillAdder asks available_size() per candidate at O(1)."""
    a, _ = make_pair(cache=True)
    seam = SGLangAllocator(a)
    reqs = [Req(i, [7 * i + j for j in range(10)], 1) for i in range(3)]
    seam.prepare_for_extend(Batch(reqs, [0, 0, 0], [10, 10, 10]))
    calls = []
    dry_run = a.dry_run

    def counting(step, **kw):
        calls.append(step.kinds())
        return dry_run(step, **kw)

    a.dry_run = counting
    free0 = seam.full_available_size()
    assert calls == []  # nothing recorded: n_free, no plan
    for r in reqs[:2]:
        r.kv_len = 10
        seam.release_kv_cache(r)  # an insert (take) and a release each
    sizes = {seam.full_available_size() for _ in range(50)}
    seam.available_size(), seam.swa_available_size()
    assert calls == [["take", "release"]]  # one dry run for 52 queries
    # each request: 3 pages, 2 whole ones kept by its new entry: 1 freed per request
    assert sizes == {free0 + 2 * PS}
    seam.evictable_size(), seam.evictable_size()
    assert len(calls) == 1  # nothing in the cache to reclaim yet: no plan
    seam.flush()
    assert a.n_free("full") * PS == free0 + 2 * PS and len(a.prefix_cache) == 2
    assert seam.full_evictable_size() == 4 * PS and len(calls) == 2  # the entries' pages
    assert seam.evictable_size() <= 4 * PS and len(calls) == 2
    seam.release_kv_cache(reqs[2])  # a new version of the records
    seam.available_size(), seam.available_size()
    assert len(calls) == 3
