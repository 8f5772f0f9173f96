"""Serve a tiny Mamba-2 + attention hybrid from graphalloc's recurrent-state slots, checked
token for token against transformers' ``BambaForCausalLM``.

The model (``recurrent_model.py``: Bamba's architecture, random float32 weights) keeps its
attention K/V in the allocator's pages and its Mamba-2 state (conv + SSM) in the allocator's
state slots: the two state tensors are registered with the allocator
(``state_tensors=[(conv, 1), (ssm, 1)]``), which copies them inside its own step when a
prefix snapshot is taken or restored and names every request's slot on the device
(``req_to_state``, ``spec_state``). ``recurrent_loop.py`` explains the loop, the graph of a
step and its cost; in short, each step is::

    plain:        alloc step (releases, decode) + model.decode at req_to_state + argmax
    speculative:  alloc step (releases, commit of the last round's counts, decode with
                  lookahead k: 1 + k state slots a row) + k drafts + the 1 + k-token verify
                  writing each token's state into spec_state + greedy acceptance; then the
                  round's one read (the accepted counts)

captured as ONE CUDA graph per descriptor buffer on a GPU (``--graph``) and run eagerly on a
CPU. Every request carries a shared system prompt (``--shared-prompt`` tokens): the first
prefills it in chunks, one ending at its page-aligned end P, and inserts it into the prefix
cache there (the step copies its state into a snapshot slot); every later request is
admitted on the cached handle inside a decode step's graph (K/V of ``[0, P)`` shared, the
snapshot copied into its slot: ``PlannedStep.state_copies``) and prefills only ``[P,
len)``. The drafts of the speculative mode are the target's own greedy tokens from an
earlier pass (the plain run at the same page size), each wrong with probability
``--draft-error`` (seeded): rounds accept 0..k drafts, so rollback runs at every depth.

Checks, per page size and mode (``--modes plain spec``): every request's tokens equal
transformers' greedy ``generate`` on its full prompt (float32 on the CPU; our logits are
reported, typically within 1e-5: transformers' prefill sums the SSM in chunks, ours token
by token); every carrier after the first was served from the cache with one state copy
whose source is the snapshot slot; ``alloc.audit()`` is empty with the cache held and after
``prefix_cache.drop_all()``, when every page and state slot is back. Negative controls
(``--stale-state restore``: a sharer's slot zeroed instead of restored; ``commit``: each
verify reads the request's slot from before its round's commit) must change tokens;
``--negative-control`` runs them after the main runs, and the exit status is 0 only if every
main run matches and every control differs.

CPU (eager, tiny sizes)::

    python examples/model_loops/recurrent_decode.py

GPU (each step one graph replay, any host sync but a round's read raises)::

    python examples/model_loops/recurrent_decode.py --device cuda --graph --sync-debug \\
        --negative-control --out DIR
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
from decode_loop import _json_default, _progress  # noqa: E402
from paged_decode import Request  # noqa: E402
from provenance import add_stamp_option, stamp_or_exit  # noqa: E402
from recurrent_loop import STALE_STATE, RecurrentLoop, state_slots_needed  # noqa: E402
from recurrent_model import (  # noqa: E402
    RecurrentConfig,
    RecurrentState,
    TinyRecurrentLM,
    random_weights,
    to_transformers,
)

import graphalloc as ga  # noqa: E402

__all__ = ["main", "make_requests", "build", "reference", "compare"]

RESULTS = Path(__file__).resolve().parents[2] / "results" / "examples"
MODES = {"plain": 0, "spec": None}  # spec: --lookahead


def make_requests(n: int, system_len: int, user_len: tuple[int, int],
                  output_len: tuple[int, int], vocab: int, seed: int) -> list[Request]:
    """``n`` requests whose prompts are one shared system prompt of ``system_len`` tokens and
    a user part of a length uniform in ``user_len`` (inclusive); outputs uniform in
    ``output_len``."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, vocab, size=system_len).astype(np.int64)
    reqs = []
    for i in range(n):
        u = int(rng.integers(user_len[0], user_len[1] + 1))
        o = int(rng.integers(output_len[0], output_len[1] + 1))
        user = rng.integers(0, vocab, size=u).astype(np.int64)
        reqs.append(Request(i, np.concatenate([system, user]), o))
    return reqs


