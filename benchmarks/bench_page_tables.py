"""Attention page tables: the GPU time they add to a step, against building them eagerly.

    python benchmarks/bench_page_tables.py --out results/bench/page-tables-h200  # GPU, ~1 min
    python benchmarks/bench_page_tables.py --quick --out /tmp/bench_page_tables      # CPU smoke run

One attention batch of B lanes (B in {1, 64, 256, 1024}) x page size {16, 64}, over the
allocator tables it reads (``req_to_token`` ``[2B, 8192]`` and ``full_to_swa``, int32,
built directly, page-dense, on random page ids): lengths lognormal around 2048 tokens
(clipped to [1, 8192]), a 1024-token window, SWA frontiers at the window's page or lagging
up to two pages behind it (eviction not run yet), request rows in a random lane order.
Per case, timed alternately in one sample loop (so drift hits all alike):

    tables_csr    graphalloc's page tables, FULL + SWA CSR (kv_indptr, kv_indices,
                  kv_last_page_len): ONE replay of a graph holding ``PageTables.launch``
    tables_all    the same with the block-table form too (block tables + seq_lens)
    eager         the way engines build the CSR tables today, reimplemented here: from the
                  step's pinned host rows and lengths, one H2D copy, then eager torch ops --
                  page count and indptr by cumsum, page ids gathered from req_to_token with
                  torch indexing, scattered into kv_indices, translated through full_to_swa
                  and masked to the window for SWA (about 30 launches; fixed-shape and
                  sync-free, so it never waits for the host)
    eager_graph   those same eager ops captured in one CUDA graph (GPU only)
    floor         an empty Triton kernel in a graph (``timing.empty_graph``)

GPU time: CUDA events around the call, a 256 MiB L2-evicting write before every sample
(outside the interval); medians (p50) of 100 samples after 10 warm-ups, p20/p80 in the JSON.
``tables_csr - floor`` estimates what one more kernel node costs inside a step graph that
already runs (the tables' true cost in the decode step). Host time: ``PageTables.plan`` +
replay + ``mark_submitted`` for the tables; filling the pinned inputs + enqueueing the ops
for the eager baseline. Every case checks that the eager baseline and the page tables
write the same CSR tables (``outputs_equal``).

Writes ``bench_page_tables.json``, ``bench_page_tables.md`` and (with matplotlib)
``bench_page_tables.png`` into ``--out``. Without CUDA (``--quick``) everything runs
eagerly on the Torch twins: device times are CPU wall clock (``"device_clock":
"cpu-wall"``), not GPU intervals, and ``eager_graph`` is skipped.
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
from figures import plot_page_tables  # noqa: E402
from timing import (  # noqa: E402
    Sampler,
    bench_main,
    bench_parser,
    count_launches,
    empty_graph,
    format_quantiles,
    graph_nodes,
    machine_info,
    measure_floor,
    replayable,
    summarize,
)

FULL = dict(b=(1, 64, 256, 1024), ps=(16, 64), max_context=8192, window=1024,
            median_len=2048, samples=100, warmup=10, flush_mib=256)
QUICK = dict(b=(1, 8), ps=(16,), max_context=256, window=48, median_len=96, samples=3,
             warmup=1, flush_mib=0)
IMPLS = ("tables_csr", "tables_all", "eager", "eager_graph", "floor")


# ---- the workload -------------------------------------------------------------------------
class TableWorkload:
    """One attention batch and the allocator tables it reads, built directly on the host.

    ``n_reqs = 2B`` request rows; the batch is B of them (``rows``, a random lane order).
    Row r's positions ``[0, L)`` sit on ``ceil(L / ps)`` distinct FULL pages
    (``req_to_token[r, t] = page * ps + t % ps``); its pages from the frontier's on are
    mapped page-densely to distinct SWA pages (``full_to_swa``), the rest map to 0. The
    frontier ``f = floor_page(max(L - W, 0)) - lag * ps`` (lag 0..2 pages, >= 0) never passes
    ``L - W``, so the SWA tables start at ``floor_page(max(L - W, 0))``, as an engine's
    window rule computes without the frontier.
    """

    def __init__(self, b: int, ps: int, max_context: int, window: int, median_len: int,
                 device: torch.device, seed: int):
        rng = np.random.default_rng(seed)
        self.b, self.ps, self.window, self.max_context = b, ps, window, max_context
        self.n_reqs = 2 * b
        lens = np.exp(rng.normal(np.log(median_len), 0.8, self.n_reqs)).round()
        self.seq_len = np.clip(lens, 1, max_context).astype(np.int64)
        lag = rng.integers(0, 3, self.n_reqs)
        win_page = np.maximum(self.seq_len - window, 0) // ps
        self.frontier = np.maximum(win_page - lag, 0) * ps
        self.rows = rng.permutation(self.n_reqs)[:b].astype(np.int64)

        L, f = self.seq_len[self.rows], self.frontier[self.rows]
        n_full = -(-L // ps)
        first = f // ps
        total_full = int(n_full.sum())
        page_row = np.repeat(self.rows, n_full)  # one entry per FULL page of the batch
        page_col = np.arange(total_full) - np.repeat(np.cumsum(n_full) - n_full, n_full)
        full_page = rng.permutation(total_full) + 1  # page 0 is the sink
        off = np.arange(ps)
        r2t = np.zeros((self.n_reqs, max_context), dtype=np.int32)
        r2t[page_row[:, None], page_col[:, None] * ps + off] = full_page[:, None] * ps + off
        in_swa = page_col >= np.repeat(first, n_full)
        swa_page = rng.permutation(int(in_swa.sum())) + 1
        f2s = np.zeros((total_full + 1) * ps, dtype=np.int32)
        f2s[full_page[in_swa][:, None] * ps + off] = swa_page[:, None] * ps + off
        self.n_full_pages, self.n_swa_pages = total_full, int(in_swa.sum())
        self.req_to_token = torch.from_numpy(r2t).to(device)
        self.full_to_swa = torch.from_numpy(f2s).to(device)


class EagerTables:
    """The eager baseline: FlashInfer CSR tables for FULL and SWA layers from the step's
    host rows and lengths, the way engines build them today (torch ops, one launch each).

    Buffers (allocated once): ``host_in`` ``[2, B]`` int64 (pinned on CUDA: rows, lengths);
    ``*_indptr`` ``[B+1]``, ``*_indices`` ``[capacity + 1]`` (the last entry is a scratch
    the masked scatter writes into), ``*_last`` ``[B]``, int32.
    """

    def __init__(self, wl: TableWorkload, device: torch.device):
        self.wl, self.device = wl, device
        b, ps = wl.b, wl.ps
        self.max_pages = wl.max_context // ps
        self.full_cap = b * self.max_pages
        self.swa_cap = b * min(self.max_pages, -(-wl.window // ps) + 1)
        self.host_in = torch.zeros(2, b, dtype=torch.int64, pin_memory=device.type == "cuda")
        self.host_np = self.host_in.numpy()
        self.cols = torch.arange(self.max_pages, device=device)
        self.col_slots = self.cols * ps

        def i32(n):
            return torch.zeros(n, dtype=torch.int32, device=device)

        self.full_indptr, self.full_indices, self.full_last = (
            i32(b + 1), i32(self.full_cap + 1), i32(b))
        self.swa_indptr, self.swa_indices, self.swa_last = (
            i32(b + 1), i32(self.swa_cap + 1), i32(b))

    def fill(self) -> None:
        """Host: the step's rows and lengths into the pinned input."""
        self.host_np[0] = self.wl.rows
        self.host_np[1] = self.wl.seq_len[self.wl.rows]

    def run(self) -> None:
        wl, ps, cols = self.wl, self.wl.ps, self.cols
        dev_in = self.host_in.to(self.device, non_blocking=True)
        rows, L = dev_in[0], dev_in[1]
        # FULL: pages of [0, L)
        n_full = (L + ps - 1) // ps
        self.full_indptr[1:].copy_(torch.cumsum(n_full, 0))
        in_full = cols[None, :] < n_full[:, None]
        full = wl.req_to_token[rows[:, None], self.col_slots[None, :]].long() // ps
        dst = torch.where(in_full, self.full_indptr[:-1, None].long() + cols, self.full_cap)
        self.full_indices.scatter_(0, dst.view(-1), full.view(-1).int())
        last = L - (n_full - 1) * ps
        self.full_last.copy_(last)
        # SWA: pages of [floor_page(max(L - W, 0)), L), translated through full_to_swa
        first = (L - wl.window).clamp(min=0) // ps
        n_swa = n_full - first
        self.swa_indptr[1:].copy_(torch.cumsum(n_swa, 0))
        in_swa = in_full & (cols[None, :] >= first[:, None])
        swa = wl.full_to_swa[torch.where(in_swa, full * ps, 0)].long() // ps
        dst = torch.where(in_swa, self.swa_indptr[:-1, None].long() + cols - first[:, None],
                          self.swa_cap)
        self.swa_indices.scatter_(0, dst.view(-1), swa.view(-1).int())
        self.swa_last.copy_(torch.where(n_swa > 0, last, 0))


