"""Host cost of SGLang's own iteration (its allocation path, frees and window eviction) on
SGLang's allocator and on graphalloc's, same seeded continuous-batching workload.

Runs in SGLang's environment (``tools/engines/install_sglang.sh``). For every batch size B,
page size, window W and eviction interval: B requests are prefilled, then decode
iterations are timed in steady state (finished requests replaced by new ones, so
releases and admissions happen too). Reported per iteration: host time of the whole
iteration (SGLang's path + the harness loop, the same code on both), host time inside
the allocator's methods (each call wrapped by a timer), and device ops issued by the
allocator's methods (aten ops counted by a dispatch mode in a separate, untimed pass:
each is a kernel launch on a GPU). ``--device cuda`` runs the same on a GPU (host times
then exclude the device; the loop synchronises after each iteration, untimed).

    .engines/sglang/bin/python benchmarks/sglang_path.py --out results/engines/sglang-path-cpu
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools" / "engines"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import sglang_import  # noqa: E402
from sglang_loop import Loop, Workload  # noqa: E402

METHODS = ("alloc_extend", "alloc_decode", "alloc", "free", "free_swa", "free_full",
           "free_segment", "free_swa_segment", "free_full_segment", "free_segments",
           "free_full_segments", "free_group_begin", "free_group_end", "available_size",
           "full_available_size", "swa_available_size", "translate_loc_from_full_to_swa")
_VIEWS = {"view", "_unsafe_view", "slice", "select", "as_strided", "alias", "detach",
          "expand", "unsqueeze", "squeeze", "t", "lift_fresh", "_to_copy_view"}


class OpCounter(TorchDispatchMode):
    """Counts aten ops that move data (views and metadata ops left out)."""

    def __init__(self):
        super().__init__()
        self.n = 0
        self.on = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.on and func.__name__.split(".")[0] not in _VIEWS:
            self.n += 1
        return func(*args, **(kwargs or {}))


def instrument(alloc, clock: list, counter: OpCounter | None):
    """Wrap the allocator's SGLang methods: time inside them (outermost call only)."""
    depth = [0]
    for name in METHODS:
        method = getattr(alloc, name, None)
        if method is None:
            continue

        @functools.wraps(method)
        def wrapped(*a, _m=method, **k):
            depth[0] += 1
            outer = depth[0] == 1
            if outer and counter is not None:
                counter.on = True
            t0 = time.perf_counter()
            try:
                return _m(*a, **k)
            finally:
                if outer:
                    clock[0] += time.perf_counter() - t0
                    if counter is not None:
                        counter.on = False
                depth[0] -= 1
        setattr(alloc, name, wrapped)


def workload(batch: int, ps: int, window: int, interval: int, seed: int) -> Workload:
    ctx_pages = -(-(300 + 400) // ps) + 2
    return Workload(f"B{batch}-ps{ps}-w{window}-i{interval}", page_size=ps, window=window,
                    eviction_interval=interval, chunk_tokens=16384, n_requests=4 * batch,
                    max_running=batch, prompt_tokens=(100, 300), output_tokens=(60, 400),
                    full_pages=batch * ctx_pages + 64, swa_pages=batch * ctx_pages + 64,
                    seed=seed)


def measure(sg, kind: str, w: Workload, device: str, iters: int, count_ops: bool):
    loop = Loop(sg, kind, w, device=device)
    while len(loop.running) < w.max_running and not loop.done():  # fill the batch
        loop.iteration()
    clock, counter = [0.0], (OpCounter() if count_ops else None)
    instrument(loop.alloc, clock, counter)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    times, inside, kinds = [], [], []
    ctx = counter if counter is not None else _Null()
    with ctx:
        for _ in range(iters):
            if loop.done():
                break
            before = clock[0]
            t0 = time.perf_counter()
            rec = loop.iteration()
            times.append(time.perf_counter() - t0)
            inside.append(clock[0] - before)
            kinds.append(rec["kind"])
            sync()
    out = {"iteration_us": 1e6 * float(np.median(times)),
           "allocator_us": 1e6 * float(np.median(inside)),
           "iterations": len(times), "decodes": kinds.count("decode")}
    if counter is not None:
        out["allocator_ops_per_iter"] = counter.n / max(len(times), 1)
    return out


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--page-size", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--window", type=int, nargs="+", default=[128, 4096])
    ap.add_argument("--interval", type=int, nargs="+", default=[1, 128])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--out", default="results/engines/sglang-path-local")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    sg = sglang_import.import_sglang()
    if sg is None:
        print("SGLang is not installed here: run tools/engines/install_sglang.sh")
        return 2
    rows = []
    for b, ps, wnd, itv in itertools.product(args.batch, args.page_size, args.window,
                                             args.interval):
        w = workload(b, ps, wnd, itv, seed=b + ps)
        row = {"batch": b, "page_size": ps, "window": wnd, "interval": itv}
        for kind in ("sglang", "graphalloc"):
            timed = measure(sg, kind, w, args.device, args.iters, count_ops=False)
            ops = measure(sg, kind, w, args.device, min(args.iters, 5), count_ops=True)
            row[kind] = {**timed, "allocator_ops_per_iter": ops["allocator_ops_per_iter"]}
        row["iteration_ratio"] = row["sglang"]["iteration_us"] / row["graphalloc"]["iteration_us"]
        row["allocator_ratio"] = row["sglang"]["allocator_us"] / row["graphalloc"]["allocator_us"]
        rows.append(row)
        print(f"B={b:5d} ps={ps:3d} W={wnd:5d} I={itv:4d}  iteration us sglang "
              f"{row['sglang']['iteration_us']:9.1f} graphalloc "
              f"{row['graphalloc']['iteration_us']:9.1f}"
              f" ({row['iteration_ratio']:.2f}x)  allocator us {row['sglang']['allocator_us']:8.1f}"
              f" / {row['graphalloc']['allocator_us']:8.1f} ({row['allocator_ratio']:.2f}x)  ops "
              f"{row['sglang']['allocator_ops_per_iter']:.0f} / "
              f"{row['graphalloc']['allocator_ops_per_iter']:.0f}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sglang_path.json").write_text(json.dumps({"device": args.device, "rows": rows},
                                                     indent=1) + "\n")
    try:
        import sglang_path_plot
        sglang_path_plot.plot({"device": args.device, "rows": rows},
                              str(out / "sglang_path.png"))
    except ImportError:  # no matplotlib in SGLang's environment: benchmarks/replot.py
        print("matplotlib missing: draw the plot with benchmarks/replot.py")
    print(f"wrote {out / 'sglang_path.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
