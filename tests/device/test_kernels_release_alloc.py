"""Release and allocation kernels (Triton) against their Torch twins, element for element.

On the CPU the kernels run through the Triton interpreter (one program at a
time, about 2 ms each), so sizes are small: a few requests, a few pages, and
descriptors of 8 release and 4 allocation rows.
"""

import numpy as np
import pytest
import torch
from faults import keep_damage
from triton_cache import n_variants

from graphalloc import (
    AllocatorConfig,
    AllocResult,
    ContractError,
    DeviceFaultError,
    HybridAllocator,
    IntegrityError,
)
from graphalloc.errors import FaultCode
from graphalloc.kernels import (
    allocate_tokens,
    allocate_tokens_torch,
    get_and_clear_swa_pages,
    new_error_word,
    release_pages,
    release_pages_torch,
)
from graphalloc.kernels.abi import (
    AL_FLAGS,
    AL_FULL_POP,
    AL_N_PAGES,
    AL_N_TOKENS,
    AL_OUT,
    AL_REQ,
    AL_RING,
    AL_RING_ADMIT,
    AL_START_POS,
    AL_SWA_POP,
    ERR_CLAIMED,
    ERR_CODE,
    ERR_CODES,
    ERR_COUNT,
    ERR_PAGE,
    ERR_REQ,
    ERR_ROW,
    ERR_STAGE,
    REL_CLEAR,
    REL_FLAGS,
    REL_FULL,
    REL_FULL_PUSH,
    REL_LANE,
    REL_N_PAGES,
    REL_REQ,
    REL_RING_RETURN,
    REL_START_POS,
    REL_SWA,
    REL_SWA_PUSH,
    ROW_WIDTH,
    STAGE_ALLOC,
    STAGE_RELEASE,
)

DTYPES = [torch.int32, torch.int64]


def make_pair(ps, dtype, device, ring=False, **overrides):
    """The same small allocator twice: Torch backend first, Triton second."""
    cfg = dict(page_size=ps, num_full_pages=24, num_swa_pages=12, max_reqs=3,
               max_context_len=8 * ps, sliding_window=2 * ps + 1, index_dtype=dtype,
               device=device, max_release_rows=8, max_alloc_rows=4, max_step_pages=32,
               max_step_tokens=8 * ps + 4, swa_ring_pages=4 if ring else 0)
    cfg.update(overrides)
    return [HybridAllocator(AllocatorConfig(backend=b, **cfg)) for b in ("torch", "triton")]


def assert_same_state(pair, results=(None, None)):
    snaps = [alloc.snapshot() for alloc in pair]
    for name in snaps[0]:
        np.testing.assert_array_equal(np.asarray(snaps[0][name]), np.asarray(snaps[1][name]),
                                      err_msg=f"{name} differs between torch and triton")
    ref, got = results
    if not isinstance(ref, AllocResult):  # None, or a request row from admit()
        assert ref == got
        return
    for field in ("full_slots", "swa_slots"):
        torch.testing.assert_close(getattr(ref, field).cpu(), getattr(got, field).cpu(),
                                   rtol=0, atol=0, msg=f"{field} differs")


def apply_both(pair, op):
    """Run ``op`` on both allocators: both refuse with the same error, or both run."""
    outcomes = []
    for alloc in pair:
        try:
            outcomes.append(("ran", op(alloc)))
        except ContractError as exc:
            outcomes.append(("refused", type(exc)))
    assert outcomes[0][0] == outcomes[1][0], outcomes
    if outcomes[0][0] == "refused":
        assert outcomes[0][1] is outcomes[1][1]
        return False
    assert_same_state(pair, (outcomes[0][1], outcomes[1][1]))
    return True