def same_tables(pt, eager: EagerTables, planned) -> bool:
    """The page tables' CSR buffers equal the eager baseline's (entries up to indptr[B])."""
    ok = True
    for layer, n in (("full", planned.n_full_pages), ("swa", planned.n_swa_pages)):
        mine = [getattr(pt, f"{layer}_kv_{k}_buf") for k in ("indptr", "indices",
                                                            "last_page_len")]
        theirs = [getattr(eager, f"{layer}_{k}") for k in ("indptr", "indices", "last")]
        ok &= torch.equal(mine[0].cpu(), theirs[0].cpu())
        ok &= torch.equal(mine[1][:n].cpu(), theirs[1][:n].cpu())
        ok &= torch.equal(mine[2].cpu(), theirs[2].cpu())
    return bool(ok)


# ---- one case -----------------------------------------------------------------------------
def measure_case(ctx, b: int, ps: int) -> dict:
    from graphalloc.attention.page_tables import PageTables, PageTableSpec

    p, dev, sampler = ctx.params, ctx.device, ctx.sampler
    wl = TableWorkload(b, ps, p["max_context"], p["window"], p["median_len"], dev,
                       seed=1000 * b + ps)
    tables, graphs = {}, {}
    for name, forms in (("tables_csr", ("csr",)), ("tables_all", ("csr", "block_table"))):
        spec = PageTableSpec(max_batch=b, page_size=ps, sliding_window=wl.window,
                             max_context_len=wl.max_context, forms=forms, device=dev,
                             backend=ctx.backend, n_bufs=1)  # one row table: one graph
        pt = PageTables(spec, wl.req_to_token, wl.full_to_swa)
        planned = pt.plan(wl.rows, wl.seq_len, wl.frontier)
        call, graph = replayable(lambda pt=pt: pt.launch(0), ctx.is_cuda)
        pt.mark_submitted(planned)
        tables[name] = (pt, call, planned)
        graphs[name] = graph
    eager = EagerTables(wl, dev)
    eager.fill()
    calls = {name: tables[name][1] for name in tables}
    calls["eager"] = eager.run
    if ctx.is_cuda:
        calls["eager_graph"], graphs["eager_graph"] = replayable(eager.run, True)
    calls["floor"] = ctx.floor_call

    calls["tables_csr"]()
    eager.run()
    sampler.sync()
    equal = same_tables(tables["tables_csr"][0], eager, tables["tables_csr"][2])

    gpu = {name: summarize(v) for name, v in sampler.alternating(calls).items()}

    host = {}
    for name in ("tables_csr", "tables_all"):
        pt, call, _ = tables[name]

        def launch(planned, call=call, pt=pt):
            call()
            pt.mark_submitted(planned)

        plan_us, launch_us = sampler.host_stages_us(
            [lambda _, pt=pt: pt.plan(wl.rows, wl.seq_len, wl.frontier), launch])
        host[name] = summarize(np.add(plan_us, launch_us))
        host[name + "_plan"] = summarize(plan_us)
    fill_us, run_us = sampler.host_stages_us([lambda _: eager.fill(), lambda _: eager.run()])
    host["eager"] = summarize(np.add(fill_us, run_us))
    if "eager_graph" in calls:
        host["eager_graph"] = summarize(
            np.add(*sampler.host_stages_us([lambda _: eager.fill(),
                                            lambda _: calls["eager_graph"]()])))

    launches = {name: count_launches(calls[name], ctx.is_cuda)
                for name in ("tables_csr", "eager")}
    nodes = {name: graph_nodes(g) for name, g in graphs.items()} if ctx.is_cuda else None

    def p50(name):
        stats = gpu.get(name)
        return stats["p50"] if stats else None

    def ratio(a, b_):
        x, y = p50(a), p50(b_)
        return x / y if x is not None and y else None

    rec = {
        "b": b, "ps": ps, "pages": {"full": wl.n_full_pages, "swa": wl.n_swa_pages},
        "mean_len": float(wl.seq_len[wl.rows].mean()), "outputs_equal": equal,
        "gpu_us": gpu, "host_us": host, "launches": launches, "graph_nodes": nodes,
        "ratios": {
            "eager / tables_csr": ratio("eager", "tables_csr"),
            "eager_graph / tables_csr": ratio("eager_graph", "tables_csr"),
            "tables_csr / floor": ratio("tables_csr", "floor"),
            "tables_all / floor": ratio("tables_all", "floor"),
            "tables_all / tables_csr": ratio("tables_all", "tables_csr"),
        },
        "added_us": {name: p50(name) - p50("floor") for name in ("tables_csr", "tables_all")},
    }
    return rec


