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
(``--attention tables``, the default): the allocator is built with
``page_tables=PageTableSpec(max_batch, forms=("csr",), model_window=W)``, so the graph of a
step holds the allocator's step -- which writes the FULL and SWA CSR page tables of the
step's batch into ``alloc.tables`` after its allocations -- the model whose attention layers
read only those tables (the paged Triton kernel on a GPU, its Torch twin on a CPU:
``graphalloc.kernels.paged_attention``) and the argmax.
``--attention gather`` keeps the earlier path (every layer gathers its slots from
``req_to_token`` / ``full_to_swa``). ``--attention flashinfer``: the same page tables read by
FlashInfer's paged decode (``BatchDecodeWithPagedKVCacheWrapper``, one FULL + SWA pair per
descriptor buffer built once with ``use_cuda_graph=True`` on ``alloc.tables``' buffers,
planned each step from the step's pinned host copies ``p.tables``, ``run()`` captured in the
step's graph with ``alloc.launch(i)``; see
``paged_decode.py`` and ``flashinfer_tables.py``). FlashInfer is imported only in that
mode; it needs CUDA, a half-precision model (``--dtype float16`` or ``bfloat16``: its decode
has no float32 kernels) and a head dim of 64, 128 or 256 (default model in this mode:
hidden 1024, 8 query / 2 KV heads, head_dim 128).

