"""Tensor-parallel replicas (graphalloc.replicas): determinism, digests, multi-rank runs.

* planning is deterministic: the same random op sequence planned in processes with
  different ``PYTHONHASHSEED`` values gives byte-identical descriptors and ledgers;
* the digest and the ledger payload, unit by unit;
* the wrapper's contracts on a one-rank gloo group (in this process);
* two ranks, gloo, ``torch.multiprocessing`` spawn (one spawn for all scenarios, to
  pay the start-up once): a few hundred random steps in replicated and broadcast mode
  (pool and ring) with equal digests, and two perturbed runs whose divergence must be
  named at the exact step and rank;
* the same on two GPUs with NCCL, graph replay and sync-debug "error" (``cuda``).
"""

from __future__ import annotations

import gc
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist
from replica_selftest import (
    RandomWorkload,
    Scenario,
    SelftestWorkerError,
    default_scenarios,
    plan_trace,
    selftest_config,
    spawn_selftest,
)

from graphalloc import (
    ConfigError,
    ContractError,
    HybridAllocator,
    IntegrityError,
    ReplicaDivergenceError,
    UnknownRequestError,
)
from graphalloc.ledger import Ledger
from graphalloc.replicas import ReplicatedAllocator
from graphalloc.state_digest import (
    META_LEDGER,
    StateDigest,
    ledger_digest,
    n_ledger_rows,
    pack_ledger,
    unpack_ledger,
)

SELFTEST = os.path.join(os.path.dirname(os.path.abspath(__file__)), "replica_selftest.py")

# ---- determinism -------------------------------------------------------------------------


def test_planning_is_identical_across_hash_seeds(tmp_path):
    """Two processes with different PYTHONHASHSEED, and this one, plan the same bytes."""
    procs, paths = [], []
    for hash_seed in ("0", "987654321"):
        path = tmp_path / f"trace_{hash_seed}.bin"
        env = dict(os.environ, PYTHONHASHSEED=hash_seed)
        procs.append(subprocess.Popen(
            [sys.executable, SELFTEST, "--plan-trace", str(path),
             "--seed", "7", "--steps", "300"], env=env, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT))
        paths.append(path)
    here = tmp_path / "trace_here.bin"
    n_planned = plan_trace(str(here), seed=7, iterations=300)
    for proc in procs:
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, out.decode()
    blobs = [p.read_bytes() for p in (*paths, here)]
    assert n_planned > 500 and len(blobs[0]) > 100_000
    assert blobs[0] == blobs[1] == blobs[2]
    other = tmp_path / "trace_other_seed.bin"
    plan_trace(str(other), seed=8, iterations=30)
    assert other.read_bytes() != blobs[0][:len(other.read_bytes())]  # the trace sees inputs


def test_workload_is_a_function_of_seed_and_ledger():
    cfg = selftest_config("cpu", "torch", ring=False)
    ledger = Ledger(cfg)
    ledger.live[[1, 4, 5]] = True
    ledger.seq_len[[1, 4, 5]] = [7, 0, 30]
    ledger.full.n_free -= 13
    ledger.swa.n_free -= 13
    a, b = RandomWorkload(cfg, 3), RandomWorkload(cfg, 3)
    for _ in range(20):
        sa, sb = a.propose(ledger), b.propose(ledger)
        assert sa.keys() == sb.keys()
        for k in sa:
            np.testing.assert_equal(sa[k], sb[k])


# ---- digest and payload ------------------------------------------------------------------


