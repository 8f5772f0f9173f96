"""The compiled twin against the numpy reference planner, byte for byte.

Two allocators of one config plan identical :class:`StepArrays` through their pipelines,
one with the numpy reference (``planner="numpy"``), one with the compiled twin
(``planner="compiled"``). After every step both must have the same refusal (its five
integers, the error class and message), the same descriptor buffers (release, allocation,
lane and state sections of every buffer, ``ring.used`` / ``ring.fusable`` /
``ring.state_used``), the same ledger (``Ledger.arrays()``: rows, handles, rings, page
mirror, state slots), the same :class:`PlanOutcome` fields (lanes and state rows included),
the same tables' host copies and the same ``PlannedStep`` fields.

Random sequences (seeded) cover page sizes 1, 2, 3, 4, 16 and 128, int32 and int64 tables,
pool and ring mode, handles taken / admitted on / dropped / tombstoned with the prefix
cache's reclaim offers, speculative lookahead, commits and trims (into shared pages too),
load-backs, an open free group's exclusions, page tables on and off, and frozen shapes tight
enough that every shape refusal happens. Steps are submitted, cancelled or dry-run; a
refused, cancelled or dry-run step must leave every array as before. The compiled path is
asserted to have planned (its counter), and the coverage of kinds and refusal codes is
asserted at the end, so a test that stopped exercising something fails.

With recurrent-state slots (``STATE_CONFIGS``: pools short enough to refuse and reclaim,
``max_spec_tokens`` 2 to 12, so a speculative step spans one or two ``ST_SPEC`` rows) the
random steps mostly keep the states' rules (takes at the committed length, admits on whole
handles, trims down to C, lookahead up to K) and sometimes break them (codes 40-44); code
45, and the built-in prefix cache dropping snapshots under slot pressure, are directed cases.
"""

from __future__ import annotations

import collections
import os
import types

import numpy as np
import pytest
import torch

import graphalloc.plan.compiled as compiled
from graphalloc import AllocatorConfig, ConfigError, ContractError, HybridAllocator
from graphalloc.attention.spec import PageTableSpec
from graphalloc.kernels.abi import ST_SPEC
from graphalloc.plan.refusals import Kind, RefusalCode
from graphalloc.plan.step import Step, normalize
from graphalloc.pools import ChunkedLocal, FullAttention, RecurrentState

if os.environ.get("CI") and not compiled.AVAILABLE:  # CI must build it: never skip there
    raise AssertionError(f"the compiled planner was not built: {compiled.UNAVAILABLE_REASON}")
pytestmark = pytest.mark.skipif(not compiled.AVAILABLE, reason=compiled.UNAVAILABLE_REASON)

CONFIGS = {
    # name: (AllocatorConfig kwargs, page-table spec kwargs or None)
    "pool-ps16-handles": (dict(page_size=16, num_full_pages=40, num_swa_pages=18, max_reqs=6,
                               max_context_len=256, sliding_window=31, max_handles=5,
                               max_tokens_per_alloc_row=48), dict(max_batch=6)),
    "pool-ps1-i32": (dict(page_size=1, num_full_pages=120, num_swa_pages=40, max_reqs=5,
                          max_context_len=64, sliding_window=9, max_handles=3,
                          index_dtype=torch.int32),
                     dict(max_batch=4, out_dtype=torch.int64, forms=("csr",))),
    "pool-ps3-tight": (dict(page_size=3, num_full_pages=40, num_swa_pages=24, max_reqs=5,
                            max_context_len=48, sliding_window=7, max_handles=3,
                            max_pages_per_row=2, max_alloc_rows=3, max_step_tokens=20,
                            max_tokens_per_alloc_row=12), "tight"),
    "pool-ps2": (dict(page_size=2, num_full_pages=50, num_swa_pages=20, max_reqs=4,
                      max_context_len=40, sliding_window=5, max_handles=4,
                      max_tokens_per_alloc_row=9), dict(max_batch=3, max_full_indices=30,
                                                        max_swa_indices=8)),
    "pool-ps128": (dict(page_size=128, num_full_pages=14, num_swa_pages=6, max_reqs=4,
                        max_context_len=640, sliding_window=150, max_handles=2,
                        max_tokens_per_alloc_row=200, index_dtype=torch.int32), None),
    "ring-ps16": (dict(page_size=16, num_full_pages=40, num_swa_pages=24, max_reqs=5,
                       max_context_len=256, sliding_window=31, swa_ring_pages=3,
                       max_tokens_per_alloc_row=48), dict(max_batch=5)),
    "ring-ps3-split-i32": (dict(page_size=3, num_full_pages=60, num_swa_pages=30, max_reqs=5,
                                max_context_len=60, sliding_window=8, swa_ring_pages=4,
                                max_pages_per_row=2, index_dtype=torch.int32), "tight"),
    "ring-ps4": (dict(page_size=4, num_full_pages=50, num_swa_pages=13, max_reqs=4,
                      max_context_len=64, sliding_window=6, swa_ring_pages=5,
                      max_tokens_per_alloc_row=16), dict(max_batch=2, forms=("block_table",))),
}

# Pools the keyword form cannot describe (layers=): no window layers, chunked local attention
LAYER_CONFIGS = {
    "nowin-ps4-handles": (dict(page_size=4, max_reqs=5, max_context_len=64, max_handles=4,
                               layers=(FullAttention(40),), max_tokens_per_alloc_row=16),
                          dict(max_batch=5, layers=("full",))),
    "nowin-ps1-tight": (dict(page_size=1, max_reqs=4, max_context_len=24, max_handles=3,
                             layers=(FullAttention(60),), max_pages_per_row=5,
                             index_dtype=torch.int32), "tight"),
    "chunk-ps4-handles": (dict(page_size=4, max_reqs=5, max_context_len=80, max_handles=4,
                               layers=(FullAttention(48), ChunkedLocal(12, 20)),
                               max_tokens_per_alloc_row=20), dict(max_batch=5)),
    "chunk-ps3-tight": (dict(page_size=3, max_reqs=4, max_context_len=48, max_handles=3,
                             layers=(FullAttention(40), ChunkedLocal(8, 16)),
                             max_pages_per_row=2, max_alloc_rows=3, max_step_tokens=20,
                             max_tokens_per_alloc_row=12), "tight"),
}

