"""The GPU at its floor: a decode + eviction step's interval against the pipelined floor, and
an 8,192-token prefill's GPU span, with the descriptor rows staged in device memory (now)
and read from pinned host memory (before).

    python benchmarks/bench_floor.py --out OUT                # one GPU, about 2 minutes
    python benchmarks/bench_floor.py --quick --out /tmp/floor  # CPU smoke run (host clocks)

Cases, through the library's own graph executor (``StepGraph``: row buckets, two descriptor
buffers, one replay per step)::

    decode    B = 256 running requests, page size 16, model window 4096, lengths uniform in
              [W/2, 2W), each step alloc.step(evict_all=True, decode=rows); without and
              with page tables (PageTableSpec(B): CSR and block tables, FULL and SWA)
    prefill   one request extends by 8,192 tokens: alloc.step(extend=([r], [8192])), a fresh
              request each step (the previous one released, untimed)

Variants: ``staged`` (``StepGraph()``: the graph's first kernel copies the step's rows into
device memory, ``graphalloc.kernels.stage``) and ``pinned`` (``StepGraph(staged=False)``:
every kernel reads the pinned buffer, the form before); prefill also over ``long_programs``
64 / 128 / 256 (programs a long row is spread over).

Clocks:

* ``interval`` -- pipelined: ``steps`` steps in a host loop, no synchronisation; CUDA events
  before the first and after the last; (end - start) / steps. The variants take turns,
  ``rounds`` times; p50 (p20 / p80) over the rounds. ``host``: perf_counter over the same loop.
* ``floor`` -- the pipelined floor: the same loop on the same kind of allocator whose
  executor replays an empty graph (one empty Triton kernel) instead of the step's graph:
  the loop with the step's device work at zero.
* ``busy`` -- GPU kernel time per step (torch.profiler / CUPTI: the union of the kernels'
  intervals over ``busy_steps`` steps, divided by them).
* ``span`` -- (prefill) one step on an idle GPU: synchronise, then CUDA events around
  ``alloc.step``; p50 (p20 / p80) over ``span_samples`` steps.

Targets (issue 34): decode interval, staged, no tables, within 1.5 x the floor; prefill span,
staged, at most 10 us. Without CUDA (``--quick``) everything runs eagerly on the Torch twins
and the clocks are host wall time (``"device_clock": "cpu-wall"``, no verdicts). Writes
``bench_floor.json`` and ``bench_floor.md`` into ``--out``.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if HERE not in sys.path:
    sys.path.insert(0, HERE)
from timing import bench_main, bench_parser, empty_graph, machine_info, summarize  # noqa: E402

FULL = dict(batch=256, prefill=8192, steps=40, rounds=7, warm_steps=10, busy_steps=30,
            span_samples=30, long_programs=(64, 128, 256), tables_context=131072,
            tables_median=16384, tables_samples=30,
            tables_sweep=((512, 8), (1024, 8), (256, 8), (512, 4), (512, 16), (1024, 4)))
QUICK = dict(batch=8, prefill=512, steps=6, rounds=2, warm_steps=2, busy_steps=3,
             span_samples=3, long_programs=(64,), tables_context=2048, tables_median=512,
             tables_samples=3, tables_sweep=((512, 8), (16, 8)))
DECODE_TARGET = 1.5  # interval / floor
PREFILL_TARGET_US = 10.0


def _q(s: dict | None) -> str:
    return "-" if not s else f"{s['p50']:.1f} ({s['p20']:.1f} / {s['p80']:.1f})"


# ---- executors ------------------------------------------------------------------------------
def empty_replay_executor():
    """An executor that replays an empty graph for every step (the floor: the host path
    unchanged, the step's device work zero). Its steps count no stamp."""
    from graphalloc.device.executor import Executor

    class EmptyReplay(Executor):
        name = "empty-replay"
        stamps_steps = False

        def bind(self, parts) -> None:
            super().bind(parts)
            self.call, self.what, self.graph = empty_graph(parts.config.device)

        def execute(self, planned) -> None:
            self.call()

    return EmptyReplay()


# ---- clocks ---------------------------------------------------------------------------------
def loop_us(fn, n: int, is_cuda: bool) -> tuple[float, float]:
    """(device interval per call, host time per call) of ``n`` calls of ``fn`` in a loop with
    no synchronisation inside (CUDA events around the loop; without CUDA both are host)."""
    if is_cuda:
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = time.perf_counter_ns()
    for _ in range(n):
        fn()
    t1 = time.perf_counter_ns()
    host = (t1 - t0) / 1e3 / n
    if not is_cuda:
        return host, host
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / n, host


def busy_us(fn, n: int, is_cuda: bool) -> float | None:
    """GPU kernel time per call of ``fn`` over ``n`` calls: the union of the device kernels'
    intervals (torch.profiler), divided by ``n``; None without CUDA or a profiler."""
    if not is_cuda:
        return None
    try:
        from torch.profiler import ProfilerActivity, profile
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(n):
                fn()
            torch.cuda.synchronize()
        spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                       if str(getattr(e, "device_type", "")).upper().endswith("CUDA"))
    except Exception:
        return None
    total, cur_start, cur_end = 0.0, None, None
    for a, b in spans:
        if cur_end is None or a > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = a, b
        else:
            cur_end = max(cur_end, b)
    if cur_end is not None:
        total += cur_end - cur_start
    return total / n