def _run_some_steps(alloc: HybridAllocator, seed: int, n: int) -> None:
    RandomWorkload(alloc.config, seed).drive(alloc, n)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_state_digest_equal_states_equal_digests_and_single_entry_changes(dtype):
    cfg = selftest_config("cpu", "torch", ring=False)
    cfg = type(cfg)(**{**cfg.__dict__, "index_dtype": dtype})
    a, b = HybridAllocator(cfg), HybridAllocator(cfg)
    _run_some_steps(a, 11, 25)
    _run_some_steps(b, 11, 25)
    da, db = StateDigest(a.state.tables()), StateDigest(b.state.tables())
    out_a, out_b = torch.zeros(len(da), dtype=torch.int64), torch.zeros(len(db), dtype=torch.int64)
    da.compute(out_a)
    db.compute(out_b)
    assert torch.equal(out_a, out_b) and (out_a[:4] != 0).all()  # ring pages, err: 0
    assert ledger_digest(a.ledger) == ledger_digest(b.ledger)
    for j, (name, table) in enumerate(b.state.tables().items()):
        flat = table.view(-1)
        k = (7919 * (j + 1)) % flat.numel()
        flat[k] += 1  # one entry of one table
        db.compute(out_b)
        changed = torch.nonzero(out_a != out_b).view(-1).tolist()
        assert changed == [j], (name, changed)
        flat[k] -= 1
    db.compute(out_b)
    assert torch.equal(out_a, out_b)


def test_state_digest_sees_a_swap():
    cfg = selftest_config("cpu", "torch", ring=False)
    alloc = HybridAllocator(cfg)
    d = StateDigest(alloc.state.tables())
    before, after = torch.zeros(len(d), dtype=torch.int64), torch.zeros(len(d), dtype=torch.int64)
    d.compute(before)
    free = alloc.state.full_free
    free[[3, 90]] = free[[90, 3]].clone()  # same multiset, different order
    d.compute(after)
    assert (before != after).tolist() == [name == "full_free" for name in d.names]


def test_ledger_payload_roundtrip_and_torn_payload():
    cfg = selftest_config("cpu", "torch", ring=True)
    alloc = HybridAllocator(cfg)
    _run_some_steps(alloc, 5, 30)
    header = np.zeros((1 + n_ledger_rows(cfg), 8), dtype=np.int64)
    digest = pack_ledger(alloc.ledger, header)
    assert digest == ledger_digest(alloc.ledger) == header[0, META_LEDGER]
    back = unpack_ledger(cfg, header)
    assert ledger_digest(back) == digest
    back.check_host_invariants()
    for name in ("live", "seq_len", "frontier", "protected"):
        np.testing.assert_array_equal(getattr(back, name), getattr(alloc.ledger, name))
    header[1, 3] += 1  # a torn payload
    with pytest.raises(IntegrityError, match="digest"):
        unpack_ledger(cfg, header)


# ---- the wrapper on a one-rank group (this process) --------------------------------------


@pytest.fixture(scope="module")
def one_rank_group(tmp_path_factory):
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    path = tmp_path_factory.mktemp("pg") / "init"
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
    gc.collect()  # the wrappers' cycles hold the group: join its gloo threads now, not at exit


def test_wrapper_contracts(one_rank_group):
    cfg = selftest_config("cpu", "torch", ring=False)
    with pytest.raises(ConfigError, match="mode"):
        ReplicatedAllocator(cfg, mode="gossip")
    with pytest.raises(ConfigError, match="multiple"):
        ReplicatedAllocator(cfg, check_every=10, digest_every=4)
    with pytest.raises(ConfigError, match="builds the allocator"):
        ReplicatedAllocator(HybridAllocator(cfg))  # the layer builds its own allocator
    with pytest.raises(ConfigError, match="use_graph"):
        ReplicatedAllocator(cfg, use_graph=True)  # graphs need CUDA

    rep = ReplicatedAllocator(cfg, mode="broadcast", check_every=4)
    alloc = rep.alloc
    assert rep.is_planner and rep.n_checks == 1  # the construction check
    with pytest.raises(ContractError, match="follow"):
        rep.follow()
    with pytest.raises(ContractError, match="handle"):
        rep.admit(handle=0)
    assert rep.n_steps == 0  # pool mode: a refused admit is host-only
    row = rep.admit()
    rep.step(extend=([row], [5]))
    with pytest.raises(UnknownRequestError):
        rep.step(decode=[row + 1])
    assert rep.n_steps == 2  # the refused step still ran (empty), keeping lockstep
    rep.step(decode=[row])
    rep.check()
    assert rep.last_equal_step == 3
    assert rep.current_digest()["step"] == 3
    alloc.check_integrity()
    rep.close()