# ---- reporting ----------------------------------------------------------------------------
def _fmt(x, digits=3):
    if x is None:
        return "-"
    return f"{x:.{digits}g}" if abs(x) < 1000 else f"{x:.0f}"


def _launches(counts: dict) -> str:
    if counts.get("kernels") is None:
        return f"{counts['aten_ops']} aten ops"
    return (f"{counts['kernels']} kernels ({counts['launch_calls']} launch calls, "
            f"{counts['graph_launches']} graph launches, {counts['copies']} copies)")


def markdown(res: dict) -> str:
    clock = res["device_clock"]
    unit = "GPU us (p50)" if clock == "cuda-events" else "CPU wall us (p50, no CUDA)"
    lines = [
        "# bench_page_tables", "",
        f"Command: `{res['command']}`  ",
        f"Machine: {res['machine']['summary']}  ",
        f"Device clock: {clock}; page-table backend: {res['backend']}; window "
        f"{res['params']['window']} tokens, context {res['params']['max_context']}, lengths "
        f"lognormal around {res['params']['median_len']}", "",
        f"One attention batch of B lanes, FULL + SWA CSR tables; {unit}, p20-p80 in the JSON. "
        "`tables` = one replay of a graph holding `PageTables.launch`; `eager` = the eager "
        "torch-op baseline; `added` = tables - floor (what the node adds inside a step graph).",
        "",
        "| B | ps | FULL / SWA pages | tables_csr | tables_all | eager | eager in a graph "
        "| floor | added (csr) | eager / tables | tables / floor | host tables (plan) "
        "| host eager | same tables |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["cases"]:
        g, h, q = r["gpu_us"], r["host_us"], r["ratios"]

        def med(stats):
            return _fmt(stats["p50"]) if stats else "-"

        lines.append(
            f"| {r['b']} | {r['ps']} | {r['pages']['full']} / {r['pages']['swa']} "
            f"| {med(g.get('tables_csr'))} | {med(g.get('tables_all'))} | {med(g.get('eager'))} "
            f"| {med(g.get('eager_graph'))} | {med(g.get('floor'))} "
            f"| {_fmt(r['added_us']['tables_csr'])} | {_fmt(q['eager / tables_csr'])}x "
            f"| {_fmt(q['tables_csr / floor'])}x | {med(h.get('tables_csr'))} "
            f"({med(h.get('tables_csr_plan'))}) | {med(h.get('eager'))} "
            f"| {r['outputs_equal']} |")
    lines += ["", "Launches per call (torch.profiler; GPU kernels on CUDA, top-level aten ops "
              "without CUDA):", ""]
    for r in res["cases"]:
        lines.append(f"* B={r['b']} ps={r['ps']}: tables_csr "
                     f"{_launches(r['launches']['tables_csr'])}; eager "
                     f"{_launches(r['launches']['eager'])}"
                     + (f"; graph nodes {r['graph_nodes']}" if r["graph_nodes"] else ""))
    if res["floor"]:
        lines += ["", f"Floor ({res['floor']['kernel']}): device "
                  f"{format_quantiles(res['floor']['gpu_us'])} us, host "
                  f"{format_quantiles(res['floor']['cpu_us'])} us (first); end: "
                  + (format_quantiles(res["floor_end"]["gpu_us"]) if res["floor_end"] else "-")]
    if res["skipped"] or res["errors"]:
        lines += ["", "Skipped: " + "; ".join(res["skipped"]) if res["skipped"] else "",
                  "Errors: " + "; ".join(f"{e['case']}: {e['error']}" for e in res["errors"])
                  if res["errors"] else ""]
    return "\n".join(lines) + "\n"


# ---- run ----------------------------------------------------------------------------------
class Context:
    def __init__(self, params: dict, device: torch.device, backend: str):
        self.params, self.device, self.backend = params, device, backend
        self.is_cuda = device.type == "cuda"
        self.sampler = Sampler(device, n_samples=params["samples"], n_warmup=params["warmup"],
                               flush_mib=params["flush_mib"])
        self.floor_call = None


def parse_args(argv):
    ap = bench_parser(__doc__, os.path.join(REPO, "results", "bench", "page-tables"),
                      "page-table writer: auto = Triton on CUDA, the Torch twin on a CPU")
    ap.add_argument("--b", help="comma-separated lane counts (default 1,64,256,1024)")
    ap.add_argument("--ps", help="comma-separated page sizes (default 16,64)")
    for key in ("max-context", "window", "median-len", "samples", "warmup", "flush-mib"):
        ap.add_argument(f"--{key}", type=int)
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)
    params = dict(QUICK if args.quick else FULL)
    for key in ("b", "ps"):
        if getattr(args, key):
            params[key] = tuple(int(x) for x in getattr(args, key).split(","))
    for key in ("max_context", "window", "median_len", "samples", "warmup", "flush_mib"):
        if getattr(args, key) is not None:
            params[key] = getattr(args, key)
    bad = [ps for ps in params["ps"] if params["max_context"] % ps]
    if bad:
        ap.error(f"--max-context must be a multiple of every page size, not of {bad}")
    args.params = params
    return args


