"""Debug aid: step a Triton allocator (eager or graph) and a Torch one in lockstep on CUDA and
print the first table that differs, with the descriptor rows of that step."""
import sys

import numpy as np
import torch

sys.path.insert(0, "tests/lib")
from workload import random_step  # noqa: E402

import graphalloc as ga  # noqa: E402


def cfg(backend, handles):
    return ga.AllocatorConfig(page_size=4, num_full_pages=160, num_swa_pages=96, max_reqs=8,
                              max_context_len=96, sliding_window=9, device="cuda",
                              backend=backend, max_handles=handles)


for executor in ("eager", "graph"):
    for handles in (0, 6):
        for fused in (False, True):
            a = ga.HybridAllocator(cfg("triton", handles), executor=executor, fused_step=fused)
            b = ga.HybridAllocator(cfg("torch", handles), fused_step=fused)
            rng = np.random.default_rng(1)
            bad = None
            for i in range(300):
                kind = random_step([a, b], rng)
                torch.cuda.synchronize()
                for (name, x), y in zip(a.state.tables().items(), b.state.tables().values(),
                                        strict=True):
                    if not torch.equal(x, y):
                        idx = torch.nonzero(x != y)[:6].tolist()
                        bad = (i, kind, name, idx, [x[tuple(j)].item() for j in idx],
                               [y[tuple(j)].item() for j in idx])
                        break
                if bad:
                    break
            buf = a.ring.np_bufs[(a.steps_run - 1) % len(a.ring)]
            n_rel, n_al = a.ring.used[(a.steps_run - 1) % len(a.ring)]
            print(executor, "handles", handles, "fused", fused, "->", bad or "OK")
            if bad:
                print("  release rows", buf[:n_rel].tolist())
                base = a.config.max_release_rows
                print("  alloc rows", buf[base:base + n_al].tolist())
                print("  err", a.state.err_buf.tolist(), b.state.err_buf.tolist())