def test_replicated_wrapper_stacks_on_the_allocators_executor(one_rank_group):
    """Replicated mode: the layer's executor runs each step through the inner executor and
    records a digest after it; nothing is patched into the allocator."""
    cfg = selftest_config("cpu", "torch", ring=True)
    rep = ReplicatedAllocator(cfg, mode="replicated", check_every=6, digest_every=3)
    alloc = rep.alloc
    assert alloc.executor is rep.executor and rep.executor.inner.alloc is alloc
    workload = RandomWorkload(cfg, 9)
    for _ in range(40):
        if workload.wants_admit():
            try:
                rep.admit()
            except ContractError:
                pass
        rep.step(**workload.propose(alloc.ledger))
    assert rep.n_steps == alloc.steps_run and rep.n_checks == 1 + rep.n_steps // 6
    assert rep.executor.n_fused + rep.executor.n_two_launch == alloc.steps_run
    rep.close()
    alloc.check_integrity()


def test_the_wrapper_is_freed_without_a_garbage_collection(one_rank_group):
    """No reference cycle keeps a wrapper, its allocator or its process group alive: dropping
    the last reference frees them at once (a gloo group kept alive to interpreter exit is
    how a rank once aborted there)."""
    import weakref

    gc.collect()
    gc.disable()
    try:
        rep = ReplicatedAllocator(selftest_config("cpu", "torch", ring=False), mode="replicated")
        rep.step(extend=([rep.admit()], [3]))
        refs = [weakref.ref(rep), weakref.ref(rep.alloc), weakref.ref(rep.executor)]
        del rep
        assert [r() for r in refs] == [None, None, None]
    finally:
        gc.enable()


def test_divergence_names_the_majority_outlier(one_rank_group):
    """The comparator on a fabricated 3-rank history (every rank computes this)."""
    rep = ReplicatedAllocator(selftest_config("cpu", "torch", False), mode="broadcast")
    rep.global_ranks, rep.src = [0, 1, 2], 0
    n_cols = len(rep.columns)
    table = np.zeros((3, 4, n_cols), dtype=np.int64)
    table[:, :, 0] = [10, 11, 12, 13]  # step numbers
    table[:, :, 3:] = 5
    table[0, 2:, rep.columns.index("req_to_token")] = 6  # the planner is the outlier
    err = rep._first_divergence(table)
    assert (err.step, err.rank, err.ranks, err.reference_rank) == (12, 0, [0], 1)
    assert err.fields == ["req_to_token"] and err.last_equal_step == 11
    assert "rank 0 differs from rank 1 at step 12" in str(err)
    table[1, 2:, 4] = 9  # three different values: a tie, the planner is the reference
    err = rep._first_divergence(table)
    assert (err.rank, err.ranks, err.reference_rank) == (1, [1, 2], 0)
    assert isinstance(err, ReplicaDivergenceError)
    rep.close()


# ---- two ranks, gloo, spawned ------------------------------------------------------------


@pytest.fixture(scope="module")
def gloo_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("replicas_gloo")
    summary = spawn_selftest(2, "gloo", str(out), default_scenarios(300, 16), timeout_s=60)
    return {v["name"]: v for v in summary["scenarios"]}, out


@pytest.mark.parametrize("name", ["replicated-pool", "broadcast-pool", "replicated-ring",
                                  "broadcast-ring"])