def build(mcfg: RecurrentConfig, *, page_size: int, max_batch: int, max_total: int,
          lookahead: int, shared_prompt: int, device: str, backend: str
          ) -> tuple[ga.HybridAllocator, RecurrentState]:
    """The model's state and an allocator that owns its slots: ``2 * max_batch`` rows
    (finished rows wait one step for their release), FULL pages for every row at full
    length plus the cached prefix, state slots that never run short
    (:func:`recurrent_loop.state_slots_needed`). The model has no sliding window: the
    allocator's window is the context (nothing is evicted; its SWA pool mirrors the FULL
    pool and is never read)."""
    ps, max_reqs = page_size, 2 * max_batch
    handles = 4 if shared_prompt else 0
    n_pages = max_reqs * -(-max_total // ps) + -(-shared_prompt // ps) + 1
    n_slots = state_slots_needed(max_reqs, lookahead, handles)
    state = RecurrentState.zeros(mcfg, n_slots, device)
    cfg = ga.AllocatorConfig(
        page_size=ps, max_reqs=max_reqs, max_context_len=max_total, num_full_pages=n_pages,
        num_swa_pages=n_pages, model_window=max_total + 1, max_handles=handles,
        num_state_slots=n_slots, num_lookahead_tokens=lookahead, device=device,
        backend=backend)
    alloc = ga.HybridAllocator(cfg, prefix_cache=bool(shared_prompt),
                               state_tensors=[(state.conv, 1), (state.ssm, 1)])
    return alloc, state


def reference(mcfg: RecurrentConfig, weights, requests: list[Request], progress=None):
    """transformers' greedy generation, one request at a time on its full prompt (float32,
    CPU): ``({serial: tokens}, {serial: logits [n_out, vocab]})``."""
    hf = to_transformers(mcfg, weights)
    tokens, logits = {}, {}
    with torch.no_grad():
        for r in requests:
            ids = torch.from_numpy(r.prompt)[None]
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=r.n_out, min_new_tokens=r.n_out,
                              output_logits=True, return_dict_in_generate=True)
            tokens[r.serial] = out.sequences[0, len(r.prompt):].tolist()
            logits[r.serial] = torch.cat(out.logits, 0).float().numpy()
            if progress is not None:
                progress.update(1)
    return tokens, logits


def perturb(tokens: dict, error_rate: float, vocab: int, seed: int) -> dict:
    """Drafts from an earlier pass: each token replaced, with probability ``error_rate``, by
    another token (seeded)."""
    rng = np.random.default_rng([seed, 11])
    out = {}
    for s in sorted(tokens):
        t = np.asarray(tokens[s], dtype=np.int64)
        wrong = rng.random(len(t)) < error_rate
        other = (t + 1 + rng.integers(0, vocab - 1, size=len(t))) % vocab
        out[s] = np.where(wrong, other, t).tolist()
    return out


def compare(tokens: dict, logits: dict | None, ref_tokens: dict, ref_logits: dict) -> dict:
    """Tokens must be identical; logits compared up to each request's first difference."""
    diffs, max_diff, n_tok = [], 0.0, 0
    for s, want in ref_tokens.items():
        got = tokens[s]
        n_tok += len(want)
        first = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b),
                     None)
        upto = len(want) if first is None else first + 1
        if logits is not None:
            max_diff = max(max_diff, float(np.abs(logits[s][:upto] - ref_logits[s][:upto]).max()))
        if first is not None:  # the reference's top-1 minus top-2 logit there (a near tie?)
            top2 = np.sort(ref_logits[s][first])[-2:]
            diffs.append({"request": s, "index": first, "ours": got[first],
                          "transformers": want[first],
                          "transformers_top2_gap": float(top2[1] - top2[0])})
    return {"tokens_equal": not diffs, "tokens_compared": n_tok,
            "requests_differing": len(diffs), "differences": diffs,
            "max_logit_diff": max_diff}


