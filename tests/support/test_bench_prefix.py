"""Prefix caching in the scheduler benchmark (benchmarks/sched_prefix.py, the baselines'
caches, graphalloc's own cache driven directly and through the seams, sched_agreement.py):
the traces' hits are the real longest cached prefixes of their token ids, every
implementation finds exactly those hits and agrees with the trace and with the others step
by step (allocations, FULL frees, FULL pool states), graphalloc in ONE step per iteration,
no page is ever lost (also when a small pool forces eviction), and the checks catch a wrong
cache. Traces without the option are unchanged."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location(
    "_bench_sched_prefix", os.path.join(ROOT, "benchmarks", "bench_scheduler.py"))
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)  # puts benchmarks/ on sys.path for the sched_* modules
import sched_agreement as sa  # noqa: E402
import sched_workload as sw  # noqa: E402
from sched_graphalloc import GraphallocDriver, engine_config  # noqa: E402
from sched_seams import SGLangSeamDriver, VLLMSeamDriver  # noqa: E402
from sched_sglang_prefix import SGLangRadixStyle  # noqa: E402
from sched_vllm_style import VLLMStyle  # noqa: E402

CTX = 256


def _spec_of(prefix, b=6, ps=4, window=16, interval=3, seed=1, **kw):
    return sw.WorkloadSpec(n_running=b, page_size=ps, window=window,
                           eviction_interval=interval, max_context_len=CTX, chunk_tokens=48,
                           prompt_median=30, output_median=14, seed=seed, prefix=prefix,
                           system_prompt_tokens=40, system_prompts=2, **kw)


def _baselines(trace, n_pages: int, sglang_cls=SGLangRadixStyle, vllm_cls=VLLMStyle):
    spec = trace.spec
    return {
        "sglang": sglang_cls(
            num_full_pages=n_pages, num_swa_pages=n_pages, max_reqs=2 * spec.n_running,
            max_context_len=CTX, page_size=spec.page_size, sliding_window=spec.alloc_window,
            n_requests=trace.n_requests, max_rows=4 * spec.n_running, device="cpu",
            backend="torch", tokens=trace.tokens, prompt_lens=trace.fill),
        "vllm": vllm_cls(
            num_full_pages=n_pages, num_swa_pages=n_pages, max_batch=spec.n_running,
            max_context_len=CTX, page_size=spec.page_size, model_window=spec.window,
            max_tokens=8 * CTX, n_requests=trace.n_requests, device="cpu",
            prefix_caching=True, tokens=trace.tokens, prompt_lens=trace.fill),
    }


def _graphallocs(trace, pool: str = "no-eviction", api: str = "step", cls=GraphallocDriver):
    """graphalloc with its cache on, directly and through both seams, on the baselines'
    pools (bench.graphalloc_configs)."""
    cfg, _ = engine_config(trace, "cpu", "torch", pools=bench.baseline_pools(trace, pool),
                           cache=True)
    kw = dict(n_requests=trace.n_requests, prefix_cache=True, tokens=trace.tokens,
              prompt_lens=trace.fill)
    return {"graphalloc": cls(cfg, api=api, **kw),
            "graphalloc_sglang": SGLangSeamDriver(
                cfg, interval=trace.spec.eviction_interval, **kw),
            "graphalloc_vllm": VLLMSeamDriver(cfg, **kw)}


def _replay(trace, drivers, strict=True):
    n = len(trace.steps)
    counts = {k: np.zeros((n, 4), dtype=np.int64) for k in drivers}
    states = {k: np.zeros((n, 6), dtype=np.int64) for k in drivers}
    for k, d in drivers.items():
        sa.replay(d, trace.steps, 0, n, counts[k], states[k], strict)
    return counts, states


# ---- the workload --------------------------------------------------------------------------
def _digest(trace) -> str:
    h = hashlib.sha256()
    for s in trace.steps:
        for v in (s.index, s.phase, s.release, s.evict, s.admit, s.extend_ids, s.extend_n,
                  s.decode, s.expect, s.n_evict_segments, s.n_evict_pages, s.n_release_rows):
            h.update(repr(v.tolist() if hasattr(v, "tolist") else v).encode())
            h.update(str(getattr(v, "dtype", "")).encode())
    h.update(repr((trace.phase_start, trace.n_requests, trace.peak_full, trace.peak_swa,
                   trace.max_releases, trace.max_free_lanes, trace.max_release_rows)).encode())
    return h.hexdigest()[:16]


@pytest.mark.parametrize("kw,digest", [
    (dict(n_running=6, page_size=1, window=9, eviction_interval=1, max_context_len=192,
          chunk_tokens=40, prompt_median=30, output_median=14, seed=6), "cc125729db83ce38"),
    (dict(n_running=5, page_size=3, window=17, eviction_interval=4, max_context_len=192,
          chunk_tokens=40, prompt_median=30, output_median=14, seed=5), "25b3c07b717ddb8f"),
    (dict(n_running=16, page_size=16, window=128, eviction_interval=128,
          max_context_len=4096, chunk_tokens=8192, prompt_median=512, output_median=128,
          seed=7919 * 16), "43eafce5703df23c")])
def test_traces_without_prefix_are_unchanged(kw, digest):
    """Digests recorded from the generator before prefix caching existed."""
    trace = sw.generate(sw.WorkloadSpec(**kw), 4, 60, 3)
    assert _digest(trace) == digest
    assert trace.tokens is None and trace.prefix is None
    assert all(s.extend_n_nocache is s.extend_n and len(s.hit) == len(s.admit)
               and not s.hit.any() for s in trace.steps)


def _direct_hits(trace) -> np.ndarray:
    """Each admission's hit recomputed from the token ids alone: the longest common
    whole-page prefix (at most prompt - 1 tokens) with a sequence some request computed
    before (prompt pages after their chunk, output pages when released)."""
    ps = trace.spec.page_size
    computed: list = []
    length = np.zeros(trace.n_requests, dtype=np.int64)
    out = np.full(trace.n_requests, -1, dtype=np.int64)
    for s in trace.steps:
        for r in s.release.tolist():
            computed.append(trace.tokens[r][:length[r] // ps * ps])
        for r in s.admit.tolist():
            key = trace.tokens[r][:trace.fill[r] - 1]
            best = 0
            for seq in computed:
                m = min(len(seq), len(key))
                neq = np.flatnonzero(seq[:m] != key[:m])
                best = max(best, (int(neq[0]) if len(neq) else m) // ps * ps)
            out[r] = best
            length[r] = best
        length[s.decode] += 1
        for r, n in zip(s.extend_ids.tolist(), s.extend_n.tolist(), strict=True):
            length[r] += n
            computed.append(trace.tokens[r][:length[r] // ps * ps])
    return out


@pytest.mark.parametrize("prefix", ["system-prompt", "multi-turn"])
@pytest.mark.parametrize("ps,window", [(4, 16), (1, 9), (3, 10)])
def test_hits_are_the_longest_cached_prefixes(prefix, ps, window):
    trace = sw.generate(_spec_of(prefix, ps=ps, window=window), 4, 80, 0)
    hits = trace.hits()
    admitted = hits >= 0
    assert np.array_equal(hits, _direct_hits(trace))
    assert (hits[admitted] % ps == 0).all() and (hits[admitted] < trace.fill[admitted]).all()
    assert (hits > 0).sum() >= 5  # the workload does share prefixes
    # the summary states the rate the trace's cache gives (hit tokens / prompt tokens)
    assert trace.prefix["hit_rate"] == pytest.approx(
        hits[admitted].sum() / trace.fill[admitted].sum())
    assert trace.prefix["requests_admitted"] == admitted.sum()
    assert 0.2 < trace.prefix["hit_rate"] < 0.9
    # a replay without a cache allocates the hit with the first chunk
    for s in trace.steps:
        n_cont = len(s.extend_ids) - len(s.admit)
        assert np.array_equal(s.extend_n_nocache[n_cont:], s.extend_n[n_cont:] + s.hit)


def test_multi_turn_window_restriction_is_needed():
    """WorkloadSpec refuses multi-turn with window % page_size > 1; with the check lifted
    SGLang's radix cache does hit less than the trace (and vLLM) there."""
    with pytest.raises(ValueError, match="window % page_size"):
        _spec_of("multi-turn", ps=4, window=19)
    spec = _spec_of("multi-turn", ps=4, window=16, seed=2)
    object.__setattr__(spec, "window", 19)
    trace = sw.generate(spec, 4, 150, 0)
    drivers = _baselines(trace, trace.cache_pages + 16)
    _replay(trace, drivers, strict=False)
    hits = trace.hits()
    admitted = hits >= 0
    assert np.array_equal(drivers["vllm"].hit_tokens[admitted], hits[admitted])
    assert drivers["sglang"].recomputed_tokens > 0


