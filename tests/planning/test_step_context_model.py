"""The scheduler-step context against the pure-Python model (tests/lib/model.py), step by step.

Each iteration is ONE ``alloc.scheduler_step()`` block of several calls drawn at random
(releases, window evictions of chosen rows or of all, frontier advances, handle drops and
SWA tombstones, plain admits and admits on a handle, prefill chunks, decodes; mostly
valid, sometimes a dead row, a dropped handle, a misaligned or backward frontier, too many
tokens, a second allocation of a row). The model applies the block as ONE step of its
own (``Model.step``): the calls of one kind concatenated in call order, the kinds in the
step's order (releases, evictions, advances, handle drops as one drop call, admits -- rows
reserved at the call: the lowest rows not live when the block began --, decodes, extends),
the frozen step shape checked over the whole step (a prefix copy and a ring admission are
allocation rows too); in ring mode a row admitted in the block cannot allocate tokens in
it (its ring admission is its allocation row). A block the
model refuses must raise the matching typed error with nothing changed (and no row
admitted); otherwise every call's slots must be the model's.

After every block: free counts, lengths, frontiers, live rows, handles and the step count;
in pool mode also the host page mirror (each row's and handle's pages, the SWA peers, the
reference counts, both free rings in order) against the model's. Every few blocks, and at
the end: ``alloc.audit()`` is empty and the device tables (``req_to_token`` on every held
position, ``full_to_swa``, ring pages, free rings) equal the model's prediction. Seeded
random sequences, page sizes 1, 3 and 16, pool and ring mode.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import assert_same_snapshot
from model import (
    ALIGNMENT,
    BATCH,
    CAPACITY,
    FRONTIER,
    HANDLE,
    NESTED,
    OVERLAP,
    POSITION,
    RING,
    SHARING,
    UNKNOWN,
    Model,
    Violation,
)

from graphalloc import AllocatorConfig, HybridAllocator
from graphalloc import errors as E

ERRORS = {UNKNOWN: E.UnknownRequestError, OVERLAP: E.OverlapError,
          CAPACITY: E.CapacityError, ALIGNMENT: E.AlignmentError,
          POSITION: E.PositionError, FRONTIER: E.FrontierError,
          BATCH: E.BatchTooLargeError, RING: E.RingOverflowError,
          NESTED: E.NestedGroupError, HANDLE: E.UnknownHandleError,
          SHARING: E.ContractError}

CONFIGS = {
    "ps1_pool": dict(page_size=1, num_full_pages=16, num_swa_pages=10, max_reqs=4,
                     max_context_len=12, sliding_window=3, max_handles=3),
    "ps3_pool_tight": dict(page_size=3, num_full_pages=14, num_swa_pages=10, max_reqs=4,
                           max_context_len=24, sliding_window=4, max_handles=2,
                           max_release_rows=6, max_pages_per_row=2, max_alloc_rows=2,
                           max_tokens_per_alloc_row=9, max_step_tokens=12,
                           max_step_pages=8),
    "ps16_pool": dict(page_size=16, num_full_pages=10, num_swa_pages=6, max_reqs=3,
                      max_context_len=96, sliding_window=20, max_handles=2),
    "ps1_ring": dict(page_size=1, num_full_pages=12, num_swa_pages=16, max_reqs=4,
                     max_context_len=10, sliding_window=3, swa_ring_pages=4),
    "ps3_ring": dict(page_size=3, num_full_pages=12, num_swa_pages=12, max_reqs=3,
                     max_context_len=18, sliding_window=2, swa_ring_pages=3),
    "ps16_ring": dict(page_size=16, num_full_pages=10, num_swa_pages=10, max_reqs=3,
                      max_context_len=80, sliding_window=20, swa_ring_pages=3),
}
SEEDS = (0, 1, 2, 3)
BLOCKS = 60  # iterations per sequence
FULL_CHECK_EVERY = 5


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def expected_error(kinds):
    return tuple(ERRORS[k] for k in sorted(kinds))


# ---- the model's side of one block ------------------------------------------------------
def model_block(model: Model, calls: list, reserved: list):
    """The block's calls as ONE step of the model (calls of one kind concatenated in call
    order, the kinds in the step's order); returns (the new model, per allocation call its
    [(row, full, swa)]). Raises Violation with ``model`` unchanged. ``reserved``: the rows
    the block's admits got, in call order."""
    work = model.clone()
    kw: dict = {"release": [], "decode": []}
    admits = [c for c in calls if c[0] == "admit"]
    plain = [row for (_, h, _), row in zip(admits, reserved, strict=True) if h is None]
    shared = [(row, h, n) for (_, h, n), row in zip(admits, reserved, strict=True)
              if h is not None]
    sizes = []  # per allocation call: (kind, rows)
    ext_rows, ext_n = [], []
    for kind, *args in calls:
        if kind == "release":
            kw["release"] += list(args[0])
        elif kind == "evict":
            kw["evict"] = kw.get("evict", []) + list(args[0])
        elif kind == "evict_all":
            kw["evict_all"] = True
        elif kind == "advance":
            rows, pos = kw.get("advance", ([], []))
            kw["advance"] = (rows + list(args[0]), pos + list(args[1]))
        elif kind == "drop_handle":
            kw["drop"] = kw.get("drop", []) + [args[0]]
        elif kind == "drop_handle_swa":
            kw["drop_swa"] = kw.get("drop_swa", []) + [args[0]]
        elif kind == "decode":
            kw["decode"] += list(args[0])
            sizes.append(("decode", len(args[0])))
        elif kind == "extend":
            ext_rows += list(args[0])
            ext_n += list(args[1])
            sizes.append(("extend", len(args[0])))
    if ext_rows or any(k == "extend" for k, _ in sizes):
        kw["extend"] = (ext_rows, ext_n)
    kw["admit"] = plain
    if shared:
        kw["admit_on"] = tuple(list(x) for x in zip(*shared, strict=True))
    out = work.step(**kw) or []
    # the step's lanes: decode rows, then extend rows; give each call its own part
    n_dec = len(kw["decode"])
    parts, at = [], {"decode": 0, "extend": n_dec}
    for kind, n in sizes:
        parts.append(out[at[kind]:at[kind] + n])
        at[kind] += n
    return work, parts


