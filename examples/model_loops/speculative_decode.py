"""Speculative decoding of a hybrid SWA model over graphalloc, checked token for token against
transformers' plain greedy decoding.

The target is the tiny hybrid decoder of ``hybrid_model.py`` (random weights; the reference
is ``transformers``' ``Qwen2ForCausalLM`` with the same weights, generating greedily with its
own cache). The draft is the same model with seeded noise on the weight matrices of some
layers (``--draft-noise``, ``--draft-layers``): close enough that many drafts are accepted,
far enough that many are rejected. The draft keeps its own K/V at the target's slots (one
allocator, SGLang EAGLE's layout; ``spec_loop.py`` explains the round).

Each round, for every running request (continuous batching: requests of different prompt
and output lengths finish and are replaced mid-loop): ONE allocator step
``step(release=finished, accept=(rows, n_accepted), evict=rows, decode=rows, lookahead=k)``,
k + 1 draft steps, one verify forward of 1 + k tokens, greedy acceptance on the device; then
the one documented read of the round (the accepted counts, pinned copy + event wait) gives
the host the counts it commits in the next round's step. Every attention (the prefill, the
draft steps, the verify) reads K/V through the block tables the allocator writes inside the
round's own step (``page_tables=PageTableSpec(forms=("block_table",), model_window=W)``;
the batch's lane m is its m-th decode row, with query ``1 + k``), never through
``req_to_token``. Window eviction follows the committed length; the SWA layers of the verify
read each query's own window ``[p + 1 - W, p]``, inside the lane's SWA range, which starts
at its first query's window; the K/V of rejected positions is poisoned after the verify, so
a read of one would show.

Checks: every request's accepted tokens equal transformers' greedy tokens (and the logits
of the accepted tokens are within ``--atol``); ``alloc.audit()`` is empty at midpoints
(``--audit-every``) and at the end after every release, and every page is back in its pool.
Prints, and writes under ``--out`` (``speculative_decode.json`` / ``.md``), the acceptance
rate, rounds, tokens per round and pages in use.

CPU (eager, tiny sizes)::

    python examples/model_loops/speculative_decode.py

GPU (allocator step + draft + verify + acceptance in one CUDA graph per round, any host
sync but the round's read raises)::

    python examples/model_loops/speculative_decode.py --device cuda --graph --sync-debug --out DIR

Exit status 0 when every run matches transformers and every audit is empty. Negative
controls (must fail): ``--alloc-window W-2`` (the allocator frees a position the SWA layers
of the verify read), ``--table-window W-1`` (the step's SWA block tables start one position
late: the first query's oldest key is outside them) and ``--commit-extra 1`` (the allocator
is told one token more than was accepted: its lengths and output lanes run ahead of the
K/V, and the next round reads a rejected, poisoned position).
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

if not torch.cuda.is_available():  # Triton kernels (if chosen) run in the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import timing  # noqa: E402
from decode_loop import _json_default, _progress, compare, make_requests, reference  # noqa: E402
from hybrid_model import (  # noqa: E402
    ModelConfig,
    TinyHybridLM,
    allocator_window,
    random_weights,
)
from provenance import add_stamp_option, stamp_or_exit  # noqa: E402
from spec_loop import SpecLoop, SpecResult, perturbed_weights, spec_tables_spec  # noqa: E402

import graphalloc as ga  # noqa: E402

__all__ = ["main", "build_allocator", "summarize"]

# the default --out is a folder of the repository's one results tree
RESULTS = Path(__file__).resolve().parents[2] / "results" / "examples"


def build_allocator(*, page_size: int, max_batch: int, max_prompt: int, max_total: int,
                    alloc_window: int, lookahead: int, device: str,
                    backend: str, model_window: int) -> ga.HybridAllocator:
    """An allocator sized for the workload: ``2 * max_batch`` request rows (finished rows
    wait one round for their release while new requests are admitted), FULL pages for every
    row at full length, SWA pages for every row's prompt plus its window and a round's
    ``1 + k`` slots; every step writes its batch's block tables, FULL and SWA, for the
    model's window ``model_window`` (``spec_loop.spec_tables_spec``)."""
    ps = page_size
    max_reqs = 2 * max_batch
    cfg = ga.AllocatorConfig(
        page_size=ps, max_reqs=max_reqs, max_context_len=max_total,
        num_full_pages=max_reqs * -(-max_total // ps),
        num_swa_pages=max_reqs * (-(-max_prompt // ps) + -(-(alloc_window + 1 + lookahead)
                                                           // ps) + 2),
        model_window=alloc_window + 1, device=device, backend=backend)
    return ga.HybridAllocator(cfg, page_tables=spec_tables_spec(max_batch, model_window))


def summarize(result: SpecResult, k: int) -> dict:
    """Acceptance, rounds and pages, all from host-side numbers."""
    rounds = result.rounds
    acc = np.array([a for r in rounds for a in r["accepted"]], dtype=np.int64)
    lane_rounds = int(acc.size)
    full = np.array([r["full_used_pages"] for r in rounds])
    swa = np.array([r["swa_used_pages"] for r in rounds])
    tokens_out = int(acc.sum())  # accepted in rounds, overshoot past n_out included
    return {
        "rounds": len(rounds),
        "lane_rounds": lane_rounds,  # (request, round) pairs: target verify passes per request
        "draft_tokens_proposed": k * lane_rounds,
        "draft_tokens_accepted": int((acc - 1).sum()),
        "acceptance_rate": float((acc - 1).sum() / (k * lane_rounds)) if k and lane_rounds
        else None,
        "tokens_per_round": float(acc.mean()) if lane_rounds else None,
        "accepted_histogram": {str(n): int((acc == n).sum()) for n in range(1, k + 2)},
        "tokens_accepted_in_rounds": tokens_out,
        "rounds_with_commit": sum(r["committed_rows"] > 0 for r in rounds),
        "requests_released": int(sum(r["released"] for r in rounds)),
        "swa_pages_evicted": int(sum(r["swa_pages_evicted"] for r in rounds)),
        "pages_allocated": {kind: int(sum(r["pages_allocated"][kind] for r in rounds))
                            + result.prefill_pages[kind] for kind in ("full", "swa")},
        "pages_freed": {kind: int(sum(r["pages_freed"][kind] for r in rounds))
                        for kind in ("full", "swa")},
        "peak_full_pages": int(full.max()) if len(full) else 0,
        "peak_swa_pages": int(swa.max()) if len(swa) else 0,
        "host_us_per_round": timing.summarize(result.host_round_us),
        "read_wait_us_per_round": timing.summarize(result.read_wait_us),
        "wall_s": result.wall_s, "prefill_s": result.prefill_s,
        "tokens_per_s": tokens_out / result.wall_s if result.wall_s else None,
        "graph_nodes": result.graph_nodes,
        "series": {"full_used_pages": full.tolist(), "swa_used_pages": swa.tolist(),
                   "lanes": [r["lanes"] for r in rounds],
                   "tokens_per_round": [float(np.mean(r["accepted"])) if r["accepted"]
                                        else None for r in rounds]},
    }


def markdown(cfg: dict, runs: list[dict]) -> str:
    lines = [f"# speculative_decode: {cfg['device']}, graph={cfg['graph']}, "
             f"backend={cfg['backend']}, k={cfg['lookahead']}", "",
             f"Model: {cfg['model']}; draft: noise {cfg['draft']['noise']} on layers "
             f"{cfg['draft']['layers']}; {cfg['requests']} requests, {cfg['max_batch']} lanes, "
             f"sync debug {cfg['sync_debug']}; transformers {cfg.get('transformers')}", "",
             f"Machine: {cfg['machine']['summary']}", "",
             "| ps | rounds | acceptance rate | tokens / round | accepted 1..k+1 "
             "| peak FULL / SWA pages | audits (mid, end) | pages back | tokens equal "
             "| max logit diff | host us/round | read wait us |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        s, c = run["summary"], run.get("comparison") or {}
        hist = " / ".join(str(v) for v in s["accepted_histogram"].values())
        mid = run["audits_mid"]
        audits = (f"{len(mid)} x [], []" if not run["audit_findings"]
                  and all(not a["findings"] for a in mid) else "FINDINGS")
        rate = s["acceptance_rate"]
        lines.append(
            f"| {run['page_size']} | {s['rounds']} "
            f"| {'n/a' if rate is None else f'{100 * rate:.1f}%'} "
            f"| {s['tokens_per_round']:.2f} | {hist} "
            f"| {s['peak_full_pages']} / {s['peak_swa_pages']} | {audits} "
            f"| {run['pages_back']} | {c.get('tokens_equal', 'n/a')} "
            f"| {c.get('max_logit_diff', float('nan')):.2e} "
            f"| {s['host_us_per_round']['p50']:.0f} | {s['read_wait_us_per_round']['p50']:.0f} |")
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--graph", action="store_true",
                    help="capture each round (allocator step, draft, verify, acceptance) as "
                         "one CUDA graph (needs --device cuda)")
    ap.add_argument("--sync-debug", action="store_true",
                    help="run the loop under torch.cuda.set_sync_debug_mode('error'); only the "
                         "round's read of the accepted counts and the audits may synchronise")
    ap.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"])
    ap.add_argument("--page-sizes", "--page-size", dest="page_sizes", type=int, nargs="+",
                    default=[1, 16])
    ap.add_argument("--lookahead", "-k", type=int, default=3, help="draft tokens per round")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-batch", type=int, default=6, help="requests per round")
    ap.add_argument("--prompt-len", type=int, nargs=2, default=[17, 40],
                    metavar=("MIN", "MAX"))
    ap.add_argument("--output-len", type=int, nargs=2, default=[12, 48], metavar=("MIN", "MAX"))
    ap.add_argument("--window", type=int, default=16,
                    help="the model's sliding window W (transformers convention); the default "
                         "is smaller than every prompt")
    ap.add_argument("--alloc-window", type=int, default=None,
                    help="the allocator's sliding_window (default W - 1; W - 2 must fail)")
    ap.add_argument("--table-window", type=int, default=None,
                    help="the window of the step's SWA block tables (PageTableSpec "
                         "model_window; default W; W - 1 must fail)")
    ap.add_argument("--draft-noise", type=float, default=0.1,
                    help="noise on the draft's weight matrices, in units of each matrix's std")
    ap.add_argument("--draft-layers", type=int, nargs="+", default=None,
                    help="decoder layers whose weights the draft perturbs (default: the upper "
                         "half)")
    ap.add_argument("--commit-extra", type=int, default=0,
                    help="NEGATIVE CONTROL: commit this many tokens more than were accepted "
                         "(must fail)")
    ap.add_argument("--no-poison", action="store_true",
                    help="leave rejected positions' K/V as the verify wrote them")
    ap.add_argument("--audit-every", type=int, default=10,
                    help="alloc.audit() every N rounds (0: only at the end)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--layer-pattern", default="sf", help="'s' sliding, 'f' full, repeated")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--atol", type=float, default=2e-3, help="logit tolerance (float32)")
    ap.add_argument("--no-reference", action="store_true", help="skip the transformers check")
    ap.add_argument("--out", default=str(RESULTS / "speculative-decode"),
                    help="directory for speculative_decode.{json,md}; '' writes nothing")
    ap.add_argument("--no-progress", action="store_true")
    add_stamp_option(ap)
    args = ap.parse_args(argv)
    if args.graph and args.device != "cuda":
        ap.error("--graph needs --device cuda (on a CPU the loop runs eagerly)")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda but torch sees no GPU")
    if args.lookahead < 0 or args.commit_extra < 0:
        ap.error("--lookahead and --commit-extra must be >= 0")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    stamp_or_exit(args.out, __file__, argv, allow_dirty=args.allow_dirty)
    with timing.cpu_threads(args.device):
        return _main(args)


def _main(args: argparse.Namespace) -> dict:
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 everywhere: exact comparison
    torch.backends.cudnn.allow_tf32 = False
    mcfg = ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                       intermediate_size=2 * args.hidden, num_layers=args.layers,
                       num_heads=args.heads, num_kv_heads=args.kv_heads,
                       sliding_window=args.window, layer_pattern=args.layer_pattern)
    k = args.lookahead
    weights = random_weights(mcfg, args.seed)
    draft_layers = (args.draft_layers if args.draft_layers is not None
                    else list(range(args.layers // 2, args.layers)))
    draft_weights = perturbed_weights(weights, draft_layers, args.draft_noise, args.seed + 2)
    requests = make_requests(args.requests, tuple(args.prompt_len), tuple(args.output_len),
                             args.vocab, args.seed + 1)
    max_prompt = max(len(r.prompt) for r in requests)
    max_out = max(r.n_out for r in requests)
    # the longest a request gets: prompt + outputs + a round's overshoot (+ the control's)
    max_total = max_prompt + max_out * (1 + args.commit_extra) + 1 + k
    alloc_window = args.alloc_window or allocator_window(args.window)
    backend, _ = timing.pick_backend(args.backend, args.device)
    show = not args.no_progress
    print(f"model: {mcfg.num_layers} layers {mcfg.layer_types}, window {mcfg.sliding_window} "
          f"(allocator {alloc_window}); draft: noise {args.draft_noise} on layers "
          f"{draft_layers}; k = {k}; {len(requests)} requests, prompts {args.prompt_len[0]}-"
          f"{args.prompt_len[1]}, outputs {args.output_len[0]}-{args.output_len[1]}, "
          f"{args.max_batch} lanes; device {args.device}, graph={args.graph}, backend {backend}")

    ref = None
    if not args.no_reference:
        t0 = time.perf_counter()
        bar = _progress(len(requests), "transformers reference", show)
        ref = reference(mcfg, weights, requests, bar)
        if bar is not None:
            bar.close()
        print(f"transformers reference (plain greedy decoding): {time.perf_counter() - t0:.1f} s")

    runs = []
    for ps in args.page_sizes:
        alloc = build_allocator(page_size=ps, max_batch=args.max_batch, max_prompt=max_prompt,
                                max_total=max_total, alloc_window=alloc_window, lookahead=k,
                                device=args.device, backend=backend,
                                model_window=args.table_window or args.window)
        loop = SpecLoop(TinyHybridLM(mcfg, weights, args.device),
                        TinyHybridLM(mcfg, draft_weights, args.device), alloc,
                        max_batch=args.max_batch, n_serials=len(requests), max_out=max_out,
                        lookahead=k, graph=args.graph, poison=not args.no_poison,
                        commit_extra=args.commit_extra)
        if args.graph:
            loop.capture()
        bar = _progress(None, f"speculative ps={ps}", show)
        result = loop.run(requests, audit_every=args.audit_every, progress=bar,
                          sync_debug=args.sync_debug)
        if bar is not None:
            bar.close()
        alloc.check()
        alloc.check_integrity()
        if alloc.n_live > 0:
            raise RuntimeError("requests still live after the loop")
        findings = [str(f) for f in alloc.audit()]  # after every release: no page leaked
        st = alloc.stats()
        cfg_a = alloc.config
        pages_back = (st["full_free_pages"] == cfg_a.num_full_pages
                      and st["swa_free_pages"] == cfg_a.num_swa_pages)
        summary = summarize(result, k)
        run = {"page_size": ps, "alloc_window": alloc_window, "lookahead": k,
               "table_window": alloc.tables.spec.model_window,
               "summary": summary, "audits_mid": result.audits, "audit_findings": findings,
               "pages_back": pages_back,
               "host_syncs_in_loop": ("one read per round + audits"
                                      if args.sync_debug and args.device == "cuda" else None),
               "tokens": {str(s): v for s, v in result.tokens.items()}}
        if ref is not None:
            run["comparison"] = compare(result, ref[0], ref[1], args.atol)
        runs.append(run)
        c = run.get("comparison")
        verdict = ("no reference" if c is None else
                   f"tokens equal: {c['tokens_equal']} ({c['tokens_compared']} tokens), "
                   f"max |logit diff| {c['max_logit_diff']:.2e}")
        rate = summary["acceptance_rate"]
        mid_ok = all(not a["findings"] for a in result.audits)
        print(f"ps={ps:>3}: {summary['rounds']} rounds ({summary['lane_rounds']} request-rounds), "
              f"acceptance rate {'n/a' if rate is None else f'{100 * rate:.1f}%'} "
              f"({summary['draft_tokens_accepted']}/{summary['draft_tokens_proposed']} drafts), "
              f"{summary['tokens_per_round']:.2f} tokens per round, accepted counts 1..{k + 1}: "
              f"{list(summary['accepted_histogram'].values())}; {verdict}")
        print(f"        peak pages FULL {summary['peak_full_pages']} SWA "
              f"{summary['peak_swa_pages']}, {summary['swa_pages_evicted']} SWA pages evicted, "
              f"{summary['requests_released']} requests released; audits: "
              f"{len(result.audits)} midpoints {'all empty' if mid_ok else 'WITH FINDINGS'}, "
              f"end {findings or 'empty'}, every page back: {pages_back}; host "
              f"{summary['host_us_per_round']['p50']:.0f} us/round, read wait "
              f"{summary['read_wait_us_per_round']['p50']:.0f} us (medians)"
              + (", sync debug 'error'" if run["host_syncs_in_loop"] else "")
              + (f", graph nodes {summary['graph_nodes']}" if summary["graph_nodes"] else ""))

    ok = all(r.get("comparison", {}).get("tokens_equal", True)
             and r.get("comparison", {}).get("logits_within_atol", True)
             and not r["audit_findings"] and r["pages_back"]
             and all(not a["findings"] for a in r["audits_mid"]) for r in runs)
    cfg = {"args": vars(args), "device": args.device, "graph": args.graph,
           "sync_debug": args.sync_debug, "backend": backend, "lookahead": k,
           "machine": timing.machine_info(args.device),
           "model": {"layers": mcfg.layer_types, "hidden": mcfg.hidden_size,
                     "heads": mcfg.num_heads, "kv_heads": mcfg.num_kv_heads,
                     "vocab": mcfg.vocab_size, "window": mcfg.sliding_window},
           "draft": {"noise": args.draft_noise, "layers": draft_layers,
                     "kv": "own K/V buffers at the target's slots (one allocator)"},
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
        (d / "speculative_decode.json").write_text(json.dumps(out, indent=1,
                                                              default=_json_default))
        (d / "speculative_decode.md").write_text(markdown(cfg, runs))
        print(f"wrote {d}/speculative_decode.json, .md")
    print("MATCH: every request's tokens equal transformers' greedy tokens, audits empty"
          if ok and ref is not None else
          "MISMATCH against transformers (or an audit finding)" if not ok
          else "done (no reference check)")
    return out


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
