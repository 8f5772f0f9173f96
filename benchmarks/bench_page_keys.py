"""Page keys: what hashing costs per page, and what share of a prefix-caching step it is.

    python benchmarks/bench_page_keys.py --out results/bench/page-keys-cpu
    python benchmarks/bench_page_keys.py --quick --out /tmp/page_keys      # CPU smoke run
    python benchmarks/bench_page_keys.py --tree OLD_CHECKOUT --share-only --out DIR

1. Cost per page (host only). The keys of a request's whole pages, in one call, for
   prompts of 1,024 and 8,192 tokens at page size 16 and 64, and the incremental call of
   a decode (one new page, the request's keys kept), for:

       before        the BLAKE2b loop in Python that page_keys was until this benchmark's
                     commit (hashlib, one call a page, over int64 bytes), written out here
       siphash       page_keys now: SipHash-2-4-128 in C (graphalloc.sharing._ckeys),
                     token ids as a list and as an int64 array
       blake2b       page_keys(..., key_hash="blake2b"), the opt-in multi-tenant mode
       python twin   page_keys(..., compiled=False): the reference, used when the C part
                     is not built (1,024 tokens only: it is slow)

   timeit: the best of 7 repeats of n calls (n sized to ~20 ms), per call and per page.

2. Share of the step. The scheduler benchmark's prefix workload (``sched_workload``,
   ``--prefix-cache system-prompt``: a shared 1,024-token system prompt, B running
   requests, page size 16, window 4096, eviction interval 1) replayed by graphalloc's
   direct driver, its SGLang seam and its vLLM facade (``sched_graphalloc.py``,
   ``sched_seams.py``) on the CPU, eager: host time of each measured step, and the time
   spent inside ``page_keys`` during it (every module's reference to it wrapped by a timer;
   the wrapper's own ~0.1 us a call is counted in the step, not in hashing; the garbage
   collector off during the measured steps, as in bench_scheduler). ``--tree``
   imports graphalloc and the drivers from another checkout (built), to measure the code
   before this change the same way.

Writes ``bench_page_keys.json`` and ``bench_page_keys.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import sys
import time
import timeit

HERE = os.path.dirname(os.path.abspath(__file__))


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(os.path.dirname(HERE), "results", "bench",
                                                 "page-keys"), help="output directory")
    p.add_argument("--quick", action="store_true", help="small sizes (CI smoke run)")
    p.add_argument("--tree", default=None,
                   help="a graphalloc checkout to import graphalloc and the benchmark "
                        "drivers from (default: this one)")
    p.add_argument("--share-only", action="store_true", help="only part 2")
    p.add_argument("--b", default="16,64,256", help="running requests for part 2")
    p.add_argument("--steps", type=int, default=60, help="measured steps per driver")
    return p.parse_args(argv)


def before_page_keys(token_ids, page_size, keys=None):
    """page_keys as it was before this benchmark's commit (for the 'before' column)."""
    import numpy as np

    if keys is None:
        keys = []
    first, n_pages = len(keys), len(token_ids) // page_size
    if n_pages <= first:
        return keys
    data = np.asarray(token_ids[first * page_size:n_pages * page_size],
                      dtype=np.int64).tobytes()
    step = 8 * page_size
    prev = keys[-1] if keys else b""
    append, blake2b = keys.append, hashlib.blake2b
    for start in range(0, len(data), step):
        prev = blake2b(prev + data[start:start + step], digest_size=16).digest()
        append(prev)
    return keys


def _best(fn, budget_s: float = 0.02) -> float:
    """Seconds per call: the best of 7 repeats of n calls, n sized to ``budget_s``."""
    t0 = time.perf_counter()
    fn()
    one = max(time.perf_counter() - t0, 1e-7)
    n = max(1, int(budget_s / one))
    return min(timeit.repeat(fn, number=n, repeat=7)) / n


