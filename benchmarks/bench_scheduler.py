"""Scheduler benchmark: graphalloc's whole step against two engine-style baselines, per iteration.

    python benchmarks/bench_scheduler.py --out results/bench/scheduler-h200 \\
        --time-budget-s 240 --no-progress                           # GPU, under 5 minutes
    python benchmarks/bench_scheduler.py --quick --out /tmp/bench_scheduler   # CPU smoke run

A seeded continuous-batching workload (``sched_workload.py``: Poisson arrivals,
log-normal prompt and output lengths, a chunked-prefill token budget, requests finishing
and being replaced, window eviction every ``eviction_interval`` decode tokens and at every
prefill chunk) at B = 1, 16, 64, 256, 1024 running requests x page size 16, 64 x model
window 128, 4096 x eviction interval 1, 128, replayed by six implementations that make
the same decisions:

    graphalloc          one HybridAllocator with graphalloc's StepGraph executor: per
                        iteration ONE alloc.step(...) (cache inserts, releases, evictions,
                        admits, prefill chunks, decodes) -- one plan, one CUDA-graph replay
                        (sched_graphalloc.py)
    graphalloc_tables   the same plus the step batch's attention block tables (FULL + SWA,
                        PageTableSpec: written in the step), in the same graph: one replay
    graphalloc_sglang   graphalloc through its SGLang seam, driven as SGLang's scheduler
                        calls it (free group, prepare_for_extend / prepare_for_decode; with
                        a cache match_prefix, cache_unfinished_req, cache_finished_req):
                        one step per iteration (sched_seams.py)
    graphalloc_vllm     graphalloc through its vLLM facade: per request allocate_slots /
                        free (get_computed_blocks, cache_blocks with a cache), then
                        run_step(): one step per iteration (sched_seams.py)
    sglang              SGLang-style eager calls (sched_baselines.SGLangStyle): the
                        project's own re-implementation, not SGLang's code
    vllm                a vLLM-style CPU block manager and block-table upload
                        (sched_baselines.VLLMStyle): the project's own re-implementation

and, beside them, two real peers' code where it is installed, each compared with
graphalloc's whole step with tables: TokenSpeed's scheduler (``tokenspeed-scheduler`` from
the package index, ``sched_tokenspeed.py``) given the same trace's work -- its own plan per
iteration, timed -- and vLLM's KV-cache manager (``vllm`` from the package index,
``sched_vllm_peer.py``) replaying the same trace's decisions, called per request as
vLLM's scheduler calls it, timed (``--tokenspeed-path`` / ``--vllm-path`` name a
site-packages to import each from; a peer not importable is skipped and the outputs say so).

Per configuration, each implementation runs the trace's bootstrap and warm-up steps, then
M measured steps (M adapts to ``--time-budget-s``), then a profiled window of K steps:

    host us        time.perf_counter_ns around the whole step (planning, launches,
                   bookkeeping), pipelined: no synchronisation between steps; the CUDA event
                   records are subtracted
    GPU interval   CUDA events: around the replay (graphalloc), around the whole step (the
                   baselines: their launches are interleaved with host work, so the interval
                   includes the gaps the host leaves); read after the M steps
    GPU busy       torch.profiler (CUPTI) over the K profiled steps: the union of the
                   device activity (kernels, memcpy, memset) divided by K
    launches       the same profile: kernels executed, kernel-launch API calls, graph
                   launches, memcpy/memset API calls per step (aten ops without CUDA)
    syncs          torch.cuda.set_sync_debug_mode("warn") during the M steps: the
                   synchronising CUDA calls torch reports, per step (not observable without
                   CUDA); plus ``stalls``, the waits for a pinned buffer still being read
    floor          an empty Triton kernel in a CUDA graph (timing.empty_graph), timed the
                   same way as the steps (pipelined events, a host pause before each replay
                   so the device is idle when it starts; and timing.measure_floor's L2-flushed
                   sampler for reference), first and last

Agreement: after every configuration the per-step page counts (FULL allocated, SWA
allocated, FULL freed, SWA freed) of every implementation and of the trace's own model
must be equal at every step run (the seams' SWA frees are reported instead: they evict
by their engine's own window rule); otherwise the configuration is an error
(``AgreementError``) and the exit status is 1. Then every implementation's device state
is checked against its host (graphalloc: ``check()`` and ``audit()``; the baselines:
``verify()``). Host ratios: baselines / graphalloc and seam / graphalloc (p50s).

``--prefix-cache system-prompt|multi-turn`` replays a prefix-caching trace with every
implementation's prefix cache on (SGLang's radix cache, vLLM's prefix caching,
graphalloc's own: inserts as takes of the iteration's step, hits admitted on their
handles, eviction inside the step), all on the same pools, plus one small-pool
configuration whose caches must evict. What must agree then is in ``sched_agreement.py``
(hits per request, allocations and FULL frees per step, FULL pool states, no page lost)
and in the method text.

Writes ``bench_scheduler.json`` (rewritten after every configuration), ``bench_scheduler.md``
(tables, targets, the method) and, with matplotlib, ``host_us_vs_b.png`` and
``gpu_us_vs_b.png`` (drawn by ``sched_plots.py``) into ``--out``. A failing configuration is
recorded in the JSON's ``errors`` and the run goes on.
"""

from __future__ import annotations

import collections
import gc
import json
import math
import os
import sys
import time
import traceback
import warnings

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if HERE not in sys.path:
    sys.path.insert(0, HERE)
import sched_host_path  # noqa: E402
import sched_tokenspeed  # noqa: E402
import sched_vllm_peer  # noqa: E402
from sched_agreement import (  # noqa: E402
    AgreementError,  # noqa: F401 (re-exported: the tests catch it from here)
    check_agreement,
    check_prefix,
    live_ids,
    record,
    replay,
)
from sched_baselines import SGLangStyle, VLLMStyle  # noqa: E402
from sched_graphalloc import SHAPES, GraphallocDriver, engine_config, pool_pages  # noqa: E402
from sched_plots import plot  # noqa: E402
from sched_prefix import PREFIX_WORKLOADS  # noqa: E402
from sched_seams import SGLangSeamDriver, VLLMSeamDriver  # noqa: E402
from sched_sglang_prefix import SGLangRadixStyle  # noqa: E402
from sched_workload import STEP_CLASSES, WorkloadSpec, generate  # noqa: E402
from timing import (  # noqa: E402
    _COPY_APIS,
    _GRAPH_LAUNCH_APIS,
    _LAUNCH_APIS,
    _VIEW_OPS,
    Sampler,
    _is_device_event,
    bench_main,
    bench_parser,
    empty_graph,
    machine_info,
    measure_floor,
)

IMPLS = ("graphalloc", "graphalloc_tables", "graphalloc_sglang", "graphalloc_vllm", "sglang",
         "vllm")
LABELS = {"graphalloc": "graphalloc", "graphalloc_tables": "graphalloc + tables",
          "graphalloc_sglang": "graphalloc via SGLang seam",
          "graphalloc_vllm": "graphalloc via vLLM facade",
          "sglang": "SGLang-style eager (own re-implementation)",
          "vllm": "vLLM-style block manager (own re-implementation)"}
SEAMS = ("graphalloc_sglang", "graphalloc_vllm")  # their own window rule (sched_seams.py)
RATIOS = (("sglang", "graphalloc"), ("vllm", "graphalloc"), ("vllm", "graphalloc_tables"),
          ("sglang", "graphalloc_tables"), ("graphalloc_sglang", "graphalloc"),
          ("graphalloc_vllm", "graphalloc"), ("sglang", "graphalloc_sglang"),
          ("vllm", "graphalloc_vllm"))

FULL = dict(b=(1, 16, 64, 256, 1024), ps=(16, 64), window=(128, 4096), interval=(1, 128),
            chunk=8192, steps=300, min_steps=40, steps_1024=120, warmup=10, profile=10,
            seed=0, sigma=0.8, floor_samples=200, small_pool_b=64, small_pool_steps=300,
            system_prompt_tokens=1024)
