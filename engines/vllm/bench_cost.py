"""Cost inside vLLM's real scheduler: schedule() + update_from_output() per decode step.

Run in the engine environment::

    python engines/vllm/bench_cost.py [--batches 16 64 256 1024] [--steps 40] \
        [--out results/engines/vllm-0.33.0-cost]

For each batch size B and prefix caching off / on, B requests (128-token prompts, seeded,
all distinct) are prefilled, then ``--steps`` steady decode steps are timed with vLLM's own
KV-cache manager and with graphalloc's (the same scheduler, the same fake runner; the two
schedulers step in turn in one process, so load on the machine falls on both alike;
medians and minima). Per step: the whole ``schedule()`` +
``update_from_output()`` (median), and in a second pass the time spent inside the KV-cache
manager (every method the scheduler calls wrapped with a timer; graphalloc's includes its
step, planned at the first block-id read). graphalloc's executor is replaced by one that
enqueues nothing: the host path alone, as the project's host benchmarks measure it (on a
GPU the step is one asynchronous graph replay; on this CPU the eager executor would run the
device work itself). Writes ``vllm_cost.json`` and ``vllm_cost.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402

_MANAGER_CALLS = ("get_computed_blocks", "allocate_slots", "free", "cache_blocks",
                  "remove_skipped_blocks", "get_blocks", "get_block_ids", "new_step_starts",
                  "make_prefix_cache_stats", "record_prefix_cache_stats", "take_events",
                  "take_new_block_ids", "take_kv_cache_block_copies",
                  "take_boundary_state_offloads", "estimate_cached_tokens",
                  "resolve_block_ids")


def _workload(batch: int, caching: bool) -> dict:
    import random
    rng = random.Random(batch)
    n_blocks = batch * (128 + 200) // 16 + 64
    return {"block_size": 16, "max_model_len": 2048, "max_num_seqs": batch,
            "max_num_batched_tokens": max(8192, batch), "num_blocks": n_blocks,
            "caching": caching,
            "requests": [{"id": f"r{i}", "prompt": [rng.randrange(3, 900) for _ in range(128)],
                          "max_tokens": 10_000, "arrive": 0} for i in range(batch)]}


def _wrap(manager, acc: list) -> None:
    for name in _MANAGER_CALLS:
        fn = getattr(manager, name, None)
        if fn is None:
            continue

        def timed(*a, _fn=fn, **k):
            t0 = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                acc[0] += time.perf_counter() - t0
        setattr(manager, name, timed)


def _scheduler(batch: int, caching: bool, manager: str):
    w = _workload(batch, caching)
    s = harness.build(w, manager)
    if manager == "graphalloc":
        from graphalloc.device.executor import Executor

        class NoLaunch(Executor):
            name = "no-launch"

            def execute(self, planned) -> None:
                self.count(planned.fusable)
        alloc = s.kv_cache_manager.alloc
        alloc.executor = NoLaunch()
        alloc.executor.bind(alloc.parts)
    for _, req in harness.make_requests(w):
        s.add_request(req)
    return s


def _one(s, acc) -> tuple[float, bool]:
    """One schedule() + update_from_output(): seconds, and whether every request decoded."""
    acc[0] = 0.0
    t0 = time.perf_counter()
    so = s.schedule()
    t1 = time.perf_counter()
    out = harness.fake_output(s, so)
    t2 = time.perf_counter()
    s.update_from_output(so, out)
    t3 = time.perf_counter()
    decode = all(n == 1 for n in so.num_scheduled_tokens.values())
    return (t1 - t0) + (t3 - t2), decode


def measure(batch: int, caching: bool, steps: int, wrap: bool) -> dict[str, list[float]]:
    """Per manager, ``steps`` decode steps' seconds (``wrap``: inside the manager). The two
    schedulers step in turn, so load on the machine falls on both alike."""
    scheds = {m: _scheduler(batch, caching, m) for m in ("vllm", "graphalloc")}
    accs = {m: [0.0] for m in scheds}
    for m, s in scheds.items():  # prefill until every request decodes
        for _ in range(400):
            if _one(s, accs[m])[1] and len(s.running) == batch:
                break
        if wrap:
            _wrap(s.kv_cache_manager, accs[m])
    times = {m: [] for m in scheds}
    for _ in range(steps):
        for m, s in scheds.items():
            total, _ = _one(s, accs[m])
            times[m].append(accs[m][0] if wrap else total)
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="*", default=[16, 64, 256, 1024])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", default="results/engines/vllm-0.33.0-cost")
    args = ap.parse_args()
    rows = []
    for caching in (False, True):
        for batch in args.batches:
            row = {"batch": batch, "caching": caching}
            steps = measure(batch, caching, args.steps, False)
            inside = measure(batch, caching, args.steps, True)
            for manager in ("vllm", "graphalloc"):
                row[manager] = {"step_us": statistics.median(steps[manager]) * 1e6,
                                "manager_us": statistics.median(inside[manager]) * 1e6,
                                "step_us_min": min(steps[manager]) * 1e6,
                                "manager_us_min": min(inside[manager]) * 1e6}
            row["manager_ratio"] = row["vllm"]["manager_us"] / row["graphalloc"]["manager_us"]
            row["step_ratio"] = row["vllm"]["step_us"] / row["graphalloc"]["step_us"]
            row["vllm_manager_share"] = row["vllm"]["manager_us"] / row["vllm"]["step_us"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    os.makedirs(args.out, exist_ok=True)
    res = {"commit": commit, "machine": platform.platform(), "cpus": os.cpu_count(),
           "rows": rows}
    with open(os.path.join(args.out, "vllm_cost.json"), "w") as f:
        json.dump(res, f, indent=1)
    _plot(res, os.path.join(args.out, "vllm_cost.png"))
    return 0


def _plot(res: dict, path: str) -> None:
    """The figure, drawn by benchmarks/figures.py (replot.py redraws it from the JSON)."""
    try:
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
        import figures
    except ImportError:
        print("matplotlib absent: no plot", flush=True)
        return
    figures.plot_vllm_cost(res, path)


if __name__ == "__main__":
    sys.exit(main())
