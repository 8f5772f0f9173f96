"""Attention page tables (graphalloc.attention, kernels.page_table) against a numpy
reference.

A random workload drives a HybridAllocator through its public API (admit, with and without
a shared prefix, alloc_extend, alloc_decode, evict_window, advance_frontier, release).
After every operation the live rows, in a random lane order with padding lanes (and
sometimes a row on two lanes), are planned once per PageTables and launched with the
Triton kernel and with the Torch twin. Both must equal, buffer for buffer, a reference
built per *position* from ``alloc.snapshot()`` (req_to_token, full_to_swa, the ledger),
independently of the page arithmetic of the planner and the kernel.
"""

import numpy as np
import pytest
import torch

import graphalloc as ga
from graphalloc.attention.page_tables import PageTables, PageTableSpec, plan_page_table_rows
from graphalloc.kernels import write_page_tables, write_page_tables_torch
from graphalloc.kernels.abi import PT_END_PAGE, ROW_WIDTH

MAX_REQS = 5
B = MAX_REQS + 2  # lanes: every live row, plus room for padding and a duplicated row


def make_alloc(ps, dtype, backend, ring=False):
    window = {1: 5, 3: 7, 16: 20}[ps]
    context = {1: 24, 3: 30, 16: 128}[ps]
    window_pages = -(-window // ps)
    ring_pages = window_pages + 2 if ring else 0
    cfg = ga.AllocatorConfig(  # SWA pool tight enough that some allocations are refused
        page_size=ps, num_full_pages=MAX_REQS * context // ps,
        num_swa_pages=MAX_REQS * (window_pages + 4),
        max_reqs=MAX_REQS, max_context_len=context, sliding_window=window, index_dtype=dtype,
        device="cpu", backend=backend, swa_ring_pages=ring_pages,
        max_handles=0 if ring else 2)
    return ga.HybridAllocator(cfg)


# ---- the reference: per position, from a snapshot ---------------------------------------

def dedupe_pages(slots, ps):
    """Page ids of consecutive positions' slots, one per page (positions fill pages in order)."""
    pages = slots // ps
    keep = np.ones(len(pages), dtype=bool)
    keep[1:] = pages[1:] != pages[:-1]
    return pages[keep]


def reference(snap, lane_rows, ps, window, width):
    """Expected outputs (numpy) for lanes ``lane_rows`` (-1 = padding), and checks of the
    allocator's own invariants on the way (every SWA position in the window is mapped)."""
    r2t, f2s = snap["req_to_token"].astype(np.int64), snap["full_to_swa"].astype(np.int64)
    seq_len, frontier = snap["host_seq_len"], snap["host_frontier"]
    full_lists, swa_lists, lens, lasts, swa_lasts = [], [], [], [], []
    full_bt = np.zeros((len(lane_rows), width), dtype=np.int64)
    swa_bt = np.zeros((len(lane_rows), width), dtype=np.int64)
    for i, r in enumerate(lane_rows):
        if r < 0:
            full_lists.append(np.zeros(0, np.int64))
            swa_lists.append(np.zeros(0, np.int64))
            lens.append(0)
            lasts.append(0)
            swa_lasts.append(0)
            continue
        L, f = int(seq_len[r]), int(frontier[r])
        full_slots = r2t[r, :L]
        full_pages = dedupe_pages(full_slots, ps)
        assert len(full_pages) == -(-L // ps)
        ws = max(f, L - window, 0)
        start = ws // ps * ps  # the SWA CSR starts at the window start's page
        swa_slots = f2s[full_slots[start:]]
        assert (swa_slots > 0).all(), f"request {r}: an SWA position in [{start}, {L}) unmapped"
        assert (swa_slots % ps == np.arange(start, L) % ps).all(), "mapping not page-dense"
        swa_pages = dedupe_pages(swa_slots, ps)
        assert len(swa_pages) == -(-L // ps) - start // ps
        full_lists.append(full_pages)
        swa_lists.append(swa_pages)
        lens.append(L)
        last = (L - 1) % ps + 1 if L else 0
        lasts.append(last)
        swa_lasts.append(last if len(swa_pages) else 0)
        full_bt[i, :len(full_pages)] = full_pages
        swa_bt[i, start // ps:start // ps + len(swa_pages)] = swa_pages
    def csr(lists, last):
        indptr = np.concatenate([[0], np.cumsum([len(x) for x in lists])])
        return indptr, np.concatenate(lists), np.array(last)
    return dict(full=csr(full_lists, lasts), swa=csr(swa_lists, swa_lasts), full_bt=full_bt,
                swa_bt=swa_bt, seq_lens=np.array(lens), swa_lists=swa_lists)


def free_swa_pages(snap):
    if "swa_free" not in snap or "host_swa_ring" not in snap:
        return set()
    head, n_free = snap["host_swa_ring"]
    ring = snap["swa_free"]
    return set(ring[(head + np.arange(n_free)) % len(ring)].tolist())


def check_tables(pt, planned, snap, width):
    """One PageTables' device buffers and host copies against the reference."""
    spec = pt.spec
    ref = reference(snap, planned.lane_rows, spec.page_size, spec.sliding_window, width)
    out = {k: v.cpu().numpy().astype(np.int64) for k, v in pt.outputs().items()}
    evicted = free_swa_pages(snap)
    for layer in ("full", "swa"):
        if not spec.has("csr", layer):
            assert getattr(pt, f"{layer}_kv_indptr_buf") is None
            continue
        indptr, indices, last = ref[layer]
        n = indptr[-1]
        assert np.array_equal(out[f"{layer}_kv_indptr"], indptr), layer
        assert np.array_equal(out[f"{layer}_kv_indices"][:n], indices), layer
        assert np.array_equal(out[f"{layer}_kv_last_page_len"], last), layer
        assert np.array_equal(getattr(planned, f"{layer}_kv_indptr_host").numpy(), indptr)
        assert np.array_equal(getattr(planned, f"{layer}_kv_last_page_len_host").numpy(), last)
        kv_len = np.clip(np.diff(indptr) - 1, 0, None) * spec.page_size + last
        if layer == "swa":  # never the sink, never a freed page; lengths end at L
            assert (indices[:n] > 0).all(), "an SWA entry in a request's range is the sink"
            assert not evicted & set(indices[:n].tolist()), "an SWA entry is a freed page"
            ws = planned.window_start
            assert (kv_len >= np.where(planned.lane_rows >= 0, ref["seq_lens"] - ws, 0)).all()
            assert (kv_len - (ref["seq_lens"] - ws) < spec.page_size).all()
        else:
            assert np.array_equal(kv_len, ref["seq_lens"])
    if "block_table" in spec.forms:
        assert np.array_equal(out["seq_lens"], ref["seq_lens"])
        assert np.array_equal(planned.seq_lens_host.numpy(), ref["seq_lens"])
        for layer in spec.layers:
            assert np.array_equal(out[f"{layer}_block_table"], ref[f"{layer}_bt"]), layer
        if "swa" in spec.layers:  # outside [window page, end): 0, never a stale id
            first = planned.plan.swa_first
            end = planned.plan.end_page
            c = np.arange(width)[None, :]
            outside = (c < first[:, None]) | (c >= end[:, None])
            assert (out["swa_block_table"][outside] == 0).all()
            assert (out["swa_block_table"][~outside] > 0).all()


# ---- the workload ---------------------------------------------------------------------

def random_op(alloc, rng, sources, share=False):
    """One public-API operation; contract refusals (a full pool, a ring overflow, ...) are
    skipped. ``sources``: sharer row -> the row whose prefix it shares (kept alive).
    ``share``: admit a request sharing a live row's prefix, if one has a whole page."""
    cfg = alloc.config
    ps = cfg.page_size
    snap = alloc.snapshot()
    live = np.flatnonzero(snap["host_live"])
    L, f = snap["host_seq_len"], snap["host_frontier"]
    roll = 0.0 if share else rng.random()
    try:
        if roll < 0.2 or len(live) == 0:
            n_shared = 0
            owners = [r for r in live if L[r] >= ps and not cfg.ring_mode]
            if len(live) >= cfg.max_reqs:
                return "full"
            if owners and (share or rng.random() < 0.3):
                src = int(rng.choice(owners))
                n_shared = int(rng.integers(1, L[src] // ps + 1)) * ps
                handle = alloc.take_handle(src, n_shared)
                r = alloc.admit(handle=handle)  # shares src's first pages (references)
                alloc.drop_handle(handle)  # the sharer keeps its own references
                sources[r] = src
            else:
                r = alloc.admit()
            room = cfg.max_context_len - n_shared
            alloc.alloc_extend([r], [int(rng.integers(0, min(room, 4 * ps) + 1))])
            return "admit" if not n_shared else "admit+prefix"
        if roll < 0.35:
            rows = rng.permutation(live)[:int(rng.integers(1, len(live) + 1))]
            room = cfg.max_context_len - L[rows]
            lens = np.minimum(rng.integers(0, 2 * ps + 2, size=len(rows)), room)
            alloc.alloc_extend(rows, lens)
            return "extend"
        if roll < 0.55:
            rows = live[L[live] < cfg.max_context_len]
            if len(rows):
                alloc.alloc_decode(rows)
            return "decode"
        if roll < 0.65:
            alloc.evict_window()
            return "evict"
        if roll < 0.75:
            r = int(rng.choice(live))
            target = min(int(f[r]) + ps * int(rng.integers(0, 3)), int(L[r]) // ps * ps)
            alloc.advance_frontier([r], [target])
            return "advance"
        if roll < 0.85:
            held = set(sources.values())
            free_ok = [r for r in live if r not in held]
            if not free_ok:
                return "none"
            rel = rng.permutation(free_ok)[:int(rng.integers(1, len(free_ok) + 1))]
            alloc.release(rel)
            for r in rel:
                sources.pop(int(r), None)
            return "release"
        alloc.evict_window()  # a scheduler step: slide every window, then decode
        rows = live[L[live] < cfg.max_context_len]
        if len(rows):
            alloc.alloc_decode(rows)
        return "evict+decode"
    except ga.ContractError:
        return "refused"


def random_lanes(rng, live):
    """Live rows in a random order, padding (-1) mixed in, sometimes a row on two lanes."""
    lanes = list(rng.permutation(live))
    if len(lanes) and len(lanes) < B and rng.random() < 0.3:
        lanes.append(int(rng.choice(live)))  # the same row on two lanes
    while len(lanes) < B and rng.random() < 0.5:
        lanes.insert(int(rng.integers(0, len(lanes) + 1)), -1)
    return np.array(lanes, dtype=np.int64)


CASES = [  # (page size, index dtype, allocator backend, ring mode)
    (1, torch.int32, "triton", False),
    (1, torch.int64, "torch", False),
    (3, torch.int64, "triton", False),
    (3, torch.int32, "torch", False),
    (16, torch.int32, "triton", False),
    (16, torch.int64, "torch", False),
]


@pytest.mark.parametrize("ps,dtype,backend,ring", CASES)
def test_page_tables_follow_the_allocator(ps, dtype, backend, ring):
    rng = np.random.default_rng(1000 * ps + (dtype == torch.int32) + 7 * ring)
    alloc = make_alloc(ps, dtype, backend, ring)
    width = alloc.config.pages_per_request
    both = {be: PageTables.for_allocator(alloc, B, backend=be) for be in ("triton", "torch")}
    # Reduced variants (one form, one layer kind): the CSR-only SWA path gathers only the
    # window's pages; the block-table-only FULL path writes no CSR.
    variants = [PageTables.for_allocator(alloc, B, forms=("csr",), layers=("swa",),
                                         backend="triton"),
                PageTables.for_allocator(alloc, B, forms=("block_table",), layers=("full",),
                                         backend="torch")]
    sources: dict = {}
    seen = {"shared": 0, "clipped": 0, "padded": 0}
    for step in range(20):
        random_op(alloc, rng, sources, share=step % 8 == 4)
        snap = alloc.snapshot()
        lanes = random_lanes(rng, np.flatnonzero(snap["host_live"]))
        planned = {}
        for be, pt in both.items():
            planned[be] = pt.plan(lanes, snap["host_seq_len"], snap["host_frontier"])
            pt.run(planned[be])
            check_tables(pt, planned[be], snap, width)
        for name, buf in both["triton"].outputs().items():  # kernel == twin, every entry
            assert torch.equal(buf, both["torch"].outputs()[name]), name
        pt = variants[step % 2]
        p = pt.plan(lanes, snap["host_seq_len"], snap["host_frontier"])
        pt.run(p)
        check_tables(pt, p, snap, width)
        p = planned["triton"]
        seen["clipped"] += p.n_swa_clipped
        seen["padded"] += int((p.lane_rows < 0).sum())
        for sharer, src in sources.items():
            shared = min(snap["host_seq_len"][sharer], snap["host_seq_len"][src]) // ps
            seen["shared"] += int(shared > 0)
    assert seen["padded"] > 0
    if not ring:
        assert seen["shared"] > 0, "the workload never shared a prefix"


def test_shared_prefix_pages_appear_in_both_rows():
    alloc = make_alloc(3, torch.int64, "torch")
    a = alloc.admit()
    alloc.alloc_extend([a], [14])
    b = alloc.admit(handle=alloc.take_handle(a, 9))
    alloc.alloc_extend([b], [4])
    pt = PageTables.for_allocator(alloc, 4, backend="triton")
    snap = alloc.snapshot()
    p = pt.plan([b, -1, a], snap["host_seq_len"], snap["host_frontier"])
    pt.run(p)
    bt = pt.full_block_table_buf
    assert torch.equal(bt[0, :3], bt[2, :3])  # the three shared FULL pages
    indptr, indices = pt.full_kv_indptr_buf, pt.full_kv_indices_buf
    assert torch.equal(indices[indptr[0]:indptr[0] + 3], indices[indptr[2]:indptr[2] + 3])
    # b: L = 13, it shares a's SWA pages too (a's frontier 0 when the handle was taken), so
    # its window [L - W, L) = [6, 13) is whole
    assert p.swa_clipped.tolist() == [False] * 4 and p.window_start[0] == 6
    check_tables(pt, p, snap, alloc.config.pages_per_request)


def test_empty_batch_and_padding_lanes():
    alloc = make_alloc(3, torch.int32, "torch")
    pt = PageTables.for_allocator(alloc, 4, backend="triton")
    snap = alloc.snapshot()
    for b in pt.outputs().values():
        b.fill_(-1)  # stale contents: every fixed-shape output must be rewritten
    p = pt.plan([], snap["host_seq_len"], snap["host_frontier"])
    pt.run(p)
    out = pt.outputs()
    for name in ("full_kv_indptr", "swa_kv_indptr", "full_kv_last_page_len",
                 "swa_kv_last_page_len", "seq_lens", "full_block_table", "swa_block_table"):
        assert (out[name] == 0).all(), name
    assert (out["full_kv_indices"] == -1).all()  # past indptr[B]: left alone


def test_plan_refusals_write_nothing():
    alloc = make_alloc(3, torch.int64, "torch")
    r = alloc.admit()
    alloc.alloc_extend([r], [10])
    pt = PageTables.for_allocator(alloc, 2, backend="torch", max_full_indices=3)
    snap = alloc.snapshot()
    L, f = snap["host_seq_len"], snap["host_frontier"]
    before = [t.clone() for t in pt.table_bufs]
    bad_f = f.copy()
    bad_f[r] = 1
    bad_l = L.copy()
    bad_l[r] = alloc.config.max_context_len + 1
    with pytest.raises(ga.BatchTooLargeError):
        pt.plan([r, r, r], L, f)  # three lanes, two fit
    with pytest.raises(ga.BatchTooLargeError):
        pt.plan([r], L, f)  # 4 FULL pages, 3 kv_indices entries
    pt2 = PageTables.for_allocator(alloc, 2, backend="torch")
    with pytest.raises(ga.AlignmentError):
        pt2.plan([r], L, bad_f)
    with pytest.raises(ga.PositionError):
        pt2.plan([r], bad_l, f)
    with pytest.raises(ga.UnknownRequestError):
        pt2.plan([MAX_REQS], L, f)
    assert all(torch.equal(a, b) for a, b in zip(before, pt.table_bufs, strict=True))
    p = pt2.plan([-1, -1], L, bad_f)  # padded lanes read no frontier: nothing to refuse
    with pytest.raises(ga.PendingStepError):
        pt2.plan([r], L, f)
    pt2.run(p)
    pt2.run(pt2.plan([r], L, f))


def test_launchers_share_one_signature_on_hand_written_rows():
    """The kernel and its twin on hand-made rows: a lane with an empty SWA range (frontier
    at L), a lane past the capacity of kv_indices (not written), and a padded lane."""
    ps = 4
    r2t = torch.zeros(3, 16, dtype=torch.int32)
    r2t[0, :12] = torch.arange(8, 20, dtype=torch.int32)  # pages 2, 3, 4
    f2s = torch.zeros(8 * ps, dtype=torch.int32)
    f2s[8:20] = torch.arange(4, 16, dtype=torch.int32)  # SWA pages 1, 2, 3
    spec = PageTableSpec(max_batch=3, page_size=ps, sliding_window=5, max_context_len=16,
                         max_full_indices=5)
    L = np.array([12, 8, 0])
    f = np.array([4, 8, 0])
    plan = plan_page_table_rows([0, 1, -1], L, f, spec)
    assert plan.table[2, PT_END_PAGE] == 0 and plan.table.shape == (3, ROW_WIDTH)
    assert plan.swa_first.tolist() == [1, 2, 0] and plan.swa_last_page_len.tolist() == [4, 0, 0]
    table = torch.from_numpy(plan.table)
    r2t[1, :8] = torch.arange(4, 12, dtype=torch.int32)
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
    assert a["swa_csr"][0].tolist() == [0, 2, 2, 2]  # lane 1: frontier at L, nothing to read
    assert a["swa_csr"][1].tolist() == [2, 3, -7, -7, -7, -7]
    assert a["swa_block_table"].tolist() == [[0, 2, 3, 0], [0, 0, 0, 0], [0, 0, 0, 0]]
    assert a["seq_lens"].tolist() == [12, 8, 0]


@pytest.mark.cuda
def test_graph_replay_on_cuda_never_syncs():
    """On a GPU: one graph per row-table buffer, each capturing ``launch(i)``; every step
    is plan (host) + replay + mark_submitted under sync-debug "error", then compared."""
    cfg = ga.AllocatorConfig(page_size=16, num_full_pages=400, num_swa_pages=200, max_reqs=8,
                             max_context_len=512, sliding_window=40, device="cuda",
                             backend="triton", index_dtype=torch.int32)
    alloc = ga.HybridAllocator(cfg)
    rows = [alloc.admit() for _ in range(6)]
    for part, lens in ((rows[:5], [1, 17, 40, 100, 200]), (rows[5:], [333])):
        alloc.alloc_extend(part, lens)  # each within max_step_tokens
    pt = PageTables.for_allocator(alloc, 10, backend="triton")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # compile and warm up outside the capture
        for i in range(pt.spec.n_bufs):
            pt.launch(i)
    torch.cuda.synchronize()
    graphs = []
    for i in range(pt.spec.n_bufs):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            pt.launch(i)
        graphs.append(g)
    rng = np.random.default_rng(5)
    for _ in range(12):
        alloc.evict_window()
        alloc.alloc_decode(rows)
        snap = alloc.snapshot()
        lanes = random_lanes(rng, np.array(rows))
        torch.cuda.set_sync_debug_mode("error")
        try:
            p = pt.plan(lanes, snap["host_seq_len"], snap["host_frontier"])
            graphs[p.buffer_index].replay()
            pt.mark_submitted(p)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
        check_tables(pt, p, snap, cfg.pages_per_request)


def test_query_lens_widen_the_swa_range_for_a_multi_token_verify():
    """A lane verifying q tokens: its SWA range starts at the window of its FIRST query,
    ``max(f, L - (q - 1) - W)``; the FULL range and the last page are the lane's length's."""
    ps, W = 4, 6
    spec = PageTableSpec(max_batch=4, page_size=ps, sliding_window=W, max_context_len=64,
                         layers=("full", "swa"), forms=("csr",))
    seq_len = np.array([30, 30, 9, 0], dtype=np.int64)
    frontier = np.array([16, 20, 0, 0], dtype=np.int64)
    rows, q = np.array([0, 1, 2]), np.array([5, 5, 1])
    one = plan_page_table_rows(rows, seq_len, frontier, spec)
    many = plan_page_table_rows(rows, seq_len, frontier, spec, query_lens=q)
    expect = np.maximum(np.maximum(seq_len[rows] - (q - 1) - W, 0), frontier[rows])
    assert many.window_start[:3].tolist() == expect.tolist() == [20, 20, 3]
    assert one.window_start[:3].tolist() == [24, 24, 3]
    assert (many.swa_first[:3] == expect // ps).all()
    assert (many.full_indptr == one.full_indptr).all()
    assert (many.last_page_len == one.last_page_len).all()
    assert many.swa_indptr[-1] - one.swa_indptr[-1] == 2  # rows 0 and 1: one more page each
    with pytest.raises(ga.errors.PositionError):
        plan_page_table_rows(rows, seq_len, frontier, spec, query_lens=[31, 1, 1])
    with pytest.raises(ga.errors.PositionError):
        plan_page_table_rows(rows, seq_len, frontier, spec, query_lens=[0, 1, 1])
    with pytest.raises(ga.errors.TensorSpecError):
        plan_page_table_rows(rows, seq_len, frontier, spec, query_lens=[1, 1])