def random_op(rng, led, ps):
    """A random allocator operation over the (shared) host ledger; may break a contract."""
    live = np.flatnonzero(led.live)
    pick = lambda: rng.choice(live, size=rng.integers(1, len(live) + 1), replace=False)
    kinds = ["admit", "extend", "decode", "step", "evict", "release", "group", "release_extend"]
    weights = np.array([3 * (len(live) < len(led.live)), 3, 2, 3, 1, 1, 1, 1], dtype=float)
    kind = rng.choice(kinds, p=weights / weights.sum()) if len(live) else "admit"
    if kind == "admit":
        return lambda a: a.admit()
    if kind == "extend":
        rows = pick()
        n = rng.integers(1, 2 * ps + 2, size=len(rows))
        return lambda a: a.alloc_extend(rows, n)
    if kind == "decode":
        rows = pick()
        return lambda a: a.alloc_decode(rows)
    if kind == "step":
        rows = pick()
        return lambda a: a.step(evict_all=True, decode=rows)
    if kind == "evict":
        return lambda a: a.evict_window()
    if kind == "release":
        rows = pick()
        return lambda a: a.release(rows)
    row = int(rng.choice(live))

    if kind == "group":
        def group(a):
            with a.free_group():
                a.release([row])
                a.evict_window()
        return group
    others = [r for r in live if r != row]
    if not others:
        return lambda a: a.release([row])
    other = int(rng.choice(others))
    n = int(rng.integers(1, 2 * ps + 2))
    # Pages freed by the release may be popped by the same step.
    return lambda a: a.step(release=[row], extend=([other], [n]))


