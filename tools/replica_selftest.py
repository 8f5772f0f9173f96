"""Self-test of :mod:`graphalloc.replicas`: random multi-rank runs, a planning trace, a CLI.

Test tooling (it lives in ``tests/``, not in the runtime package). On a machine with N GPUs
(NCCL, one process per GPU, graph replay, sync-debug "error"), from the repository root::

    python tools/replica_selftest.py --world-size 2 --backend nccl --steps 300 --out DIR

``--world-size 1`` is a one-GPU smoke run of the CUDA paths (graphs, NCCL calls,
sync-debug) without the perturbation scenarios. On a CPU (gloo; what
``tests/replicas/test_replicas.py`` runs)::

    python tools/replica_selftest.py --world-size 2 --backend gloo --out DIR

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
from graphalloc.device.executor import Executor
from graphalloc.device.graph import StepGraph
from graphalloc.errors import ContractError, ReplicaDivergenceError
from graphalloc.plan.context import PlanContext
from graphalloc.plan.reference import plan_step
from graphalloc.plan.refusals import Refusal
from graphalloc.plan.step import Step, normalize
from graphalloc.replicas.allocator import ReplicatedAllocator
from graphalloc.replicas.digest import ledger_digest
from graphalloc.state.ledger import Ledger

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
from provenance import add_stamp_option, stamp_or_exit  # noqa: E402

__all__ = ["RandomWorkload", "Scenario", "SelftestWorkerError", "default_scenarios",
           "selftest_config", "plan_trace", "spawn_selftest", "summarize", "main"]


def selftest_config(device: str | torch.device, backend: str, ring: bool,
                    max_handles: int = 0) -> AllocatorConfig:
    """A small, awkward geometry (page size 3, window 10) that fills and drains often;
    ``max_handles`` > 0 (pool mode) for shared pages and the prefix cache."""
    return AllocatorConfig(page_size=3, num_full_pages=160, num_swa_pages=96, max_reqs=12,
                           max_context_len=120, sliding_window=10, device=device,
                           backend=backend, swa_ring_pages=5 if ring else 0,
                           max_step_tokens=256, max_handles=max_handles)


def _fits(config: AllocatorConfig, ledger: Ledger, step: dict) -> bool:
    """Dry run of ``HybridAllocator.plan`` with ``step``'s arguments on ``ledger`` (pure
    host: the reference planner, its writes rolled back)."""
    mark = ledger.journal.mark()
    try:
        plan_step(PlanContext(config, ledger, 1), normalize(Step(**step), config))
        return True
    except Refusal:
        return False
    finally:
        ledger.journal.rollback(mark)


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


def _token(family: int, uid: int, pos: int) -> int:
    """Token id at ``pos`` of a request: a prompt shared by its family for the first 24
    positions (prefix-cache hits), its own tokens after."""
    return family * 100_000 + pos if pos < 24 else 10_000_000 + uid * 1_000 + pos


class OpsWorkload:
    """A deterministic random scheduler over every operation of the replica layer.

    Each iteration is one operation, its *kind* drawn from ``shape_rng`` (every rank draws
    the same, so every rank calls the same wrapper method); a planner draws the arguments
    from ``arg_rng`` and its ledger, a follower calls the method without arguments. Kinds
    that the planner finds nothing to apply to run an empty ``step()`` (one step, like
    every kind but ``cache_insert``). Refusals (``ContractError``) are counted, never
    needed for lockstep. ``counts[kind] = [ran, refused]``.

    ``api`` is a :class:`ReplicatedAllocator`, or :class:`DirectOps` over a bare allocator
    (the planning trace).
    """

    POOL_KINDS = ("admit", "step", "step", "step", "spec_decode", "commit", "commit", "trim",
                  "take_handle", "admit_handle", "drop_handle", "drop_handle_swa",
                  "load_back", "block", "block", "cache_insert", "admit_cached")
    RING_KINDS = ("admit", "step", "step", "step", "spec_decode", "commit", "commit", "trim",
                  "block")
    # the wrapper's operation each kind is (every single operation is one step(Step))
    METHODS = {"spec_decode": "step", "commit": "step", "trim": "step", "drop_handle": "step",
               "drop_handle_swa": "step", "load_back": "step", "admit_handle": "admit",
               "admit_cached": "admit", "block": "scheduler_step"}

    def __init__(self, config: AllocatorConfig, seed: int, cache: bool):
        self.config = config
        self.cache = cache
        kinds = self.RING_KINDS if config.ring_mode else self.POOL_KINDS
        if not config.max_handles:
            kinds = tuple(k for k in kinds if "handle" not in k and "cache" not in k)
        if not cache:
            kinds = tuple(k for k in kinds if "cache" not in k)
        self.kinds = kinds
        self.shape_rng = np.random.default_rng([seed, 3])
        self.arg_rng = np.random.default_rng([seed, 4])
        n = config.max_reqs
        self.family = np.zeros(n, dtype=np.int64)
        self.uid = np.zeros(n, dtype=np.int64)
        self.next_uid = 1
        self.handles: list[int] = []  # the workload's own handles (not the cache's)
        self.handle_tokens: dict[int, tuple[int, int]] = {}  # handle -> (family, uid)
        self.counts = {k: [0, 0] for k in kinds}

    def next_kind(self) -> str:
        return self.kinds[int(self.shape_rng.integers(len(self.kinds)))]

    def run(self, api, kind: str, planner: bool) -> None:
        """One operation of ``kind`` (collective: every rank, the same kind). A planner
        that ran no step for it (nothing to apply it to, or its arguments were refused
        before the call) runs the kind's fallback -- an empty ``step()``, or an empty
        ``cache_insert`` -- so the step count never depends on the ledger."""
        method = getattr(api, self.METHODS.get(kind, kind))
        if not planner:
            if kind == "block":
                with method():
                    pass
            else:
                method()
            return
        before = getattr(api, "n_steps", None)
        try:
            ran = getattr(self, "_" + kind)(api, api.alloc.ledger)
            self.counts[kind][0] += bool(ran)
        except ContractError:
            self.counts[kind][1] += 1
        if before is not None and api.n_steps == before:
            if kind == "cache_insert":
                api.cache_insert(0, [])
            else:
                api.step()
        h_live = api.alloc.ledger.h_live
        self.handles = [h for h in self.handles if h_live[h]]  # dropped: no longer ours

    # ---- helpers (planner) ---------------------------------------------------------------
    def _pick(self, rows: np.ndarray, most: int) -> np.ndarray:
        if len(rows) <= most:
            return rows
        return np.sort(self.arg_rng.choice(rows, size=most, replace=False))

    def _tokens(self, row: int, n: int) -> list[int]:
        f, u = int(self.family[row]), int(self.uid[row])
        return [_token(f, u, p) for p in range(n)]

    def _new_request(self, row: int, family: int, uid: int | None = None) -> None:
        self.family[row] = family
        self.uid[row] = self.next_uid if uid is None else uid
        self.next_uid += 1

    def _spec_len(self, led) -> np.ndarray:
        return led.seq_len - led.committed

    # ---- kinds (planner): True when the operation ran or was refused, False: nothing to do
    def _admit(self, api, led) -> bool:
        row = api.admit()
        self._new_request(row, int(self.arg_rng.integers(3)))
        return True

    def _step(self, api, led) -> bool:
        cfg, rng, ps = self.config, self.arg_rng, self.config.page_size
        live = np.flatnonzero(led.live)
        seq = led.seq_len[live]
        finish = (rng.random(len(live)) < 0.06) | (seq >= cfg.max_context_len - 4)
        release, rest = live[finish], live[~finish]
        plain = rest[self._spec_len(led)[rest] == 0]
        roll = rng.random(len(plain))
        room = cfg.max_context_len - led.seq_len[plain]
        n_tok = np.minimum(rng.integers(1, 4 * ps + 6, size=len(plain)), room)
        fresh = led.seq_len[plain] == 0
        decode = plain[(roll < 0.5) & ~fresh & (room > 0)]
        grow = (((roll >= 0.5) & (roll < 0.8)) | fresh) & (n_tok > 0)
        ext, ext_n = plain[grow], n_tok[grow]
        if cfg.ring_mode:  # the new pages must fit the ring once the window moved
            c = led.committed[ext]
            frontier = np.maximum(led.frontier[ext],
                                  np.maximum(c - cfg.sliding_window, 0) // ps * ps)
            ext_n = np.minimum(ext_n, (frontier // ps + cfg.swa_ring_pages) * ps
                               - led.seq_len[ext])
            ext, ext_n = ext[ext_n > 0], ext_n[ext_n > 0]
        base = {"release": release, "evict_all": bool(cfg.ring_mode or rng.random() < 0.6)}
        half = len(ext) // 2
        for step in ({**base, "decode": decode, "extend": (ext, ext_n)},
                     {**base, "decode": decode, "extend": (ext[:half], ext_n[:half])},
                     {**base, "decode": decode}, {**base, "decode": decode[:len(decode) // 2]},
                     base, {"release": release}):
            if "extend" in step and not len(step["extend"][0]):
                del step["extend"]
            if "decode" in step and not len(step["decode"]):
                del step["decode"]
            if api.alloc.fits(**step):
                api.step(**step)
                return True
        return False

    def _spec_decode(self, api, led) -> bool:
        cfg, ps = self.config, self.config.page_size
        ok = led.live & (led.seq_len > 0) & (led.spec_steps[:, -1] == 0)
        room = cfg.max_context_len - led.seq_len  # positions this row may still take
        if cfg.ring_mode:  # and inside its ring, from its frontier
            room = np.minimum(room, (led.frontier // ps + cfg.swa_ring_pages) * ps
                              - led.seq_len)
        rows = self._pick(np.flatnonzero(ok & (room >= 1)), 4)
        if not len(rows):
            return False
        k = np.minimum(self.arg_rng.integers(0, 4, size=len(rows)), room[rows] - 1)
        for n in (len(rows), 1):
            if api.alloc.fits(decode=rows[:n], lookahead=k[:n]):
                api.step(decode=rows[:n], lookahead=k[:n])
                return True
        return False

    def _commit(self, api, led) -> bool:
        rows = self._pick(np.flatnonzero(led.live & (led.spec_steps[:, 0] > 0)), 4)
        if not len(rows):
            return False
        oldest = led.spec_steps[rows, 0]
        api.step(accept=(rows, self.arg_rng.integers(0, oldest)))  # drafts: 0 .. k
        return True

    def _trim(self, api, led) -> bool:
        window = self.config.sliding_window
        live = np.flatnonzero(led.live & (led.seq_len > 0))
        low = np.where(led.frontier[live] > 0, led.frontier[live] + window, 0)
        rows = self._pick(live[low <= led.seq_len[live]], 2)
        if not len(rows):
            return False
        low = np.where(led.frontier[rows] > 0, led.frontier[rows] + window, 0)
        cut = self.arg_rng.integers(0, 5, size=len(rows))
        api.step(trim=(rows, np.maximum(low, led.seq_len[rows] - cut)))
        return True

    def _take_handle(self, api, led) -> bool:
        ps = self.config.page_size
        rows = np.flatnonzero(led.live & (np.minimum(led.seq_len, led.committed) >= ps))
        if not len(rows) or led.h_live.all():
            return False
        row = int(self.arg_rng.choice(rows))
        n = ps * int(self.arg_rng.integers(1, min(led.seq_len[row], led.committed[row]) // ps
                                           + 1))
        handle = api.take_handle(row, n)
        self.handles.append(handle)
        self.handle_tokens[handle] = (int(self.family[row]), int(self.uid[row]))
        return True

    def _admit_handle(self, api, led) -> bool:
        held = [h for h in self.handles if led.h_live[h]]
        if not held or led.live.all():
            return False
        h = held[int(self.arg_rng.integers(len(held)))]
        ps = self.config.page_size
        n = None if self.arg_rng.random() < 0.5 else ps * int(
            self.arg_rng.integers(1, led.h_len[h] // ps + 1))
        row = api.admit(handle=h, n_tokens=n)
        family, uid = self.handle_tokens[h]
        self._new_request(row, family, uid)
        return True

    def _drop_handle(self, api, led, swa_only: bool = False) -> bool:
        held = [h for h in self.handles if led.h_live[h]]
        if not held:
            return False
        h = held[int(self.arg_rng.integers(len(held)))]
        api.step(drop_swa=[h]) if swa_only else api.step(drop=[h])
        return True

    def _drop_handle_swa(self, api, led) -> bool:
        return self._drop_handle(api, led, swa_only=True)

    def _load_back(self, api, led) -> bool:
        ps, refs = self.config.page_size, led.refs
        rows = np.flatnonzero(led.live & (led.frontier > 0))
        page = refs.page_of[rows, np.maximum(led.frontier[rows] // ps - 1, 0)]
        rows = rows[refs.swa_of[page] == 0]
        if not len(rows) or led.swa.n_free < 1:
            return False
        row = int(self.arg_rng.choice(rows))
        api.step(load_back=([row], [int(led.frontier[row]) - ps]))
        return True

    def _block(self, api, led) -> bool:
        cfg, rng = self.config, self.arg_rng
        live = np.flatnonzero(led.live)
        done = live[led.seq_len[live] >= cfg.max_context_len - 8]
        plain = live[(self._spec_len(led)[live] == 0) & (led.seq_len[live] > 0)
                     & (led.seq_len[live] < cfg.max_context_len - 8)]
        decode = self._pick(plain, 3)
        with api.scheduler_step() as it:
            if len(done):
                it.release(done[:1])
            it.evict_all()
            held = [h for h in self.handles if led.h_live[h]]
            if held and rng.random() < 0.3:
                it.drop_handle(held[0])
            new = None
            if not led.live.all() and rng.random() < 0.5:
                new = it.admit()
                self._new_request(new, int(rng.integers(3)))
            if len(decode):
                it.decode(decode)
            if new is not None:
                it.extend([new], [int(rng.integers(1, 8))])
        return True

    def _cache_insert(self, api, led) -> bool:
        ps = self.config.page_size
        rows = np.flatnonzero(led.live & (led.committed >= ps))
        if not len(rows):
            return False
        row = int(self.arg_rng.choice(rows))
        api.cache_insert(row, self._tokens(row, int(led.committed[row])))
        return True

    def _admit_cached(self, api, led) -> bool:
        if led.live.all():
            return False
        family, uid = int(self.arg_rng.integers(3)), self.next_uid
        hit = api.alloc.prefix_cache.match([_token(family, uid, p) for p in range(30)])
        if hit.cached_tokens:
            row = api.admit(handle=hit.handle, n_tokens=hit.cached_tokens)
        else:
            row = api.admit()
        self._new_request(row, family, uid)
        return True


class DirectOps:
    """The replica layer's operation names over one bare allocator (the planning trace)."""

    def __init__(self, alloc):
        self.alloc = alloc

    def __getattr__(self, name):
        return getattr(self.alloc, name)

    def cache_insert(self, row, token_ids):
        return self.alloc.prefix_cache.insert(row, token_ids)