QUICK = dict(b=(1, 4), ps=(16,), window=(32,), interval=(1, 8), chunk=64, steps=12,
             min_steps=6, steps_1024=12, warmup=2, profile=2, seed=0, sigma=0.8,
             floor_samples=10, small_pool_b=4, small_pool_steps=80,
             system_prompt_tokens=64)
END_RESERVE_S = 10.0  # kept back for the last floor, the outputs and the plots


def lengths_for(window: int, quick: bool) -> dict:
    """Medians and context of the length distributions for a model window W."""
    if quick:
        return dict(prompt_median=max(24, window // 2), output_median=max(12, window // 4),
                    max_context_len=max(256, 4 * window))
    return dict(prompt_median=max(512, window // 2), output_median=max(128, window // 4),
                max_context_len=max(4096, 4 * window))


# ---- statistics -----------------------------------------------------------------------------
def stats(samples) -> dict | None:
    """p50 / p90 / p20 / p80 / mean / min / max / n (None for no samples)."""
    a = np.asarray(samples, dtype=np.float64)
    if a.size == 0:
        return None
    p20, p50, p80, p90 = np.percentile(a, (20, 50, 80, 90))
    return {"p50": float(p50), "p90": float(p90), "p20": float(p20), "p80": float(p80),
            "mean": float(a.mean()), "min": float(a.min()), "max": float(a.max()),
            "n": int(a.size)}


def _p(rec, key="p50"):
    return rec[key] if rec else None


def _ratio(a, b):
    return a / b if a is not None and b not in (None, 0) else None


# ---- clocks ---------------------------------------------------------------------------------
class StepClock:
    """Host time of one step without the CUDA event records, and an event pair around the
    step's device part (wall time of it without CUDA). Events are made up front."""

    def __init__(self, is_cuda: bool, n_steps: int):
        self.is_cuda = is_cuda
        self.pairs = ([(torch.cuda.Event(enable_timing=True), torch.cuda.Event(
            enable_timing=True)) for _ in range(n_steps)] if is_cuda else [])
        self.walls: list[float] = []
        self.i = -1

    def begin(self) -> None:
        self.i += 1
        self.excluded = 0
        if not self.is_cuda:
            self.walls.append(0.0)  # this step's device part (its launches add up)
        self.t0 = time.perf_counter_ns()

    def device_begin(self) -> None:
        a = time.perf_counter_ns()
        if self.is_cuda:
            self.pairs[self.i][0].record()
        self._wall0 = a
        self.excluded += time.perf_counter_ns() - a

    def device_end(self) -> None:
        a = time.perf_counter_ns()
        if self.is_cuda:
            self.pairs[self.i][1].record()
        else:
            self.walls[-1] += (a - self._wall0) / 1e3
        self.excluded += time.perf_counter_ns() - a

    def end(self) -> float:
        return (time.perf_counter_ns() - self.t0 - self.excluded) / 1e3

    def device_us(self) -> list[float]:
        if not self.is_cuda:
            return self.walls
        torch.cuda.synchronize()
        return [s.elapsed_time(e) * 1e3 for s, e in self.pairs[:self.i + 1]]


class SyncCounter:
    """Counts the synchronising CUDA calls torch reports under set_sync_debug_mode("warn")
    (``None`` per step without CUDA: not observable)."""

    def __init__(self, is_cuda: bool):
        self.is_cuda = is_cuda
        self.records: list = []

    def __enter__(self):
        if self.is_cuda:
            self._ctx = warnings.catch_warnings(record=True)
            self.records = self._ctx.__enter__()
            warnings.simplefilter("always")
            self._old = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc):
        if self.is_cuda:
            torch.cuda.set_sync_debug_mode(self._old)
            self._ctx.__exit__(*exc)
        return False

    def count(self) -> int | None:
        if not self.is_cuda:
            return None
        return sum(1 for w in self.records if "synchroniz" in str(w.message).lower())


def _busy_us(intervals) -> float:
    """Union length of (start, end) intervals (us)."""
    total, end = 0.0, -math.inf
    for s, e in sorted(intervals):
        if s >= end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def profile_steps(fn, n_steps: int, is_cuda: bool) -> dict:
    """Per step over one profiled window: device busy us (union of kernel/memcpy/memset
    activity), kernels, launch API calls, graph launches, copy API calls, aten ops."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if is_cuda else [])
    if is_cuda:
        torch.cuda.synchronize()
    with profile(activities=acts) as prof:
        fn()
        if is_cuda:
            torch.cuda.synchronize()
    counts = collections.Counter()
    spans = []
    for ev in prof.events():
        name = ev.name
        if _is_device_event(ev):
            low = name.lower()
            counts["device_copies" if low.startswith(("memcpy", "memset")) else "kernels"] += 1
            spans.append((ev.time_range.start, ev.time_range.end))
        elif name in _LAUNCH_APIS:
            counts["launch_calls"] += 1
        elif name in _GRAPH_LAUNCH_APIS:
            counts["graph_launches"] += 1
        elif name in _COPY_APIS:
            counts["copy_calls"] += 1
        elif (name.startswith("aten::") and getattr(ev, "cpu_parent", None) is None
              and name not in _VIEW_OPS):
            counts["aten_ops"] += 1
    n = max(n_steps, 1)
    out = {k: counts.get(k, 0) / n for k in ("kernels", "device_copies", "launch_calls",
                                              "graph_launches", "copy_calls", "aten_ops")}
    out["busy_us"] = _busy_us(spans) / n if is_cuda else None
    if not is_cuda:
        for k in ("kernels", "device_copies", "launch_calls", "graph_launches", "copy_calls"):
            out[k] = None
    out["steps"] = n_steps
    return out


# ---- the floor --------------------------------------------------------------------------------
def _spin(us: float) -> None:
    t_end = time.perf_counter_ns() + int(us * 1e3)
    while time.perf_counter_ns() < t_end:
        pass


def measure_floors(device, n: int, flush: bool) -> dict:
    """The empty-graph floor three ways (module docstring); without CUDA the eager fill."""
    is_cuda = device.type == "cuda"
    call, what, graph = empty_graph(device)
    out = {"kernel": what}
    sampler = Sampler(device, n_samples=min(n, 100), n_warmup=10,
                      flush_mib=256 if (flush and is_cuda) else 0)
    out["sampler"] = {k: v for k, v in measure_floor(sampler).items() if k != "graph"}
    clock = StepClock(is_cuda, n + 10)
    host = []
    for i in range(n + 10):
        _spin(20.0)  # the device is idle when the replay starts, as after a step's planning
        clock.begin()
        clock.device_begin()
        call()
        clock.device_end()
        if i >= 10:
            host.append(clock.end())
    dev = clock.device_us()[10:]
    out["pipelined_gpu_us"] = stats(dev)
    out["pipelined_host_us"] = stats(host)
    prof = profile_steps(lambda: [call() for _ in range(20)], 20, is_cuda)
    out["busy_us"] = prof["busy_us"]
    out["launches"] = prof
    return out


# ---- one configuration ---------------------------------------------------------------------
class Context:
    def __init__(self, args, device, backend):
        self.args, self.params = args, args.params
        self.device, self.backend = device, backend
        self.is_cuda = device.type == "cuda"
        self.tokenspeed, self.tokenspeed_why = False, "not loaded"  # _run loads the peers
        self.vllm, self.vllm_why = False, "not loaded"
        self.vllm_run = None  # the configuration's sched_vllm_peer.Run
        self.host_run = None  # the configuration's sched_host_path.Run


def baseline_pools(trace, pool: str) -> tuple[int, int]:
    """The baselines' FULL and SWA pools. Without a prefix workload, or with
    ``pool="small"``: graphalloc's (the trace's peak without a cache, plus 2%: a cache
    fills it and evicts). With one and ``pool="no-eviction"``: every page the replay with
    a cache allocates, plus 2% (no page ever has to be reused, so nothing is evicted)."""
    if trace.spec.prefix is None or pool == "small":
        n = pool_pages(trace)
        return (max(n), max(n)) if trace.spec.prefix else n
    n = trace.cache_pages + max(16, trace.cache_pages // 50)
    return n, n


def graphalloc_configs(ctx, trace, pool: str = "no-eviction") -> tuple:
    """``(config, notes, seams' config)``: graphalloc's allocator for the trace (with a
    prefix workload: its cache on, the baselines' pools) and the seams' (their SWA pool as
    large as the FULL one: they evict by their own rule, ``sched_seams.py``)."""
    if trace.spec.prefix:
        cfg, notes = engine_config(trace, ctx.device, ctx.backend,
                                   pools=baseline_pools(trace, pool), cache=True)
        return cfg, notes, cfg
    cfg, notes = engine_config(trace, ctx.device, ctx.backend)
    n = max(pool_pages(trace))
    return cfg, notes, engine_config(trace, ctx.device, ctx.backend, pools=(n, n))[0]


def build_driver(ctx, name: str, trace, cfgs, pool: str = "no-eviction"):
    spec = trace.spec
    cfg, _, seam_cfg = cfgs
    n_full, n_swa = baseline_pools(trace, pool)
    cache = dict(tokens=trace.tokens, prompt_lens=trace.fill) if spec.prefix else None
    on = dict(n_requests=trace.n_requests, prefix_cache=bool(cache), **(cache or {}))
    if name in ("graphalloc", "graphalloc_tables"):
        return GraphallocDriver(cfg, tables=name == "graphalloc_tables", **on)
    if name == "graphalloc_sglang":
        return SGLangSeamDriver(seam_cfg, interval=spec.eviction_interval, **on)
    if name == "graphalloc_vllm":
        return VLLMSeamDriver(seam_cfg, **on)
    if name == "sglang":
        return (SGLangRadixStyle if cache else SGLangStyle)(
            num_full_pages=n_full, num_swa_pages=n_swa, max_reqs=cfg.max_reqs,
            max_context_len=spec.max_context_len, page_size=spec.page_size,
            sliding_window=spec.alloc_window, n_requests=trace.n_requests,
            max_rows=cfg.max_alloc_rows, device=ctx.device, backend=ctx.backend,
            decode=ctx.args.sglang_decode, **(cache or {}))
    if name == "vllm":
        return VLLMStyle(
            num_full_pages=n_full, num_swa_pages=n_swa, max_batch=spec.n_running,
            max_context_len=spec.max_context_len, page_size=spec.page_size,
            model_window=spec.window, max_tokens=cfg.max_step_tokens,
            n_requests=trace.n_requests, device=ctx.device, prefix_caching=bool(cache),
            **(cache or {}))
    raise ValueError(f"unknown implementation {name!r}")


def _by_class(values, classes) -> dict:
    out = {}
    for c in STEP_CLASSES:
        sel = [v for v, k in zip(values, classes, strict=True) if k == c]
        out[c] = stats(sel)
    return out


class _Drivers:
    """The configuration's implementations; one that raises is dropped (its error kept)
    and the others go on."""

    def __init__(self, errors: dict):
        self.live: dict = {}
        self.errors = errors

    def attempt(self, name: str, fn) -> None:
        try:
            fn()
        except Exception as exc:
            self.errors[name] = {"error": f"{type(exc).__name__}: {exc}",
                                 "traceback": traceback.format_exc()}
            d = self.live.pop(name, None)
            if d is not None and hasattr(d, "close"):
                d.close()
            if torch.cuda.is_available():
                torch.cuda.synchronize()


def _measure(ctx, d, trace, m0: int, m: int, counts: np.ndarray, classes, seg1,
             states=None) -> dict:
    """M pipelined steps of one implementation: host, GPU interval, syncs per step."""
    is_cuda = ctx.is_cuda
    clock = StepClock(is_cuda, m)
    host, plan, syncs = np.zeros(m), [], []
    gc.collect()
    if is_cuda:
        torch.cuda.synchronize()  # start on an idle device (the previous one's work done)
    gc.disable()  # no collector pause inside the measured steps (all alike)
    prepare = getattr(d, "prepare", None)  # the engine's own bookkeeping: untimed
    try:
        with SyncCounter(is_cuda) as sc:
            for j in range(m):
                st = trace.steps[m0 + j]
                if prepare is not None:
                    prepare(st)
                clock.begin()
                d.step(st, clock)
                host[j] = clock.end()
                syncs.append(sc.count())
                if hasattr(d, "plan_ns"):
                    plan.append(d.plan_ns / 1e3)
                record(d, st, m0 + j, counts, states, ctx.strict)
    finally:
        gc.enable()
    dev = clock.device_us()
    per_sync = None if syncs[0] is None else np.diff([0] + syncs).tolist()
    if not is_cuda:  # the eager device part runs inside the step on a CPU: without it
        extra = {"host_us_no_device": stats(host - np.asarray(dev[:m]))}
    else:
        extra = {}
    out = {
        "host_us": stats(host), "host_us_by_class": _by_class(host, classes),
        "gpu_interval_us": stats(dev), "gpu_interval_us_by_class": _by_class(dev, classes),
        "gpu_interval_us_one_segment": stats([v for v, s in zip(dev, seg1, strict=True)
                                              if s]),
        "syncs": None if per_sync is None else {
            "total": int(sum(per_sync)), "max_per_step": int(max(per_sync)),
            "steps_with_syncs": int(np.count_nonzero(per_sync))},
    }
    if plan:
        out["plan_us"] = stats(plan)
    out.update(extra)
    return out


def run_config(ctx, b: int, ps: int, window: int, interval: int, budget_s: float,
               pool: str = "no-eviction") -> dict:
    """One configuration, every implementation (module docstring); ``budget_s`` is its
    share of the run's time budget (it sizes the measured steps). ``pool``: the
    baselines' pools with ``--prefix-cache`` (``baseline_pools``)."""
    p = ctx.params
    ctx.budget_s = budget_s
    ctx.strict = pool != "small"
    t_cfg = time.perf_counter()
    prefix = {} if not p.get("prefix") else dict(
        prefix=p["prefix"], system_prompt_tokens=p["system_prompt_tokens"])
    spec = WorkloadSpec(n_running=b, page_size=ps, window=window, eviction_interval=interval,
                        chunk_tokens=p["chunk"], sigma=p["sigma"], seed=p["seed"] + 7919 * b,
                        **lengths_for(window, ctx.args.quick), **prefix)
    m_max = max(p["steps_1024"] if b >= 1024 else p["steps"], p["min_steps"])
    if pool == "small":  # long enough for the caches to fill the pools
        m_max = max(m_max, p["small_pool_steps"])
    K = p["profile"]
    trace = generate(spec, p["warmup"], m_max, K)
    cfgs = graphalloc_configs(ctx, trace, pool)
    cfg, notes, seam_cfg = cfgs
    small = " small pool" if pool == "small" else ""
    rec = {"b": b, "ps": ps, "window": window, "interval": interval,
           "label": f"B={b} ps={ps} W={window} ei={interval}{small}",
           "spec": {k: getattr(spec, k) for k in spec.__dataclass_fields__},
           "allocator": {**{k: getattr(cfg, k) for k in SHAPES}, **notes},
           "allocator_seams": {k: getattr(seam_cfg, k) for k in SHAPES
                               if getattr(seam_cfg, k) != getattr(cfg, k)},
           "pools": {"full": cfg.num_full_pages, "swa": cfg.num_swa_pages},
           "driver_errors": {}}
    if spec.prefix:
        rec["prefix"] = {"workload": spec.prefix, "pool": pool, "graphalloc": "cache on",
                         "baseline_pools": dict(zip(("full", "swa"), baseline_pools(
                             trace, pool), strict=True)), "trace": trace.prefix}
    drivers = _Drivers(rec["driver_errors"])
    # with a real peer: vLLM's manager and graphalloc + tables' host path alone (nothing
    # launched), replayed to the measured steps, then measured in turn (``_in_turn``)
    # once the drivers ran
    m0 = trace.phase_start["measure"]
    ctx.vllm_run = (sched_vllm_peer.start(trace, baseline_pools(trace, pool), m0)
                    if ctx.vllm else None)
    ctx.host_run = (sched_host_path.start(trace, cfg, m0, ctx.strict)
                    if ctx.vllm or ctx.tokenspeed else None)
    for name in (n for n in IMPLS if n in ctx.args.impls):
        drivers.attempt(name, lambda name=name: drivers.live.__setitem__(
            name, build_driver(ctx, name, trace, cfgs, pool)))
    gc.collect()
    gc.freeze()  # the drivers' long-lived objects (vLLM's blocks) are never scanned again
    try:
        rec = _run_drivers(ctx, rec, drivers, trace, cfg, t_cfg, m_max)
        m = rec["steps"]["measured"]
        _in_turn((ctx.host_run, ctx.vllm_run), trace, m0, m)
        if ctx.host_run is not None:
            rec["host_path"] = ctx.host_run.result()
        rec["peers"] = {"tokenspeed": sched_tokenspeed.measure(
            trace, baseline_pools(trace, pool), cfg.max_reqs, m0, m)
            if ctx.tokenspeed else {"skipped": ctx.tokenspeed_why},
            "vllm": ctx.vllm_run.result() if ctx.vllm_run is not None
            else {"skipped": ctx.vllm_why}}
        return rec
    finally:
        for d in drivers.live.values():
            if hasattr(d, "close"):
                d.close()
        drivers.live.clear()
        if ctx.host_run is not None:
            ctx.host_run.close()
        ctx.vllm_run = ctx.host_run = None
        gc.unfreeze()
        gc.collect()  # the linked free queues are reference cycles


def _in_turn(runs, trace, m0: int, m: int) -> None:
    """The measured steps ``[m0, m0 + m)`` of ``runs`` (graphalloc's host path alone,
    vLLM's manager), stepping in turn -- the order swapped every step -- so that load on
    the machine and each other's use of the CPU's caches fall on all alike; the
    collector off, as for the drivers."""
    runs = [r for r in runs if r is not None]
    gc.collect()
    gc.disable()
    try:
        for k, st in enumerate(trace.steps[m0:m0 + m]):
            for run in (runs if k % 2 == 0 else runs[::-1]):
                run.step(st)
    finally:
        gc.enable()


def _run_drivers(ctx, rec, drivers, trace, cfg, t_cfg, m_max) -> dict:
    p, is_cuda, K, budget_s = ctx.params, ctx.is_cuda, ctx.params["profile"], ctx.budget_s
    rec["setup_s"] = time.perf_counter() - t_cfg
    if "graphalloc_tables" in drivers.live:
        rec["tables_mode"] = drivers.live["graphalloc_tables"].table_mode
    n_total = len(trace.steps)
    counts = {n: np.zeros((n_total, 4), dtype=np.int64) for n in drivers.live}
    states = {n: np.zeros((n_total, 6), dtype=np.int64) for n, d in drivers.live.items()
              if getattr(d, "prefix_cache", False)}
    strict = ctx.strict
    w0, m0 = trace.phase_start["warmup"], trace.phase_start["measure"]
    # 1. bootstrap + warm-up, every implementation (the warm-up timed to size the run)
    wall_step = {}

    def warm(name, d):
        replay(d, trace.steps, 0, w0, counts[name], states.get(name), strict)
        if is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        replay(d, trace.steps, w0, m0, counts[name], states.get(name), strict)
        if is_cuda:
            torch.cuda.synchronize()
        wall_step[name] = (time.perf_counter() - t0) / max(1, m0 - w0)

    for name, d in list(drivers.live.items()):
        drivers.attempt(name, lambda name=name, d=d: warm(name, d))
    per_step = sum(wall_step.values())
    spent = time.perf_counter() - t_cfg
    left = budget_s - spent - 3.0 * K * per_step - 1.0  # the profile (~3x), the checks
    m = int(max(p["min_steps"], min(m_max, left / max(per_step * 1.2, 1e-6))))
    rec["steps"] = {"bootstrap": w0, "warmup": m0 - w0, "measured": m, "profiled": K,
                    "measured_max": m_max}
    classes = [s.step_class for s in trace.steps[m0:m0 + m]]
    seg1 = [s.step_class == "decode+evict" and s.n_evict_segments == 1
            for s in trace.steps[m0:m0 + m]]
    rec["workload"] = trace.stats(m0, m0 + m)
    # 2. measured steps, 3. the profiled window (launches, device busy time)
    res: dict = {}
    k0, stop = m0 + m, m0 + m + K
    for name, d in list(drivers.live.items()):
        drivers.attempt(name, lambda name=name, d=d: res.__setitem__(
            name, _measure(ctx, d, trace, m0, m, counts[name], classes, seg1,
                           states.get(name))))
    for name, d in list(drivers.live.items()):
        def prof(name=name, d=d):
            res[name]["profile"] = profile_steps(
                lambda: replay(d, trace.steps, k0, stop, counts[name], states.get(name),
                               strict), K, is_cuda)
            res[name]["stalls"] = int(d.stalls)
        drivers.attempt(name, prof)
    # 4. agreement (every step run) and each device state against its host
    done = {n: counts[n] for n in drivers.live}
    cached = [n for n in drivers.live if n in states]
    rec["agreement"] = check_agreement(trace, done, stop, cached, strict,
                                       [n for n in done if n in SEAMS])
    rec["agreement"]["impls"] = sorted(done)
    if cached:
        rec["prefix"].update(check_prefix(trace, {n: drivers.live[n] for n in cached}, done,
                                          states, stop, strict))
        if not strict and not any(sum(r["evicted_pages"]) for r in
                                  rec["prefix"]["impls"].values()):
            rec["prefix"]["note"] = "small pool: no implementation had to evict in this run"
    live = live_ids(trace, stop)
    audit = cfg.max_reqs * cfg.max_context_len <= p.get("audit_limit", 8 << 20)

    def check(name, d):
        v = d.verify(live, audit=audit) if name.startswith("graphalloc") else d.verify(live)
        res[name]["verify"] = v
        if not v["ok"]:
            raise AssertionError(f"device state does not match the host: {v}")

    for name, d in list(drivers.live.items()):
        drivers.attempt(name, lambda name=name, d=d: check(name, d))
    # measured implementations (one whose device check failed too: its error is recorded)
    rec["impls"] = {n: res[n] for n in IMPLS if n in res and "profile" in res[n]}
    rec["ratios"] = ratios_of(rec["impls"])
    rec["wall_s"] = time.perf_counter() - t_cfg
    return rec


def ratios_of(res: dict) -> dict:
    out = {}
    for a, b in RATIOS:
        if a not in res or b not in res:
            continue
        ra, rb = res[a], res[b]
        key = f"{a}/{b}"
        out[key] = {
            "host_p50": _ratio(_p(ra["host_us"]), _p(rb["host_us"])),
            "host_p90": _ratio(_p(ra["host_us"], "p90"), _p(rb["host_us"], "p90")),
            "gpu_interval_p50": _ratio(_p(ra["gpu_interval_us"]), _p(rb["gpu_interval_us"])),
            "gpu_busy": _ratio(ra["profile"]["busy_us"], rb["profile"]["busy_us"]),
        }
    return out


# ---- targets -------------------------------------------------------------------------------
def targets(res: dict) -> list[dict]:
    """The issue's targets, judged on CUDA runs only."""
    judged = res["device_clock"] == "cuda-events"
    floor = _p((res.get("floor") or {}).get("pipelined_gpu_us"))
    rows = []

    def add(what, case, measured, limit, op):
        ok = None if measured is None or not judged else (
            measured <= limit if op == "<=" else measured >= limit)
        rows.append({"target": what, "case": case, "measured": measured, "limit": limit,
                     "op": op, "result": ("not judged (no CUDA)" if not judged else
                                          "no data" if ok is None else
                                          "PASS" if ok else "FAIL")})

    for c in res["configs"]:
        ga = c["impls"].get("graphalloc")
        if not ga:
            continue
        host = _p(ga["host_us"])
        lim = 30.0 if c["b"] >= 1024 else 15.0
        add("graphalloc host us per step (p50)", c["label"], host, lim, "<=")
        for base in ("sglang", "vllm"):
            r = c["ratios"].get(f"{base}/graphalloc", {}).get("host_p50")
            add(f"host: {base} / graphalloc (p50)", c["label"], r, 10.0, ">=")
        for b, key, what, lim in (
                (1, "gpu_interval_us_one_segment", "GPU: one-segment step / floor (p50)", 1.5),
                (256, "decode+evict", "GPU: B=256 decode + eviction step / floor (p50)", 2.0)):
            if c["b"] != b or not floor:
                continue
            st = (ga["gpu_interval_us_one_segment"] if b == 1
                  else ga["gpu_interval_us_by_class"][key])
            add(what, f"{c['label']} ({st['n'] if st else 0} steps)",
                _ratio(_p(st), floor), lim, "<=")
    return rows


# ---- report --------------------------------------------------------------------------------
def _f(x, digits=3) -> str:
    if x is None:
        return "–"
    if abs(x) >= 1000:
        return f"{x:.0f}"
    return f"{x:.{digits}g}"


def _q(st, key="p50") -> str:
    return _f(st[key]) if st else "–"


def _labels(res: dict) -> dict:
    """Column labels; with a prefix workload they say that every cache is on."""
    if not res["params"].get("prefix"):
        return LABELS
    return {n: f"{v} (prefix cache on)" for n, v in LABELS.items()}


def _row_key(c: dict) -> str:
    small = " (small pool)" if (c.get("prefix") or {}).get("pool") == "small" else ""
    return f"| {c['b']} | {c['ps']} | {c['window']} | {c['interval']}{small}"


def _prefix_lines(res: dict) -> list[str]:
    """The prefix-caching table: hits per implementation and what their caches hold."""
    cfgs = [c for c in res["configs"] if c.get("prefix") and "impls" in c["prefix"]]
    if not cfgs:
        return []
    names = [n for n in IMPLS if any(n in c["prefix"]["impls"] for c in cfgs)]

    def each(c, fn):
        return "; ".join(fn(c["prefix"]["impls"][n]) if n in c["prefix"]["impls"] else "–"
                         for n in names)

    lines = ["", f"## Prefix caching ({res['params']['prefix']}): hits and cache contents",
             "", f"Per implementation ({'; '.join(names)}), every one with its prefix "
             "cache on. Hit rate = hit tokens / prompt tokens of the requests "
             "admitted in the run; the trace's is what a cache that never evicts gives. "
             "Freed = pages whose content was dropped; cached = unreferenced pages kept "
             "for reuse (FULL / SWA).", "",
             "| B | ps | W | interval | trace hit rate | hit rate | recomputed tokens | "
             "freed FULL / SWA | cached at the end FULL / SWA | evicted FULL / SWA | "
             "hits and FULL state agree |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in cfgs:
        pr = c["prefix"]
        agree = ("yes" if pr["strict"] else "not required (small pool)") if all(
            r["hits_equal_trace"] for r in pr["impls"].values()) and pr[
            "full_state_equal"] else ("NO" if pr["strict"] else "no (small pool: reported)")
        lines.append(
            _row_key(c) + f" | {pr['trace_hit_rate']:.3f} | "
            + each(c, lambda r: f"{r['hit_rate']:.3f}") + " | "
            + each(c, lambda r: str(r["recomputed_tokens"])) + " | "
            + each(c, lambda r: "{}/{}".format(*r["freed_total"])) + " | "
            + each(c, lambda r: "{}/{}".format(r["final_state"][2], r["final_state"][5]))
            + " | " + each(c, lambda r: "{}/{}".format(*r["evicted_pages"])) + f" | {agree} |")
    return lines


def markdown(res: dict) -> str:
    clock = res["device_clock"]
    fl = res.get("floor") or {}
    labels = _labels(res)
    lines = [
        "# bench_scheduler: graphalloc's scheduler step against engine-style baselines", "",
        f"Command: `{res['command']}`  ",
        f"Machine: {res['machine']['summary']}  ",
        f"Device clock: {clock}; backend: {res['backend']}; SGLang-style decode: "
        f"{res['params']['sglang_decode']}; wall {res.get('wall_s', 0):.0f} s of a "
        f"{res['params']['time_budget_s']:.0f} s budget", "",
    ]
    if fl:
        lines += [f"Floor ({fl['kernel']}): pipelined GPU "
                  f"{_q(fl.get('pipelined_gpu_us'))} us (p50; p90 "
                  f"{_q(fl.get('pipelined_gpu_us'), 'p90')}), L2-flushed sampler "
                  f"{_q((fl.get('sampler') or {}).get('gpu_us'))} us, CUPTI busy "
                  f"{_f(fl.get('busy_us'))} us; at the end: pipelined "
                  f"{_q((res.get('floor_end') or {}).get('pipelined_gpu_us'))} us.", ""]
    if clock != "cuda-events":
        lines += ["**CPU run: device times are CPU wall clock of eager execution, launches "
                  "and syncs are not observable, targets are not judged.**", ""]
    lines += ["## Targets", "", "| target | case | measured | limit | result |",
              "|---|---|---|---|---|"]
    for t in res["targets"]:
        lines.append(f"| {t['target']} | {t['case']} | {_f(t['measured'])} | {t['op']} "
                     f"{_f(t['limit'])} | {t['result']} |")
    cfgs = res["configs"]
    lines += ["", "## Host time per step (us, p50 / p90)", "",
              "Ratios of the p50s: baselines / graphalloc (ga: `alloc.step`), and the seams "
              "(graphalloc driven through them) / `alloc.step`.", "",
              "| B | ps | W | interval | " + " | ".join(labels[n] for n in IMPLS)
              + " | sglang / ga | vllm / ga | vllm / ga + tables | SGLang seam / ga | "
              "vLLM facade / ga |", "|---|---|---|---|" + "---|" * (len(IMPLS) + 5)]
    for c in cfgs:
        cells = []
        for n in IMPLS:
            r = c["impls"].get(n)
            cells.append(f"{_q(r['host_us'])} / {_q(r['host_us'], 'p90')}" if r else "–")
        rat = c["ratios"]
        lines.append(
            _row_key(c) + " | " + " | ".join(cells)
            + f" | {_f(rat.get('sglang/graphalloc', {}).get('host_p50'))}x"
            f" | {_f(rat.get('vllm/graphalloc', {}).get('host_p50'))}x"
            f" | {_f(rat.get('vllm/graphalloc_tables', {}).get('host_p50'))}x"
            f" | {_f(rat.get('graphalloc_sglang/graphalloc', {}).get('host_p50'))}x"
            f" | {_f(rat.get('graphalloc_vllm/graphalloc', {}).get('host_p50'))}x |")
    lines += sched_tokenspeed.markdown_lines(res)
    lines += sched_vllm_peer.markdown_lines(res, sched_tokenspeed.graphalloc_key(res))
    lines += ["", "## GPU per step (us): interval p50 (CUDA events) / busy (CUPTI, mean)", "",
              "| B | ps | W | interval | " + " | ".join(labels[n] for n in IMPLS)
              + " | ga decode+evict p50 | ga one-segment p50 | floor |",
              "|---|---|---|---|" + "---|" * (len(IMPLS) + 3)]
    floor = _q(fl.get("pipelined_gpu_us")) if fl else "–"
    for c in cfgs:
        cells = []
        for n in IMPLS:
            r = c["impls"].get(n)
            cells.append(f"{_q(r['gpu_interval_us'])} / {_f(r['profile']['busy_us'])}"
                         if r else "–")
        ga = c["impls"].get("graphalloc")
        de = _q(ga["gpu_interval_us_by_class"]["decode+evict"]) if ga else "–"
        one = _q(ga["gpu_interval_us_one_segment"]) if ga else "–"
        lines.append(_row_key(c) + " | "
                     + " | ".join(cells) + f" | {de} | {one} | {floor} |")
    lines += ["", "## Launches and syncs per step (profiled window)", "",
              "Per implementation: kernels executed / kernel-launch calls / graph launches / "
              "memcpy+memset calls (aten ops without CUDA); syncs: total over the measured "
              "steps (max in one step); stalls: waits for a pinned buffer.", "",
              "| B | ps | W | interval | " + " | ".join(labels[n] for n in IMPLS) + " |",
              "|---|---|---|---|" + "---|" * len(IMPLS)]
    for c in cfgs:
        cells = []
        for n in IMPLS:
            r = c["impls"].get(n)
            if not r:
                cells.append("–")
                continue
            pr = r["profile"]
            if pr["kernels"] is None:
                launch = f"{_f(pr['aten_ops'])} aten ops"
            else:
                launch = (f"{_f(pr['kernels'])} / {_f(pr['launch_calls'])} / "
                          f"{_f(pr['graph_launches'])} / {_f(pr['copy_calls'])}")
            sy = r["syncs"]
            sync = "syncs –" if sy is None else f"syncs {sy['total']} ({sy['max_per_step']})"
            cells.append(f"{launch}; {sync}; stalls {r['stalls']}")
        lines.append(_row_key(c) + " | "
                     + " | ".join(cells) + " |")
    lines += ["", "## Workload per configuration (means over the measured steps)", "",
              "| B | ps | W | interval | steps (bootstrap / measured / profiled) | decode rows "
              "| prefill tokens | releases | eviction segments | SWA pages freed | pools FULL / "
              "SWA | same pages freed |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in cfgs:
        w, s = c["workload"], c["steps"]
        lines.append(
            _row_key(c) + f" | {s['bootstrap']} / "
            f"{s['measured']} / {s['profiled']} | {_f(w.get('decode_rows'))} | "
            f"{_f(w.get('prefill_tokens'))} | {_f(w.get('releases'))} | "
            f"{_f(w.get('evict_segments'))} | {_f(w.get('swa_pages_freed'))} | "
            f"{c['pools']['full']} / {c['pools']['swa']} | "
            f"{'yes' if c['agreement']['equal'] else 'NO'} "
            f"({c['agreement']['steps_compared']} steps) |")
    lines += _prefix_lines(res)
    if res["errors"] or res["skipped"]:
        lines += ["", "## Errors and skipped parts", ""]
        lines += [f"* ERROR {e['case']}: {e['error']}" for e in res["errors"]]
        lines += [f"* skipped: {s}" for s in res["skipped"]]
    lines += ["", METHOD]
    return "\n".join(lines) + "\n"


METHOD = """## Method (how to read these numbers)

**Workload** (`benchmarks/sched_workload.py`): a seeded continuous-batching scheduler on
the host. Per iteration: release the requests that decoded their last token in the
previous iteration; evict by the window rule (new frontier = max(f, floor_page(L - W + 1)),
L the length when the step begins) every decoding request whose decode count is a multiple
of the eviction interval (SGLang's `SGLANG_SWA_EVICTION_INTERVAL`-style gate) and every
request continuing a chunked prefill; spend the chunked-prefill budget (8192 tokens) on
requests already prefilling, then admit waiting requests (FCFS) while fewer than B run;
decode one token for every request whose prefill is complete. Poisson arrivals at 1.25 x
the finishing rate keep B requests running. Prompt and output lengths are log-normal
(sigma 0.8; medians max(512, W/2) and max(128, W/4), context max(4096, 4 W)). The run starts
from B requests already part-way through their output (a bootstrap that only prefills
them), then warm-up, measured and profiled steps. All implementations replay the same
decisions and keep their own lengths and frontiers.

**graphalloc**: `HybridAllocator(AllocatorConfig.for_engine(...), executor="graph")`, pools
of the trace's peak plus 2%, `max_reqs` = B + the most releases in one step; where the trace
frees more in one step than for_engine's every-step-eviction sizing allows (the 128-token
interval), `max_step_pages` / `max_release_rows` are raised to the trace's need (recorded
per configuration under `allocator.raised_from_for_engine`). Per iteration the new
requests' rows (`alloc.free_row()`, host only, O(1)) and ONE `alloc.step(release=, evict=,
admit=, decode=, extend=)`, planned by the compiled planner and run as one CUDA-graph
replay (graphalloc's `StepGraph`, subclassed only to put the CUDA events around the
replay). **graphalloc + tables** adds `PageTables.plan` of the step's batch (block-table
form, FULL and SWA) and replays one graph holding the allocator's launch and the tables'
launch (captured per descriptor buffer and launch form): still one replay per step. The
JSON's `plan_us` is the planning alone (the call to the replay).

**graphalloc via the seams** (`sched_seams.py`): the same allocator driven as the engines
call `graphalloc.integrations`. SGLang seam: the finished requests released in a free
group (`release_kv_cache`; with a cache `cache_finished_req`, and `cache_unfinished_req`
for every request that extended), `match_prefix` per new request, then ONE
`prepare_for_extend` (the iteration's chunks with the decoding requests as 1-token
extends: SGLang's mixed chunked prefill) or `prepare_for_decode`, on plain objects with
SGLang's field names. vLLM facade: `free(rid, token_ids)` per finished request
(`cache_blocks` per request that extended, with a cache), `allocate_slots` per decoding,
continuing and new request (`get_computed_blocks` first for a new one), then ONE
`run_step()`. The engine's own objects (requests, token lists, the batch's host arrays) are
built before the clock starts; what the seam does with them is timed. Each seam evicts
windows by its engine's rule (SGLang: every extend, and a decode once `L - W >= frontier +
interval`; vLLM: every `allocate_slots`), not the trace's decode-count gate, so their SWA
frees are reported, not compared, and their SWA pools are the FULL pools' size.

**SGLang-style** (`benchmarks/sched_sglang_style.py`, `SGLangStyle`): the same device tables;
releases split at the frontier (FULL pages by a floor_divide of the page-start slots, SWA
pages by graphalloc's fused lookup-and-clear kernel), one fused lookup-and-clear per
request whose window lost a page, all inside a free group (one cat and ring write per pool
at its end), then per allocation call (prefill chunks, decodes) one host-to-device copy,
two gathers, one allocation kernel per pool, one req_to_token write kernel and the
full-to-SWA scatter. Sync-free (SGLang's own frees use `torch.unique` and boolean masks,
which wait for the device): this favours the baseline.

**vLLM-style** (`sched_vllm_style.py`, `VLLMStyle`): Python block objects in a doubly
linked free queue per group, per-request block lists, `allocate_slots` topping them up,
the SWA group's removal of blocks wholly outside the window (replaced by the null block 0,
called where the trace evicts), `free` in reverse order; the worker's persistent batch
(holes filled, then condensed), new block ids appended to a pinned CPU block table, the
slot mapping computed in numpy, and per step one non_blocking copy of the running
requests' block-table rows (both groups) plus one of the slot mapping.

**Timing.** Host: `perf_counter_ns` around the whole step, steps pipelined (no
synchronisation between them; CUDA event records subtracted). GPU interval: CUDA events
around the replay for graphalloc, around the whole step for the baselines (their launches
interleave with host work, so their interval includes the gaps the host leaves: read their
busy time for device work). GPU busy: torch.profiler (CUPTI) over the profiled window, the
union of device activity per step (a mean). Launches: the same profile. Syncs: torch's
sync debug mode "warn" over the measured steps. The floor is an empty Triton kernel in a
CUDA graph, replayed after a 20 us host pause (so it starts on an idle device, like a step's
replay after planning), timed by the same events. Medians and p90 over the measured steps;
per step class (prefill / release / decode+evict / decode) in the JSON. Ratios are
baseline / graphalloc of the medians.

**Agreement.** Every step, every implementation's FULL and SWA pages allocated and freed
(graphalloc: `PlannedStep.pages_allocated` / `pages_freed`; the baselines: what they
popped and pushed) equal the trace's model; any difference fails the configuration. Page
ids differ by design. After the run each implementation's device state is checked against
its host (graphalloc `check()` + `audit()` where the tables are small enough; the
baselines: distinct free pages, conservation, mapped slots, the uploaded block table).

**Prefix caching** (`--prefix-cache system-prompt|multi-turn`, `sched_prefix.py`):
requests carry token ids. `system-prompt`: 4 shared prompts of 1024 tokens (64 with
`--quick`), each request one of them plus its own user tokens (the drawn prompt length),
every request's own part starting with a unique token. `multi-turn`: conversations whose
turn k + 1 (arriving when turn k finishes, with probability 3/4, ahead of new
conversations as SGLang's cache-aware LPM policy would order it) resends turn k's prompt
and output plus new user tokens (log-normal, median prompt_median / 4). The trace decides
every admission's hit with a cache that never evicts: the longest prefix of whole pages an
earlier request computed and an earlier step inserted, at most the prompt less one token.
Inserts follow graphalloc's one-step timing, the same as an engine that processes a
step's results after scheduling the next (SGLang's overlap scheduler): a chunk's pages
are inserted in the step after the chunk (an insert is a `take` at the start of a step:
it holds only pages an earlier step allocated), a finished request's at its release, and
a page is hit from the step after its insert (a handle taken in a step is admitted on from
the next: the planner refuses a handle written in its own step). A request whose prefix
another request is still computing, or has not yet inserted, waits (SGLang's in-batch
prefix check), so no page is computed twice.
Expected hit rate (hit tokens / prompt tokens of the admissions, stated per
configuration, whole trace / measured steps): system prompts about 1024 / (1024 + mean
user prompt), 0.57-0.63 / 0.64 at W = 128 (B = 1: 0.23 / 0.32, its first requests miss)
and 0.20-0.26 / 0.26-0.53 at W = 4096; multi-turn grows as conversations reach later
turns, 0.36-0.56 / 0.59-0.71 at W = 128 and 0.10-0.23 / 0.49-0.79 at W = 4096. At
B = 1, W = 4096 no request is admitted within the run (outputs of ~1400 tokens): 0.
Every implementation runs with its cache on. **SGLang-style** with an
SWA radix tree (`sched_sglang_radix.py`, `sched_sglang_prefix.py`: match_prefix on whole
pages with the tombstone-window rule, cache_unfinished_req after every chunk,
cache_finished_req at release, FULL and SWA lock refs, LRU eviction of unlocked leaves,
SWA tombstoning first when only SWA is short); **vLLM-style** with prefix caching
(`sched_vllm_blocks.py`: chained block hashes, a hash -> block map, reference counts,
freed cached blocks kept in the LRU free queue until a popleft reuses them,
get_computed_blocks on the prompt less its last token, the SWA hit from the right,
cache_blocks after allocation). **graphalloc** with its own prefix cache
(`HybridAllocator(prefix_cache=True)`, `max_handles` = the trace's inserts, at most the
FULL pool): in the iteration's one step, every released request's whole pages and every
request that extended in the previous step are inserted as a `take` of the lowest free
handle (skipped when `cache.lookup` finds that prefix; `cache.add_entry` once the step
ran), a new request's prompt less its last token is matched (`cache.match`, window-aware:
a hit needs an entry holding the SWA pages of the window before it) and a hit admitted on
its handle (`admit_on`, the prefix's pages shared, only the rest prefilled); when an
allocation is short the planner evicts unlocked entries inside the step (SWA tombstones
first, then LRU leaves). Page keys are hashed once per page (kept per request). Through
the seams the same cache is driven by `match_prefix` / `cache_unfinished_req` /
`cache_finished_req` (SGLang) and `get_computed_blocks` / `cache_blocks` / `free(rid,
token_ids)` (vLLM), which keep a request's page keys too (each page hashed once). Pools: every
implementation gets every page the cached replay allocates (+2%), so nothing is evicted,
and one extra small-pool configuration (the peak without a cache + 2%; B = 64, 300 steps)
in which the caches fill and evict. Both pools get the FULL size: with a smaller SWA pool
the SGLang-style cache can need more SWA pages than a replay without a cache (its SWA
locks cover whole tree nodes, e.g. a shared system prompt's while any request on it
runs; SGLang's optional leaf split and early lock release address this) and would have
to retract requests, which the trace cannot model. In the small pool graphalloc cannot
evict an entry its own step takes (a finished request inserted as it is released): when
a step is refused for pages, its inserts and frees run first as a step of their own, then
the rest (`steps_per_iteration` 2 in the JSON's `verify`; 1 everywhere else).

**Agreement with prefix caching** (`sched_agreement.py`), every implementation at every
step: FULL and SWA pages allocated and FULL pages freed (content dropped: the partial last
page of each release) equal the trace's; per admitted request the hit tokens equal the
trace's; the FULL pool's (free, used, cached) pages are equal in all (graphalloc's from its
host mirror: used = pages a live request holds, cached = pages only cache handles hold);
free + used + cached = pool in each pool (no page lost). SWA frees and the SWA pool's
state are reported, not compared: SGLang frees a request's decode-window SWA pages (they
are not the tree's) and locks SWA by tree node, vLLM keeps every full SWA block cached in
its free queue, graphalloc keeps the SWA pages an entry took from its request's frontier.
Page ids are never compared. The multi-turn workload needs W mod ps in {0, 1} (true
here): otherwise a finished turn may have freed the SWA page its next turn's window
needs, which SGLang frees and vLLM keeps, and their hits differ. In the small-pool
configuration only conservation is required; the rest is reported (each engine evicts
different entries - vLLM reuses the least recently freed block even when cached, SGLang
evicts only when its free list is short, graphalloc tombstones SWA before it evicts
whole entries and evicts whole entries, not tree nodes - and a hit lost to eviction is
recomputed at admission).

**Not covered**: speculative decoding, preemption (the pools are sized so nothing is ever
refused), SGLang's overlap scheduler, the model's own work.
"""


def write_outputs(res: dict, out_dir: str, with_plots: bool) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    res["targets"] = targets(res)
    with open(os.path.join(out_dir, "bench_scheduler.json"), "w") as f:
        json.dump(res, f, indent=1)
    with open(os.path.join(out_dir, "bench_scheduler.md"), "w") as f:
        f.write(markdown(res))
    files = ["bench_scheduler.json", "bench_scheduler.md"]
    if with_plots:
        files += plot(res, out_dir)
    return files


# ---- run -----------------------------------------------------------------------------------
def parse_args(argv):
    ap = bench_parser(__doc__, os.path.join(REPO, "results", "bench", "scheduler"),
                      "graphalloc and baseline kernels: auto = Triton on CUDA, the Torch "
                      "twins on a CPU")
    for key in ("b", "ps", "window", "interval"):
        ap.add_argument(f"--{key}", help=f"comma-separated {key} values")
    for key in ("steps", "min-steps", "steps-1024", "warmup", "profile", "chunk", "seed"):
        ap.add_argument(f"--{key}", type=int)
    ap.add_argument("--impls", default=",".join(IMPLS),
                    help=f"comma-separated subset of {','.join(IMPLS)}")
    ap.add_argument("--sglang-decode", default="kernels", choices=("kernels", "torch_ops"),
                    help="the SGLang-style decode allocation: one kernel per pool (default) "
                         "or baselines.eager_decode_alloc's Torch ops")
    ap.add_argument("--prefix-cache", default=None, choices=PREFIX_WORKLOADS,
                    help="a prefix-caching workload: every implementation runs with its "
                         "prefix cache on (SGLang's radix cache, vLLM's prefix caching, "
                         "graphalloc's own); adds one small-pool configuration "
                         "(B = --small-pool-b) whose caches must evict")
    ap.add_argument("--small-pool-b", type=int, default=None,
                    help="B of the small-pool configuration with --prefix-cache (0: none)")
    ap.add_argument("--time-budget-s", type=float, default=None,
                    help="whole-run budget (default 200 s; 60 s with --quick)")
    ap.add_argument("--tokenspeed-path", default=None,
                    help="a directory (the site-packages of an environment where "
                         "tokenspeed-scheduler is installed) appended to sys.path to import "
                         "TokenSpeed's scheduler from; default: import it if installed here")
    ap.add_argument("--no-tokenspeed", action="store_true",
                    help="skip the TokenSpeed peer even when it is importable")
    ap.add_argument("--vllm-path", default=None,
                    help="a directory (the site-packages of an environment where vllm is "
                         "installed, e.g. by engines/vllm/install.sh) appended to sys.path "
                         "to import vLLM's KV-cache manager from; default: import it if "
                         "installed here")
    ap.add_argument("--no-vllm", action="store_true",
                    help="skip the vLLM peer even when it is importable")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)
    params = dict(QUICK if args.quick else FULL)
    for key in ("b", "ps", "window", "interval"):
        if getattr(args, key):
            params[key] = tuple(int(x) for x in getattr(args, key).split(","))
    for key in ("steps", "min_steps", "steps_1024", "warmup", "profile", "chunk", "seed"):
        if getattr(args, key) is not None:
            params[key] = getattr(args, key)
    args.impls = tuple(x for x in args.impls.split(",") if x)
    bad = [x for x in args.impls if x not in IMPLS]
    if bad or not args.impls:
        ap.error(f"--impls: unknown {bad}; choose from {IMPLS}")
    if args.time_budget_s is None:
        args.time_budget_s = 60.0 if args.quick else 200.0
    params["time_budget_s"] = args.time_budget_s
    params["sglang_decode"] = args.sglang_decode
    params["prefix"] = args.prefix_cache
    if args.small_pool_b is not None:
        params["small_pool_b"] = args.small_pool_b
    args.params = params
    return args


def main(argv=None) -> int:
    return bench_main(argv, parse_args, _run)


def _progress(items, enabled: bool):
    if not enabled:
        return items
    try:
        from tqdm import tqdm
        return tqdm(items, desc="bench_scheduler", unit="config", file=sys.stderr,
                    dynamic_ncols=True)
    except ImportError:
        print("[tqdm not installed: plain progress lines]", file=sys.stderr)
        return items


def _run(args, argv, device, backend, note) -> int:
    t_start = time.perf_counter()
    p = args.params
    ctx = Context(args, device, backend)
    res = {"command": " ".join(["python", os.path.relpath(__file__, REPO),
                                *sched_vllm_peer.placeholder_argv(
                                    sched_tokenspeed.placeholder_argv(argv))]),
           "machine": machine_info(device),
           "device_clock": "cuda-events" if ctx.is_cuda else "cpu-wall",
           "backend": backend, "backend_note": note, "impls": list(args.impls),
           "params": {k: list(v) if isinstance(v, tuple) else v for k, v in p.items()},
           "floor": None, "floor_end": None, "configs": [], "errors": [], "skipped": [],
           "targets": []}
    ctx.tokenspeed = not args.no_tokenspeed and sched_tokenspeed.load(args.tokenspeed_path)
    ctx.tokenspeed_why = ("--no-tokenspeed" if args.no_tokenspeed else sched_tokenspeed.REASON)
    ctx.vllm = not args.no_vllm and sched_vllm_peer.load(args.vllm_path)
    ctx.vllm_why = "--no-vllm" if args.no_vllm else sched_vllm_peer.REASON
    res["peers"] = {"tokenspeed": {"available": ctx.tokenspeed,
                                   "version": sched_tokenspeed.VERSION,
                                   "reason": "" if ctx.tokenspeed else ctx.tokenspeed_why},
                    "vllm": {"available": ctx.vllm, "version": sched_vllm_peer.VERSION,
                             "reason": "" if ctx.vllm else ctx.vllm_why}}
    if not ctx.tokenspeed:
        res["skipped"].append(f"TokenSpeed peer (its real scheduler): {ctx.tokenspeed_why}")
    if not ctx.vllm:
        res["skipped"].append(f"vLLM peer (its real KV-cache manager): {ctx.vllm_why}")
    try:
        res["floor"] = measure_floors(device, p["floor_samples"], flush=True)
    except Exception as exc:
        res["errors"].append({"case": "floor", "error": f"{type(exc).__name__}: {exc}",
                              "traceback": traceback.format_exc()})
    cases = [(b, ps, w, ei, "no-eviction") for b in p["b"] for ps in p["ps"]
             for w in p["window"] for ei in p["interval"]]
    if p.get("prefix") and p["small_pool_b"]:  # one configuration whose caches must evict
        cases.append((p["small_pool_b"], p["ps"][0], p["window"][0], p["interval"][0],
                      "small"))
    bar = _progress(cases, not args.no_progress)
    for i, (b, ps, w, ei, pool) in enumerate(bar):
        label = f"B={b} ps={ps} W={w} ei={ei}" + (" small pool" if pool == "small" else "")
        elapsed = time.perf_counter() - t_start
        left = args.time_budget_s - END_RESERVE_S - elapsed
        if left <= 0:
            res["skipped"].append(f"{label}: past --time-budget-s {args.time_budget_s:.0f}")
            continue
        share = left / (len(cases) - i)
        try:
            rec = run_config(ctx, b, ps, w, ei, share, pool)
            res["configs"].append(rec)
            for name, err in rec["driver_errors"].items():
                res["errors"].append({"case": f"{label} {name}", **err})
            msg = (f"{label}: host p50 " + ", ".join(
                f"{n} {_q(r['host_us'])}" for n, r in rec["impls"].items())
                + f" us; {rec['steps']['measured']} steps; same pages freed by "
                f"{len(rec['agreement']['impls'])} ({rec['agreement']['steps_compared']} "
                f"steps); {rec['wall_s']:.1f} s"
                + "".join(f"; {n} FAILED: {e['error']}" for n, e in
                          rec["driver_errors"].items()))
        except Exception as exc:
            res["errors"].append({"case": label, "error": f"{type(exc).__name__}: {exc}",
                                  "traceback": traceback.format_exc()})
            msg = f"{label}: FAILED {type(exc).__name__}: {exc}"
        if hasattr(bar, "write"):
            bar.write(msg, file=sys.stderr)
        else:
            print(msg, file=sys.stderr)
        if ctx.is_cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        res["wall_s"] = time.perf_counter() - t_start
        write_outputs(res, args.out, with_plots=False)  # partial results survive a kill
    try:
        res["floor_end"] = measure_floors(device, p["floor_samples"], flush=False)
    except Exception as exc:
        res["errors"].append({"case": "floor_end", "error": f"{type(exc).__name__}: {exc}"})
    res["wall_s"] = time.perf_counter() - t_start
    files = write_outputs(res, args.out, with_plots=not args.no_plot)
    print(f"wrote {', '.join(files)} into {args.out} in {res['wall_s']:.1f} s"
          + (f"; {len(res['errors'])} ERRORS" if res["errors"] else ""), file=sys.stderr)
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
