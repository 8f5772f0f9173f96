"""Attention page tables inside the step: what they add to it, against building them eagerly.

    python benchmarks/bench_page_tables.py --out results/bench/page-tables-instep-h200  # GPU
    python benchmarks/bench_page_tables.py --quick --out /tmp/bench_page_tables         # CPU

Engine scale: a decode batch of B lanes (B = 256 and 1024) over a 128k-token context
(``max_context_len = 131072``), page size 16, lengths lognormal around 16k tokens (clipped
to the context), a 4096-token window (the allocator's ``W - 1``), request rows in a random
lane order. Three allocators with one configuration are prefilled by the same chunked
extend steps (``alloc.step(evict_all=True, extend=...)``), so they hold the same pages, and
every round steps each once with the same decode step (``evict_all=True, decode=rows``),
in alternating order (drift hits all alike):

    step          (a) the allocator's step alone: ONE graph replay (``executor="graph"``)
    step_tables   (b) the same step with ``page_tables=PageTableSpec(B)``: FlashInfer's CSR
                  (kv_indptr, kv_indices, kv_last_page_len) AND block tables + seq_lens, for
                  FULL and SWA layers, written by one more kernel inside the same replay
    step_eager    (c) step (a), then the tables the way engines build them today, written
                  here from their documented behaviour in eager torch ops: the step's rows
                  and lengths to the device (one pinned H2D copy), pages per lane and
                  ``kv_indptr`` by cumsum, page ids gathered from ``req_to_token`` (columns
                  up to the batch's longest length, a host-known bound), scattered into
                  ``kv_indices`` and the block table, SWA ids translated through
                  ``full_to_swa`` from the window's page ``floor_page(L - W)`` (the engine's
                  window rule, no frontier), ``seq_lens``

Per round and variant: host time (``perf_counter`` around ``alloc.plan`` and around the
enqueue: the replay, plus filling the eager path's pinned input and launching its ops), and
device time (CUDA events around the enqueued work; before each interval a 256 MiB
L2-evicting write and a ``torch.cuda._sleep`` long enough to cover the host's enqueue, so
the interval holds device execution only, no idle gap; the device is drained before each
sample, so ``alloc.plan`` never waits for a descriptor buffer). p20/p50/p80 of 100 samples
after 10 warm-ups; the empty-graph floor alongside. Ratios in one run: ``b / a``, ``c / a``,
``c / b``, and what each way adds to the step (``b - a`` against ``c - a``), host and
device. After the rounds the in-step tables (b) must equal the eager ones (c), every
buffer (``outputs_equal``), and the host copies on ``PlannedStep.tables`` must equal both.

Writes ``bench_page_tables.json`` and ``bench_page_tables.md`` into ``--out``. Without
CUDA (``--quick``) the same code runs eagerly on the Torch twins at tiny sizes: device
times are CPU wall clock of the eager work (``"device_clock": "cpu-wall"``).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if HERE not in sys.path:
    sys.path.insert(0, HERE)
from timing import (  # noqa: E402
    Sampler,
    bench_main,
    bench_parser,
    count_launches,
    format_quantiles,
    graph_nodes,
    machine_info,
    measure_floor,
    summarize,
)

FULL = dict(b=(256, 1024), ps=16, max_context=131072, window=4096, median_len=16384,
            sigma=1.0, samples=100, warmup=10, flush_mib=256, sleep_us=3000,
            prefill_step_tokens=1 << 20, prefill_row_tokens=1 << 17)
QUICK = dict(b=(4, 8), ps=16, max_context=512, window=48, median_len=96, sigma=0.8,
             samples=3, warmup=1, flush_mib=0, sleep_us=0, prefill_step_tokens=512,
             prefill_row_tokens=256)
VARIANTS = ("step", "step_tables", "step_eager")
TABLES = ("full_kv_indptr", "full_kv_indices", "full_kv_last_page_len", "swa_kv_indptr",
          "swa_kv_indices", "swa_kv_last_page_len", "full_block_table", "swa_block_table",
          "seq_lens")


def progress(total, desc: str, enabled: bool):
    """A tqdm bar on stderr, or None (disabled, or tqdm not installed)."""
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, leave=False, file=sys.stderr)


# ---- the workload ---------------------------------------------------------------------------
class EngineState:
    """Three allocators of one configuration, prefilled alike: ``allocs[v]`` for each
    variant (``step_tables``' with ``page_tables=PageTableSpec(B)``: both forms, both layer
    kinds). ``rows``: the decode batch (every admitted row, a random lane order);
    ``lengths``: their prompt lengths. Cost: the prefill, ``sum(lengths)`` tokens per
    allocator in steps of at most ``prefill_step_tokens``."""

    def __init__(self, b: int, p: dict, device: torch.device, backend: str, seed: int,
                 bar=None):
        import graphalloc as ga

        ps, ctx, W = p["ps"], p["max_context"], p["window"]
        rng = np.random.default_rng(seed)
        self.n_rounds = p["warmup"] + p["samples"] + 4
        top = ctx - self.n_rounds - 2 * ps  # room for every round's decode token
        lens = np.exp(rng.normal(np.log(p["median_len"]), p["sigma"], b)).round()
        self.lengths = np.clip(lens, ps, top).astype(np.int64)
        row_tokens = min(p["prefill_row_tokens"], p["prefill_step_tokens"])
        full_pages = int((-(-(self.lengths + self.n_rounds) // ps)).sum()) + 2 * b
        # SWA: every row's window after the step's eviction, plus one step's new tokens
        swa_pages = b * (-(-W // ps) + 3) + -(-p["prefill_step_tokens"] // ps) + b
        self.cfg = ga.AllocatorConfig(
            page_size=ps, max_reqs=b, max_context_len=ctx, num_full_pages=full_pages,
            num_swa_pages=swa_pages, model_window=W, device=device, backend=backend,
            index_dtype=torch.int32, max_tokens_per_alloc_row=row_tokens,
            max_step_tokens=p["prefill_step_tokens"] + b)
        self.spec = ga.PageTableSpec(max_batch=b)  # CSR + block tables, FULL + SWA
        self.allocs = {v: ga.HybridAllocator(
            self.cfg, executor="graph", page_tables=self.spec if v == "step_tables" else None)
            for v in VARIANTS}
        self.rows = None
        for alloc in self.allocs.values():
            rows = np.array([alloc.admit() for _ in range(b)], dtype=np.int64)
            assert self.rows is None or np.array_equal(rows, self.rows)
            self.rows = rows
        self.n_prefill_steps = self._prefill(p, row_tokens, bar)
        self.rows = rng.permutation(self.rows)  # the decode batch's lane order
        self.tables = self.allocs["step_tables"].tables

    def _prefill(self, p: dict, row_tokens: int, bar) -> int:
        """Chunked extend steps, the same on every allocator; returns their count."""
        done = np.zeros(len(self.rows), dtype=np.int64)
        n_steps = 0
        while (done < self.lengths).any():
            rows, ns, budget = [], [], p["prefill_step_tokens"]
            for i in np.flatnonzero(done < self.lengths):
                n = int(min(self.lengths[i] - done[i], row_tokens, budget))
                if n <= 0:
                    break
                rows.append(int(self.rows[i]))
                ns.append(n)
                done[i] += n
                budget -= n
            for alloc in self.allocs.values():
                alloc.step(evict_all=True, extend=(rows, ns))
            n_steps += 1
            if bar is not None:
                bar.update(1)
        return n_steps

    def seq_lens(self) -> np.ndarray:
        """The batch's lengths (every allocator holds the same)."""
        return self.allocs["step"].seq_lens()[self.rows]