def test_two_ranks_stay_identical(gloo_run, name):
    verdicts, _ = gloo_run
    v = verdicts[name]
    assert v["ok"], v["detail"]
    assert v["steps"] >= (300 if name.endswith("pool") else 100)
    assert v["checks"] >= v["steps"] // 16


@pytest.mark.parametrize("name, fields", [("replicated-input-skew", {"ledger", "req_to_token"}),
                                          ("broadcast-device-skew", {"full_to_swa"})])
def test_perturbed_rank_is_named(gloo_run, name, fields):
    import json

    verdicts, out = gloo_run
    assert verdicts[name]["ok"], verdicts[name]["detail"]
    for rank in (0, 1):
        with open(out / f"rank{rank}.json") as f:
            res = next(s for s in json.load(f)["scenarios"] if s["name"] == name)
        err, expected = res["error"], res["expected"]
        assert (err["step"], err["rank"]) == (expected["step"], 1)
        assert fields <= set(err["fields"])
        assert err["last_equal_step"] == expected["step"] - 1


def test_failing_worker_reports_its_own_traceback(tmp_path):
    """A rank that raises: the parent's error carries that rank's own traceback (not just
    spawn's "process 1 terminated ..."), and the rank's report stays in the out dir."""
    failing = Scenario("fails-on-purpose", "replicated", iterations=40, perturb="raise")
    with pytest.raises(SelftestWorkerError) as info:
        spawn_selftest(2, "gloo", str(tmp_path), [failing], timeout_s=20)
    message = str(info.value)
    assert message.startswith("replica self-test failed (Process")
    sections: dict = {}  # rank -> its reports (raised, and a stack dump if it got SIGTERM)
    for rank, text in re.findall(r"^--- rank (\d): (.*?)(?=^--- rank |\Z)", message, re.M | re.S):
        sections.setdefault(rank, []).append(text)
    assert sections.keys() == {"0", "1"}, message
    own = next(t for t in sections["1"] if t.startswith("raised (rank1.error.txt) ---\n"))
    assert "Traceback (most recent call last):" in own
    assert "in run_scenario" in own  # the worker's own frames, not the parent's
    assert own.rstrip().endswith("SelftestDeliberateError: deliberate failure of rank 1 in "
                                 "scenario 'fails-on-purpose'")
    assert "deliberate failure" not in "".join(sections["0"])  # rank 0 only lost its peer
    assert "deliberate failure of rank 1" in (tmp_path / "rank1.error.txt").read_text()
    assert not (tmp_path / "rank1.json").exists()


def test_failure_report_tells_a_rank_that_never_started(tmp_path):
    """No report from a rank: the parent says whether its worker function ever ran (the
    worker opens its fault file first thing), e.g. a child that failed importing."""
    from replica_selftest import _failure_report
    from torch.multiprocessing.spawn import ProcessExitedException

    (tmp_path / "rank0.fault.txt").write_text("")
    exc = ProcessExitedException("process 1 terminated with exit code 1", error_index=1,
                                 error_pid=0, exit_code=1)
    message = _failure_report(str(tmp_path), 2, exc)
    assert message.splitlines()[0] == ("replica self-test failed (ProcessExitedException: "
                                       "process 1 terminated with exit code 1)")
    assert "--- rank 1: no report: it never reached the worker function" in message
    assert "--- rank 0: no report (its worker ran;" in message
    assert message.index("--- rank 1") < message.index("--- rank 0")


# ---- two GPUs, NCCL ----------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_nccl_graphs_sync_debug(tmp_path):
    """One process per GPU, NCCL, graph replay on every rank, sync-debug "error" around the
    step loops: the same scenarios as the gloo run."""
    out = os.environ.get("GRAPHALLOC_REPLICA_RESULTS", str(tmp_path))
    summary = spawn_selftest(2, "nccl", out, default_scenarios(300, 16), sync_debug=True)
    assert summary["ok"], summary
    assert all(summary["sync_debug"])
    assert all(min(v["replays"]) > 0 for v in summary["scenarios"])