STATE_CONFIGS = {
    # recurrent-state slots: pools a few requests' speculative steps exhaust
    "states-ps4-k3": (dict(page_size=4, num_full_pages=48, num_swa_pages=24, max_reqs=6,
                           max_context_len=96, sliding_window=11, max_handles=5,
                           max_tokens_per_alloc_row=24, num_state_slots=14, max_spec_tokens=3),
                      dict(max_batch=6)),
    "states-ps1-k7-i32": (dict(page_size=1, num_full_pages=120, num_swa_pages=40, max_reqs=5,
                               max_context_len=48, sliding_window=9, max_handles=4,
                               index_dtype=torch.int32, num_state_slots=16,
                               max_spec_tokens=7), None),
    "states-ps3-tight": (dict(page_size=3, num_full_pages=40, num_swa_pages=24, max_reqs=5,
                              max_context_len=48, sliding_window=7, max_handles=3,
                              max_pages_per_row=2, max_alloc_rows=3, max_step_tokens=20,
                              max_tokens_per_alloc_row=12, num_state_slots=9,
                              max_spec_tokens=2), "tight"),
    "states-ps16-k12": (dict(page_size=16, num_full_pages=40, num_swa_pages=18, max_reqs=4,
                             max_context_len=256, sliding_window=31, max_handles=4,
                             max_tokens_per_alloc_row=48, num_state_slots=40,
                             max_spec_tokens=12), dict(max_batch=4)),
    "states-nowin-ps4": (dict(page_size=4, max_reqs=5, max_context_len=64, max_handles=4,
                              layers=(FullAttention(40), RecurrentState(12, 3)),
                              max_tokens_per_alloc_row=16), dict(max_batch=5,
                                                                 layers=("full",))),
    "states-chunk-ps2": (dict(page_size=2, max_reqs=4, max_context_len=40, max_handles=4,
                              layers=(FullAttention(50), ChunkedLocal(6, 20),
                                      RecurrentState(12, 3)),
                              max_tokens_per_alloc_row=10), None),
    "states-ring-ps4": (dict(page_size=4, num_full_pages=50, num_swa_pages=20, max_reqs=4,
                             max_context_len=64, sliding_window=6, swa_ring_pages=4,
                             max_tokens_per_alloc_row=16, num_state_slots=8,
                             max_spec_tokens=4), dict(max_batch=4)),
}

COUNTS: collections.Counter = collections.Counter()  # kinds planned, refusal codes, modes


def make_config(name: str, **overrides):
    kwargs, tables = {**CONFIGS, **LAYER_CONFIGS, **STATE_CONFIGS}[name]
    kwargs = dict(kwargs, backend="torch", device="cpu")
    if tables == "tight":  # every frozen release shape at its minimum: steps exceed them
        probe = AllocatorConfig(**kwargs)
        kwargs.update(max_release_rows=probe.min_release_rows,
                      max_step_pages=probe.min_step_pages)
        tables = None
    kwargs.update(overrides)
    spec = None if tables is None else PageTableSpec(**tables)
    return AllocatorConfig(**kwargs), spec


class FakeCache:
    """A prefix cache's side of the pipeline: an offer of handles in a given order."""

    def __init__(self, tomb: np.ndarray, evict: np.ndarray):
        self.tomb, self.evict = tomb, evict
        self.n_unlocked = len(tomb)
        self.reclaimed: list = []

    def offer(self, limit: int):
        return self.tomb[:limit], self.evict[:limit]

    def on_reclaimed(self, reclaimed) -> None:
        self.reclaimed.extend(reclaimed)