def _summary(result, k: int) -> dict:
    acc = np.array([a for s in result.steps for a in s["accepted"]], dtype=np.int64)
    out = {"steps": len(result.steps), "lane_steps": int(acc.size),
           "tokens_in_steps": int(acc.sum()), "wall_s": result.wall_s,
           "prefill_s": result.prefill_s, "host_us_per_step": timing.summarize(result.host_step_us),
           "graph_nodes": result.graph_nodes,
           "min_free_state_slots": min((s["free_state_slots"] for s in result.steps),
                                       default=None)}
    if k:
        out.update({
            "lookahead": k, "acceptance_rate": float((acc - 1).sum() / (k * acc.size))
            if acc.size else None,
            "tokens_per_round": float(acc.mean()) if acc.size else None,
            "accepted_histogram": {str(n): int((acc == n).sum()) for n in range(1, k + 2)},
            "rounds_with_commit": sum(s["committed_rows"] > 0 for s in result.steps),
            "read_wait_us_per_round": timing.summarize(result.read_wait_us)})
    return out


def run_one(args, ctx: dict, ps: int, mode: str, stale: str | None) -> dict:
    """One loop (a fresh allocator, state and model) at page size ``ps`` in ``mode``, checked
    against the reference; printed and returned as a run record."""
    mcfg, requests = ctx["mcfg"], ctx["requests"]
    k = args.lookahead if mode == "spec" else 0
    alloc, state = build(mcfg, page_size=ps, max_batch=args.max_batch,
                         max_total=ctx["max_total"] + k, lookahead=k,
                         shared_prompt=args.shared_prompt, device=args.device,
                         backend=ctx["backend"])
    model = TinyRecurrentLM(mcfg, ctx["weights"], args.device)
    loop = RecurrentLoop(model, alloc, state, max_batch=args.max_batch,
                         n_serials=len(requests), max_out=ctx["max_out"], lookahead=k,
                         graph=args.graph, shared_prefix=ctx["prefix"],
                         chunk_tokens=args.chunk_tokens, stale_state=stale)
    if args.graph:
        loop.capture()
    bar = _progress(None, f"{mode} ps={ps}" + (f" [{stale}]" if stale else ""), ctx["show"])
    drafts = None
    if k:  # the plain pass's tokens at this page size, perturbed
        drafts = perturb(ctx["plain_tokens"][ps], args.draft_error, mcfg.vocab_size, args.seed)
    result = loop.run(requests, drafts=drafts, progress=bar, sync_debug=args.sync_debug)
    if bar is not None:
        bar.close()
    alloc.check()
    if alloc.n_live > 0:
        raise RuntimeError("requests still live after the loop")
    if mode == "plain" and stale is None:
        ctx["plain_tokens"][ps] = result.tokens
    run = {"page_size": ps, "mode": mode, "lookahead": k, "stale_state": stale,
           "summary": _summary(result, k),
           "tokens": {str(s): t for s, t in result.tokens.items()}}
    if result.sharing is not None:
        sh = result.sharing
        snap = alloc.handle_to_state.cpu().tolist()  # sync ok: after the loop
        cache = alloc.prefix_cache
        restores_ok = all(r["step_state_copies"] == r["step_restores"]  # one copy each
                          and r["state_copies"] == [[snap[r["handle"]], r["slot"]]]
                          and r["cached_tokens"] == sh["cached_prefix_tokens"]
                          for r in sh["restores"])
        sh.update({"cache_hits": cache.hits, "cache_misses": cache.misses,
                   "snapshot_slots": snap, "restores_ok": restores_ok,
                   "audit_with_cache": [str(f) for f in alloc.audit()]})
        cache.drop_all()
        run["sharing"] = sh
    run["audit_end"] = [str(f) for f in alloc.audit()]
    st = alloc.stats()
    run["all_back"] = (st["full_used_pages"] == 0 and st["swa_used_pages"] == 0
                       and alloc.n_free("state") == alloc.config.num_state_slots)
    sharing_ok = result.sharing is None or (
        run["sharing"]["restores_ok"]
        and run["sharing"]["requests_sharing"] == run["sharing"]["requests_carrying"] - 1
        and not run["sharing"]["audit_with_cache"])
    run["healthy"] = bool(sharing_ok and not run["audit_end"] and run["all_back"])
    if ctx["ref"] is not None:
        run["comparison"] = compare(result.tokens, result.logits, *ctx["ref"])
        run["verdict"] = "tokens equal" if run["comparison"]["tokens_equal"] else "mismatch"
    else:
        run["verdict"] = "no reference"
    _print_run(run)
    return run


