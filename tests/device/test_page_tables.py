"""The step's attention page tables (``HybridAllocator(cfg, page_tables=PageTableSpec(...))``)
against a dense recomputation, after every step.

A seeded random workload drives the allocator through ``alloc.step(Step(...))`` only: admits
(fresh, and on a prefix handle: ``admit_on``), chunked prefills (``extend``), decodes with
and without lookahead (speculative steps, committed in a later step), window evictions,
frontier advances, trims, releases, handles taken and dropped. After EVERY step the device
buffers in ``alloc.tables`` must equal, buffer for buffer, tables rebuilt *per position*
from ``alloc.snapshot()`` (``req_to_token``, ``full_to_swa``, the ledger's lengths and
frontiers): the batch is the step's decode rows then its extend rows (in the order given),
lane i's FULL pages those of positions ``[0, L)``, its SWA pages those of
``[floor_page(ws), L)`` in SWA page ids, ``ws = max(f, L - (q - 1) - W, 0)`` (q the lane's
query tokens), block-table entries outside those ranges 0, padded lanes empty, indptr
monotone; every SWA id referenced by the ledger (never a freed page, never the sink).
The host copies on ``PlannedStep.tables`` must equal the device's indptr, last-page lengths
and seq lens. The reference never uses the planner's or the kernel's page arithmetic.

Cases: both backends (the Torch twin; Triton through its interpreter at a tiny size), both
planners, page sizes 1, 3 and 16, int32 and int64 outputs, every subset of forms x layers
tried, the model window equal to and smaller than the allocator's. A ``cuda`` test replays
2,000 random steps with ``executor="graph"`` under ``set_sync_debug_mode("error")``, and
checks the paged attention (FlashInfer when it imports, the Triton kernel) against the Torch
twin on the same tables. The README snippet (``docs/page_tables.md``) runs as written.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

import graphalloc as ga
from graphalloc.kernels import write_page_tables, write_page_tables_torch
from graphalloc.kernels.abi import (
    PT_END_PAGE,
    PT_FULL_OFF,
    PT_LAST_LEN,
    PT_REQ,
    PT_SEQ_LEN,
    PT_SWA_FIRST,
    PT_SWA_OFF,
    ROW_WIDTH,
)

ROOT = Path(__file__).resolve().parents[2]


# ---- the dense reference: per position, from a snapshot ----------------------------------
def dedupe_pages(slots: np.ndarray, ps: int) -> np.ndarray:
    """Page ids of consecutive positions' slots, one per page, with the page-dense layout
    checked (offset in page == position % ps, one page per ps positions)."""
    pages = slots // ps
    keep = np.ones(len(pages), dtype=bool)
    keep[1:] = pages[1:] != pages[:-1]
    return pages[keep]


def dense_tables(snap: dict, lanes: list[tuple[int, int]], B: int, ps: int, W: int,
                 width: int) -> dict:
    """Expected tables for ``lanes`` = ``[(row, query_tokens), ...]`` (the step's batch, in
    lane order), numpy int64, from the snapshot alone."""
    r2t, f2s = snap["req_to_token"].astype(np.int64), snap["full_to_swa"].astype(np.int64)
    seq_len, frontier = snap["host_seq_len"], snap["host_frontier"]
    full_ref, swa_ref = snap["host_full_ref"], snap["host_swa_ref"]
    full_lists, swa_lists = [], []
    regimes = {"window": 0, "frontier": 0, "multi_query": 0}  # what set each lane's ws
    seq_lens = np.zeros(B, np.int64)
    last = np.zeros(B, np.int64)
    swa_last = np.zeros(B, np.int64)
    full_bt = np.zeros((B, width), np.int64)
    swa_bt = np.zeros((B, width), np.int64)
    for i in range(B):
        if i >= len(lanes):
            full_lists.append(np.zeros(0, np.int64))
            swa_lists.append(np.zeros(0, np.int64))
            continue
        r, q = lanes[i]
        L, f = int(seq_len[r]), int(frontier[r])
        slots = r2t[r, :L]
        assert (slots % ps == np.arange(L) % ps).all(), f"row {r}: FULL mapping not page-dense"
        full = dedupe_pages(slots, ps)
        assert len(full) == -(-L // ps) and (full > 0).all() and (full_ref[full] > 0).all()
        ws = max(f, L - (q - 1) - W, 0)
        regimes["frontier" if f > max(L - (q - 1) - W, 0) else "window"] += 1
        regimes["multi_query"] += q > 1 and ws < max(f, L - W, 0)  # wider than a decode's
        start = ws // ps * ps
        swa_slots = f2s[slots[start:]]
        assert (swa_slots > 0).all(), f"row {r}: an SWA position of [{start}, {L}) unmapped"
        assert (swa_slots % ps == np.arange(start, L) % ps).all(), "SWA not page-dense"
        swa = dedupe_pages(swa_slots, ps)
        assert len(swa) == -(-L // ps) - start // ps
        assert (swa_ref[swa] > 0).all(), f"row {r}: an SWA page of its range is free"
        full_lists.append(full)
        swa_lists.append(swa)
        seq_lens[i] = L
        last[i] = (L - 1) % ps + 1 if L else 0
        swa_last[i] = last[i] if len(swa) else 0
        full_bt[i, :len(full)] = full
        swa_bt[i, start // ps:start // ps + len(swa)] = swa

    def csr(lists, last_len):
        indptr = np.concatenate([[0], np.cumsum([len(x) for x in lists])]).astype(np.int64)
        return indptr, np.concatenate(lists).astype(np.int64), last_len

    return {"full": csr(full_lists, last), "swa": csr(swa_lists, swa_last),
            "full_block_table": full_bt, "swa_block_table": swa_bt, "seq_lens": seq_lens,
            "regimes": regimes}


def check_step(alloc, p, lanes: list[tuple[int, int]], before: dict | None) -> dict:
    """``alloc.tables`` and ``p.tables`` after step ``p`` against :func:`dense_tables`;
    returns the reference's ``regimes``. A step with no descriptor rows launches nothing
    (its batch is empty): the device tables must then be exactly ``before``."""
    t, spec, cfg = alloc.tables, alloc.tables.spec, alloc.config
    out = {k: v.cpu().numpy().astype(np.int64) for k, v in t.outputs().items()}
    h = p.tables
    assert h is not None and h.buffer_index == p.buffer_index and h.n_lanes == len(lanes)
    if not (p.n_release_rows or p.n_alloc_rows):
        assert not lanes
        for k, v in out.items():
            assert np.array_equal(v, before[k]), f"{k} changed by a step that launched nothing"
        return {}
    ref = dense_tables(alloc.snapshot(), lanes, spec.max_batch, cfg.page_size,
                       spec.model_window, spec.max_pages_per_req)
    for layer in ("full", "swa"):
        names = [f"{layer}_kv_indptr", f"{layer}_kv_indices", f"{layer}_kv_last_page_len"]
        if not spec.has("csr", layer):
            assert all(getattr(t, n + "_buf") is None for n in names)
            assert getattr(h, f"{layer}_kv_indptr_host") is None
            continue
        indptr, indices, last = ref[layer]
        n = int(indptr[-1])
        assert np.array_equal(out[names[0]], indptr), (layer, out[names[0]], indptr)
        assert (np.diff(out[names[0]]) >= 0).all() and out[names[0]][0] == 0
        assert np.array_equal(out[names[1]][:n], indices), layer
        assert np.array_equal(out[names[2]], last), layer
        assert getattr(h, f"n_{layer}_pages") == n
        assert np.array_equal(getattr(h, f"{layer}_kv_indptr_host").numpy(), out[names[0]])
        assert np.array_equal(getattr(h, f"{layer}_kv_last_page_len_host").numpy(),
                              out[names[2]])
        assert getattr(h, f"{layer}_kv_indptr_host").dtype == spec.out_dtype
    if "block_table" not in spec.forms:
        assert t.seq_lens_buf is None and h.seq_lens_host is None
        assert t.full_block_table_buf is None and t.swa_block_table_buf is None
        return ref["regimes"]
    assert np.array_equal(out["seq_lens"], ref["seq_lens"])
    assert np.array_equal(h.seq_lens_host.numpy(), out["seq_lens"])
    for layer in ("full", "swa"):
        name = f"{layer}_block_table"
        if layer in spec.layers:
            assert np.array_equal(out[name], ref[name]), (layer, out[name], ref[name])
        else:
            assert getattr(t, name + "_buf") is None
    return ref["regimes"]


# ---- the workload: random Steps -----------------------------------------------------------
class Workload:
    """Random steps through the public Step API; a refused step (nothing changed) is
    counted and skipped. ``kinds`` counts what ran."""

    def __init__(self, alloc, rng, *, lookahead: bool = True, keep_before: bool = True):
        self.alloc, self.rng, self.lookahead = alloc, rng, lookahead
        self.keep_before = keep_before  # copy the tables before each step (reads the device)
        self.before = None
        self.spec_k: dict[int, int] = {}  # row -> lookahead of its uncommitted step
        self.handles: list[int] = []
        self.kinds: dict[str, int] = {}
        self.refused = 0
        self.steps = 0

    def _count(self, *names) -> None:
        for n in names:
            self.kinds[n] = self.kinds.get(n, 0) + 1

    def step(self):
        """Run one random step; returns ``(planned, lanes)`` or None when refused."""
        alloc, rng, cfg = self.alloc, self.rng, self.alloc.config
        ps, ctx = cfg.page_size, cfg.max_context_len
        B = alloc.tables.spec.max_batch
        L, f = alloc.seq_lens(), alloc.frontiers()
        live = [r for r in range(cfg.max_reqs) if alloc.is_live(r)]
        free = [r for r in range(cfg.max_reqs) if not alloc.is_live(r)]
        rng.shuffle(live)
        kw: dict = {}
        names = []
        busy: set[int] = set()
        # handles: take one on a live row's whole pages, or drop one (their own steps)
        if self.handles and rng.random() < 0.08:
            h = self.handles.pop(int(rng.integers(len(self.handles))))
            alloc.drop_handle(h)
            self._count("drop_handle")
        elif (cfg.max_handles and len(self.handles) < cfg.max_handles and live
              and rng.random() < 0.1):
            src = live[0]
            if L[src] >= ps and src not in self.spec_k:
                try:
                    self.handles.append(alloc.take_handle(src, int(
                        rng.integers(1, L[src] // ps + 1)) * ps))
                    self._count("take_handle")
                except ga.ContractError:
                    self.refused += 1
        # commits of last step's speculative rows (all of them: a plain decode, an extend,
        # a trim of a row with an uncommitted step would be refused)
        commit = [(r, int(rng.integers(1, 2 + k))) for r, k in self.spec_k.items()]
        if commit:
            kw["commit"] = ([r for r, _ in commit], [n for _, n in commit])
            names.append("commit")
        roll = rng.random()
        if roll < 0.1 and len(live) > 1:
            rel = live[:int(rng.integers(1, len(live)))]
            kw["release"] = rel
            busy |= set(rel)
            names.append("release")
        elif roll < 0.18 and live:
            r = live[-1]
            if r not in self.spec_k and L[r] > 0:
                low = int(f[r] + cfg.sliding_window) if f[r] > 0 else 0
                if low < L[r]:
                    kw["trim"] = ([r], [int(rng.integers(low, L[r]))])
                    busy.add(r)
                    names.append("trim")
        elif roll < 0.26 and live:
            r = live[-1]
            target = min(int(f[r]) + ps * int(rng.integers(1, 3)), int(L[r]) // ps * ps)
            if target > f[r] and r not in busy:
                kw["advance"] = ([r], [target])
                names.append("advance")
        if rng.random() < 0.6:
            kw["evict_all"] = True
            names.append("evict")
        if free and rng.random() < 0.35:
            r = free[0]
            if self.handles and rng.random() < 0.5:
                kw["admit_on"] = ([r], [self.handles[int(rng.integers(len(self.handles)))]],
                                  None)
                names.append("admit_on")
            else:
                kw["admit"] = [r]
                names.append("admit")
        # the batch: decodes (some speculative) then prefill chunks, at most B lanes
        decode, look, ext, ext_n = [], [], [], []
        room = ctx - L
        for r in live:
            if r in busy or len(decode) + len(ext) >= B:
                continue
            if rng.random() < 0.5 and room[r] >= 3 + 2 and L[r] > 0:
                decode.append(r)
                spec = self.lookahead and rng.random() < 0.4
                look.append(int(rng.integers(0, 3)) if spec else -1)
            elif rng.random() < 0.6 and r not in self.spec_k and room[r] > 0:
                ext.append(r)
                ext_n.append(int(rng.integers(0, min(room[r], 3 * ps + 2) + 1)))
        if decode:
            kw["decode"] = decode
            if any(k >= 0 for k in look):
                kw["lookahead"] = look
                names.append("lookahead")
            names.append("decode")
        if ext:
            kw["extend"] = (ext, ext_n)
            names.append("extend")
        lanes = ([(r, 1 + max(k, 0)) for r, k in zip(decode, look, strict=True)]
                 + [(r, n) for r, n in zip(ext, ext_n, strict=True) if n > 0])
        if self.keep_before:  # (the handle steps above may have run)
            self.before = outputs_np(alloc)
        try:
            p = alloc.plan(ga.Step(**kw))
        except ga.ContractError:
            self.refused += 1
            return None
        alloc.run(p)
        self.steps += 1
        self._count(*names)
        self.spec_k = {r: k for r, k in zip(decode, look, strict=True) if k >= 0}
        for r in kw.get("release", ()):
            self.spec_k.pop(r, None)
        return p, lanes


def outputs_np(alloc) -> dict:
    return {k: v.cpu().numpy().astype(np.int64) for k, v in alloc.tables.outputs().items()}


def make_alloc(ps, *, backend="torch", planner="auto", max_reqs=5, lanes=None, forms=None,
               layers=None, model_window=0, out_dtype=torch.int32, index_dtype=torch.int64,
               device="cpu", executor="eager"):
    window = {1: 5, 3: 7, 16: 20}[ps]
    context = {1: 24, 3: 33, 16: 96}[ps]
    cfg = ga.AllocatorConfig(  # pools tight enough that some steps are refused
        page_size=ps, num_full_pages=max_reqs * context // ps + 4,
        num_swa_pages=max_reqs * (-(-window // ps) + 4), max_reqs=max_reqs,
        max_context_len=context, sliding_window=window, max_handles=2, device=device,
        backend=backend, index_dtype=index_dtype)
    spec = ga.PageTableSpec(max_batch=lanes or max_reqs, forms=forms or ("csr", "block_table"),
                            layers=layers or ("full", "swa"), model_window=model_window,
                            out_dtype=out_dtype)
    return ga.HybridAllocator(cfg, page_tables=spec, planner=planner, executor=executor)


CASES = {  # name: (page size, make_alloc options, steps)
    "ps1-torch": (1, dict(), 160),
    "ps3-torch-numpy-int64-smaller-window": (3, dict(planner="numpy", out_dtype=torch.int64,
                                                     model_window=5, lanes=7), 160),
    "ps16-torch-csr-swa": (16, dict(forms=("csr",), layers=("swa",), lanes=6), 120),
    "ps3-torch-bt-full": (3, dict(forms=("block_table",), layers=("full",),
                                  index_dtype=torch.int32), 80),
    "ps16-torch-csr-bt-swa": (16, dict(layers=("swa",), model_window=11), 120),
    "ps3-triton": (3, dict(backend="triton", max_reqs=3, lanes=4), 40),
    "ps16-triton": (16, dict(backend="triton", max_reqs=3), 40),
}


@pytest.mark.parametrize("name", list(CASES))
def test_tables_equal_a_dense_recomputation_after_every_step(name):
    ps, options, n_steps = CASES[name]
    alloc = make_alloc(ps, **options)
    for t in alloc.tables.outputs().values():
        t.fill_(-7)  # stale contents: every output a step owns must be rewritten
    work = Workload(alloc, np.random.default_rng(sum(map(ord, name))))
    checked = 0
    regimes: dict[str, int] = {}
    for _ in range(4 * n_steps):
        if work.steps >= n_steps:
            break
        out = work.step()
        if out is None:
            continue
        p, lanes = out
        for key, n in check_step(alloc, p, lanes, work.before).items():
            regimes[key] = regimes.get(key, 0) + n
        checked += 1
    alloc.check()
    alloc.check_integrity()
    assert checked == n_steps, (checked, work.refused)
    k = work.kinds
    want = ["decode", "extend", "evict", "admit", "release", "commit"]
    if n_steps >= 80:
        want += ["lookahead", "trim", "admit_on", "take_handle"]
    assert all(k.get(x, 0) > 0 for x in want), k
    # every way a lane's SWA range can start: the window, a multi-token query's first
    # window, the frontier (advanced, or a shared prefix's: the long runs)
    assert regimes["window"] and regimes["multi_query"], regimes
    assert regimes["frontier"] or n_steps < 80, regimes


def test_the_reference_catches_a_wrong_window():
    """The check can fail: the same allocator's tables against a reference one key wider
    (W + 1) differ on some step's SWA range."""
    alloc = make_alloc(1, max_reqs=3)
    work = Workload(alloc, np.random.default_rng(3), lookahead=False)
    spec = alloc.tables.spec
    caught = 0
    for _ in range(60):
        out = work.step()
        if out is None or not out[1]:
            continue
        p, lanes = out
        ref = dense_tables(alloc.snapshot(), lanes, spec.max_batch, 1, spec.model_window + 1,
                           spec.max_pages_per_req)
        caught += not np.array_equal(alloc.tables.swa_kv_indptr_buf.numpy(), ref["swa"][0])
    assert caught > 5