class Pair:
    """A numpy-planned and a compiled-planned allocator fed identical steps."""

    def __init__(self, name: str, prefix_cache: bool = False, **overrides):
        self.cfg, spec = make_config(name, **overrides)
        self.ref = HybridAllocator(self.cfg, planner="numpy", page_tables=spec,
                                   prefix_cache=prefix_cache)
        self.twin = HybridAllocator(self.cfg, planner="compiled", page_tables=spec,
                                    prefix_cache=prefix_cache)
        assert self.ref.pipeline.compiled is None
        assert isinstance(self.twin.pipeline.compiled, compiled.CompiledPlanner)
        self.outcomes = {}
        self.reclaimed: list = []  # what submitted steps reclaimed (handle, tomb, FULL, SWA)
        for alloc in (self.ref, self.twin):  # record each pipeline's PlanOutcome
            self._record(alloc)

    def _record(self, alloc) -> None:
        pipe, inner = alloc.pipeline, alloc.pipeline.outcome

        def outcome(*args, **kwargs):
            out = inner(*args, **kwargs)
            self.outcomes[id(alloc)] = out
            return out
        pipe.outcome = outcome

    # ---- one step on both -------------------------------------------------------------------
    def step(self, arrays, mode: str, excluded=None, offer=None):
        """Plan ``arrays`` on both (``mode``: submit, cancel or dry); compare everything.
        Returns the refusal tuple or None."""
        results, befores = [], []
        for alloc in (self.ref, self.twin):
            pipe = alloc.pipeline  # the open free group's masks and the reclaim policy
            pipe.masks = (None if excluded is None else
                          types.SimpleNamespace(released=excluded[0], dropped=excluded[1]))
            pipe.reclaim = None if offer is None else FakeCache(*offer)
            before = state(alloc)
            befores.append({k: v for k, v in before.items() if k.startswith("ledger.")})
            self.outcomes.pop(id(alloc), None)
            try:
                if mode == "dry":
                    alloc.pipeline.outcome(arrays, dry_run=True)
                    planned = None
                else:
                    planned = alloc.pipeline.plan(arrays)
            except ContractError as exc:
                assert_same(before, state(alloc), "a refused step changed the allocator")
                results.append((exc, None, None))
                continue
            results.append((None, self.outcomes[id(alloc)], planned))
            if mode == "dry":  # nothing visible changed (the twin wrote its scratch buffer)
                assert_same(before, state(alloc), "a dry run changed the allocator")
        (e_ref, o_ref, p_ref), (e_twin, o_twin, p_twin) = results
        assert (e_ref is None) == (e_twin is None), (e_ref, e_twin)
        if e_ref is not None:
            assert e_ref.refusal == e_twin.refusal, (e_ref.refusal, e_twin.refusal)
            assert type(e_ref) is type(e_twin) and str(e_ref) == str(e_twin)
            code = e_ref.refusal[0]
            COUNTS[f"refused {int(code)}" + (f".{e_ref.refusal[2]}"
                                            if code == RefusalCode.STEP_OVER_SHAPE else "")] += 1
        else:
            compare_outcomes(o_ref, o_twin)
            COUNTS[f"mode {mode}"] += 1
            COUNTS["reclaimed"] += len(o_ref.reclaimed)
            COUNTS["lookahead"] += int(arrays.decode_spec.sum())
            COUNTS["not fusable"] += not o_ref.fusable
            cut = set(arrays.commit_row.tolist()) | set(arrays.trim_row.tolist())
            COUNTS["cut and allocated"] += bool(cut & set(o_ref.result_rows.tolist()))
            if o_ref.state_rows is not None:
                count_state_rows(self.cfg, o_ref.state_rows, o_ref.reclaimed)
        self.compare()
        if p_ref is not None:
            compare_planned(p_ref, p_twin)
            if mode == "cancel":  # the ledger as before the plan
                self.ref.cancel(p_ref)
                self.twin.cancel(p_twin)
                self.compare()
                assert_same(befores[1], state(self.twin, ledger_only=True), "a cancel")
            else:
                self.ref.mark_submitted(p_ref)
                self.twin.mark_submitted(p_twin)
                if offer is not None:
                    self.reclaimed += self.ref.pipeline.reclaim.reclaimed
                    assert (self.ref.pipeline.reclaim.reclaimed
                            == self.twin.pipeline.reclaim.reclaimed)
        for alloc in (self.ref, self.twin):
            cache = alloc.prefix_cache
            alloc.pipeline.masks = None
            alloc.pipeline.reclaim = None if cache is None else cache.index
        return None if e_ref is None else e_ref.refusal

    def compare(self) -> None:
        assert_same(state(self.ref), state(self.twin), "numpy and compiled differ")

    def both(self, op):
        """``op(alloc)`` on both (public API calls, the built-in prefix cache included);
        the same result or error, then everything compared (the last plan's outcome too)."""
        results = []
        for alloc in (self.ref, self.twin):
            self.outcomes.pop(id(alloc), None)
            try:
                results.append((op(alloc), None))
            except ContractError as exc:
                results.append((None, exc))
        (r_ref, e_ref), (r_twin, e_twin) = results
        assert (e_ref is None) == (e_twin is None), (e_ref, e_twin)
        if e_ref is not None:
            assert type(e_ref) is type(e_twin) and str(e_ref) == str(e_twin)
            assert getattr(e_ref, "refusal", None) == getattr(e_twin, "refusal", None)
            COUNTS[f"refused {int(e_ref.refusal[0])}"] += e_ref.refusal is not None
        else:
            assert r_ref == r_twin, (r_ref, r_twin)
        o_ref, o_twin = (self.outcomes.get(id(a)) for a in (self.ref, self.twin))
        assert (o_ref is None) == (o_twin is None)
        if o_ref is not None:
            compare_outcomes(o_ref, o_twin)
            COUNTS["state cache reclaimed"] += len(o_ref.reclaimed)
        self.compare()
        if self.ref.prefix_cache is not None:
            assert self.ref.prefix_cache.stats() == self.twin.prefix_cache.stats()
        return r_ref, e_ref


def count_state_rows(cfg, rows: np.ndarray, reclaimed) -> None:
    """What a planned state section held (for the coverage test)."""
    spec = rows[1:][rows[1:, 0] == ST_SPEC]
    COUNTS["state copies"] += int(rows[0, 0])
    COUNTS["state sets"] += int((rows[1:, 0] == 1).sum())
    COUNTS["state spec rows"] += len(spec)
    first = cfg.max_reqs + cfg.max_handles  # a second ST_SPEC row of one step: not at r * K
    COUNTS["state spec row continued"] += int(((spec[:, 1] - first) % cfg.max_spec_tokens
                                               != 0).sum())
    COUNTS["state reclaimed"] += len(reclaimed)


def state(alloc, ledger_only: bool = False) -> dict:
    out = {f"ledger.{k}": v.copy() for k, v in alloc.ledger.arrays().items()}
    if ledger_only:
        return out
    ring = alloc.ring
    for i, buf in enumerate(ring.np_bufs):
        out[f"buffer {i}"] = buf.copy()
    out["ring.used"] = list(ring.used)
    out["ring.fusable"] = list(ring.fusable)
    out["ring.state_used"] = list(ring.state_used)
    if alloc.tables is not None:
        for name, arrays in alloc.tables.host_np.items():
            for i, arr in enumerate(arrays):
                out[f"host {name} {i}"] = arr.copy()
    return out


