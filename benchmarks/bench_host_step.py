"""The host step's fixed cost: Python-level calls per step through every front door, and
host microseconds per step now against earlier commits rebuilt in the same run.

    python benchmarks/bench_host_step.py --out results/bench/host-step-cpu      # ~15 min
    python benchmarks/bench_host_step.py --quick --out /tmp/bench_host_step     # ~1 min
    python benchmarks/bench_host_step.py --trees aab3f5b,86c2913 --batches 16,256

Workload (seeded, the same in every tree): B running requests, page size 16, a model window
of 4096 (``sliding_window = 4095``), pool mode, lengths uniform in [W/2, 2W) (most requests
are past their window, so the window rule frees SWA pages as they cross page boundaries).
Each step is ONE decode + eviction step::

    alloc.step(evict_all=True, decode=rows)

with the rows as an int64 numpy array and as a Python list, alternating step by step. The
executor does nothing (``execute`` returns at once): what is timed is the host path between
the caller and the device -- normalise, plan (the compiled planner when it was built),
descriptor write, submit. GC off, ``perf_counter_ns`` per step; p50 with p20 / p80.

**Python calls** (``calls``): the ``call`` events of ``sys.setprofile`` during one step --
every Python-level frame entered (a function, a method, a generator resumed; calls into C are
not counted) -- through each front door of this tree at B = 16 and 256:

=================  ============================================================
front door         one decode + eviction step
=================  ============================================================
``step``           ``alloc.step(evict_all=True, decode=rows)``
``scheduler_step`` ``with alloc.scheduler_step() as it: it.evict_all();
                   it.decode(rows)``
``sglang``         the SGLang seam's ``prepare_for_decode(batch)`` (eviction
                   interval 1; ``seq_lens_cpu`` a CPU tensor, as SGLang keeps it)
``vllm``           the vLLM facade: B ``allocate_slots(rid, 1, ...)`` then
                   ``run_step()``; also per ``allocate_slots`` call
=================  ============================================================

**Trees** (``--trees``): each named commit is checked out into a temporary git worktree and
built there with its own compiled planner (``setup.py build_ext --inplace``, this Python);
nothing of it is kept. ``HEAD`` is this checkout as it is. Every (tree, B) runs in a fresh
interpreter with that tree first on the import path, the trees interleaved per B and the
whole sweep repeated ``--rounds`` times (the sample sets pooled), so machine load falls on all
trees alike. The ``step`` door's calls are counted in every tree.

Writes ``bench_host_step.json``, ``bench_host_step.md`` and ``bench_host_step.png`` into
``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

PAGE_SIZE = 16
MODEL_WINDOW = 4096
BATCHES = (16, 64, 256, 1024)
CALL_BATCHES = (16, 256)
TREES = ("aab3f5b", "86c2913")
TARGET_CALLS = 30  # Python-level calls per decode + eviction step, at most


# ---- the worker: one (tree, B) in a fresh interpreter ------------------------------------
def _import_tree(tree: str):
    """Import graphalloc from ``tree`` (an editable install's finder removed first, so the
    tree on ``sys.path`` wins)."""
    if tree != REPO:
        sys.meta_path[:] = [f for f in sys.meta_path
                            if "__editable__" not in str(getattr(f, "__module__", ""))]
        sys.path.insert(0, tree)
    import graphalloc
    return graphalloc


def _null_executor(ga):
    try:
        from graphalloc.device.executor import Executor
    except ImportError:  # before the rooms: graphalloc/executor.py
        from graphalloc.executor import Executor

    class Null(Executor):
        name = "null"
        stamps_steps = False

        def execute(self, planned) -> None:
            return None

    return Null()


def make_config(ga, batch: int, device: str = "cpu", backend: str = "torch"):
    import torch
    w = MODEL_WINDOW - 1
    max_ctx = 2 * MODEL_WINDOW + 2048
    per_req_full = -(-max_ctx // PAGE_SIZE)
    per_req_swa = -(-w // PAGE_SIZE) + 2
    kw = dict(page_size=PAGE_SIZE, num_full_pages=(batch + 2) * per_req_full + 64,
              num_swa_pages=(batch + 2) * (per_req_swa + 2) + MODEL_WINDOW // PAGE_SIZE + 64,
              max_reqs=batch + 2,
              max_context_len=max_ctx, index_dtype=torch.int32, device=device, backend=backend,
              max_tokens_per_alloc_row=MODEL_WINDOW, max_step_tokens=MODEL_WINDOW + 4 * batch + 8)
    try:
        return ga.AllocatorConfig(model_window=w + 1, **kw)
    except TypeError:  # before model_window: the allocator's own window
        return ga.AllocatorConfig(sliding_window=w, **kw)


def warm_allocator(ga, batch: int, seed: int, executor=None, device: str = "cpu",
                   backend: str = "torch", **alloc_kw):
    """An allocator with ``batch`` requests prefilled to lengths uniform in [W/2, 2W), each
    past one decode step (its window evicted); returns (alloc, rows). ``alloc_kw``: more
    HybridAllocator arguments (page tables)."""
    import numpy as np
    alloc = ga.HybridAllocator(make_config(ga, batch, device, backend),
                               executor=_null_executor(ga) if executor is None else executor,
                               **alloc_kw)
    rng = np.random.default_rng(seed)
    lengths = rng.integers(MODEL_WINDOW // 2, 2 * MODEL_WINDOW, batch)
    rows = []
    for n in lengths.tolist():
        r = alloc.admit()
        done = 0
        while done < n:
            k = min(MODEL_WINDOW, n - done)
            if done:  # the window below the previous chunk first
                alloc.step(evict=[r], extend=([r], [k]))
            else:
                alloc.step(extend=([r], [k]))
            done += k
        alloc.step(evict=[r])  # its SWA pages below the window back before the next one
        rows.append(r)
    alloc.step(evict_all=True, decode=np.array(rows, dtype=np.int64))
    return alloc, rows


def count_calls(fn) -> int:
    """Python-level frames entered while ``fn()`` runs (``sys.setprofile`` ``call`` events),
    ``fn``'s own frame (the measuring wrapper) excluded."""
    n = [0]

    def prof(frame, event, arg):
        if event == "call":
            n[0] += 1

    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return n[0] - 1


