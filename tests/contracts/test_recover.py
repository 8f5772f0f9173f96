"""The one way back after a device fault: ``recover()`` rebuilds the device from the host.

Rules (``HybridAllocator.recover``, ``reset_faults``; docs/errors.md "Getting back"):

* ``recover()`` waits for the device, writes every device table again from the host
  ledger, clears the error word and the step count, and audits: afterwards ``audit()`` is
  empty, ``check_integrity()`` passes, ``check()`` is clean, and the allocator holds what an
  allocator that never faulted holds (same host ledger, same defined device entries).
* ``reset_faults()`` never lets steps run on tables that are still wrong: while the audit
  finds a discrepancy it changes nothing and raises ``IntegrityError`` naming recover().
* Ring mode keeps no host copy of page ids: what depends only on the host (full_to_swa,
  the free windows, the state table) is rebuilt; a damaged req_to_token is refused.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from launch_faults import defined_state, same_state
from workload import random_step

import graphalloc as ga
from graphalloc import ChunkedLocal, FullAttention, RecurrentState
from graphalloc import errors as E
from graphalloc.kernels.abi import ERR_CODES, ERR_COUNT

BACKENDS = ["torch", "triton"]


def build(backend="torch", ring=False, chunked=False, **kw):
    args = dict(page_size=3, num_full_pages=48, num_swa_pages=30, max_reqs=4,
                max_context_len=30, sliding_window=7, backend=backend,
                swa_ring_pages=4 if ring else 0, max_handles=0 if ring else 2,
                num_state_slots=0 if ring else 12, max_spec_tokens=4)
    if chunked:  # a chunked-local window pool (graphalloc.pools) instead of the window
        for name in ("num_full_pages", "num_swa_pages", "sliding_window", "num_state_slots"):
            del args[name]
        args["layers"] = (FullAttention(48), ChunkedLocal(9, 30), RecurrentState(12, 4))
    args.update(kw)
    return ga.HybridAllocator(ga.AllocatorConfig(**args))


def twins(n_ops, seed, **kw):
    """Two allocators that ran the same random workload."""
    a, b = build(**kw), build(**kw)
    rng = np.random.default_rng(seed)
    for _ in range(n_ops):
        random_step([a, b], rng)
    return a, b


def fresh_row(*allocs) -> int:
    """A row with room, the same in each allocator: every request released, one admitted."""
    rows = []
    for alloc in allocs:
        alloc.release(alloc.live_rows())
        rows.append(alloc.admit())
        alloc.alloc_extend([rows[-1]], [5])
    assert len(set(rows)) == 1
    return rows[0]


def corrupt(alloc, rng) -> str:
    """Damage one defined device entry by hand (what a bug elsewhere could do)."""
    cfg, led, st = alloc.config, alloc.ledger, alloc.state
    choices = ["full_to_swa", "full_free", "swa_free"]
    live = np.flatnonzero(led.live & (led.seq_len > 0))
    if len(live) and not cfg.ring_mode:
        choices.append("req_to_token")
    if cfg.num_state_slots:
        choices.append("state_table")
    if led.n_handles and led.h_live.any():
        choices.append("handle_to_token")
    what = str(rng.choice(choices))
    if what == "full_to_swa":
        page = int(rng.integers(1, cfg.num_full_pages + 1))
        st.full_to_swa_buf[page * cfg.page_size] += 3 * cfg.page_size + 1
    elif what in ("full_free", "swa_free"):
        ring = led.full if what == "full_free" else led.swa
        if not ring.n_free:
            return "nothing"
        getattr(st, what)[ring.head] = 0  # a sink marker where a free page was
    elif what == "req_to_token":
        r = int(rng.choice(live))
        st.req_to_token_buf[r, int(rng.integers(0, led.seq_len[r]))] += cfg.page_size
    elif what == "state_table":
        st.state_table_buf[int(rng.integers(0, cfg.max_reqs))] += 1
    else:
        h = int(rng.choice(np.flatnonzero(led.h_live)))
        st.req_to_token_buf[cfg.max_reqs + h, 0] += 1
    return what


@pytest.mark.parametrize("seed", range(6))
def test_recover_rebuilds_hand_corrupted_tables(seed):
    """Random workload, random damage, a fault word set: reset_faults is refused, recover
    gives back exactly the allocator that was never damaged, and both go on alike (seeds
    4 and 5: a chunked-local window pool)."""
    a, b = twins(60 + 10 * seed, seed, chunked=seed >= 4)
    rng = np.random.default_rng(100 + seed)
    damaged = {corrupt(a, rng) for _ in range(3)} - {"nothing"}
    a.state.err_buf[ERR_CODES], a.state.err_buf[ERR_COUNT] = 1, 1  # as a kernel records
    with pytest.raises(E.DeviceFaultError):
        a.check()
    if damaged:
        assert a.audit() != []
        with pytest.raises(E.IntegrityError, match="recover"):
            a.reset_faults()
        with pytest.raises(E.PendingStepError):
            a.step()
    a.recover()
    assert a.audit() == [] and not a.faulted
    a.check_integrity()
    a.check()
    assert same_state(defined_state(a), defined_state(b)) is None
    for _ in range(40):
        random_step([a, b], rng)
    assert a.audit() == []
    assert same_state(defined_state(a), defined_state(b)) is None


@pytest.mark.parametrize("backend", BACKENDS)
def test_recover_after_a_submission_error_catches_the_device_up(backend):
    """A step marked submitted was never launched: check() raises SubmissionError, the host
    is ahead of the device; recover() writes the host's view, and the allocator equals one
    that launched the step."""
    a, b = twins(30, 2, backend=backend)
    led = a.ledger
    rows = np.flatnonzero(led.live & (led.spec_steps[:, 0] == 0)
                          & (led.seq_len + 3 <= a.config.max_context_len))[:2]
    assert len(rows)
    p = a.plan(extend=(rows, [3] * len(rows)))
    a.mark_submitted(p)  # no launch
    b.step(extend=(rows, [3] * len(rows)))
    with pytest.raises(E.SubmissionError):
        a.check()
    with pytest.raises(E.IntegrityError):
        a.reset_faults()
    a.recover()
    assert a.audit() == []
    a.check()
    assert same_state(defined_state(a), defined_state(b)) is None
    rng = np.random.default_rng(9)
    for _ in range(10):
        random_step([a, b], rng)
    assert same_state(defined_state(a), defined_state(b)) is None
    a.check()


def test_recover_after_a_cancelled_step_ran_takes_it_back():
    """The device ran a step the host cancelled (an engine replayed, then cancelled):
    recover() writes the host's view back, as if the step never ran."""
    a, b = twins(30, 4)
    r = fresh_row(a, b)
    p = a.plan(extend=([r], [4]))
    a.launch(p.buffer_index)
    a.cancel(p)
    with pytest.raises(E.SubmissionError):
        a.check()
    a.recover()
    assert a.audit() == []
    assert same_state(defined_state(a), defined_state(b)) is None


