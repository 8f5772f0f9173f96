"""AllocatorConfig: strict validation, the release minimum (no config may strand a request),
for_engine's derived shapes and memory split, the window convention, describe().

Everything runs on the CPU with the Torch backend.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

import graphalloc as ga
from graphalloc import AllocatorConfig, ConfigError, ContractError, HybridAllocator


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


BASE = dict(page_size=4, num_full_pages=12, num_swa_pages=12, max_reqs=4, max_context_len=32,
            sliding_window=6, device="cpu", backend="torch")
NO_CUDA = not torch.cuda.is_available()


def cfg_of(**kw) -> AllocatorConfig:
    return AllocatorConfig(**{**BASE, **kw})


def ceil_div(a, b):
    return -(-a // b)


# ---- 1. strict validation ----------------------------------------------------------------
BAD = [
    ("ring_pages_float", dict(swa_ring_pages=3.5), "swa_ring_pages"),
    ("ring_pages_negative", dict(swa_ring_pages=-1), "swa_ring_pages"),
    ("page_size_bool", dict(page_size=True), "page_size"),
    ("page_size_zero", dict(page_size=0), "page_size"),
    ("page_size_float", dict(page_size=4.0), "page_size"),
    ("page_size_numpy_bool", dict(page_size=np.bool_(True)), "page_size"),
    ("num_full_pages_negative", dict(num_full_pages=-3), "num_full_pages"),
    ("num_swa_pages_str", dict(num_swa_pages="12"), "num_swa_pages"),
    ("max_reqs_none", dict(max_reqs=None), "max_reqs"),
    ("context_float", dict(max_context_len=32.0), "max_context_len"),
    ("window_zero", dict(sliding_window=0), "sliding_window"),
    ("validate_str", dict(validate="yes"), "validate"),
    ("validate_int", dict(validate=1), "validate"),
    ("device_cuda_without_cuda", dict(device="cuda"), "is_available"),
    ("device_cuda_index_out_of_range", dict(device="cuda:1000"), "cuda"),
    ("device_unknown", dict(device="gpu0"), "device"),
    ("device_meta", dict(device="meta"), "meta"),
    ("device_int", dict(device=3.0), "device"),
    ("index_dtype_float", dict(index_dtype=torch.float32), "index_dtype"),
    ("index_dtype_int16", dict(index_dtype=torch.int16), "index_dtype"),
    ("index_dtype_str", dict(index_dtype="int64"), "index_dtype"),
    ("index_dtype_numpy", dict(index_dtype=np.int64), "index_dtype"),
    ("backend_unknown", dict(backend="cuda"), "backend"),
    ("backend_none", dict(backend=None), "backend"),
    ("int32_overflow", dict(index_dtype=torch.int32, num_full_pages=2**31 // 4), "int32"),
    ("ring_too_small", dict(swa_ring_pages=2), "swa_ring_pages"),  # needs ceil(6/4)+1 = 3
    ("ring_larger_than_pool", dict(swa_ring_pages=13), "num_swa_pages"),
    *[(f"{name}_{kind}", {name: value}, name)
      for name in ("max_release_rows", "max_pages_per_row", "max_alloc_rows",
                   "max_tokens_per_alloc_row", "max_step_pages", "max_step_tokens")
      for kind, value in (("negative", -1), ("float", 8.0), ("bool", True))],
    ("row_tokens_above_step_tokens", dict(max_tokens_per_alloc_row=10, max_step_tokens=9),
     "max_tokens_per_alloc_row"),
    ("step_pages_below_release", dict(max_step_pages=7), "max_step_pages"),
    ("release_rows_below_release", dict(max_release_rows=1), "max_release_rows"),
]


@pytest.mark.parametrize("name,kw,word", BAD, ids=[b[0] for b in BAD])
def test_bad_value_raises_config_error(name, kw, word):
    if name == "device_cuda_without_cuda" and not NO_CUDA:
        pytest.skip("this torch has CUDA")
    with pytest.raises(ConfigError) as info:
        cfg_of(**kw)
    assert isinstance(info.value, ContractError)
    msg = str(info.value)
    assert word in msg, msg
    value = next(iter(kw.values()))
    if not isinstance(value, torch.dtype | type) and name != "int32_overflow":
        assert repr(value) in msg or str(value) in msg, msg  # the message quotes the value


def test_bad_device_string_is_a_config_error_not_torchs():
    with pytest.raises(ConfigError, match="not a torch device"):
        cfg_of(device="not-a-device")


def test_numpy_integers_are_accepted_and_stored_as_int():
    kw = dict(page_size=np.int64(4), num_full_pages=np.int32(12), num_swa_pages=np.uint16(12),
              max_reqs=np.int8(4), max_context_len=np.int64(32), sliding_window=np.int64(6),
              swa_ring_pages=np.int64(3), max_step_pages=np.int64(20),
              max_release_rows=np.int32(9), validate=np.bool_(False))
    cfg = cfg_of(**kw)
    for name in kw:
        value = getattr(cfg, name)
        assert type(value) is (bool if name == "validate" else int), name
        assert value == kw[name]
    assert cfg == cfg_of(page_size=4, swa_ring_pages=3, max_step_pages=20, max_release_rows=9)
    alloc = HybridAllocator(cfg)
    r = alloc.admit()
    alloc.alloc_extend([r], [np.int64(9)])
    alloc.release([r])
    alloc.check_integrity()


def test_device_is_normalised_and_dataclass_behaviour_kept():
    cfg = cfg_of(device=torch.device("cpu"))
    assert cfg.device == torch.device("cpu")
    assert cfg == cfg_of() and hash(cfg) == hash(cfg_of())
    again = dataclasses.replace(cfg, validate=True)
    assert again.validate and again.frozen_shapes() == cfg.frozen_shapes()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.page_size = 8
    for c in (cfg, engine()):  # the instance holds its fields and nothing else
        assert set(vars(c)) == {f.name for f in dataclasses.fields(c)}
        assert type(c)(**vars(c)) == c


def test_describe_bookkeeping_dies_with_the_config():
    from graphalloc import config as config_module
    before = len(config_module._ORIGINS)
    for _ in range(50):
        engine().describe()
    assert len(config_module._ORIGINS) == before


# ---- 2. no config may strand a request -----------------------------------------------------
def worst_release(n_pages, ring_pages, row_pages):
    """Brute force over every frontier: (rows, lanes) of the worst single release."""
    rows = max(ceil_div(b, row_pages) + ceil_div(n_pages - b, row_pages)
               for b in range(n_pages + 1))
    if ring_pages:
        rows += ceil_div(ring_pages, row_pages)
    return rows, n_pages + ring_pages


GEOMETRIES = [  # page_size, max_context_len, num_full_pages, max_pages_per_row, ring pages
    (1, 10, 14, 1, 0), (1, 10, 14, 3, 4), (3, 18, 10, 2, 0), (3, 18, 10, 4, 3),
    (4, 32, 12, 3, 0), (4, 32, 5, 2, 0), (16, 80, 10, 1, 3), (5, 7, 8, 1, 0),
    (4, 4, 8, 1, 0), (128, 384, 5, 2, 0), (2, 14, 12, 7, 2), (2, 14, 12, 5, 0),
]


@pytest.mark.parametrize("ps,ctx,n_full,row_pages,ring", GEOMETRIES)
def test_release_minimum_matches_brute_force(ps, ctx, n_full, row_pages, ring):
    kw = dict(page_size=ps, num_full_pages=n_full, num_swa_pages=max(ring, 8), max_reqs=2,
              max_context_len=ctx, sliding_window=1, swa_ring_pages=ring,
              max_pages_per_row=row_pages)
    cfg = AllocatorConfig(**kw)
    p = min(ceil_div(ctx, ps), n_full)
    assert cfg.request_pages == p
    assert (cfg.min_release_rows, cfg.min_step_pages) == worst_release(p, ring, row_pages)
    assert cfg.min_release_rows == 1 + ceil_div(p - 1, row_pages) + (
        ceil_div(ring, row_pages) if ring else 0)
    assert cfg.max_release_rows >= cfg.min_release_rows  # the defaults satisfy the rule
    assert cfg.max_step_pages >= cfg.min_step_pages
    rows, pages = cfg.min_release_rows, cfg.min_step_pages
    AllocatorConfig(**kw, max_release_rows=rows, max_step_pages=pages)  # the minimum: accepted
    if rows > 1:  # (0 would pick the default)
        with pytest.raises(ConfigError, match=f"below the {rows} rows"):
            AllocatorConfig(**kw, max_release_rows=rows - 1, max_step_pages=pages)
    if pages > 1:
        with pytest.raises(ConfigError, match=f"below the {pages} page lanes"):
            AllocatorConfig(**kw, max_release_rows=rows, max_step_pages=pages - 1)


def test_default_release_rows_grow_to_the_minimum():
    cfg = cfg_of(max_reqs=1, max_pages_per_row=1)  # 8 pages, one per row: 8 rows > 3 x 1
    assert cfg.min_release_rows == 8 and cfg.max_release_rows == 8
    assert cfg_of(max_reqs=1).max_release_rows == 3  # unchanged where 3 x max_reqs suffices


def test_row_tokens_default_to_the_step_budget():
    assert cfg_of(max_step_tokens=5).max_tokens_per_alloc_row == 5
    assert cfg_of(max_step_tokens=500).max_tokens_per_alloc_row == 32
    cfg = cfg_of()
    assert cfg.max_tokens_per_alloc_row == 32 and cfg.max_step_tokens == 4 + 32


@pytest.mark.parametrize("ps,ctx,n_full,row_pages,ring", [
    (4, 32, 12, 2, 0), (3, 20, 10, 3, 0), (4, 32, 5, 2, 0), (2, 14, 12, 3, 7), (1, 9, 9, 2, 9),
    (4, 30, 12, 1, 0)])
def test_request_grown_to_the_limit_is_released_at_the_minimum_shape(ps, ctx, n_full,
                                                                      row_pages, ring):
    """The tightest accepted shape releases a request grown as far as allocation lets it,
    with its frontier one page in (the worst split): every page comes back."""
    p = min(ceil_div(ctx, ps), n_full)
    probe = AllocatorConfig(page_size=ps, num_full_pages=n_full, num_swa_pages=max(p, ring),
                            max_reqs=2, max_context_len=ctx, sliding_window=1,
                            swa_ring_pages=ring, max_pages_per_row=row_pages)
    cfg = dataclasses.replace(probe, max_release_rows=probe.min_release_rows,
                              max_step_pages=probe.min_step_pages, max_step_tokens=ps,
                              max_tokens_per_alloc_row=ps)
    alloc = HybridAllocator(cfg)
    r = alloc.admit()
    length = min(ctx, p * ps)
    alloc.alloc_extend([r], [ps])
    alloc.advance_frontier([r], [ps])  # FULL-only [0, ps), FULL + SWA above
    while alloc.stats()["seq_len"][r] < length:
        alloc.alloc_extend([r], [min(ps, length - alloc.stats()["seq_len"][r])])
    if length < ctx:  # the FULL pool is the limit: not one page more
        with pytest.raises(ga.CapacityError):
            alloc.alloc_extend([r], [1])
    planned = alloc.plan(release=[r])
    assert planned.n_release_rows == cfg.max_release_rows == cfg.min_release_rows
    assert planned.pages_freed["full"] == p
    alloc.run(planned)
    alloc.check_integrity()
    st = alloc.stats()
    assert st["full_free_pages"] == cfg.num_full_pages
    assert st["swa_free_pages"] == cfg.num_swa_pages
    assert st["live_requests"] == 0


# ---- 3. for_engine ---------------------------------------------------------------------------
ENGINE = dict(max_running_requests=8, chunked_prefill_size=64, max_context_len=256,
              page_size=16, model_sliding_window=32, num_full_pages=128, num_swa_pages=48)


def engine(**kw) -> AllocatorConfig:
    return AllocatorConfig.for_engine(**{**ENGINE, **kw})


@pytest.mark.parametrize("kw", [
    {}, dict(num_lookahead_tokens=3), dict(max_running_requests=1, chunked_prefill_size=1),
    dict(chunked_prefill_size=1000), dict(page_size=1, model_sliding_window=5),
    dict(page_size=3, max_context_len=100, chunked_prefill_size=7, num_lookahead_tokens=2),
    dict(max_releases_per_step=2), dict(max_pages_per_row=4), dict(max_reqs=12),
    dict(num_full_pages=10), dict(swa_ring_pages=8, num_swa_pages=96),
    dict(swa_ring_pages=10, num_swa_pages=200, max_pages_per_row=3, num_lookahead_tokens=1),
])
def test_for_engine_shapes_follow_the_documented_formulas(kw):
    e = {**ENGINE, **kw}
    cfg = AllocatorConfig.for_engine(**e)
    n, c_tok, k, ps = (e["max_running_requests"], e["chunked_prefill_size"],
                       e.get("num_lookahead_tokens", 0), e["page_size"])
    ctx, ring = e["max_context_len"], e.get("swa_ring_pages", 0)
    f = e.get("max_releases_per_step", n)
    c = e.get("max_pages_per_row", ceil_div(ctx, ps))
    p = min(ceil_div(ctx, ps), cfg.num_full_pages)
    row_tokens = min(ctx, max(c_tok, 1 + k))
    step_tokens = c_tok + n * (1 + k)
    per_release = 1 + ceil_div(p - 1, c) + (ceil_div(ring, c) if ring else 0)
    assert cfg.sliding_window == e["model_sliding_window"] - 1
    assert cfg.max_reqs == e.get("max_reqs", n)
    assert (cfg.num_full_pages, cfg.num_swa_pages) == (e["num_full_pages"], e["num_swa_pages"])
    assert cfg.max_alloc_rows == n
    assert cfg.max_tokens_per_alloc_row == row_tokens
    assert cfg.max_step_tokens == step_tokens
    assert cfg.max_pages_per_row == c
    assert cfg.max_release_rows == f * per_release + n * ceil_div(ceil_div(row_tokens, ps), c)
    assert cfg.max_step_pages == (min(f * p, cfg.num_full_pages)
                                  + (min(f * ring, cfg.num_swa_pages) if ring else 0)
                                  + min(step_tokens // ps + n, cfg.num_swa_pages))
    assert cfg.max_release_rows >= cfg.min_release_rows
    assert cfg.max_step_pages >= cfg.min_step_pages
    assert cfg.swa_ring_pages == ring


def test_for_engine_shapes_are_budget_sized_not_pool_sized():
    cfg = engine(num_full_pages=4096, num_swa_pages=1024, max_releases_per_step=2)
    assert cfg.max_step_pages == 2 * 16 + (64 + 8) // 16 + 8  # two releases + evictions
    assert cfg.max_step_pages < cfg.num_full_pages + cfg.num_swa_pages
    assert cfg.max_step_tokens == 64 + 8 < cfg.max_reqs + cfg.max_context_len


# 4096 past the 256-token context: clamped to the context (tests/support/test_naming.py)
@pytest.mark.parametrize("model_window,alloc_window", [(4096, 256), (257, 256), (256, 255),
                                                       (2, 1), (1, 1), (33, 32)])
def test_for_engine_converts_the_model_window(model_window, alloc_window):
    assert engine(model_sliding_window=model_window).sliding_window == alloc_window


@pytest.mark.parametrize("model_window", [1, 2, 5, 9])
def test_window_conversion_keeps_exactly_what_the_model_reads(model_window):
    """Page size 1: after a decode step at length L, the new query at L reads keys
    L - W_model + 1 .. L, and those (and only those) keep their SWA slots."""
    cfg = engine(page_size=1, model_sliding_window=model_window, max_context_len=40)
    alloc = HybridAllocator(cfg)
    r = alloc.admit()
    alloc.alloc_extend([r], [20])
    for length in range(20, 26):
        alloc.step(evict=[r], decode=[r])  # the new token is position `length`
        f2s = alloc.full_to_swa[alloc.req_to_token[r, :length + 1].long()]
        oldest = max(length - model_window + 1, 0)
        assert (f2s[oldest:] != 0).all(), (length, f2s.tolist())
        if model_window > 1:  # the allocator window is clamped to 1 for W_model = 1
            assert (f2s[:oldest] == 0).all(), (length, f2s.tolist())
    alloc.release([r])
    alloc.check_integrity()


def page_bytes(cfg, full_bpt, swa_bpt):
    return ((cfg.num_full_pages + 1) * cfg.page_size * full_bpt
            + (cfg.num_swa_pages + 1) * cfg.page_size * swa_bpt)


@pytest.mark.parametrize("kv_bytes", [10**6, 3 * 10**6, 10**8])
@pytest.mark.parametrize("ring", [0, 8])
def test_for_engine_memory_split(kv_bytes, ring):
    full_bpt, swa_bpt = 2 * 2 * 4 * 2, 2 * 6 * 4 * 2  # K+V x layers x heads x bytes
    kw = dict(ENGINE, num_full_pages=None, num_swa_pages=None, kv_bytes=kv_bytes,
              full_bytes_per_token=full_bpt, swa_bytes_per_token=swa_bpt, swa_ring_pages=ring)
    cfg = AllocatorConfig.for_engine(**kw)
    ps, n, w = cfg.page_size, 8, cfg.sliding_window
    assert page_bytes(cfg, full_bpt, swa_bpt) <= kv_bytes  # sinks included
    need = 8 * (ceil_div(w, ps) + 1) + cfg.max_step_tokens // ps + n
    if ring:
        assert cfg.num_swa_pages == cfg.max_reqs * ring
    elif cfg.num_full_pages == cfg.num_swa_pages:  # memory short of S: equal split
        assert cfg.num_swa_pages <= need
        bigger = dataclasses.replace(cfg, num_full_pages=cfg.num_full_pages + 1,
                                     num_swa_pages=cfg.num_swa_pages + 1)
        assert page_bytes(bigger, full_bpt, swa_bpt) > kv_bytes
    else:
        assert cfg.num_swa_pages == need < cfg.num_full_pages
    if ring or cfg.num_full_pages != cfg.num_swa_pages:  # FULL gets every byte left
        more = dataclasses.replace(cfg, num_full_pages=cfg.num_full_pages + 1)
        assert page_bytes(more, full_bpt, swa_bpt) > kv_bytes
    assert "kv_bytes" in cfg.describe()


ENGINE_BAD = [
    (dict(kv_bytes=10**6), "one way"),  # bytes and page counts both
    (dict(num_full_pages=None), "num_full_pages and num_swa_pages"),
    (dict(num_full_pages=None, num_swa_pages=None, kv_bytes=10**6), "all three"),
    (dict(num_full_pages=None, num_swa_pages=None, kv_bytes=100, full_bytes_per_token=8,
          swa_bytes_per_token=8), "too small"),
    (dict(swa_ring_pages=3, num_swa_pages=96), "swa_ring_pages=3"),  # window + one chunk
    (dict(max_reqs=4), "max_reqs"),
    (dict(max_running_requests=0), "max_running_requests"),
    (dict(chunked_prefill_size=-1), "chunked_prefill_size"),
    (dict(model_sliding_window=True), "model_sliding_window"),
    (dict(num_lookahead_tokens=1.5), "num_lookahead_tokens"),
    (dict(max_releases_per_step=0), "max_releases_per_step"),
    (dict(page_size=np.float64(16)), "page_size"),
    (dict(device="cuda:1000"), "CUDA device"),
    (dict(backend="tensorrt"), "backend"),
]


@pytest.mark.parametrize("kw,word", ENGINE_BAD, ids=[w for _, w in ENGINE_BAD])
def test_for_engine_refuses_bad_inputs(kw, word):
    with pytest.raises(ConfigError, match=word):
        engine(**kw)


def test_for_engine_accepts_numpy_inputs():
    cfg = engine(max_running_requests=np.int64(8), page_size=np.int32(16),
                 num_full_pages=np.int64(128))
    assert cfg == engine() and type(cfg.page_size) is int


@pytest.mark.parametrize("lookahead,ring,releases", [(0, 0, None), (2, 0, 2), (1, 9, None),
                                                     (3, 10, 1)])
def test_engine_loop_within_its_budgets_is_never_refused_for_shape(lookahead, ring, releases):
    """A random engine within for_engine's budgets (N running, C prefill tokens a step in
    chunks, 1 + k decode tokens a row, eviction every step, at most F releases a step) never
    meets BatchTooLargeError, and the SWA pool sized by the split rule never runs out."""
    n_run, chunk, ctx, ps = 6, 24, 96, 4
    cfg = AllocatorConfig.for_engine(
        max_running_requests=n_run, chunked_prefill_size=chunk, max_context_len=ctx,
        page_size=ps, model_sliding_window=9, kv_bytes=10**7, full_bytes_per_token=4,
        swa_bytes_per_token=4, num_lookahead_tokens=lookahead, swa_ring_pages=ring,
        max_releases_per_step=releases)
    assert cfg.num_full_pages >= cfg.max_reqs * ceil_div(ctx, ps)  # FULL never binds here
    n_rel = releases or n_run
    alloc = HybridAllocator(cfg)
    rng = np.random.default_rng(7 + lookahead + ring)
    reqs: dict[int, list] = {}  # row -> [target length, prompt length]
    for _ in range(150):
        while len(reqs) < n_run and rng.random() < 0.5:
            prompt = int(rng.integers(1, ctx - 8))
            reqs[alloc.admit()] = [int(rng.integers(prompt + 1, ctx + 1)), prompt]
        seq = alloc.stats()["seq_len"]
        done = [r for r, (target, _) in reqs.items() if seq[r] >= target][:n_rel]
        budget, rows, toks = chunk, [], []
        for r, (target, prompt) in reqs.items():
            if r in done or seq[r] >= target:
                continue
            if seq[r] < prompt:  # chunked prefill
                n = min(prompt - seq[r], budget)
                budget -= n
            else:  # decode, with lookahead
                n = min(1 + lookahead, target - seq[r])
            if n:
                rows.append(r)
                toks.append(n)
        planned = alloc.plan(release=done, evict=[r for r in reqs if r not in done],
                             extend=(rows, toks))
        assert planned.n_release_rows <= cfg.max_release_rows  # (plan() refuses otherwise)
        alloc.run(planned)
        for r in done:
            del reqs[r]
    left = list(reqs)
    while left:  # at most F releases a step
        alloc.step(release=left[:n_rel])
        left = left[n_rel:]
    alloc.check_integrity()
    assert alloc.stats()["full_free_pages"] == cfg.num_full_pages
    assert alloc.stats()["swa_free_pages"] == cfg.num_swa_pages


# ---- 4. describe() and frozen_shapes() --------------------------------------------------------
SHAPES = ("max_reqs", "max_context_len", "max_release_rows", "max_pages_per_row",
          "max_alloc_rows", "max_tokens_per_alloc_row", "max_step_pages", "max_step_tokens")


def test_frozen_shapes_are_plain_ints():
    shapes = cfg_of(max_step_pages=np.int64(20)).frozen_shapes()
    assert tuple(shapes) == SHAPES
    assert all(type(v) is int for v in shapes.values())
    assert shapes["max_step_pages"] == 20


def test_describe_lists_every_shape_with_its_rule():
    text = cfg_of(max_step_pages=20).describe()
    for name, value in cfg_of(max_step_pages=20).frozen_shapes().items():
        assert f"| {name} | {value} |" in text
    assert "| max_step_pages | 20 | given |" in text
    assert "| max_release_rows | 12 | default: max(3 x max_reqs, min_release_rows) |" in text
    assert "2 release rows and 8 page lanes" in text
    text = engine(num_lookahead_tokens=3).describe()
    assert "| max_step_tokens | 96 | chunked_prefill_size + max_running_requests x " \
           "(1 + lookahead) = 64 + 8 x 4 |" in text
    assert "max(32 - 1, 1)" in text
    assert len(text.splitlines()) < 20


def test_engine_config_builds_a_working_allocator():
    cfg = engine()
    alloc = HybridAllocator(cfg)
    rows = [alloc.admit() for _ in range(cfg.max_alloc_rows)]
    alloc.alloc_extend(rows[:1], [cfg.max_tokens_per_alloc_row])
    alloc.step(evict=rows, decode=rows[1:], extend=(rows[:1], [cfg.max_tokens_per_alloc_row]))
    alloc.step(release=rows)
    alloc.check_integrity()
    assert alloc.stats()["full_free_pages"] == cfg.num_full_pages
    assert math.isclose(cfg.max_step_tokens, 64 + 8)


def test_for_engine_sizes_handles_and_prefix_hits():
    """A prefix cache's handles, and one allocation row per hit admitted in a step."""
    base = dict(max_running_requests=8, chunked_prefill_size=64, max_context_len=256,
                page_size=16, model_sliding_window=32, num_full_pages=128, num_swa_pages=64)
    plain = ga.AllocatorConfig.for_engine(**base)
    assert (plain.max_handles, plain.max_alloc_rows) == (0, 8)
    cached = ga.AllocatorConfig.for_engine(**base, max_handles=4)
    assert (cached.max_handles, cached.max_alloc_rows) == (4, 16)
    few = ga.AllocatorConfig.for_engine(**base, max_handles=4, max_prefix_hits_per_step=2)
    assert few.max_alloc_rows == 10
    with pytest.raises(ga.ConfigError):
        ga.AllocatorConfig.for_engine(**base, max_handles=-1)
    with pytest.raises(ga.ConfigError):  # handles need pool mode
        ga.AllocatorConfig.for_engine(**{**base, "num_swa_pages": 80}, max_handles=2,
                                      swa_ring_pages=10)