# ---- the baselines ---------------------------------------------------------------------------
@pytest.mark.parametrize("prefix", ["system-prompt", "multi-turn"])
@pytest.mark.parametrize("ps,window,interval", [(4, 16, 3), (1, 9, 1), (3, 10, 4)])
def test_baselines_agree_on_hits_counts_and_full_state(prefix, ps, window, interval):
    trace = sw.generate(_spec_of(prefix, ps=ps, window=window, interval=interval), 4, 80, 0)
    n_pages = bench.baseline_pools(trace, "no-eviction")[0]
    drivers = _baselines(trace, n_pages)
    counts, states = _replay(trace, drivers)  # raises at a step that differs or loses a page
    n = len(trace.steps)
    agreement = sa.check_agreement(trace, counts, n, cached=list(drivers))
    assert agreement["equal"]
    assert (agreement["totals_with_cache"][2] > 0) == (ps > 1)  # partial pages only
    rec = sa.check_prefix(trace, drivers, counts, states, n)
    assert rec["full_state_equal"] and rec["trace_hit_rate"] > 0.2
    for name, r in rec["impls"].items():
        assert r["hits_equal_trace"] and r["recomputed_tokens"] == 0, name
        assert r["evicted_pages"] == [0, 0], name  # the pool never had to evict
        assert r["hit_rate"] == pytest.approx(rec["trace_hit_rate"])
    # the caches kept what nothing references: every unreferenced FULL page of a whole
    # page of a finished or prefilled request, the same number in both
    assert states["sglang"][-1, 2] == states["vllm"][-1, 2] > 0
    live = sa.live_ids(trace, n)
    for name, d in drivers.items():
        assert d.verify(live)["ok"], (name, d.verify(live))