# ---- decode ---------------------------------------------------------------------------------
def decode_case(p: dict, device, backend: str, errors: list) -> list[dict]:
    from bench_host_step import warm_allocator

    import graphalloc as ga

    is_cuda = device.type == "cuda"
    B = p["batch"]
    variants = {}
    for tables in (False, True):
        for name, make in (("staged", lambda: ga.StepGraph()),
                           ("pinned", lambda: ga.StepGraph(staged=False)),
                           ("floor", empty_replay_executor)):
            label = f"{name}{'+tables' if tables else ''}"
            try:
                kw = {"page_tables": ga.PageTableSpec(max_batch=B)} if tables else {}
                alloc, rows = warm_allocator(ga, B, seed=B, executor=make(),
                                             device=str(device), backend=backend, **kw)
                rows = np.array(rows, dtype=np.int64)
                variants[label] = (alloc, rows)
            except Exception as exc:
                errors.append({"case": f"decode {label}", "error": f"{type(exc).__name__}: "
                                                                    f"{exc}"})
    for alloc, rows in variants.values():  # warm: every bucket a steady step uses
        for _ in range(p["warm_steps"]):
            alloc.step(evict_all=True, decode=rows)
    samples: dict = {k: {"interval": [], "host": []} for k in variants}
    names = list(variants)
    for r in range(p["rounds"]):
        for name in (names if r % 2 == 0 else names[::-1]):
            alloc, rows = variants[name]
            dev, host = loop_us(lambda a=alloc, x=rows: a.step(evict_all=True, decode=x),
                                p["steps"], is_cuda)
            samples[name]["interval"].append(dev)
            samples[name]["host"].append(host)
    out = []
    for name, (alloc, rows) in variants.items():
        busy = busy_us(lambda a=alloc, x=rows: a.step(evict_all=True, decode=x),
                       p["busy_steps"], is_cuda)
        rec = {"case": "decode", "variant": name, "batch": B,
               "interval_us": summarize(samples[name]["interval"]),
               "host_us": summarize(samples[name]["host"]), "busy_us": busy,
               "steps_per_sample": p["steps"], "descriptor_stalls": alloc.ring.stalls}
        if not name.startswith("floor"):
            try:
                alloc.check()  # every submitted step ran on the device (stamps)
                rec["check"] = "ok"
            except Exception as exc:
                rec["check"] = f"{type(exc).__name__}: {exc}"
            ex = alloc.executor
            rec["graphs"] = getattr(ex, "n_graphs", None)
            try:
                desc = ex.describe(fused=True) if is_cuda else {}
                rec["fused_graph_kernels"] = desc.get("kernel")
            except Exception:
                rec["fused_graph_kernels"] = None
        out.append(rec)
    by_name = {r["variant"]: r for r in out}
    for rec in out:  # the ratio to the floor of the same tables setting
        floor = by_name.get("floor+tables" if rec["variant"].endswith("+tables") else "floor")
        if not rec["variant"].startswith("floor") and floor and floor["interval_us"]:
            rec["x_floor"] = rec["interval_us"]["p50"] / floor["interval_us"]["p50"]
    return out


