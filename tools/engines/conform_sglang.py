"""SGLang conformance: SGLang's own allocation path on seeded workloads, run once with
SGLang's ``SWATokenToKVPoolAllocator`` and once with graphalloc's, compared iteration by
iteration (``tools/engines/sglang_loop.py`` says which code is SGLang's).

Compared at every iteration (equal or the workload is not identical): the scheduling
decision (extend or decode, which requests, which finished, which were retracted), the
free FULL and SWA tokens, and for every request holding KV its FULL pages, its SWA pages
and its window frontier (SGLang's ``swa_evicted_seqlen``); with SGLang's radix cache
(``radix`` workloads, ``sglang_radix_loop.py``) also every admitted request's prefix hit,
the tree's evictable FULL / SWA tokens and its protected tokens. Page ids are not compared
(SGLang's free list is LIFO, graphalloc's ring FIFO); instead, on graphalloc's side, no
FULL or SWA page is held by two requests and none is page 0, at every iteration, and the
rings hold distinct pages at the end (``check()``).

    python tools/engines/conform_sglang.py --out results/engines/sglang-0.5.23
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import sglang_import  # noqa: E402
from sglang_loop import Loop, Workload  # noqa: E402
from sglang_radix_loop import RadixLoop  # noqa: E402

WORKLOADS = [
    Workload("ps16-w128-i1", page_size=16, window=128, eviction_interval=1, seed=1),
    Workload("ps16-w128-i128", page_size=16, window=128, eviction_interval=128, seed=2),
    Workload("ps64-w128-i1", page_size=64, window=128, eviction_interval=1, seed=3,
             full_pages=160, swa_pages=48),
    Workload("ps16-w4096-i1", page_size=16, window=4096, eviction_interval=1, seed=4,
             prompt_tokens=(200, 3000), output_tokens=(4, 300), full_pages=2048,
             swa_pages=2048, chunk_tokens=1024),
    Workload("ps64-w32-page-over-window", page_size=64, window=32, eviction_interval=1,
             seed=5, full_pages=160, swa_pages=40),
    Workload("ps1-w64-i16", page_size=1, window=64, eviction_interval=16, seed=6,
             full_pages=6000, swa_pages=2000),
    Workload("tight-retract-ps16", page_size=16, window=128, eviction_interval=1, seed=7,
             full_pages=96, swa_pages=40, max_running=24, output_tokens=(100, 400),
             prompt_tokens=(16, 300)),
    Workload("small-chunks-ps16", page_size=16, window=256, eviction_interval=32, seed=8,
             chunk_tokens=96, n_requests=32),
    Workload("radix-ps16-w64", page_size=16, window=64, radix=True, seed=9, n_requests=64,
             full_pages=160, swa_pages=64, prompt_tokens=(16, 160), output_tokens=(4, 100)),
    Workload("radix-ps64-w32-page-over-window", page_size=64, window=32, radix=True,
             seed=10, n_requests=48, full_pages=60, swa_pages=24, system_tokens=256,
             prompt_tokens=(16, 200), output_tokens=(4, 140)),
    Workload("radix-tenants-small-chunks", page_size=16, window=128, radix=True, seed=11,
             n_requests=64, tenants=3, system_prompts=1, chunk_tokens=128,
             full_pages=200, swa_pages=80, prompt_tokens=(16, 120), output_tokens=(4, 80)),
]


def run(sg, kind: str, w: Workload, limit: int = 20_000):
    loop = (RadixLoop if w.radix else Loop)(sg, kind, w)
    records, disjoint = [], True
    while not loop.done() and loop.n_iter < limit:
        records.append(loop.iteration(observe=True))
        if kind == "graphalloc":
            disjoint = disjoint and loop.owners_disjoint()
    if kind == "graphalloc":
        loop.alloc.check()
    return loop, records, disjoint


def compare(w: Workload, sg) -> dict:
    ref_loop, ref, _ = run(sg, "sglang", w)
    ga_loop, got, disjoint = run(sg, "graphalloc", w)
    pairs = zip(ref, got, strict=False)
    first = next((i for i, (a, b) in enumerate(pairs) if a != b), None)
    if first is None and len(ref) != len(got):
        first = min(len(ref), len(got))
    kinds = [r["kind"] for r in ref]
    return {
        "name": w.name, "identical": first is None and disjoint,
        "first_difference": None if first is None else {
            "iteration": first + 1, "sglang": ref[first] if first < len(ref) else None,
            "graphalloc": got[first] if first < len(got) else None},
        "iterations": len(ref), "extends": kinds.count("extend"),
        "decodes": kinds.count("decode"),
        "retractions": sum(len(r.get("retracted", ())) for r in ref),
        "window_moves": sum(1 for a, b in zip(ref, ref[1:], strict=False)
                            for rid, h in b.get("held", {}).items()
                            if rid in a.get("held", {}) and h[2] > a["held"][rid][2]),
        "owners_disjoint": disjoint,
        "prefix_hit_tokens": sum(h for r in ref for h in r.get("hits", ())),
        "cache_shrinks": sum(1 for a, b in zip(ref, ref[1:], strict=False)
                             if "evictable" in a and b["evictable"][0] < a["evictable"][0]),
        "graphalloc_steps": ga_loop.alloc.n_steps,
        "graphalloc_host_reads": ga_loop.alloc.n_host_reads,
        "workload": {k: getattr(w, k) for k in w.__dataclass_fields__},
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results/engines/sglang-local")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    sg = sglang_import.import_sglang()
    if sg is None:
        print("SGLang is not installed here: run tools/engines/install_sglang.sh")
        return 2
    import sglang
    import torch
    rows = []
    for w in WORKLOADS:
        row = compare(w, sg)
        rows.append(row)
        print(f"{w.name:28s} identical={row['identical']!s:5s} iterations={row['iterations']:5d} "
              f"retractions={row['retractions']:3d} window_moves={row['window_moves']:5d} "
              f"hits={row['prefix_hit_tokens']} shrinks={row['cache_shrinks']} "
              f"steps={row['graphalloc_steps']} host_reads={row['graphalloc_host_reads']}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=HERE).stdout.strip()
    summary = {"engine": "sglang", "version": sglang.__version__, "torch": torch.__version__,
               "machine": platform.machine(), "python": platform.python_version(),
               "commit": commit, "compared": ["decision", "finished", "retracted",
                                              "available_full", "available_swa",
                                              "pages_held_full", "pages_held_swa",
                                              "window_frontier"],
               "invariant": "page ids differ (LIFO vs FIFO free lists); on graphalloc no "
                            "page is held by two requests, none is page 0, rings distinct",
               "workloads": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"wrote {out / 'summary.json'}")
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