# ---- the model's window W (Hugging Face's) and the deprecated sliding_window input -----------
def test_model_window_is_huggingfaces_and_the_old_input_warns():
    import dataclasses
    import warnings

    base = dict(page_size=4, num_full_pages=16, num_swa_pages=16, max_reqs=2,
                max_context_len=64)
    new = ga.AllocatorConfig(**base, model_window=8)
    assert (new.model_window, new.sliding_window) == (8, 7)
    assert "| model_window | 8 |" in new.describe() and "| sliding_window | 7 |" in new.describe()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = ga.AllocatorConfig(**base, sliding_window=7)
    # the keyword form warns (layers=), and sliding_window= (model_window=) on top
    window = [w for w in caught if "sliding_window" in str(w.message)
              and "minus one" in str(w.message)]
    assert len(window) == 1 and all(w.category is DeprecationWarning for w in caught)
    assert "model_window=8" in str(window[0].message) and window[0].filename == __file__
    assert old == new  # the same config either way
    assert dataclasses.replace(new, max_reqs=3).sliding_window == 7  # replace keeps it
    assert dataclasses.replace(new, model_window=12, sliding_window=None).sliding_window == 11
    with pytest.raises(ga.ConfigError, match="give the window once"):
        dataclasses.replace(new, model_window=12)  # both given, and they disagree
    with pytest.raises(ga.ConfigError, match="model_window"):
        ga.AllocatorConfig(**base)
    for bad in (0, True, 2.5):
        with pytest.raises(ga.ConfigError):
            ga.AllocatorConfig(**base, model_window=bad)
    assert ga.AllocatorConfig(**base, model_window=1).sliding_window == 1  # max(W - 1, 1)


# A release larger than a step is split; no config can make a request unreleasable.
def test_config_refuses_shapes_that_strand_a_request():
    with pytest.raises(ConfigError, match="could never be released"):
        ga.AllocatorConfig(page_size=2, num_full_pages=24, num_swa_pages=16, max_reqs=4,
                           max_context_len=16, sliding_window=3, max_step_pages=4)