# ---- the allocator's side ---------------------------------------------------------------
def alloc_block(alloc, calls: list):
    """Run the calls in one scheduler_step block; returns (reserved rows, per allocation
    call its StepSlots)."""
    slots, reserved = [], []
    with alloc.scheduler_step() as it:
        for kind, *args in calls:
            if kind == "release":
                it.release(args[0])
            elif kind == "evict":
                it.evict(args[0])
            elif kind == "evict_all":
                it.evict_all()
            elif kind == "advance":
                it.advance(args[0], args[1])
            elif kind == "drop_handle":
                it.drop_handle(args[0])
            elif kind == "drop_handle_swa":
                it.drop_handle_swa(args[0])
            elif kind == "admit":
                reserved.append(it.admit(handle=args[0], n_tokens=args[1]))
            elif kind == "decode":
                slots.append(it.decode(args[0]))
            else:
                slots.append(it.extend(args[0], args[1]))
    return reserved, slots


# ---- comparisons ------------------------------------------------------------------------
def compare(alloc, model: Model, full: bool) -> None:
    cfg, ps, led = alloc.config, model.ps, alloc.ledger
    stats = alloc.stats()
    assert stats["full_free_pages"] == len(model.full_q)
    assert stats["swa_free_pages"] == len(model.swa_q)
    assert stats["live_requests"] == len(model.reqs)
    assert stats["seq_len"] == {r: q.length for r, q in model.reqs.items()}
    assert stats["frontier"] == {r: q.frontier for r, q in model.reqs.items()}
    assert stats["steps_run"] == model.steps
    refs = led.refs
    if refs is not None:  # the host page mirror, exactly the model's
        assert sorted(int(h) for h in alloc.live_handles()) == sorted(model.handles)
        for h, hd in model.handles.items():
            assert int(led.h_len[h]) == hd.n_tokens and int(led.h_swa_start[h]) == hd.swa_start
            assert refs.page_of[cfg.max_reqs + h, :len(hd.pages)].tolist() == hd.pages
        for r, q in model.reqs.items():
            assert refs.page_of[r, :len(q.pages)].tolist() == q.pages, r
        assert refs.full_ref.tolist() == model.full_ref
        assert refs.swa_ref.tolist() == model.swa_ref
        assert refs.swa_of.tolist() == model.f2s
        for ring, q, n in ((led.full, model.full_q, cfg.num_full_pages),
                           (led.swa, model.swa_q, cfg.num_swa_pages)):
            arr = refs.full_ring if n == cfg.num_full_pages and q is model.full_q else \
                refs.swa_ring
            assert [int(arr[(ring.head + i) % n]) for i in range(ring.n_free)] == list(q)
    if not full:
        return
    assert alloc.audit() == []
    model.check_self()
    r2t = alloc.req_to_token
    for r, q in model.reqs.items():
        assert r2t[r, :q.length].tolist() == q.slots, r
        if cfg.ring_mode:
            assert alloc.state.ring_pages[r, :cfg.swa_ring_pages].tolist() == q.ring
    assert alloc.full_to_swa.tolist() == model.full_to_swa()
    for dev, q, n, pool in ((alloc.state.full_free, model.full_q, cfg.num_full_pages, "full"),
                            (alloc.state.swa_free, model.swa_q, cfg.num_swa_pages, "swa")):
        head = model.free_ring_head(pool)
        got = dev.tolist()
        assert [got[(head + i) % n] for i in range(len(q))] == list(q)
    _ = ps


