"""Host cost of graphalloc's SGLang allocator alone (no SGLang needed): a steady decode
iteration as SGLang's path makes it (window evictions and releases recorded as segment
frees in free groups, then ``alloc_decode``), with the Triton step kernels and with their
Torch twins, checked to hand out the same slots.

Per B: host us per iteration inside the allocator's calls (median), and its device ops per
iteration (aten ops counted by a dispatch mode, plus the Triton launches: two per step).
On a GPU the calls are timed without synchronising (host time); the device is
synchronised after each iteration, untimed.

    python benchmarks/bench_sglang_pool.py --device cuda --out OUTDIR
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from graphalloc.integrations.sglang_pool import GraphallocTokenToKVPoolAllocator

_VIEWS = {"view", "_unsafe_view", "slice", "select", "as_strided", "alias", "detach",
          "expand", "unsqueeze", "squeeze", "t", "lift_fresh"}


class OpCounter(TorchDispatchMode):
    """Aten ops issued while ``on`` (the allocator's calls), views left out."""

    def __init__(self):
        super().__init__()
        self.n, self.on = 0, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.on and func.__name__.split(".")[0] not in _VIEWS:
            self.n += 1
        return func(*args, **(kwargs or {}))


def instrument(alloc, clock: list, counter: OpCounter) -> None:
    """Time (and count the ops of) the allocator's SGLang calls, outermost only."""
    for name in ("alloc_extend", "alloc_decode", "free_segment", "free_swa_segment",
                 "free_full_segment", "free_group_begin", "free_group_end"):
        method = getattr(alloc, name)

        def wrapped(*a, _m=method, **k):
            counter.on = True
            t0 = time.perf_counter()
            try:
                return _m(*a, **k)
            finally:
                clock[0] += time.perf_counter() - t0
                counter.on = False
        setattr(alloc, name, wrapped)


class Decoder:
    """B requests decoding; each iteration: evict the window's page of the requests that
    crossed one, release the requests that finished (refilled with fresh ones), decode."""

    def __init__(self, batch: int, ps: int, window: int, device: str, backend: str, seed=0):
        self.rng = np.random.default_rng(seed)
        self.ps, self.window, self.device = ps, window, device
        ctx_pages = -(-2048 // ps) + 2
        n_pages = batch * ctx_pages + 64
        self.alloc = GraphallocTokenToKVPoolAllocator(
            size=n_pages * ps, size_swa=n_pages * ps, page_size=ps, device=device,
            backend=backend)
        self.max_ctx = ctx_pages * ps
        self.rows = torch.zeros(batch, self.max_ctx, dtype=torch.int64, device=device)
        self.lens = np.zeros(batch, dtype=np.int64)
        self.front = np.zeros(batch, dtype=np.int64)
        self.budget = self.rng.integers(200, 1500, batch)
        for i in range(batch):
            self._prefill(i)

    def _prefill(self, i: int) -> None:
        n = int(self.rng.integers(64, 400))
        out = self.alloc.alloc_extend(None, torch.tensor([0]), None, torch.tensor([n]),
                                      torch.tensor([-1], device=self.device), n)
        self.rows[i, :n] = out
        self.lens[i], self.front[i] = n, 0

    def iteration(self) -> torch.Tensor:
        a, ps = self.alloc, self.ps
        due = np.flatnonzero(self.lens - self.window >= self.front + ps)
        a.free_group_begin()
        for i in due.tolist():
            new = (self.lens[i] - self.window) // ps * ps
            a.free_swa_segment(self.rows[i, self.front[i]:new], start_pos=int(self.front[i]))
            self.front[i] = new
        done = np.flatnonzero(self.lens >= self.budget)
        for i in done.tolist():
            f, n = int(self.front[i]), int(self.lens[i])
            if f:
                a.free_full_segment(self.rows[i, :f], start_pos=0)
            a.free_segment(self.rows[i, f:n], start_pos=f)
        a.free_group_end()
        for i in done.tolist():
            self._prefill(i)
        lens = torch.from_numpy(self.lens + 1)
        idx = torch.from_numpy(self.lens - 1).to(self.device)
        ar = torch.arange(len(self.lens), device=self.device)
        out = a.alloc_decode(None, lens, self.rows[ar, idx])
        self.rows[ar, idx + 1] = out
        self.lens += 1
        return out


def measure(batch, ps, window, device, backend, iters):
    """Median host us inside the allocator per iteration, its aten ops per iteration, and
    every iteration's decode slots (to compare backends)."""
    dec = Decoder(batch, ps, window, device, backend)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for _ in range(5):
        dec.iteration()
    sync()
    clock, counter = [0.0], OpCounter()
    instrument(dec.alloc, clock, counter)
    times, outs = [], []
    for _ in range(iters):
        before = clock[0]
        out = dec.iteration()
        times.append(clock[0] - before)
        sync()
        outs.append(out.cpu())
    with counter:  # a separate pass: the dispatch mode slows every op down
        for _ in range(3):
            dec.iteration()
    return 1e6 * float(np.median(times)), counter.n / 3, outs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--page-size", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", default="results/bench/sglang-pool")
    args = ap.parse_args(argv)
    backends = ["torch", "triton"] if args.device.startswith("cuda") else ["torch"]
    rows = []
    for b in args.batch:
        for ps in args.page_size:
            row = {"batch": b, "page_size": ps, "window": args.window}
            outs = {}
            for backend in backends:
                us, ops, outs[backend] = measure(b, ps, args.window, args.device, backend,
                                                 args.iters)
                row[backend] = {"host_us": us, "aten_ops_per_iter": ops,
                                "triton_launches_per_iter": 2 if backend == "triton" else 0}
            if len(backends) == 2:
                row["same_slots"] = all(torch.equal(x, y) for x, y in
                                        zip(outs["torch"], outs["triton"], strict=True))
            rows.append(row)
            print(json.dumps(row), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_sglang_pool.json"), "w") as f:
        json.dump({"device": args.device, "torch": torch.__version__, "rows": rows}, f,
                  indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
