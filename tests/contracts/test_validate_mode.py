"""Validate mode: each device-side check triggered by a hand-made corruption.

Every scenario runs on a Torch-backend and a Triton-backend allocator (the
Triton interpreter on the CPU) with ``validate=True``; both must record the same
fault bits and count, and leave identical tables (the epoch stamps included).
The first record is equal too where the interpreter runs programs in order; on
a GPU programs race for it (and two lanes freeing one page race for which one
is the duplicate), so there it must be one of the candidates. With
``validate=False`` the same corruptions record no validation fault. Sizes are
tiny: every Triton program costs ~2 ms in the interpreter.
"""

import numpy as np
import pytest
import torch

from graphalloc import AllocatorConfig, HybridAllocator, TensorSpecError
from graphalloc.errors import FaultCode
from graphalloc.kernels import release_pages, release_pages_torch
from graphalloc.kernels.abi import (
    ERR_CLAIMED,
    ERR_CODE,
    ERR_CODES,
    ERR_COUNT,
    ERR_PAGE,
    ERR_REQ,
    ERR_ROW,
    ERR_STAGE,
    REL_CLEAR,
    REL_EPOCH,
    REL_FLAGS,
    REL_FULL,
    REL_FULL_PUSH,
    REL_LANE,
    REL_N_PAGES,
    REL_REQ,
    REL_START_POS,
    REL_SWA,
    REL_SWA_PUSH,
    ROW_WIDTH,
    STAGE_ALLOC,
    STAGE_RELEASE,
)
from graphalloc.kernels.error_word import new_error_word

F = FaultCode
VALIDATION_BITS = F.NOT_PAGE_DENSE | F.OUT_OF_RANGE | F.DUPLICATE_FREE


def make_pair(ps, device, *, validate=True, ring=False, **overrides):
    cfg = dict(page_size=ps, num_full_pages=24, num_swa_pages=12, max_reqs=3,
               max_context_len=8 * ps, sliding_window=2 * ps + 1, device=device,
               max_release_rows=8, max_alloc_rows=4, max_step_pages=32,
               max_step_tokens=8 * ps + 4, swa_ring_pages=4 if ring else 0, validate=validate)
    cfg.update(overrides)
    return [HybridAllocator(AllocatorConfig(backend=b, **cfg)) for b in ("torch", "triton")]


def err_of(alloc):
    return alloc.state.err_buf.cpu().tolist()


def assert_pair_equal(pair, candidates=None):
    """Same tables, epoch stamps and error word on both backends. ``candidates`` (first
    records ``[code, row, req, page]``, the one the twin and the interpreter give first):
    on a GPU the Triton record may be any of them."""
    snaps = [alloc.snapshot() for alloc in pair]
    racy = candidates is not None and pair[1].config.device.type == "cuda"
    for name in snaps[0]:
        a, b = np.asarray(snaps[0][name]), np.asarray(snaps[1][name])
        if name == "err" and racy:
            a, b = a[:ERR_CLAIMED], b[:ERR_CLAIMED]
        np.testing.assert_array_equal(a, b, err_msg=f"{name} differs between torch and triton")
    torch.testing.assert_close(pair[0].state.swa_epoch_buf.cpu(),
                               pair[1].state.swa_epoch_buf.cpu(), rtol=0, atol=0)
    if candidates is not None:
        stage = int(snaps[0]["err"][ERR_STAGE])
        assert err_of(pair[0])[ERR_CLAIMED:ERR_STAGE] == [1, *candidates[0]]
        assert err_of(pair[1])[ERR_CLAIMED + 1:ERR_STAGE] in [list(c) for c in candidates]
        assert err_of(pair[1])[ERR_STAGE] == stage