@pytest.mark.parametrize("prefix,ps,window,interval,api", [
    ("system-prompt", 4, 16, 3, "step"), ("multi-turn", 3, 10, 4, "context"),
    ("multi-turn", 4, 16, 1, "step")])
def test_graphalloc_with_its_cache_agrees_with_the_baselines(prefix, ps, window, interval,
                                                            api):
    """graphalloc's own cache -- directly (``alloc.step`` or a ``scheduler_step()`` block)
    and through the SGLang seam and the vLLM facade -- on the baselines' pools: the same
    hits as the trace, the same allocations and FULL frees at every step, the same FULL
    pool state as both baselines, ONE graphalloc step per iteration, nothing evicted."""
    trace = sw.generate(_spec_of(prefix, ps=ps, window=window, interval=interval), 4, 60, 0)
    drivers = {**_graphallocs(trace, api=api),
               **_baselines(trace, bench.baseline_pools(trace, "no-eviction")[0])}
    counts, states = _replay(trace, drivers)  # raises at a step that differs or loses a page
    n = len(trace.steps)
    assert sa.check_agreement(trace, counts, n, cached=list(drivers))["equal"]
    rec = sa.check_prefix(trace, drivers, counts, states, n)
    assert rec["full_state_equal"] and rec["trace_hit_rate"] > 0.2
    for name, r in rec["impls"].items():
        assert r["hits_equal_trace"] and r["recomputed_tokens"] == 0, name
        assert r["evicted_pages"] == [0, 0], name
    live = sa.live_ids(trace, n)
    for name, d in drivers.items():
        assert d.verify(live)["ok"], name
        if name.startswith("graphalloc"):
            assert d.steps_per_iteration == 1, name
            assert 0 < len(d.cache) <= d.config.max_handles, name
            d.alloc.check_integrity()
    assert drivers["graphalloc_sglang"].seam.cache_steps == 0
    assert drivers["graphalloc_vllm"].mgr.cache_steps == 0