def assert_same(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys()
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and np.array_equal(x, y), f"{what}: {key}\n{x}\n{y}"
        else:
            assert x == y, f"{what}: {key}: {x} != {y}"


def compare_outcomes(a, b) -> None:
    for name in ("release_rows", "alloc_rows", "result_rows", "result_first_lane",
                 "result_n_tokens"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y), \
            f"{name}\n{x}\n{y}"
    for name in ("n_tokens", "pages_freed", "pages_allocated", "pages_evicted", "fusable",
                 "reclaimed"):
        assert getattr(a, name) == getattr(b, name), name
    assert (a.lanes is None) == (b.lanes is None)
    if a.lanes is not None:
        for name in ("rows", "full_indptr", "swa_indptr", "last_page_len",
                     "swa_last_page_len", "seq_lens"):
            x, y = getattr(a.lanes, name), getattr(b.lanes, name)
            assert np.array_equal(x, y), f"lanes.{name}\n{x}\n{y}"
        assert a.lanes.n_lanes == b.lanes.n_lanes
    x, y = a.state_rows, b.state_rows
    assert (x is None) == (y is None)
    if x is not None:  # the whole section: header, copies, table writes, speculative rows
        assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y), \
            f"state_rows\n{x}\n{y}"


def compare_planned(a, b) -> None:
    for name in ("buffer_index", "n_release_rows", "n_alloc_rows", "n_tokens", "pages_freed",
                 "pages_allocated", "fusable", "pages_evicted", "reclaimed"):
        assert getattr(a, name) == getattr(b, name), name
    for name in ("rows", "first_lane", "n_tokens"):
        assert np.array_equal(getattr(a.result, name), getattr(b.result, name)), name
    assert a.result.n_step_tokens == b.result.n_step_tokens
    assert a.state_counts == b.state_counts
    x, y = a.state_copies, b.state_copies
    assert (x is None) == (y is None) and (x is None or np.array_equal(x, y))
    assert (a.tables is None) == (b.tables is None)
    if a.tables is not None:
        for name in ("n_lanes", "n_full_pages", "n_swa_pages", "buffer_index"):
            assert getattr(a.tables, name) == getattr(b.tables, name), name
        for name in ("full_kv_indptr_host", "swa_kv_indptr_host", "seq_lens_host",
                     "full_kv_last_page_len_host", "swa_kv_last_page_len_host"):
            x, y = getattr(a.tables, name), getattr(b.tables, name)
            assert (x is None) == (y is None) and (x is None or torch.equal(x, y)), name


# ---- random steps -----------------------------------------------------------------------------
def _pick(rng, values, p):
    values = list(values)
    return [v for v in values if rng.random() < p]


