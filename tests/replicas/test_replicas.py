"""Tensor-parallel replicas (graphalloc.replicas): determinism, digests, multi-rank runs.

* planning is deterministic: the same random op sequences (steps; every operation:
  handles, prefix cache, load_back, scheduler_step blocks, speculative decoding) planned
  in processes with different ``PYTHONHASHSEED`` values give byte-identical descriptors
  and host digests;
* the digests (each host part sees its own state and only it) and the ledger payload,
  with the page mirror rebuilt from the device tables exactly;
* the wrapper's contracts on a one-rank gloo group (in this process): every operation is
  a fixed number of steps, refused or not;
* two ranks, gloo, ``torch.multiprocessing`` spawn (one spawn for all scenarios, to
  pay the start-up once): a few hundred random steps and a few hundred random operations
  of every kind in replicated and broadcast mode (pool and ring) with equal digests --
  host parts included, a broadcast follower's from the ledger it rebuilt -- and perturbed
  runs (a skipped decode, a mapping entry, a reference count, a handle, a committed
  length, the prefix cache, a planner's reference count, a follower's handle row) whose
  divergence must be named at the exact step, rank and field;
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
from conftest import TOOLS
from replica_selftest import (
    PERTURBATIONS,
    DirectOps,
    OpsWorkload,
    RandomWorkload,
    Scenario,
    SelftestWorkerError,
    default_scenarios,
    plan_trace,
    selftest_config,
    spawn_selftest,
)

from graphalloc import (
    CapacityError,
    ConfigError,
    ContractError,
    HybridAllocator,
    IntegrityError,
    ReplicaDivergenceError,
    UnknownRequestError,
)
from graphalloc.replicas.allocator import ReplicatedAllocator
from graphalloc.replicas.digest import HOST_PARTS, StateDigest, host_digests, ledger_digest
from graphalloc.replicas.wire import (
    n_header_rows,
    pack_ledger,
    planned_digests,
    rebuild_page_refs,
    unpack_ledger,
)
from graphalloc.state.ledger import Ledger

SELFTEST = os.path.join(TOOLS, "replica_selftest.py")
ITERATIONS = 200  # of the long gloo scenarios (the short ones: a third)

# ---- determinism -------------------------------------------------------------------------


def test_planning_is_identical_across_hash_seeds(tmp_path):
    """Two processes with different PYTHONHASHSEED, and this one, plan the same bytes."""
    procs, paths = [], []
    for hash_seed in ("0", "987654321"):
        path = tmp_path / f"trace_{hash_seed}.bin"
        env = dict(os.environ, PYTHONHASHSEED=hash_seed)
        procs.append(subprocess.Popen(
            [sys.executable, SELFTEST, "--plan-trace", str(path),
             "--seed", "7", "--steps", "200"], env=env, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT))
        paths.append(path)
    here = tmp_path / "trace_here.bin"
    n_planned = plan_trace(str(here), seed=7, iterations=200)
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
    ledger.rings[:, 1] -= 13  # [pool][n_free]
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


def _ops_allocator(seed: int, n_ops: int, ring: bool = False) -> HybridAllocator:
    """A CPU allocator after ``n_ops`` random operations of every kind (kernels run)."""
    cfg = selftest_config("cpu", "torch", ring, max_handles=0 if ring else 6)
    alloc = HybridAllocator(cfg, prefix_cache=not ring)
    ops, api = OpsWorkload(cfg, seed, cache=not ring), DirectOps(alloc)
    for _ in range(n_ops):
        ops.run(api, ops.next_kind(), planner=True)
    led = alloc.ledger  # end with a speculative tail in flight
    rows = np.flatnonzero(led.live & (led.seq_len > 0) & (led.spec_steps[:, -1] == 0)
                          & (led.seq_len + 2 <= cfg.max_context_len))
    row = next(r for r in rows if alloc.fits(decode=[r], lookahead=1, evict_all=True))
    alloc.step(decode=[row], lookahead=1, evict_all=True)
    return alloc


def _rebuilt(alloc: HybridAllocator, header: np.ndarray):
    cfg, st = alloc.config, alloc.state
    back = unpack_ledger(cfg, header)
    if not cfg.ring_mode:
        ps, n_rows = cfg.page_size, cfg.max_reqs + cfg.max_handles
        back.refs = rebuild_page_refs(cfg, back, st.req_to_token_buf[:n_rows, ::ps].numpy(),
                                      st.full_to_swa_buf[::ps].numpy(), st.full_free.numpy(),
                                      st.swa_free.numpy())
    return back


@pytest.mark.parametrize("ring", [False, True])
def test_ledger_payload_roundtrip_rebuilds_the_page_mirror_exactly(ring):
    """Pack a ledger after every kind of operation, unpack it, rebuild the page mirror from
    the device tables: every array equals the planner's (page ids on the holders' ranges)
    and so do the host digests; a torn payload is refused."""
    alloc = _ops_allocator(5, 160, ring)
    led, cfg = alloc.ledger, alloc.config
    assert ring or (led.h_live.any() and (led.seq_len != led.committed).any())
    header = np.zeros((n_header_rows(led), 8), dtype=np.int64)
    digests = pack_ledger(led, header, alloc.prefix_cache)
    assert digests == host_digests(led, alloc.prefix_cache) == planned_digests(header)
    back = _rebuilt(alloc, header)
    for name in led.ROW_ARRAYS + led.HANDLE_ARRAYS:
        np.testing.assert_array_equal(getattr(back, name), getattr(led, name), err_msg=name)
    assert (back.full.head, back.full.n_free, back.swa.head, back.swa.n_free) == (
        led.full.head, led.full.n_free, led.swa.head, led.swa.n_free)
    if not ring:
        for name in ("full_ref", "swa_ref", "swa_of", "full_ring", "swa_ring"):
            np.testing.assert_array_equal(getattr(back.refs, name), getattr(led.refs, name),
                                          err_msg=name)
        ps = cfg.page_size
        for r in np.flatnonzero(led.live):
            n = -(-led.seq_len[r] // ps)
            np.testing.assert_array_equal(back.refs.page_of[r, :n], led.refs.page_of[r, :n])
        for h in np.flatnonzero(led.h_live):
            n, row = led.h_len[h] // ps, cfg.max_reqs + h
            np.testing.assert_array_equal(back.refs.page_of[row, :n], led.refs.page_of[row, :n])
        back.check_host_invariants()
    assert {k: v for k, v in host_digests(back).items() if k != "cache"} == {
        k: v for k, v in digests.items() if k != "cache"}
    header[3, 5] += 1  # a torn payload
    with pytest.raises(IntegrityError, match="digest"):
        unpack_ledger(cfg, header)


def test_each_host_digest_part_sees_its_own_state():
    """One change of the host state changes its part's digest and no other; state that is
    not state (a stale page id past a holder's range) changes nothing."""
    alloc = _ops_allocator(3, 120)
    led, cache, ps = alloc.ledger, alloc.prefix_cache, alloc.config.page_size
    base = host_digests(led, cache)
    assert set(base) == set(HOST_PARTS) and ledger_digest(led, cache) != ledger_digest(led)
    row = int(np.flatnonzero(led.live & (led.seq_len > 0))[0])
    end = -(-int(led.seq_len[row]) // ps)
    handle = int(np.flatnonzero(led.h_live)[0])
    page = int(np.flatnonzero(led.refs.full_ref)[1])

    def bump(arr, index, part):
        arr[index] += 1
        changed = [k for k, v in host_digests(led, cache).items() if v != base[k]]
        arr[index] -= 1
        assert changed == [part], (part, changed)

    bump(led.frontier, row, "ledger")
    bump(led.committed, row, "spec")
    bump(led.spec_steps, (row, 1), "spec")
    bump(led.h_len, handle, "handles")
    bump(led.h_swa_start, handle, "handles")
    bump(led.refs.full_ref, page, "refs")
    bump(led.refs.swa_ref, 1, "refs")
    bump(led.refs.page_of, (row, end - 1), "pages")
    bump(led.refs.swa_of, page, "pages")
    bump(led.refs.full_ring, (led.full.head + led.full.n_free - 1) % led.full.capacity, "pages")
    stale = led.refs.page_of[row, end:end + 1]
    stale += 5  # past the row's range: nothing reads it
    assert host_digests(led, cache) == base
    stale -= 5
    cache.hits += 1
    assert [k for k, v in host_digests(led, cache).items() if v != base[k]] == ["cache"]
    cache.hits -= 1


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
    with pytest.raises(ConfigError, match="prefix_cache"):
        ReplicatedAllocator(cfg, prefix_cache=True)  # a cache needs handles

    rep = ReplicatedAllocator(cfg, mode="broadcast", check_every=4)
    alloc = rep.alloc
    assert rep.is_planner and rep.n_checks == 1  # the construction check
    with pytest.raises(ContractError, match="follow"):
        rep.follow()
    with pytest.raises(CapacityError):
        rep.take_handle(0, 3)  # no handle slots: refused, and still its one step
    assert rep.n_steps == 1 and rep.n_empty_steps == 1
    row = rep.admit()  # a step of its own (followers cannot tell it from an admit on a handle)
    rep.step(extend=([row], [5]))
    with pytest.raises(UnknownRequestError):
        rep.step(decode=[row + 1])
    assert rep.n_steps == 4  # the refused step still ran (empty), keeping lockstep
    rep.step(decode=[row])
    with pytest.raises(ContractError, match="prefix_cache"):
        rep.cache_insert(row, [1, 2, 3])  # refused on every rank before any step
    with pytest.raises(ContractError, match="scheduler_step"):
        rep.free_group()  # broadcast mode: its flush is a number of steps only the planner knows
    assert rep.n_steps == 5
    rep.check()
    assert rep.last_equal_step == 5
    assert rep.current_digest()["step"] == 5
    alloc.check_integrity()
    rep.close()


def test_every_operation_is_its_fixed_number_of_steps(one_rank_group):
    """Broadcast planner, pool mode with handles and a prefix cache: each operation, run or
    refused (its arguments, a raising block, a bad keyword), is exactly the steps the
    followers replay for it; the payload carries the whole ledger each step."""
    cfg = selftest_config("cpu", "torch", ring=False, max_handles=3)
    rep = ReplicatedAllocator(cfg, mode="broadcast", check_every=4, prefix_cache=True)
    alloc, ps = rep.alloc, cfg.page_size
    assert rep.cache_insert_steps == 1 + -(-cfg.request_pages // cfg.max_release_rows)

    def steps(expected, fn, *errors):
        before = rep.n_steps
        if errors:
            with pytest.raises(errors):
                fn()
        else:
            out = fn()
        assert rep.n_steps - before == expected, fn
        return None if errors else out

    row = steps(1, rep.admit)
    steps(1, lambda: rep.step(extend=([row], [7 * ps])))
    h = steps(1, lambda: rep.take_handle(row, 4 * ps))
    other = steps(1, lambda: rep.admit(handle=h, n_tokens=2 * ps))
    assert alloc.seq_len(other) == 2 * ps and alloc.ledger.h_live[h]
    steps(1, lambda: rep.admit(handle=h + 1), ContractError)  # an unknown handle
    steps(1, lambda: rep.step(decode=[other], lookahead=2))
    assert alloc.spec_len(other) == 3
    steps(1, lambda: rep.step(commit=([other], [1])))
    assert alloc.committed_len(other) == 2 * ps + 1 and alloc.spec_len(other) == 0
    steps(1, lambda: rep.step(commit=([other], [1])), ContractError)  # nothing speculative left
    steps(1, lambda: rep.step(trim=([other], [2 * ps])))
    steps(1, lambda: rep.step(drop_swa=[h]))
    steps(1, lambda: rep.step(drop=[h]))
    steps(1, lambda: rep.step(drop=[h]), ContractError)  # dropped already
    steps(1, lambda: rep.step(evict_all=True, decode=[row]))
    steps(1, lambda: rep.step(evict_all=True))
    for _ in range(4):
        steps(1, lambda: rep.step(decode=[row]))
    steps(1, lambda: rep.step(evict=[row]))
    f = alloc.frontier(row)
    assert f > 0
    out = steps(1, lambda: rep.step(load_back=([row], [f - ps])))
    slots = None if out is None else out.swa_slots
    assert alloc.frontier(row) == f - ps and slots.numel() == ps
    cached = steps(rep.cache_insert_steps, lambda: rep.cache_insert(row, list(range(7 * ps))))
    assert cached == 7 * ps and len(alloc.prefix_cache) == 1
    steps(rep.cache_insert_steps, lambda: rep.cache_insert(row, list(range(7 * ps))))  # cached
    with rep.scheduler_step() as it:  # one step, several calls
        it.release([other])
        new = it.admit()
        d = it.decode([row])
        e = it.extend([new], [4])
    assert rep.n_steps and d.rows.tolist() == [row] and e.n_tokens.tolist() == [4]
    before = rep.n_steps
    with pytest.raises(RuntimeError, match="the engine's own"):
        with rep.scheduler_step() as it:
            it.release([new])
            raise RuntimeError("the engine's own failure")  # the block runs nothing
    assert rep.n_steps == before + 1 and alloc.is_live(new)
    steps(1, lambda: rep.step(extend=([new], [10 ** 6])), ContractError)
    steps(1, lambda: rep.step(no_such_argument=1), ContractError)  # even this keeps lockstep
    assert steps(1, lambda: rep.try_step(decode=[row])).rows.tolist() == [row]
    # the payload of the latest step carries the planner's whole ledger
    header = rep.payload.header.cpu().numpy()
    assert planned_digests(header) == host_digests(alloc.ledger, alloc.prefix_cache)
    with pytest.raises(IntegrityError, match="lockstep"):
        rep.ops._op(1, lambda: (alloc.step(), alloc.step()))  # more steps than followers replay
    rep.check()
    alloc.check_integrity()
    rep.close()


def test_cache_inserts_key_pages_in_their_namespace_and_the_digest_sees_the_keys(
        one_rank_group):
    """``cache_insert`` with a salt: the same tokens under another salt are another entry
    (no page shared), under the same salt cached already; the cache digest covers the
    entries' keys (changing one key changes it); the hash mode is a wrapper option."""
    cfg = selftest_config("cpu", "torch", ring=False, max_handles=4)
    with pytest.raises(ConfigError, match="prefix_cache"):
        ReplicatedAllocator(cfg, mode="replicated", prefix_cache="md5")
    rep = ReplicatedAllocator(cfg, mode="replicated", prefix_cache="blake2b")
    alloc, cache, ps = rep.alloc, rep.alloc.prefix_cache, cfg.page_size
    assert cache.key_hash == "blake2b"
    row = rep.admit()
    rep.step(extend=([row], [4 * ps]))
    tokens = list(range(4 * ps))
    assert rep.cache_insert(row, tokens, salt="a") == 4 * ps and len(cache) == 1
    rep.cache_insert(row, tokens, salt="a")  # cached already
    assert len(cache) == 1
    rep.cache_insert(row, tokens, salt="b")  # another namespace: an entry of its own
    assert len(cache) == 2
    assert cache.match(tokens, salt="b").full_tokens == 4 * ps
    assert cache.match(tokens, salt="c").full_tokens == 0
    (entry, *_) = cache.digest_state()["entries"]
    base = host_digests(alloc.ledger, cache)
    last = entry.keys[-1]
    entry.keys[-1] = bytes(16)
    assert [k for k, v in host_digests(alloc.ledger, cache).items() if v != base[k]] == [
        "cache"]
    entry.keys[-1] = last
    assert host_digests(alloc.ledger, cache) == base
    rep.check()
    rep.close()


def test_replicated_wrapper_stacks_on_the_allocators_executor(one_rank_group):
    """Replicated mode: the layer's executor runs each step through the inner executor and
    records a digest after it; nothing is patched into the allocator."""
    cfg = selftest_config("cpu", "torch", ring=True)
    rep = ReplicatedAllocator(cfg, mode="replicated", check_every=6, digest_every=3)
    alloc = rep.alloc
    assert alloc.executor is rep.executor and rep.executor.inner.parts is alloc.parts
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
    summary = spawn_selftest(2, "gloo", str(out), default_scenarios(ITERATIONS, 16), timeout_s=60)
    return {v["name"]: v for v in summary["scenarios"]}, out


@pytest.mark.parametrize("name", ["replicated-pool", "broadcast-pool", "replicated-ring",
                                  "broadcast-ring", "replicated-ops-pool", "broadcast-ops-pool",
                                  "replicated-ops-ring", "broadcast-ops-ring"])
def test_two_ranks_stay_identical(gloo_run, name):
    """Every digest equal at every check and at the end -- a broadcast follower's host parts
    (ledger, speculative state, handles, reference counts, page mirror) from the ledger it
    rebuilt -- and the follower's own integrity audit passes against its rebuilt mirror."""
    verdicts, _ = gloo_run
    v = verdicts[name]
    assert v["ok"], v["detail"]
    long = name.endswith("pool") or "-ops-" in name
    assert v["steps"] >= (ITERATIONS if long else ITERATIONS // 3)
    assert v["checks"] >= v["steps"] // 16
    if name.startswith("broadcast"):  # the follower installed a rebuilt ledger at each check
        assert v["ledger_installs"][1] >= v["checks"] - 2, v["ledger_installs"]


@pytest.mark.parametrize("mode", ["replicated", "broadcast"])
@pytest.mark.parametrize("ring", [False, True])
def test_every_operation_ran_under_replicas(gloo_run, mode, ring):
    """The operation workload ran every kind of operation, in both modes (pool: handles,
    admits on handles, drops, SWA tombstones, load_back, scheduler_step blocks, the prefix
    cache, speculative decode / commit / trim; ring: the speculative ones and blocks)."""
    verdicts, _ = gloo_run
    counts = verdicts[f"{mode}-ops-{'ring' if ring else 'pool'}"]["op_counts"]
    kinds = OpsWorkload.RING_KINDS if ring else OpsWorkload.POOL_KINDS
    assert set(counts) == set(kinds)
    assert all(ran >= 1 for ran, _ in counts.values()), counts


@pytest.mark.parametrize("name, fields", [("replicated-input-skew", {"ledger", "req_to_token"}),
                                          ("broadcast-device-skew", {"full_to_swa"})] + [
    (f"{'broadcast' if kind in ('planner-refcount', 'device-handle') else 'replicated'}-"
     f"{kind}-skew", fields) for kind, (_, fields) in PERTURBATIONS.items()])
def test_perturbed_rank_is_named(gloo_run, name, fields):
    import json

    verdicts, out = gloo_run
    assert verdicts[name]["ok"], verdicts[name]["detail"]
    for rank in (0, 1):
        with open(out / f"rank{rank}.json") as f:
            res = next(s for s in json.load(f)["scenarios"] if s["name"] == name)
        err, expected = res["error"], res["expected"]
        assert (err["step"], err["rank"]) == (expected["step"], 1)
        assert fields <= set(err["fields"]), err["fields"]
        assert err["last_equal_step"] == expected["step"] - 1
        if name.startswith("replicated") and name != "replicated-input-skew":
            assert err["fields"] == sorted(fields), err["fields"]  # only the perturbed part
        if name == "broadcast-device-handle-skew" and rank == 1 and "pages" in err["fields"]:
            # the rebuilt ledger differed from the planner's: the follower did not install it
            assert res["n_ledger_installs"] == res["installs_before_check"]


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