def _quantiles(samples: list[float]) -> dict:
    import numpy as np
    a = np.asarray(samples, dtype=np.float64)
    return {"p20": float(np.percentile(a, 20)), "p50": float(np.percentile(a, 50)),
            "p80": float(np.percentile(a, 80)), "n": len(samples)}


def worker(tree: str, batch: int, n_warmup: int, n_samples: int, seed: int) -> dict:
    """Time the decode + eviction step in ``tree`` at ``batch`` (ndarray and list rows,
    alternating); count its Python calls."""
    import gc

    import numpy as np
    ga = _import_tree(tree)
    t0 = time.perf_counter()
    alloc, rows = warm_allocator(ga, batch, seed)
    warm_s = time.perf_counter() - t0
    arr = np.array(rows, dtype=np.int64)
    lst = list(rows)
    times = {"ndarray": [], "list": []}
    c_ns: list = []  # the compiled planner's own clock per step, where it keeps one
    pipeline = getattr(alloc, "pipeline", None)
    twin = getattr(getattr(pipeline, "compiled", None), "_c", None)
    clock = twin if twin is not None and hasattr(twin, "last_ns") else None
    step = alloc.step
    gc.collect()
    gc.disable()
    try:
        for i in range(2 * (n_warmup + n_samples)):
            kind = "ndarray" if i % 2 == 0 else "list"
            r = arr if kind == "ndarray" else lst
            t = time.perf_counter_ns()
            step(evict_all=True, decode=r)
            dt = (time.perf_counter_ns() - t) / 1e3
            if i >= 2 * n_warmup:
                times[kind].append(dt)
                if clock is not None and kind == "ndarray":
                    c_ns.append(clock.last_ns / 1e3)
        calls = {kind: count_calls(lambda r=r: step(evict_all=True, decode=r))
                 for kind, r in (("ndarray", arr), ("list", lst))}
    finally:
        gc.enable()
    planner = "compiled" if getattr(alloc, "pipeline", None) is not None and getattr(
        alloc.pipeline, "compiled", None) is not None else (
        "compiled" if getattr(alloc, "_fast", None) is not None else "numpy")
    return {"tree": tree, "batch": batch, "samples_us": times, "calls": calls,
            "planner": planner, "warm_s": round(warm_s, 2), "steps_run": int(alloc.steps_run),
            "c_plan_us": c_ns}


