"""Stateful comparison of HybridAllocator (Torch backend, CPU) against tests/lib/model.py.

A hypothesis state machine drives both with random admits (plain, and on a handle),
handles taken on live requests, handle drops and SWA tombstones, extends (zero
tokens and zero new pages included), decodes, window evictions, frontier advances,
releases, free groups (with deferred handle drops) and combined steps, valid and
invalid. After every rule it checks the allocator's integrity checker, and then
independently: exact equality with the model (free queues in order, ``full_to_swa``,
``req_to_token`` on held positions, ring pages, counts, step count, the slots each
allocation returned, the live handles and what each one holds and would free), per-pool
conservation with references rebuilt from the device tables (every held page counted
once per holder and equal to the model's counts, none both held and free, none lost,
page 0 never handed out), page density of the mapping, and page-aligned monotone
frontiers. An operation the model refuses must raise the matching typed error with the
snapshot and stats unchanged. Ring-mode configurations refuse every sharing call with
a ContractError, nothing changed.

Speculative decoding is interleaved with all of it: decodes with lookahead (one k for
the batch or one per row; two steps in flight, a third refused), commits of any accepted
count (all rejected, all accepted, one past the step: refused), trims (to a page
boundary, across one, below the frontier plus the window: refused), and the typical
round as one step (commit, evict, then the next lookahead decode); committed lengths and
speculative tails are compared with the model after every rule.

Contracts of the blocks and the launch (round 3): trims drawn into the pages a row shares
with a handle (SharedPageError, nothing changed); launches that raise at random steps (the
executor fails before launching: LaunchError, the model does nothing, the audit stays
exact and ``check()`` -- device faults and the step count -- stays clean); audits and
``check()`` inside open ``free_group()`` and ``scheduler_step()`` blocks; scheduler_step()
blocks compared with the model's one step, with misuse inside (a direct mutation: refused,
nothing changed), a block that raises (discarded), and calls on the closed block (refused).
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from conftest import assert_same_snapshot
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from model import (
    ALIGNMENT,
    BATCH,
    CAPACITY,
    FRONTIER,
    HANDLE,
    MAPPED,
    NESTED,
    NO_WINDOW,
    OVERLAP,
    POSITION,
    RING,
    SHARED,
    SHARING,
    SPEC,
    STATE_ADMIT,
    STATE_READ,
    STATE_SHORT,
    STATE_SPEC,
    STATE_TAKE,
    STATE_TRIM,
    UNKNOWN,
    Model,
    Violation,
    ceil_div,
)

from graphalloc import AllocatorConfig, HybridAllocator
from graphalloc import errors as E
from graphalloc.device.executor import EagerExecutor
from graphalloc.pools import ChunkedLocal, FullAttention, SlidingWindow

ERRORS = {
    UNKNOWN: E.UnknownRequestError,
    OVERLAP: E.OverlapError,
    CAPACITY: E.CapacityError,
    ALIGNMENT: E.AlignmentError,
    POSITION: E.PositionError,
    FRONTIER: E.FrontierError,
    BATCH: E.BatchTooLargeError,
    RING: E.RingOverflowError,
    NESTED: E.NestedGroupError,
    HANDLE: E.UnknownHandleError,
    SHARING: E.ContractError,  # ring mode: every sharing call is refused
    SPEC: E.SpeculativeStateError,
    SHARED: E.SharedPageError,
    MAPPED: E.ContractError,  # code 33
    NO_WINDOW: E.ContractError,  # code 46: a frontier move without window layers
    # recurrent-state slots (tests/planning/test_state_slots.py drives this machine with them)
    STATE_ADMIT: E.PositionError,  # code 40
    STATE_TAKE: E.PositionError,  # 41
    STATE_TRIM: E.PositionError,  # 42
    STATE_SHORT: E.CapacityError,  # 43
    STATE_SPEC: E.BatchTooLargeError,  # 44
    STATE_READ: E.CapacityError,  # 45
}

I32, I64 = torch.int32, torch.int64


# name: AllocatorConfig kwargs (+ the allocator's fused_step: one fused release+allocation
# launch where the step allows it, or always two). Small pools so capacity is hit often;
# few handle slots so CapacityError for handles is hit too. Ring mode has no handle slots
# (the config refuses max_handles > 0 with a ring): its sharing calls must be refused.
CONFIGS = {
    "ps1": dict(page_size=1, num_full_pages=14, num_swa_pages=8, max_reqs=4,
                max_context_len=10, sliding_window=3, index_dtype=I64, max_handles=3,
                fused_step=False),
    "ps1_ring": dict(page_size=1, num_full_pages=10, num_swa_pages=14, max_reqs=4,
                     max_context_len=10, sliding_window=3, swa_ring_pages=4, index_dtype=I32,
                     fused_step=True),
    "ps2_tight": dict(page_size=2, num_full_pages=12, num_swa_pages=8, max_reqs=3,
                      max_context_len=14, sliding_window=5, index_dtype=I32,
                      max_release_rows=4, max_pages_per_row=2, max_alloc_rows=2,
                      max_tokens_per_alloc_row=6, max_step_tokens=8, max_step_pages=9,
                      max_handles=2, fused_step=True),
    "ps3_ring": dict(page_size=3, num_full_pages=10, num_swa_pages=11, max_reqs=4,
                     max_context_len=18, sliding_window=2, swa_ring_pages=3, index_dtype=I64,
                     fused_step=False),
    "ps4": dict(page_size=4, num_full_pages=10, num_swa_pages=6, max_reqs=4,
                max_context_len=24, sliding_window=1, index_dtype=I32,  # W < ps
                max_handles=3, fused_step=True),
    "ps16_ring": dict(page_size=16, num_full_pages=10, num_swa_pages=10, max_reqs=3,
                      max_context_len=80, sliding_window=20, swa_ring_pages=3, index_dtype=I32,
                      fused_step=False),
    "ps64": dict(page_size=64, num_full_pages=8, num_swa_pages=5, max_reqs=3,
                 max_context_len=256, sliding_window=40, index_dtype=I64, max_handles=2,
                 fused_step=True),
    "ps128": dict(page_size=128, num_full_pages=5, num_swa_pages=4, max_reqs=2,
                  max_context_len=384, sliding_window=130, index_dtype=I32, max_handles=2,
                  fused_step=False),
    # pools the keyword form cannot describe: no window layers; chunked local attention
    "ps2_no_window": dict(page_size=2, max_reqs=4, max_context_len=14, index_dtype=I64,
                          layers=(FullAttention(14),), max_handles=3, fused_step=True),
    "ps3_chunked": dict(page_size=3, max_reqs=4, max_context_len=18, index_dtype=I32,
                        layers=(FullAttention(14), ChunkedLocal(4, 10)), max_handles=3,
                        fused_step=False),
    "ps1_chunked": dict(page_size=1, max_reqs=3, max_context_len=10, index_dtype=I64,
                        layers=(FullAttention(14), ChunkedLocal(3, 8)), max_handles=2,
                        fused_step=True),
    # several window pools: two sliding windows of different sizes; a sliding window beside
    # chunked local attention (the further pool has its own sections, planned by numpy)
    "ps2_two_windows": dict(page_size=2, max_reqs=4, max_context_len=14, index_dtype=I64,
                            layers=(FullAttention(14), SlidingWindow(4, 8),
                                    SlidingWindow(7, 9)), max_handles=3, fused_step=True),
    "ps1_two_windows_tight": dict(page_size=1, max_reqs=3, max_context_len=10,
                                  index_dtype=I32, layers=(FullAttention(12), SlidingWindow(6, 9),
                                                           SlidingWindow(3, 6)),
                                  max_handles=2, max_release_rows=6, max_pages_per_row=2,
                                  max_step_pages=10, fused_step=False),
    "ps3_window_chunked": dict(page_size=3, max_reqs=4, max_context_len=18, index_dtype=I32,
                               layers=(FullAttention(14), SlidingWindow(4, 9),
                                       ChunkedLocal(5, 10)), max_handles=3, fused_step=True),
    "ps2_three_windows": dict(page_size=2, max_reqs=3, max_context_len=12, index_dtype=I64,
                              layers=(FullAttention(12), ChunkedLocal(4, 8), SlidingWindow(3, 7),
                                      SlidingWindow(9, 9)), max_handles=2, fused_step=False),
}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The tables are tiny: intra-op threads only add overhead (and oversubscribe CI cores)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


class Boom(Exception):
    """Raised inside a free_group block on purpose."""


class FlakyExecutor(EagerExecutor):
    """The eager executor, raising before it launches anything when ``fail_next`` is set."""

    name = "flaky"

    def __init__(self):
        super().__init__()
        self.fail_next = False

    def execute(self, planned) -> None:
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("injected launch failure")
        super().execute(planned)


def expected_error(kinds):
    return tuple(ERRORS[k] for k in sorted(kinds))


INFO_FIELDS = ("n_tokens", "swa_start", "n_full_pages", "n_swa_pages", "frees_full",
               "frees_swa")

# ---- strategies (indices into the live rows, resolved when the rule runs) ----------------
picks = st.lists(st.integers(0, 7), max_size=4)
codes = st.tuples(st.integers(0, 3), st.integers(0, 2**20))  # token counts, see tokens_value
badness = st.sampled_from([None] * 8 + ["dead", "range", "dup"])
hbadness = st.sampled_from([None] * 7 + ["dropped", "range", "neg"])  # handle picks
hcodes = st.tuples(st.sampled_from([0] * 5 + [1, 2, 3]), st.integers(0, 2**20))


class AllocatorMachine(RuleBasedStateMachine):
    CONFIG: dict = {}

    def __init__(self):
        super().__init__()
        config = dict(self.CONFIG)
        fused = config.pop("fused_step")
        self.cfg = AllocatorConfig(device="cpu", backend="torch", **config)
        self.executor = FlakyExecutor()
        self.alloc = HybridAllocator(self.cfg, fused_step=fused, executor=self.executor)
        self.model = Model.from_config(self.cfg)
        assert self.model.max_handles == config.get("max_handles", 0)
        self.ps = self.cfg.page_size
        self.prev_frontier: dict[int, int] = {}
        self.prev_xf: dict[tuple[int, int], int] = {}

    # ---- helpers ---------------------------------------------------------------------------
    def rows_from(self, idx, bad=None) -> list[int]:
        live = sorted(self.model.reqs)
        rows = []
        if live:
            for i in idx:
                r = live[i % len(live)]
                if r not in rows:
                    rows.append(r)
        if bad == "dead":
            dead = [r for r in range(self.cfg.max_reqs) if r not in self.model.reqs]
            if dead:
                rows.append(dead[0])
        elif bad == "range":
            rows.append(self.cfg.max_reqs if len(idx) % 2 else -1)
        elif bad == "dup" and rows:
            rows.append(rows[0])
        return rows

    def handle_from(self, i: int, bad=None) -> int:
        """A live handle id, or (``bad``) a dropped / never-taken one, one past the slots,
        or -1."""
        live = sorted(self.model.handles)
        n = self.model.max_handles
        if bad is None and live:
            return live[i % len(live)]
        if bad == "neg":
            return -1
        dead = [h for h in range(n) if h not in self.model.handles]
        if bad in (None, "dropped") and dead:
            return dead[i % len(dead)]
        return n

    @staticmethod
    def form(rows: list[int], k: int):
        """The same rows as a list, an int64 array or an int32 array (the model gets the list)."""
        return [rows, np.asarray(rows, dtype=np.int64), np.asarray(rows, dtype=np.int32)][k % 3]

    @staticmethod
    def hform(h: int, k: int):
        """One id as a Python int, a numpy int64 or a numpy int32."""
        return [int, np.int64, np.int32][k % 3](h)

    def tokens_value(self, n_code) -> int:
        """Map a drawn (kind, value) onto a token count: small counts, whole pages, up to two
        pages, or anything up to past the context limit."""
        ps = self.ps
        kind, v = n_code
        if kind == 0:
            return v % 4  # 0..3 tokens
        if kind == 1:
            return (v % 3) * ps  # whole pages (0 included)
        if kind == 2:
            return v % (2 * ps + 2)
        return v % (self.cfg.max_context_len + 2)  # large: capacity and context limits

    def handle_tokens(self, row, h_code) -> int:
        """A handle length for ``row``: whole pages within its length (mostly), one token
        off a page boundary, 0, or one page past its whole pages."""
        ps = self.ps
        q = self.model.reqs.get(row) if isinstance(row, int) else None
        whole = q.length // ps if q is not None else 1
        kind, v = h_code
        if kind == 0:
            return (1 + v % max(whole, 1)) * ps
        if kind == 1:
            return (1 + v % max(whole, 1)) * ps + (1 if ps > 1 else whole + 1)
        if kind == 2:
            return 0
        return (whole + 1) * ps

    def apply(self, model_op, alloc_op):
        """Run an operation on both; compare outcome. Returns (model result, alloc result)."""
        before = self.alloc.snapshot()
        stats_before = self.alloc.stats()
        try:
            expected = model_op(self.model)
        except Violation as v:
            with pytest.raises(expected_error(v.kinds)):
                alloc_op(self.alloc)
            assert_same_snapshot(before, self.alloc.snapshot())
            assert self.alloc.stats() == stats_before
            return None, None
        got = alloc_op(self.alloc)
        return expected, got

    def compare_result(self, expected, got) -> None:
        if expected is None:  # nothing allocated: an empty result
            assert got is None or len(got.rows) == 0
            return
        assert got is not None
        assert [int(r) for r in got.rows] == [r for r, _, _ in expected]
        for i, (_, full, swa) in enumerate(expected):
            assert int(got.n_tokens[i]) == len(full)
            f, s = got.slots_of(i)
            assert f.tolist() == full
            assert s.tolist() == swa
        full_slots = [x for _, full, _ in expected for x in full]
        for p in range(1, len(self.model.x) + 1):  # further window pools: their slots
            assert got.window_slots(p).tolist() == self.model.window_slots(p, full_slots)

    # ---- operations --------------------------------------------------------------------------
    def do_admit(self):
        expected, got = self.apply(lambda m: m.admit(), lambda a: a.admit())
        if expected is not None:
            assert got == expected
        return expected

    def do_take_handle(self, i, h_code, bad, k=0):
        rows = self.rows_from([i], bad)
        row = rows[-1] if rows else 0  # no live row: row 0 is not live either
        n = self.handle_tokens(row, h_code)
        row_in = self.hform(row, k)
        expected, got = self.apply(lambda m: m.take_handle(row, n),
                                   lambda a: a.take_handle(row_in, n))
        if expected is not None:
            assert isinstance(got, (int, np.integer)) and int(got) == expected
        return expected

    def do_admit_handle(self, i, bad, k=0):
        h = self.handle_from(i, bad)
        h_in = self.hform(h, k)
        expected, got = self.apply(lambda m: m.admit(handle=h), lambda a: a.admit(handle=h_in))
        if expected is not None:
            assert got == expected
            q = self.model.reqs[expected]
            assert self.alloc.seq_len(expected) == q.length
            assert self.alloc.frontier(expected) == q.frontier
        return expected

    def do_drop_handle(self, i, bad, swa_only, k=0):
        h = self.handle_from(i, bad)
        h_in = self.hform(h, k)
        if swa_only:
            self.apply(lambda m: m.drop_handle_swa(h), lambda a: a.drop_handle_swa(h_in))
        else:
            self.apply(lambda m: m.drop_handle(h), lambda a: a.drop_handle(h_in))

    def do_extend(self, idx, codes, bad):
        rows = self.rows_from(idx, bad)
        n = [self.tokens_value(c) for c in codes][:len(rows)]
        n += [1] * (len(rows) - len(n))
        rows_in = self.form(rows, len(codes))
        self.compare_result(*self.apply(lambda m: m.alloc_extend(rows, n),
                                        lambda a: a.alloc_extend(rows_in, n)))
        assert [int(r) for r in rows_in] == rows  # the caller's array is left alone

    def do_decode(self, idx, bad):
        rows = self.rows_from(idx, bad)
        rows_in = self.form(rows, len(idx))
        self.compare_result(*self.apply(lambda m: m.alloc_decode(rows),
                                        lambda a: a.alloc_decode(rows_in)))
        assert [int(r) for r in rows_in] == rows

    def do_evict(self, idx, all_rows, bad):
        rows = None if all_rows else self.rows_from(idx, bad)
        self.apply(lambda m: m.evict_window(rows), lambda a: a.evict_window(rows))

    def advance_targets(self, rows, deltas, misalign):
        pos = []
        for i, r in enumerate(rows):
            req = self.model.reqs.get(r)
            cur = req.frontier if req is not None else 0
            d = deltas[i % len(deltas)] if deltas else 0
            p = cur + d * self.ps
            if misalign and i == 0 and self.ps > 1:
                p += 1
            pos.append(p)
        return pos

    def do_advance(self, idx, deltas, misalign, bad):
        rows = self.rows_from(idx, bad)
        pos = self.advance_targets(rows, deltas, misalign)
        self.apply(lambda m: m.advance_frontier(rows, pos),
                   lambda a: a.advance_frontier(rows, pos))

    def spec_rows(self, idx, bad=None) -> list[int]:
        """Rows with speculative steps in flight (any live rows when there are none)."""
        spec = [r for r, q in sorted(self.model.reqs.items()) if q.spec]
        if not spec or bad is not None:
            return self.rows_from(idx, bad)
        return list(dict.fromkeys(spec[i % len(spec)] for i in idx))

    def accepted(self, rows, codes) -> list[int]:
        """Accepted counts: mostly within the oldest step (0 and all of it included), now
        and then one past it."""
        out = []
        for i, r in enumerate(rows):
            q = self.model.reqs.get(r)
            size = q.spec[0] if q is not None and q.spec else 1
            kind, v = codes[i % len(codes)] if codes else (0, 0)
            out.append(size + 1 if kind == 3 and v % 2 else [0, size, v % (size + 1)][kind % 3])
        return out

    def trim_targets(self, rows, codes) -> list[int]:
        """Trim lengths: a few tokens back, to a page boundary, to the committed length, or
        just below the frontier plus the window (refused once the frontier moved)."""
        out = []
        for i, r in enumerate(rows):
            q = self.model.reqs.get(r)
            length = q.length if q is not None else 0
            kind, v = codes[i % len(codes)] if codes else (0, 0)
            if kind == 0:
                out.append(max(length - v % 4, 0))
            elif kind == 1:
                out.append(max(length - 1, 0) // self.ps * self.ps)
            elif kind == 2:
                out.append(q.committed if q is not None else 0)
            else:
                f = q.frontier if q is not None else 0
                out.append(max(f + (self.cfg.sliding_window or 0) - 1, 0))
        return out

    def do_release(self, idx, bad):
        rows = self.rows_from(idx, bad)
        rows_in = self.form(rows, len(idx) + 1)
        self.apply(lambda m: m.release(rows), lambda a: a.release(rows_in))
        assert [int(r) for r in rows_in] == rows

    # ---- rules -------------------------------------------------------------------------------
    @initialize(n=st.integers(0, 4), codes=st.lists(codes, min_size=4, max_size=4))
    def start(self, n, codes):
        for _ in range(min(n, self.cfg.max_reqs)):
            self.do_admit()
        for i in range(min(n, self.cfg.max_reqs)):
            self.do_extend([i], codes[i:i + 1], None)

    @rule()
    def admit(self):
        self.do_admit()

    @rule(i=st.integers(0, 7), h_code=hcodes, bad=badness, k=st.integers(0, 2))
    def take_handle(self, i, h_code, bad, k):
        self.do_take_handle(i, h_code, None if bad == "dup" else bad, k)

    @precondition(lambda self: self.model.x and self.model.reqs)
    @rule(i=st.integers(0, 7), h_code=hcodes, codes=st.lists(codes, min_size=2, max_size=2),
          then=st.sampled_from(["keep", "tombstone", "drop", "release"]))
    def further_windows_share(self, i, h_code, codes, then):
        """A model's further window pools: grow a row, evict every row (each pool by its own
        rule, so their frontiers part), take a handle on a row's first whole pages (below,
        inside or past each pool's frontier), admit on it and extend, then keep, tombstone
        or drop the handle, or release the source row."""
        self.do_extend([i], codes[:1], None)
        self.do_evict([], True, None)
        h = self.do_take_handle(i, h_code, None)
        if h is None:
            return
        row = self.do_admit_handle(sorted(self.model.handles).index(h), None)
        if row is not None:
            self.do_extend([sorted(self.model.reqs).index(row)], codes[1:], None)
            self.do_evict([], True, None)
        if then in ("tombstone", "drop"):
            self.do_drop_handle(sorted(self.model.handles).index(h), None, then == "tombstone")
        elif then == "release" and self.model.reqs:
            self.do_release([i], None)

    @rule(i=st.integers(0, 7), bad=hbadness, code=codes, k=st.integers(0, 2))
    def admit_on_handle_and_extend(self, i, bad, code, k):
        row = self.do_admit_handle(i, bad, k)
        if row is not None:
            self.do_extend([sorted(self.model.reqs).index(row)], [code], None)

    @precondition(lambda self: any(q.length >= self.ps for q in self.model.reqs.values()))
    @rule(src=st.integers(0, 7), h_code=hcodes, code=codes, then=st.sampled_from(
        ["keep", "drop", "drop_swa", "release_donor", "trim_shared"]))
    def share_and_extend(self, src, h_code, code, then):
        """A handle on whole pages of a live request, a request admitted on it that then
        extends with its own tokens, and the handle kept, dropped or tombstoned, or the
        donor released (the sharer and the handle keep the pages), or the sharer trimmed
        into the shared prefix (mid-page: SharedPageError, nothing changed)."""
        live = sorted(self.model.reqs)
        sources = [r for r in live if self.model.reqs[r].length >= self.ps]
        donor = sources[src % len(sources)]
        h = self.do_take_handle(live.index(donor), (0, h_code[1]), None)
        if h is None:
            return
        row = self.do_admit_handle(sorted(self.model.handles).index(h), None)
        if row is not None:
            self.do_extend([sorted(self.model.reqs).index(row)], [code], None)
        if then == "drop":
            self.do_drop_handle(sorted(self.model.handles).index(h), None, False)
        elif then == "drop_swa":
            self.do_drop_handle(sorted(self.model.handles).index(h), None, True)
        elif then == "release_donor":
            self.do_release([sorted(self.model.reqs).index(donor)], None)
        elif then == "trim_shared" and row is not None:
            n = self.shared_targets([row], [code])
            self.apply(lambda m: m.trim([row], n), lambda a: a.trim([row], n))

    @rule(i=st.integers(0, 7), bad=hbadness, swa_only=st.booleans(), k=st.integers(0, 2))
    def drop_handle(self, i, bad, swa_only, k):
        self.do_drop_handle(i, bad, swa_only, k)

    @rule(idx=picks, codes=st.lists(codes, max_size=4), bad=badness)
    def extend(self, idx, codes, bad):
        self.do_extend(idx, codes, bad)

    @rule(idx=picks, bad=badness)
    def decode(self, idx, bad):
        self.do_decode(idx, bad)

    @rule(idx=picks, codes=st.lists(codes, max_size=4))
    def extend_valid_rows(self, idx, codes):  # a second allocating rule: pools fill up
        self.do_extend(idx, codes, None)

    @rule(idx=picks, k=st.integers(0, 3), per_row=st.booleans(), bad=badness)
    def spec_decode(self, idx, k, per_row, bad):
        rows = self.spec_rows(idx, bad) if k % 2 else self.rows_from(idx, bad)
        look = [(k + i) % 3 for i in range(len(rows))] if per_row else k
        rows_in = self.form(rows, len(idx))
        self.compare_result(*self.apply(lambda m: m.alloc_decode(rows, lookahead=look),
                                        lambda a: a.alloc_decode(rows_in, lookahead=look)))

    @rule(idx=picks, codes=st.lists(codes, max_size=3), bad=badness)
    def commit(self, idx, codes, bad):
        rows = self.spec_rows(idx, bad)
        n = self.accepted(rows, codes)
        self.apply(lambda m: m.commit(rows, n), lambda a: a.commit(rows, n))

    def shared_rows(self, idx) -> list[int]:
        """Live rows holding a page another holder references (rows admitted on handles,
        donors of handles)."""
        m = self.model
        rows = [r for r, q in sorted(m.reqs.items()) if any(m.full_ref[p] > 1 for p in q.pages)]
        return list(dict.fromkeys(rows[i % len(rows)] for i in idx)) if rows else []

    def shared_targets(self, rows, codes) -> list[int]:
        """Trim lengths inside a shared page (mid-page when ps > 1: refused, the next
        allocation would write it), or at its end."""
        m, ps, out = self.model, self.ps, []
        for i, r in enumerate(rows):
            q = m.reqs[r]
            shared = [k for k, p in enumerate(q.pages) if m.full_ref[p] > 1]
            kind, v = codes[i % len(codes)] if codes else (0, 0)
            k = shared[v % len(shared)]
            n = k * ps + (1 + v % (ps - 1) if ps > 1 and kind != 1 else ps)
            out.append(min(n, q.length))
        return out

    @rule(idx=picks, codes=st.lists(codes, max_size=3), bad=badness, shared=st.booleans())
    def trim(self, idx, codes, bad, shared):
        rows = self.shared_rows(idx) if shared and bad is None else []
        if rows:  # into the pages a row shares with a handle (or another request)
            n = self.shared_targets(rows, codes)
        else:
            rows = self.spec_rows(idx, bad)
            n = self.trim_targets(rows, codes)
        self.apply(lambda m: m.trim(rows, n), lambda a: a.trim(rows, n))

    @rule(kind=st.sampled_from(["decode", "extend", "step", "release"]), idx=picks,
          codes=st.lists(codes, max_size=3))
    def launch_fails(self, kind, idx, codes):
        """The executor raises at this step, before launching anything: the step is cancelled
        (LaunchError from the cause) and nothing changes; a step the model refuses is refused
        before any launch (the executor is not reached)."""
        rows = self.rows_from(idx)
        n = [self.tokens_value(c) for c in codes][:len(rows)]
        n += [1] * (len(rows) - len(n))
        if kind == "decode":
            op = dict(decode=rows)
        elif kind == "extend":
            op = dict(extend=(rows, n))
        elif kind == "step":
            op = dict(evict=rows, decode=rows[:1], extend=(rows[1:], n[1:]))
        else:
            op = dict(release=rows[:1])
        before, stats = self.alloc.snapshot(), self.alloc.stats()
        try:
            self.model.clone().step(**op)
        except Violation as v:
            with pytest.raises(expected_error(v.kinds)):
                self.alloc.step(**op)
        else:
            self.executor.fail_next = True
            with pytest.raises(E.LaunchError) as info:
                self.alloc.step(**op)
            assert isinstance(info.value.__cause__, RuntimeError)
        self.executor.fail_next = False  # (a refused step never reached the executor)
        assert self.alloc.pending is None
        assert_same_snapshot(before, self.alloc.snapshot())
        assert self.alloc.stats() == stats

    @precondition(lambda self: self.model.reqs)
    @rule(rel=picks, dec=picks, ext=picks, codes=st.lists(codes, max_size=3),
          n_admit=st.integers(0, 2), misuse=st.booleans(), raise_inside=st.booleans(),
          bad=badness)
    def scheduler_block(self, rel, dec, ext, codes, n_admit, misuse, raise_inside, bad):
        """One scheduler_step() block against the model's one step: the audit is clean and
        the snapshot committed inside it; a direct mutation inside it is refused with nothing
        changed; a block that raises runs nothing; after it, a call on the closed block is
        refused."""
        a, m = self.alloc, self.model
        release = self.rows_from(rel[:1]) if self.busy() else []
        others = [r for r in sorted(m.reqs) if r not in release]
        pick = lambda idx: list(dict.fromkeys(others[i % len(others)] for i in idx)) \
            if others else []
        decode = pick(dec)
        ext_rows = [r for r in pick(ext) if r not in decode]
        if bad == "dup" and release:
            decode = decode + release  # released in this step, then decoded: unknown
        elif bad == "range":
            decode = decode + [self.cfg.max_reqs]
        n = [self.tokens_value(c) for c in codes][:len(ext_rows)]
        n += [1] * (len(ext_rows) - len(n))
        admitted: list[int] = []
        for _ in range(n_admit):
            free = [r for r in m._free_rows() if r not in admitted]
            if free:
                admitted.append(free[0])
        before, stats = a.snapshot(), a.stats()

        def block():
            with a.scheduler_step() as it:
                if release:
                    it.release(release)
                assert [it.admit() for _ in admitted] == admitted
                if decode:
                    it.decode(decode)
                if ext_rows:
                    it.extend(ext_rows, n)
                assert a.audit() == []  # nothing ran yet: the committed state, healthy
                a.check()
                assert_same_snapshot(before, a.snapshot())
                if misuse:
                    with pytest.raises(E.RecorderError):
                        a.alloc_decode(decode or [0])
                    with pytest.raises(E.RecorderError):
                        a.release(release or [0])
                    assert_same_snapshot(before, a.snapshot())
                if raise_inside:
                    raise Boom()
            return it

        if raise_inside:
            with pytest.raises(Boom):
                block()
            assert_same_snapshot(before, a.snapshot())
            assert a.stats() == stats
            return
        step = dict(release=release, admit=admitted, decode=decode,
                    extend=(ext_rows, n) if ext_rows else None)
        try:
            expected = m.step(**step)
        except Violation as v:
            with pytest.raises(expected_error(v.kinds)):
                block()
            assert_same_snapshot(before, a.snapshot())
            assert a.stats() == stats
            return
        it = block()
        self.compare_result(expected, it.result)
        after = a.snapshot()
        with pytest.raises(E.RecorderError):
            it.decode(decode or [0])
        assert_same_snapshot(after, a.snapshot())

    @rule(idx=picks, codes=st.lists(codes, max_size=3), k=st.integers(0, 2),
          evict=st.booleans(), overlap=st.booleans())
    def spec_round(self, idx, codes, k, evict, overlap):
        """The engine's round as one step: commit the oldest step's accepted counts, evict by
        the committed window, draft the next step (with overlap: draft first, commit in the
        step after)."""
        rows = [r for r in self.spec_rows(idx) if self.model.reqs[r].spec] or self.rows_from(idx)
        n = self.accepted(rows, codes)
        commit = None if overlap or not any(self.model.reqs[r].spec for r in rows) else (rows, n)
        ev = rows if evict else None
        self.compare_result(*self.apply(
            lambda m: m.step(commit=commit, evict=ev, decode=rows, lookahead=k),
            lambda a: a.step(commit=commit, evict=ev, decode=rows, lookahead=k)))

    def shared_load_back(self, idx):
        """Two rows with a FULL page in common below both frontiers, and each one's
        position of it: both load it back in one step (refused: one SWA pairing a page)."""
        m, ps = self.model, self.ps
        rows = self.shared_rows(idx)
        for i, r1 in enumerate(rows):
            q1 = m.reqs[r1]
            for r2 in rows[i + 1:]:
                q2 = m.reqs[r2]
                common = set(q1.pages[:q1.frontier // ps]) & set(q2.pages[:q2.frontier // ps])
                if common:
                    p = min(common)
                    return [r1, r2], [q1.pages.index(p) * ps, q2.pages.index(p) * ps]
        return [], []

    @rule(idx=picks, backs=st.lists(st.integers(-1, 3), min_size=1, max_size=3),
          misalign=st.booleans(), bad=badness, shared=st.booleans())
    def load_back(self, idx, backs, misalign, bad, shared):
        """Frontiers moved back by whole pages (mostly), one off a boundary, or forward; or
        (``shared``) two rows loading back a page they share."""
        rows, pos = self.shared_load_back(idx) if shared else ([], [])
        if not rows:
            rows = self.rows_from(idx, bad)
            for i, r in enumerate(rows):
                req = self.model.reqs.get(r)
                p = (req.frontier if req is not None else 0) - backs[i % len(backs)] * self.ps
                pos.append(p + 1 if misalign and i == 0 and self.ps > 1 else p)
        self.apply(lambda m: m.step(load_back=(rows, pos)),
                   lambda a: a.step(load_back=(rows, pos)))
        for r, q in self.model.reqs.items():  # the one way a frontier moves back
            self.prev_frontier[r] = min(self.prev_frontier.get(r, 0), q.frontier)

    @rule(idx=picks, all_rows=st.booleans(), bad=badness)
    def evict(self, idx, all_rows, bad):
        self.do_evict(idx, all_rows, bad)

    @rule(idx=picks, deltas=st.lists(st.integers(-1, 3), max_size=3), misalign=st.booleans(),
          bad=badness)
    def advance(self, idx, deltas, misalign, bad):
        self.do_advance(idx, deltas, misalign, bad)

    def busy(self) -> bool:
        """Enough live state that freeing is interesting (keeps the pools under pressure)."""
        m = self.model
        return len(m.reqs) >= 2 or len(m.full_q) < m.n_full // 2

    @precondition(lambda self: self.busy())
    @rule(idx=picks, bad=badness)
    def release(self, idx, bad):
        self.do_release(idx[:2], bad)

    @rule(rel=picks, ev=st.sampled_from(["none", "all", "rows"]), ev_idx=picks,
          adv=st.one_of(st.none(), st.tuples(picks, st.lists(st.integers(-1, 2), max_size=2))),
          dec=picks, ext=picks, codes=st.lists(codes, max_size=4), bad=badness)
    def combined_step(self, rel, ev, ev_idx, adv, dec, ext, codes, bad):
        live = sorted(self.model.reqs)
        # at most one release, and only under pressure, so others stay to allocate
        release = self.rows_from(rel[:1]) if self.busy() else []
        others = [r for r in live if r not in release]
        pick = lambda idx: list(dict.fromkeys(others[i % len(others)] for i in idx)) \
            if others else []
        evict = pick(ev_idx) if ev == "rows" else None
        evict_all = ev == "all"
        advance = None
        if adv is not None:  # targets relative to the frontier before this step's eviction
            adv_rows = pick(adv[0])
            advance = (adv_rows, self.advance_targets(adv_rows, adv[1], False))
        decode = pick(dec)
        ext_rows = [r for r in pick(ext) if r not in decode]
        if bad == "dup" and release:
            decode = decode + release  # released this step, then decoded: unknown
        elif bad == "dead" and decode:
            ext_rows = ext_rows + decode[:1]  # allocates twice in one step: overlap
        elif bad == "range":
            decode = decode + [self.cfg.max_reqs]
        n = [self.tokens_value(c) for c in codes][:len(ext_rows)]
        n += [1] * (len(ext_rows) - len(n))
        extend = (ext_rows, n) if ext_rows or codes else None
        self.compare_result(*self.apply(
            lambda m: m.step(release=release, evict=evict, evict_all=evict_all,
                             advance=advance, decode=decode, extend=extend),
            lambda a: a.step(release=release, evict=evict, evict_all=evict_all,
                             advance=advance, decode=decode, extend=extend)))

    group_op = st.tuples(
        st.sampled_from(["release", "evict", "evict_all", "advance", "decode", "extend",
                         "admit", "nested", "step_release", "step_advance", "take_handle",
                         "admit_handle", "drop_handle", "drop_handle_swa"]),
        picks, st.lists(st.integers(-1, 2), max_size=3), st.booleans(), badness)

    @precondition(lambda self: self.busy())
    @rule(ops=st.lists(group_op, max_size=5), raise_inside=st.booleans())
    def free_group(self, ops, raise_inside):
        def body():
            for kind, idx, deltas, flag, bad in ops:
                self.group_op(kind, idx, deltas, flag, bad)
        self.run_group(body, raise_inside)

    @precondition(lambda self: self.model.reqs)
    @rule(idx=picks, deltas=st.lists(st.integers(-1, 2), max_size=3), release_other=st.booleans())
    def group_evict_then_advance(self, idx, deltas, release_other):
        """Deferred eviction, then a deferred advance validated against the frontier as the
        eviction moved it (a target behind it is a backward move), maybe with a release."""
        def body():
            rows = self.rows_from(idx)
            others = [r for r in self.model.reqs if r not in rows]
            if release_other and others:
                self.do_release(others[:1], None)
            self.do_evict(idx, False, None)
            self.do_advance(idx, deltas, False, None)
        self.run_group(body, False)

    @precondition(lambda self: self.model.handles or self.model.ring_mode)
    @rule(i=st.integers(0, 7), release_all=st.booleans(), evict_first=st.booleans(),
          swa_first=st.booleans())
    def group_drop_handle_with_releases(self, i, release_all, evict_first, swa_first):
        """In one block: maybe an eviction, a tombstone and then the drop of a handle (the
        second call on a handle dropped in the block is refused), and the release of the
        requests that share its pages: the pages reach the queues at the exit, once."""
        def body():
            h = self.handle_from(i)
            if evict_first:
                self.do_evict([], True, None)
            if swa_first:
                self.do_drop_handle(i, None, True)
            self.do_drop_handle(i, None, False)
            # the handle is gone: its info, and a tombstone of it, are refused
            self.apply(lambda m: m.handle_info(h), lambda a: a.handle_info(h))
            self.apply(lambda m: m.drop_handle_swa(h), lambda a: a.drop_handle_swa(h))
            if release_all:
                rows = sorted(self.model.reqs)
                self.do_release(list(range(len(rows))), None)
            else:
                self.do_release([i], None)
        self.run_group(body, False)

    def run_group(self, body, raise_inside):
        """Run ``body`` inside free_group() on both; the exit runs what was recorded as one
        step (split when it exceeds the frozen shape; never refused); an exception escaping
        the block discards it on both."""
        model = self.model
        model.open_group()
        before = self.alloc.snapshot()
        try:
            with self.alloc.free_group():
                body()
                # nothing changes until the block exits
                assert self.alloc.stats()["full_free_pages"] == len(model.full_q)
                assert self.alloc.stats()["swa_free_pages"] == len(model.swa_q)
                assert self.alloc.audit() == []  # a healthy allocator is healthy inside a block
                self.alloc.check()
                if raise_inside:
                    raise Boom()
        except Boom:
            model.discard_group()
            return
        finally:
            del before
        model.close_group()
        assert model.group is None

    def group_op(self, kind, idx, deltas, flag, bad):
        i = idx[0] if idx else 0
        hbad = {"dead": "dropped", "range": "range"}.get(bad)
        if kind == "release":
            self.do_release(idx, bad)
        elif kind == "evict":
            self.do_evict(idx, False, bad)
        elif kind == "evict_all":
            self.do_evict(idx, True, bad)
        elif kind == "advance":
            self.do_advance(idx, deltas, flag, bad)
        elif kind == "decode":
            # pending (released in this block) rows are legal picks: they must be refused
            self.do_decode(idx, bad)
        elif kind == "extend":
            self.do_extend(idx, [(i % 4, i * 7) for i in idx], bad)
        elif kind == "admit":
            self.do_admit()
        elif kind == "take_handle":
            self.do_take_handle(i, (0, len(deltas)), None if bad == "dup" else bad, len(idx))
        elif kind == "admit_handle":
            self.do_admit_handle(i, hbad, len(idx))
        elif kind in ("drop_handle", "drop_handle_swa"):
            self.do_drop_handle(i, hbad, kind == "drop_handle_swa", len(idx))
        elif kind == "nested":
            before = self.alloc.snapshot()
            with pytest.raises(E.NestedGroupError):
                with self.alloc.free_group():
                    pass
            assert_same_snapshot(before, self.alloc.snapshot())
        elif kind == "step_release":  # release through step() inside a group: refused
            rows = self.rows_from(idx, bad)
            self.apply(lambda m: m.step(release=rows), lambda a: a.step(release=rows))
        else:  # frontier advance through step() inside a group: refused
            rows = self.rows_from(idx, bad)
            adv = (rows, self.advance_targets(rows, deltas, False))
            self.apply(lambda m: m.step(advance=adv), lambda a: a.step(advance=adv))

    # ---- checks ------------------------------------------------------------------------------
    @invariant()
    def matches_model(self):
        a, m, cfg, ps = self.alloc, self.model, self.cfg, self.ps
        a.check_integrity()
        a.check()  # no device fault, and the device ran exactly the steps submitted
        m.check_self()
        stats = a.stats()
        assert stats["full_free_pages"] == len(m.full_q)
        assert stats["swa_free_pages"] == len(m.swa_q)
        assert stats["full_used_pages"] == cfg.num_full_pages - len(m.full_q)
        assert stats["live_requests"] == len(m.reqs)
        assert stats["seq_len"] == {r: q.length for r, q in m.reqs.items()}
        assert stats["frontier"] == {r: q.frontier for r, q in m.reqs.items()}
        for r, q in m.reqs.items():  # speculative decoding: committed length and tail
            assert (a.committed_len(r), a.spec_len(r)) == (q.committed, sum(q.spec)), r
            spec = a.ledger.spec_steps[r]
            assert [int(x) for x in spec if x] == q.spec, r
        assert stats["steps_run"] == m.steps

        # free rings, in FIFO order from the head
        full_free = a.state.full_free.tolist()
        swa_free = a.state.swa_free.tolist()
        assert len(full_free) == cfg.num_full_pages and len(swa_free) == cfg.num_swa_pages
        head = m.free_ring_head("full")
        got_full = [full_free[(head + i) % cfg.num_full_pages] for i in range(len(m.full_q))]
        assert got_full == list(m.full_q)
        head = m.free_ring_head("swa")
        got_swa = [swa_free[(head + i) % cfg.num_swa_pages] for i in range(len(m.swa_q))]
        assert got_swa == list(m.swa_q)

        # mapping: exactly the model's, and page-dense
        f2s = a.full_to_swa.tolist()
        assert f2s == m.full_to_swa()
        for page in range(cfg.num_full_pages + 1):
            slots = f2s[page * ps:(page + 1) * ps]
            assert all(s == 0 for s in slots) or (
                slots[0] > 0 and slots[0] % ps == 0
                and slots == [slots[0] + o for o in range(ps)]), (page, slots)
        assert all(s == 0 for s in f2s[:ps]), "page 0 is mapped"

        # req_to_token on every held position; ring pages
        r2t = a.req_to_token
        for r, q in m.reqs.items():
            assert r2t[r, :q.length].tolist() == q.slots
            if cfg.ring_mode:
                assert a.state.ring_pages[r, :cfg.swa_ring_pages].tolist() == q.ring

        # handles: the live ids, and what each holds and would free (the model's counts)
        if not cfg.ring_mode:
            assert sorted(int(h) for h in a.live_handles()) == m.live_handles()
            for h in m.handles:
                info, want = a.handle_info(h), m.handle_info(h)
                assert {f: int(getattr(info, f)) for f in INFO_FIELDS} == want, h

        # conservation with references, rebuilt from the device tables (a handle's pages from
        # the model: the device names them through the rows admitted on it): every held page
        # counted once per holder, the counts equal the model's, held and free disjoint and
        # together exactly 1..N
        full_refs, swa_refs = Counter(), Counter()
        for r, q in m.reqs.items():
            pages = [int(r2t[r, p * ps]) // ps for p in range(ceil_div(q.length, ps))]
            full_refs.update(pages)
            if cfg.ring_mode:
                swa_refs.update(a.state.ring_pages[r, :cfg.swa_ring_pages].tolist())
            elif m.has_window:
                swa_refs.update(f2s[pg * ps] // ps for pg in pages[q.frontier // ps:])
        for h in m.handles.values():
            full_refs.update(h.pages)
            if m.has_window:
                swa_refs.update(f2s[pg * ps] // ps for pg in h.pages[h.swa_start // ps:])
        assert 0 not in full_refs and 0 not in swa_refs, "page 0 (or an unmapped page) held"
        assert {p: full_refs[p] for p in full_refs} == {
            p: c for p, c in enumerate(m.full_ref) if c}
        if not cfg.ring_mode:
            assert {p: swa_refs[p] for p in swa_refs} == {
                p: c for p, c in enumerate(m.swa_ref) if c}
        assert sorted(list(full_refs) + got_full) == list(range(1, cfg.num_full_pages + 1))
        assert sorted(list(swa_refs) + got_swa) == list(range(1, cfg.num_swa_pages + 1))

        # frontiers: page-aligned, within the whole pages, monotone while the row lives
        for r, q in m.reqs.items():
            f = stats["frontier"][r]
            assert f % ps == 0 and 0 <= f <= q.length // ps * ps
            assert f >= self.prev_frontier.get(r, 0)
        self.prev_frontier = {r: q.frontier for r, q in m.reqs.items()}
        self.check_further_windows()

    def check_further_windows(self):
        """A model's further window pools: free rings in FIFO order, the mapping, frontiers
        and handle starts equal the model's; references rebuilt from the device tables
        equal its counts; held and free together exactly 1..N_p; frontiers monotone."""
        a, m, ps = self.alloc, self.model, self.ps
        r2t = a.req_to_token
        for p, x in enumerate(m.x, start=1):
            window, tables = a.ledger.windows[p - 1], a.state.windows[p - 1]
            free = tables.swa_free.tolist()
            head = m.free_ring_head(p)
            got_free = [free[(head + i) % x.n] for i in range(len(x.q))]
            assert got_free == list(x.q), p
            f2s = tables.full_to_swa.tolist()
            assert f2s == m.x_full_to_swa(p), p
            refs = Counter()
            for r, q in m.reqs.items():
                assert int(window.frontier[r]) == q.xf[p - 1], (p, r)
                assert q.xf[p - 1] >= self.prev_xf.get((p, r), 0), (p, r)
                pages = [int(r2t[r, k * ps]) // ps for k in range(ceil_div(q.length, ps))]
                refs.update(f2s[pg * ps] // ps for pg in pages[q.xf[p - 1] // ps:])
            for h, hd in m.handles.items():
                assert int(window.h_start[h]) == hd.xf[p - 1], (p, h)
                refs.update(f2s[pg * ps] // ps for pg in hd.pages[hd.xf[p - 1] // ps:])
            assert 0 not in refs
            assert dict(refs) == {s: c for s, c in enumerate(x.ref) if c}, p
            assert sorted(list(refs) + got_free) == list(range(1, x.n + 1)), p
        self.prev_xf = {(p, r): q.xf[p - 1] for p in range(1, len(m.x) + 1)
                        for r, q in m.reqs.items()}


def _make(name: str, config: dict):
    machine = type(f"Machine_{name}", (AllocatorMachine,), {"CONFIG": config})
    case = machine.TestCase
    case.settings = settings(max_examples=50, stateful_step_count=40, deadline=None,
                             suppress_health_check=list(HealthCheck), database=None)
    return case


for _name, _config in CONFIGS.items():
    globals()[f"TestModelVsAllocator_{_name}"] = _make(_name, _config)