def _print_run(run: dict) -> None:
    s, c, sh = run["summary"], run.get("comparison"), run.get("sharing")
    tag = f"{run['mode']:>5} ps={run['page_size']:>2}" + (
        f" [control: stale state '{run['stale_state']}']" if run["stale_state"] else "")
    line = f"{tag}: {s['steps']} steps"
    if run["lookahead"]:
        line += (f", k={run['lookahead']}: acceptance {100 * s['acceptance_rate']:.1f}%, "
                 f"{s['tokens_per_round']:.2f} tokens/round, accepted 1..k+1 "
                 + "/".join(str(v) for v in s["accepted_histogram"].values()))
    if c is not None:
        line += (f"; tokens equal: {c['tokens_equal']} ({c['tokens_compared']} tokens"
                 + (f", {c['requests_differing']} requests differ" if c["requests_differing"]
                    else "") + f"), max |logit diff| {c['max_logit_diff']:.1e}")
    print(f"{line} -> {run['verdict']}")
    if c is not None and c["differences"] and not run["stale_state"]:
        for d in c["differences"][:8]:
            print(f"        request {d['request']} token {d['index']}: ours {d['ours']}, "
                  f"transformers {d['transformers']} (its top-2 gap "
                  f"{d['transformers_top2_gap']:.2e})")
    if sh is not None:
        n_copies = sorted({len(r["state_copies"]) for r in sh["restores"]})
        sources = sorted({c[0] for r in sh["restores"] for c in r["state_copies"]})
        print(f"        shared prompt {sh['prefix_tokens']} tokens, snapshot at "
              f"{sh['cached_prefix_tokens']}: {sh['requests_sharing']}/"
              f"{sh['requests_carrying']} requests served from the cache (hits "
              f"{sh['cache_hits']}), prefill tokens saved {sh['prefill_tokens_saved']}; "
              f"each admit on the handle planned {n_copies} state copies from slots "
              f"{sources} (the snapshot: {[x for x in sh['snapshot_slots'] if x]}): "
              f"{'ok' if sh['restores_ok'] else 'WRONG'}")
    print(f"        audit {'empty' if not run['audit_end'] else run['audit_end']}, pages and "
          f"state slots back: {run['all_back']}; host {s['host_us_per_step']['p50']:.0f} "
          f"us/step (median)" + (f", graph nodes {s['graph_nodes']}" if s["graph_nodes"]
                                 else ""))