def test_batch_larger_than_max_batch_is_refused_with_nothing_changed():
    alloc = make_alloc(3, max_reqs=4, lanes=2)
    rows = [alloc.admit() for _ in range(3)]
    alloc.step(extend=(rows[:2], [5, 7]))
    before, snap = outputs_np(alloc), alloc.snapshot()
    with pytest.raises(ga.BatchTooLargeError, match="max_batch"):
        alloc.step(decode=rows[:2], extend=([rows[2]], [4]))  # three lanes, two fit
    after = alloc.snapshot()
    assert all(np.array_equal(snap[k], after[k]) for k in snap)
    assert all(np.array_equal(v, before[k]) for k, v in outputs_np(alloc).items())
    alloc.step(decode=rows[:2], extend=([rows[2]], [0]))  # an empty chunk is no lane


def test_kv_indices_capacity_is_refused():
    cfg = ga.AllocatorConfig(page_size=2, num_full_pages=40, num_swa_pages=40, max_reqs=3,
                             max_context_len=20, sliding_window=3, device="cpu",
                             backend="torch")
    alloc = ga.HybridAllocator(cfg, page_tables=ga.PageTableSpec(max_batch=2,
                                                                 max_full_indices=5))
    r = [alloc.admit(), alloc.admit()]
    alloc.step(extend=([r[0]], [9]))  # 5 pages: fits
    with pytest.raises(ga.BatchTooLargeError, match="max_full_indices"):
        alloc.step(decode=[r[0]], extend=([r[1]], [1]))  # 5 + 1 + ... > 5


