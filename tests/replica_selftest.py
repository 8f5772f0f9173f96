"""Self-test of :mod:`graphalloc.replicas`: random multi-rank runs, a planning trace, a CLI.

Test tooling (it lives in ``tests/``, not in the runtime package). On a machine with N GPUs
(NCCL, one process per GPU, graph replay, sync-debug "error"), from the repository root::

    python tests/replica_selftest.py --world-size 2 --backend nccl --steps 300 --out DIR

``--world-size 1`` is a one-GPU smoke run of the CUDA paths (graphs, NCCL calls,
sync-debug) without the perturbation scenarios. On a CPU (gloo; what
``tests/test_replicas.py`` runs)::

    python tests/replica_selftest.py --world-size 2 --backend gloo --out DIR

Each rank writes ``DIR/rank<r>.json``; rank 0's parent then writes ``DIR/summary.json``
and ``DIR/summary.md`` and exits non-zero if any scenario failed. A rank that fails
writes its own traceback to ``DIR/rank<r>.error.txt`` (a native crash: every thread's
Python stack, from :mod:`faulthandler`, to ``DIR/rank<r>.fault.txt``) and the parent
raises :class:`SelftestWorkerError` with those texts. Scenarios (each a few hundred random
steps of admit / extend / decode / window eviction / release):

===========================  ================================================================
``replicated-pool``          every rank plans; digests equal at every check and at the end
``replicated-ring``          the same in SWA ring mode (ring admits are device steps)
``broadcast-pool``           rank 0 plans, followers replay the broadcast payload
``broadcast-ring``           the same in ring mode
``replicated-input-skew``    the last rank skips one decode: must be named, at that step
``broadcast-device-skew``    the last rank's mapping is corrupted: must be named, at that step
===========================  ================================================================

``--plan-trace FILE`` instead runs the workload on one CPU allocator and writes every
planned descriptor (used rows) and ledger digest to FILE: runs with different
``PYTHONHASHSEED`` values must write identical bytes (the determinism test).

Run as a script, this file is the ``__main__`` module: ``torch.multiprocessing.spawn``
re-imports it by path in every child (as ``__mp_main__``) to find :func:`_worker`, so
everything but the definitions stays under ``if __name__ == "__main__"``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import faulthandler
import gc
import json
import os
import signal
import sys
import tempfile
import time
import traceback
import weakref

import numpy as np
import torch
import torch.distributed as dist

from graphalloc.allocator import HybridAllocator
from graphalloc.config import AllocatorConfig
from graphalloc.errors import ContractError, ReplicaDivergenceError
from graphalloc.executor import Executor
from graphalloc.graph import StepGraph
from graphalloc.ledger import Ledger
from graphalloc.planner import StepBuilder
from graphalloc.replicas import ReplicatedAllocator
from graphalloc.state_digest import ledger_digest

__all__ = ["RandomWorkload", "Scenario", "SelftestWorkerError", "default_scenarios",
           "selftest_config", "plan_trace", "spawn_selftest", "summarize", "main"]


def selftest_config(device: str | torch.device, backend: str, ring: bool) -> AllocatorConfig:
    """A small, awkward geometry (page size 3, window 10) that fills and drains often."""
    return AllocatorConfig(page_size=3, num_full_pages=160, num_swa_pages=96, max_reqs=12,
                           max_context_len=120, sliding_window=10, device=device,
                           backend=backend, swa_ring_pages=5 if ring else 0,
                           max_step_tokens=256)


def _dry_run(config: AllocatorConfig, ledger: Ledger, plan) -> StepBuilder | None:
    """``plan(builder)`` on a throwaway planner over a copy of ``ledger`` (pure host); the
    builder when it planned, ``None`` when refused. Ledger copies share the page mirror,
    whose writes are journaled: they are rolled back here, so nothing stays."""
    refs = ledger.refs
    mark = refs.mark() if refs is not None else 0
    b = StepBuilder(config, ledger.copy())
    try:
        plan(b)
        b.finish()
        return b
    except ContractError:
        return None
    finally:
        if refs is not None:
            refs.rollback(mark)


def _fits(config: AllocatorConfig, ledger: Ledger, step: dict) -> bool:
    """Dry run of ``HybridAllocator.plan`` with ``step``'s arguments (pure host)."""
    def plan(b):
        if len(step.get("release", ())):
            b.release(b.live_rows(step["release"], "release"))
        if step.get("evict_all"):
            b.evict(np.flatnonzero(b.ledger.live))
        if len(step.get("decode", ())):
            rows = b.live_rows(step["decode"], "decode")
            b.extend(rows, np.ones(len(rows), dtype=np.int64))
        if step.get("extend") is not None:
            b.extend(b.live_rows(step["extend"][0], "extend"), step["extend"][1])
    return _dry_run(config, ledger, plan) is not None