def markdown(cfg: dict, runs: list[dict], controls: list[dict]) -> str:
    lines = [f"# recurrent_decode: {cfg['device']}, graph={cfg['graph']}, sync debug "
             f"{cfg['sync_debug']}, backend {cfg['backend']}", "",
             f"Model: {cfg['model']}; {cfg['requests']} requests, {cfg['max_batch']} lanes, "
             f"shared prompt {cfg['shared_prompt']} tokens; transformers "
             f"{cfg.get('transformers')}", "",
             "| mode | ps | steps | acceptance | restores ok | audit | back | tokens equal "
             "| max logit diff | host us/step |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        s, c = r["summary"], r.get("comparison") or {}
        rate = s.get("acceptance_rate")
        lines.append(
            f"| {r['mode']} | {r['page_size']} | {s['steps']} "
            f"| {'-' if rate is None else f'{100 * rate:.1f}%'} "
            f"| {(r.get('sharing') or {}).get('restores_ok', '-')} "
            f"| {'empty' if not r['audit_end'] else 'FINDINGS'} | {r['all_back']} "
            f"| {c.get('tokens_equal', 'n/a')} | {c.get('max_logit_diff', float('nan')):.1e} "
            f"| {s['host_us_per_step']['p50']:.0f} |")
    if controls:
        lines += ["", "| control | mode | ps | requests differing | detected |",
                  "|---|---|---|---|---|"]
        for c in controls:
            lines.append(f"| {c['stale_state']} | {c['mode']} | {c['page_size']} "
                         f"| {(c.get('comparison') or {}).get('requests_differing')} "
                         f"| {c['detected']} |")
    return "\n".join(lines) + "\n"


def _applies(stale: str | None, mode: str, args) -> bool:
    """Whether the control ``stale`` means something in ``mode``: ``restore`` needs the
    shared prompt, ``commit`` speculative rounds."""
    return (stale == "restore" and bool(args.shared_prompt)) or (
        stale == "commit" and mode == "spec")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--graph", action="store_true",
                    help="capture each step (allocator step, state slots, model, argmax) as one "
                         "CUDA graph per descriptor buffer (needs --device cuda)")
    ap.add_argument("--sync-debug", action="store_true",
                    help="run the loop under torch.cuda.set_sync_debug_mode('error'); only a "
                         "speculative round's read of its accepted counts may synchronise")
    ap.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"])
    ap.add_argument("--page-sizes", "--page-size", dest="page_sizes", type=int, nargs="+",
                    default=[4, 16])
    ap.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES),
                    help="plain decode steps and/or speculative rounds")
    ap.add_argument("--lookahead", "-k", type=int, default=3,
                    help="draft tokens per speculative round")
    ap.add_argument("--draft-error", type=float, default=0.3,
                    help="probability that a draft token (the plain pass's token) is replaced "
                         "by a wrong one")
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--max-batch", type=int, default=3, help="lanes of a step")
    ap.add_argument("--shared-prompt", type=int, default=22,
                    help="tokens of the system prompt every request starts with (served from "
                         "the prefix cache after the first; 0: none)")
    ap.add_argument("--user-len", type=int, nargs=2, default=[3, 12], metavar=("MIN", "MAX"),
                    help="tokens of each request's own part of the prompt")
    ap.add_argument("--output-len", type=int, nargs=2, default=[8, 20], metavar=("MIN", "MAX"))
    ap.add_argument("--chunk-tokens", type=int, default=8,
                    help="most prompt tokens per prefill chunk (0: whole prompts)")
    ap.add_argument("--vocab", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stale-state", choices=list(STALE_STATE), default=None,
                    help="NEGATIVE CONTROL for every run: 'restore' zeroes a sharer's state "
                         "slot instead of the restored snapshot; 'commit' makes each verify "
                         "read the slot from before its round's commit (spec mode only). "
                         "Tokens must differ")
    ap.add_argument("--negative-control", action="store_true",
                    help="after the main runs, run every control that applies (restore: each "
                         "mode; commit: spec) at every page size; all must differ")
    ap.add_argument("--no-reference", action="store_true", help="skip transformers")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--out", default=str(RESULTS / "recurrent-decode"),
                    help="folder for recurrent_decode.json / .md ('' : none)")
    add_stamp_option(ap)
    args = ap.parse_args(argv)
    if args.graph and args.device != "cuda":
        ap.error("--graph needs --device cuda")
    if args.stale_state == "commit" and "spec" not in args.modes:
        ap.error("--stale-state commit needs the spec mode")
    if args.stale_state == "restore" and not args.shared_prompt:
        ap.error("--stale-state restore needs --shared-prompt > 0")
    if args.lookahead < 1 and "spec" in args.modes:
        ap.error("--lookahead must be >= 1 for the spec mode")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    stamp_or_exit(args.out, __file__, argv, allow_dirty=args.allow_dirty)
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32 (the reference's)
    mcfg = RecurrentConfig(vocab_size=args.vocab)
    weights = random_weights(mcfg, args.seed)
    requests = make_requests(args.requests, args.shared_prompt, tuple(args.user_len),
                             tuple(args.output_len), args.vocab, args.seed + 1)
    prefix = requests[0].prompt[:args.shared_prompt] if args.shared_prompt else None
    max_prompt = max(len(r.prompt) for r in requests)
    max_out = max(r.n_out for r in requests)
    if max_prompt + max_out + args.lookahead + 1 > mcfg.max_position:
        raise SystemExit(f"prompts + outputs exceed the model's {mcfg.max_position} positions")
    backend, _ = timing.pick_backend(args.backend, args.device)
    show = not args.no_progress
    print(f"model: Bamba {mcfg.num_layers} layers {mcfg.layer_types}, hidden "
          f"{mcfg.hidden_size}, state {mcfg.state_bytes_per_slot()} B/slot; "
          f"{len(requests)} requests (system prompt {args.shared_prompt} + user "
          f"{args.user_len[0]}-{args.user_len[1]} tokens, outputs {args.output_len[0]}-"
          f"{args.output_len[1]}), {args.max_batch} lanes; device {args.device}, graph="
          f"{args.graph}, backend {backend}, sync debug {args.sync_debug}")
    ref = None
    if not args.no_reference:
        t0 = time.perf_counter()
        bar = _progress(len(requests), "transformers reference", show)
        ref = reference(mcfg, weights, requests, bar)
        if bar is not None:
            bar.close()
        print(f"transformers reference (BambaForCausalLM, float32, CPU): "
              f"{time.perf_counter() - t0:.1f} s")
    ctx = {"mcfg": mcfg, "weights": weights, "requests": requests, "prefix": prefix,
           "max_total": max_prompt + max_out + 1, "max_out": max_out, "backend": backend,
           "ref": ref, "show": show, "plain_tokens": {}}
    runs = []
    for ps in args.page_sizes:
        for mode in args.modes:
            stale = args.stale_state if _applies(args.stale_state, mode, args) else None
            if mode == "spec" and ps not in ctx["plain_tokens"]:  # the drafts' earlier pass
                run_one(args, ctx, ps, "plain", None)
            runs.append(run_one(args, ctx, ps, mode, stale))
    controls = []
    if args.negative_control:
        for ps in args.page_sizes:
            for mode in args.modes:
                for stale in STALE_STATE:
                    if not _applies(stale, mode, args):
                        continue
                    run = run_one(args, ctx, ps, mode, stale)
                    run["detected"] = (None if ref is None
                                       else not run["comparison"]["tokens_equal"])
                    controls.append(run)
    runs_ok = all(r["verdict"] in ("tokens equal", "no reference") and r["healthy"]
                  for r in runs)
    controls_ok = all(c["detected"] is not False for c in controls)
    cfg = {"args": vars(args), "device": args.device, "graph": args.graph,
           "sync_debug": args.sync_debug, "backend": backend,
           "machine": timing.machine_info(args.device),
           "model": {"layers": mcfg.layer_types, "hidden": mcfg.hidden_size,
                     "vocab": mcfg.vocab_size, "state_bytes_per_slot":
                     mcfg.state_bytes_per_slot()},
           "requests": len(requests), "max_batch": args.max_batch,
           "shared_prompt": args.shared_prompt}
    try:
        import transformers
        cfg["transformers"] = transformers.__version__
    except ImportError:
        pass
    out = {"ok": runs_ok and controls_ok, "runs_ok": runs_ok, "controls_ok": controls_ok,
           "config": cfg, "runs": runs, "controls": controls}
    if args.out:
        d = Path(args.out)
        d.mkdir(parents=True, exist_ok=True)
        (d / "recurrent_decode.json").write_text(json.dumps(out, indent=1,
                                                            default=_json_default))
        (d / "recurrent_decode.md").write_text(markdown(cfg, runs, controls))
        print(f"wrote {d}/recurrent_decode.json, .md")
    print("MATCH: every request's tokens equal transformers'" if runs_ok and ref is not None
          else "MISMATCH against transformers (or an unhealthy run)" if not runs_ok
          else "done (no reference check)")
    if controls:
        print("negative controls: " + ("every one changes the tokens" if controls_ok else
                                       "SOME MATCHED transformers (not detected)"))
    return out


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