# ---- drawing a block --------------------------------------------------------------------
class Drawer:
    """Random block calls over the model's current state (mostly valid)."""

    def __init__(self, cfg, rng):
        self.cfg, self.rng, self.ps = cfg, rng, cfg.page_size

    def pick(self, rows, k_max=2):
        if not rows:
            return []
        k = int(self.rng.integers(1, min(k_max, len(rows)) + 1))
        return [int(r) for r in self.rng.choice(rows, size=k, replace=False)]

    def bad_row(self, model):
        dead = [r for r in range(self.cfg.max_reqs) if r not in model.reqs]
        return dead[0] if dead and self.rng.random() < 0.5 else self.cfg.max_reqs

    def tokens(self):
        ps, r = self.ps, self.rng.random()
        if r < 0.5:
            return int(self.rng.integers(0, 4))
        if r < 0.9:
            return int(self.rng.integers(0, 2 * ps + 2))
        return int(self.rng.integers(0, self.cfg.max_context_len + 2))

    def block(self, model: Model) -> list:
        rng, ps, cfg = self.rng, self.ps, self.cfg
        live = sorted(model.reqs)
        handles = sorted(model.handles)
        calls, new_rows = [], []
        free_rows = [r for r in range(cfg.max_reqs) if r not in model.reqs]
        kinds = ["release", "evict", "evict_all", "advance", "admit", "admit", "extend",
                 "extend", "decode", "decode"]
        if not cfg.ring_mode:
            kinds += ["admit_handle", "admit_handle", "drop_handle", "drop_handle_swa"]
        busy = len(live) >= 2 or len(model.full_q) < model.n_full // 2
        released = set()
        for _ in range(int(rng.integers(0, 7))):
            kind = kinds[int(rng.integers(len(kinds)))]
            bad = rng.random() < 0.08
            if kind == "release":
                if not busy:
                    continue
                rows = [r for r in self.pick(live, 1) if r not in released]
                released.update(rows)
                calls.append(("release", rows + ([self.bad_row(model)] if bad else [])))
            elif kind == "evict":
                calls.append(("evict", self.pick(live) + ([self.bad_row(model)] if bad else [])))
            elif kind == "evict_all":
                calls.append(("evict_all",))
            elif kind == "advance":
                rows = self.pick(live)
                pos = [model.reqs[r].frontier + int(rng.integers(-1 if bad else 0, 3)) * ps
                       + (1 if bad and ps > 1 else 0) for r in rows]
                calls.append(("advance", rows, pos))
            elif kind in ("admit", "admit_handle"):
                if len(new_rows) >= len(free_rows):
                    break  # the next admit would find no row (tested on its own below)
                if kind == "admit" or not handles:
                    calls.append(("admit", None, None))
                else:
                    h = handles[int(rng.integers(len(handles)))]
                    n_h = model.handles[h].n_tokens
                    n = None if rng.random() < 0.4 else int(rng.integers(1, n_h // ps + 1)) * ps
                    if bad:
                        h, n = (-1, n) if rng.random() < 0.5 else (h, (n or n_h) + 1)
                    calls.append(("admit", h, n))
                new_rows.append(free_rows[len(new_rows)])
            elif kind in ("drop_handle", "drop_handle_swa"):
                if handles:
                    h = handles[int(rng.integers(len(handles)))]
                    calls.append((kind, cfg.max_handles if bad else h))
            else:
                pool = live + new_rows
                rows = self.pick(pool, 3) + ([self.bad_row(model)] if bad else [])
                if kind == "decode":
                    calls.append(("decode", rows))
                else:
                    calls.append(("extend", rows, [self.tokens() for _ in rows]))
        return calls


def take_a_handle(alloc, model, rng) -> None:
    """Between blocks: a handle on whole pages of a live request (one step on both)."""
    ps = model.ps
    cands = [r for r, q in model.reqs.items() if q.length >= ps]
    if not cands or len(model.handles) >= model.max_handles:
        return
    r = cands[int(rng.integers(len(cands)))]
    n = int(rng.integers(1, model.reqs[r].length // ps + 1)) * ps
    assert alloc.take_handle(r, n) == model.take_handle(r, n)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_scheduler_step_blocks_match_the_model(name, seed):
    cfg = AllocatorConfig(device="cpu", backend="torch", **CONFIGS[name])
    alloc = HybridAllocator(cfg)
    model = Model.from_config(cfg)
    rng = np.random.default_rng([seed, len(name)])
    drawer = Drawer(cfg, rng)
    outcomes = {"ran": 0, "refused": 0}
    for i in range(BLOCKS):
        calls = drawer.block(model)
        free_rows = [r for r in range(cfg.max_reqs) if r not in model.reqs]
        reserved = free_rows[:sum(1 for c in calls if c[0] == "admit")]
        before = alloc.snapshot()
        try:
            expected = model_block(model, calls, reserved)
        except Violation as v:
            with pytest.raises(expected_error(v.kinds)):
                alloc_block(alloc, calls)
            assert_same_snapshot(before, alloc.snapshot())  # refused whole, no row admitted
            outcomes["refused"] += 1
        else:
            got_rows, slots = alloc_block(alloc, calls)
            model, results = expected
            assert got_rows == reserved
            assert len(slots) == len(results)
            for got, want in zip(slots, results, strict=True):
                assert got.rows.tolist() == [r for r, _, _ in want]
                assert got.full_slots.tolist() == [s for _, f, _ in want for s in f]
                assert got.swa_slots.tolist() == [s for _, _, w in want for s in w]
            outcomes["ran"] += 1
        compare(alloc, model, full=i % FULL_CHECK_EVERY == 0)
        if not cfg.ring_mode and rng.random() < 0.3:
            take_a_handle(alloc, model, rng)
    compare(alloc, model, full=True)
    assert outcomes["ran"] > BLOCKS // 3 and outcomes["refused"] > 0, outcomes


@pytest.mark.parametrize("name", ["ps3_pool_tight", "ps3_ring"])
def test_an_admit_without_a_free_row_is_refused_at_the_call_and_runs_nothing(name):
    cfg = AllocatorConfig(device="cpu", backend="torch", **CONFIGS[name])
    alloc = HybridAllocator(cfg)
    model = Model.from_config(cfg)
    rows = list(range(cfg.max_reqs))
    with alloc.scheduler_step() as it:
        assert [it.admit() for _ in rows] == rows
    model, _ = model_block(model, [("admit", None, None)] * len(rows), rows)
    compare(alloc, model, full=True)
    before = alloc.snapshot()
    with pytest.raises(E.CapacityError):
        with alloc.scheduler_step() as it:
            it.release([0])  # released by this step: its row is reusable after it
            it.admit()
    assert_same_snapshot(before, alloc.snapshot())
    if cfg.ring_mode:  # the implemented rule: an admitted row allocates from the next block
        with alloc.scheduler_step() as it:
            it.release([0])
        with pytest.raises(E.OverlapError):
            with alloc.scheduler_step() as it:
                it.extend([it.admit()], [1])