def main(argv=None) -> int:
    return bench_main(argv, parse_args, _run)


def _run(args, argv, device, backend, note) -> int:
    p = args.params
    ctx = Context(p, device, backend)
    res = {"command": " ".join(["python", os.path.relpath(__file__, REPO), *argv]),
           "machine": machine_info(device), "device_clock": ctx.sampler.clock,
           "backend": backend, "backend_note": note,
           "params": {k: list(v) if isinstance(v, tuple) else v for k, v in p.items()},
           "floor": None, "floor_end": None, "cases": [], "errors": [], "skipped": []}
    if not ctx.is_cuda:
        res["skipped"].append("GPU-only parts (no CUDA device): graphs, CUDA events, the L2 "
                              "flush, eager_graph; device times are CPU wall clock")
    t_start = time.perf_counter()
    try:
        res["floor"] = measure_floor(ctx.sampler)
        ctx.floor_call = empty_graph(device)[0]
    except Exception as exc:
        res["errors"].append({"case": "floor", "error": f"{type(exc).__name__}: {exc}",
                              "traceback": traceback.format_exc()})
        ctx.floor_call = lambda: None
    for b in p["b"]:
        for ps in p["ps"]:
            label = f"B={b} ps={ps}"
            t0 = time.perf_counter()
            try:
                rec = measure_case(ctx, b, ps)
                ctx.sampler.release_memory()  # the case's tables and graphs are gone
                rec["wall_s"] = time.perf_counter() - t0
                res["cases"].append(rec)
                g = rec["gpu_us"]
                print(f"{label}: tables_csr {format_quantiles(g['tables_csr'])}  eager "
                      f"{format_quantiles(g['eager'])}  floor {format_quantiles(g['floor'])} "
                      f"us; same tables {rec['outputs_equal']} ({rec['wall_s']:.1f} s)",
                      file=sys.stderr)
                if not rec["outputs_equal"]:
                    res["errors"].append({"case": label, "error": "the eager baseline and "
                                          "the page tables wrote different CSR tables"})
            except Exception as exc:
                res["errors"].append({"case": label, "error": f"{type(exc).__name__}: {exc}",
                                      "traceback": traceback.format_exc()})
                print(f"{label}: FAILED {type(exc).__name__}: {exc}", file=sys.stderr)
                ctx.sampler.release_memory()
    try:
        res["floor_end"] = measure_floor(ctx.sampler)
    except Exception as exc:
        res["errors"].append({"case": "floor_end", "error": f"{type(exc).__name__}: {exc}"})
    res["wall_s"] = time.perf_counter() - t_start
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_page_tables.json"), "w") as f:
        json.dump(res, f, indent=1)
    with open(os.path.join(args.out, "bench_page_tables.md"), "w") as f:
        f.write(markdown(res))
    plotted = not args.no_plot and plot_page_tables(
        res, os.path.join(args.out, "bench_page_tables.png"))
    print(f"wrote {args.out}/bench_page_tables.json, .md" + (", .png" if plotted else "")
          + f" in {res['wall_s']:.1f} s", file=sys.stderr)
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