def _one_size(ps: int, n_tokens: int) -> list[dict]:
    import numpy as np

    from graphalloc.sharing.page_keys import COMPILED, page_keys

    toks = list(range(1000, 1000 + n_tokens))
    arr = np.array(toks, dtype=np.int64)
    n_pages = n_tokens // ps
    cases = [("before", "list", lambda: before_page_keys(toks, ps)),
             ("before", "array", lambda: before_page_keys(arr, ps)),
             ("siphash", "list", lambda: page_keys(toks, ps)),
             ("siphash", "array", lambda: page_keys(arr, ps)),
             ("blake2b", "list", lambda: page_keys(toks, ps, key_hash="blake2b"))]
    if n_tokens <= 1024:
        cases.append(("python twin", "list", lambda: page_keys(toks, ps, compiled=False)))
    rows = []
    for impl, form, fn in cases:
        s = _best(fn, 0.005 if impl == "python twin" else 0.02)
        rows.append({"impl": impl, "input": form, "page_size": ps, "tokens": n_tokens,
                     "pages": n_pages, "call_us": s * 1e6, "ns_per_page": s * 1e9 / n_pages,
                     "compiled": COMPILED})
    # the decode case: the request's keys kept, one new page per call (the list copy that
    # keeps the kept keys unchanged between calls is timed alone and subtracted)
    kept_new = page_keys(toks[:n_tokens - ps], ps)
    kept_old = before_page_keys(toks[:n_tokens - ps], ps)
    copy = _best(lambda: kept_new[:])
    for impl, fn in (("before", lambda: before_page_keys(toks, ps, kept_old[:])),
                     ("siphash", lambda: page_keys(toks, ps, kept_new[:]))):
        s = _best(fn) - copy
        rows.append({"impl": impl, "input": "list, one new page", "page_size": ps,
                     "tokens": n_tokens, "pages": 1, "call_us": s * 1e6,
                     "ns_per_page": s * 1e9, "compiled": COMPILED})
    return rows


def per_page(quick: bool) -> list[dict]:
    rows = []
    for ps in (16, 64):
        for n_tokens in ((256, 1024) if quick else (1024, 8192)):
            rows += _one_size(ps, n_tokens)
    return rows


# ---- part 2: the share of a prefix-caching step ---------------------------------------
class _HashTimer:
    """Wraps every loaded reference to page_keys; ``ns`` the time inside, ``calls``."""

    def __init__(self):
        import graphalloc.sharing.prefix_cache as pc

        self.orig = pc.page_keys
        self.ns = self.calls = 0
        self.per_call: list[float] = []
        orig, timer = self.orig, self

        def timed(*args, **kwargs):
            t0 = time.perf_counter_ns()
            try:
                return orig(*args, **kwargs)
            finally:
                dt = time.perf_counter_ns() - t0
                timer.ns += dt
                timer.calls += 1
                timer.per_call.append(dt / 1e3)

        self.patched = []
        for name, mod in list(sys.modules.items()):
            if (name.startswith("graphalloc") or name.startswith("sched_")) and getattr(
                    mod, "page_keys", None) is orig:
                mod.page_keys = timed
                self.patched.append(name)

    def restore(self) -> None:
        for name in self.patched:
            sys.modules[name].page_keys = self.orig


class _DeviceClock:
    """The drivers' clock: adds up the executor's wall time (on the CPU the device work
    runs eagerly inside the step; it is not host work and is subtracted)."""

    def __init__(self):
        self.ns = 0

    def device_begin(self):
        self._t0 = time.perf_counter_ns()

    def device_end(self):
        self.ns += time.perf_counter_ns() - self._t0


def step_share(bs, n_steps: int, quick: bool) -> list[dict]:
    import types

    import numpy as np
    import torch

    sys.path.insert(0, os.path.join(TREE, "benchmarks"))
    import bench_scheduler as bs_mod
    from sched_workload import WorkloadSpec, generate

    ctx = types.SimpleNamespace(device=torch.device("cpu"), backend="torch",
                                args=types.SimpleNamespace(sglang_decode="eager"))
    rows = []
    for b in bs:
        spec = WorkloadSpec(n_running=b, page_size=16, window=4096, eviction_interval=1,
                            chunk_tokens=8192, sigma=0.8, seed=7919 * b,
                            **bs_mod.lengths_for(4096, quick), prefix="system-prompt",
                            system_prompt_tokens=64 if quick else 1024)
        trace = generate(spec, 4 if quick else 10, n_steps, 0)
        cfgs = bs_mod.graphalloc_configs(ctx, trace)
        m0 = trace.phase_start["measure"]
        for name in ("graphalloc", "graphalloc_sglang", "graphalloc_vllm"):
            d = bs_mod.build_driver(ctx, name, trace, cfgs)
            prepare = getattr(d, "prepare", None)
            clock = _DeviceClock()
            for st in trace.steps[:m0]:
                if prepare is not None:
                    prepare(st)
                d.step(st, clock)
            timer = _HashTimer()
            host = []
            gc.collect()
            gc.disable()  # no collector pause inside the measured steps (bench_scheduler's rule)
            try:
                for st in trace.steps[m0:m0 + n_steps]:
                    if prepare is not None:
                        prepare(st)
                    clock.ns = 0
                    t0 = time.perf_counter_ns()
                    d.step(st, clock)
                    host.append(time.perf_counter_ns() - t0 - clock.ns)
            finally:
                gc.enable()
                timer.restore()
                if hasattr(d, "close"):
                    d.close()
            total = float(np.sum(host))
            rows.append({"b": b, "impl": name, "steps": len(host),
                         "host_us_p50": float(np.median(host)) / 1e3,
                         "host_us_mean": total / len(host) / 1e3,
                         "hash_us_per_step": timer.ns / len(host) / 1e3,
                         "hash_calls_per_step": timer.calls / len(host),
                         "hash_us_per_call_p50": float(np.median(timer.per_call))
                         if timer.per_call else 0.0,
                         "hash_share": timer.ns / total if total else 0.0})
    return rows