class _NoChunkInserts(GraphallocDriver):
    """Wrong on purpose: caches finished requests only, never a prefill's chunks."""

    def _inserts(self, st):
        self.prev_extend = self.prev_extend[:0]
        return super()._inserts(st)


def test_a_missing_insert_is_caught():
    trace = sw.generate(_spec_of("system-prompt"), 4, 60, 0)
    ga = _graphallocs(trace, cls=_NoChunkInserts)["graphalloc"]
    with pytest.raises(sa.AgreementError, match="^graphalloc differs at step"):
        _replay(trace, {"graphalloc": ga})  # a missed hit is recomputed: more allocated


def test_graphalloc_runs_the_prefix_trace_with_its_cache_off():
    trace = sw.generate(_spec_of("system-prompt"), 2, 30, 0)
    cfg, notes = engine_config(trace, "cpu", "torch")
    assert "max_step_tokens" in notes["raised_from_for_engine"]  # hits joined the chunks
    ga = GraphallocDriver(cfg, n_requests=trace.n_requests)
    n = len(trace.steps)
    counts = np.zeros((n, 4), dtype=np.int64)
    sa.replay(ga, trace.steps, 0, n, counts)
    assert sa.check_agreement(trace, {"graphalloc": counts}, n)["equal"]
    assert ga.verify(sa.live_ids(trace, n))["ok"]
    ga.close()


def test_small_pool_evicts_and_loses_no_page():
    trace = sw.generate(_spec_of("multi-turn", b=4, seed=6), 4, 200, 0)
    n_pages = bench.baseline_pools(trace, "small")[0]
    assert n_pages < trace.cache_pages  # the caches cannot keep everything
    drivers = {**_baselines(trace, n_pages), **_graphallocs(trace, "small")}
    counts, states = _replay(trace, drivers, strict=False)  # conservation: every step
    n = len(trace.steps)
    for name in drivers:
        assert (states[name][:, :3].sum(axis=1) == n_pages).all(), name
        assert (states[name][:, 3:].sum(axis=1) == n_pages).all(), name
    rec = sa.check_prefix(trace, drivers, counts, states, n, strict=False)
    hits = trace.hits()
    admitted = hits >= 0
    for name, d in drivers.items():
        assert sum(d.evicted_pages) > 0, name
        assert (d.hit_tokens[admitted] <= hits[admitted]).all(), name
        assert d.recomputed_tokens == int((hits - d.hit_tokens)[admitted].sum()), name
        assert rec["impls"][name]["hit_rate"] > 0, name
        assert d.verify(sa.live_ids(trace, n))["ok"], name
    # graphalloc evicted inside its steps; where a step's own inserts held the pages it
    # needed (this trace has such a step), they ran first: two steps in that iteration
    for name in ("graphalloc", "graphalloc_sglang", "graphalloc_vllm"):
        assert drivers[name].steps_per_iteration == 2, name