def random_step(pair: Pair, rng) -> tuple[Step, tuple | None, tuple | None]:
    """A step on the reference ledger's state: mostly valid, sometimes not (``bad``)."""
    cfg, led = pair.cfg, pair.ref.ledger
    ps, W, ring = cfg.page_size, cfg.sliding_window, cfg.swa_ring_pages > 0
    bad = rng.random() < 0.2
    live = [int(r) for r in rng.permutation(np.flatnonzero(led.live))]
    free = [int(r) for r in np.flatnonzero(~led.live)]
    L, C, f, spec = led.seq_len, led.committed, led.frontier, led.spec_steps
    used_full = 1 - led.full.n_free / cfg.num_full_pages
    roles = {}
    weights = np.array([.12, .06 + .3 * used_full, .08, .06, .3, .2, .04, .04, .1])
    for r in live:  # "round": a speculative round (commit, then a lookahead decode)
        roles[r] = str(rng.choice(["none", "release", "commit", "trim", "decode", "extend",
                                   "load", "advance", "round"], p=weights / weights.sum()))
    kw: dict = {}
    held = np.flatnonzero(led.h_live) if cfg.max_handles else np.zeros(0, int)
    unheld = np.flatnonzero(~led.h_live) if cfg.max_handles else np.zeros(0, int)
    # take: free handles of rows' committed whole pages
    if len(unheld) and rng.random() < 0.3 or (ring and rng.random() < 0.02):
        cands = [r for r in live if min(L[r], C[r]) >= ps]
        if cands:
            r = int(rng.choice(cands))
            h = int(rng.choice(unheld)) if len(unheld) and not bad else int(rng.integers(-1, 7))
            n = ps * int(rng.integers(1, min(L[r], C[r]) // ps + 1)) + (bad and rng.random() < .5)
            kw["take"] = ([h], [r], [n])
    by = collections.defaultdict(list)
    for r, role in roles.items():
        by[role].append(r)
    if by["release"]:
        kw["release"] = by["release"] + ([int(rng.choice(free))] if bad and free else [])
    rounds = [r for r in by["round"] if spec[r, 0]]
    com = [r for r in by["commit"] if spec[r, 0] or bad] + rounds
    if com:
        kw["commit"] = (com, [int(rng.integers(0, spec[r, 0] + 1 + bad)) for r in com])
    if by["trim"]:
        lens = []
        for r in by["trim"]:
            lo = f[r] + W if f[r] > 0 else 0
            n = (int(rng.integers(min(lo, L[r]), L[r] + 1)) if not bad
                 else int(rng.integers(-1, L[r] + 2)))
            if rng.random() < 0.5 and not bad:
                n = min(L[r], -(-n // ps) * ps)
            lens.append(n)
        kw["trim"] = (by["trim"], lens)
    released = set(kw.get("release", []))
    if rng.random() < 0.3:
        kw["evict_all"] = True
    elif rng.random() < 0.5:
        kw["evict"] = [r for r in live if r not in released and rng.random() < 0.5]
    adv = by["advance"]
    if adv:
        pos = []
        for r in adv:
            top = min(L[r], C[r]) // ps * ps
            p = f[r] + ps * int(rng.integers(0, max(0, (top - f[r]) // ps) + 1))
            pos.append(int(p + (rng.integers(-1, 2) * ps if bad else 0)))
        kw["advance"] = (adv, pos)
    if len(held):
        d = _pick(rng, held, 0.15)
        ds = [h for h in held if h not in d and rng.random() < 0.15]
        if d:
            kw["drop"] = d + ([d[0]] if bad and rng.random() < .3 else [])
        if ds:
            kw["drop_swa"] = ds
    n_admit = int(rng.integers(0, 3)) if free else 0
    adm = list(rng.permutation(free)[:n_admit])
    on = []
    if len(held) and adm and rng.random() < 0.5 and not ring:
        on, adm = adm[:1], adm[1:]
    if adm:
        kw["admit"] = [int(r) for r in adm] + ([live[0]] if bad and live else [])
    if on:
        h = int(rng.choice(held))
        n = -1 if rng.random() < 0.4 else ps * int(rng.integers(0, led.h_len[h] // ps + 1 + bad))
        kw["admit_on"] = ([int(on[0])], [h], [n])
    dec = [r for r in by["decode"] if not spec[r, 1] or bad]
    if dec or rounds:
        kw["decode"] = dec + rounds
        if rng.random() < 0.4 or any(spec[r, 0] for r in dec) or rounds:
            kw["lookahead"] = [int(rng.integers(0 if spec[r, 0] and not bad else -1, 4))
                               for r in dec] + [int(rng.integers(0, 4)) for r in rounds]
    ext = [r for r in by["extend"] if not spec[r, 0] or bad]
    ext += [int(r) for r in adm if rng.random() < 0.5] if not ring else []
    if ext:
        cap = cfg.max_tokens_per_alloc_row
        kw["extend"] = (ext, [int(min(rng.integers(0, cap + 1 + bad),
                                      max(0, cfg.max_context_len - L[r] + bad)))
                              if r < len(L) else 1 for r in ext])
    load = [r for r in by["load"] if f[r] > 0 and not ring or bad]
    if load:
        kw["load_back"] = (load, [int(f[r] - ps * rng.integers(0, f[r] // ps + 1) + (bad and 1))
                                  for r in load])
    if bad:
        _mutate(rng, kw, live, free, held, cfg)
    excluded = offer = None
    if rng.random() < 0.12:
        rows = np.zeros(cfg.max_reqs, dtype=bool)
        for r in live:
            if roles[r] == "none" and rng.random() < 0.5:
                rows[r] = True
        hs = np.zeros(cfg.max_handles, dtype=bool)
        for h in held:
            if rng.random() < 0.2:
                hs[h] = True
        excluded = (rows, hs)
    if cfg.max_handles and rng.random() < 0.5:
        order = rng.permutation(cfg.max_handles).astype(np.int64)
        offer = (order, rng.permutation(order))
    if cfg.has_states:
        _state_kinds(rng, kw, pair)
    return Step(**kw), excluded, offer


def _state_kinds(rng, kw: dict, pair: Pair) -> None:
    """With recurrent-state slots: keep the states' rules most of the time -- extends
    ending on a page (so C can be snapshotted), takes at C, admits on whole handles, trims
    in [C, L], lookahead below K -- and break them sometimes (41, 40, 42, 44)."""
    cfg, led = pair.cfg, pair.ref.ledger
    ps, K, L, C = cfg.page_size, cfg.max_spec_tokens, led.seq_len, led.committed
    if "extend" in kw and rng.random() < .6:
        rows, ns = kw["extend"]
        to_page = [n + (-(L[r] + n)) % ps for r, n in zip(rows, ns, strict=True)]
        kw["extend"] = (rows, [m if m <= cfg.max_tokens_per_alloc_row else n
                               for m, n in zip(to_page, ns, strict=True)])
    if "take" in kw and 0 <= kw["take"][1][0] < cfg.max_reqs and rng.random() < .8:
        h, r, _ = kw["take"]
        kw["take"] = (h, r, [int(C[r[0]])])
    if "admit_on" in kw and rng.random() < .7:
        kw["admit_on"] = (*kw["admit_on"][:2], [-1])
    if "trim" in kw:
        rows, lens = kw["trim"]
        kw["trim"] = (rows, [int(rng.integers(C[r], L[r] + 1)) if rng.random() < .85 else n
                             for r, n in zip(rows, lens, strict=True)])
    look = kw.get("lookahead")
    if look is not None:
        kw["lookahead"] = [k if k < 0 else int(rng.integers(0, K)) if rng.random() < .95 else K
                           for k in look]


def _mutate(rng, kw: dict, live, free, held, cfg) -> None:
    """One more way for a step to be wrong (repeats, a written handle, a row allocating
    twice, an admitted row allocating in ring mode, a row past the frozen shape)."""
    choice = int(rng.integers(0, 7))
    if choice == 0 and kw.get("decode"):
        kw["decode"] = kw["decode"] + kw["decode"][:1]
        kw.pop("lookahead", None)
    elif choice == 1 and free:
        kw["admit"] = [free[0], free[0]]
    elif choice == 2 and "take" in kw:
        h = kw["take"][0][0]
        kw["drop" if rng.random() < .5 else "drop_swa"] = [h]
    elif choice == 3 and kw.get("decode") and live:
        r = kw["decode"][0]
        kw["extend"] = ([r], [1])
    elif choice == 4 and free and cfg.swa_ring_pages:
        kw["admit"] = [free[0]]
        kw["extend"] = ([free[0]], [1])
    elif choice == 5 and live:
        kw["extend"] = ([live[0]], [cfg.max_tokens_per_alloc_row + 1])
    elif choice == 6 and live and "take" in kw:
        h, r, n = kw["take"]
        kw["take"] = (h, r, [n[0] + cfg.page_size * 50])


def drive(name: str, seed: int, n_steps: int) -> Pair:
    pair = Pair(name)
    rng = np.random.default_rng(seed)
    for _ in range(n_steps):
        step, excluded, offer = random_step(pair, rng)
        try:
            arrays = normalize(step, pair.cfg)
        except ContractError:
            COUNTS["not normalised"] += 1
            continue
        mode = rng.choice(["submit", "cancel", "dry"], p=[.75, .15, .1])
        refusal = pair.step(arrays, mode, excluded, offer)
        if refusal is None:
            for kind in step.kinds():
                COUNTS[f"kind {kind}"] += 1
        pair.ref.ledger.check_host_invariants()
    return pair


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_steps_match_the_reference(name, seed):
    pair = drive(name, seed, 300)
    assert pair.twin.pipeline.compiled.n_planned > 50


@pytest.mark.parametrize("name", sorted(LAYER_CONFIGS))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_steps_of_new_pools_match_the_reference(name, seed):
    """Models the keyword form cannot describe: no window layers, chunked local attention."""
    pair = drive(name, seed, 300)
    assert pair.twin.pipeline.compiled.n_planned > 50


@pytest.mark.parametrize("name", sorted(STATE_CONFIGS))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_steps_with_state_slots_match_the_reference(name, seed):
    pair = drive(name, seed, 300)
    assert pair.twin.pipeline.compiled.n_planned > 50
    assert pair.ref.ledger.states.n_free < pair.cfg.num_state_slots  # slots were held


# ---- directed cases ---------------------------------------------------------------------------
def run(pair: Pair, mode: str = "submit", **kinds):
    """One Step on both; the refusal tuple or None."""
    return pair.step(normalize(Step(**kinds), pair.cfg), mode)


def prefill(pair: Pair, n_tokens, **more) -> list[int]:
    """Admit len(n_tokens) rows and extend them (two steps); returns the rows."""
    free = [int(r) for r in np.flatnonzero(~pair.ref.ledger.live)][:len(n_tokens)]
    assert run(pair, admit=free, **more) is None
    chunk = min(pair.cfg.max_tokens_per_alloc_row, pair.cfg.max_step_tokens)
    for r, n in zip(free, n_tokens, strict=True):
        while n > 0:
            assert run(pair, extend=([r], [min(n, chunk)]), evict_all=True) is None
            n -= chunk
    return free


def test_release_shape_refusals():
    pair = Pair("pool-ps3-tight", sliding_window=40)
    rows = prefill(pair, [24, 24, 24])
    assert run(pair, release=rows)[:3] == (35, 13, 0)
    pair = Pair("pool-ps3-tight", max_release_rows=40, sliding_window=40)
    rows = prefill(pair, [24, 24, 24])
    assert run(pair, release=rows)[:3] == (35, 13, 1)
    assert run(pair, release=rows[:1]) is None


def test_lane_shape_refusals():
    pair = Pair("pool-ps2")  # max_batch 3, 30 FULL indices, 8 SWA
    rows = prefill(pair, [24, 24, 24])
    assert run(pair, decode=rows)[:3] == (35, 13, 5)
    assert run(pair, decode=rows[:2]) is None
    pair = Pair("pool-ps1-i32")  # max_batch 4 of 5 rows
    rows = prefill(pair, [3, 3, 3, 3, 3])
    assert run(pair, decode=rows)[:5] == (35, 13, 4, 5, 4)


def test_load_back_refusals_and_rows():
    pair = Pair("pool-ps16-handles", sliding_window=15)
    (r,) = prefill(pair, [48])
    assert run(pair, evict=[r]) is None
    assert pair.ref.ledger.frontier[r] == 32
    assert run(pair, load_back=([r], [48])) == (32, 12, r, 48, 32)
    assert run(pair, load_back=([r], [8])) == (19, 12, r, 8, 16)
    assert run(pair, load_back=([r], [0]), decode=[r]) == (22, 12, r, 0, 0)
    assert run(pair, load_back=([r], [0])) is None
    assert pair.ref.ledger.frontier[r] == 0


@pytest.mark.parametrize("n_swa, expected", [(18, [(0, False), (1, False)]),
                                              (9, [(1, True), (0, True)])])
def test_reclaim_in_the_offered_order(n_swa, expected):
    pair = Pair("pool-ps16-handles", num_swa_pages=n_swa)
    rows = prefill(pair, [48, 48])
    assert run(pair, take=([0, 1], rows, [48, 32])) is None
    assert run(pair, release=rows) is None  # the handles keep their pages
    offer = (np.array([3, 1, 0], dtype=np.int64), np.array([0, 4, 1], dtype=np.int64))
    rows = prefill(pair, [0, 0, 0])
    for r in rows * 6:
        pair.step(normalize(Step(extend=([r], [48]), evict_all=True), pair.cfg), "submit",
                  offer=offer)
    assert [(h, tomb) for h, tomb, *_ in pair.reclaimed][:2] == expected, pair.reclaimed


def test_trim_into_a_shared_page():
    pair = Pair("pool-ps16-handles")
    (r,) = prefill(pair, [40])
    assert run(pair, take=([2], [r], [32])) is None
    assert run(pair, trim=([r], [20])) == (18, 3, r, 20, 32)
    assert run(pair, trim=([r], [32])) is None  # a page boundary: allowed
    assert run(pair, decode=[r], lookahead=[2]) is None
    assert run(pair, commit=([r], [1])) is None
    assert run(pair, trim=([r], [33])) is None


def test_refusal_puts_back_the_descriptor_rows_it_overwrote():
    pair = Pair("pool-ps16-handles")
    rows = prefill(pair, [40, 40, 40])
    for _ in range(3):  # both buffers hold rows of earlier steps
        assert run(pair, decode=rows, evict_all=True) is None
    before = state(pair.twin)
    # frees that write release rows, then a shortage at the end: everything put back
    assert run(pair, release=rows[:1], extend=(rows[1:], [20, 20]), mode="cancel") is None
    refusal = run(pair, release=rows[:1], decode=rows[1:], extend=([rows[1]], [5]))
    assert refusal[0] == RefusalCode.ROW_ALLOCATES_TWICE
    del before


def test_a_dry_run_while_a_step_is_pending_keeps_the_pending_step():
    pair = Pair("pool-ps16-handles")
    rows = prefill(pair, [30, 30])
    start = state(pair.twin, ledger_only=True)
    planned = pair.twin.pipeline.plan(normalize(Step(decode=rows[1:], release=rows[:1]), pair.cfg))
    pending = state(pair.twin, ledger_only=True)
    pair.twin.dry_run(Step(decode=rows[1:], evict_all=True))
    assert_same(pending, state(pair.twin, ledger_only=True), "a dry run over a pending step")
    pair.twin.cancel(planned)
    assert_same(start, state(pair.twin, ledger_only=True), "cancel after a dry run")


def test_results_held_by_the_caller_are_never_overwritten():
    pair = Pair("pool-ps16-handles")
    rows = prefill(pair, [10, 10, 10])
    twin = pair.twin
    kept = twin.step(decode=rows)
    first = kept.rows.copy(), kept.first_lane.copy(), kept.n_tokens.copy()
    for _ in range(2 * len(twin.ring)):
        twin.step(decode=rows[::-1], extend=([], []))
    assert np.array_equal(kept.rows, first[0]) and np.array_equal(kept.n_tokens, first[2])
    assert np.array_equal(kept.first_lane, first[1])


# ---- recurrent-state slots: directed cases --------------------------------------------------
def free_rows(pair: Pair, n: int) -> list[int]:
    return [int(r) for r in np.flatnonzero(~pair.ref.ledger.live)][:n]


def test_state_rules_refuse_alike():
    pair = Pair("states-ps4-k3", num_state_slots=4)  # K = 3
    (r,) = prefill(pair, [8])
    (b,) = free_rows(pair, 1)
    assert run(pair, take=([0], [r], [4])) == (41, 0, r, 4, 8)  # a snapshot at C only
    assert run(pair, take=([0], [r], [8])) is None
    assert run(pair, admit_on=([b], [0], [4])) == (40, 9, 0, 4, 8)  # the whole handle only
    assert run(pair, decode=[r], lookahead=[3]) == (44, 10, r, 4, 3)  # 1 + k > K
    assert run(pair, decode=[r], lookahead=[2]) == (43, 10, r, 3, 2)  # 2 of 4 slots free
    assert run(pair, decode=[r], lookahead=[1]) is None
    assert run(pair, trim=([r], [4])) == (42, 3, r, 4, 8)  # below C
    assert run(pair, trim=([r], [9])) is None  # the second token's slot goes back
    assert run(pair, admit=[b]) is None
    assert run(pair, commit=([r], [1])) is None
    assert pair.ref.ledger.states.n_free == 1


@pytest.mark.parametrize("n_slots", [3, 4])
def test_a_copy_into_a_slot_another_copy_reads_is_refused(n_slots):
    """Take a snapshot of a, release a and admit b on another handle in one step: with one
    free slot the admit pops a's slot, which the take's copy reads (45); with two it pops a
    free one. Split over two steps it always works."""
    pair = Pair("states-ps4-k3", num_state_slots=n_slots)
    (a,) = prefill(pair, [8])
    assert run(pair, take=([1], [a], [8])) is None
    (b,) = free_rows(pair, 1)
    slot_a = int(pair.ref.ledger.state_slot[a])
    both = dict(take=([0], [a], [8]), release=[a], admit_on=([b], [1], [-1]))
    if n_slots == 3:
        assert run(pair, **both) == (45, 9, 0, slot_a, 0)
        assert run(pair, take=([0], [a], [8]), release=[a]) is None
        assert run(pair, admit_on=([b], [1], [-1])) is None
    else:
        assert run(pair, **both) is None
    assert pair.ref.ledger.states.n_free == n_slots - 3


def test_prefix_cache_drops_snapshots_when_state_slots_run_short():
    """The built-in prefix cache on both planners: entries inserted until the slot pool is
    short, then admits (plain and on a locked entry) and speculative decodes that only fit
    after the step drops entries (their snapshots come back), until nothing is left to drop."""
    pair = Pair("states-ps4-k3", prefix_cache=True, num_state_slots=7)

    def tokens(i):
        return list(range(100 * i, 100 * i + 8))

    def prefill_and_insert(i):
        def op(a):
            r = a.admit()
            a.step(extend=([r], [8]))
            n = a.prefix_cache.insert(r, tokens(i))
            a.release([r])
            return r, n
        return op

    for i in range(6):  # every handle held, then the LRU entry makes room for the next
        assert pair.both(prefill_and_insert(i)) == ((0, 8), None)
    assert pair.ref.ledger.states.n_free == 2  # 5 snapshots of 7 slots

    def admit_on_match(i):
        def op(a):
            m = a.prefix_cache.match(tokens(i) + [7])
            return m.cached_tokens, a.admit(handle=m.handle, n_tokens=m.cached_tokens)
        return op

    def entries():
        assert len(pair.ref.prefix_cache) == len(pair.twin.prefix_cache)
        return len(pair.ref.prefix_cache)

    def step(**kinds):
        def op(a):
            a.step(**kinds)
        return pair.both(op)[1]

    rows = [pair.both(lambda a: a.admit())[0] for _ in range(2)]  # the pool is empty now
    assert entries() == 5
    rows.append(pair.both(admit_on_match(5))[0][1])  # an entry dropped for its slot
    rows.append(pair.both(lambda a: a.admit())[0])  # another
    assert entries() == 3
    assert step(decode=rows[:1], lookahead=1) is None  # two more for the speculative step
    assert entries() == 1
    assert step(commit=(rows[:1], [1])) is None  # two slots back
    error = step(decode=rows, lookahead=1)  # 8 slots: 2 free + 1 snapshot are not enough
    assert error.refusal == (RefusalCode.STATE_SLOTS_SHORT, Kind.DECODE, rows[0], 8, 3), \
        error.refusal
    assert entries() == 1  # the refused step dropped nothing
    assert COUNTS["state cache reclaimed"] >= 4


def test_an_admit_on_a_cache_entry_never_reclaims_that_entry():
    """Slots short, the entry admitted on first in the cache's offer: the step drops the
    other entry (or is refused, 43, when there is none) -- never the one it restores (the
    admit would copy the sink slot and reference freed pages)."""
    pair = Pair("states-ps4-k3", prefix_cache=True, num_state_slots=4)

    def insert(i):
        def op(a):
            r = a.admit()
            a.step(extend=([r], [8]))
            a.prefix_cache.insert(r, list(range(10 * i, 10 * i + 8)))
            a.release([r])
        return op

    pair.both(insert(0))
    pair.both(insert(1))
    h0, h1 = (int(h) for h in pair.ref.prefix_cache.offer(2)[1])  # the LRU one first
    for _ in range(2):
        pair.both(lambda a: a.admit())  # no slot free now
    snapshot = int(pair.ref.ledger.state_slot[pair.cfg.max_reqs + h0])
    row, error = pair.both(lambda a: a.admit(handle=h0))
    out = pair.outcomes[id(pair.ref)]
    assert error is None and [h for h, *_ in out.reclaimed] == [h1]
    assert out.state_rows[0, 0] == 1 and out.state_rows[1, 1:3].tolist() == [
        snapshot, pair.ref.ledger.state_slot[row]]  # h0's snapshot copied, h1's slot reused
    for alloc in (pair.ref, pair.twin):
        alloc.check_integrity()
    (x, y) = free_rows(pair, 2)
    _, error = pair.both(lambda a: a.admit(handle=h0))  # nothing else to drop
    assert error.refusal[:2] == (RefusalCode.STATE_SLOTS_SHORT, Kind.ADMIT_ON)
    _, error = pair.both(lambda a: a.step(admit=[x], admit_on=([y], [h0], [-1])))
    assert error.refusal[:2] == (RefusalCode.STATE_SLOTS_SHORT, Kind.ADMIT)
    # the plain admit's reclaim keeps h0 too
    assert pair.both(lambda a: a.try_step(admit=[x], admit_on=([y], [h0], [-1]))) == (None,
                                                                                        None)
    for alloc in (pair.ref, pair.twin):
        alloc.check_integrity()


def test_planner_argument(monkeypatch):
    cfg, _ = make_config("pool-ps16-handles")
    assert compiled.resolve_planner("numpy") == "numpy"
    monkeypatch.setenv("GRAPHALLOC_PLANNER", "numpy")
    assert HybridAllocator(cfg).pipeline.compiled is None
    monkeypatch.delenv("GRAPHALLOC_PLANNER")
    assert HybridAllocator(cfg).pipeline.compiled is not None
    states, _ = make_config("states-ps4-k3")  # the twin plans state slots too
    assert HybridAllocator(states).pipeline.compiled is not None
    assert HybridAllocator(states, planner="compiled").pipeline.compiled is not None
    monkeypatch.setattr(compiled, "AVAILABLE", False)
    with pytest.raises(ConfigError):
        HybridAllocator(cfg, planner="compiled")
    assert HybridAllocator(cfg).pipeline.compiled is None


def test_abi_constants_match():
    from graphalloc.plan import _cplan
    for name, value in _cplan.ABI.items():
        assert compiled._expected(name) == value, name


def test_zz_coverage():
    """The random and directed cases above exercised every kind and refusal code (run
    after them: a test that stopped reaching one fails here)."""
    if COUNTS["mode submit"] < 1000:
        pytest.skip("runs after the random tests")
    for kind in ("take", "release", "commit", "trim", "evict", "evict_all", "advance", "drop",
                 "drop_swa", "admit", "admit_on", "decode", "extend", "load_back"):
        assert COUNTS[f"kind {kind}"] > 0, kind
    codes = {int(k.split()[1].split(".")[0]) for k in COUNTS if k.startswith("refused")}
    # every code the planners raise, but the state slots' (test_state_slots covers them: this
    # file's allocators have none) and the allocator's own (no free row: not a plan)
    planned = {c for c in RefusalCode
               if not c.name.startswith("STATE_") and c is not RefusalCode.NO_FREE_ROW}
    assert codes >= planned, sorted(c.name for c in planned - codes)
    for shape in range(7):
        assert COUNTS[f"refused {int(RefusalCode.STEP_OVER_SHAPE)}.{shape}"] > 0, shape
    assert COUNTS["lookahead"] and COUNTS["mode cancel"] and COUNTS["mode dry"]
    assert COUNTS["reclaimed"] and COUNTS["not fusable"] and COUNTS["cut and allocated"]
    print(sorted(COUNTS.items()))


def test_zz_states_coverage():
    """The state-slot cases above reached every state rule and row kind (run after them)."""
    if COUNTS["state sets"] < 1000:
        pytest.skip("runs after the random tests with state slots")
    codes = {int(k.split()[1].split(".")[0]) for k in COUNTS if k.startswith("refused")}
    assert codes >= set(range(40, 46)), sorted(set(range(40, 46)) - codes)
    for what in ("state copies", "state spec rows", "state spec row continued",
                 "state reclaimed", "state cache reclaimed"):
        assert COUNTS[what] > 0, what
