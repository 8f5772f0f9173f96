"""Decode-loop throughput: the allocator inside the model's CUDA graph vs. launched eagerly.

The loop is ``examples/model_loops/paged_decode.py``'s: a hybrid SWA/full decoder whose KV
is paged by graphalloc, continuous batching with window evictions on most
steps, releases and admissions mid-loop. Variants, each per allocator backend:

* ``in_graph``: ONE graph per step = allocator step + model forward + argmax; the
  host plans and replays (the point of graphalloc).
* ``eager_alloc``: the allocator's kernels are launched eagerly before each replay
  of a model-only graph (the way engines do it today: metadata work outside the
  graph). Same plan, same kernels, same model graph.
* ``eager`` (``--with-eager``): no graphs at all.

Measured per variant, over ``--repeats`` interleaved runs of the same workload:
decode steps per second (wall clock, prefills included, the same for every
variant), host time per decode step (plan + launches + replay +
``mark_submitted``) and GPU time per decode step (CUDA events around the step's
launches: the eager allocator kernels, if any, and the replay; planning is outside),
as p50 with p20/p80 (``timing.summarize``). The floor: one replay of an empty graph
(``timing.measure_floor``, no L2 flush, like the steps).

    python benchmarks/bench_decode_loop.py --out DIR         # on a GPU: JSON, markdown, PNG
    python benchmarks/bench_decode_loop.py --device cpu --batch 4 --requests 8   # smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "model_loops"))
from decode_loop import build_allocator, make_requests  # noqa: E402
from figures import plot_decode_loop_bench  # noqa: E402
from hybrid_model import ModelConfig, TinyHybridLM, allocator_window, random_weights  # noqa: E402
from paged_decode import DecodeLoop  # noqa: E402
from provenance import add_stamp_option, stamp_or_exit  # noqa: E402
from timing import (  # noqa: E402
    Sampler,
    cpu_threads,
    format_quantiles,
    machine_info,
    measure_floor,
    pick_backend,
    progress,
    say,
    summarize,
)

__all__ = ["main"]

FLOOR_SAMPLES = 2000


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    choices=["cpu", "cuda"])
    ap.add_argument("--backends", nargs="+", default=["auto"],
                    help="allocator backends; 'auto' = every one available (torch, triton)")
    ap.add_argument("--batch", type=int, nargs="+", default=[16, 64], help="decode lanes")
    ap.add_argument("--requests-per-lane", type=float, default=3.0,
                    help="requests per run = this x batch")
    ap.add_argument("--requests", type=int, default=0, help="requests per run (overrides)")
    ap.add_argument("--prompt-len", type=int, nargs=2, default=[16, 96], metavar=("MIN", "MAX"))
    ap.add_argument("--output-len", type=int, nargs=2, default=[128, 512],
                    metavar=("MIN", "MAX"))
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--window", type=int, default=64, help="model sliding window W")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--layer-pattern", default="sf")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--with-eager", action="store_true", help="also run without any graph")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results" / "bench"
                                          / "decode-loop"),
                    help="directory for bench_decode_loop.{json,md,png}; '' writes nothing")
    add_stamp_option(ap)
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda but torch sees no GPU")
    if args.backends == ["auto"]:
        args.backends = ["torch"]
        if args.device == "cuda" and pick_backend("auto", "cuda")[0] == "triton":
            args.backends.append("triton")
    return args


def run_bench(args) -> dict:
    cuda = args.device == "cuda"
    torch.backends.cuda.matmul.allow_tf32 = False
    mcfg = ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                       intermediate_size=2 * args.hidden, num_layers=args.layers,
                       num_heads=args.heads, num_kv_heads=args.kv_heads,
                       sliding_window=args.window, layer_pattern=args.layer_pattern)
    weights = random_weights(mcfg, args.seed)
    variants = (["in_graph", "eager_alloc"] + (["eager"] if args.with_eager else [])
                if cuda else ["eager"])
    results = []
    n_runs = len(args.batch) * len(args.backends) * len(variants) * args.repeats
    bar = progress(n_runs, "bench_decode_loop", not args.no_progress, unit="run")
    for batch in args.batch:
        n_req = args.requests or int(args.requests_per_lane * batch)
        reqs = make_requests(n_req, tuple(args.prompt_len), tuple(args.output_len),
                             args.vocab, args.seed + batch)
        max_prompt = max(len(r.prompt) for r in reqs)
        max_out = max(r.n_out for r in reqs)
        loops = {}
        for backend in args.backends:
            for v in variants:
                alloc = build_allocator(page_size=args.page_size, max_batch=batch,
                                        max_prompt=max_prompt, max_total=max_prompt + max_out,
                                        alloc_window=allocator_window(args.window),
                                        device=args.device, backend=backend)
                loop = DecodeLoop(TinyHybridLM(mcfg, weights, args.device), alloc,
                                  max_batch=batch, n_serials=n_req, max_out=max_out,
                                  graph=v != "eager", alloc_in_graph=v == "in_graph",
                                  keep_logits=False, time_steps=True)
                if v != "eager":
                    loop.capture()
                loop.run(reqs[: max(2, batch // 4)])  # warm-up (allocator left empty)
                loops[(backend, v)] = loop
        samples = {k: {"steps_per_s": [], "host_us": [], "launch_us": [], "gpu_us": [],
                       "steps": 0} for k in loops}
        tokens = {}
        for _ in range(args.repeats):  # interleaved, so drift hits every variant alike
            for k, loop in loops.items():
                res = loop.run(reqs)
                sm = samples[k]
                sm["steps_per_s"].append(len(res.steps) / res.wall_s)
                sm["host_us"] += [t * 1e6 for t in res.host_step_s]
                sm["launch_us"] += [t * 1e6 for t in res.host_launch_s]
                sm["gpu_us"] += res.gpu_step_us
                sm["steps"] = len(res.steps)
                sm["graph_nodes"] = res.graph_nodes
                sm["evict_steps"] = sum(s["swa_pages_evicted"] > 0 for s in res.steps)
                tokens[k] = res.tokens
                if bar is not None:
                    bar.update(1)
        ref_tokens = next(iter(tokens.values()))
        for (backend, v), sm in samples.items():
            results.append({
                "batch": batch, "backend": backend, "variant": v, "requests": n_req,
                "steps": sm["steps"], "steps_with_evictions": sm["evict_steps"],
                "steps_per_s": summarize(sm["steps_per_s"]),
                "host_us_per_step": summarize(sm["host_us"]),
                "host_launch_us_per_step": summarize(sm["launch_us"]),
                "gpu_us_per_step": summarize(sm["gpu_us"]),
                "tokens_equal_across_variants": tokens[(backend, v)] == ref_tokens,
                "graph_nodes": sm["graph_nodes"],
            })
            r = results[-1]
            say(bar, f"batch {batch:>4} {backend:>6} {v:<11} {r['steps_per_s']['p50']:8.0f} "
                f"steps/s  host {r['host_us_per_step']['p50']:7.1f} us/step (launch "
                f"{r['host_launch_us_per_step']['p50']:6.1f})"
                + (f"  GPU {r['gpu_us_per_step']['p50']:7.1f} us/step"
                   if r["gpu_us_per_step"] else "")
                + ("" if r["tokens_equal_across_variants"] else "  TOKENS DIFFER"))
    if bar is not None:
        bar.close()
    floor = measure_floor(Sampler(args.device, n_samples=FLOOR_SAMPLES, flush_mib=0))
    meta = {"machine": machine_info(args.device), "device_clock": "cuda-events" if cuda else
            "cpu-wall", "floor": floor, "page_size": args.page_size, "window": args.window,
            "model": {"layers": mcfg.layer_types, "hidden": mcfg.hidden_size,
                      "heads": mcfg.num_heads, "kv_heads": mcfg.num_kv_heads,
                      "vocab": mcfg.vocab_size},
            "prompt_len": args.prompt_len, "output_len": args.output_len,
            "repeats": args.repeats, "args": vars(args)}
    return {"meta": meta, "results": results}


def markdown(out: dict) -> str:
    m = out["meta"]
    machine = m["machine"]
    lines = [f"# Decode loop: allocator in the model's graph vs. launched eagerly "
             f"({machine['gpu'] or 'cpu'})", "",
             f"Machine: {machine['summary']}; page_size {m['page_size']}, window {m['window']}, "
             f"model {m['model']}, prompts {m['prompt_len']}, outputs {m['output_len']}, "
             f"{m['repeats']} interleaved repeats; p50 (p20-p80).", "",
             f"Arguments: `{m.get('args')}`", "",
             f"Floor ({m['floor']['kernel']}): {format_quantiles(m['floor']['gpu_us'], 1)} us "
             f"per replay, clock {m['device_clock']}.", ""]
    lines += ["host us/step: plan (with any wait for a free descriptor buffer, i.e. for the GPU)"
              " + launch; launch: lane inputs + eager allocator launches (eager_alloc) + replay"
              " + mark_submitted. GPU us/step: CUDA events around the eager allocator launches"
              " (eager_alloc) and the replay only; an idle GPU's interval includes their"
              " enqueue.", "",
              "| batch | backend | variant | steps/s | host us/step | host launch us/step "
              "| GPU us/step | tokens equal |",
              "|---|---|---|---|---|---|---|---|"]
    for r in out["results"]:
        q = {k: format_quantiles(r[k], 1) for k in ("host_us_per_step", "host_launch_us_per_step",
                                                    "gpu_us_per_step")}
        lines.append(f"| {r['batch']} | {r['backend']} | {r['variant']} | "
                     f"{format_quantiles(r['steps_per_s'], 0)} | {q['host_us_per_step']} | "
                     f"{q['host_launch_us_per_step']} | {q['gpu_us_per_step']} | "
                     f"{r['tokens_equal_across_variants']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    args = parse_args(argv)
    stamp_or_exit(args.out, __file__, argv, allow_dirty=args.allow_dirty)
    t0 = time.perf_counter()
    with cpu_threads(args.device):
        out = run_bench(args)
    out["meta"]["bench_s"] = time.perf_counter() - t0
    print(markdown(out))
    if args.out:
        d = Path(args.out)
        d.mkdir(parents=True, exist_ok=True)
        (d / "bench_decode_loop.json").write_text(json.dumps(out, indent=1))
        (d / "bench_decode_loop.md").write_text(markdown(out))
        png = plot_decode_loop_bench(out, d / "bench_decode_loop.png")
        print(f"wrote {d}/bench_decode_loop.json, .md" + (", .png" if png else ""))
    return out


if __name__ == "__main__":
    main()