class EagerTables:
    """Case (c): the tables built the way engines build them today, in eager torch ops,
    after the allocator's step, from its ``req_to_token`` / ``full_to_swa`` and the step's
    host-known rows and lengths.

    Buffers (allocated once, the in-step tables' shapes): ``host_in`` ``[2, B]`` int64
    (pinned on CUDA: rows, lengths); CSR ``*_indptr`` ``[B+1]``, ``*_indices``
    ``[capacity + 1]`` (the last entry: a scratch the masked scatter writes into),
    ``*_last`` ``[B]``; block tables ``[B, width]``; ``seq_lens`` ``[B]``; int32. ``run``
    is about 40 launches whose columns reach the batch's longest length (``n_cols``, host
    known); it never reads the device on the host.
    """

    def __init__(self, alloc, spec, device: torch.device, window: int):
        self.alloc, self.device, self.window = alloc, device, window
        b, ps = spec.max_batch, alloc.config.page_size
        self.b, self.ps, self.width = b, ps, spec.max_pages_per_req
        self.full_cap, self.swa_cap = spec.max_full_indices, spec.max_swa_indices
        self.host_in = torch.zeros(2, b, dtype=torch.int64, pin_memory=device.type == "cuda")
        self.host_np = self.host_in.numpy()
        self.n_cols = self.width
        self.cols = torch.arange(self.width, device=device)

        def i32(*shape):
            return torch.zeros(shape, dtype=torch.int32, device=device)

        self.full_kv_indptr, self.full_kv_indices = i32(b + 1), i32(self.full_cap + 1)
        self.swa_kv_indptr, self.swa_kv_indices = i32(b + 1), i32(self.swa_cap + 1)
        self.full_kv_last_page_len, self.swa_kv_last_page_len = i32(b), i32(b)
        self.full_block_table, self.swa_block_table = i32(b, self.width), i32(b, self.width)
        self.seq_lens = i32(b)

    def fill(self, rows: np.ndarray, seq_lens: np.ndarray) -> None:
        """Host: the step's rows and lengths into the pinned input; the column bound."""
        self.host_np[0] = rows
        self.host_np[1] = seq_lens
        self.n_cols = int(-(-int(seq_lens.max()) // self.ps))

    def run(self) -> None:
        ps, W, n = self.ps, self.window, self.n_cols
        r2t, f2s = self.alloc.req_to_token, self.alloc.full_to_swa
        dev_in = self.host_in.to(self.device, non_blocking=True)
        rows, L = dev_in[0], dev_in[1]
        cols = self.cols[:n]
        # FULL: pages of [0, L); kv_indptr by cumsum, ids gathered from req_to_token
        n_full = (L + ps - 1) // ps
        self.full_kv_indptr[1:].copy_(torch.cumsum(n_full, 0))
        in_full = cols[None, :] < n_full[:, None]
        full = torch.where(in_full, r2t[rows[:, None], cols[None, :] * ps].long() // ps, 0)
        dst = torch.where(in_full, self.full_kv_indptr[:-1, None].long() + cols, self.full_cap)
        self.full_kv_indices.scatter_(0, dst.view(-1), full.view(-1).int())
        last = L - (n_full - 1) * ps
        self.full_kv_last_page_len.copy_(last)
        self.full_block_table[:, :n].copy_(full)
        self.full_block_table[:, n:].zero_()
        # SWA: pages of [floor_page(max(L - W, 0)), L), translated through full_to_swa
        first = (L - W).clamp(min=0) // ps
        n_swa = n_full - first
        self.swa_kv_indptr[1:].copy_(torch.cumsum(n_swa, 0))
        in_swa = in_full & (cols[None, :] >= first[:, None])
        swa = torch.where(in_swa, f2s[full * ps].long() // ps, 0)
        dst = torch.where(in_swa, self.swa_kv_indptr[:-1, None].long() + cols - first[:, None],
                          self.swa_cap)
        self.swa_kv_indices.scatter_(0, dst.view(-1), swa.view(-1).int())
        self.swa_kv_last_page_len.copy_(torch.where(n_swa > 0, last, 0))
        self.swa_block_table[:, :n].copy_(swa)
        self.swa_block_table[:, n:].zero_()
        self.seq_lens.copy_(L)


def compare_tables(tables, eager: EagerTables, planned) -> dict:
    """Every in-step buffer against the eager one (``kv_indices`` up to ``indptr[B]``),
    and the step's host copies against both. ``{name: equal}``."""
    out = {}
    n = {"full": planned.n_full_pages, "swa": planned.n_swa_pages}
    for name in TABLES:
        mine = getattr(tables, name + "_buf").cpu()
        theirs = getattr(eager, name).cpu()
        if name.endswith("indices"):
            k = n[name.split("_")[0]]
            mine, theirs = mine[:k], theirs[:k]
        out[name] = bool(torch.equal(mine, theirs))
    for name in ("full_kv_indptr", "full_kv_last_page_len", "swa_kv_indptr",
                 "swa_kv_last_page_len", "seq_lens"):
        out[name + "_host"] = bool(torch.equal(getattr(planned, name + "_host"),
                                               getattr(eager, name).cpu()))
    return out


# ---- one case -------------------------------------------------------------------------------
def measure_case(ctx, b: int) -> dict:
    p, dev = ctx.params, ctx.device
    t0 = time.perf_counter()
    bar = progress(None, f"B={b}: prefill steps", ctx.show)
    st = EngineState(b, p, dev, ctx.backend, seed=1000 + b, bar=bar)
    if bar is not None:
        bar.close()
    setup_s = time.perf_counter() - t0
    eager = EagerTables(st.allocs["step_eager"], st.spec.resolve(st.cfg), dev, p["window"])
    cuda, sampler = ctx.is_cuda, ctx.sampler
    host = {v: {"plan": [], "enqueue": []} for v in VARIANTS}
    device_us = {v: [] for v in VARIANTS}
    pairs: dict[str, list] = {v: [] for v in VARIANTS}
    planned = {}
    n_rounds = p["warmup"] + p["samples"]
    bar = progress(n_rounds, f"B={b}: rounds", ctx.show)
    for i in range(n_rounds):
        for v in (VARIANTS if i % 2 == 0 else VARIANTS[::-1]):
            alloc = st.allocs[v]
            sampler.sync()  # an empty queue: plan() never waits for a descriptor buffer
            h0 = time.perf_counter_ns()
            pl = alloc.plan(evict_all=True, decode=st.rows)
            h1 = time.perf_counter_ns()
            if cuda:
                sampler.flush()
                torch.cuda._sleep(ctx.sleep_cycles)  # covers the enqueue below
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
            h2 = time.perf_counter_ns()
            alloc.run(pl)
            if v == "step_eager":
                eager.fill(st.rows, alloc.seq_lens()[st.rows])
                eager.run()
            h3 = time.perf_counter_ns()
            if cuda:
                end.record()
            else:
                wall = (h3 - h2) / 1e3
            planned[v] = pl
            if i >= p["warmup"]:
                host[v]["plan"].append((h1 - h0) / 1e3)
                host[v]["enqueue"].append((h3 - h2) / 1e3)
                if cuda:
                    pairs[v].append((start, end))
                else:
                    device_us[v].append(wall)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    sampler.sync()
    if cuda:
        device_us = {v: [s.elapsed_time(e) * 1e3 for s, e in pairs[v]] for v in VARIANTS}
    same_state = all(np.array_equal(st.allocs[v].seq_lens(), st.allocs["step"].seq_lens())
                     for v in VARIANTS)
    equal = compare_tables(st.tables, eager, planned["step_tables"].tables)
    for alloc in st.allocs.values():
        alloc.check()
    gpu = {v: summarize(device_us[v]) for v in VARIANTS}
    host_total = {v: summarize(np.add(host[v]["plan"], host[v]["enqueue"])) for v in VARIANTS}
    host_plan = {v: summarize(host[v]["plan"]) for v in VARIANTS}

    def p50(stats, v):
        s = stats.get(v)
        return s["p50"] if s else None

    def ratios(stats):
        a, tb, c = (p50(stats, v) for v in VARIANTS)
        div = (lambda x, y: x / y if x is not None and y else None)
        return {"step_tables / step": div(tb, a), "step_eager / step": div(c, a),
                "step_eager / step_tables": div(c, tb),
                "added by tables (b - a)": None if tb is None else tb - a,
                "added by eager (c - a)": None if c is None else c - a,
                "eager added / tables added": div(c - a if c is not None else None,
                                                  tb - a if tb is not None else None)}

    lens = st.seq_lens()
    planned_tables = planned["step_tables"].tables
    nodes = None
    if cuda:
        nodes = {v: graph_nodes(st.allocs[v].executor.graphs[0])  # buffer 0's full grid
                 for v in ("step", "step_tables")}
    return {
        "b": b, "ps": p["ps"], "setup_s": setup_s, "prefill_steps": st.n_prefill_steps,
        "lengths": {"min": int(lens.min()), "p50": float(np.median(lens)),
                    "mean": float(lens.mean()), "max": int(lens.max())},
        "pages": {"full": int(planned_tables.n_full_pages),
                  "swa": int(planned_tables.n_swa_pages)},
        "eager_columns": eager.n_cols, "same_allocator_state": same_state,
        "outputs_equal": all(equal.values()) and same_state, "buffers_equal": equal,
        "gpu_us": gpu, "host_us": host_total, "host_plan_us": host_plan,
        "ratios": {"device": ratios(gpu), "host": ratios(host_total)},
        # kernels per eager build (torch.profiler; on CUDA only: on a CPU it would count aten
        # ops, and importing the profiler costs seconds)
        "eager_launches": count_launches(eager.run, cuda) if cuda else None,
        "graph_nodes": nodes,
    }


# ---- reporting ------------------------------------------------------------------------------
def _fmt(x, digits=3):
    if x is None:
        return "-"
    return f"{x:.{digits}g}" if abs(x) < 1000 else f"{x:.0f}"


def markdown(res: dict) -> str:
    clock, p = res["device_clock"], res["params"]
    unit = "GPU us" if clock == "cuda-events" else "CPU wall us (no CUDA)"
    lines = [
        "# bench_page_tables: the attention page tables inside the step", "",
        f"Command: `{res['command']}`  ",
        f"Machine: {res['machine']['summary']}  ",
        f"Device clock: {clock}; backend: {res['backend']}; page size {p['ps']}, context "
        f"{p['max_context']}, window {p['window']}, lengths lognormal around "
        f"{p['median_len']} (sigma {p['sigma']}); {p['samples']} samples after "
        f"{p['warmup']} warm-ups", "",
        "One decode step of B lanes. (a) `step`: the allocator's step alone, one graph "
        "replay; (b) `step_tables`: the same step writing FlashInfer CSR + block tables, "
        "FULL + SWA, in the same replay; (c) `step_eager`: step (a), then the same tables "
        f"built by eager torch ops (engines today). p50, p20-p80 in the JSON; {unit}.", "",
        "| B | FULL / SWA pages | device a / b / c | device b/a, c/a, c/b | device added: "
        "tables (b-a) vs eager (c-a) | host a / b / c | host b/a, c/a, c/b | host added: "
        "b-a vs c-a | same tables |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["cases"]:
        g, h = r["gpu_us"], r["host_us"]
        rd, rh = r["ratios"]["device"], r["ratios"]["host"]

        def three(stats):
            return " / ".join(_fmt(stats[v]["p50"]) if stats.get(v) else "-"
                              for v in VARIANTS)

        def rat(q):
            return ", ".join(_fmt(q[k]) + "x" if q[k] is not None else "-" for k in (
                "step_tables / step", "step_eager / step", "step_eager / step_tables"))

        def added(q):
            return (f"{_fmt(q['added by tables (b - a)'])} vs "
                    f"{_fmt(q['added by eager (c - a)'])}")

        lines.append(f"| {r['b']} | {r['pages']['full']} / {r['pages']['swa']} | {three(g)} "
                     f"| {rat(rd)} | {added(rd)} | {three(h)} | {rat(rh)} | {added(rh)} "
                     f"| {r['outputs_equal']} |")
    lines += ["", "Per case: lengths, eager launches, graph nodes:", ""]
    for r in res["cases"]:
        ln, launches = r["lengths"], r["eager_launches"] or {}
        what = (f"{launches['kernels']} kernels" if launches.get("kernels") is not None
                else "(launches counted on CUDA only)")
        lines.append(f"* B={r['b']}: lengths {ln['min']}-{ln['max']} (p50 {ln['p50']:.0f}), "
                     f"{r['prefill_steps']} prefill steps ({r['setup_s']:.1f} s); eager "
                     f"tables {what} over {r['eager_columns']} columns; host plan p50 a/b/c "
                     + " / ".join(_fmt(r["host_plan_us"][v]["p50"]) for v in VARIANTS)
                     + (f"; graph nodes {r['graph_nodes']}" if r["graph_nodes"] else ""))
    if res["floor"]:
        lines += ["", f"Floor ({res['floor']['kernel']}): device "
                  f"{format_quantiles(res['floor']['gpu_us'])} us, host "
                  f"{format_quantiles(res['floor']['cpu_us'])} us"]
    if res["skipped"]:
        lines += ["", "Skipped: " + "; ".join(res["skipped"])]
    if res["errors"]:
        lines += ["", "Errors: " + "; ".join(f"{e['case']}: {e['error']}"
                                             for e in res["errors"])]
    return "\n".join(lines) + "\n"


# ---- run ------------------------------------------------------------------------------------
class Context:
    def __init__(self, params: dict, device: torch.device, backend: str, show: bool):
        self.params, self.device, self.backend, self.show = params, device, backend, show
        self.is_cuda = device.type == "cuda"
        self.sampler = Sampler(device, n_samples=params["samples"], n_warmup=params["warmup"],
                               flush_mib=params["flush_mib"])
        self.sleep_cycles = 0
        if self.is_cuda and params["sleep_us"] > 0:
            self.sleep_cycles = _sleep_cycles(params["sleep_us"])


def _sleep_cycles(us: float) -> int:
    """Cycles of ``torch.cuda._sleep`` that keep the GPU busy about ``us`` microseconds."""
    cycles = 1_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(cycles)  # warm
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return int(us / max(start.elapsed_time(end) * 1e3 / cycles, 1e-9))


def parse_args(argv):
    ap = bench_parser(__doc__, os.path.join(REPO, "results", "bench", "page-tables"),
                      "graphalloc backend: auto = Triton on CUDA, the Torch twins on a CPU")
    ap.add_argument("--b", help="comma-separated lane counts (default 256,1024)")
    for key in ("ps", "max-context", "window", "median-len", "samples", "warmup",
                "flush-mib", "sleep-us", "prefill-step-tokens", "prefill-row-tokens"):
        ap.add_argument(f"--{key}", type=int)
    ap.add_argument("--sigma", type=float, help="lognormal sigma of the lengths")
    ap.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = ap.parse_args(argv)
    params = dict(QUICK if args.quick else FULL)
    if args.b:
        params["b"] = tuple(int(x) for x in args.b.split(","))
    for key in ("ps", "max_context", "window", "median_len", "samples", "warmup", "flush_mib",
                "sleep_us", "prefill_step_tokens", "prefill_row_tokens", "sigma"):
        if getattr(args, key) is not None:
            params[key] = getattr(args, key)
    if params["max_context"] % params["ps"]:
        ap.error("--max-context must be a multiple of --ps")
    if params["window"] < 2 or params["median_len"] < 1:
        ap.error("--window must be >= 2 and --median-len >= 1")
    args.params = params
    return args


def main(argv=None) -> int:
    return bench_main(argv, parse_args, _run)


def _run(args, argv, device, backend, note) -> int:
    p = args.params
    ctx = Context(p, device, backend, show=not args.no_progress)
    res = {"benchmark": "page tables inside the step (a: step, b: step + tables, c: step + "
                        "eager tables)",
           "command": " ".join(["python", os.path.relpath(__file__, REPO), *argv]),
           "machine": machine_info(device), "device_clock": ctx.sampler.clock,
           "backend": backend, "backend_note": note,
           "params": {k: list(v) if isinstance(v, tuple) else v for k, v in p.items()},
           "floor": None, "cases": [], "errors": [], "skipped": []}
    if not ctx.is_cuda:
        res["skipped"].append("GPU-only parts (no CUDA device): graphs, CUDA events, the L2 "
                              "flush and sleep; device times are CPU wall clock")
    t_start = time.perf_counter()
    try:
        res["floor"] = measure_floor(ctx.sampler)
    except Exception as exc:
        res["errors"].append({"case": "floor", "error": f"{type(exc).__name__}: {exc}",
                              "traceback": traceback.format_exc()})
    for b in p["b"]:
        label = f"B={b}"
        t0 = time.perf_counter()
        try:
            rec = measure_case(ctx, b)
            rec["wall_s"] = time.perf_counter() - t0
            res["cases"].append(rec)
            g = rec["gpu_us"]
            print(f"{label}: device us p50 step {_fmt(g['step']['p50'])}, step_tables "
                  f"{_fmt(g['step_tables']['p50'])}, step_eager {_fmt(g['step_eager']['p50'])}"
                  f"; same tables {rec['outputs_equal']} ({rec['wall_s']:.1f} s)",
                  file=sys.stderr)
            if not rec["outputs_equal"]:
                res["errors"].append({"case": label, "error": "the in-step tables and the "
                                      "eager ones differ: " + json.dumps(rec["buffers_equal"])})
        except Exception as exc:
            res["errors"].append({"case": label, "error": f"{type(exc).__name__}: {exc}",
                                  "traceback": traceback.format_exc()})
            print(f"{label}: FAILED {type(exc).__name__}: {exc}", file=sys.stderr)
        ctx.sampler.release_memory()  # the case's allocators and graphs are gone
    res["wall_s"] = time.perf_counter() - t_start
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_page_tables.json"), "w") as f:
        json.dump(res, f, indent=1)
    with open(os.path.join(args.out, "bench_page_tables.md"), "w") as f:
        f.write(markdown(res))
    print(f"wrote {args.out}/bench_page_tables.json, .md in {res['wall_s']:.1f} s",
          file=sys.stderr)
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