def markdown(res: dict) -> str:
    lines = ["# bench_page_keys: page keys per page, and their share of a prefix-caching step",
             "", f"Command: `{res['command']}`  ", f"Machine: {res['machine']}  ",
             f"Tree: {res['tree']} at {res['commit']}", ""]
    if res.get("per_page"):
        lines += ["## 1. Cost per page (us per call / ns per page, best of 7)", "",
                  "`before` is the BLAKE2b loop page_keys was; `siphash` is page_keys now "
                  "(C); `blake2b` its opt-in mode; `python twin` the reference used when the "
                  "C part is not built.", "",
                  "| page size | tokens | input | impl | us per call | ns per page |",
                  "|---|---|---|---|---|---|"]
        for r in res["per_page"]:
            lines.append(f"| {r['page_size']} | {r['tokens']} | {r['input']} | {r['impl']} | "
                         f"{r['call_us']:.2f} | {r['ns_per_page']:.0f} |")
    if res.get("share"):
        lines += ["", "## 2. Share of a prefix-caching step spent in page_keys", "",
                  "Host us per step (eager, CPU); hashing = time inside page_keys during "
                  "the measured steps.", "",
                  "| B | driver | steps | host us p50 | host us mean | hash us per step | "
                  "page_keys calls per step | us per call (p50) | hash share (of the mean) |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in res["share"]:
            lines.append(f"| {r['b']} | {r['impl']} | {r['steps']} | {r['host_us_p50']:.0f} | "
                         f"{r['host_us_mean']:.0f} | {r['hash_us_per_step']:.1f} | "
                         f"{r['hash_calls_per_step']:.1f} | {r['hash_us_per_call_p50']:.1f} | "
                         f"{100 * r['hash_share']:.1f}% |")
    return "\n".join(lines) + "\n"


def _commit(tree: str) -> str:
    import subprocess

    try:
        out = subprocess.run(["git", "-C", tree, "rev-parse", "--short=12", "HEAD"],
                             capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", tree, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        return out + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "not a git checkout"


def main(argv=None) -> int:
    global TREE
    args = _parse(sys.argv[1:] if argv is None else argv)
    TREE = os.path.abspath(args.tree) if args.tree else os.path.dirname(HERE)
    sys.path.insert(0, TREE)
    import platform

    import torch

    torch.set_num_threads(1)
    shown = []  # the command as run, with this machine's folders as placeholders
    for arg in (sys.argv[1:] if argv is None else argv):
        path = os.path.abspath(arg) if os.path.exists(arg) or os.sep in arg else None
        if path and path.startswith(os.path.dirname(HERE) + os.sep):
            arg = os.path.relpath(path, os.path.dirname(HERE))
        elif path and arg not in ("--tree",):
            arg = "OTHER_CHECKOUT" if os.path.isdir(os.path.join(path, "graphalloc")) else arg
        shown.append(arg)
    res = {"command": "python benchmarks/bench_page_keys.py " + " ".join(shown),
           "tree": "this checkout" if TREE == os.path.dirname(HERE) else "OTHER_CHECKOUT",
           "commit": _commit(TREE),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                   f"Python {platform.python_version()}, torch {torch.__version__}"}
    if not args.share_only:
        res["per_page"] = per_page(args.quick)
    bs = [int(x) for x in args.b.split(",")] if not args.quick else [4]
    res["share"] = step_share(bs, 12 if args.quick else args.steps, args.quick)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_page_keys.json"), "w") as f:
        json.dump(res, f, indent=1)
    text = markdown(res)
    with open(os.path.join(args.out, "bench_page_keys.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


TREE = os.path.dirname(HERE)

if __name__ == "__main__":
    sys.exit(main())