``--dtype float16`` / ``bfloat16`` (any attention mode): our model AND the transformers
reference run in that dtype on the same device (``--device``), the reference with SDPA
attention by default (``--reference-attn``: fp32 scores and softmax, as FlashInfer and the
Triton kernel compute them; ``eager`` rounds the scores to the dtype first), cuBLAS without
reduced-precision reductions. Our model's math follows transformers' in that dtype
(``hybrid_model.py``). Tokens are compared exactly; logits within ``--atol`` (default
2e-3 in float32, 0.125 in float16, 1.0 in bfloat16: 16 fp16 / 8 bf16 ulps of a logit of
magnitude 8). Two half-precision computations that are not bit-identical (FlashInfer's or
the Triton kernel's attention against transformers' SDPA, batched GEMMs against batch-1
ones) differ by a few ulps in the logits, so wherever transformers' own top-1 and top-2
logits are that close (a near tie; exact ties are common at fp16's resolution) greedy
decoding may take the other token, and that request's continuation differs from there on.
The comparison records, for every request that differs, the reference's top-1 minus top-2
margin at its first differing token and the largest logit difference before it; and in
half precision a teacher-forced check (transformers' logits for OUR tokens, every
position: each of our tokens must be transformers' argmax or within ``--atol`` of it, every
logit within ``--atol``) covers the tokens after a first difference too. A run's verdict:
``tokens equal``; ``equal up to near ties`` (half precision: every difference is at a
margin within ``--atol`` and the teacher-forced check passes); else ``mismatch``. The
negative controls must end ``mismatch``.

The same random weights are loaded into ``transformers``' ``Qwen2ForCausalLM``
(``layer_types`` mixing sliding and full attention), which generates greedily
with its own cache. Every request's tokens must be identical and every step's
logits within ``--atol``. Then the script prints, and plots, the full and SWA
pages in use per step and the KV memory saved against giving every layer full KV.

CPU (eager, tiny sizes)::

    python examples/model_loops/decode_loop.py

GPU (each step one graph replay, any host sync raises)::

    python examples/model_loops/decode_loop.py --device cuda --graph --sync-debug --out DIR

``--shared-prompt N``: every request's prompt starts with the same N-token system prompt,
served from the allocator's prefix cache (``prefix_cache=True``): the first request
prefills it and inserts it, every later one is admitted on the cached handle and prefills
only the rest of its prompt (``paged_decode.py``). The result states the prefill tokens
and the KV pages saved, and ``alloc.audit()`` at the end (with the cache held, and after
``prefix_cache.drop_all()``).

Exit status 0 when every run matches transformers. Negative controls (must fail):
``--alloc-window W-2`` (the allocator frees a position the SWA layers read) and, with the
tables (or FlashInfer), ``--attention-window W-1`` (the SWA tables and mask drop one
position). ``--negative-control`` runs them in the same command after the main runs (every
page size, the same reference), and the exit status is 0 only if the main runs match and
every control differs from transformers.

GPU, FlashInfer (page sizes 1 and 16, JIT compile on first use, both controls)::

    python examples/model_loops/decode_loop.py --device cuda --graph --sync-debug \
        --attention flashinfer \
        --dtype float16 --negative-control --out DIR
"""

from __future__ import annotations

import argparse
import gc
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
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import timing  # noqa: E402
from figures import plot_decode_loop_example  # noqa: E402
from hybrid_model import (  # noqa: E402
    DTYPES,
    ModelConfig,
    TinyHybridLM,
    allocator_window,
    random_weights,
    to_transformers,
)
from paged_decode import (  # noqa: E402
    FLASHINFER_HEAD_DIMS,
    DecodeLoop,
    LoopResult,
    Request,
    decode_tables_spec,
)
from provenance import add_stamp_option, stamp_or_exit  # noqa: E402

import graphalloc as ga  # noqa: E402

__all__ = ["main", "make_requests", "build_allocator", "reference", "compare",
           "default_atol", "resolve_model_args"]

# the default --out is a folder of the repository's one results tree
RESULTS = Path(__file__).resolve().parents[2] / "results" / "examples"
# logit tolerance per dtype (also the near-tie margin): float32 as before; in half precision
# 16 ulps of a logit of magnitude 8 (fp16 ulp 2^-7 there, bf16 2^-4 -> 8 ulps): at least
# twice the largest difference seen between our half-precision model and transformers' SDPA
# on a CPU (fp16 0.05, bf16 0.34), far below what a negative control changes (about 7)
ATOL = {"float32": 2e-3, "float16": 0.125, "bfloat16": 1.0}
# model sizes: the tiny default, and FlashInfer's (head_dim 128, GQA 4: the GPU-checked shapes)
MODEL_SIZES = {"default": {"hidden": 64, "heads": 4, "kv_heads": 2},
               "flashinfer": {"hidden": 1024, "heads": 8, "kv_heads": 2}}


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
                    shared_prompt: int = 0, tables_window: int | None = None
                    ) -> ga.HybridAllocator:
    """An allocator sized for the workload: ``2 * max_batch`` request rows (finished rows
    wait one step for their release while new requests are admitted), FULL pages for
    every row at full length, SWA pages for every row's prompt plus its window.
    ``shared_prompt`` > 0: a prefix cache with a few handles, and room for its pages.
    ``tables_window`` (W): every step also writes its batch's CSR page tables, FULL and
    SWA (``paged_decode.decode_tables_spec(max_batch, W)``); None: no tables."""
    ps = page_size
    max_reqs = 2 * max_batch
    extra = -(-shared_prompt // ps) + 1 if shared_prompt else 0  # the cached prefix's pages
    cfg = ga.AllocatorConfig(
        page_size=ps, max_reqs=max_reqs, max_context_len=max_total,
        num_full_pages=max_reqs * -(-max_total // ps) + extra,
        num_swa_pages=max_reqs * (-(-max_prompt // ps) + -(-alloc_window // ps) + 2) + extra,
        model_window=alloc_window + 1, max_handles=4 if shared_prompt else 0,
        device=device, backend=backend)
    tables = None if tables_window is None else decode_tables_spec(max_batch, tables_window)
    return ga.HybridAllocator(cfg, prefix_cache=bool(shared_prompt), page_tables=tables)


def reference(cfg: ModelConfig, weights, requests: list[Request], progress=None, *,
              device="cpu", dtype: torch.dtype = torch.float32,
              attn_implementation: str = "eager", model=None):
    """Greedy generation by transformers with its own cache, one request at a time
    (default: float32 on the CPU, eager attention; ``device`` / ``dtype`` /
    ``attn_implementation``: see ``hybrid_model.to_transformers``; ``model``: an already
    built one, on ``device``). Returns ``{serial: tokens}``, ``{serial: logits [n_out,
    vocab]}`` (float32 numpy)."""
    hf = model if model is not None else to_transformers(
        cfg, weights, device=device, dtype=dtype, attn_implementation=attn_implementation)
    tokens, logits = {}, {}
    with torch.no_grad():
        for r in requests:
            ids = torch.from_numpy(r.prompt)[None].to(device)
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=r.n_out, min_new_tokens=r.n_out,
                              output_logits=True, return_dict_in_generate=True,
                              pad_token_id=0)
            tokens[r.serial] = out.sequences[0, len(r.prompt):].tolist()
            logits[r.serial] = torch.cat(out.logits, 0).float().cpu().numpy()
            if progress is not None:
                progress.update(1)
    return tokens, logits


def teacher_forced(hf, requests: list[Request], result: LoopResult, atol: float,
                   device="cpu") -> dict:
    """transformers' logits for OUR tokens: one forward per request over its prompt and
    our generated tokens but the last, so every generated position is checked, also past a
    first difference (where the free-running comparison stops). At each position our token
    must be transformers' argmax, or within ``atol`` of it (a near tie: transformers'
    top logit minus its logit of our token, ``margin``, at most ``atol``), and our logits
    within ``atol`` of transformers'. Cost: one forward of ``prompt + n_out - 1`` tokens per
    request."""
    n_tok = n_disagree = 0
    max_diff = max_margin = 0.0
    beyond, ties = [], []
    with torch.no_grad():
        for r in requests:
            ours = np.asarray(result.tokens[r.serial], dtype=np.int64)
            seq = np.concatenate([r.prompt, ours[:-1]])
            ids = torch.from_numpy(seq)[None].to(device)
            lg = hf(ids, attention_mask=torch.ones_like(ids)).logits[0, len(r.prompt) - 1:]
            lg = lg.float().cpu().numpy()  # [n_out, vocab]
            n_tok += len(ours)
            top = lg.argmax(axis=-1)
            margin = lg.max(axis=-1) - lg[np.arange(len(ours)), ours]
            max_margin = max(max_margin, float(margin.max()))
            if result.logits is not None:
                max_diff = max(max_diff, float(np.abs(result.logits[r.serial] - lg).max()))
            for i in np.flatnonzero(top != ours):
                n_disagree += 1
                rec = {"request": r.serial, "index": int(i), "ours": int(ours[i]),
                       "transformers": int(top[i]), "margin": float(margin[i])}
                (ties if margin[i] <= atol else beyond).append(rec)
    return {"ok": not beyond and max_diff <= atol, "tokens_checked": n_tok,
            "argmax_equal": n_tok - n_disagree, "near_ties": len(ties),
            "beyond_tolerance": len(beyond), "max_margin_over_ours": max_margin,
            "max_logit_diff": max_diff, "logits_within_atol": max_diff <= atol, "atol": atol,
            "near_tie_list": ties[:50], "beyond_list": beyond[:50]}


def run_verdict(run: dict, dtype: str) -> str:
    """``"tokens equal"``, ``"equal up to near ties"`` (half precision only: every request
    whose free-running tokens differ does so at a near tie, transformers' margin of its
    token over ours at most atol, logits within atol up to there, and the teacher-forced
    check passes over every token) or ``"mismatch"``; ``"no reference"``."""
    c = run.get("comparison")
    if c is None:
        return "no reference"
    if not c["logits_within_atol"]:
        return "mismatch"
    tf = run.get("teacher_forced")
    if tf is not None and not tf["ok"]:
        return "mismatch"
    if c["tokens_equal"]:
        return "tokens equal"
    if dtype != "float32" and tf is not None and all(
            d["transformers_margin_over_ours"] <= c["atol"] for d in c["differences"]):
        return "equal up to near ties"
    return "mismatch"


def compare(result: LoopResult, ref_tokens: dict, ref_logits: dict, atol: float) -> dict:
    """Tokens must be identical; logits are compared up to the first differing token
    (after it the two runs see different inputs).

    ``differences``: every request whose tokens differ, at its first differing token: our
    token and transformers', the reference's top-1 minus top-2 logit margin there
    (``transformers_top2_gap``; a near tie when it is within the logit noise), the margin
    of transformers' token over ours in the reference's logits and in ours, and the largest
    logit difference up to that token. ``min_top2_gap``: the smallest reference margin over
    every token compared (how close to a tie the run came)."""
    n_tok = n_bad_req = 0
    max_diff = 0.0
    first_bad = None
    differences = []
    min_gap = (math.inf, None)
    for s, ref in ref_tokens.items():
        ours = result.tokens[s]
        n_tok += len(ref)
        diff = [i for i, (a, b) in enumerate(zip(ours, ref, strict=True)) if a != b]
        upto = (diff[0] + 1) if diff else len(ref)
        top2 = np.sort(ref_logits[s][:upto], axis=-1)[:, -2:]
        gaps = top2[:, 1] - top2[:, 0]
        if len(gaps) and float(gaps.min()) < min_gap[0]:
            min_gap = (float(gaps.min()), {"request": s, "index": int(np.argmin(gaps))})
        d_req = None
        if result.logits is not None:
            d = np.abs(result.logits[s][:upto] - ref_logits[s][:upto]).max(axis=-1)
            d_req = float(d.max())
            max_diff = max(max_diff, d_req)
        if diff:
            n_bad_req += 1
            i, a, b = diff[0], ours[diff[0]], ref[diff[0]]
            rec = {"request": s, "index": i, "ours": a, "transformers": b,
                   "transformers_top2_gap": float(gaps[i]),
                   "transformers_margin_over_ours": float(ref_logits[s][i, b]
                                                          - ref_logits[s][i, a]),
                   "max_logit_diff_upto": d_req}
            if result.logits is not None:
                rec["our_margin_over_transformers"] = float(result.logits[s][i, a]
                                                            - result.logits[s][i, b])
            differences.append(rec)
            if first_bad is None:
                first_bad = rec
    return {"tokens_equal": n_bad_req == 0, "requests_differing": n_bad_req,
            "tokens_compared": n_tok, "max_logit_diff": max_diff,
            "logits_within_atol": max_diff <= atol, "atol": atol,
            "first_difference": first_bad, "differences": differences,
            "min_top2_gap": None if min_gap[1] is None else {"gap": min_gap[0], **min_gap[1]}}


def summarize(result: LoopResult, mcfg: ModelConfig, ps: int, elt_bytes: int = 4) -> dict:
    """Per-step series and totals, all from host-side numbers (``elt_bytes``: bytes per K/V
    element, 4 in float32, 2 in half precision)."""
    steps = result.steps
    full = np.array([s["full_used_pages"] for s in steps])
    swa = np.array([s["swa_used_pages"] for s in steps])
    n_l, n_s = mcfg.num_layers, mcfg.n_swa_layers
    all_full = n_l * full
    hybrid = (n_l - n_s) * full + n_s * swa
    saved = np.where(all_full > 0, 1.0 - hybrid / np.maximum(all_full, 1), np.nan)
    token_bytes = ps * mcfg.kv_bytes_per_token_layer(elt_bytes)
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


def markdown(cfg: dict, runs: list[dict]) -> str:
    dtype = cfg.get("dtype", "float32")
    lines = [f"# decode_loop: {cfg['device']}, graph={cfg['graph']}, backend={cfg['backend']}, "
             f"attention={cfg['attention']}, dtype={dtype}", "",
             f"Model: {cfg['model']}; {cfg['requests']} requests, {cfg['max_batch']} lanes, "
             f"sync debug {cfg['sync_debug']}; transformers {cfg.get('transformers')}", "",
             f"Reference: transformers Qwen2ForCausalLM in {dtype} on {cfg.get('reference_device')}"
             f", attention {cfg.get('reference_attn')}; tokens compared exactly, logits within "
             f"atol {cfg['atol']:g}"
             + (f"; FlashInfer {cfg['flashinfer']['version']} (JIT "
                f"{cfg['flashinfer']['jit_seconds']:.1f} s)" if cfg.get("flashinfer") else ""),
             "", f"Machine: {cfg['machine']['summary']}", "",
             "| ps | steps | steps w/ evictions | SWA pages evicted | peak FULL / SWA pages "
             "| memory saved (peak, mean) | tokens equal | max logit diff | host us/step "
             "| steps/s | verdict |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        s, c = run["summary"], run.get("comparison") or {}
        lines.append(
            f"| {run['page_size']} | {s['steps']} | {s['steps_with_evictions']} "
            f"| {s['swa_pages_evicted']} | {s['peak_full_pages']} / {s['peak_swa_pages']} "
            f"| {100 * s['memory_saved_at_peak']:.1f}%, {100 * s['memory_saved_mean']:.1f}% "
            f"| {c.get('tokens_equal', 'n/a')} | {c.get('max_logit_diff', float('nan')):.2e} "
            f"| {s['host_us_per_step']['p50']:.0f} | {s['steps_per_s']:.0f} "
            f"| {run.get('verdict', '-')} |")
    tfs = [(run["page_size"], run["teacher_forced"]) for run in runs
           if run.get("teacher_forced")]
    if tfs:
        lines += ["", "Teacher-forced check (transformers' logits for our tokens, every "
                  "position; a near tie: transformers' top logit minus its logit of our "
                  f"token at most atol {cfg['atol']:g}):", "",
                  "| ps | tokens | transformers' argmax | near ties | beyond tolerance "
                  "| largest margin over ours | max logit diff |", "|---|---|---|---|---|---|---|"]
        for ps, tf in tfs:
            lines.append(f"| {ps} | {tf['tokens_checked']} | {tf['argmax_equal']} "
                         f"| {tf['near_ties']} | {tf['beyond_tolerance']} "
                         f"| {tf['max_margin_over_ours']:.3g} | {_num(tf['max_logit_diff'])} |")
    diffs = [(run["page_size"], d) for run in runs
             for d in (run.get("comparison") or {}).get("differences", [])]
    if diffs:
        lines += ["", "Requests whose tokens differ (first differing token; margin: the "
                  "reference's top-1 minus top-2 logit there):", "",
                  "| ps | request | token index | ours / transformers | reference margin "
                  "| transformers' token over ours (reference, ours) | max logit diff before |",
                  "|---|---|---|---|---|---|---|"]
        for ps, d in diffs:
            lines.append(f"| {ps} | {d['request']} | {d['index']} | {d['ours']} / "
                         f"{d['transformers']} | {d['transformers_top2_gap']:.3g} "
                         f"| {d['transformers_margin_over_ours']:.3g}, "
                         f"{-d.get('our_margin_over_transformers', float('nan')):.3g} "
                         f"| {_num(d['max_logit_diff_upto'])} |")
    gaps = [(run["page_size"], (run.get("comparison") or {}).get("min_top2_gap"))
            for run in runs]
    if any(g for _, g in gaps):
        lines += ["", "Smallest reference top-1 minus top-2 margin over the tokens compared: "
                  + ", ".join(f"ps {ps}: {g['gap']:.3g} (request {g['request']}, token "
                              f"{g['index']})" for ps, g in gaps if g)]
    controls = cfg.get("controls") or []
    if controls:
        lines += ["", "Negative controls (must differ from transformers):", "",
                  "| ps | control | tokens equal | requests differing | max logit diff "
                  "| teacher-forced beyond tolerance, max logit diff | verdict | detected |",
                  "|---|---|---|---|---|---|---|---|"]
        for c in controls:
            cmp_, tf = c["comparison"] or {}, c.get("teacher_forced")
            tf_txt = ("-" if tf is None else
                      f"{tf['beyond_tolerance']}, {_num(tf['max_logit_diff'])}")
            lines.append(f"| {c['page_size']} | {c['control']} | {cmp_.get('tokens_equal')} "
                         f"| {cmp_.get('requests_differing')} "
                         f"| {_num(cmp_.get('max_logit_diff'))} | {tf_txt} | {c['verdict']} "
                         f"| {c['detected']} |")
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


def _num(x) -> str:
    return "-" if x is None else f"{x:.2e}"


def _progress(total, desc, enabled):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, leave=False, file=sys.stderr)


def resolve_model_args(args: argparse.Namespace) -> None:
    """Fill the model sizes left unset (``--hidden``, ``--heads``, ``--kv-heads``) for the
    attention mode (FlashInfer: head_dim 128, 8 query / 2 KV heads; otherwise the tiny
    default), and ``--atol`` / ``--reference-attn`` for the dtype. In place."""
    sizes = MODEL_SIZES["flashinfer" if args.attention == "flashinfer" else "default"]
    for key, value in sizes.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.atol is None:
        args.atol = default_atol(args.dtype)
    if args.reference_attn == "auto":
        args.reference_attn = "eager" if args.dtype == "float32" else "sdpa"


def default_atol(dtype: str) -> float:
    """The logit tolerance of a run in ``dtype`` (``ATOL``)."""
    return ATOL[dtype]


def _check_flashinfer(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--attention flashinfer``: refuse (argparse error, exit status 2) before anything
    runs if FlashInfer does not import, the dtype is float32, the device is not CUDA or the
    head dim is not one FlashInfer's decode is built for."""
    from flashinfer_tables import import_flashinfer
    try:
        args.flashinfer_module = import_flashinfer()
    except ImportError as exc:
        ap.error(f"--attention flashinfer: {exc}. Install flashinfer-python (or put it on "
                 "PYTHONPATH), or use --attention tables")
    if args.dtype == "float32":
        ap.error("--attention flashinfer needs --dtype float16 or bfloat16: FlashInfer's "
                 "decode kernels have no float32 variant")
    if args.device != "cuda":
        ap.error("--attention flashinfer needs --device cuda (FlashInfer runs on CUDA only)")
    head_dim = args.hidden // args.heads if args.heads else 0
    if head_dim not in FLASHINFER_HEAD_DIMS or args.hidden % args.heads:
        ap.error(f"--attention flashinfer needs a head dim (--hidden / --heads) in "
                 f"{FLASHINFER_HEAD_DIMS}, got {args.hidden} / {args.heads}")


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
    ap.add_argument("--attention", default="tables", choices=["tables", "gather", "flashinfer"],
                    help="decode attention through the page tables written in the step (the "
                         "paged Triton kernel / its twin), by gathering slots from "
                         "req_to_token / full_to_swa, or through the same page tables with "
                         "FlashInfer's paged decode (CUDA, --dtype float16 / bfloat16)")
    ap.add_argument("--attention-window", type=int, default=None,
                    help="with --attention tables / flashinfer: the window of the SWA tables "
                         "and of the attention mask (default the model's; a smaller one "
                         "must fail)")
    ap.add_argument("--attention-backend", default="auto", choices=["auto", "triton", "torch"],
                    help="with --attention tables: the paged Triton kernel, its Torch twin, "
                         "or auto (Triton on CUDA, the twin on a CPU)")
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES),
                    help="our model's and the transformers reference's dtype (half precision: "
                         "both on --device)")
    ap.add_argument("--reference-attn", default="auto", choices=["auto", "eager", "sdpa"],
                    help="transformers' attention implementation (auto: eager in float32, "
                         "sdpa in half precision)")
    ap.add_argument("--negative-control", action="store_true",
                    help="after the main runs, run the negative controls at every page size "
                         "(attention window W - 1 with the tables, allocator window W - 2); "
                         "each must differ from transformers")
    ap.add_argument("--shared-prompt", type=int, default=0, metavar="N",
                    help="prepend one N-token system prompt to every request and serve it "
                         "from the allocator's prefix cache (0: off)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--layer-pattern", default="sf", help="'s' sliding, 'f' full, repeated")
    ap.add_argument("--hidden", type=int, default=None,
                    help="hidden size (default 64; 1024 with --attention flashinfer)")
    ap.add_argument("--heads", type=int, default=None,
                    help="query heads (default 4; 8 with --attention flashinfer)")
    ap.add_argument("--kv-heads", type=int, default=None, help="KV heads (default 2)")
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--atol", type=float, default=None,
                    help="logit tolerance (default per dtype: " + ", ".join(
                        f"{k} {v:g}" for k, v in ATOL.items()) + ")")
    ap.add_argument("--no-reference", action="store_true", help="skip the transformers check")
    ap.add_argument("--out", default=str(RESULTS / "decode-loop"),
                    help="directory for decode_loop.{json,md,png}; '' writes nothing")
    ap.add_argument("--no-progress", action="store_true")
    add_stamp_option(ap)
    args = ap.parse_args(argv)
    resolve_model_args(args)
    args.flashinfer_module = None
    if args.attention == "flashinfer":
        _check_flashinfer(ap, args)
    if args.graph and args.device != "cuda":
        ap.error("--graph needs --device cuda (on a CPU the loop runs eagerly)")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda but torch sees no GPU")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    stamp_or_exit(args.out, __file__, argv, allow_dirty=args.allow_dirty)
    with timing.cpu_threads(args.device):
        return _main(args)