def test_shared_prefix_pages_appear_in_both_lanes():
    alloc = make_alloc(3, max_reqs=4)
    a = alloc.admit()
    alloc.step(extend=([a], [14]))
    h = alloc.take_handle(a, 9)
    b = alloc.admit(handle=h)  # shares a's first 9 tokens: 3 FULL and 3 SWA pages
    p = alloc.plan(ga.Step(decode=[a], extend=([b], [4])))  # lanes: a (L 15), b (L 13)
    alloc.run(p)
    bt = alloc.tables.full_block_table_buf
    assert torch.equal(bt[0, :3], bt[1, :3])
    ind, ptr = alloc.tables.full_kv_indices_buf, alloc.tables.full_kv_indptr_buf
    assert torch.equal(ind[ptr[0]:ptr[0] + 3], ind[ptr[1]:ptr[1] + 3])
    assert p.tables.seq_lens_host.tolist()[:2] == [15, 13]
    check_step(alloc, p, [(a, 1), (b, 4)], None)
    # b's prefill chunk of 4 queries: its SWA range starts at its FIRST query's window
    W = alloc.tables.spec.model_window  # 8: the allocator's 7 + 1
    assert p.tables.swa_kv_indptr_host[2] - p.tables.swa_kv_indptr_host[1] == (
        -(-13 // 3) - max(13 - 3 - W, 0) // 3)


def test_launchers_share_one_signature_on_hand_written_rows():
    """The kernel and its twin on hand-made lane rows: a lane with an empty SWA range
    (first == end), a lane past the capacity of kv_indices (not written), a padded lane."""
    ps = 4
    r2t = torch.zeros(3, 16, dtype=torch.int32)
    r2t[0, :12] = torch.arange(8, 20, dtype=torch.int32)  # pages 2, 3, 4
    r2t[1, :8] = torch.arange(4, 12, dtype=torch.int32)  # pages 1, 2
    f2s = torch.zeros(8 * ps, dtype=torch.int32)
    f2s[8:20] = torch.arange(4, 16, dtype=torch.int32)  # SWA pages 1, 2, 3
    table = torch.zeros(3, ROW_WIDTH, dtype=torch.int64)
    for lane, (r, L, end, first, foff, soff, last) in enumerate(
            ((0, 12, 3, 1, 0, 0, 4), (1, 8, 2, 2, 3, 2, 4))):
        for col, v in ((PT_REQ, r), (PT_SEQ_LEN, L), (PT_END_PAGE, end), (PT_SWA_FIRST, first),
                       (PT_FULL_OFF, foff), (PT_SWA_OFF, soff), (PT_LAST_LEN, last)):
            table[lane, col] = v
    table[2, PT_FULL_OFF], table[2, PT_SWA_OFF] = 5, 2  # padding: an empty range at the end
    res = []
    for fn in (write_page_tables, write_page_tables_torch):
        bufs = dict(full_csr=(torch.zeros(4, dtype=torch.int32), torch.full((4,), -7),
                              torch.zeros(3, dtype=torch.int32)),
                    swa_csr=(torch.zeros(4, dtype=torch.int32), torch.full((6,), -7),
                             torch.zeros(3, dtype=torch.int32)),
                    full_block_table=torch.full((3, 4), -7, dtype=torch.int32),
                    swa_block_table=torch.full((3, 4), -7, dtype=torch.int32),
                    seq_lens=torch.full((3,), -7, dtype=torch.int32))
        fn(table, r2t, f2s, page_size=ps, **bufs)
        res.append(bufs)
    a, b = res
    for k in a:
        for x, y in zip(*(v if isinstance(v, tuple) else (v,) for v in (a[k], b[k])),
                        strict=True):
            assert torch.equal(x, y), k
    assert a["full_csr"][0].tolist() == [0, 3, 5, 5]
    assert a["full_csr"][1].tolist() == [2, 3, 4, 1]  # lane 1's second page: past the end
    assert a["swa_csr"][0].tolist() == [0, 2, 2, 2]  # lane 1: first == end, nothing to read
    assert a["swa_csr"][1].tolist() == [2, 3, -7, -7, -7, -7]
    assert a["swa_csr"][2].tolist() == [4, 0, 0]
    assert a["swa_block_table"].tolist() == [[0, 2, 3, 0], [0, 0, 0, 0], [0, 0, 0, 0]]
    assert a["full_block_table"].tolist() == [[2, 3, 4, 0], [1, 2, 0, 0], [0, 0, 0, 0]]
    assert a["seq_lens"].tolist() == [12, 8, 0]


def test_readme_snippet_runs_as_written_on_cpu():
    """``docs/page_tables.md``'s code block, its ``# gpu-only`` lines left out."""
    text = (ROOT / "docs" / "page_tables.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "docs/page_tables.md has no python block"
    code = "\n".join(line for line in blocks[0].splitlines()
                     if not line.rstrip().endswith("# gpu-only"))
    assert "# gpu-only" in blocks[0] and "page_tables=" in code
    scope: dict = {}
    exec(compile(code, "docs/page_tables.md", "exec"), scope)  # noqa: S102
    assert isinstance(scope["p"].tables, ga.PlannedTables)


# ---- the GPU: 2,000 graph-replayed steps under sync debug ---------------------------------
def replay_and_check(device: str, n_steps: int, *, flashinfer=None) -> dict:
    """``n_steps`` random steps through ``executor="graph"`` (one replay per step on CUDA;
    eager on a CPU), under ``set_sync_debug_mode("error")`` on CUDA: per step the device
    tables, ``req_to_token`` and ``full_to_swa`` are copied (device to device) into
    preallocated history buffers, and the paged attention over the step's tables --
    FlashInfer's CUDA-graph decode wrappers built once per descriptor buffer on
    ``alloc.tables`` (``flashinfer``: the module, or None) and, on CUDA, the Triton kernel
    -- is compared with the Torch twin on the device. After the loop every step is checked
    against the dense reference. Returns the largest attention difference and counts."""
    from graphalloc.kernels import paged_decode_attention, paged_decode_attention_torch

    cuda, ps = device == "cuda", 16
    alloc = make_alloc(ps, max_reqs=5, lanes=6, device=device,
                       backend="triton" if cuda else "torch", executor="graph",
                       index_dtype=torch.int32)
    spec, t, cfg = alloc.tables.spec, alloc.tables, alloc.config
    W = spec.model_window
    outs = t.outputs()
    sources = {**outs, "req_to_token": alloc.req_to_token, "full_to_swa": alloc.full_to_swa}
    hist = {k: torch.zeros(n_steps, *v.shape, dtype=v.dtype, device=device)
            for k, v in sources.items()}
    H, Hkv, D = 4, 2, 64
    dt = torch.float16 if cuda else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    caches = {layer: tuple(torch.randn(n + 1, ps, Hkv, D, generator=gen, device=device,
                                       dtype=dt) for _ in range(2))
              for layer, n in (("full", cfg.num_full_pages), ("swa", cfg.num_swa_pages))}
    q = torch.randn(spec.max_batch, H, D, generator=gen, device=device, dtype=dt)
    wrappers = None
    if flashinfer is not None:
        ws = torch.zeros(64 << 20, dtype=torch.uint8, device=device)
        wrappers = [{layer: flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            ws, "NHD", use_cuda_graph=True,
            paged_kv_indptr_buffer=getattr(t, f"{layer}_kv_indptr_buf"),
            paged_kv_indices_buffer=getattr(t, f"{layer}_kv_indices_buf"),
            paged_kv_last_page_len_buffer=getattr(t, f"{layer}_kv_last_page_len_buf"))
            for layer in ("full", "swa")} for _ in range(len(alloc.ring))]
    windows = {"full": (0, -1), "swa": (W, W - 1)}  # (twin / Triton keys, window_left)
    worst = torch.zeros(n_steps, 2, dtype=torch.float32, device=device)

    def attend(k: int, p, n: int) -> None:
        """Step k's attention over lanes [0, n) (padded lanes: empty, not compared)."""
        for j, layer in enumerate(("full", "swa")):
            csr = [getattr(t, f"{layer}_kv_{m}_buf") for m in ("indptr", "indices",
                                                               "last_page_len")]
            keys, left = windows[layer]
            twin = paged_decode_attention_torch(q, *caches[layer], *csr, sliding_window=keys)
            err = torch.zeros((), device=device)
            if cuda:
                tri = paged_decode_attention(q, *caches[layer], *csr, sliding_window=keys)
                err = (tri[:n].float() - twin[:n].float()).abs().amax()
            if wrappers is not None:
                w = wrappers[p.buffer_index][layer]
                w.plan(getattr(p.tables, f"{layer}_kv_indptr_host"),
                       csr[1][:getattr(p.tables, f"n_{layer}_pages")],
                       getattr(p.tables, f"{layer}_kv_last_page_len_host"), H, Hkv, D, ps,
                       window_left=left, q_data_type=dt, kv_data_type=dt)
                fi = w.run(q, caches[layer])
                err = torch.maximum(err, (fi[:n].float() - twin[:n].float()).abs().amax())
            worst[k, j] = err

    work = Workload(alloc, np.random.default_rng(11), keep_before=False)  # no device reads
    for _ in range(2):  # warm-up outside sync debug (Triton compiles, FlashInfer's JIT)
        out = work.step()
        if out is not None and out[1]:
            attend(0, out[0], len(out[1]))
    records = []
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        while len(records) < n_steps:
            out = work.step()
            if out is None:
                continue
            p, lanes = out
            k = len(records)
            for name, buf in hist.items():
                buf[k].copy_(sources[name])
            if lanes:
                attend(k, p, len(lanes))
            records.append((p.n_release_rows + p.n_alloc_rows, lanes, alloc.seq_lens(),
                            alloc.frontiers(), {n: getattr(p.tables, n + "_host").clone()
                                                for n in ("full_kv_indptr", "seq_lens")}))
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode(0)
    hist_np = {k: v.cpu().numpy().astype(np.int64) for k, v in hist.items()}
    snap = alloc.snapshot()
    checked = 0
    for k, (n_rows, lanes, seq_len, frontier, host) in enumerate(records):
        if not n_rows:
            continue
        s_k = {"req_to_token": hist_np["req_to_token"][k],
               "full_to_swa": hist_np["full_to_swa"][k], "host_seq_len": seq_len,
               "host_frontier": frontier,  # (only the final reference counts are kept)
               "host_full_ref": np.ones_like(snap["host_full_ref"]),
               "host_swa_ref": np.ones_like(snap["host_swa_ref"])}
        ref = dense_tables(s_k, lanes, spec.max_batch, ps, W, spec.max_pages_per_req)
        for layer in ("full", "swa"):
            indptr, indices, last = ref[layer]
            assert np.array_equal(hist_np[f"{layer}_kv_indptr"][k], indptr), (k, layer)
            assert np.array_equal(hist_np[f"{layer}_kv_indices"][k][:indptr[-1]], indices)
            assert np.array_equal(hist_np[f"{layer}_kv_last_page_len"][k], last), (k, layer)
            assert np.array_equal(hist_np[f"{layer}_block_table"][k],
                                  ref[f"{layer}_block_table"]), (k, layer)
        assert np.array_equal(hist_np["seq_lens"][k], ref["seq_lens"])
        assert np.array_equal(host["full_kv_indptr"].numpy(), ref["full"][0])
        assert np.array_equal(host["seq_lens"].numpy(), ref["seq_lens"])
        checked += 1
    alloc.check()
    alloc.check_integrity()
    return {"attention_max_diff": float(worst.max()), "checked": checked,
            "replays": getattr(alloc.executor, "replays", 0), "kinds": work.kinds}


def test_replay_check_runs_on_cpu():
    """The GPU test's path at a tiny size on the CPU (the graph executor runs eagerly, the
    twin against itself): the history copies and the per-step reference line up."""
    r = replay_and_check("cpu", 40)
    assert r["checked"] > 30 and r["attention_max_diff"] == 0.0
    assert r["kinds"].get("decode", 0) > 5 and r["kinds"].get("extend", 0) > 5


@pytest.mark.cuda
def test_graph_replayed_steps_on_cuda_never_sync_and_equal_the_reference():
    """2,000 random steps, each ONE graph replay, under sync debug "error"; tables equal to
    the dense recomputation; FlashInfer (when it imports) and the Triton kernel agree with
    the Torch twin on them (fp16)."""
    try:
        import flashinfer
    except ImportError:
        flashinfer = None
    r = replay_and_check("cuda", 2000, flashinfer=flashinfer)
    assert r["checked"] > 1500 and r["replays"] > 1000, r
    assert r["attention_max_diff"] <= 2e-2, r