@pytest.mark.parametrize("ring", [False, True], ids=["pool", "ring"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["i32", "i64"])
@pytest.mark.parametrize("ps", [1, 3, 4, 16])
def test_random_steps_match_twin(ps, dtype, ring, device):
    pair = make_pair(ps, dtype, device, ring=ring)
    rng = np.random.default_rng(1000 * ps + 10 * (dtype == torch.int64) + ring)
    ran = 0
    for _ in range(24):
        ran += apply_both(pair, random_op(rng, pair[0].ledger, ps))
    assert ran >= 12, "too few steps ran; the op mix needs retuning"
    for alloc in pair:
        alloc.check()
        alloc.check_integrity()


def _free_window(snap, pool):
    head, n_free = snap[f"host_{pool}_ring"]
    ring = snap[f"{pool}_free"]
    return ring[(head + np.arange(n_free)) % len(ring)]


@pytest.mark.parametrize("dtype", DTYPES, ids=["i32", "i64"])
@pytest.mark.parametrize("ps", [1, 3])
def test_unmapped_peer_then_sink_pop(ps, dtype, device):
    # Three SWA pages: the release pushes the sink marker to the head of the next pops.
    pair = make_pair(ps, dtype, device, num_full_pages=8, num_swa_pages=3, max_reqs=2,
                     max_context_len=4 * ps, sliding_window=ps)  # (a pool holds a window)
    for alloc in pair:
        r = alloc.admit()
        alloc.alloc_extend([r], [2 * ps + 1])  # three pages in each pool
        rep = int(alloc.req_to_token[r, ps])  # representative of the second page
        page = rep // ps
        alloc.full_to_swa[page * ps:(page + 1) * ps] = 0  # lose the mapping by hand
        alloc.release([r])
    assert_same_state(pair)
    for alloc in pair:
        err = alloc.state.err_buf.cpu().tolist()
        assert err[ERR_CODES] == FaultCode.UNMAPPED_PEER
        assert err[ERR_COUNT] == 1
        assert err[ERR_CLAIMED] == 1 and err[ERR_CODE] == FaultCode.UNMAPPED_PEER
        assert (err[ERR_ROW], err[ERR_REQ], err[ERR_PAGE], err[ERR_STAGE]) == (
            0, 0, page, STAGE_RELEASE)
        window = _free_window(alloc.snapshot(), "swa")
        assert window.tolist().count(0) == 1 and window[1] == 0  # the sink marker, 2nd page
        with pytest.raises(DeviceFaultError):
            alloc.check()
        with pytest.raises(IntegrityError):  # the sink marker in the ring: not a reset
            alloc.reset_faults()
        keep_damage(alloc)  # this test goes on over the damage (recover() would repair it)

    results = []
    for alloc in pair:
        r = alloc.admit()
        results.append(alloc.alloc_extend([r], [2 * ps]))  # pops the marker as page 2
    assert_same_state(pair, results)
    for alloc, res in zip(pair, results, strict=True):
        err = alloc.state.err_buf.cpu().tolist()
        assert err[ERR_CODES] == FaultCode.SINK_POP
        assert err[ERR_COUNT] == ps  # every token of the sink page faults
        assert (err[ERR_CODE], err[ERR_ROW], err[ERR_REQ], err[ERR_PAGE], err[ERR_STAGE]) == (
            FaultCode.SINK_POP, 0, 0, 0, STAGE_ALLOC)
        # The SWA slots of the faulting page point at the sink; its full page is not mapped.
        swa = res.swa_slots.cpu()
        assert (swa[ps:2 * ps] == torch.arange(ps, dtype=swa.dtype)).all()
        full_page = int(res.full_slots[ps]) // ps
        assert (alloc.full_to_swa[full_page * ps:(full_page + 1) * ps] == 0).all()


def _tables(device, dtype, ps, n_reqs=4, n_cols=12, n_full=20, n_swa=10, n_ring=3):
    """Device tables with the scratch entries the twins expect (row / entry past the end)."""
    z = lambda *shape: torch.zeros(*shape, dtype=dtype, device=device)
    return dict(req_to_token=z(n_reqs + 1, n_cols * ps), full_to_swa=z((n_full + 1) * ps),
                full_free=z(n_full + 1), swa_free=z(n_swa + 1), ring_pages=z(n_reqs + 1, n_ring),
                err=new_error_word(device))


def _visible(tables):
    """Every table without its scratch entry (the twins write scratch, the kernels do not)."""
    cut = {"req_to_token", "full_free", "swa_free", "ring_pages", "out_full_slots",
           "out_swa_slots"}
    return {k: (v[:-1] if k in cut else v).cpu() for k, v in tables.items()}


def _assert_tables_equal(a, b, records):
    """Equal tables. The first-error record is checked against ``records`` (the faulting
    rows' records, lowest row first): on a GPU programs race for the claim, so any of them
    may win; the twin and the interpreter give the first."""
    va, vb = _visible(a), _visible(b)
    for name in va:
        if name == "err" and not records:
            assert not va[name].any() and not vb[name].any()
            continue
        if name == "err":
            for err in (va[name], vb[name]):
                assert err[:ERR_CLAIMED].tolist() == va[name][:ERR_CLAIMED].tolist()
                assert err[ERR_CLAIMED:].tolist() in [[1, *rec] for rec in records]
            assert va[name][ERR_CLAIMED:].tolist() == [1, *records[0]]
            if b[name].device.type == "cpu":  # the interpreter runs programs in order
                assert vb[name][ERR_CLAIMED:].tolist() == [1, *records[0]]
            continue
        torch.testing.assert_close(va[name], vb[name], rtol=0, atol=0, msg=f"{name} differs")


@pytest.mark.parametrize("dtype", DTYPES, ids=["i32", "i64"])
@pytest.mark.parametrize("ps", [1, 3, 16])
def test_hand_built_release_rows(ps, dtype, device):
    """Every flag combination, padded rows between real ones, ring wrap-around, unmapped
    peers in two rows, and a lane budget that cuts the last row short."""
    rng = np.random.default_rng(ps)
    n_full, n_swa, n_cols = 20, 14, 12
    ref = _tables(device, dtype, ps, n_cols=n_cols, n_full=n_full, n_swa=n_swa)
    # Requests 0..3 own four disjoint full pages each; nine of them are mapped page-densely.
    pages = rng.permutation(np.arange(1, n_full + 1))[:16].reshape(4, 4)
    for r in range(4):
        slots = (pages[r][:, None] * ps + np.arange(ps)).reshape(-1)
        ref["req_to_token"][r, :len(slots)] = torch.as_tensor(slots)
    mapped = [*pages[0, :3], pages[1, 0], pages[1, 1], pages[1, 3], *pages[3, 1:]]
    for page, swa_page in zip(mapped, rng.permutation(np.arange(1, n_swa + 1))[:len(mapped)],
                              strict=True):
        ref["full_to_swa"][page * ps:(page + 1) * ps] = torch.as_tensor(
            swa_page * ps + np.arange(ps))
    ref["ring_pages"][2] = torch.as_tensor([7, 8, 9])
    rows = np.zeros((8, ROW_WIDTH), dtype=np.int64)
    specs = [  # (row, req, first page, pages, flags)
        (0, 0, 0, 3, REL_SWA | REL_FULL | REL_CLEAR),
        (2, 1, 1, 3, REL_SWA | REL_CLEAR),  # its second page is unmapped
        (3, 2, 0, 3, REL_RING_RETURN),
        (5, 1, 0, 1, REL_FULL),  # keeps its mapping (no CLEAR)
        (6, 3, 0, 4, REL_SWA | REL_FULL | REL_CLEAR),  # unmapped first page; cut by n_lanes
    ]
    lane, swa_push, full_push = 0, n_swa - 2, n_full - 3  # the pushes wrap around
    for row, req, first, n, flags in specs:
        rows[row, [REL_REQ, REL_START_POS, REL_N_PAGES, REL_FLAGS]] = req, first * ps, n, flags
        rows[row, [REL_SWA_PUSH, REL_FULL_PUSH, REL_LANE]] = swa_push, full_push, lane
        if flags & (REL_SWA | REL_RING_RETURN):
            swa_push = (swa_push + n) % n_swa
        if flags & REL_FULL:
            full_push = (full_push + n) % n_full
        lane += n
    n_lanes = lane - 1
    rows = torch.as_tensor(rows, device=device)
    got = {k: v.clone() for k, v in ref.items()}
    kw = dict(page_size=ps, n_full_cap=n_full, n_swa_cap=n_swa, n_lanes=n_lanes)
    release_pages_torch(rows, *ref.values(), **kw)
    release_pages(rows, *got.values(), **kw)
    code, stage = FaultCode.UNMAPPED_PEER, STAGE_RELEASE
    _assert_tables_equal(ref, got, [[code, 2, 1, pages[1][2], stage],
                                    [code, 6, 3, pages[3][0], stage]])
    err = got["err"].cpu().tolist()
    assert err[ERR_CODES] == code and err[ERR_COUNT] == 2


@pytest.mark.parametrize("dtype", DTYPES, ids=["i32", "i64"])
@pytest.mark.parametrize("ps", [1, 4])
def test_hand_built_alloc_rows(ps, dtype, device):
    """Pool and ring rows, a continued partial page, an admission, padded rows, a lane
    budget that cuts the last row short, and sink pops in a token row *and* an admission
    row: the first record is the lowest row's (the twin used to prefer admissions)."""
    n_full, n_swa, n_ring = 20, 10, 3
    ref = _tables(device, dtype, ps, n_full=n_full, n_swa=n_swa, n_ring=n_ring)
    ref["full_free"][:-1] = torch.arange(1, n_full + 1)
    ref["swa_free"][:-1] = torch.arange(1, n_swa + 1)
    ref["swa_free"][6] = 0  # the sink marker, popped by the admission row
    ref["full_free"][3] = 0  # ... and by the first token row's second new page
    # Request 0 has 1 token (pool): its page 20 continues; request 2 is in ring mode.
    ref["req_to_token"][0, 0] = 20 * ps
    ref["full_to_swa"][20 * ps:21 * ps] = torch.arange(5 * ps, 6 * ps)
    ref["ring_pages"][2] = torch.tensor([4, 5, 6])
    rows = np.zeros((7, ROW_WIDTH), dtype=np.int64)
    n0, n2 = 3 * ps, 2 * ps + 1
    rows[1, [AL_REQ, AL_START_POS, AL_N_TOKENS, AL_FULL_POP, AL_SWA_POP, AL_OUT, AL_N_PAGES]] = (
        0, 1, n0, 2, 8, 0, -(-(1 + n0) // ps) - 1)
    rows[3, [AL_REQ, AL_START_POS, AL_N_TOKENS, AL_FULL_POP, AL_OUT, AL_FLAGS]] = (
        2, 0, n2, 8, n0, AL_RING)
    rows[4, [AL_REQ, AL_SWA_POP, AL_FLAGS, AL_N_PAGES]] = 3, 5, AL_RING_ADMIT, n_ring
    rows[5, [AL_REQ, AL_START_POS, AL_N_TOKENS, AL_FULL_POP, AL_SWA_POP, AL_OUT]] = (
        1, 0, ps, 14, 2, n0 + n2)
    n_lanes = n0 + n2 + ps - 1  # the last row loses its last token (ps == 1: its page)
    rows = torch.as_tensor(rows, device=device)
    z = lambda: torch.zeros(n_lanes + 1, dtype=dtype, device=device)
    ref = {**{k: v for k, v in ref.items() if k != "err"}, "out_full_slots": z(),
           "out_swa_slots": z(), "err": ref["err"]}
    got = {k: v.clone() for k, v in ref.items()}
    kw = dict(page_size=ps, n_full_cap=n_full, n_swa_cap=n_swa, n_lanes=n_lanes)
    allocate_tokens_torch(rows, *ref.values(), **kw)
    allocate_tokens(rows, *got.values(), **kw)
    code, stage = FaultCode.SINK_POP, STAGE_ALLOC
    _assert_tables_equal(ref, got, [[code, 1, 0, 0, stage], [code, 4, 3, 0, stage]])
    err = got["err"].cpu().tolist()
    assert err[ERR_CODES] == code and err[ERR_COUNT] == ps + 1


def test_empty_descriptor_launches_nothing(device):
    t = _tables(device, torch.int64, 2)
    rows = torch.zeros((0, ROW_WIDTH), dtype=torch.int64, device=device)
    before = {k: v.clone() for k, v in t.items()}
    release_pages(rows, *t.values(), page_size=2, n_full_cap=20, n_swa_cap=10, n_lanes=4)
    _assert_tables_equal(before, t, [])


# ---- compile count (GPU): nothing new is compiled mid-serving ----------------------------

@pytest.mark.cuda
def test_no_new_variant_mid_serving(device):
    from graphalloc.kernels.allocate import _allocate_kernel
    from graphalloc.kernels.get_and_clear import _get_and_clear_kernel
    from graphalloc.kernels.release import _release_kernel

    kernels = (_release_kernel, _allocate_kernel, _get_and_clear_kernel)
    if any(n_variants(k) is None for k in kernels):
        pytest.skip("this Triton keeps no per-device kernel cache to count")
    ps = 16
    (alloc,) = [HybridAllocator(AllocatorConfig(
        page_size=ps, num_full_pages=64, num_swa_pages=32, max_reqs=4, max_context_len=16 * ps,
        sliding_window=2 * ps + 1, device=device, backend="triton", max_release_rows=12,
        max_alloc_rows=4))]
    f2s = torch.zeros(65 * ps, dtype=torch.int64, device=device)
    reps = torch.arange(1, 9, device=device) * ps
    # Warm-up: one of each kernel (validation off, as in serving).
    r = alloc.admit()
    alloc.alloc_extend([r], [3 * ps + 5])
    alloc.step(evict_all=True, decode=[r])
    alloc.release([r])
    get_and_clear_swa_pages(reps, f2s, ps)
    torch.cuda.synchronize()
    warm = [n_variants(k) for k in kernels]

    # Other page counts, mid-page starts, more or fewer padded rows, both descriptor buffers.
    rows = [alloc.admit() for _ in range(3)]
    alloc.alloc_extend(rows, [1, ps + 3, 5 * ps])
    for _ in range(3):
        alloc.step(evict_all=True, decode=rows)
    alloc.alloc_extend(rows[:1], [2 * ps + 7])
    alloc.step(release=rows[1:2], evict_all=True, decode=rows[2:])
    alloc.release([rows[0], rows[2]])
    # Other counts, strides and start offsets (alignments) of the representatives.
    buf = torch.arange(1, 200, device=device) * ps
    for view in (buf[:1], buf[3:40:3], buf[1:61], buf[5:6]):
        get_and_clear_swa_pages(view, f2s, ps)
    torch.cuda.synchronize()
    alloc.check()
    assert [n_variants(k) for k in kernels] == warm