def test_reset_faults_clears_a_fault_when_the_tables_are_right():
    """A fault word with no damage (the tables agree): reset_faults accepts steps again."""
    a, _ = twins(20, 5)
    a.state.err_buf[ERR_CODES], a.state.err_buf[ERR_COUNT] = 1, 1
    with pytest.raises(E.DeviceFaultError):
        a.check()
    a.reset_faults()
    a.check()
    a.step()


def test_recover_is_refused_with_a_step_pending_or_a_block_open():
    a, _ = twins(10, 6)
    p = a.plan()
    with pytest.raises(E.PendingStepError):
        a.recover()
    with pytest.raises(E.PendingStepError):
        a.reset_faults()
    a.cancel(p)
    with a.free_group(), pytest.raises(E.NestedGroupError):
        a.recover()
    with a.scheduler_step(), pytest.raises(E.RecorderError):
        a.recover()


def test_recover_after_a_failed_restore():
    """A launch failed and the restore of the device failed too: the allocator refuses
    steps (faulted) until recover(), which gives back the allocator as before the step."""
    from launch_faults import LaunchFaults

    import graphalloc.device.restore as restore

    a, b = twins(30, 8)
    faults = LaunchFaults(a)
    r = fresh_row(a, b)
    real = restore.project_mapping

    def broken(alloc):
        raise RuntimeError("restore failed")
    restore.project_mapping = broken
    try:
        faults.arm(0)  # the restore runs (and fails) whatever was launched
        with pytest.raises(E.LaunchError, match="until recover"):
            a.alloc_extend([r], [4])
    finally:
        restore.project_mapping = real
    assert a.faulted
    with pytest.raises(E.PendingStepError):
        a.step()
    a.recover()
    assert a.audit() == []
    assert same_state(defined_state(a), defined_state(b)) is None


def test_ring_mode_recover_rebuilds_what_the_host_knows_and_refuses_the_rest():
    a, b = twins(60, 7, ring=True)
    rng = np.random.default_rng(1)
    for _ in range(3):
        corrupt(a, rng)  # mappings and free windows
    a.recover()
    assert a.audit() == []
    # free windows are refilled in page order, so compare what ring mode promises
    sa, sb = defined_state(a), defined_state(b)
    for key in sa:
        if key not in ("full_free", "swa_free"):
            assert np.array_equal(sa[key], sb[key]), key
        else:
            assert sorted(sa[key]) == sorted(sb[key]), key
    r = int(np.flatnonzero(a.ledger.live & (a.ledger.seq_len > 0))[0])
    a.state.req_to_token_buf[r, 0] += a.config.page_size  # the host has no copy of this
    with pytest.raises(E.IntegrityError, match="Ring mode"):
        a.recover()
    assert a.faulted
    torch.testing.assert_close(a.state.err_buf, torch.zeros_like(a.state.err_buf))