# ---- prefill --------------------------------------------------------------------------------
class PrefillSteps:
    """Prefill steps of ``n_tok`` tokens, each on a fresh request (the previous one released
    first, untimed): ``one(timed)`` synchronises, then times one ``alloc.step`` (CUDA events
    on an idle GPU: its span; host perf_counter)."""

    def __init__(self, alloc, n_tok: int, is_cuda: bool):
        self.alloc, self.n_tok, self.is_cuda = alloc, n_tok, is_cuda
        self.prev = None
        self.spans: list[float] = []
        self.hosts: list[float] = []

    def one(self, timed: bool) -> None:
        alloc = self.alloc
        if self.prev is not None:
            alloc.release([self.prev])
        self.prev = r = alloc.admit()
        if self.is_cuda:
            torch.cuda.synchronize()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter_ns()
        alloc.step(extend=([r], [self.n_tok]))
        t1 = time.perf_counter_ns()
        if self.is_cuda:
            end.record()
            torch.cuda.synchronize()
            span = start.elapsed_time(end) * 1e3
        else:
            span = (t1 - t0) / 1e3
        if timed:
            self.spans.append(span)
            self.hosts.append((t1 - t0) / 1e3)


def prefill_case(p: dict, device, backend: str, errors: list) -> list[dict]:
    import graphalloc as ga

    is_cuda = device.type == "cuda"
    n_tok, ps = p["prefill"], 16
    pages = -(-n_tok // ps)
    cfg = ga.AllocatorConfig(page_size=ps, num_full_pages=4 * pages + 64,
                             num_swa_pages=4 * pages + 64, max_reqs=4,
                             max_context_len=2 * n_tok, model_window=4096,
                             index_dtype=torch.int32, device=device, backend=backend,
                             max_tokens_per_alloc_row=n_tok, max_step_tokens=n_tok + 8)
    specs = [("staged", True, lp) for lp in p["long_programs"]] + [("pinned", False, 64)]
    out = []
    for name, staged, lp in specs:
        label = f"{name}, long_programs={lp}"
        try:
            alloc = ga.HybridAllocator(cfg, executor=ga.StepGraph(staged=staged,
                                                                   long_programs=lp))
        except Exception as exc:
            errors.append({"case": f"prefill {label}", "error": f"{type(exc).__name__}: {exc}"})
            continue
        run = PrefillSteps(alloc, n_tok, is_cuda)
        for i in range(p["span_samples"] + 3):
            run.one(timed=i >= 3)
        busy = busy_us(lambda r=run: r.one(timed=False), max(3, p["busy_steps"] // 3),
                       is_cuda)
        spans, hosts = run.spans, run.hosts
        alloc.check()
        out.append({"case": "prefill", "variant": name, "long_programs": lp,
                    "tokens": n_tok, "span_us": summarize(spans), "host_us": summarize(hosts),
                    "busy_us_per_release_and_prefill": busy})
    return out


# ---- the page-table kernel alone --------------------------------------------------------------
def tables_case(p: dict, device, backend: str, errors: list) -> list[dict]:
    """The page-table kernel alone at engine scale (B lanes, a 128k context, page size 16,
    lengths lognormal around 16k, window 4096; CSR and block tables, FULL and SWA), its lane
    rows in device memory (staged) or pinned host memory, over a sweep of the page block
    (``BLOCK_COLS_MAX``) and the programs per SM: GPU us per launch, cold (256 MiB L2 flush
    before each, a graph replay) and warm (back to back). One launch of each is checked
    against the Torch twin."""
    from timing import Sampler

    from graphalloc.kernels import page_table as pt
    from graphalloc.kernels.abi import (
        PT_END_PAGE,
        PT_FULL_OFF,
        PT_LAST_LEN,
        PT_REQ,
        PT_SEQ_LEN,
        PT_SWA_FIRST,
        PT_SWA_OFF,
        PT_WINDOW_START,
        ROW_WIDTH,
    )
    is_cuda = device.type == "cuda"
    B, ps, ctx, window = p["batch"], 16, p["tables_context"], 4096
    width = ctx // ps
    rng = np.random.default_rng(7)
    L = np.clip(rng.lognormal(np.log(p["tables_median"]), 1.0, B), 1, ctx).astype(np.int64)
    end = -(-L // ps)
    first = np.maximum(L - window, 0) // ps
    rows = np.zeros((B, ROW_WIDTH), dtype=np.int64)
    rows[:, PT_REQ], rows[:, PT_SEQ_LEN], rows[:, PT_END_PAGE] = np.arange(B), L, end
    rows[:, PT_SWA_FIRST], rows[:, PT_LAST_LEN] = first, L - (end - 1) * ps
    rows[:, PT_FULL_OFF] = np.cumsum(end) - end
    rows[:, PT_SWA_OFF] = np.cumsum(end - first) - (end - first)
    rows[:, PT_WINDOW_START] = first * ps
    n_pages = int(end.sum()) + 1
    gen = torch.Generator(device="cpu").manual_seed(7)
    r2t = (torch.randint(1, n_pages, (B, ctx), generator=gen, dtype=torch.int32) * ps).to(device)
    f2s = torch.randint(1, n_pages, ((n_pages + 1) * ps,), generator=gen,
                        dtype=torch.int32).to(device)
    dev_rows = torch.from_numpy(rows).to(device)
    host_rows = torch.from_numpy(rows).pin_memory() if is_cuda else torch.from_numpy(rows)

    def outputs():
        z = dict(dtype=torch.int32, device=device)
        return dict(full_csr=(torch.zeros(B + 1, **z), torch.zeros(B * width, **z),
                              torch.zeros(B, **z)),
                    swa_csr=(torch.zeros(B + 1, **z), torch.zeros(B * width, **z),
                             torch.zeros(B, **z)),
                    full_block_table=torch.zeros(B, width, **z),
                    swa_block_table=torch.zeros(B, width, **z), seq_lens=torch.zeros(B, **z),
                    bt_ranges=torch.tensor([[width, 0, width]] * B, dtype=torch.int64,
                                           device=device))
    fn = pt.write_page_tables if backend == "triton" else pt.write_page_tables_torch
    twin = outputs()
    pt.write_page_tables_torch(dev_rows, r2t, f2s, page_size=ps, **twin)
    sampler = Sampler(device, n_samples=p["tables_samples"], n_warmup=3,
                      flush_mib=256 if is_cuda else 0)
    saved = (pt.BLOCK_COLS_MAX, pt.PROGRAMS_PER_SM)
    out = []
    sweep = [(blk, pps, "device") for blk, pps in p["tables_sweep"]] + [
        (p["tables_sweep"][0][0], p["tables_sweep"][0][1], "pinned")]
    try:
        for blk, pps, where in sweep:
            pt.BLOCK_COLS_MAX, pt.PROGRAMS_PER_SM = blk, pps
            bufs = outputs()
            table = dev_rows if where == "device" else host_rows
            call = lambda t=table, b=bufs: fn(t, r2t, f2s, page_size=ps, **b)  # noqa: E731
            try:
                call()  # compile; the first launch writes whole rows (ranges were the width)
                if is_cuda:
                    torch.cuda.synchronize()
                same = all(torch.equal(x, y) for k in twin for x, y in zip(
                    *(v if isinstance(v, tuple) else (v,) for v in (bufs[k], twin[k])),
                    strict=True))
                if is_cuda:
                    from graphalloc import capture_graph
                    graph = capture_graph(call)
                    replay = graph.replay
                else:
                    replay = call
                cold = summarize(sampler.device_us(replay))
                warm, _ = loop_us(replay, 50 if is_cuda else 2, is_cuda)
            except Exception as exc:
                errors.append({"case": f"tables block={blk} per_sm={pps} {where}",
                               "error": f"{type(exc).__name__}: {exc}"})
                continue
            out.append({"case": "tables", "variant": f"rows in {where} memory", "batch": B,
                        "context": ctx, "block_cols": blk, "programs_per_sm": pps,
                        "programs": pt.page_table_programs(device, B, width),
                        "cold_us": cold, "warm_us": warm, "equal_to_twin": same,
                        "pages": {"full": int(end.sum()), "swa": int((end - first).sum())}})
    finally:
        pt.BLOCK_COLS_MAX, pt.PROGRAMS_PER_SM = saved
    return out


# ---- report ---------------------------------------------------------------------------------
def verdicts(rows: list[dict], is_cuda: bool) -> list[dict]:
    out = []
    dec = next((r for r in rows if r["case"] == "decode" and r["variant"] == "staged"), None)
    if dec is not None and "x_floor" in dec:
        out.append({"what": "decode + eviction interval, staged, no tables, x pipelined floor",
                    "measured": round(dec["x_floor"], 2), "limit": DECODE_TARGET,
                    "ok": dec["x_floor"] <= DECODE_TARGET if is_cuda else None})
    pre = [r for r in rows if r["case"] == "prefill" and r["variant"] == "staged"
           and r["span_us"]]
    if pre:
        best = min(pre, key=lambda r: r["span_us"]["p50"])
        out.append({"what": f"{pre[0]['tokens']:,}-token prefill GPU span, staged (best: "
                            f"long_programs={best['long_programs']}), us", "measured":
                    round(best["span_us"]["p50"], 2), "limit": PREFILL_TARGET_US,
                    "ok": best["span_us"]["p50"] <= PREFILL_TARGET_US if is_cuda else None})
    tab = [r for r in rows if r["case"] == "tables" and r["variant"].endswith("device memory")
           and r["equal_to_twin"]]
    if tab:
        best = min(tab, key=lambda r: r["cold_us"]["p50"])
        out.append({"what": f"page-table kernel alone, B = {best['batch']}, "
                            f"{best['context']:,}-token context, cold (best: block "
                            f"{best['block_cols']}, {best['programs_per_sm']} programs / SM), us",
                    "measured": round(best["cold_us"]["p50"], 2), "limit": 5.0,
                    "ok": best["cold_us"]["p50"] <= 5.0 if is_cuda else None})
    return out


def markdown(doc: dict) -> str:
    lines = ["# The GPU at its floor: decode interval vs the pipelined floor, prefill span", "",
             f"`{doc['command']}` on {doc['machine']['summary']}. Clock: "
             f"{doc['device_clock']}.", "",
             f"## Decode + eviction, B = {doc['params']['batch']} (us per step)", "",
             "| variant | interval p50 (p20 / p80) | x floor | busy (CUPTI) | host | "
             "fused graph kernels | check |", "|:---|---:|---:|---:|---:|---:|:---|"]
    for r in doc["results"]:
        if r["case"] != "decode":
            continue
        busy = "-" if r["busy_us"] is None else f"{r['busy_us']:.1f}"
        ratio = f"{r['x_floor']:.2f}" if "x_floor" in r else "-"
        lines.append(f"| {r['variant']} | {_q(r['interval_us'])} | {ratio} | {busy} | "
                     f"{_q(r['host_us'])} | {r.get('fused_graph_kernels', '-')} | "
                     f"{r.get('check', '-')} |")
    lines += ["", f"## Prefill of {doc['params']['prefill']:,} tokens (us)", "",
              "| variant | long_programs | span p50 (p20 / p80) | host | busy: release + prefill |",
              "|:---|---:|---:|---:|---:|"]
    for r in doc["results"]:
        if r["case"] != "prefill":
            continue
        busy = r["busy_us_per_release_and_prefill"]
        lines.append(f"| {r['variant']} | {r['long_programs']} | {_q(r['span_us'])} | "
                     f"{_q(r['host_us'])} | {'-' if busy is None else f'{busy:.1f}'} |")
    tab = [r for r in doc["results"] if r["case"] == "tables"]
    if tab:
        lines += ["", f"## The page-table kernel alone, B = {doc['params']['batch']}, "
                  f"{doc['params']['tables_context']:,}-token context ({tab[0]['pages']['full']:,}"
                  f" FULL, {tab[0]['pages']['swa']:,} SWA pages; us per launch)", "",
                  "| lane rows | block | programs / SM | programs | cold p50 (p20 / p80) | "
                  "warm | equal to twin |", "|:---|---:|---:|---:|---:|---:|:---:|"]
        for r in tab:
            lines.append(f"| {r['variant']} | {r['block_cols']} | {r['programs_per_sm']} | "
                         f"{r['programs']} | {_q(r['cold_us'])} | {r['warm_us']:.1f} | "
                         f"{r['equal_to_twin']} |")
    lines += ["", "## Targets", "", "| what | measured | limit | result |", "|:---|---:|---:|:---|"]
    for v in doc["verdicts"]:
        res = "no verdict (no GPU)" if v["ok"] is None else ("PASS" if v["ok"] else "FAIL")
        lines.append(f"| {v['what']} | {v['measured']} | {v['limit']} | {res} |")
    if doc["errors"]:
        lines += ["", "## Errors", ""] + [f"- {e['case']}: {e['error']}" for e in doc["errors"]]
    lines += ["", "Interval: CUDA events around a loop of steps, no sync inside, divided by "
              "the steps (the variants take turns, p50 over the rounds); floor: the same loop "
              "replaying an empty graph instead of the step's; busy: the union of the kernels' "
              "device intervals per step (CUPTI); span: events around one step on an idle GPU.",
              ""]
    return "\n".join(lines)


def run(args, argv, device, backend, note) -> int:
    del note
    p = dict(QUICK if args.quick else FULL)
    is_cuda = device.type == "cuda"
    errors: list = []
    t0 = time.perf_counter()
    rows = decode_case(p, device, backend, errors)
    for r in rows:
        print(f"decode {r['variant']:14s} interval {_q(r['interval_us'])}  x floor "
              f"{r.get('x_floor', '-')}  busy {r['busy_us']}  host {_q(r['host_us'])}",
              flush=True)
    pre = prefill_case(p, device, backend, errors)
    for r in pre:
        print(f"prefill {r['variant']} long_programs={r['long_programs']}: span "
              f"{_q(r['span_us'])}  host {_q(r['host_us'])}", flush=True)
    rows += pre
    tab = tables_case(p, device, backend, errors)
    for r in tab:
        print(f"tables {r['variant']} block={r['block_cols']} per_sm={r['programs_per_sm']}: "
              f"cold {_q(r['cold_us'])}  warm {r['warm_us']:.1f}  equal {r['equal_to_twin']}",
              flush=True)
    rows += tab
    doc = {"benchmark": "bench_floor", "command": "python benchmarks/bench_floor.py "
           + " ".join(argv), "params": p, "machine": machine_info(device),
           "device_clock": "cuda-events" if is_cuda else "cpu-wall", "backend": backend,
           "results": rows, "errors": errors, "wall_s": round(time.perf_counter() - t0, 1)}
    doc["verdicts"] = verdicts(rows, is_cuda)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_floor.json"), "w") as f:
        json.dump(doc, f, indent=1)
    md = markdown(doc)
    with open(os.path.join(args.out, "bench_floor.md"), "w") as f:
        f.write(md)
    print(md)
    return 1 if errors else 0


def main(argv=None) -> int:
    parser = bench_parser(__doc__, os.path.join(REPO, "results", "bench", "floor"),
                          "kernels (GPU: triton; CPU: the Torch twins)")
    return bench_main(argv, parser.parse_args, run)


if __name__ == "__main__":
    sys.exit(main())
