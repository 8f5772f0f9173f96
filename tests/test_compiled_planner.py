"""The compiled planner against the numpy planner, byte for byte.

Two allocators get identical inputs: one plans with the numpy planner (the reference), one
with the compiled planner (``planner="compiled"``; steps it does not cover fall back to the
numpy planner, which is part of what is compared). After every operation the two must have
the same descriptor buffers (every row of every pinned buffer), the same ledger arrays, the
same page mirror (ids, rings and reference counts), the same free-ring heads and counts, the
same results and planned-step counts, the same error type for a refused operation, and --
the eager CPU executor having run every step -- the same device tables.

Random sequences cover pool mode with shared pages (handles taken, admitted on, dropped and
tombstoned interleaved, so later compiled steps free pages with reference counts > 1, and a
prefix cache reclaiming inside a step), speculative decoding planned in C (commits of any
count, trims, lookahead decodes one or two steps in flight, in one step with releases,
evictions and extends; counted: the C planner planned them), ring mode, page sizes 1, 3,
16 and 64, int32 and int64 tables, rows split at ``max_pages_per_row``, every frozen shape
exceeded, capacity shortage and invalid steps of every kind. A refused step is checked to
change nothing, with the C planner's own rollback tested directly (not hidden by the numpy
fallback).
"""

from __future__ import annotations

import gc
import os
import weakref

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import graphalloc.plan.compiled as fast_plan
from graphalloc import (
    AllocatorConfig,
    ConfigError,
    ContractError,
    HybridAllocator,
    StaleResultError,
)
from graphalloc.state.ledger import Ledger

if os.environ.get("CI") and not fast_plan.AVAILABLE:  # CI must build it: never skip there
    raise AssertionError(f"the compiled planner was not built: {fast_plan.UNAVAILABLE_REASON}")
pytestmark = pytest.mark.skipif(not fast_plan.AVAILABLE,
                                reason=f"compiled planner not built: "
                                       f"{fast_plan.UNAVAILABLE_REASON}")

CONFIGS = {
    # name: (AllocatorConfig kwargs, allocator kwargs)
    "pool-ps16-shared": (dict(page_size=16, num_full_pages=48, num_swa_pages=20, max_reqs=6,
                              max_context_len=256, sliding_window=31, max_handles=4,
                              max_tokens_per_alloc_row=48), {}),
    "pool-ps1-shared-i32": (dict(page_size=1, num_full_pages=120, num_swa_pages=40,
                                 max_reqs=5, max_context_len=64, sliding_window=9,
                                 max_handles=3, index_dtype=torch.int32), {}),
    "pool-ps3-tight": (dict(page_size=3, num_full_pages=40, num_swa_pages=24, max_reqs=5,
                            max_context_len=48, sliding_window=7, max_handles=3,
                            max_pages_per_row=2, max_alloc_rows=3, max_step_tokens=20,
                            max_tokens_per_alloc_row=12), {"tight": True}),
    "pool-ps64-i32": (dict(page_size=64, num_full_pages=16, num_swa_pages=8, max_reqs=4,
                           max_context_len=320, sliding_window=100,
                           max_tokens_per_alloc_row=70, index_dtype=torch.int32), {}),
    "pool-ps16-cache": (dict(page_size=16, num_full_pages=24, num_swa_pages=14, max_reqs=5,
                             max_context_len=192, sliding_window=20, max_handles=4,
                             max_tokens_per_alloc_row=48, max_step_tokens=128),
                        {"prefix_cache": True}),
    "ring-ps16": (dict(page_size=16, num_full_pages=40, num_swa_pages=24, max_reqs=5,
                       max_context_len=256, sliding_window=31, swa_ring_pages=3,
                       max_tokens_per_alloc_row=48), {}),
    "ring-ps3-split-i32": (dict(page_size=3, num_full_pages=60, num_swa_pages=30, max_reqs=5,
                                max_context_len=60, sliding_window=8, swa_ring_pages=4,
                                max_pages_per_row=2, index_dtype=torch.int32),
                           {"tight": True}),
    "ring-ps1": (dict(page_size=1, num_full_pages=80, num_swa_pages=40, max_reqs=4,
                      max_context_len=40, sliding_window=5, swa_ring_pages=7), {}),
}


def make_config(name: str) -> tuple[AllocatorConfig, dict]:
    kwargs, extra = CONFIGS[name]
    kwargs = dict(kwargs, backend="torch", device="cpu")
    if extra.get("tight"):  # every frozen release shape at its minimum: steps exceed them
        probe = AllocatorConfig(**kwargs)
        kwargs.update(max_release_rows=probe.min_release_rows,
                      max_step_pages=probe.min_step_pages)
    return AllocatorConfig(**kwargs), {"prefix_cache": extra.get("prefix_cache", False)}