def _prebuild_flashinfer(args, head_dim: int) -> dict:
    """JIT-compile FlashInfer's two decode variants (no window, window) in one ninja run
    before the first plan() (``flashinfer_tables.prebuild``; an internal-API mismatch falls
    back to plan()'s lazy compile, a compile error raises)."""
    from flashinfer_tables import prebuild
    fi = args.flashinfer_module
    t0 = time.perf_counter()
    try:
        how = prebuild(fi, DTYPES[args.dtype], head_dim)["how"]
    except (ImportError, AttributeError, TypeError) as exc:
        how = f"lazy in plan() (prebuild unavailable: {type(exc).__name__}: {exc})"
    return {"version": getattr(fi, "__version__", "unknown"), "jit": how,
            "jit_seconds": time.perf_counter() - t0}


def _main(args: argparse.Namespace) -> dict:
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 everywhere: exact comparison
    torch.backends.cudnn.allow_tf32 = False
    dtype = DTYPES[args.dtype]
    if dtype != torch.float32:  # half-precision GEMMs accumulate in float32, split-K too
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
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
    # the float32 reference runs on the CPU (as it always has); half precision on our device
    ref_device = "cpu" if dtype == torch.float32 else args.device
    show = not args.no_progress
    print(f"model: {mcfg.num_layers} layers {mcfg.layer_types}, hidden {mcfg.hidden_size}, "
          f"heads {mcfg.num_heads}/{mcfg.num_kv_heads} (head_dim {mcfg.head_dim}), window "
          f"{mcfg.sliding_window} (allocator {alloc_window}); {len(requests)} requests, prompts "
          f"{args.prompt_len[0]}-{args.prompt_len[1]}, outputs {args.output_len[0]}-"
          f"{args.output_len[1]}, {args.max_batch} lanes; device {args.device}, "
          f"graph={args.graph}, backend {backend}, attention {args.attention}, dtype "
          f"{args.dtype}")

    fi_info = None
    if args.attention == "flashinfer":
        fi_info = _prebuild_flashinfer(args, mcfg.head_dim)
        print(f"flashinfer {fi_info['version']}: JIT {fi_info['jit_seconds']:.1f} s "
              f"({fi_info['jit']})")

    ref = hf = None
    if not args.no_reference:
        t0 = time.perf_counter()
        hf = to_transformers(mcfg, weights, device=ref_device, dtype=dtype,
                             attn_implementation=args.reference_attn)
        bar = _progress(len(requests), "transformers reference", show)
        ref = reference(mcfg, weights, requests, bar, device=ref_device, model=hf)
        if bar is not None:
            bar.close()
        print(f"transformers reference ({args.dtype} on {ref_device}, {args.reference_attn}): "
              f"{time.perf_counter() - t0:.1f} s")

    ctx = {"mcfg": mcfg, "weights": weights, "requests": requests, "prefix": prefix,
           "max_prompt": max_prompt, "max_out": max_out, "backend": backend, "ref": ref,
           "show": show, "dtype": dtype, "ref_device": ref_device,
           # half precision: transformers' logits for our tokens too (every position)
           "hf_teacher": hf if dtype != torch.float32 else None}
    runs = []
    for ps in args.page_sizes:
        runs.append(_run_page_size(args, ctx, ps, alloc_window, args.attention_window))
        _release_device_memory(args.device)
    controls = []
    if args.negative_control:
        for ps in args.page_sizes:
            for name, a_win, t_win in _controls(args, alloc_window):
                print(f"negative control ps={ps}: {name}")
                run = _run_page_size(args, ctx, ps, a_win, t_win, control=name)
                _release_device_memory(args.device)
                c = run.get("comparison")
                controls.append({"page_size": ps, "control": name, "alloc_window": a_win,
                                 "attention_window": run["attention_window"],
                                 "comparison": c, "teacher_forced": run.get("teacher_forced"),
                                 "verdict": run["verdict"],
                                 "summary_steps": run["summary"]["steps"],
                                 "swa_clipped_lanes": run["summary"]["swa_clipped_lanes"],
                                 "detected": (None if c is None
                                              else run["verdict"] == "mismatch")})

    ok = all(r["verdict"] in ("tokens equal", "equal up to near ties", "no reference")
             and not (r.get("sharing") or {}).get("audit_with_cache")
             and not (r.get("sharing") or {}).get("audit_after_drop") for r in runs)
    controls_ok = all(c["detected"] is not False for c in controls)
    cfg = {"args": {k: v for k, v in vars(args).items() if k != "flashinfer_module"},
           "device": args.device, "graph": args.graph,
           "sync_debug": args.sync_debug, "backend": backend, "attention": args.attention,
           "dtype": args.dtype, "reference_device": ref_device,
           "reference_attn": args.reference_attn,
           "machine": timing.machine_info(args.device),
           "model": {"layers": mcfg.layer_types, "hidden": mcfg.hidden_size,
                     "heads": mcfg.num_heads, "kv_heads": mcfg.num_kv_heads,
                     "vocab": mcfg.vocab_size, "window": mcfg.sliding_window},
           "requests": len(requests), "max_batch": args.max_batch, "atol": args.atol}
    if fi_info is not None:
        cfg["flashinfer"] = fi_info
    if controls:
        cfg["controls"] = controls
    try:
        import transformers
        cfg["transformers"] = transformers.__version__
    except ImportError:
        pass
    tokens_equal = all((r.get("comparison") or {}).get("tokens_equal", True) for r in runs)
    out = {"ok": ok and controls_ok, "runs_ok": ok, "tokens_equal": tokens_equal,
           "controls_ok": controls_ok, "verdicts": {r["page_size"]: r["verdict"] for r in runs},
           "config": cfg, "runs": runs, "controls": controls}
    if args.out:
        d = Path(args.out)
        d.mkdir(parents=True, exist_ok=True)
        (d / "decode_loop.json").write_text(json.dumps(out, indent=1, default=_json_default))
        (d / "decode_loop.md").write_text(markdown(cfg, runs))
        png = plot_decode_loop_example(out, d / "decode_loop.png")
        print(f"wrote {d}/decode_loop.json, .md" + (", .png" if png else
                                                    " (no plot: matplotlib is not installed)"))
    print("MATCH: every request's tokens equal transformers'"
          if ok and tokens_equal and ref is not None else
          "MATCH UP TO NEAR TIES: every request whose tokens differ from transformers' does "
          "so where transformers' own top-2 margin is within the logit tolerance "
          f"({args.atol:g}), and every token of ours is transformers' argmax or within it"
          if ok and ref is not None else
          "MISMATCH against transformers" if not ok else "done (no reference check)")
    if controls:
        print("negative controls: " + ("every one differs from transformers" if controls_ok
                                       else "SOME MATCHED transformers (not detected): "
                                       + ", ".join(f"ps {c['page_size']} {c['control']}"
                                                   for c in controls if c["detected"] is False)))
    return out


