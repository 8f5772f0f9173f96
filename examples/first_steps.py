"""Read me first: graphalloc's scheduler step, on a CPU, in well under a minute.

What it shows, in order:

1. ONE step: planned on the host into a descriptor (its receipt says how many rows, pages
   and tokens), then run as one piece of device work that hands back the new tokens' slots.
2. A continuous-batching loop: requests arrive, prefill in chunks, decode and finish, and
   every iteration is ONE call, ``alloc.step(release=, evict_all=True, decode=, extend=)``.
   Each request's sliding-window pages go back to the SWA pool in the step its window
   passes them, so the SWA pool stays small while the FULL pool grows with the contexts.
3. Refusals: ``try_step`` returns None when the pools or the frozen shape are short, and a
   broken rule raises a typed error; either way nothing changed.
4. The checks: ``check()``, ``check_integrity()`` and ``audit()`` (the only calls that read
   the device), and every page back at the end.

On a GPU the same script uses device="cuda", backend="triton", executor="graph": each step
is then one CUDA-graph replay. More: README.md, docs/, examples/replay_batched_frees.py.

    python examples/first_steps.py
    python examples/first_steps.py --steps 1000 --page-size 1 --window 64
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import torch

import graphalloc as ga

__all__ = ["main"]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=400, help="scheduler iterations (400)")
    ap.add_argument("--running", type=int, default=16, help="requests at once (16)")
    ap.add_argument("--page-size", type=int, default=16, help="tokens per page (16)")
    ap.add_argument("--window", type=int, default=128, help="model window W in tokens (128)")
    ap.add_argument("--chunk", type=int, default=256, help="prefill tokens per step (256)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    a = ap.parse_args(argv)
    ps, W, n = a.page_size, a.window, a.running
    cuda = torch.cuda.is_available()
    if not cuda:  # the Torch twins' tensors are small: one intra-op thread is the fastest
        torch.set_num_threads(1)  # (2-3x here on a busy 2-core machine; results unchanged)
    max_len = 768 + 256  # longest prompt + longest output
    swa_per_req = -(-(W + a.chunk) // ps) + 2  # the window plus one chunk, both ends partial
    # for_engine freezes the step as tight as this loop's budgets (n running, two prefill
    # chunks a step, at most 4 releases: a bigger burst is split): the frozen shape is the
    # work every step launches, so a tight one is a fast one (describe() shows each rule)
    cfg = ga.AllocatorConfig.for_engine(
        max_running_requests=n, chunked_prefill_size=2 * a.chunk, max_context_len=max_len,
        page_size=ps, model_window=W, num_full_pages=n * -(-max_len // ps),
        num_swa_pages=n * swa_per_req, max_reqs=2 * n, max_releases_per_step=4,
        device="cuda" if cuda else "cpu", backend="triton" if cuda else "torch")
    alloc = ga.HybridAllocator(cfg, executor="graph" if cuda else "eager")
    print(f"1. one step ({cfg.device.type}, backend {cfg.backend}; pools FULL "
          f"{cfg.num_full_pages} / SWA {cfg.num_swa_pages} pages of {ps} tokens)")
    r = alloc.admit()
    p = alloc.plan(extend=([r], [300]))  # host only: validate, update the ledger, descriptor
    print(f"   planned: {p}\n   pages allocated {p.pages_allocated}")
    out = alloc.run(p)  # the device half: one launch (one graph replay on a GPU)
    print(f"   first FULL slots {out.full_slots[:4].tolist()}, SWA {out.swa_slots[:4].tolist()}")
    alloc.release([r])

    print(f"2. {a.steps} iterations, each ONE alloc.step(...), model window {W}")
    rng = np.random.default_rng(a.seed)
    todo = {}  # row -> [prompt tokens left, output tokens left]
    freed_by_window, peak, tokens, served = 0, [0, 0], 0, 0
    bar = None
    if not a.no_progress:
        try:
            from tqdm import tqdm
            bar = tqdm(total=a.steps, unit="step", file=sys.stderr, leave=False)
        except ImportError:
            pass
    for _ in range(a.steps):
        done = [row for row, (pr, o) in todo.items() if pr == 0 and o == 0][:4]
        for row in done:
            del todo[row]
        while len(todo) < n:  # the pools hold n requests of max_len: no admission check
            todo[alloc.admit()] = [int(rng.integers(32, 768)), int(rng.integers(16, 256))]
        ext = [(row, min(pr, a.chunk)) for row, (pr, o) in todo.items() if pr > 0][:2]
        dec = [row for row, (pr, o) in todo.items() if pr == 0 and o > 0]
        p = alloc.plan(release=done, evict_all=True, decode=dec,  # alloc.step(...) is
                       extend=([e[0] for e in ext], [e[1] for e in ext]) if ext else None)
        alloc.run(p)  # plan + run; the receipt p counts the step's pages
        freed_by_window, tokens, served = (freed_by_window + p.pages_evicted,
                                           tokens + p.n_tokens, served + len(done))
        for row, k in ext:
            todo[row][0] -= k
        for row in dec:
            todo[row][1] -= 1
        used = [cfg.num_full_pages - alloc.n_free("full"), cfg.num_swa_pages - alloc.n_free("swa")]
        peak = [max(peak[0], used[0]), max(peak[1], used[1])]
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    print(f"   {served} requests finished, {tokens} tokens allocated; pages in use at peak: "
          f"FULL {peak[0]}, SWA {peak[1]}; {freed_by_window} SWA pages freed by the window")

    print("3. refusals leave everything as it was")
    new = [alloc.admit() for _ in range(4)]
    free_before = alloc.n_free("full"), alloc.n_free("swa")
    short = alloc.try_step(extend=(new, [max_len] * 4))  # more than one step may allocate
    print(f"   try_step(extend 4 x {max_len} tokens) -> {short}")
    try:
        alloc.step(decode=[alloc.free_row()])  # a row that is not admitted
    except ga.UnknownRequestError as e:
        print(f"   {type(e).__name__}: {str(e).splitlines()[0][:90]}...")
    assert (alloc.n_free("full"), alloc.n_free("swa")) == free_before

    print("4. drain and check")
    alloc.release(alloc.live_rows())
    alloc.check()  # the device error word: call it where the engine synchronises anyway
    alloc.check_integrity()
    assert alloc.audit() == [] and alloc.n_free("full") == cfg.num_full_pages
    assert alloc.n_free("swa") == cfg.num_swa_pages
    print("   check(), check_integrity() and audit() clean; every page back")
    return {"served": served, "tokens": tokens, "peak": peak, "freed_by_window": freed_by_window}


if __name__ == "__main__":
    main()