# ---- the pair -------------------------------------------------------------------------------
class Pair:
    """A numpy-planned and a compiled-planned allocator fed identically."""

    def __init__(self, name: str):
        cfg, kwargs = make_config(name)
        self.cfg = cfg
        self.ref = HybridAllocator(cfg, planner="numpy", **kwargs)
        self.fast = HybridAllocator(cfg, planner="compiled", **kwargs)
        assert self.ref._fast is None and self.fast._fast is not None
        self.n_ops = 0
        self.n_spec_planned = {"commit": 0, "trim": 0, "lookahead": 0}  # planned in C

    def apply(self, fn):
        """``fn(alloc)`` on both; the same error type or none; the same result."""
        out, err = [], []
        for alloc in (self.ref, self.fast):
            try:
                out.append(fn(alloc))
                err.append(None)
            except ContractError as exc:
                out.append(None)
                err.append(type(exc))
        assert err[0] == err[1], f"numpy raised {err[0]}, compiled {err[1]}"
        self.compare_results(*out)
        self.n_ops += 1
        return out[0], err[0]

    @staticmethod
    def compare_results(a, b) -> None:
        if hasattr(a, "n_step_tokens") or hasattr(b, "n_step_tokens"):
            for name in ("rows", "first_lane", "n_tokens"):
                x, y = getattr(a, name), getattr(b, name)
                assert x.dtype == y.dtype and np.array_equal(x, y), name
            assert a.n_step_tokens == b.n_step_tokens
            assert torch.equal(a.full_slots, b.full_slots)
            assert torch.equal(a.swa_slots, b.swa_slots)
        elif hasattr(a, "buffer_index") or hasattr(b, "buffer_index"):  # PlannedSteps
            for name in ("buffer_index", "n_release_rows", "n_alloc_rows", "n_tokens",
                         "pages_freed", "pages_allocated", "fusable", "pages_evicted"):
                assert getattr(a, name) == getattr(b, name), name
            Pair.compare_results(a.result, b.result)
        else:
            assert a == b or (a is None and b is None), (a, b)

    def compare(self, device: bool = False) -> None:
        ra, fa = self.ref, self.fast
        lr, lf = ra.ledger, fa.ledger
        for name in Ledger.ROW_ARRAYS + Ledger.HANDLE_ARRAYS:
            x, y = getattr(lr, name), getattr(lf, name)
            assert x.dtype == y.dtype and np.array_equal(x, y), f"ledger.{name}"
        assert (lr.full.head, lr.full.n_free) == (lf.full.head, lf.full.n_free)
        assert (lr.swa.head, lr.swa.n_free) == (lf.swa.head, lf.swa.n_free)
        assert type(lr.full.head) is int and type(lf.full.n_free) is int
        if lr.refs is not None:
            for name in lr.refs.NAMES:
                assert np.array_equal(getattr(lr.refs, name), getattr(lf.refs, name)), name
        for i, (x, y) in enumerate(zip(ra.ring.np_bufs, fa.ring.np_bufs, strict=True)):
            assert np.array_equal(x, y), f"descriptor buffer {i}"
        assert ra.ring.used == fa.ring.used and ra.ring.fusable == fa.ring.fusable
        assert ra.steps_run == fa.steps_run
        assert (ra.executor.n_fused, ra.executor.n_two_launch) == (
            fa.executor.n_fused, fa.executor.n_two_launch)
        if device:
            for name, t in ra.state.tables().items():
                assert torch.equal(t, fa.state.tables()[name]), f"device table {name}"


# ---- random steps ---------------------------------------------------------------------------
def _form(rng, rows):
    """The same rows as a numpy array, a list, a tuple or (one row) a Python int."""
    rows = np.asarray(rows, dtype=np.int64)
    k = rng.integers(0, 4)
    if k == 0:
        return rows
    if k == 1 or (k == 3 and len(rows) != 1):
        return [int(r) for r in rows]
    if k == 2:
        return tuple(int(r) for r in rows)
    return int(rows[0])


def _subset(rng, rows, p_keep):
    return rows[rng.random(len(rows)) < p_keep] if len(rows) else rows


