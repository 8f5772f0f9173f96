"""Paged decode attention (kernels.paged_attention) against dense attention from the same KV.

Each case builds lanes of a decode batch the way the page tables describe them: lane i's
CSR list covers positions ``[S, L)`` of a request (FULL tables: S = 0; SWA tables:
``S = floor_page(max(f, L - W))``) on random, distinct page ids, and the query is the token
at position ``L - 1``. Only the K/V of positions the query reads (``>= L - W`` with a
window) hold numbers; every other cache entry -- stale tokens of a first page, the tail of
a last page, unused pages, the sink page 0 -- is NaN, the ``kv_indices`` tail past
``indptr[B]`` names the sink, and an empty lane's query is NaN. So a finite, matching
result proves that nothing outside the window and the lane's list reached the output, and
an empty lane's exact zeros that it read nothing. The Triton kernel (through the
interpreter on a CPU) and the Torch twin are both checked against float64 dense attention.
"""

import math

import numpy as np
import pytest
import torch

from graphalloc.kernels import paged_decode_attention, paged_decode_attention_torch
from graphalloc.kernels.errors import TensorSpecError

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
IMPLS = {"triton": paged_decode_attention, "torch": paged_decode_attention_torch}


def build_case(ps, n_heads, n_kv_heads, head_dim, lens, window, swa, frontiers=None,
               index_dtype=torch.int64, seed=0):
    """Caches, CSR tables, queries and the float64 dense reference of one decode batch."""
    rng = np.random.default_rng(seed)
    frontiers = frontiers or [0] * len(lens)
    starts, n_pages = [], []
    for L, f in zip(lens, frontiers, strict=True):
        S = (max(f, L - window, 0) // ps * ps) if swa else 0
        starts.append(S)
        n_pages.append(-(-L // ps) - S // ps if L else 0)
    total = sum(n_pages)
    n_cache_pages = total + 4  # page 0 (the sink) and a few never-used pages
    page_ids = rng.permutation(np.arange(1, n_cache_pages))[:total]
    k = np.full((n_cache_pages, ps, n_kv_heads, head_dim), np.nan)
    v = np.full_like(k, np.nan)
    q = rng.standard_normal((len(lens), n_heads, head_dim))
    ref = np.zeros_like(q)
    rep = n_heads // n_kv_heads
    indptr = np.concatenate([[0], np.cumsum(n_pages)]).astype(np.int64)
    for i, (L, S) in enumerate(zip(lens, starts, strict=True)):
        if L == 0:
            q[i] = np.nan  # an empty lane must not read its query either
            continue
        pages = page_ids[indptr[i]:indptr[i + 1]]
        lo = max(S, L - window) if window else S
        pos = np.arange(lo, L)
        keys = rng.standard_normal((len(pos), n_kv_heads, head_dim))
        vals = rng.standard_normal((len(pos), n_kv_heads, head_dim))
        page, off = pages[(pos - S) // ps], pos % ps
        k[page, off], v[page, off] = keys, vals
        for h in range(n_heads):
            s = keys[:, h // rep] @ q[i, h] / math.sqrt(head_dim)
            p = np.exp(s - s.max())
            ref[i, h] = (p / p.sum()) @ vals[:, h // rep]
    last = [(L - 1) % ps + 1 if L else 0 for L in lens]
    capacity = total + 3  # a tail past indptr[B]: the sink, never read
    indices = np.zeros(capacity, dtype=np.int64)
    indices[:total] = page_ids

    def dev(a, dtype=torch.float32):
        return torch.as_tensor(np.asarray(a), dtype=dtype, device=DEVICE)

    tables = (dev(indptr, index_dtype), dev(indices, index_dtype), dev(last, index_dtype))
    max_pages = max(max(n_pages), 1)
    return dict(q=dev(q), k=dev(k), v=dev(v), tables=tables, ref=ref, lens=lens,
                max_pages=max_pages)


CASES = {
    # name: (ps, n_heads, n_kv_heads, head_dim, lens, window, swa tables, frontiers)
    "ps1_full": (1, 4, 2, 16, [5, 0, 1, 9], 0, False, None),
    "ps1_swa_window_vs_lengths": (1, 4, 2, 16, [5, 0, 1, 9], 3, True, None),
    "ps3_swa_gqa3_dim12": (3, 3, 1, 12, [10, 7, 0, 2, 14], 4, True, None),
    "ps16_swa_ragged": (16, 4, 2, 16, [40, 17, 0, 5, 33], 20, True, None),
    "ps16_window_longer_than_all": (16, 4, 4, 8, [40, 17, 5], 100, True, None),
    "ps3_full_table_with_window": (3, 4, 2, 16, [30, 9, 0], 5, False, None),
    "ps3_full_many_tiles": (3, 2, 1, 16, [150, 64, 65, 0], 0, False, None),
    "ps16_swa_many_tiles": (16, 2, 2, 16, [150, 70], 80, True, None),
    "ps3_clipped_lanes": (3, 2, 1, 16, [20, 12, 7], 6, True, [18, 9, 0]),
}


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("case", list(CASES))
def test_matches_dense_attention(impl, case):
    ps, H, Hkv, D, lens, window, swa, frontiers = CASES[case]
    c = build_case(ps, H, Hkv, D, lens, window, swa, frontiers,
                   index_dtype=torch.int32 if list(CASES).index(case) % 2 else torch.int64,
                   seed=list(CASES).index(case))
    out = IMPLS[impl](c["q"], c["k"], c["v"], *c["tables"], sliding_window=window,
                      max_pages=c["max_pages"])
    got = out.cpu().double().numpy()
    assert np.isfinite(got).all(), "a NaN outside the window or the lane's list was read"
    np.testing.assert_allclose(got, c["ref"], rtol=1e-5, atol=1e-5)
    empty = [i for i, L in enumerate(lens) if L == 0]
    assert (got[empty] == 0).all(), "an empty lane must produce exact zeros"


@pytest.mark.parametrize("impl", list(IMPLS))
def test_out_buffer_scale_and_all_empty(impl):
    c = build_case(3, 4, 2, 16, [7, 0, 11], 4, True, seed=3)
    out = torch.full_like(c["q"], 7.0)
    res = IMPLS[impl](c["q"], c["k"], c["v"], *c["tables"], sliding_window=4,
                      sm_scale=0.25 / math.sqrt(16) * 4, out=out)  # == the default scale
    assert res is out
    np.testing.assert_allclose(out.cpu().double().numpy(), c["ref"], rtol=1e-5, atol=1e-5)
    # every lane empty: zeros, nothing read (indices is an empty buffer)
    B, z = 3, torch.zeros(4, dtype=torch.int32, device=DEVICE)
    none = IMPLS[impl](c["q"], c["k"], c["v"], z, z[:0], z[:B], sliding_window=0)
    assert (none == 0).all()


def test_twin_default_grid_is_enough():
    """Without ``max_pages`` the twin's grid is the whole ``kv_indices`` capacity."""
    c = build_case(1, 4, 2, 16, [5, 0, 1, 9], 3, True, seed=5)
    out = paged_decode_attention_torch(c["q"], c["k"], c["v"], *c["tables"], sliding_window=3)
    np.testing.assert_allclose(out.cpu().double().numpy(), c["ref"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", list(IMPLS))
def test_refuses_bad_arguments(impl):
    c = build_case(3, 4, 2, 16, [7, 0, 11], 4, True, seed=1)
    q, k, v, (indptr, indices, last) = c["q"], c["k"], c["v"], c["tables"]
    fn = IMPLS[impl]
    bad = {
        "3 heads over 2 KV heads": dict(q=q[:, :3]),
        "head dim differs": dict(q=q[..., :8].contiguous()),
        "indptr of the wrong length": dict(indptr=indptr[:-1]),
        "float tables": dict(last=last.float()),
        "v shape differs": dict(v=v[:, :2]),
        "negative window": dict(window=-1),
        "out of another dtype": dict(out=torch.empty_like(q, dtype=torch.float64)),
    }
    for what, change in bad.items():
        a = dict(q=q, k=k, v=v, indptr=indptr, indices=indices, last=last, window=4, out=None)
        a.update(change)
        with pytest.raises(TensorSpecError):
            fn(a["q"], a["k"], a["v"], a["indptr"], a["indices"], a["last"],
               sliding_window=a["window"], out=a["out"])
            pytest.fail(what)


@pytest.mark.cuda
def test_cuda_no_sync_and_graph_replay():
    """Kernel and twin run eagerly under ``set_sync_debug_mode("error")`` (neither syncs),
    then both are captured in one CUDA graph; replays after the tables, caches and queries
    change in place give the new batch's results."""
    first, second = (build_case(16, 4, 2, 16, [40, 17, 0, 5, 33], 20, True, seed=s)
                     for s in (1, 2))
    static = {name: first[name].clone() for name in ("q", "k", "v")}
    tables = [t.clone() for t in first["tables"]]
    max_pages = max(first["max_pages"], second["max_pages"])

    def body():
        a = paged_decode_attention(static["q"], static["k"], static["v"], *tables,
                                   sliding_window=20)
        b = paged_decode_attention_torch(static["q"], static["k"], static["v"], *tables,
                                         sliding_window=20, max_pages=max_pages)
        return a, b

    body()  # compiles the kernel
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        eager = body()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    for o in eager:
        np.testing.assert_allclose(o.cpu().double().numpy(), first["ref"], rtol=1e-5, atol=1e-5)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = body()
    for case in (first, second):
        for name in ("q", "k", "v"):
            static[name].copy_(case[name])
        for t, src in zip(tables, case["tables"], strict=True):
            assert t.shape == src.shape
            t.copy_(src)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            graph.replay()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
        for o in outs:
            np.testing.assert_allclose(o.cpu().double().numpy(), case["ref"], rtol=1e-5,
                                       atol=1e-5)
