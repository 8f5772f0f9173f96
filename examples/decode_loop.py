"""Graph-captured decode loop of a hybrid SWA model, checked token for token against transformers.

A tiny decoder with sliding-window and full-attention layers (``hybrid_model.py``)
keeps its KV caches in graphalloc's pages: full layers read K/V through
``req_to_token``, SWA layers through ``full_to_swa``. Continuous batching serves
requests of different prompt and output lengths, finishing and admitting them
mid-loop; every decode step is one step body (allocator step: releases, window
evictions, decode allocation; model forward; greedy sampling), captured as ONE
CUDA graph per descriptor buffer on a GPU (``--graph``) and run eagerly on a CPU
(``paged_decode.py`` explains the loop and the lane bookkeeping).

Decode attention reads K/V through the page tables written in the same step
(``--attention tables``, the default): the graph of a step holds the allocator's step,
the FULL and SWA CSR page tables of the step's lanes (``graphalloc.page_tables``), the
model whose attention layers read only those tables (the paged Triton kernel on a GPU,
its Torch twin on a CPU: ``graphalloc.kernels.paged_attention``) and the argmax.
``--attention gather`` keeps the earlier path (every layer gathers its slots from
``req_to_token`` / ``full_to_swa``).

The same random weights are loaded into ``transformers``' ``Qwen2ForCausalLM``
(``layer_types`` mixing sliding and full attention), which generates greedily
with its own cache. Every request's tokens must be identical and every step's
logits within ``--atol``. Then the script prints, and plots, the full and SWA
pages in use per step and the KV memory saved against giving every layer full KV.

CPU (eager, tiny sizes)::

    python examples/decode_loop.py

GPU (each step one graph replay, any host sync raises)::

    python examples/decode_loop.py --device cuda --graph --sync-debug --out DIR

``--shared-prompt N``: every request's prompt starts with the same N-token system prompt,
served from the allocator's prefix cache (``prefix_cache=True``): the first request
prefills it and inserts it, every later one is admitted on the cached handle and prefills
only the rest of its prompt (``paged_decode.py``). The result states the prefill tokens
and the KV pages saved, and ``alloc.audit()`` at the end (with the cache held, and after
``prefix_cache.drop_all()``).

Exit status 0 when every run matches transformers. Negative controls (must fail):
``--alloc-window W-2`` (the allocator frees a position the SWA layers read) and, with the
tables, ``--attention-window W-1`` (the SWA tables and mask drop one position).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

if not torch.cuda.is_available():  # Triton kernels (if chosen) run in the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import timing  # noqa: E402
from hybrid_model import (  # noqa: E402
    ModelConfig,
    TinyHybridLM,
    allocator_window,
    random_weights,
    to_transformers,
)
from paged_decode import DecodeLoop, LoopResult, Request  # noqa: E402

import graphalloc as ga  # noqa: E402

__all__ = ["main", "make_requests", "build_allocator", "reference", "compare"]


def make_requests(n: int, prompt_len: tuple[int, int], output_len: tuple[int, int], vocab: int,
                  seed: int, prefix=None) -> list[Request]:
    """``n`` requests, prompt and output lengths uniform in the given inclusive ranges;
    ``prefix`` (token ids, optional) is prepended to every prompt."""
    rng = np.random.default_rng(seed)
    reqs = []
    for i in range(n):
        p = int(rng.integers(prompt_len[0], prompt_len[1] + 1))
        o = int(rng.integers(output_len[0], output_len[1] + 1))
        prompt = rng.integers(0, vocab, size=p).astype(np.int64)
        if prefix is not None:
            prompt = np.concatenate([np.asarray(prefix, dtype=np.int64), prompt])
        reqs.append(Request(i, prompt, o))
    return reqs


def system_prompt(n: int, vocab: int, seed: int) -> np.ndarray:
    """The shared system prompt of ``--shared-prompt n`` (its own random stream)."""
    return np.random.default_rng([seed, 7]).integers(0, vocab, size=n).astype(np.int64)


def build_allocator(*, page_size: int, max_batch: int, max_prompt: int, max_total: int,
                    alloc_window: int, device: str, backend: str,
                    shared_prompt: int = 0) -> ga.HybridAllocator:
    """An allocator sized for the workload: ``2 * max_batch`` request rows (finished rows
    wait one step for their release while new requests are admitted), FULL pages for
    every row at full length, SWA pages for every row's prompt plus its window.
    ``shared_prompt`` > 0: a prefix cache with a few handles, and room for its pages."""
    ps = page_size
    max_reqs = 2 * max_batch
    extra = -(-shared_prompt // ps) + 1 if shared_prompt else 0  # the cached prefix's pages
    cfg = ga.AllocatorConfig(
        page_size=ps, max_reqs=max_reqs, max_context_len=max_total,
        num_full_pages=max_reqs * -(-max_total // ps) + extra,
        num_swa_pages=max_reqs * (-(-max_prompt // ps) + -(-alloc_window // ps) + 2) + extra,
        sliding_window=alloc_window, max_handles=4 if shared_prompt else 0,
        device=device, backend=backend)
    return ga.HybridAllocator(cfg, prefix_cache=bool(shared_prompt))


def reference(cfg: ModelConfig, weights, requests: list[Request], progress=None):
    """Greedy generation by transformers with its own cache, one request at a time (CPU).
    Returns ``{serial: tokens}``, ``{serial: logits [n_out, vocab]}``."""
    hf = to_transformers(cfg, weights)
    tokens, logits = {}, {}
    with torch.no_grad():
        for r in requests:
            ids = torch.from_numpy(r.prompt)[None]
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=r.n_out, min_new_tokens=r.n_out,
                              output_logits=True, return_dict_in_generate=True,
                              pad_token_id=0)
            tokens[r.serial] = out.sequences[0, len(r.prompt):].tolist()
            logits[r.serial] = torch.cat(out.logits, 0).float().numpy()
            if progress is not None:
                progress.update(1)
    return tokens, logits


def compare(result: LoopResult, ref_tokens: dict, ref_logits: dict, atol: float) -> dict:
    """Tokens must be identical; logits are compared up to the first differing token
    (after it the two runs see different inputs)."""
    n_tok = n_bad_req = 0
    max_diff = 0.0
    first_bad = None
    for s, ref in ref_tokens.items():
        ours = result.tokens[s]
        n_tok += len(ref)
        diff = [i for i, (a, b) in enumerate(zip(ours, ref, strict=True)) if a != b]
        upto = (diff[0] + 1) if diff else len(ref)
        if result.logits is not None:
            d = np.abs(result.logits[s][:upto] - ref_logits[s][:upto]).max(axis=-1)
            max_diff = max(max_diff, float(d.max()))
        if diff:
            n_bad_req += 1
            if first_bad is None:
                top2 = np.sort(ref_logits[s][diff[0]])[-2:]
                first_bad = {"request": s, "index": diff[0], "ours": ours[diff[0]],
                             "transformers": ref[diff[0]],
                             "transformers_top2_gap": float(top2[1] - top2[0])}
    return {"tokens_equal": n_bad_req == 0, "requests_differing": n_bad_req,
            "tokens_compared": n_tok, "max_logit_diff": max_diff,
            "logits_within_atol": max_diff <= atol, "first_difference": first_bad}


def summarize(result: LoopResult, mcfg: ModelConfig, ps: int) -> dict:
    """Per-step series and totals, all from host-side numbers."""
    steps = result.steps
    full = np.array([s["full_used_pages"] for s in steps])
    swa = np.array([s["swa_used_pages"] for s in steps])
    n_l, n_s = mcfg.num_layers, mcfg.n_swa_layers
    all_full = n_l * full
    hybrid = (n_l - n_s) * full + n_s * swa
    saved = np.where(all_full > 0, 1.0 - hybrid / np.maximum(all_full, 1), np.nan)
    token_bytes = ps * mcfg.kv_bytes_per_token_layer()
    peak = int(np.argmax(all_full))
    evict = np.array([s["swa_pages_evicted"] for s in steps])
    host_us = np.array(result.host_step_s) * 1e6
    return {
        "steps": len(steps),
        "steps_with_evictions": int((evict > 0).sum()),
        "swa_clipped_lanes": (None if not steps or steps[0]["swa_clipped_lanes"] is None
                              else int(sum(s["swa_clipped_lanes"] for s in steps))),
        "swa_pages_evicted": int(evict.sum()),
        "requests_released": int(sum(s["released"] for s in steps)),
        "pages_allocated": {k: int(sum(s["pages_allocated"][k] for s in steps))
                            + result.prefill_pages[k] for k in ("full", "swa")},
        "pages_freed": {k: int(sum(s["pages_freed"][k] for s in steps)) for k in ("full", "swa")},
        "peak_full_pages": int(full.max()), "peak_swa_pages": int(swa.max()),
        "kv_bytes_at_peak": {"hybrid": int(hybrid[peak]) * token_bytes,
                             "all_full": int(all_full[peak]) * token_bytes},
        "memory_saved_at_peak": float(saved[peak]),
        "memory_saved_mean": float(np.nanmean(saved)) if (all_full > 0).any() else 0.0,
        "host_us_per_step": timing.summarize(host_us),
        "wall_s": result.wall_s, "prefill_s": result.prefill_s,
        "steps_per_s": len(steps) / result.wall_s,
        "ring_stalls": result.ring_stalls,
        "graph_nodes": result.graph_nodes,
        "series": {"full_used_pages": full.tolist(), "swa_used_pages": swa.tolist(),
                   "memory_saved": [None if np.isnan(x) else round(float(x), 4) for x in saved],
                   "swa_pages_evicted": evict.tolist(),
                   "decode_lanes": [s["decode"] for s in steps]},
    }


def plot(runs: list[dict], path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return False
    fig, axes = plt.subplots(len(runs), 2, figsize=(12, 3.2 * len(runs)), squeeze=False)
    for (ax_pages, ax_saved), run in zip(axes, runs, strict=True):
        s, ps = run["summary"]["series"], run["page_size"]
        ax_pages.plot(s["full_used_pages"], label="FULL pages in use")
        ax_pages.plot(s["swa_used_pages"], label="SWA pages in use")
        ax_pages.bar(range(len(s["swa_pages_evicted"])), s["swa_pages_evicted"], color="0.7",
                     label="SWA pages evicted this step")
        ax_pages.set_title(f"page_size {ps}: pages in use per decode step")
        ax_pages.set_xlabel("decode step")
        ax_pages.legend(fontsize=8)
        saved = np.array([np.nan if x is None else x for x in s["memory_saved"]])
        ax_saved.plot(100 * saved, color="C2")
        ax_saved.set_ylim(0, 100)
        ax_saved.axhline(100 * run["max_saving"], color="0.6", ls="--", lw=1,
                         label="bound: SWA layers hold nothing")
        ax_saved.legend(fontsize=8)
        ax_saved.set_title(f"page_size {ps}: KV memory saved vs. full KV in every layer (%)")
        ax_saved.set_xlabel("decode step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def markdown(cfg: dict, runs: list[dict]) -> str:
    lines = [f"# decode_loop: {cfg['device']}, graph={cfg['graph']}, backend={cfg['backend']}, "
             f"attention={cfg['attention']}", "",
             f"Model: {cfg['model']}; {cfg['requests']} requests, {cfg['max_batch']} lanes, "
             f"sync debug {cfg['sync_debug']}; transformers {cfg.get('transformers')}", "",
             f"Machine: {cfg['machine']['summary']}", "",
             "| ps | steps | steps w/ evictions | SWA pages evicted | peak FULL / SWA pages "
             "| memory saved (peak, mean) | tokens equal | max logit diff | host us/step "
             "| steps/s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        s, c = run["summary"], run.get("comparison") or {}
        lines.append(
            f"| {run['page_size']} | {s['steps']} | {s['steps_with_evictions']} "
            f"| {s['swa_pages_evicted']} | {s['peak_full_pages']} / {s['peak_swa_pages']} "
            f"| {100 * s['memory_saved_at_peak']:.1f}%, {100 * s['memory_saved_mean']:.1f}% "
            f"| {c.get('tokens_equal', 'n/a')} | {c.get('max_logit_diff', float('nan')):.2e} "
            f"| {s['host_us_per_step']['p50']:.0f} | {s['steps_per_s']:.0f} |")
    shared = [run for run in runs if run.get("sharing")]
    if shared:
        lines += ["", f"Shared system prompt of {shared[0]['sharing']['prefix_tokens']} tokens "
                  "from the prefix cache (`--shared-prompt`):", "",
                  "| ps | prefix tokens cached | requests sharing / carrying "
                  "| prefill tokens saved / computed | KV pages saved (FULL, SWA) "
                  "| cache hits / misses | audit (cache held, after drop_all) |",
                  "|---|---|---|---|---|---|---|"]
        for run in shared:
            sh = run["sharing"]
            audit = ("[] / []" if not sh["audit_with_cache"] and not sh["audit_after_drop"]
                     else f"{len(sh['audit_with_cache'])} / {len(sh['audit_after_drop'])} "
                     "findings")
            lines.append(
                f"| {run['page_size']} | {sh['cached_prefix_tokens']} "
                f"| {sh['requests_sharing']} / {sh['requests_carrying']} "
                f"| {sh['prefill_tokens_saved']} / {sh['prefill_tokens_computed']} "
                f"| {sh['pages_saved']['full']}, {sh['pages_saved']['swa']} "
                f"| {sh['cache_hits']} / {sh['cache_misses']} | {audit} |")
    return "\n".join(lines) + "\n"


def _progress(total, desc, enabled):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, leave=False, file=sys.stderr)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    choices=["cpu", "cuda"])
    ap.add_argument("--graph", action="store_true",
                    help="capture each decode step as one CUDA graph (needs --device cuda)")
    ap.add_argument("--sync-debug", action="store_true",
                    help="run the loop under torch.cuda.set_sync_debug_mode('error')")
    ap.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"])
    ap.add_argument("--page-sizes", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--max-batch", type=int, default=24, help="decode lanes per step")
    ap.add_argument("--prompt-len", type=int, nargs=2, default=[4, 40], metavar=("MIN", "MAX"))
    ap.add_argument("--output-len", type=int, nargs=2, default=[24, 96], metavar=("MIN", "MAX"))
    ap.add_argument("--window", type=int, default=16,
                    help="the model's sliding window W (transformers convention)")
    ap.add_argument("--alloc-window", type=int, default=None,
                    help="the allocator's sliding_window (default W - 1, the smallest that "
                         "keeps what the model reads; smaller ones must fail the check)")
    ap.add_argument("--attention", default="tables", choices=["tables", "gather"],
                    help="decode attention through the page tables written in the step, or "
                         "by gathering slots from req_to_token / full_to_swa")
    ap.add_argument("--attention-window", type=int, default=None,
                    help="with --attention tables: the window of the SWA tables and of the "
                         "attention mask (default the model's; a smaller one must fail)")
    ap.add_argument("--attention-backend", default="auto", choices=["auto", "triton", "torch"],
                    help="with --attention tables: the paged Triton kernel, its Torch twin, "
                         "or auto (Triton on CUDA, the twin on a CPU)")
    ap.add_argument("--shared-prompt", type=int, default=0, metavar="N",
                    help="prepend one N-token system prompt to every request and serve it "
                         "from the allocator's prefix cache (0: off)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--layer-pattern", default="sf", help="'s' sliding, 'f' full, repeated")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--atol", type=float, default=2e-3, help="logit tolerance (float32)")
    ap.add_argument("--no-reference", action="store_true", help="skip the transformers check")
    ap.add_argument("--out", default="decode_loop_out",
                    help="directory for decode_loop.{json,md,png}; '' writes nothing")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    if args.graph and args.device != "cuda":
        ap.error("--graph needs --device cuda (on a CPU the loop runs eagerly)")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda but torch sees no GPU")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    with timing.cpu_threads(args.device):
        return _main(args)


def _main(args: argparse.Namespace) -> dict:
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 everywhere: exact comparison
    torch.backends.cudnn.allow_tf32 = False
    mcfg = ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                       intermediate_size=2 * args.hidden, num_layers=args.layers,
                       num_heads=args.heads, num_kv_heads=args.kv_heads,
                       sliding_window=args.window, layer_pattern=args.layer_pattern)
    weights = random_weights(mcfg, args.seed)
    prefix = (system_prompt(args.shared_prompt, args.vocab, args.seed)
              if args.shared_prompt else None)
    requests = make_requests(args.requests, tuple(args.prompt_len), tuple(args.output_len),
                             args.vocab, args.seed + 1, prefix)
    max_prompt = max(len(r.prompt) for r in requests)
    max_out = max(r.n_out for r in requests)
    alloc_window = args.alloc_window or allocator_window(args.window)
    backend, _ = timing.pick_backend(args.backend, args.device)
    show = not args.no_progress
    print(f"model: {mcfg.num_layers} layers {mcfg.layer_types}, window {mcfg.sliding_window} "
          f"(allocator {alloc_window}); {len(requests)} requests, prompts "
          f"{args.prompt_len[0]}-{args.prompt_len[1]}, outputs {args.output_len[0]}-"
          f"{args.output_len[1]}, {args.max_batch} lanes; device {args.device}, "
          f"graph={args.graph}, backend {backend}, attention {args.attention}")

    ref = None
    if not args.no_reference:
        t0 = time.perf_counter()
        bar = _progress(len(requests), "transformers reference", show)
        ref = reference(mcfg, weights, requests, bar)
        if bar is not None:
            bar.close()
        print(f"transformers reference: {time.perf_counter() - t0:.1f} s")

    runs = []
    for ps in args.page_sizes:
        alloc = build_allocator(page_size=ps, max_batch=args.max_batch, max_prompt=max_prompt,
                                max_total=max_prompt + max_out, alloc_window=alloc_window,
                                device=args.device, backend=backend,
                                shared_prompt=args.shared_prompt)
        model = TinyHybridLM(mcfg, weights, args.device)
        loop = DecodeLoop(model, alloc, max_batch=args.max_batch, n_serials=len(requests),
                          max_out=max_out, graph=args.graph, attention=args.attention,
                          attention_window=args.attention_window,
                          attention_backend=args.attention_backend, shared_prefix=prefix)
        if args.graph:
            loop.capture()
        bar = _progress(None, f"decode ps={ps}", show)
        result = loop.run(requests, progress=bar, sync_debug=args.sync_debug)
        if bar is not None:
            bar.close()
        alloc.check()
        alloc.check_integrity()
        if alloc.n_live > 0:
            raise RuntimeError("requests still live after the loop")
        sharing = None
        if result.sharing is not None:  # the cache still holds the prefix; then drop it
            sharing = {**result.sharing, "cache_hits": alloc.prefix_cache.hits,
                       "cache_misses": alloc.prefix_cache.misses,
                       "cache_evicted_pages": alloc.prefix_cache.evicted_pages,
                       "cache_tombstoned_pages": alloc.prefix_cache.tombstoned_pages,
                       "audit_with_cache": [str(f) for f in alloc.audit()]}
            alloc.prefix_cache.drop_all()
            st = alloc.stats()
            sharing["audit_after_drop"] = [str(f) for f in alloc.audit()]
            sharing["pages_used_after_drop"] = {"full": st["full_used_pages"],
                                                "swa": st["swa_used_pages"]}
        summary = summarize(result, mcfg, ps)
        run = {"page_size": ps, "alloc_window": alloc_window, "attention": args.attention,
               "attention_window": (loop.page_tables.spec.sliding_window
                                    if loop.page_tables is not None else None),
               "attention_backend": loop.attention_backend, "summary": summary,
               "max_saving": mcfg.n_swa_layers / mcfg.num_layers,
               "host_syncs_in_loop": 0 if (args.sync_debug and args.device == "cuda") else None,
               "tokens": {str(k): v for k, v in result.tokens.items()}}
        if sharing is not None:
            run["sharing"] = sharing
        if ref is not None:
            run["comparison"] = compare(result, ref[0], ref[1], args.atol)
        runs.append(run)
        c = run.get("comparison")
        verdict = ("no reference" if c is None else
                   f"tokens equal: {c['tokens_equal']} ({c['tokens_compared']} tokens), "
                   f"max |logit diff| {c['max_logit_diff']:.2e}")
        print(f"ps={ps:>3}: {summary['steps']} steps ({summary['steps_with_evictions']} with "
              f"evictions, {summary['swa_pages_evicted']} SWA pages evicted), "
              f"{summary['requests_released']} requests released; peak pages FULL "
              f"{summary['peak_full_pages']} SWA {summary['peak_swa_pages']}; KV memory saved "
              f"{100 * summary['memory_saved_at_peak']:.1f}% at peak "
              f"(mean {100 * summary['memory_saved_mean']:.1f}%); {verdict}")
        print(f"        host {summary['host_us_per_step']['p50']:.0f} us/step (median), "
              f"{summary['steps_per_s']:.0f} steps/s incl. prefill, "
              f"{summary['ring_stalls']} descriptor-ring waits (for the GPU), integrity ok"
              + (", 0 host syncs (sync debug 'error')" if run["host_syncs_in_loop"] == 0 else "")
              + (f", graph nodes {summary['graph_nodes']}" if summary["graph_nodes"] else ""))
        if run["attention"] == "tables":
            print(f"        attention through the page tables ({run['attention_backend']}, "
                  f"window {run['attention_window']}): {summary['swa_clipped_lanes']} lane-steps "
                  "with the SWA range clipped at the frontier")
        if sharing is not None:
            sh = sharing
            print(f"        shared prompt {sh['prefix_tokens']} tokens "
                  f"({sh['cached_prefix_tokens']} cached): {sh['requests_sharing']}/"
                  f"{sh['requests_carrying']} requests "
                  f"shared it, prefill tokens saved {sh['prefill_tokens_saved']} (computed "
                  f"{sh['prefill_tokens_computed']}), KV pages saved FULL "
                  f"{sh['pages_saved']['full']} SWA {sh['pages_saved']['swa']}; audit "
                  f"{len(sh['audit_with_cache'])} findings with the cache, "
                  f"{len(sh['audit_after_drop'])} after drop_all")

    ok = all(r.get("comparison", {}).get("tokens_equal", True)
             and r.get("comparison", {}).get("logits_within_atol", True)
             and not (r.get("sharing") or {}).get("audit_with_cache")
             and not (r.get("sharing") or {}).get("audit_after_drop") for r in runs)
    cfg = {"args": vars(args), "device": args.device, "graph": args.graph,
           "sync_debug": args.sync_debug, "backend": backend, "attention": args.attention,
           "machine": timing.machine_info(args.device),
           "model": {"layers": mcfg.layer_types, "hidden": mcfg.hidden_size,
                     "heads": mcfg.num_heads, "kv_heads": mcfg.num_kv_heads,
                     "vocab": mcfg.vocab_size, "window": mcfg.sliding_window},
           "requests": len(requests), "max_batch": args.max_batch, "atol": args.atol}
    try:
        import transformers
        cfg["transformers"] = transformers.__version__
    except ImportError:
        pass
    out = {"ok": ok, "config": cfg, "runs": runs}
    if args.out:
        d = Path(args.out)
        d.mkdir(parents=True, exist_ok=True)
        (d / "decode_loop.json").write_text(json.dumps(out, indent=1, default=_json_default))
        (d / "decode_loop.md").write_text(markdown(cfg, runs))
        if plot(runs, d / "decode_loop.png"):
            print(f"wrote {d}/decode_loop.json, .md, .png")
    print("MATCH: every request's tokens equal transformers'" if ok and ref is not None else
          "MISMATCH against transformers" if not ok else "done (no reference check)")
    return out


def _json_default(o):
    if isinstance(o, np.integer | np.floating):
        return o.item()
    if isinstance(o, float) and math.isnan(o):
        return None
    raise TypeError(type(o).__name__)


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