def step_args(pair: Pair, rng) -> dict:
    """A random combined step, sometimes broken (a dead or repeated row, a misaligned or
    backward frontier, a decode and extend of one row, too long)."""
    cfg, led = pair.cfg, pair.ref.ledger
    ps, live = cfg.page_size, np.flatnonzero(led.live)
    dead = np.flatnonzero(~led.live)
    args: dict = {}
    rest = live
    if rng.random() < 0.25 and len(live):
        rel = _subset(rng, live, 0.3)
        rest = np.setdiff1d(live, rel)
        args["release"] = _form(rng, rel) if len(rel) else None
    if rng.random() < 0.5:
        args["evict_all"] = True
    elif rng.random() < 0.3 and len(rest):
        args["evict"] = _form(rng, _subset(rng, rest, 0.5))
    if rng.random() < 0.25 and len(rest):
        rows = _subset(rng, rest, 0.4)
        base = led.frontier[rows]
        if args.get("evict_all") or "evict" in args:  # past the window rule's move
            base = np.maximum(base, np.maximum(led.seq_len[rows] - cfg.sliding_window, 0)
                              // ps * ps)
        target = np.minimum(base + ps * rng.integers(0, 3, len(rows)), led.seq_len[rows]
                            // ps * ps)
        target = np.maximum(target, base)
        if rng.random() < 0.1 and len(rows):
            target[0] += rng.choice([1, -ps, 3 * ps])  # misaligned, backward or too far
        pos = [int(t) for t in target] if rng.random() < 0.5 else target
        if len(rows) > 1 and rng.random() < 0.2:
            pos = int(target[0])  # one position broadcast to every row
        args["advance"] = (_form(rng, rows), pos)
    spec = led.spec_steps
    committing = rest[:0]
    if rng.random() < 0.35 and len(rest):  # commit the oldest step's accepted counts
        committing = _subset(rng, rest[spec[rest, 0] > 0], 0.7)
        if rng.random() < 0.05:  # broken: a row with nothing to commit
            committing = np.union1d(committing, rest[:1])
        n = [int(rng.integers(0, s + 1)) for s in spec[committing, 0]]
        if rng.random() < 0.05 and len(n):
            n[0] += 1  # broken: more accepted than drafted
        if len(n) > 1 and rng.random() < 0.15:
            n = int(min(n))  # one count broadcast to every row
        elif rng.random() < 0.5:
            n = np.asarray(n, dtype=np.int64)
        args["commit"] = (_form(rng, committing), n)
    if rng.random() < 0.15 and len(rest):  # trim: back to C, a page boundary or L
        rows = _subset(rng, np.setdiff1d(rest, committing), 0.5)
        f, length = led.frontier[rows], led.seq_len[rows]
        low = np.where(f > 0, f + cfg.sliding_window, 0)
        pick = rng.integers(0, 3, len(rows))
        new = np.where(pick == 0, led.committed[rows],
                       np.where(pick == 1, led.committed[rows] // ps * ps, length))
        new = np.minimum(np.maximum(new, low), length)
        if rng.random() < 0.1 and len(rows):
            # broken: below f + W, or past L (a negative length is the numpy planner's
            # own matter: the C planner refuses it to the numpy planner)
            new[0] = low[0] - 1 if low[0] > 0 and rng.random() < 0.5 else length[0] + 1
        args["trim"] = (_form(rng, rows), [int(x) for x in new] if rng.random() < 0.5
                        else new)
    room = rest[led.seq_len[rest] < cfg.max_context_len - 4]
    lookahead = rng.random() < 0.4
    if lookahead:  # verify tokens: rows with a free speculative slot (after the commit)
        free_slot = (spec[room, -1] == 0) | np.isin(room, committing)
        if rng.random() < 0.9:
            room = room[free_slot]
    elif rng.random() < 0.9:  # mostly rows without a speculative tail (a plain decode of
        # one is refused: commit first; all of it committed in this step is fine)
        room = room[(spec[room, 0] == 0) | (np.isin(room, committing) & (spec[room, 1] == 0))]
    decode = _subset(rng, room, 0.7) if rng.random() < 0.8 else room[:0]
    if len(decode):
        args["decode"] = _form(rng, decode)
        if lookahead:
            k = rng.integers(0, 4, len(decode))
            args["lookahead"] = int(k[0]) if rng.random() < 0.5 else (
                [int(x) for x in k] if rng.random() < 0.5 else k)
    elif lookahead and rng.random() < 0.1:
        args["lookahead"] = 1  # broken: lookahead without decode rows
    if rng.random() < 0.35:
        rows = _subset(rng, np.setdiff1d(room, decode), 0.6)
        big = rng.random() < 0.3  # long chunks: the pools run short (refused after frees)
        n = rng.integers(0, cfg.max_tokens_per_alloc_row if big else 3 * ps + 2, len(rows))
        n = np.minimum(n, cfg.max_context_len - led.seq_len[rows])
        if rng.random() < 0.3 and len(rows) > 1:
            n = int(n.min())  # one count broadcast to every row
        else:
            n = [int(x) for x in n] if rng.random() < 0.5 else n
        args["extend"] = (_form(rng, rows), n)
    roll = rng.random()  # broken steps: the numpy planner must raise, the same error
    if roll < 0.03 and len(dead):
        key = rng.choice(["release", "evict", "decode"])
        args[key] = [int(dead[0])]
    elif roll < 0.05 and len(live):
        args["decode"] = [int(live[0]), int(live[0])]
    elif roll < 0.07 and len(decode):
        args["extend"] = ([int(decode[0])], [1])
    elif roll < 0.09 and len(live):
        args["extend"] = ([int(live[-1])], [cfg.max_context_len])
    elif roll < 0.10 and "release" in args and args["release"] is not None and len(live):
        args["decode"] = args["release"]  # released earlier in this step
    elif roll < 0.11 and "release" in args and args["release"] is not None:
        args["commit"] = (args["release"], 0)  # released earlier in this step
    return args


def other_op(pair: Pair, rng) -> None:
    """Operations the numpy planner plans in both allocators: admits, handles, groups."""
    cfg, led = pair.cfg, pair.ref.ledger
    ps, live = cfg.page_size, np.flatnonzero(led.live)
    roll = rng.random()
    if roll < 0.45 or len(live) == 0:
        row, err = pair.apply(lambda a: a.admit())
        if err is None:
            n = int(min(cfg.max_context_len - 1, rng.integers(1, 4 * ps + 3)))
            pair.apply(lambda a: a.alloc_extend([row], [n]))
        return
    if roll < 0.55:
        rel = _subset(rng, live, 0.3)
        pair.apply(lambda a: _group(a, rel))
        return
    spec = led.spec_steps
    if roll < 0.62:  # speculative decoding: later compiled steps see rows with a tail
        rows = _subset(rng, live[led.seq_len[live] < cfg.max_context_len - 8], 0.5)
        if len(rows):
            k = int(rng.integers(0, 4))
            pair.apply(lambda a: a.step(evict_all=True, decode=rows, lookahead=k))
        return
    if roll < 0.68:
        rows = live[spec[live, 0] > 0]
        if len(rows):
            n = [int(rng.integers(0, s + 1)) for s in spec[rows, 0]]
            pair.apply(lambda a: a.step(commit=(rows, n), evict_all=True))
        return
    if led.n_handles == 0 or cfg.ring_mode:
        pair.apply(lambda a: a.evict_window())
        return
    held = pair.ref.live_handles()
    cache = pair.ref.prefix_cache
    if cache is not None and roll < 0.8:
        r = int(rng.choice(live))
        tokens = np.arange(int(led.seq_len[r]))  # every row shares one prompt's prefix
        pair.apply(lambda a: a.prefix_cache.insert(r, tokens))
        return
    if roll < 0.7 or len(held) == 0:
        r = int(rng.choice(live))
        n = int(led.seq_len[r]) // ps * ps
        if n:
            n = int(rng.integers(1, n // ps + 1)) * ps
            pair.apply(lambda a: a.take_handle(r, n))
        return
    h = int(rng.choice(held))
    if roll < 0.85:
        row, err = pair.apply(lambda a: a.admit(handle=h))
        n = int(rng.integers(0, 2 * ps))  # drawn once: both allocators get the same step
        if err is None:
            pair.apply(lambda a: a.alloc_extend([row], [n]))
    elif roll < 0.92:
        pair.apply(lambda a: a.drop_handle_swa(h))
    else:
        pair.apply(lambda a: a.drop_handle(h))


def _group(alloc, rows) -> None:
    with alloc.free_group():
        alloc.evict_window()
        if len(rows):
            alloc.release(rows)


def run_step(pair: Pair, rng, args: dict) -> None:
    """One step through step(), plan() + run(), or try_step(); counts the speculative
    operations the C planner planned."""
    fast = pair.fast._fast
    before = fast.n_planned
    _run_step(pair, rng, args)
    if fast.n_planned > before:
        for key in pair.n_spec_planned:
            pair.n_spec_planned[key] += key in args


def _run_step(pair: Pair, rng, args: dict) -> None:
    how = rng.random()
    if how < 0.15:
        def plan_run(a):
            planned = a.plan(**args)
            a.run(planned)
            return planned
        pair.apply(plan_run)
    elif how < 0.25:
        pair.apply(lambda a: a.try_step(**args))
    else:
        pair.apply(lambda a: a.step(**args))


def drive(name: str, seed: int, n_steps: int) -> Pair:
    pair = Pair(name)
    rng = np.random.default_rng(seed)
    for i in range(n_steps):
        if rng.random() < 0.25:
            other_op(pair, rng)
        else:
            run_step(pair, rng, step_args(pair, rng))
        pair.compare(device=i % 16 == 0)
    pair.compare(device=True)
    assert pair.fast.audit() == [] and pair.ref.audit() == []
    return pair


@pytest.mark.parametrize("name", list(CONFIGS))
@settings(max_examples=4, derandomize=True, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1))
def test_random_steps_match_the_numpy_planner(name, seed):
    pair = drive(name, seed, 70)
    fast = pair.fast._fast
    # the comparison means something only if most steps were planned in C
    assert fast.n_planned >= 0.5 * (fast.n_planned + fast.n_fallback), (
        fast.n_planned, fast.n_fallback)
    SPEC_PLANNED.setdefault(name, {"commit": 0, "trim": 0, "lookahead": 0})
    for key, n in pair.n_spec_planned.items():
        SPEC_PLANNED[name][key] += n


SPEC_PLANNED: dict = {}  # per config: speculative operations the C planner planned


@pytest.mark.parametrize("name", list(CONFIGS))
def test_random_speculative_steps_were_planned_in_c(name):
    """The random steps above planned commits, trims and lookahead decodes in C (not only
    through the numpy fallback): the byte comparison covered them."""
    if name not in SPEC_PLANNED:  # run alone: drive one sequence here
        test_random_steps_match_the_numpy_planner(name)
    counts = SPEC_PLANNED[name]
    assert counts["commit"] > 0 and counts["lookahead"] > 0 and counts["trim"] > 0, counts


@pytest.mark.parametrize("name", ["pool-ps16-shared", "pool-ps3-tight", "ring-ps16", "ring-ps1"])
def test_workload_speculative_rounds_are_planned_in_c(name):
    """tests/workload.py's random steps (speculative rounds commit + evict + lookahead
    decode, overlap, trims, handles, groups) on both allocators: byte-identical, and the
    speculative ones were planned in C."""
    from workload import random_step

    pair = Pair(name)
    rng = np.random.default_rng(7)
    fast = pair.fast._fast
    planned = {"spec_round": 0, "spec_overlap": 0, "trim": 0}
    drawn = dict(planned)
    for i in range(200):
        before = fast.n_planned
        what = random_step([pair.ref, pair.fast], rng)
        if what in planned:
            drawn[what] += 1
            planned[what] += fast.n_planned > before
        pair.compare(device=i % 25 == 0)
    pair.compare(device=True)
    assert planned["spec_round"] > 0 and planned["spec_overlap"] > 0, planned
    assert planned["trim"] == drawn["trim"], (planned, drawn)  # (the drawn trims are valid)
    assert pair.fast.audit() == []


def test_shared_pages_freed_by_compiled_steps():
    """Rows admitted on one handle hold pages with counts > 1; a compiled release of all of
    them and an eviction free each shared page once, in the rule's push order."""
    pair = Pair("pool-ps16-shared")
    r, _ = pair.apply(lambda a: a.admit())
    pair.apply(lambda a: a.alloc_extend([r], [40]))
    pair.apply(lambda a: a.alloc_extend([r], [30]))
    h, _ = pair.apply(lambda a: a.take_handle(r, 64))
    rows = [pair.apply(lambda a: a.admit(handle=h))[0] for _ in range(3)]
    pair.apply(lambda a: a.alloc_extend(rows, [5, 20, 0]))
    pair.apply(lambda a: a.drop_handle(h))
    assert pair.ref.ledger.full_ref.max() == 4
    n_before = pair.fast._fast.n_planned
    for _ in range(20):
        pair.apply(lambda a: a.step(evict_all=True, decode=[r] + rows))
        pair.compare()
    pair.apply(lambda a: a.step(release=[rows[0], r], evict_all=True, decode=rows[1:]))
    pair.compare(device=True)
    pair.apply(lambda a: a.step(release=rows[1:]))
    pair.compare(device=True)
    assert pair.fast._fast.n_planned == n_before + 22
    assert pair.ref.ledger.full.n_free == pair.cfg.num_full_pages
    assert pair.fast.audit() == []


def test_an_eviction_frees_around_pages_another_window_still_holds():
    """Two rows share a prefix; the one whose window has moved further evicts past the
    other's frontier: its freed pages are the prefix pages below the other's window and
    its own pages after the prefix -- two runs of one row, not one."""
    pair = Pair("pool-ps16-shared")
    ps = pair.cfg.page_size
    a, _ = pair.apply(lambda x: x.admit())
    pair.apply(lambda x: x.alloc_extend([a], [48]))
    pair.apply(lambda x: x.alloc_extend([a], [16]))
    h, _ = pair.apply(lambda x: x.take_handle(a, 4 * ps))
    b, _ = pair.apply(lambda x: x.admit(handle=h))
    pair.apply(lambda x: x.drop_handle(h))
    pair.apply(lambda x: x.advance_frontier([b], [2 * ps]))  # b's window: pages 2, 3
    pair.apply(lambda x: x.alloc_extend([a], [2 * ps]))  # a: pages 0..5
    before = pair.fast._fast.n_planned
    pair.apply(lambda x: x.step(advance=([a], [6 * ps])))
    assert pair.fast._fast.n_planned == before + 1
    pair.compare(device=True)
    buf = pair.ref.ring.np_bufs[(pair.ref.steps_run - 1) % len(pair.ref.ring)]
    assert buf[:2, 1].tolist() == [0, 4 * ps] and buf[:2, 2].tolist() == [2, 2]
    assert pair.fast.audit() == []


@pytest.mark.parametrize("name", ["pool-ps16-shared", "ring-ps16"])
def test_rows_with_a_speculative_tail(name):
    """Rows with speculative steps in flight (the numpy planner's lookahead decodes): the
    compiled steps evict them by the committed length, refuse a frontier past it, release
    them (committed and spec_steps zeroed) and decode the other rows."""
    pair = Pair(name)
    ps, w = pair.cfg.page_size, pair.cfg.sliding_window
    a, _ = pair.apply(lambda x: x.admit())
    b, _ = pair.apply(lambda x: x.admit())
    for _ in range(-(-(w + 3 * ps) // 24)):
        pair.apply(lambda x: x.step(evict_all=True, extend=([a, b], [24, 24])))
    fast = pair.fast._fast
    for k in (3, 2):  # two speculative steps in flight on a
        pair.apply(lambda x, k=k: x.step(evict_all=True, decode=[a], lookahead=k))
    assert pair.ref.spec_len(a) == 7
    n = fast.n_planned
    for _ in range(2 * ps):  # a's window follows C while b decodes
        pair.apply(lambda x: x.step(evict_all=True, decode=[b]))
        pair.compare()
    assert fast.n_planned == n + 2 * ps
    c = pair.ref.committed_len(a)
    limit = c // ps * ps
    _, err = pair.apply(lambda x: x.step(advance=([a], [limit + ps])))
    assert err is not None and fast.last_refusal == fast_plan._cplan.R_POSITIONS
    pair.apply(lambda x: x.step(advance=([a], [limit]), decode=[b]))
    assert fast.last_refusal == 0
    _, err = pair.apply(lambda x: x.step(decode=[a]))  # a plain decode of a tail: refused
    assert err is not None and err.__name__ == "SpeculativeStateError"
    pair.apply(lambda x: x.step(release=[a], evict_all=True, decode=[b]))
    assert fast.last_refusal == 0
    pair.compare(device=True)
    assert pair.fast.audit() == []


def _plan_run(**args):
    """plan() then run(): the PlannedStep (its pages freed and allocated)."""
    def fn(alloc):
        planned = alloc.plan(**args)
        alloc.run(planned)
        return planned
    return fn


def _in_c(pair: Pair, fn):
    """``fn`` on both allocators: no error, and the compiled one planned it in C."""
    fast = pair.fast._fast
    n = fast.n_planned
    out, err = pair.apply(fn)
    assert err is None, err
    assert fast.n_planned == n + 1, fast.last_refusal
    pair.compare(device=True)
    return out


def _refused(pair: Pair, code: int, error: str, **args) -> None:
    """The C planner refuses ``step(**args)`` with ``code`` and changes nothing; the step
    then raises ``error`` in both allocators, nothing changed."""
    alloc, fast = pair.fast, pair.fast._fast
    before = _state(alloc)
    got = fast.plan(alloc, args.get("release"), args.get("evict"), args.get("evict_all", False),
                    args.get("advance"), args.get("decode"), args.get("extend"),
                    args.get("commit"), args.get("trim"), args.get("lookahead"))
    assert got is None and fast.last_refusal == code, (got, fast.last_refusal)
    _assert_same(before, _state(alloc))
    _, err = pair.apply(lambda a: a.step(**args))
    assert err is not None and err.__name__ == error, err
    _assert_same(before, _state(alloc))
    pair.compare(device=True)


@pytest.mark.parametrize("name", ["pool-ps16-shared", "ring-ps16", "pool-ps3-tight"])
def test_speculative_rounds_planned_in_c(name):
    """A speculative engine's rounds, each ``step(commit=, evict=, decode=, lookahead=)``
    planned in C: drafts across a page boundary, all rejected (the new page freed, the
    partial page kept) and all accepted, two steps in flight (overlap) and a third refused,
    a commit that keeps the later step, a plain decode once the tail is resolved, a
    release of rows with a tail."""
    pair = Pair(name)
    ps, led = pair.cfg.page_size, lambda: pair.ref.ledger
    a, _ = pair.apply(lambda x: x.admit())
    b, _ = pair.apply(lambda x: x.admit())
    pair.apply(lambda x: x.step(extend=([a, b], [2 * ps - 2, ps])))
    _in_c(pair, lambda x: x.step(decode=[a, b], lookahead=3))  # a: [2ps-2, 2ps+2)
    assert led().spec_steps[a].tolist() == [4, 0] and led().committed[a] == 2 * ps - 2
    full_before = pair.ref.n_free("full")
    planned = _in_c(pair, _plan_run(commit=([a, b], [0, 4]), evict=[a, b]))
    assert planned.pages_freed["full"] == 1  # a's page past 2ps - 2: all rejected
    assert pair.ref.n_free("full") == full_before + 1
    assert led().seq_len[a] == led().committed[a] == 2 * ps - 2
    assert led().seq_len[b] == led().committed[b] == ps + 4  # all accepted
    _refused(pair, fast_plan._cplan.R_SPECULATIVE, "SpeculativeStateError",
             commit=([a], [0]))  # nothing left to commit
    _in_c(pair, lambda x: x.step(evict=[a, b], decode=[a, b], lookahead=[2, 0]))
    _in_c(pair, lambda x: x.step(decode=[a, b], lookahead=1))  # overlap: two in flight
    assert led().spec_steps[a].tolist() == [3, 2] and led().spec_steps[b].tolist() == [1, 2]
    _refused(pair, fast_plan._cplan.R_SPECULATIVE, "SpeculativeStateError", decode=[a],
             lookahead=1)  # a third step in flight
    _refused(pair, fast_plan._cplan.R_SPECULATIVE, "SpeculativeStateError",
             commit=([a], [1]), decode=[a])  # a plain decode: the later step still in flight
    _refused(pair, fast_plan._cplan.R_POSITIONS, "PositionError", commit=([a, b], [4, 1]))
    c = int(led().committed[a])
    _in_c(pair, lambda x: x.step(commit=([a, b], [2, 1]), evict_all=True, decode=[a, b],
                                 lookahead=3))  # the later step kept, a new one drafted
    assert led().committed[a] == c + 2 and led().spec_steps[a].tolist() == [2, 4]
    assert led().seq_len[a] == c + 2 + 2 + 4
    _in_c(pair, lambda x: x.step(commit=([a, b], [2, 2])))
    _in_c(pair, lambda x: x.step(commit=([a, b], [4, 0]), evict_all=True, decode=[a, b]))
    assert led().spec_steps[a].tolist() == [0, 0] and led().seq_len[a] == led().committed[a]
    for _ in range(3 * ps):  # rounds until the window moves (evicted on the committed length)
        n = [int(s) // 2 for s in led().spec_steps[[a, b], 0]]
        rows = [r for r, k in zip([a, b], n, strict=True) if led().spec_steps[r, 0]]
        commit = (rows, [k for r, k in zip([a, b], n, strict=True) if r in rows])
        k = 1 if pair.cfg.ring_mode else 2  # (a ring holds W + 1 + 1 positions past f)
        _in_c(pair, lambda x, commit=commit, k=k: x.step(commit=commit, evict=[a, b],
                                                         decode=[a, b], lookahead=k))
    assert led().frontier[a] > 0 and led().frontier[b] > 0
    _in_c(pair, lambda x: x.step(release=[a], commit=([b], [1]), decode=[b], lookahead=1))
    assert pair.fast.audit() == []


@pytest.mark.parametrize("name", ["pool-ps16-shared", "ring-ps16"])
def test_trim_planned_and_refused_in_c(name):
    """Trims: refused below frontier + window and past the length (the C call and the step
    change nothing), planned at exactly f + W, back to C, to a page boundary inside the
    committed part; a commit and a trim of one row in one step."""
    pair = Pair(name)
    ps, w, led = pair.cfg.page_size, pair.cfg.sliding_window, lambda: pair.ref.ledger
    a, _ = pair.apply(lambda x: x.admit())
    b, _ = pair.apply(lambda x: x.admit())
    for r, n in [(a, ps)] * 5 + [(b, ps + 3), (b, ps)]:  # (page chunks: a ring fits W)
        _in_c(pair, lambda x, r=r, n=n: x.step(evict_all=True, extend=([r], [n])))
    _in_c(pair, lambda x: x.step(evict_all=True, decode=[a, b], lookahead=3))
    f = int(led().frontier[a])
    assert f > 0 and led().frontier[b] == 0
    _refused(pair, fast_plan._cplan.R_POSITIONS, "FrontierError", trim=([a], [f + w - 1]))
    _refused(pair, fast_plan._cplan.R_POSITIONS, "PositionError",
             trim=([b], [int(led().seq_len[b]) + 1]))
    cb = int(led().committed[b])
    _in_c(pair, lambda x: x.step(trim=([a, b], [f + w, cb])))
    assert led().seq_len[a] == led().committed[a] == f + w
    assert led().spec_steps[[a, b]].sum() == 0
    _in_c(pair, lambda x: x.step(decode=[a, b], lookahead=2))
    _in_c(pair, lambda x: x.step(decode=[a, b], lookahead=1))
    c = int(led().committed[b])  # b: frontier 0, a trim into the committed part
    _in_c(pair, lambda x: x.step(trim=([b], [c - c % ps - ps]), decode=[a], lookahead=2,
                                 commit=([a], [3])))
    assert led().committed[b] == led().seq_len[b] == c - c % ps - ps
    t = int(led().committed[a]) + 2  # trimmed after the commit of 1: one token of the next
    _in_c(pair, lambda x: x.step(commit=([a], [1]), trim=([a], [t])))
    assert led().spec_steps[a].tolist() == [1, 0]
    _in_c(pair, lambda x: x.step(evict_all=True, decode=[b]))
    assert pair.fast.audit() == []


def test_trim_a_tail_a_handle_shares():
    """A handle and a second request hold a's committed pages: a trim of a into them drops
    only a's references (the shared pages stay), the pages past the handle's are freed; a
    commit of a row admitted on the handle; the shared pages freed by the last holder."""
    pair = Pair("pool-ps16-shared")
    ps, led = pair.cfg.page_size, lambda: pair.ref.ledger
    a, _ = pair.apply(lambda x: x.admit())
    _in_c(pair, lambda x: x.step(extend=([a], [2 * ps])))
    _in_c(pair, lambda x: x.step(extend=([a], [2 * ps + 5])))
    h, err = pair.apply(lambda x: x.take_handle(a, 4 * ps))
    b, err2 = pair.apply(lambda x: x.admit(handle=h))
    assert err is None and err2 is None
    _in_c(pair, lambda x: x.step(extend=([b], [3])))
    _in_c(pair, lambda x: x.step(decode=[a, b], lookahead=3))
    assert led().full_ref.max() == 3
    full_free = pair.ref.n_free("full")
    planned = _in_c(pair, _plan_run(trim=([a], [2 * ps + 1])))
    assert planned.pages_freed["full"] == 1  # a's page 4; pages 3 and 2 stay shared
    assert pair.ref.n_free("full") == full_free + 1
    _in_c(pair, lambda x: x.step(commit=([b], [1]), decode=[b], lookahead=2))
    pair.apply(lambda x: x.drop_handle(h))
    _in_c(pair, lambda x: x.step(trim=([b], [ps])))  # pages 1.. only b held: freed
    _in_c(pair, lambda x: x.step(release=[a, b]))
    assert pair.ref.n_free("full") == pair.cfg.num_full_pages
    assert pair.fast.audit() == []


@pytest.mark.parametrize("name", ["pool-ps16-shared", "ring-ps16"])
def test_a_refused_speculative_step_rolls_back(name):
    """A commit / trim whose frees the C planner wrote (release rows, page mirror, ledger),
    then refused for capacity (the step's allocation needs more than it freed): the C call
    rolls every write back, the numpy planner raises CapacityError, nothing changed; one
    page less is planned in C."""
    pair = Pair(name)
    cfg, ps = pair.cfg, pair.cfg.page_size
    a, _ = pair.apply(lambda x: x.admit())
    _in_c(pair, lambda x: x.step(extend=([a], [ps + 4])))
    _in_c(pair, lambda x: x.step(decode=[a], lookahead=ps))  # [ps + 4, 2 ps + 5): a new page
    others = [pair.apply(lambda x: x.admit())[0] for _ in range(cfg.max_reqs - 1)]

    def free() -> int:
        ref = pair.ref
        return ref.n_free("full") if cfg.ring_mode else min(ref.n_free("full"),
                                                            ref.n_free("swa"))
    for i in range(200):  # one page at a time (the window evicted) until one page is free
        if free() <= 1:
            break
        r = others[i % len(others)]
        _in_c(pair, lambda x, r=r: x.step(evict_all=True, extend=([r], [ps])))
    assert free() == 1
    three = others[:3]  # each starts a page (the ring holds one more page past the window)
    assert all(pair.ref.seq_len(r) % ps == 0 for r in three)
    _refused(pair, fast_plan._cplan.R_CAPACITY, "CapacityError", commit=([a], [0]),
             evict_all=True, decode=three)
    _refused(pair, fast_plan._cplan.R_CAPACITY, "CapacityError", trim=([a], [ps + 4]),
             evict_all=True, decode=three, lookahead=0)
    _refused(pair, fast_plan._cplan.R_CAPACITY, "CapacityError", commit=([a], [2]),
             trim=([a], [ps + 5]), evict_all=True, decode=three)
    _in_c(pair, lambda x: x.step(commit=([a], [0]), evict_all=True, decode=three[:2]))
    assert free() == 0
    assert pair.fast.audit() == []


@pytest.mark.parametrize("name", ["pool-ps16-shared", "ring-ps16"])
def test_capacity_boundary(name):
    """An allocation of exactly the free pages is planned in C; one page more is refused
    by both planners (CapacityError), nothing changed."""
    pair = Pair(name)
    cfg, ps = pair.cfg, pair.cfg.page_size
    rows = [pair.apply(lambda a: a.admit())[0] for _ in range(4)]

    def free() -> int:
        ref = pair.ref
        return ref.n_free("full") if cfg.ring_mode else min(ref.n_free("full"),
                                                            ref.n_free("swa"))
    for i in range(200):  # one page at a time, round robin, until fewer free than rows
        if free() < len(rows):
            break
        r = rows[i % len(rows)]
        pair.apply(lambda a, r=r: a.step(evict_all=True, extend=([r], [ps])))
    n_free = free()
    assert 0 < n_free < len(rows) and all(pair.ref.seq_len(r) % ps == 0 for r in rows)
    before = _state(pair.fast)
    _, err = pair.apply(lambda a: a.step(evict_all=True, decode=rows[:n_free + 1]))
    assert err is not None and err.__name__ == "CapacityError"
    assert pair.fast._fast.last_refusal == fast_plan._cplan.R_CAPACITY
    _assert_same(before, _state(pair.fast))
    n = pair.fast._fast.n_planned
    pair.apply(lambda a: a.step(evict_all=True, decode=rows[:n_free]))
    assert pair.fast._fast.n_planned == n + 1 and free() == 0
    pair.compare(device=True)


def test_prefix_cache_reclaims_inside_a_step_the_c_planner_refused():
    """An extend short of pages while the cache holds some: the C planner refuses
    (capacity), the numpy planner evicts cache entries inside the same step; the two
    allocators agree, and later compiled steps free the pages the cache shared."""
    pair = Pair("pool-ps16-cache")
    ps = pair.cfg.page_size
    rows = []
    for k in range(3):  # three prompts cached, the requests released: only the cache holds
        r, _ = pair.apply(lambda a: a.admit())
        pair.apply(lambda a, r=r: a.alloc_extend([r], [3 * ps]))
        tokens = np.arange(3 * ps) + 1000 * k
        pair.apply(lambda a, r=r, t=tokens: a.prefix_cache.insert(r, t))
        rows.append(r)
    pair.apply(lambda a: a.step(release=rows))
    new = [pair.apply(lambda a: a.admit())[0] for _ in range(2)]
    assert pair.ref.n_free("swa") < 6  # the cache holds what the extends need
    fast = pair.fast._fast
    n_refused = fast.n_fallback
    for _ in range(3):
        pair.apply(lambda a: a.step(evict_all=True, extend=(new, [3 * ps, 3 * ps])))
        pair.compare(device=True)
    assert pair.ref.prefix_cache.tombstoned_pages + pair.ref.prefix_cache.evicted_pages > 0
    assert fast.n_fallback > n_refused  # the reclaiming steps were the numpy planner's
    for _ in range(8):
        pair.apply(lambda a: a.step(evict_all=True, decode=new))
        pair.compare()
    pair.compare(device=True)
    assert pair.fast.audit() == []


# ---- refusals change nothing ------------------------------------------------------------------
def _state(alloc) -> dict:
    led = alloc.ledger
    snap = {name: getattr(led, name).copy() for name in Ledger.ROW_ARRAYS + Ledger.HANDLE_ARRAYS}
    snap["rings"] = (led.full.head, led.full.n_free, led.swa.head, led.swa.n_free)
    if led.refs is not None:
        snap.update(led.refs.copy_arrays())
    snap["bufs"] = [b.copy() for b in alloc.ring.np_bufs]
    snap["used"] = list(alloc.ring.used)
    snap["steps"] = alloc.steps_run
    return snap


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if key == "bufs":
            assert all(np.array_equal(x, y) for x, y in zip(a[key], b[key], strict=True))
        elif isinstance(a[key], np.ndarray):
            assert np.array_equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


@pytest.mark.parametrize("name", ["pool-ps16-shared", "ring-ps3-split-i32", "pool-ps3-tight"])
def test_a_refused_step_changes_nothing(name):
    """Steps the C planner refuses after it began writing (capacity short after this step's
    frees, the frozen release shape exceeded) roll back: the C call itself leaves every
    array and descriptor buffer as it was, and the step then raises the numpy planner's
    error with nothing changed."""
    pair = Pair(name)
    cfg = pair.cfg
    rows = []
    for _ in range(cfg.max_reqs):  # fill: prefill in page-sized chunks, the window evicted
        r, err = pair.apply(lambda a: a.admit())
        if err is not None:
            break
        for _ in range(5):
            _, err = pair.apply(lambda a, r=r: a.step(evict_all=True,
                                                      extend=([r], [cfg.page_size])))
        if err is not None:
            break
        rows.append(r)
    pair.apply(lambda a: a.step(evict_all=True, decode=rows))
    assert len(rows) >= 2
    alloc, fast = pair.fast, pair.fast._fast
    ps = cfg.page_size
    led = pair.ref.ledger  # each other row extended as far as its context allows
    huge = [int(min(cfg.max_context_len - 1 - led.seq_len[r], cfg.max_tokens_per_alloc_row))
            for r in rows[1:]]
    cases = [  # (step arguments, the C planner's refusal)
        (dict(release=rows[:1], evict_all=True, extend=(rows[1:], huge)),
         (fast_plan._cplan.R_CAPACITY, fast_plan._cplan.R_RING, fast_plan._cplan.R_SHAPE)),
        (dict(evict_all=True, advance=(rows[-1:], [ps + 1])), (fast_plan._cplan.R_POSITIONS,)),
        (dict(release=rows[-1:], decode=rows[-1:]), (fast_plan._cplan.R_ROWS,)),
        (dict(release=rows[1:], evict_all=True), (fast_plan._cplan.R_SHAPE,)),
    ]
    refused_late = 0
    for args, codes in cases:
        before = _state(alloc)
        ext = args.get("extend")
        got = fast.plan(alloc, args.get("release"), None, args.get("evict_all", False),
                        args.get("advance"), args.get("decode"), ext)
        if got is not None:  # this config can meet it: run it in both and go on
            alloc.run(got)
            pair.ref.step(**args)
            pair.compare(device=True)
            continue
        assert fast.last_refusal in codes, (args, fast.last_refusal)
        refused_late += fast.last_refusal in (fast_plan._cplan.R_CAPACITY,
                                              fast_plan._cplan.R_SHAPE)
        _assert_same(before, _state(alloc))
        _, err = pair.apply(lambda a, args=args: a.step(**args))
        assert err is not None
        _assert_same(before, _state(alloc))
        pair.compare(device=True)
    assert refused_late >= 1


# ---- the call boundary -------------------------------------------------------------------
def test_result_objects_are_reused_only_when_nobody_holds_them():
    cfg, _ = make_config("pool-ps16-shared")
    alloc = HybridAllocator(cfg, planner="compiled")
    r = alloc.admit()
    alloc.alloc_extend([r], [10])
    seen = []
    for _ in range(6):
        out = alloc.step(decode=[r])
        seen.append(id(out))
        del out
    assert len(set(seen)) <= 2 * fast_plan.FastPlanner.MAX_SLOTS  # reused, not made per step
    held = alloc.step(decode=[r])
    rows_view = held.rows
    for _ in range(4):
        other = alloc.step(decode=[r])
        assert other is not held and other.rows is not rows_view
    assert int(rows_view[0]) == r and int(held.first_lane[0]) == 0
    with pytest.raises(StaleResultError):
        held.full_slots  # noqa: B018 (a stale result still refuses access)
    assert alloc._fast.n_fallback == 0


def test_no_reference_cycle_keeps_the_allocator():
    cfg, _ = make_config("ring-ps16")
    gc.collect()
    gc.disable()
    try:
        alloc = HybridAllocator(cfg, planner="compiled")
        r = alloc.admit()
        out = alloc.alloc_extend([r], [40])
        planned = alloc.plan(decode=[r])
        alloc.run(planned)
        ref = weakref.ref(alloc)
        del alloc, out, planned
        assert ref() is None
    finally:
        gc.enable()


def test_planner_argument(monkeypatch):
    cfg, _ = make_config("ring-ps1")
    with pytest.raises(ConfigError):
        HybridAllocator(cfg, planner="fast")
    assert HybridAllocator(cfg, planner="numpy")._fast is None
    assert HybridAllocator(cfg)._fast is not None  # "auto" with the extension built
    monkeypatch.setenv("GRAPHALLOC_PLANNER", "numpy")
    assert HybridAllocator(cfg)._fast is None
    monkeypatch.setattr(fast_plan, "AVAILABLE", False)
    with pytest.raises(ConfigError, match="unavailable"):
        HybridAllocator(cfg, planner="compiled")


def test_benchmark_quick_run(tmp_path):
    """benchmarks/bench_planner.py --quick: both planners, the same descriptors, no step
    handed back to the numpy planner, both outputs written."""
    import json
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "bench"
    proc = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "bench_planner.py"),
                           "--quick", "--device", "cpu", "--out", str(out)], cwd=root,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(os.listdir(out)) == ["bench_planner.json", "bench_planner.md"]
    res = json.loads((out / "bench_planner.json").read_text())
    for row in res["results"]:
        assert row["identical"] and row["compiled"]["fallbacks"] == 0
        assert row["compiled"]["plan_us"]["p50"] > 0 and row["numpy"]["plan_us"]["p50"] > 0