def _release_device_memory(device: str) -> None:
    """After a run on CUDA: collect the finished loop (its graphs and FlashInfer wrappers
    hold device and pinned memory) and hand cached blocks back."""
    if device == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def _controls(args, alloc_window: int) -> list[tuple[str, int, int | None]]:
    """``(name, allocator window, attention window)`` of each negative control: the tables'
    window one token short (table modes), the allocator's window one token short."""
    W = args.window
    out = []
    if args.attention in ("tables", "flashinfer"):
        out.append((f"attention window {W - 1} (W - 1)", alloc_window, W - 1))
    out.append((f"allocator window {W - 2} (W - 2)", W - 2, args.attention_window))
    return out


def _run_page_size(args, ctx: dict, ps: int, alloc_window: int, attention_window,
                   control: str | None = None) -> dict:
    """One decode loop at page size ``ps`` (a fresh allocator and model), checked against
    the reference in ``ctx``; printed and returned as a run record."""
    mcfg, requests, prefix, ref = ctx["mcfg"], ctx["requests"], ctx["prefix"], ctx["ref"]
    tables_window = (attention_window or mcfg.sliding_window
                     if args.attention in ("tables", "flashinfer") else None)
    alloc = build_allocator(page_size=ps, max_batch=args.max_batch,
                            max_prompt=ctx["max_prompt"],
                            max_total=ctx["max_prompt"] + ctx["max_out"],
                            alloc_window=alloc_window, device=args.device,
                            backend=ctx["backend"], shared_prompt=args.shared_prompt,
                            tables_window=tables_window)
    model = TinyHybridLM(mcfg, ctx["weights"], args.device, dtype=ctx["dtype"])
    loop = DecodeLoop(model, alloc, max_batch=args.max_batch, n_serials=len(requests),
                      max_out=ctx["max_out"], graph=args.graph, attention=args.attention,
                      attention_backend=args.attention_backend, shared_prefix=prefix,
                      flashinfer=args.flashinfer_module)
    if args.graph:
        loop.capture()
    bar = _progress(None, f"decode ps={ps}", ctx["show"])
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
                   "cache_dropped_pages": alloc.prefix_cache.dropped_pages,
                   "cache_tombstoned_pages": alloc.prefix_cache.tombstoned_pages,
                   "audit_with_cache": [str(f) for f in alloc.audit()]}
        alloc.prefix_cache.drop_all()
        st = alloc.stats()
        sharing["audit_after_drop"] = [str(f) for f in alloc.audit()]
        sharing["pages_used_after_drop"] = {"full": st["full_used_pages"],
                                            "swa": st["swa_used_pages"]}
    summary = summarize(result, mcfg, ps, ctx["dtype"].itemsize)
    run = {"page_size": ps, "alloc_window": alloc_window, "attention": args.attention,
           "attention_window": (loop.tables.spec.model_window
                                if loop.tables is not None else None),
           "attention_backend": loop.attention_backend, "dtype": args.dtype,
           "summary": summary,
           "max_saving": mcfg.n_swa_layers / mcfg.num_layers,
           "host_syncs_in_loop": 0 if (args.sync_debug and args.device == "cuda") else None,
           "tokens": {str(k): v for k, v in result.tokens.items()}}
    if sharing is not None:
        run["sharing"] = sharing
    if ref is not None:
        run["comparison"] = compare(result, ref[0], ref[1], args.atol)
    if ctx["hf_teacher"] is not None:
        run["teacher_forced"] = teacher_forced(ctx["hf_teacher"], requests, result, args.atol,
                                               ctx["ref_device"])
    run["verdict"] = run_verdict(run, args.dtype)
    c, tf = run.get("comparison"), run.get("teacher_forced")
    verdict = ("no reference" if c is None else
               f"tokens equal: {c['tokens_equal']} ({c['tokens_compared']} tokens"
               + (f", {c['requests_differing']} requests differ" if c["requests_differing"]
                  else "")
               + f"), max |logit diff| {c['max_logit_diff']:.2e}")
    if tf is not None:
        verdict += (f"; teacher-forced: {tf['argmax_equal']}/{tf['tokens_checked']} tokens are "
                    f"transformers' argmax, {tf['near_ties']} near ties, "
                    f"{tf['beyond_tolerance']} beyond tolerance, max |logit diff| "
                    f"{tf['max_logit_diff']:.2e}")
    verdict += f" -> {run['verdict']}"
    tag = f"ps={ps:>3}" + (f" [control: {control}]" if control else "")
    print(f"{tag}: {summary['steps']} steps ({summary['steps_with_evictions']} with "
          f"evictions, {summary['swa_pages_evicted']} SWA pages evicted), "
          f"{summary['requests_released']} requests released; peak pages FULL "
          f"{summary['peak_full_pages']} SWA {summary['peak_swa_pages']}; KV memory saved "
          f"{100 * summary['memory_saved_at_peak']:.1f}% at peak "
          f"(mean {100 * summary['memory_saved_mean']:.1f}%); {verdict}")
    if c is not None and c["differences"] and not control:
        for d in c["differences"][:8]:
            print(f"        request {d['request']} token {d['index']}: ours {d['ours']}, "
                  f"transformers {d['transformers']}; reference top-1 minus top-2 margin "
                  f"{d['transformers_top2_gap']:.3g}, max logit diff before "
                  f"{d['max_logit_diff_upto']:.3g}")
    if control:
        return run
    print(f"        host {summary['host_us_per_step']['p50']:.0f} us/step (median), "
          f"{summary['steps_per_s']:.0f} steps/s incl. prefill, "
          f"{summary['ring_stalls']} descriptor-ring waits (for the GPU), integrity ok"
          + (", 0 host syncs (sync debug 'error')" if run["host_syncs_in_loop"] == 0 else "")
          + (f", graph nodes {summary['graph_nodes']}" if summary["graph_nodes"] else ""))
    if run["attention"] in ("tables", "flashinfer"):
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
    return run


def _json_default(o):
    if isinstance(o, np.integer | np.floating):
        return o.item()
    if isinstance(o, float) and math.isnan(o):
        return None
    raise TypeError(type(o).__name__)


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