# ---- this tree's front doors ------------------------------------------------------------
def front_door_calls(batch: int, seed: int) -> dict:
    """Python calls of one decode + eviction step through each front door of this tree."""
    import numpy as np
    import torch

    import graphalloc as ga
    from graphalloc.integrations.sglang import SGLangAllocator
    from graphalloc.integrations.vllm import GraphallocKVCacheManager
    out = {}
    for kind in ("ndarray", "list"):
        alloc, rows = warm_allocator(ga, batch, seed)
        r = np.array(rows, dtype=np.int64) if kind == "ndarray" else list(rows)
        for _ in range(3):
            alloc.step(evict_all=True, decode=r)
        out[f"step/{kind}"] = count_calls(lambda a=alloc, r=r: a.step(evict_all=True, decode=r))

        def block(a=alloc, r=r):
            with a.scheduler_step() as it:
                it.evict_all()
                it.decode(r)
        for _ in range(3):
            block()
        out[f"scheduler_step/{kind}"] = count_calls(block)
    # the SGLang seam: requests as SGLang holds them; one prepare_for_decode per iteration
    alloc = ga.HybridAllocator(make_config(ga, batch), executor=_null_executor(ga))
    seam = SGLangAllocator(alloc)
    rng = np.random.default_rng(seed)
    lengths = rng.integers(MODEL_WINDOW // 2, 2 * MODEL_WINDOW, batch).tolist()
    reqs = []
    for i, n in enumerate(lengths):
        req = _Req(i, range(1000 * i, 1000 * i + n))
        done = 0
        while done < n:
            k = min(MODEL_WINDOW, n - done)
            assert seam.prepare_for_extend(_Batch([req], [done], [k])) is not None
            done += k
            req.kv_len = done
            # a decode evicts the window below the chunk (SGLang's rule at a decode)
            assert seam.prepare_for_decode(_Batch([req], seq_lens_cpu=[done])) is not None
            req.kv_len = done = done + 1
            req.output_ids.append(7)
        reqs.append(req)

    def sglang_decode():
        batch_ = _Batch(reqs, seq_lens_cpu=torch.tensor([q.kv_len for q in reqs]))
        assert seam.prepare_for_decode(batch_) is not None
        for q in reqs:
            q.kv_len += 1
            q.output_ids.append(7)
    for _ in range(3):
        sglang_decode()
    seq = torch.tensor([q.kv_len for q in reqs])
    dec = _Batch(reqs, seq_lens_cpu=seq)
    out["sglang"] = count_calls(lambda: seam.prepare_for_decode(dec))
    # the vLLM facade: B allocate_slots, then run_step
    alloc = ga.HybridAllocator(make_config(ga, batch), executor=_null_executor(ga))
    mgr = GraphallocKVCacheManager(alloc, enable_caching=False)
    computed = {}
    for i, n in enumerate(lengths):
        rid, done = f"r{i}", 0
        while done < n:
            k = min(MODEL_WINDOW, n - done)
            assert mgr.allocate_slots(rid, k, num_computed_tokens=done) is not None
            mgr.run_step()
            done += k
            # one decode token removes the blocks below the window (vLLM's rule)
            assert mgr.allocate_slots(rid, 1, num_computed_tokens=done) is not None
            mgr.run_step()
            done += 1
        computed[rid] = done

    def vllm_iteration():
        for rid, c in computed.items():
            mgr.allocate_slots(rid, 1, num_computed_tokens=c)
        mgr.run_step()
        for rid in computed:
            computed[rid] += 1
    for _ in range(3):
        vllm_iteration()
    rids = list(computed)
    per = count_calls(lambda: mgr.allocate_slots(rids[0], 1,
                                                 num_computed_tokens=computed[rids[0]]))
    rest = count_calls(lambda: [mgr.allocate_slots(rid, 1, num_computed_tokens=computed[rid])
                                for rid in rids[1:]] and mgr.run_step())
    out["vllm"] = per + rest - 1  # (the list comprehension's frame)
    out["vllm/allocate_slots"] = per
    return out


class _Req:
    """The SGLang request fields the seam reads (token ids as a range)."""

    __slots__ = ("rid", "req_pool_idx", "kv_len", "origin_input_ids", "output_ids",
                 "last_node", "done")

    def __init__(self, rid: int, prompt):
        self.rid, self.req_pool_idx, self.kv_len = rid, None, 0
        self.origin_input_ids, self.output_ids = prompt, []
        self.last_node, self.done = None, False

    def finished(self) -> bool:
        return self.done


class _Batch:
    __slots__ = ("reqs", "prefix_lens", "extend_lens", "seq_lens_cpu")

    def __init__(self, reqs, prefix_lens=None, extend_lens=None, seq_lens_cpu=None):
        self.reqs, self.prefix_lens, self.extend_lens = reqs, prefix_lens, extend_lens
        self.seq_lens_cpu = seq_lens_cpu


# ---- the driver: build the trees, run the workers, report --------------------------------
def _git(*args, cwd=REPO) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True,
                          text=True).stdout.strip()