@dataclasses.dataclass
class Scenario:
    name: str
    mode: str  # "replicated" | "broadcast"
    ring: bool = False
    iterations: int = 300
    # "" | "input" (skip one decode) | "device" (corrupt a mapping entry) | "raise" (the last
    # rank raises SelftestDeliberateError as the scenario starts: the failure-report test) |
    # a state perturbation of PERTURBATIONS, followed by an empty step and a check
    perturb: str = ""
    perturb_at: int = -1  # iteration of the perturbation
    check_every: int = 16
    digest_every: int = 1
    seed: int = 0
    workload: str = "steps"  # "steps" (RandomWorkload) | "ops" (OpsWorkload)
    max_handles: int = 0
    prefix_cache: bool = False


# perturbation -> (which rank perturbs: "skewed" (the last) or "planner", fields named)
PERTURBATIONS = {
    "refcount": ("skewed", {"refs"}),  # a FULL page's reference count + 1
    "handle": ("skewed", {"handles"}),  # handle 0's SWA start + one page
    "committed": ("skewed", {"spec"}),  # row 0's committed length + 1
    "cache": ("skewed", {"cache"}),  # the prefix cache's LRU clock + 1
    # broadcast mode: the planner's reference count (its followers rebuild theirs from the
    # device: the check tells them apart), a follower's device row of handle 0
    "planner-refcount": ("planner", {"refs"}),
    "device-handle": ("skewed", {"handle_to_token"}),
}


