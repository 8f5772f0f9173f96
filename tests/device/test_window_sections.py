"""A model's further window pools on the device: AL_NO_OUT allocation rows (Triton against
the Torch twin), and the launch sequence of a step (each pool's release section, the main
kernels, each pool's allocation section) through every entry: eager and graph executors
(the graph executor runs eagerly on a CPU), fused or two launches, an engine's own
``launch()``, validate mode. On the CPU the kernels run in the Triton interpreter: sizes are
small.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from workload import apply_all, random_step

import graphalloc as ga
from graphalloc.errors import FaultCode
from graphalloc.kernels import allocate_tokens, allocate_tokens_torch, new_error_word
from graphalloc.kernels.abi import (
    AL_FLAGS,
    AL_N_PAGES,
    AL_N_TOKENS,
    AL_NO_OUT,
    AL_OUT,
    AL_REQ,
    AL_START_POS,
    AL_SWA_ONLY,
    AL_SWA_POP,
    ERR_CODES,
    ERR_COUNT,
    ROW_WIDTH,
)
from graphalloc.pools import ChunkedLocal, FullAttention, SlidingWindow

DTYPES = [torch.int32, torch.int64]


def _tables(device, dtype, ps, n_full=12, n_swa=8):
    z = lambda *shape: torch.zeros(*shape, dtype=dtype, device=device)
    t = dict(req_to_token=z(3, 6 * ps), full_to_swa=z((n_full + 1) * ps), full_free=z(n_full + 1),
             swa_free=z(n_swa + 1), ring_pages=z(3, 1))
    t["swa_free"][:-1] = torch.arange(1, n_swa + 1)
    for r, pages in ((0, (3, 4, 5)), (1, (7, 8))):  # the FULL pages the main rows wrote
        for k, page in enumerate(pages):
            t["req_to_token"][r, k * ps:(k + 1) * ps] = page * ps + torch.arange(ps)
    return t


def _rows(ps, device):
    rows = np.zeros((5, ROW_WIDTH), dtype=np.int64)
    cols = [AL_REQ, AL_START_POS, AL_N_TOKENS, AL_SWA_POP, AL_OUT, AL_FLAGS, AL_N_PAGES]
    no_out = AL_SWA_ONLY | AL_NO_OUT
    rows[0, cols] = 0, 0, 3 * ps, 0, 0, no_out, 3  # pages 3, 4, 5 of request 0
    rows[2, cols] = 1, ps, ps, 3, 999, no_out, 1  # request 1's page 8 (AL_OUT not read)
    rows[3, cols] = 1, 0, ps, 4, 0, AL_SWA_ONLY, 1  # a load-back row with output lanes
    return torch.as_tensor(rows, device=device)


def _run(fn, t, out, rows, ps, n_lanes, validate=False):
    err = new_error_word(t["full_to_swa"].device)
    fn(rows, t["req_to_token"], t["full_to_swa"], t["full_free"], t["swa_free"], t["ring_pages"],
       out[0], out[1], err, page_size=ps, n_full_cap=12, n_swa_cap=8, n_lanes=n_lanes,
       validate=validate)
    return err


@pytest.mark.parametrize("dtype", DTYPES, ids=["i32", "i64"])
@pytest.mark.parametrize("ps", [1, 3])
def test_no_out_rows_match_the_twin_and_write_no_lanes(ps, dtype, device):
    """AL_SWA_ONLY | AL_NO_OUT rows pair existing FULL pages with popped pages and write no
    output lane (the twin's lanes of them land in the scratch entry); a load-back row beside
    them writes its lanes as before. The kernel ignores ``n_lanes`` for them: launched with
    no lanes at all it maps the same pages."""
    n_lanes = 5 * ps  # the twin's flat lanes cover every row's tokens
    results = []
    for fn in (allocate_tokens_torch, allocate_tokens):
        t = _tables(device, dtype, ps)
        out = [torch.full((n_lanes + 1,), -1, dtype=dtype, device=device) for _ in range(2)]
        err = _run(fn, t, out, _rows(ps, device), ps, n_lanes)
        results.append((t, [o[:-1].cpu() for o in out], err.cpu()))
    (ref, ref_out, ref_err), (got, got_out, got_err) = results
    for name in ref:
        torch.testing.assert_close(ref[name][:-1].cpu() if name != "full_to_swa"
                                   else ref[name].cpu(),
                                   got[name][:-1].cpu() if name != "full_to_swa"
                                   else got[name].cpu(), rtol=0, atol=0, msg=name)
    assert not ref_err.any() and not got_err.any()
    f2s = got["full_to_swa"].cpu().view(-1, ps)
    for full, swa in ((3, 1), (4, 2), (5, 3), (8, 4), (7, 5)):
        assert f2s[full].tolist() == [swa * ps + o for o in range(ps)], full
    for out in (ref_out, got_out):  # only the load-back row's lanes, [0, ps)
        assert out[0][:ps].tolist() == [7 * ps + o for o in range(ps)]
        assert out[1][:ps].tolist() == [5 * ps + o for o in range(ps)]
        assert out[0][ps:].tolist() == [-1] * (n_lanes - ps)
    t = _tables(device, dtype, ps)  # no output lanes: the kernel maps the NO_OUT rows
    rows = _rows(ps, device)
    rows[3] = 0
    out = [torch.zeros(1, dtype=dtype, device=device) for _ in range(2)]
    _run(allocate_tokens, t, out, rows, ps, 0)
    expect = got["full_to_swa"].clone().view(-1, ps)
    expect[7] = 0  # (the load-back row's page, not run here)
    torch.testing.assert_close(t["full_to_swa"].view(-1, ps), expect, rtol=0, atol=0)


@pytest.mark.parametrize("fn", [allocate_tokens_torch, allocate_tokens], ids=["twin", "triton"])
def test_no_out_rows_check_their_pages_have_no_peer_in_validate_mode(fn, device):
    """Validate mode: a NO_OUT row onto a FULL page that already has a peer is a
    MAPPED_PEER fault and leaves that slot alone (as a load-back)."""
    ps = 2
    t = _tables(device, torch.int64, ps)
    t["full_to_swa"][4 * ps:5 * ps] = torch.tensor([6 * ps, 6 * ps + 1])
    out = [torch.zeros(5 * ps + 1, dtype=torch.int64, device=device) for _ in range(2)]
    rows = _rows(ps, device)
    rows[3] = 0
    err = _run(fn, t, out, rows, ps, 5 * ps, validate=True).cpu()
    assert err[ERR_CODES] == FaultCode.MAPPED_PEER and err[ERR_COUNT] == ps
    assert t["full_to_swa"][4 * ps:5 * ps].tolist() == [6 * ps, 6 * ps + 1]


TWO = (FullAttention(24), SlidingWindow(4, 12), SlidingWindow(7, 14))
CHUNKED = (FullAttention(24), SlidingWindow(3, 12), ChunkedLocal(6, 14))


def _config(layers, backend, **kw):
    args = dict(page_size=2, max_reqs=3, max_context_len=16, max_handles=2, layers=layers,
                backend=backend, max_release_rows=6, max_alloc_rows=4, max_step_pages=24,
                max_step_tokens=20)
    args.update(kw)
    return ga.AllocatorConfig(**args)


def _same_tables(a, b):
    ta, tb = a.state.tables(), b.state.tables()
    assert ta.keys() == tb.keys() and "window1_full_to_swa" in ta
    for name in ta:
        torch.testing.assert_close(ta[name].cpu(), tb[name].cpu(), rtol=0, atol=0, msg=name)


@pytest.mark.filterwarnings("ignore:executor='graph' on a CPU device")
@pytest.mark.parametrize("layers", [TWO, CHUNKED], ids=["two_windows", "window_chunked"])
def test_launch_sequence_triton_graph_matches_torch_eager(layers):
    """The random workload on two allocators: the Triton kernels under the graph executor
    (eager on a CPU) with fused steps, and the Torch twins under the eager executor with two
    launches a step: every table, the further pools' included, equal after every
    operation; both audit clean."""
    triton = ga.HybridAllocator(_config(layers, "triton"), executor="graph", fused_step=True)
    twin = ga.HybridAllocator(_config(layers, "torch"), executor="eager", fused_step=False)
    rng = np.random.default_rng(5)
    for _ in range(80):
        random_step([triton, twin], rng)
        _same_tables(triton, twin)
    triton.check()
    assert triton.audit() == [] and twin.audit() == []


def test_an_engines_own_launch_runs_the_sections():
    """``plan()``, the engine's ``launch(i)`` of the buffer, ``mark_submitted``: the further
    pools' sections run inside that launch (the stamp counted once), as in ``run()``."""
    a = ga.HybridAllocator(_config(TWO, "torch", validate=True))
    b = ga.HybridAllocator(_config(TWO, "torch", validate=True))
    rows = [a.admit() for _ in range(2)]
    apply_all([b], lambda x: [x.admit() for _ in range(2)])
    for step in (dict(extend=(rows, [9, 10])), dict(evict_all=True, decode=rows),
                 dict(release=rows[:1], evict_all=True, decode=rows[1:])):
        p = a.plan(**step)
        a.launch(p.buffer_index)
        a.mark_submitted(p)
        b.step(**step)
        _same_tables(a, b)
    a.check()
    assert a.audit() == []


def test_validate_mode_finds_no_fault_on_a_random_workload():
    """Validate mode (per-pool epochs for the duplicate-push check, mapped-peer checks of the
    further pools' rows) on the random workload: no fault, clean audits."""
    a = ga.HybridAllocator(_config(CHUNKED, "torch", validate=True))
    rng = np.random.default_rng(9)
    for _ in range(60):
        random_step([a], rng)
    a.check()
    assert a.audit() == []
