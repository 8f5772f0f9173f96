"""Decode-loop throughput: the allocator inside the model's CUDA graph vs. launched eagerly.

The loop is ``examples/paged_decode.py``'s: a hybrid SWA/full decoder whose KV
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
``mark_submitted``) and GPU time per decode step (CUDA events around each step),
as median with p20/p80. The floor: one replay of an empty graph.

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

import numpy as np
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from decode_loop import build_allocator, make_requests, resolve_backend  # noqa: E402
from hybrid_model import ModelConfig, TinyHybridLM, allocator_window, random_weights  # noqa: E402
from paged_decode import DecodeLoop  # noqa: E402

__all__ = ["main"]


def _q(x) -> dict:
    x = np.asarray(x, dtype=float)
    if x.size == 0:
        return {}
    return {"median": float(np.median(x)), "p20": float(np.percentile(x, 20)),
            "p80": float(np.percentile(x, 80))}


def empty_graph_floor_us(n: int = 2000) -> float:
    """Median GPU time of replaying a graph holding one tiny kernel."""
    x = torch.zeros(1, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        x.add_(1)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        x.add_(1)
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
          for _ in range(n)]
    for a, b in ev:
        a.record()
        g.replay()
        b.record()
    torch.cuda.synchronize()
    return float(np.median([a.elapsed_time(b) * 1e3 for a, b in ev]))


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
    ap.add_argument("--out", default="", help="directory for bench_decode_loop.{json,md,png}")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda but torch sees no GPU")
    if args.backends == ["auto"]:
        args.backends = ["torch"]
        if args.device == "cuda" and resolve_backend("auto", "cuda") == "triton":
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
                sm["gpu_us"] += [t * 1e3 for t in (res.gpu_step_ms or [])]
                sm["steps"] = len(res.steps)
                sm["graph_nodes"] = res.graph_nodes
                sm["evict_steps"] = sum(s["swa_pages_evicted"] > 0 for s in res.steps)
                tokens[k] = res.tokens
        ref_tokens = next(iter(tokens.values()))
        for (backend, v), sm in samples.items():
            results.append({
                "batch": batch, "backend": backend, "variant": v, "requests": n_req,
                "steps": sm["steps"], "steps_with_evictions": sm["evict_steps"],
                "steps_per_s": _q(sm["steps_per_s"]), "host_us_per_step": _q(sm["host_us"]),
                "host_launch_us_per_step": _q(sm["launch_us"]),
                "gpu_us_per_step": _q(sm["gpu_us"]) if sm["gpu_us"] else None,
                "tokens_equal_across_variants": tokens[(backend, v)] == ref_tokens,
                "graph_nodes": _node_counts(sm["graph_nodes"]),
            })
            r = results[-1]
            print(f"batch {batch:>4} {backend:>6} {v:<11} {r['steps_per_s']['median']:8.0f} "
                  f"steps/s  host {r['host_us_per_step']['median']:7.1f} us/step (launch "
                  f"{r['host_launch_us_per_step']['median']:6.1f})"
                  + (f"  GPU {r['gpu_us_per_step']['median']:7.1f} us/step"
                     if r["gpu_us_per_step"] else "")
                  + ("" if r["tokens_equal_across_variants"] else "  TOKENS DIFFER"))
    meta = {"device": torch.cuda.get_device_name() if cuda else "cpu",
            "torch": torch.__version__, "page_size": args.page_size, "window": args.window,
            "model": {"layers": mcfg.layer_types, "hidden": mcfg.hidden_size,
                      "heads": mcfg.num_heads, "kv_heads": mcfg.num_kv_heads,
                      "vocab": mcfg.vocab_size},
            "prompt_len": args.prompt_len, "output_len": args.output_len,
            "repeats": args.repeats, "args": vars(args)}
    try:
        import triton
        meta["triton"] = triton.__version__
    except ImportError:
        pass
    if cuda:
        meta["empty_graph_floor_us"] = empty_graph_floor_us()
    return {"meta": meta, "results": results}


def _node_counts(desc):
    if not desc:
        return None
    return {k: v for k, v in desc.items() if k != "kernel_names"}


def markdown(out: dict) -> str:
    m = out["meta"]
    lines = [f"# Decode loop: allocator in the model's graph vs. launched eagerly ({m['device']})",
             "", f"torch {m['torch']}, triton {m.get('triton', '-')}, page_size {m['page_size']},"
             f" window {m['window']}, model {m['model']}, prompts {m['prompt_len']}, outputs "
             f"{m['output_len']}, {m['repeats']} interleaved repeats; median (p20-p80).", "",
             f"Arguments: `{m.get('args')}`", ""]
    if "empty_graph_floor_us" in m:
        lines += [f"Empty-graph replay floor: {m['empty_graph_floor_us']:.1f} us GPU.", ""]
    lines += ["host us/step: plan (with any wait for a free descriptor buffer, i.e. for the GPU)"
              " + launch; launch: lane inputs + eager allocator launches (eager_alloc) + replay"
              " + mark_submitted.", "",
              "| batch | backend | variant | steps/s | host us/step | host launch us/step "
              "| GPU us/step | tokens equal |",
              "|---|---|---|---|---|---|---|---|"]

    def fmt(q, digits=1):
        return f"{q['median']:.{digits}f} ({q['p20']:.{digits}f}-{q['p80']:.{digits}f})" \
            if q else "-"
    for r in out["results"]:
        lines.append(f"| {r['batch']} | {r['backend']} | {r['variant']} | "
                     f"{fmt(r['steps_per_s'], 0)} | {fmt(r['host_us_per_step'])} | "
                     f"{fmt(r['host_launch_us_per_step'])} | "
                     f"{fmt(r['gpu_us_per_step'])} | {r['tokens_equal_across_variants']} |")
    return "\n".join(lines) + "\n"


def plot(out: dict, path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    res = out["results"]
    labels = [f"b{r['batch']}\n{r['backend']}\n{r['variant']}" for r in res]
    fig, axes = plt.subplots(1, 3, figsize=(max(10, 1.1 * len(res) * 3), 4))
    for ax, key, title in ((axes[0], "steps_per_s", "decode steps / s (higher is better)"),
                           (axes[1], "host_launch_us_per_step",
                            "host launch us / step (lanes + launches + replay)"),
                           (axes[2], "gpu_us_per_step", "GPU us / decode step")):
        if any(not r[key] for r in res):
            ax.set_visible(False)
            continue
        med = [r[key]["median"] for r in res]
        err = [[r[key]["median"] - r[key]["p20"] for r in res],
               [r[key]["p80"] - r[key]["median"] for r in res]]
        colors = ["C0" if r["variant"] == "in_graph" else "C1" if r["variant"] == "eager_alloc"
                  else "C2" for r in res]
        ax.bar(range(len(res)), med, yerr=err, color=colors)
        ax.set_xticks(range(len(res)), labels, fontsize=7)
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv=None) -> dict:
    args = parse_args(argv)
    threads = torch.get_num_threads()
    if args.device == "cpu":
        torch.set_num_threads(1)  # tiny tensors: threads only add overhead
    t0 = time.perf_counter()
    try:
        out = run_bench(args)
    finally:
        torch.set_num_threads(threads)
    out["meta"]["bench_s"] = time.perf_counter() - t0
    print(markdown(out))
    if args.out:
        d = Path(args.out)
        d.mkdir(parents=True, exist_ok=True)
        (d / "bench_decode_loop.json").write_text(json.dumps(out, indent=1))
        (d / "bench_decode_loop.md").write_text(markdown(out))
        plot(out, d / "bench_decode_loop.png")
        print(f"wrote {d}/bench_decode_loop.json, .md, .png")
    return out


if __name__ == "__main__":
    main()