def _perturb(kind: str, rep: ReplicatedAllocator) -> None:
    """Apply a state perturbation of :data:`PERTURBATIONS` to this rank (unconditional: it
    needs no particular state)."""
    led, ps = rep.alloc.ledger, rep.alloc.config.page_size
    if kind in ("refcount", "planner-refcount"):
        held = np.flatnonzero(led.refs.full_ref[1:]) + 1
        led.refs.full_ref[held[0] if len(held) else 1] += 1
    elif kind == "handle":
        led.h_swa_start[0] += ps
    elif kind == "committed":
        led.committed[0] += 1
    elif kind == "cache":
        rep.alloc.prefix_cache.hits += 1
    elif kind == "device-handle":
        rep.alloc.state.handle_to_token[0, 0] += ps
    else:
        raise ValueError(f"unknown perturbation {kind!r}")


def default_scenarios(iterations: int = 300, check_every: int = 16) -> list[Scenario]:
    short = max(40, iterations // 3)
    ops = {"workload": "ops", "max_handles": 6, "prefix_cache": True}
    skew_at = max(20, short // 2)
    scenarios = [
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
        # every operation: handles, prefix cache, load_back, scheduler_step, speculative
        Scenario("replicated-ops-pool", "replicated", iterations=iterations,
                 check_every=check_every, seed=7, **ops),
        Scenario("broadcast-ops-pool", "broadcast", iterations=iterations,
                 check_every=check_every, seed=8, **ops),
        Scenario("replicated-ops-ring", "replicated", ring=True, iterations=iterations,
                 check_every=check_every, seed=9, workload="ops"),
        Scenario("broadcast-ops-ring", "broadcast", ring=True, iterations=iterations,
                 check_every=check_every, seed=10, workload="ops"),
    ]
    for i, (kind, mode) in enumerate((("refcount", "replicated"), ("handle", "replicated"),
                                      ("committed", "replicated"), ("cache", "replicated"),
                                      ("planner-refcount", "broadcast"),
                                      ("device-handle", "broadcast"))):
        scenarios.append(Scenario(f"{mode}-{kind}-skew", mode, iterations=skew_at + 1,
                                  perturb=kind, perturb_at=skew_at, check_every=check_every,
                                  seed=11 + i, **ops))
    return scenarios


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
    cfg = selftest_config(device, backend, sc.ring, sc.max_handles)
    rep = ReplicatedAllocator(cfg, mode=sc.mode, check_every=sc.check_every,
                              digest_every=sc.digest_every,
                              prefix_cache=sc.prefix_cache)  # graphs on CUDA, eager on a CPU
    alloc = rep.alloc
    graph = rep.executor.inner if isinstance(rep.executor.inner, StepGraph) else None
    skewed_rank = rep.global_ranks[-1]
    workload = RandomWorkload(cfg, sc.seed)
    ops = OpsWorkload(cfg, sc.seed, sc.prefix_cache) if sc.workload == "ops" else None
    out: dict = {"name": sc.name, "mode": sc.mode, "ring": sc.ring, "planner": rep.is_planner,
                 "iterations": sc.iterations, "error": None, "expected": None,
                 "sync_debug": bool(sync_debug and device.type == "cuda")}
    step_times: list[float] = []
    it = 0
    if out["sync_debug"]:
        torch.cuda.set_sync_debug_mode("error")
    try:
        for it in range(sc.iterations):
            if ops is not None:
                t0 = time.perf_counter()
                ops.run(rep, ops.next_kind(), rep.is_planner)
                step_times.append(time.perf_counter() - t0)
            else:
                _steps_iteration(sc, rep, workload, it, out, step_times)
            if sc.perturb in PERTURBATIONS and it == sc.perturb_at:
                who, fields = PERTURBATIONS[sc.perturb]
                target = rep.src if who == "planner" else skewed_rank
                # two ranks tie: the planner is the reference, so its follower is named
                named = target if target != rep.src or rep.world_size > 2 else skewed_rank
                out["expected"] = {"step": rep.n_steps + 1, "rank": named,
                                   "fields": sorted(fields)}
                out["installs_before_check"] = rep.n_ledger_installs
                if rep.rank == target:
                    _perturb(sc.perturb, rep)
                rep.step()  # one more step: its digest row holds the perturbed state
                rep.check()
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
               n_empty_steps=rep.n_empty_steps, n_ledger_installs=rep.n_ledger_installs,
               host_ms_per_step=_percentiles(step_times))
    if ops is not None:
        out["op_counts"] = ops.counts
    if out["error"] is None:
        out["digest"] = {k: str(v) for k, v in rep.current_digest().items()}
        alloc.check()
        alloc.check_integrity()  # a follower: against its rebuilt page mirror, exactly
        out["integrity"] = "ok"
        out["stats"] = {k: alloc.stats()[k] for k in ("full_free_pages", "swa_free_pages",
                                                      "live_requests", "steps_run")}
    rep.close()
    return out


def _steps_iteration(sc: Scenario, rep: ReplicatedAllocator, workload: RandomWorkload, it: int,
                     out: dict, step_times: list) -> None:
    """One iteration of the step workload: maybe admit, then one step (with the "input" /
    "device" perturbations)."""
    alloc, cfg, skewed_rank = rep.alloc, rep.alloc.config, rep.global_ranks[-1]
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
                     and set(exp.get("fields", ())) <= set(e["fields"]) for e in errs)
            detail = (f"named step {errs[0]['step']}, rank {errs[0]['rank']}, fields "
                      f"{errs[0]['fields']}" if errs[0] else "not detected")
            detail += (f" (expected step {exp['step']}, rank {exp['rank']}"
                       + (f", fields >= {exp['fields']})" if exp.get("fields") else ")"))
        verdicts.append({"name": sc0["name"], "ok": bool(ok), "detail": detail,
                         "steps": sc0["n_steps"], "checks": sc0["n_checks"],
                         "replays": [s["n_replays"] for s in per_rank],
                         "empty_steps": [s["n_empty_steps"] for s in per_rank],
                         "ledger_installs": [s["n_ledger_installs"] for s in per_rank],
                         "op_counts": next((s["op_counts"] for s in per_rank
                                            if s["planner"] and "op_counts" in s), None),
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
        self.cache = None  # the allocator's prefix cache, set once it is built

    def execute(self, planned) -> None:
        parts, index = self.parts, planned.buffer_index
        buf, base = parts.ring.np_bufs[index], parts.config.max_release_rows
        n_rel, n_al = parts.ring.used[index]
        self.f.write(np.int64([n_rel, n_al]).tobytes())
        self.f.write(buf[:n_rel].tobytes())
        self.f.write(buf[base:base + n_al].tobytes())
        self.f.write(np.int64([ledger_digest(parts.ledger, self.cache)]).tobytes())


def plan_trace(path: str, seed: int, iterations: int) -> int:
    """Plan the workloads on CPU allocators -- the step workload in pool mode and in ring
    mode, then every operation (handles, prefix cache, load_back, scheduler_step blocks,
    speculative decoding) in pool mode -- and write every descriptor's used rows and the
    host digests after it to ``path``; returns the number of planned steps. Host planning
    only: the kernels are not run."""
    n_planned = 0
    with open(path, "wb") as f:
        for ring in (False, True):
            cfg = selftest_config("cpu", "torch", ring)
            alloc = HybridAllocator(cfg, executor=_TraceExecutor(f))
            RandomWorkload(cfg, seed).drive(alloc, iterations)
            n_planned += alloc.steps_run
        cfg = selftest_config("cpu", "torch", False, max_handles=6)
        alloc = HybridAllocator(cfg, executor=_TraceExecutor(f), prefix_cache=True)
        alloc.executor.cache = alloc.prefix_cache
        ops, api = OpsWorkload(cfg, seed, cache=True), DirectOps(alloc)
        for _ in range(iterations):
            ops.run(api, ops.next_kind(), planner=True)
        n_planned += alloc.steps_run
    return n_planned


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    ap.add_argument("--out", default=os.path.join(REPO, "results", "gpu-suite", "replicas"))
    ap.add_argument("--steps", type=int, default=300, help="iterations of the long scenarios")
    ap.add_argument("--check-every", type=int, default=16)
    ap.add_argument("--no-sync-debug", action="store_true")
    ap.add_argument("--plan-trace", metavar="FILE", help="write a planning trace and exit")
    ap.add_argument("--seed", type=int, default=0)
    add_stamp_option(ap)
    args = ap.parse_args(argv)
    if args.plan_trace:
        n = plan_trace(args.plan_trace, args.seed, args.steps)
        print(f"planned {n} steps into {args.plan_trace}")
        return
    if args.backend == "nccl" and torch.cuda.device_count() < args.world_size:
        sys.exit(f"--backend nccl needs {args.world_size} GPUs, this machine has "
                 f"{torch.cuda.device_count()}")
    stamp_or_exit(args.out, __file__, argv, allow_dirty=args.allow_dirty)
    summary = spawn_selftest(args.world_size, args.backend, args.out,
                             default_scenarios(args.steps, args.check_every),
                             sync_debug=not args.no_sync_debug)
    with open(os.path.join(args.out, "summary.md")) as f:
        print(f.read())
    sys.exit(0 if summary["ok"] else 1)


if __name__ == "__main__":
    main()