class RandomWorkload:
    """A deterministic random scheduler: same seed and same ledger, same steps.

    ``shape_rng`` draws the decisions every rank makes (whether an iteration admits);
    ``arg_rng`` draws step arguments and is used only where a step is planned, so a
    broadcast follower, which plans nothing, stays in lockstep with its planner.
    Proposals are dry-run on a ledger copy and shrunk until they plan, so the
    wrapper's refusal path is never needed for lockstep.
    """

    def __init__(self, config: AllocatorConfig, seed: int):
        self.config = config
        self.shape_rng = np.random.default_rng([seed, 1])
        self.arg_rng = np.random.default_rng([seed, 2])
        self.n_iterations = 0

    def drive(self, alloc, n_steps: int) -> None:
        """``n_steps`` iterations on one allocator alone: maybe admit, then one step."""
        for _ in range(n_steps):
            if self.wants_admit():
                try:
                    alloc.admit()
                except ContractError:
                    pass
            alloc.step(**self.propose(alloc.ledger))

    def wants_admit(self) -> bool:
        p_admit = 0.7 if self.n_iterations < 8 else 0.25
        self.n_iterations += 1
        return bool(self.shape_rng.random() < p_admit)

    def propose(self, ledger: Ledger) -> dict:
        """Keyword arguments for one ``step()``: release, window eviction, decode, extend."""
        cfg, rng, ps = self.config, self.arg_rng, self.config.page_size
        live = np.flatnonzero(ledger.live)
        seq = ledger.seq_len
        finish = (rng.random(len(live)) < 0.06) | (seq[live] >= cfg.max_context_len)
        release, rest = live[finish], live[~finish]
        evict = bool(cfg.ring_mode or rng.random() < 0.6)
        roll = rng.random(len(rest))
        n_tokens = np.minimum(rng.integers(1, 4 * ps + 6, size=len(rest)),
                              cfg.max_context_len - seq[rest])
        fresh = seq[rest] == 0
        if cfg.ring_mode:  # the new pages must fit the ring once the window moved
            threshold = np.maximum(seq[rest] - cfg.sliding_window, 0) // ps * ps
            frontier = np.maximum(ledger.frontier[rest], threshold)  # the window rule
            limit = (frontier // ps + cfg.swa_ring_pages) * ps - seq[rest]
            n_tokens = np.minimum(n_tokens, limit)
        decode = rest[(roll < 0.6) & ~fresh]
        grow = (((roll >= 0.6) & (roll < 0.85)) | fresh) & (n_tokens >= 1)
        ext_rows, ext_n = rest[grow], n_tokens[grow]
        half = len(ext_rows) // 2
        base = {"release": release, "evict_all": evict}
        for step in ({**base, "decode": decode, "extend": (ext_rows, ext_n)},
                     {**base, "decode": decode, "extend": (ext_rows[:half], ext_n[:half])},
                     {**base, "decode": decode},
                     {**base, "decode": decode[:len(decode) // 2]},
                     base, {"release": release}, {}):
            if step.get("extend") is not None and len(step["extend"][0]) == 0:
                step = {k: v for k, v in step.items() if k != "extend"}
            if _fits(cfg, ledger, step):
                return step
        raise AssertionError("an empty step must always plan")


@dataclasses.dataclass
class Scenario:
    name: str
    mode: str  # "replicated" | "broadcast"
    ring: bool = False
    iterations: int = 300
    # "" | "input" (skip one decode) | "device" (corrupt a mapping entry) | "raise" (the last
    # rank raises SelftestDeliberateError as the scenario starts: the failure-report test)
    perturb: str = ""
    perturb_at: int = -1  # iteration of the perturbation ("input", "device")
    check_every: int = 16
    digest_every: int = 1
    seed: int = 0


def default_scenarios(iterations: int = 300, check_every: int = 16) -> list[Scenario]:
    short = max(40, iterations // 3)
    return [
        Scenario("replicated-pool", "replicated", iterations=iterations,
                 check_every=check_every, seed=1),
        Scenario("broadcast-pool", "broadcast", iterations=iterations,
                 check_every=check_every, seed=2),
        Scenario("replicated-ring", "replicated", ring=True, iterations=short,
                 check_every=check_every, digest_every=2 if check_every % 2 == 0 else 1,
                 seed=3),
        Scenario("broadcast-ring", "broadcast", ring=True, iterations=short,
                 check_every=check_every, seed=4),
        Scenario("replicated-input-skew", "replicated", iterations=short + 20, perturb="input",
                 perturb_at=short // 2 + 1, check_every=check_every, seed=5),
        Scenario("broadcast-device-skew", "broadcast", iterations=short + 20, perturb="device",
                 perturb_at=short // 2 + 3, check_every=check_every, seed=6),
    ]


def _percentiles(times: list[float]) -> dict:
    if not times:
        return {}
    ms = np.asarray(times) * 1e3
    return {"median": float(np.median(ms)), "p90": float(np.percentile(ms, 90)),
            "max": float(ms.max())}


def run_scenario(sc: Scenario, rank: int, device: torch.device, backend: str,
                 sync_debug: bool) -> dict:
    """One scenario on this rank (collective: every rank runs the same scenarios in order)."""
    if sc.perturb == "raise" and rank == dist.get_world_size() - 1:  # before building anything
        raise SelftestDeliberateError(f"deliberate failure of rank {rank} in scenario {sc.name!r}")
    cfg = selftest_config(device, backend, sc.ring)
    rep = ReplicatedAllocator(cfg, mode=sc.mode, check_every=sc.check_every,
                              digest_every=sc.digest_every)  # graphs on CUDA, eager on a CPU
    alloc = rep.alloc
    graph = rep.executor.inner if isinstance(rep.executor.inner, StepGraph) else None
    skewed_rank = rep.global_ranks[-1]
    workload = RandomWorkload(cfg, sc.seed)
    out: dict = {"name": sc.name, "mode": sc.mode, "ring": sc.ring, "planner": rep.is_planner,
                 "iterations": sc.iterations, "error": None, "expected": None,
                 "sync_debug": bool(sync_debug and device.type == "cuda")}
    step_times: list[float] = []
    it = 0
    if out["sync_debug"]:
        torch.cuda.set_sync_debug_mode("error")
    try:
        for it in range(sc.iterations):
            if workload.wants_admit():
                try:
                    rep.admit()
                except ContractError:
                    pass  # no free row or ring pages: the same on every rank
            step = workload.propose(alloc.ledger) if rep.is_planner else {}
            if sc.perturb in ("input", "device") and it == sc.perturb_at:
                out["expected"] = {"step": rep.n_steps + 1, "rank": skewed_rank}
                step = {}
                if sc.perturb == "input":  # every rank but the skewed one decodes one row
                    rows = np.flatnonzero(alloc.ledger.live & (alloc.ledger.seq_len > 0)
                                          & (alloc.ledger.seq_len < cfg.max_context_len))
                    assert len(rows), "the skew iteration needs a live request"
                    if rep.rank != skewed_rank:
                        step = {"decode": rows[:1]}
                elif rep.rank == skewed_rank:  # a stale mapping entry on the last full page
                    alloc.state.full_to_swa_buf[cfg.num_full_pages * cfg.page_size].add_(7)
            t0 = time.perf_counter()
            rep.step(**step)
            step_times.append(time.perf_counter() - t0)
        rep.check()
    except ReplicaDivergenceError as exc:
        out["error"] = {"step": exc.step, "rank": exc.rank, "ranks": exc.ranks,
                        "reference_rank": exc.reference_rank, "fields": exc.fields,
                        "last_equal_step": exc.last_equal_step, "message": str(exc)}
    finally:
        if out["sync_debug"]:
            torch.cuda.set_sync_debug_mode(0)
    out.update(iterations_run=it + 1, n_steps=rep.n_steps, n_checks=rep.n_checks,
               n_replays=rep.n_replays + (graph.replays if graph else 0),
               host_ms_per_step=_percentiles(step_times))
    if out["error"] is None:
        out["digest"] = {k: str(v) for k, v in rep.current_digest().items()}
        alloc.check()
        alloc.check_integrity()
        out["integrity"] = "ok"
        out["stats"] = {k: alloc.stats()[k] for k in ("full_free_pages", "swa_free_pages",
                                                      "live_requests", "steps_run")}
    rep.close()
    return out


class SelftestDeliberateError(RuntimeError):
    """Raised on purpose by a ``perturb="raise"`` scenario."""


class SelftestWorkerError(RuntimeError):
    """A rank of a spawned self-test failed. The message carries each rank's own report:
    its traceback (``rank<r>.error.txt``) or, after a fatal signal, every thread's Python
    stack at the signal (``rank<r>.fault.txt``)."""


_REPORTS = {"json": "rank{}.json", "error": "rank{}.error.txt", "fault": "rank{}.fault.txt"}
_fault_file = None  # open for the life of a worker process: faulthandler writes to its fd


def _report_path(out_dir: str, rank: int, kind: str) -> str:
    return os.path.join(out_dir, _REPORTS[kind].format(rank))


def _worker(rank: int, world_size: int, backend: str, init_method: str, out_dir: str,
            scenarios: list[Scenario], sync_debug: bool, timeout_s: float) -> None:
    """One rank (run by ``torch.multiprocessing.spawn``). A failure leaves this rank's own
    report in ``out_dir`` for the parent; the process group is gone, and with it gloo's
    threads, before this returns (see :func:`_destroy_group`)."""
    global _fault_file
    _fault_file = open(_report_path(out_dir, rank, "fault"), "w")
    faulthandler.enable(file=_fault_file, all_threads=True)  # SIGABRT, SIGSEGV, ...
    # the parent stops the other ranks when one fails: record where each one was
    faulthandler.register(signal.SIGTERM, file=_fault_file, all_threads=True, chain=True)
    error = None
    try:
        _run_rank(rank, world_size, backend, init_method, out_dir, scenarios, sync_debug,
                  timeout_s)
    except Exception:
        error = traceback.format_exc()
        _write_error(out_dir, rank, error)  # now: before the teardown closes connections
    # outside the except clause: the traceback (whose frames hold the wrappers, which hold
    # the group) is released, so the group can be destroyed now
    try:
        _destroy_group(backend)
    except Exception:
        error = (error or "") + traceback.format_exc()
        _write_error(out_dir, rank, error)
    if error is not None:
        raise SelftestWorkerError(f"rank {rank} failed:\n{error}")


def _write_error(out_dir: str, rank: int, text: str) -> None:
    with open(_report_path(out_dir, rank, "error"), "w") as f:
        f.write(text)


def _run_rank(rank: int, world_size: int, backend: str, init_method: str, out_dir: str,
              scenarios: list[Scenario], sync_debug: bool, timeout_s: float) -> None:
    if backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        kernel_backend = "triton"
        extra = {"device_id": device}
    else:
        device, kernel_backend, extra = torch.device("cpu"), "torch", {}
        torch.set_num_threads(1)  # the ranks share the cores; small ops hate contended pools
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s), **extra)
    results = {"rank": rank, "world_size": world_size, "backend": backend,
               "device": str(device), "torch": torch.__version__, "scenarios": []}
    if device.type == "cuda":
        results["device_name"] = torch.cuda.get_device_name(device)
    t0 = time.perf_counter()
    for sc in scenarios:
        t1 = time.perf_counter()
        res = run_scenario(sc, rank, device, kernel_backend, sync_debug)
        res["seconds"] = time.perf_counter() - t1
        results["scenarios"].append(res)
    results["seconds"] = time.perf_counter() - t0
    with open(_report_path(out_dir, rank, "json"), "w") as f:
        json.dump(results, f, indent=1)


def _destroy_group(backend: str) -> None:
    """Destroy the default group *and its C++ object* while the interpreter is fully alive.

    ``destroy_process_group()`` only unregisters the group; the C++ object, and with gloo
    its worker threads, live on while any Python object refers to it, and every
    :class:`ReplicatedAllocator` does (``.group``) from inside reference cycles that only
    the garbage collector frees. Left to interpreter exit, a gloo worker thread that still
    drops its reference to a finished collective (``AsyncAllgatherWork``, whose tensors'
    Python objects it then owns) takes the GIL during ``Py_FinalizeEx``; CPython ends
    such a thread with ``pthread_exit``, whose forced unwind through the work's
    ``noexcept`` destructor calls ``std::terminate``: "terminate called without an active
    exception", SIGABRT, after the rank's results were written. Collecting the cycles here
    runs the group's destructor, which releases the GIL and joins those threads."""
    if not dist.is_initialized():
        return
    group = weakref.ref(dist.group.WORLD)
    dist.destroy_process_group()
    gc.collect()
    if backend == "gloo" and group() is not None:
        raise RuntimeError(
            "the gloo process group outlived destroy_process_group() and a garbage collection "
            f"(referrers: {[type(r).__name__ for r in gc.get_referrers(group())]}); its worker "
            "threads would still run at interpreter exit, where they can abort the process")


def summarize(out_dir: str, world_size: int) -> dict:
    """Cross-rank verdict per scenario; writes ``summary.json`` and ``summary.md``."""
    ranks = []
    for r in range(world_size):
        with open(os.path.join(out_dir, f"rank{r}.json")) as f:
            ranks.append(json.load(f))
    verdicts = []
    for i, sc0 in enumerate(ranks[0]["scenarios"]):
        per_rank = [rk["scenarios"][i] for rk in ranks]
        if sc0["expected"] is None:
            digests = [s.get("digest") for s in per_rank]
            ok = all(s["error"] is None for s in per_rank) and all(
                d == digests[0] for d in digests) and digests[0] is not None
            detail = "digests equal on all ranks" if ok else "divergence or unequal digests"
        else:
            errs = [s["error"] for s in per_rank]
            exp = sc0["expected"]
            ok = all(e is not None and e["step"] == exp["step"] and e["rank"] == exp["rank"]
                     for e in errs)
            detail = (f"named step {errs[0]['step']}, rank {errs[0]['rank']}, fields "
                      f"{errs[0]['fields']}" if errs[0] else "not detected")
            detail += f" (expected step {exp['step']}, rank {exp['rank']})"
        verdicts.append({"name": sc0["name"], "ok": bool(ok), "detail": detail,
                         "steps": sc0["n_steps"], "checks": sc0["n_checks"],
                         "replays": [s["n_replays"] for s in per_rank],
                         "host_ms_per_step": [s["host_ms_per_step"] for s in per_rank],
                         "seconds": max(s["seconds"] for s in per_rank)})
    summary = {"ok": all(v["ok"] for v in verdicts), "world_size": world_size,
               "backend": ranks[0]["backend"], "torch": ranks[0]["torch"],
               "devices": [rk.get("device_name", rk["device"]) for rk in ranks],
               "sync_debug": [s["sync_debug"] for s in ranks[0]["scenarios"]],
               "scenarios": verdicts}
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    lines = [f"# Replica self-test: {world_size} ranks, {summary['backend']}, torch "
             f"{summary['torch']}", "", f"Devices: {', '.join(summary['devices'])}", "",
             "Sync-debug mode \"error\" around the step loops: "
             f"{'yes' if all(summary['sync_debug']) else 'no'}. Verdict: "
             f"{'PASS' if summary['ok'] else 'FAIL'}.", "",
             "| scenario | ok | steps | checks | host ms/step (median, rank 0) | result |",
             "|---|---|---|---|---|---|"]
    for v in verdicts:
        med = v["host_ms_per_step"][0].get("median", float("nan"))
        lines.append(f"| {v['name']} | {'yes' if v['ok'] else 'NO'} | {v['steps']} | "
                     f"{v['checks']} | {med:.3f} | {v['detail']} |")
    with open(os.path.join(out_dir, "summary.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return summary


def spawn_selftest(world_size: int, backend: str, out_dir: str,
                   scenarios: list[Scenario] | None = None, sync_debug: bool = True,
                   timeout_s: float = 120.0) -> dict:
    """Run the scenarios on ``world_size`` spawned processes (rendezvous through a file in a
    fresh temporary directory: loopback only) and summarise them. A failed rank raises
    :class:`SelftestWorkerError` here, with every rank's own report in the message."""
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessException

    os.makedirs(out_dir, exist_ok=True)
    scenarios = default_scenarios() if scenarios is None else scenarios
    if world_size < 2:  # a one-rank smoke run (e.g. one GPU): nothing can diverge
        scenarios = [sc for sc in scenarios if not sc.perturb]
    for path in [_report_path(out_dir, r, kind) for r in range(world_size) for kind in _REPORTS]:
        if os.path.exists(path):  # an earlier run's: it must not pass for this run's
            os.remove(path)
    try:
        with tempfile.TemporaryDirectory() as rendezvous:
            init_method = "file://" + os.path.join(rendezvous, "init")
            mp.spawn(_worker, args=(world_size, backend, init_method, out_dir, scenarios,
                                    sync_debug, timeout_s), nprocs=world_size, join=True)
    except ProcessException as exc:
        raise SelftestWorkerError(_failure_report(out_dir, world_size, exc)) from exc
    finally:
        for r in range(world_size):
            fault = _report_path(out_dir, r, "fault")
            if os.path.exists(fault) and os.path.getsize(fault) == 0:
                os.remove(fault)
    return summarize(out_dir, world_size)


def _failure_report(out_dir: str, world_size: int, exc: Exception) -> str:
    """The parent's message: what spawn saw, then each rank's own report (the rank spawn
    saw fail first, then the others)."""
    first = getattr(exc, "error_index", None)
    said = next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
    parts = [f"replica self-test failed ({type(exc).__name__}: {said.strip(' -')})"]
    for r in sorted(range(world_size), key=lambda r: r != first):
        reports = []
        for kind, what in (("error", "raised"), ("fault", "fatal signal or SIGTERM; Python "
                                                         "stacks of every thread")):
            path = _report_path(out_dir, r, kind)
            text = open(path).read() if os.path.exists(path) else ""
            if text.strip():
                reports.append(f"--- rank {r}: {what} ({os.path.basename(path)}) ---\n"
                               f"{text.rstrip()}")
        if not reports and os.path.exists(_report_path(out_dir, r, "fault")):
            reports = [f"--- rank {r}: no report (its worker ran; it finished, or was stopped "
                       "without a Python error)"]
        elif not reports:  # the worker opens its fault file first thing
            reports = [f"--- rank {r}: no report: it never reached the worker function (it "
                       "failed while starting, e.g. importing or unpickling in the spawned "
                       "child: that traceback is on stderr; or it was stopped before)"]
        parts += reports
    return "\n".join(parts)


class _TraceExecutor(Executor):
    """An executor that runs nothing on a device: it writes each planned step's used
    descriptor rows and the ledger digest after it (host planning only)."""

    name = "trace"

    def __init__(self, f):
        super().__init__()
        self.f = f

    def execute(self, planned) -> None:
        alloc, index = self.alloc, planned.buffer_index
        buf, base = alloc.ring.np_bufs[index], alloc.config.max_release_rows
        n_rel, n_al = alloc.ring.used[index]
        self.f.write(np.int64([n_rel, n_al]).tobytes())
        self.f.write(buf[:n_rel].tobytes())
        self.f.write(buf[base:base + n_al].tobytes())
        self.f.write(np.int64([ledger_digest(alloc.ledger)]).tobytes())


def plan_trace(path: str, seed: int, iterations: int) -> int:
    """Plan the workload on CPU allocators (pool mode, then ring mode) and write every
    descriptor's used rows and the ledger digest after it to ``path``; returns the
    number of planned steps. Host planning only: the kernels are not run."""
    n_planned = 0
    with open(path, "wb") as f:
        for ring in (False, True):
            cfg = selftest_config("cpu", "torch", ring)
            alloc = HybridAllocator(cfg, executor=_TraceExecutor(f))
            RandomWorkload(cfg, seed).drive(alloc, iterations)
            n_planned += alloc.steps_run
    return n_planned


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    ap.add_argument("--out", default="benchmarks/results/replicas")
    ap.add_argument("--steps", type=int, default=300, help="iterations of the long scenarios")
    ap.add_argument("--check-every", type=int, default=16)
    ap.add_argument("--no-sync-debug", action="store_true")
    ap.add_argument("--plan-trace", metavar="FILE", help="write a planning trace and exit")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.plan_trace:
        n = plan_trace(args.plan_trace, args.seed, args.steps)
        print(f"planned {n} steps into {args.plan_trace}")
        return
    if args.backend == "nccl" and torch.cuda.device_count() < args.world_size:
        sys.exit(f"--backend nccl needs {args.world_size} GPUs, this machine has "
                 f"{torch.cuda.device_count()}")
    summary = spawn_selftest(args.world_size, args.backend, args.out,
                             default_scenarios(args.steps, args.check_every),
                             sync_debug=not args.no_sync_debug)
    with open(os.path.join(args.out, "summary.md")) as f:
        print(f.read())
    sys.exit(0 if summary["ok"] else 1)


if __name__ == "__main__":
    main()