def pages_of(alloc, r, n_pages):
    ps = alloc.config.page_size
    return [int(alloc.req_to_token[r, j * ps]) // ps for j in range(n_pages)]


def map_page(alloc, full_page, swa_page):
    """Write a page-dense mapping of ``full_page`` onto ``swa_page`` by hand."""
    ps = alloc.config.page_size
    alloc.full_to_swa[full_page * ps:(full_page + 1) * ps] = torch.arange(
        swa_page * ps, (swa_page + 1) * ps, dtype=alloc.config.index_dtype)


def free_window(alloc, pool):
    ring = getattr(alloc.ledger, pool)
    table = getattr(alloc.state, f"{pool}_free").cpu().numpy()
    return table[(ring.head + np.arange(ring.n_free)) % ring.capacity]


# ---- release-side checks -------------------------------------------------------------------
@pytest.mark.parametrize("via", ["evict", "release"])
@pytest.mark.parametrize("ps", [3, 4])
def test_not_page_dense(ps, via, device):
    pair = make_pair(ps, device)
    for alloc in pair:
        r = alloc.admit()
        alloc.alloc_extend([r], [3 * ps + 1])  # four pages
        page = pages_of(alloc, r, 2)[1]
        alloc.full_to_swa[page * ps + ps - 1] += 1  # the last slot of page 1 points elsewhere
        if via == "evict":
            alloc.advance_frontier([r], [2 * ps])  # frees the SWA pages of pages 0 and 1
        else:
            alloc.release([r])
        err = err_of(alloc)
        assert err[ERR_CODES] == F.NOT_PAGE_DENSE and err[ERR_COUNT] == 1
        assert err[ERR_CLAIMED:] == [1, F.NOT_PAGE_DENSE, 0, r, page, STAGE_RELEASE]
    assert_pair_equal(pair)


@pytest.mark.parametrize("ps", [1, 4])
def test_representative_out_of_range(ps, device):
    """Representatives past full_to_swa and in the sink page: masked lanes that touch
    nothing through the representative and push the sink marker to both rings."""
    pair = make_pair(ps, device)
    for alloc in pair:
        r = alloc.admit()
        alloc.alloc_extend([r], [3 * ps])
        pages = pages_of(alloc, r, 3)
        before = alloc.full_to_swa.clone()
        n_slots = alloc.config.num_full_slots
        alloc.state.req_to_token_buf[r, ps] = n_slots + 5 * ps  # far past the mapping
        alloc.state.req_to_token_buf[r, 2 * ps] = ps - 1  # in the sink page
        alloc.release([r])
        err = err_of(alloc)
        assert err[ERR_CODES] == F.OUT_OF_RANGE and err[ERR_COUNT] == 2
        assert err[ERR_CLAIMED:] == [1, F.OUT_OF_RANGE, 0, r, n_slots // ps + 5, STAGE_RELEASE]
        # Pages 1 and 2 were neither cleared nor pushed; the sink marker took their places.
        for page in pages[1:]:
            torch.testing.assert_close(alloc.full_to_swa[page * ps:(page + 1) * ps],
                                       before[page * ps:(page + 1) * ps], rtol=0, atol=0)
        assert (alloc.full_to_swa[pages[0] * ps:(pages[0] + 1) * ps] == 0).all()
        for pool in ("full", "swa"):
            assert free_window(alloc, pool)[-3:].tolist().count(0) == 2
    assert_pair_equal(pair)


@pytest.mark.parametrize("ps", [1, 3])
def test_swa_page_out_of_range(ps, device):
    pair = make_pair(ps, device)
    for alloc in pair:
        r = alloc.admit()
        alloc.alloc_extend([r], [2 * ps])
        pages = pages_of(alloc, r, 2)
        map_page(alloc, pages[1], alloc.config.num_swa_pages + 3)  # dense, but no such page
        alloc.release([r])
        err = err_of(alloc)
        assert err[ERR_CODES] == F.OUT_OF_RANGE and err[ERR_COUNT] == 1
        assert err[ERR_CLAIMED:] == [1, F.OUT_OF_RANGE, 0, r, pages[1], STAGE_RELEASE]
        swa_pushed = free_window(alloc, "swa")[-2:]
        assert swa_pushed[1] == 0 and swa_pushed[0] > 0  # the sink marker for the bad page
        assert sorted(free_window(alloc, "full")[-2:].tolist()) == sorted(pages)
        assert not alloc.full_to_swa.any()  # both pages cleared as usual
    assert_pair_equal(pair)


@pytest.mark.parametrize("ps", [1, 4])
def test_duplicate_free_in_one_step(ps, device):
    """Three full pages of two requests mapped onto one SWA page: the second and third
    frees are duplicates (counted once each); the first free is not."""
    pair = make_pair(ps, device)
    for alloc in pair:
        ra, rb = alloc.admit(), alloc.admit()
        alloc.alloc_extend([ra, rb], [ps, 3 * ps])
        (pa,), pb = pages_of(alloc, ra, 1), pages_of(alloc, rb, 3)
        shared = int(alloc.full_to_swa[pa * ps]) // ps
        for page in (pb[0], pb[2]):
            map_page(alloc, page, shared)
        alloc.release([ra, rb])
        err = err_of(alloc)
        assert err[ERR_CODES] == F.DUPLICATE_FREE and err[ERR_COUNT] == 2
        assert int(alloc.state.swa_epoch_buf[shared]) == alloc.steps_run  # this step's epoch
    # In program order the second and third frees are the duplicates; on a GPU any two are.
    dup = F.DUPLICATE_FREE
    assert_pair_equal(pair, [(dup, 1, rb, pb[0]), (dup, 0, ra, pa), (dup, 1, rb, pb[2])])


def test_same_page_in_two_steps_is_not_a_duplicate_of_this_step(device):
    """The check is per step (epochs differ): a page freed again in a later step is for
    audit() to find, not for the device check."""
    ps = 2
    pair = make_pair(ps, device)
    for alloc in pair:
        ra, rb = alloc.admit(), alloc.admit()
        alloc.alloc_extend([ra, rb], [ps, ps])
        (pa,), (pb,) = pages_of(alloc, ra, 1), pages_of(alloc, rb, 1)
        map_page(alloc, pb, int(alloc.full_to_swa[pa * ps]) // ps)
        alloc.release([ra])
        alloc.release([rb])
        assert err_of(alloc)[ERR_CODES] == 0
    assert_pair_equal(pair)


# ---- allocation-side checks ----------------------------------------------------------------
@pytest.mark.parametrize("pool", ["full", "swa"])
@pytest.mark.parametrize("ps", [1, 3])
def test_popped_page_out_of_range(ps, pool, device):
    """A bad id at the second pop of a ring: the page's tokens point at the sink page and
    no mapping is written for it; every token of it faults once."""
    pair = make_pair(ps, device)
    for alloc in pair:
        cap = getattr(alloc.config, f"num_{pool}_pages")
        ring = getattr(alloc.ledger, pool)
        bad = cap + 7 if pool == "full" else -3
        getattr(alloc.state, f"{pool}_free_buf")[(ring.head + 1) % cap] = bad
        r = alloc.admit()
        res = alloc.alloc_extend([r], [2 * ps + 1])  # three pages: the second is bad
        err = err_of(alloc)
        assert err[ERR_CODES] == F.OUT_OF_RANGE and err[ERR_COUNT] == ps
        assert err[ERR_CLAIMED:] == [1, F.OUT_OF_RANGE, 0, r, bad, STAGE_ALLOC]
        slots = (res.full_slots if pool == "full" else res.swa_slots).cpu()
        assert (slots[ps:2 * ps] == torch.arange(ps, dtype=slots.dtype)).all()  # the sink
        other = (res.swa_slots if pool == "full" else res.full_slots).cpu()
        assert (other[ps:2 * ps] >= ps).all()  # the other pool's page is real ...
        if pool == "swa":  # ... but its full page is not mapped (no peer to map to)
            page = int(res.full_slots[ps]) // ps
            assert not alloc.full_to_swa[page * ps:(page + 1) * ps].any()
        mapped = int((alloc.full_to_swa != 0).sum())
        assert mapped == 2 * ps  # the two good pages only
    assert_pair_equal(pair)


def test_sink_and_out_of_range_in_one_lane_count_once(device):
    ps = 2
    pair = make_pair(ps, device)
    for alloc in pair:
        alloc.state.full_free_buf[0] = 0  # the sink marker ...
        alloc.state.swa_free_buf[0] = 99  # ... and a bad SWA id, popped by the same page
        r = alloc.admit()
        alloc.alloc_extend([r], [ps])
        err = err_of(alloc)
        assert err[ERR_CODES] == F.SINK_POP | F.OUT_OF_RANGE and err[ERR_COUNT] == ps
        assert err[ERR_CODE] == F.SINK_POP and err[ERR_PAGE] == 0  # the lowest bit, FULL pop
        assert not alloc.full_to_swa.any()
    assert_pair_equal(pair)


def test_ring_admission_pops_out_of_range(device):
    ps = 2
    pair = make_pair(ps, device, ring=True, num_swa_pages=16)
    for alloc in pair:
        alloc.state.swa_free_buf[1] = 17  # the second ring page of the first admission
        r = alloc.admit()
        err = err_of(alloc)
        assert err[ERR_CODES] == F.OUT_OF_RANGE and err[ERR_COUNT] == 1
        assert (err[ERR_CODE], err[ERR_ROW], err[ERR_REQ], err[ERR_PAGE], err[ERR_STAGE]) == (
            F.OUT_OF_RANGE, 0, r, 17, STAGE_ALLOC)
        assert alloc.state.ring_pages[r].tolist() == [1, 0, 3, 4]  # the sink in its place
    assert_pair_equal(pair)


# ---- validate=False: nothing of the above is checked ---------------------------------------
def test_validate_off_records_no_validation_fault(device):
    """The corruptions that stay in bounds (non-dense page, shared SWA page, out-of-range SWA
    page in the mapping) go unrecorded without validate; the kernels behave as before."""
    ps = 3
    pair = make_pair(ps, device, validate=False)
    for alloc in pair:
        ra, rb = alloc.admit(), alloc.admit()
        alloc.alloc_extend([ra, rb], [2 * ps, 2 * ps])
        pa, pb = pages_of(alloc, ra, 2), pages_of(alloc, rb, 2)
        alloc.full_to_swa[pa[1] * ps + 1] += 1
        map_page(alloc, pb[0], int(alloc.full_to_swa[pa[0] * ps]) // ps)
        alloc.release([ra, rb])
        assert err_of(alloc)[ERR_CODES] == 0
        assert not alloc.state.swa_epoch_buf.any()  # never touched
    assert_pair_equal(pair)


# ---- the kernel against its twin on hand-built rows ------------------------------------------
def _tables(device, ps, n_reqs=4, n_cols=8, n_full=20, n_swa=10):
    z = lambda *shape: torch.zeros(*shape, dtype=torch.int64, device=device)
    return dict(req_to_token=z(n_reqs + 1, n_cols * ps), full_to_swa=z((n_full + 1) * ps),
                full_free=z(n_full + 1), swa_free=z(n_swa + 1), ring_pages=z(n_reqs + 1, 2),
                err=new_error_word(device))


@pytest.mark.parametrize("ps", [1, 3])
def test_hand_built_rows_every_check(ps, device):
    """Every kind of fault spread over rows and over lanes of one row, a page stamped by an
    earlier launch of the same epoch, and a row with epoch 0 (not checked): the lowest
    row's lowest faulting lane claims the record with its lowest bit."""
    n_full, n_swa = 20, 16
    t = _tables(device, ps, n_full=n_full, n_swa=n_swa)
    # Request r owns full pages 1 + 4r .. 4 + 4r.
    for r in range(4):
        for j in range(4):
            page = 1 + 4 * r + j
            t["req_to_token"][r, j * ps:(j + 1) * ps] = page * ps + torch.arange(ps)
    swa_of = {1: 1, 2: 2, 3: 3, 4: 4,  # page 4 is made not dense below (ps > 1)
              5: 5, 6: 5, 7: 6, 8: 20,  # 6 frees SWA page 5 again; 20 > n_swa
              9: 7, 10: 8, 11: 7,  # 11 frees SWA page 7 again; page 12 is unmapped
              13: 9, 15: 9, 16: 6}  # 13: page 9 was stamped before; 15, 16: epoch 0
    for page, swa in swa_of.items():
        t["full_to_swa"][page * ps:(page + 1) * ps] = swa * ps + torch.arange(ps)
    if ps > 1:
        t["full_to_swa"][4 * ps + ps - 1] = 0
    t["req_to_token"][3, ps] = (n_full + 1) * ps  # page 14's representative: past the end
    epochs = torch.zeros(n_swa + 1, dtype=torch.int64, device=device)
    epochs[9] = 5
    rows = np.zeros((6, ROW_WIDTH), dtype=np.int64)  # the last row is padding
    flags = REL_SWA | REL_FULL | REL_CLEAR
    lane = 0
    for row, (req, first, n, epoch) in enumerate(
            [(0, 0, 4, 5), (1, 0, 4, 5), (2, 0, 4, 5), (3, 0, 2, 5), (3, 2, 2, 0)]):
        rows[row, [REL_REQ, REL_START_POS, REL_N_PAGES, REL_FLAGS]] = req, first * ps, n, flags
        rows[row, [REL_SWA_PUSH, REL_FULL_PUSH, REL_LANE, REL_EPOCH]] = lane, lane, lane, epoch
        lane += n
    rows = torch.as_tensor(rows, device=device)
    got = {k: v.clone() for k, v in t.items()}
    got_epochs = epochs.clone()
    kw = dict(page_size=ps, n_full_cap=n_full, n_swa_cap=n_swa, n_lanes=lane, validate=True)
    full_epochs = [torch.zeros(n_full + 1, dtype=torch.int64, device=device) for _ in range(2)]
    release_pages_torch(rows, *t.values(), epochs=(full_epochs[0], epochs), **kw)
    release_pages(rows, *got.values(), epochs=(full_epochs[1], got_epochs), **kw)
    for name in t:
        cut = slice(None) if name == "full_to_swa" else slice(0, ERR_CLAIMED) if (
            name == "err") else slice(0, -1)
        torch.testing.assert_close(t[name][cut].cpu(), got[name][cut].cpu(), rtol=0, atol=0,
                                   msg=f"{name} differs")
    torch.testing.assert_close(epochs.cpu(), got_epochs.cpu(), rtol=0, atol=0)
    # Faulting lanes: 4 (ps > 1), 6, 8, 11, 12, 13, 14; never 15 or 16 (epoch 0). On a GPU
    # pages 5 / 6 and 9 / 11 race for which one is the duplicate, and rows for the record.
    assert got["err"][ERR_CODES] == (F.UNMAPPED_PEER | F.OUT_OF_RANGE | F.DUPLICATE_FREE
                                     | F.NOT_PAGE_DENSE * (ps > 1))
    assert got["err"][ERR_COUNT] == 6 + (ps > 1)
    dup = F.DUPLICATE_FREE
    first = [F.NOT_PAGE_DENSE, 0, 0, 4] if ps > 1 else [dup, 1, 1, 6]
    assert t["err"][ERR_CLAIMED:].tolist() == [1, *first, STAGE_RELEASE]  # the twin
    record = got["err"][ERR_CLAIMED:].tolist()
    if got["err"].device.type == "cpu":  # the interpreter: programs in order
        assert record == [1, *first, STAGE_RELEASE]
    else:
        assert record[1:5] in [first, [dup, 1, 1, 5], [dup, 1, 1, 6], [dup, 2, 2, 9],
                               [dup, 2, 2, 11], [dup, 3, 3, 13]]
    assert epochs.tolist() == [0] + [5] * 9 + [0] * 7
    swa_pushed = got["swa_free"][:lane].tolist()
    assert swa_pushed[7] == 0 and swa_pushed[13] == 0  # page 8's bad peer, page 14's bad rep
    assert got["full_free"][:lane].tolist()[13] == 0 and not got["err"][ERR_STAGE]


def test_validate_needs_the_epoch_table(device):
    t = _tables(device, 2)
    rows = torch.zeros((1, ROW_WIDTH), dtype=torch.int64, device=device)
    for fn in (release_pages, release_pages_torch):
        with pytest.raises(TensorSpecError, match="epochs"):
            fn(rows, *t.values(), page_size=2, n_full_cap=20, n_swa_cap=10, n_lanes=4,
               validate=True)