# ---- the checks catch a wrong cache ------------------------------------------------------------
class _NoOutputsSGLang(SGLangRadixStyle):
    """Wrong on purpose: cache_finished_req inserts only the prompt (outputs freed)."""

    def _cache_finished(self, rid):
        ps = self.ps
        keep = int(self.protected[rid])
        row, length = int(self.row_of[rid]), int(self.length[rid])
        if length > keep:
            self.free(self.req_to_token[row, keep:(length + ps - 1) // ps * ps],
                      max(0, int(self.evicted[rid]) - keep))
        self.length[rid] = keep
        super()._cache_finished(rid)


class _LeakyVLLM(VLLMStyle):
    """Wrong on purpose: a released request's unhashed (partial) block is never freed."""

    def step(self, st, clock=sa.NULL_CLOCK):
        for rid in st.release.tolist():
            for mgr in self.managers:
                blocks = mgr.req_to_blocks.get(rid)
                if blocks and blocks[-1].block_hash is None:
                    blocks.pop()
        super().step(st, clock)


def test_checks_catch_a_wrong_cache():
    trace = sw.generate(_spec_of("multi-turn"), 4, 80, 0)
    n_pages = bench.baseline_pools(trace, "no-eviction")[0]
    drivers = _baselines(trace, n_pages, sglang_cls=_NoOutputsSGLang)
    with pytest.raises(sa.AgreementError, match="^sglang "):
        _replay(trace, {"sglang": drivers["sglang"]})
    # counts not compared (small-pool mode): the hits still differ from the trace's
    drivers = _baselines(trace, n_pages, sglang_cls=_NoOutputsSGLang)
    counts, states = _replay(trace, drivers, strict=False)
    with pytest.raises(sa.AgreementError, match="^sglang hits"):
        sa.check_prefix(trace, drivers, counts, states, len(trace.steps))
    # a lost page fails at once, whatever else is compared
    drivers = _baselines(trace, n_pages, vllm_cls=_LeakyVLLM)
    with pytest.raises(sa.AgreementError, match="^vllm lost pages at step"):
        _replay(trace, {"vllm": drivers["vllm"]}, strict=False)


# ---- the benchmark ---------------------------------------------------------------------------
def test_quick_run_with_prefix_cache(tmp_path):
    out = tmp_path / "bench"
    assert bench.main(["--quick", "--device", "cpu", "--out", str(out), "--no-progress",
                       "--no-plot", "--b", "4", "--interval", "1",
                       "--prefix-cache", "system-prompt"]) == 0
    res = json.loads((out / "bench_scheduler.json").read_text())
    assert res["errors"] == [] and res["params"]["prefix"] == "system-prompt"
    assert [c["prefix"]["pool"] for c in res["configs"]] == ["no-eviction", "small"]
    for c in res["configs"]:
        pr = c["prefix"]
        assert c["agreement"]["equal"] and set(pr["impls"]) == set(bench.IMPLS)
        assert pr["trace"]["hit_rate"] > 0 and pr["trace_hit_rate"] > 0
        assert set(c["impls"]) == set(bench.IMPLS)
        for r in c["impls"].values():
            assert r["verify"]["ok"]
    strict = res["configs"][0]["prefix"]
    assert strict["full_state_equal"] and all(
        r["hits_equal_trace"] for r in strict["impls"].values())
    md = (out / "bench_scheduler.md").read_text()
    assert "## Prefix caching (system-prompt)" in md
    assert "graphalloc (prefix cache on)" in md and "(small pool)" in md


# ---- the radix tree's rules, one by one ------------------------------------------------------
class _Owner:
    """Records what the tree frees: FULL pages and SWA pages (ps = 2, slot = page * 2)."""

    def __init__(self):
        self.full, self.swa, self.remapped = [], [], []

    def free(self, value, swa_from):
        pages = (value[::2] // 2).tolist()
        self.full += pages
        self.swa += pages[swa_from // 2:]

    def free_swa(self, value):
        self.swa += (value[::2] // 2).tolist()

    def remap(self, dst, src):
        self.remapped.append(((dst[::2] // 2).tolist(), (src[::2] // 2).tolist()))


def test_radix_tree_rules():
    import torch
    from sched_sglang_radix import SWARadixTree

    def slots(*pages):
        return torch.tensor([p * 2 + o for p in pages for o in (0, 1)])

    owner = _Owner()
    tree = SWARadixTree(owner, page_size=2, window=3)
    key = np.arange(1, 9, dtype=np.int32)  # 4 pages
    assert tree.insert(key, slots(10, 11, 12, 13), 0) == 0
    assert (tree.full_evictable, tree.swa_evictable) == (8, 8)
    # a partial match splits the node at the page boundary
    values, node, n = tree.match_prefix(np.array([1, 2, 3, 4, 9, 9], dtype=np.int32))
    assert n == 4 and torch.equal(torch.cat(values), slots(10, 11))
    # lock the whole prefix: FULL locked to the root, SWA over the window (3 tokens: the
    # last node [5, 9) alone)
    values, node, n = tree.match_prefix(key)
    uuid = tree.inc_lock_ref(node)
    assert n == 8 and (tree.full_protected, tree.swa_protected, tree.swa_evictable) == (8, 4, 4)
    # SWA pressure tombstones the unlocked node [1, 5): its SWA freed, FULL kept
    assert tree.evict(0, 4) == (0, 4) and owner.swa == [10, 11] and owner.full == []
    # a match may end after a tombstone only when a window's worth of SWA follows it
    assert tree.match_prefix(key)[2] == 8
    tree.window = 5
    assert tree.match_prefix(key)[2] == 0
    tree.window = 3
    # another request inserts the same tokens: the locked tombstone keeps its FULL slots
    # and takes the incoming SWA (remap, incoming FULL freed); the live node frees the
    # incoming duplicate (FULL and SWA)
    owner.full, owner.swa = [], []
    assert tree.insert(key, slots(20, 21, 22, 23), 0) == 8
    assert owner.remapped == [([10, 11], [20, 21])]
    assert owner.full == [20, 21, 22, 23] and owner.swa == [22, 23]
    assert (tree.swa_evictable, tree.swa_protected) == (4, 4)
    # unlocked, FULL pressure frees the leaf, then the exposed parent
    tree.dec_lock_ref(node, uuid)
    owner.full, owner.swa = [], []
    assert tree.evict(8, 0) == (8, 8)
    assert sorted(owner.full) == [10, 11, 12, 13] and sorted(owner.swa) == [10, 11, 12, 13]
    audit = tree.audit([])
    assert audit["sizes_ok"] and audit["nodes"] == 0


def test_small_swa_pool_tombstones_and_loses_no_page():
    """A SWA pool smaller than FULL (as engines size them): SWA pressure alone evicts."""
    trace = sw.generate(_spec_of("multi-turn", b=4, seed=6), 4, 200, 0)
    n_full, n_swa = trace.cache_pages + 16, trace.peak_swa + 8
    spec = trace.spec
    drivers = {
        "sglang": SGLangRadixStyle(
            num_full_pages=n_full, num_swa_pages=n_swa, max_reqs=8, max_context_len=CTX,
            page_size=spec.page_size, sliding_window=spec.alloc_window,
            n_requests=trace.n_requests, max_rows=16, device="cpu", backend="torch",
            tokens=trace.tokens, prompt_lens=trace.fill),
        "vllm": VLLMStyle(
            num_full_pages=n_full, num_swa_pages=n_swa, max_batch=4, max_context_len=CTX,
            page_size=spec.page_size, model_window=spec.window, max_tokens=8 * CTX,
            n_requests=trace.n_requests, device="cpu", prefix_caching=True,
            tokens=trace.tokens, prompt_lens=trace.fill)}
    counts, states = _replay(trace, drivers, strict=False)
    for name, d in drivers.items():
        assert (states[name][:, 3:].sum(axis=1) == n_swa).all(), name
        assert d.evicted_pages[1] > 0 and d.recomputed_tokens > 0, name
        assert d.verify(sa.live_ids(trace, len(trace.steps)))["ok"], name