def build_tree(commit: str, root: str) -> str:
    """``commit`` checked out under ``root`` (a detached git worktree) with its compiled
    planner built in place; returns the tree's path."""
    path = os.path.join(root, commit)
    _git("worktree", "add", "--detach", "--force", path, commit)
    proc = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"],
                          cwd=path, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"building {commit} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return path


def run_worker(tree: str, batch: int, n_warmup: int, n_samples: int, seed: int) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", tree, "--batch", str(batch),
           "--n-warmup", str(n_warmup), "--n-samples", str(n_samples), "--seed", str(seed)]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env.pop("GRAPHALLOC_PLANNER", None)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tree)
    if proc.returncode != 0:
        raise SystemExit(f"worker {tree} B={batch} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _q(s: dict) -> str:
    return f"{s['p50']:.1f} ({s['p20']:.1f} / {s['p80']:.1f})"


def plot(doc: dict, path: str) -> bool:
    """Left: host us per step (p50, p20-p80 bands) per tree against B, ndarray solid and
    list dashed. Right: Python calls per step through each front door of this tree, and
    the ``step`` door of every tree, at B = 16 and 256, with the target."""
    sys.path.insert(0, HERE)
    try:
        from figures import finish, machine_name, pyplot, set_b_axis, set_log_y
    finally:
        sys.path.pop(0)
    plt = pyplot()
    rows = doc.get("timing", [])
    if plt is None or not rows:
        return False
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13.0, 5.0),
                                 gridspec_kw={"width_ratios": (1.0, 1.25)})
    trees = doc["trees"]
    colors = ["tab:gray", "tab:orange", "tab:purple", "tab:green", "tab:blue", "tab:red"]
    batches = sorted({r["batch"] for r in rows})
    for i, tree in enumerate(trees):
        color = colors[i % len(colors)] if tree["name"] != "HEAD" else "tab:blue"
        for kind, ls in (("ndarray", "-"), ("list", "--")):
            sel = sorted((r for r in rows if r["tree"] == tree["name"]), key=lambda r: r["batch"])
            if not sel:
                continue
            b = [r["batch"] for r in sel]
            ax.plot(b, [r["us"][kind]["p50"] for r in sel], color=color, ls=ls, marker="o",
                    label=f"{tree['label']}, {kind}")
            ax.fill_between(b, [r["us"][kind]["p20"] for r in sel],
                            [r["us"][kind]["p80"] for r in sel], color=color, alpha=0.10)
    set_log_y(ax)
    set_b_axis(ax, batches, "running requests B")
    ax.set_ylabel("host us per decode + eviction step (p50)")
    ax.set_title("alloc.step(evict_all=True, decode=rows), null executor", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    labels, values, hatch = [], [], []
    calls = doc.get("calls", {})
    for b in sorted(calls, key=int):
        for door, n in calls[b].items():
            if door == "vllm/allocate_slots":
                continue
            labels.append(f"{door} B={b}")
            values.append(n)
            hatch.append("HEAD")
    for r in sorted(rows, key=lambda r: (r["batch"], r["tree"])):
        if r["batch"] in CALL_BATCHES and r["tree"] != "HEAD":
            for kind in ("ndarray", "list"):
                labels.append(f"step/{kind} B={r['batch']} @{r['tree']}")
                values.append(r["calls"][kind])
                hatch.append(r["tree"])
    y = range(len(labels))
    bx.barh(list(y), values, color=["tab:blue" if h == "HEAD" else "tab:gray" for h in hatch])
    for yi, v in zip(y, values, strict=True):
        bx.text(v, yi, f" {v}", va="center", fontsize=7)
    bx.set_yticks(list(y))
    bx.set_yticklabels(labels, fontsize=7)
    bx.invert_yaxis()
    bx.set_xscale("log")
    bx.axvline(TARGET_CALLS, color="black", ls="--", lw=1)
    bx.set_xlabel("Python-level calls per decode + eviction step (log)")
    bx.set_title(f"calls per step: this tree (blue), earlier commits (gray); target <= "
                 f"{TARGET_CALLS} (dashed)", fontsize=9)
    bx.grid(True, axis="x", which="both", alpha=0.3)
    caption = ("One decode + eviction step of B requests (page size 16, W = 4096, lengths "
               "uniform in [W/2, 2W)), rows as an int64 ndarray (solid) or a list (dashed), "
               "alternating; the executor does nothing, so the time is the host path (normalise, "
               "plan, descriptor write, submit). Bands: p20-p80. Earlier commits rebuilt with "
               "their own compiled planner and run in the same sweep. Calls: sys.setprofile "
               "'call' events during one step (Python frames; calls into C not counted). vllm: "
               "B allocate_slots + run_step (the per-request calls are the engine's).")
    finish(fig, path, title="The host step's fixed cost: time and Python calls per step ["
           f"{machine_name(doc.get('machine'))}]", caption=caption)
    return True


def _markdown(doc: dict) -> str:
    lines = ["# The host step's fixed cost", "", f"`{doc['command']}` on "
             f"{doc['machine']['summary']}.", "",
             "One decode + eviction step, `alloc.step(evict_all=True, decode=rows)`, B running "
             "requests (page size 16, W = 4096, lengths uniform in [W/2, 2W)), null executor "
             "(the host path only). Microseconds per step, p50 (p20 / p80), rows as an int64 "
             "ndarray and as a list, alternating per step; each tree built with its own "
             "compiled planner and run in the same sweep, interleaved per B.", "",
             "Trees: " + "; ".join(f"`{t['name']}` = {t['label']}" for t in doc["trees"]), "",
             "`C plan`: the compiled planner's own clock inside the step (ndarray steps; trees "
             "whose planner keeps one), so the rest of a step is the Python around it.", "",
             "| B | tree | planner | ndarray us | list us | C plan us | calls ndarray | "
             "calls list |", "|---:|:---|:---|---:|---:|---:|---:|---:|"]
    for r in sorted(doc["timing"], key=lambda r: (r["batch"], doc["tree_order"].index(r["tree"]))):
        c_plan = _q(r["c_plan_us"]) if r.get("c_plan_us") else "-"
        lines.append(f"| {r['batch']} | {r['tree']} | {r['planner']} | {_q(r['us']['ndarray'])} "
                     f"| {_q(r['us']['list'])} | {c_plan} | {r['calls']['ndarray']} | "
                     f"{r['calls']['list']} |")
    lines += ["", f"## Python-level calls per decode + eviction step, this tree (target <= "
              f"{TARGET_CALLS})", "",
              "`sys.setprofile` `call` events during one step: every Python frame entered "
              "between the caller and the C planner (calls into C not counted).", "",
              "| front door | " + " | ".join(f"B = {b}" for b in sorted(doc["calls"], key=int))
              + " |", "|:---|" + "---:|" * len(doc["calls"])]
    doors = list(next(iter(doc["calls"].values())))
    for door in doors:
        lines.append(f"| {door} | " + " | ".join(str(doc["calls"][b][door])
                                                for b in sorted(doc["calls"], key=int)) + " |")
    lines += ["", "`vllm`: B `allocate_slots` calls plus `run_step()`; `vllm/allocate_slots`: "
              "one of those calls (the engine makes one per request).", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--out", default=os.path.join(REPO, "results", "bench", "host-step-cpu"))
    p.add_argument("--quick", action="store_true", help="B = 16, 256, few samples, 1 round")
    p.add_argument("--trees", default=",".join(TREES),
                   help="commits to rebuild and time beside this tree (comma-separated; "
                        "empty: this tree only)")
    p.add_argument("--batches", default=",".join(map(str, BATCHES)))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--n-samples", type=int, default=300)
    p.add_argument("--n-warmup", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    sys.path.insert(0, HERE)
    from provenance import add_stamp_option, stamp_or_exit
    sys.path.pop(0)
    add_stamp_option(p)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.batch, args.n_warmup, args.n_samples,
                                args.seed)))
        return 0
    stamp_or_exit(args.out, os.path.abspath(__file__), argv, allow_dirty=args.allow_dirty)
    batches = [int(b) for b in args.batches.split(",") if b]
    n_samples, n_warmup, rounds = args.n_samples, args.n_warmup, args.rounds
    if args.quick:
        batches, n_samples, n_warmup, rounds = [16, 256], 40, 5, 1
    commits = [c for c in args.trees.split(",") if c]
    import torch  # noqa: F401  (timing imports it)
    sys.path.insert(0, HERE)
    from timing import machine_info
    sys.path.pop(0)
    tmp = tempfile.mkdtemp(prefix="bench_host_step_")
    dirty = " + changes" if _git("status", "--porcelain", "--untracked-files=no") else ""
    trees = [{"name": "HEAD", "path": REPO,
              "label": f"this tree ({_git('rev-parse', '--short', 'HEAD')}{dirty})"}]
    try:
        for c in commits:
            print(f"building {c} in {tmp}", flush=True)
            trees.append({"name": c, "path": build_tree(c, tmp),
                          "label": f"{c}: " + _git("log", "-1", "--format=%cs", c)})
        print("front-door calls (this tree)", flush=True)
        calls = {str(b): front_door_calls(b, args.seed + b) for b in CALL_BATCHES}
        for b, c in calls.items():
            print(f"  B={b}: {c}", flush=True)
        pooled: dict = {}
        for rnd in range(rounds):
            for b in batches:
                order = trees if rnd % 2 == 0 else trees[::-1]
                for t in order:
                    res = run_worker(t["path"], b, n_warmup, n_samples, args.seed + b)
                    key = (t["name"], b)
                    if key not in pooled:
                        pooled[key] = res
                    else:
                        for kind in ("ndarray", "list"):
                            pooled[key]["samples_us"][kind] += res["samples_us"][kind]
                        pooled[key]["c_plan_us"] += res["c_plan_us"]
                    print(f"  round {rnd} B={b:5d} {t['name']:8s} {res['planner']:8s} ndarray "
                          f"{_q(_quantiles(res['samples_us']['ndarray']))}  list "
                          f"{_q(_quantiles(res['samples_us']['list']))}  calls "
                          f"{res['calls']}", flush=True)
    finally:
        for t in trees[1:]:
            subprocess.run(["git", "worktree", "remove", "--force", t["path"]], cwd=REPO,
                           capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)
        subprocess.run(["git", "worktree", "prune"], cwd=REPO, capture_output=True)
    timing = []
    for (name, b), res in pooled.items():
        timing.append({"tree": name, "batch": b, "planner": res["planner"],
                       "us": {k: _quantiles(v) for k, v in res["samples_us"].items()},
                       "c_plan_us": _quantiles(res["c_plan_us"]) if res["c_plan_us"] else None,
                       "calls": res["calls"]})
    doc = {"benchmark": "bench_host_step", "command": "python benchmarks/bench_host_step.py "
           + " ".join(argv), "page_size": PAGE_SIZE,
           "model_window": MODEL_WINDOW, "rounds": rounds, "n_samples": n_samples,
           "n_warmup": n_warmup, "target_calls": TARGET_CALLS, "machine": machine_info("cpu"),
           "trees": [{k: t[k] for k in ("name", "label")} for t in trees],
           "tree_order": [t["name"] for t in trees], "calls": calls, "timing": timing,
           "load_average": list(os.getloadavg())}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_host_step.json"), "w") as f:
        json.dump(doc, f, indent=1)
    md = _markdown(doc)
    with open(os.path.join(args.out, "bench_host_step.md"), "w") as f:
        f.write(md)
    plot(doc, os.path.join(args.out, "bench_host_step.png"))
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
