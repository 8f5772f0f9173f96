"""get_and_clear_swa_pages: Triton (interpreter on the CPU) vs its Torch twin vs a numpy model."""

import numpy as np
import pytest
import torch

from graphalloc.errors import OverlapError, PositionError
from graphalloc.kernels import get_and_clear_swa_pages, get_and_clear_swa_pages_torch

IMPLS = {"triton": get_and_clear_swa_pages, "torch": get_and_clear_swa_pages_torch}
N_FULL, N_SWA = 12, 16


def page_dense_mapping(ps, dtype, device, mapped_pages, rng):
    """``full_to_swa`` over pages 0..N_FULL with ``mapped_pages`` mapped to distinct SWA pages."""
    f2s = np.zeros((N_FULL + 1) * ps, dtype=np.int64)
    swa_pages = rng.permutation(np.arange(1, N_SWA + 1))[:len(mapped_pages)]
    for page, swa_page in zip(mapped_pages, swa_pages, strict=True):
        f2s[page * ps:(page + 1) * ps] = swa_page * ps + np.arange(ps)
    return torch.as_tensor(f2s, dtype=dtype, device=device)


def strided(values, stride, dtype, device, offset=1):
    """``values`` as a 1-D view with the given element stride, starting mid-buffer."""
    buf = torch.full((offset + len(values) * stride,), -7, dtype=dtype, device=device)
    view = buf[offset::stride][:len(values)]
    view.copy_(torch.as_tensor(values, dtype=dtype))
    return view


def model(reps, f2s, ps):
    """Independent numpy model: (swa_pages, mapped, valid, mapping after)."""
    f2s = f2s.copy()
    peer = f2s[reps]
    mapped = peer > 0
    swa = np.where(mapped, peer // ps, 0)
    valid = mapped.copy()
    for i, rep in enumerate(reps):
        page = f2s[rep // ps * ps:(rep // ps + 1) * ps]
        expect = swa[i] * ps + np.arange(len(page))
        valid[i] &= page[0] != 0 and bool(((page == 0) | (page == expect)).all())
    for i in range(len(reps)):
        if mapped[i] and ((swa == swa[i]) & mapped).sum() > 1:
            valid[i] = False
    for rep in reps:
        f2s[rep // ps * ps:(rep // ps + 1) * ps] = 0
    return swa, mapped, valid, f2s


def run_both(reps, f2s, ps, validate):
    """Each implementation on its own copy of the mapping; results checked equal."""
    outs = {}
    for name, fn in IMPLS.items():
        mapping = f2s.clone()
        outs[name] = (fn(reps, mapping, ps, validate=validate), mapping)
    (ref, ref_map), (got, got_map) = outs["torch"], outs["triton"]
    assert len(ref) == len(got) == (3 if validate else 2)
    for a, b in zip(ref, got, strict=True):
        assert a.dtype == b.dtype and a.device == b.device
        torch.testing.assert_close(a.cpu(), b.cpu(), rtol=0, atol=0)
    assert ref[0].dtype == f2s.dtype and ref[1].dtype == torch.bool
    torch.testing.assert_close(ref_map.cpu(), got_map.cpu(), rtol=0, atol=0)
    return ref, ref_map


@pytest.mark.parametrize("validate", [False, True], ids=["fast", "validate"])
@pytest.mark.parametrize("stride", [1, 3])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
@pytest.mark.parametrize("ps", [1, 3, 4, 16])
def test_matches_twin_and_model(ps, dtype, stride, validate, device):
    rng = np.random.default_rng(ps * 7 + stride)
    mapped_pages = [1, 2, 4, 5, 7, 8, 10, N_FULL]  # the last page ends the tensor
    f2s = page_dense_mapping(ps, dtype, device, mapped_pages, rng)
    freed = np.array([N_FULL, 2, 3, 7, 10, 5, 1])  # page 3 is unmapped
    reps = freed * ps + rng.integers(0, ps, size=len(freed))  # any slot stands for its page
    other = torch.int64 if dtype == torch.int32 else torch.int32
    reps_t = strided(reps, stride, dtype if stride == 1 else other, device)
    out, after = run_both(reps_t, f2s, ps, validate)
    swa, mapped, valid, f2s_after = model(reps, f2s.cpu().numpy().astype(np.int64), ps)
    np.testing.assert_array_equal(out[0].cpu().numpy(), swa)
    np.testing.assert_array_equal(out[1].cpu().numpy(), mapped)
    np.testing.assert_array_equal(after.cpu().numpy(), f2s_after)
    assert mapped.tolist() == [True, True, False, True, True, True, True]
    if validate:
        np.testing.assert_array_equal(out[2].cpu().numpy(), valid)
        assert valid.tolist() == mapped.tolist()


def test_many_blocks_and_tail_page_cut_short(device):
    """More representatives than one program's block, and a mapping whose last page is
    cut short by the tensor's end (its missing slots are never touched)."""
    ps, n_pages = 16, 300
    rng = np.random.default_rng(3)
    f2s = np.zeros(n_pages * ps - 5, dtype=np.int64)
    swa_pages = rng.permutation(np.arange(1, n_pages + 1))
    for page in range(1, n_pages):
        width = min(ps, len(f2s) - page * ps)
        f2s[page * ps:page * ps + width] = swa_pages[page] * ps + np.arange(width)
    pages = np.append(rng.permutation(np.arange(1, n_pages - 1))[:199], n_pages - 1)
    reps = pages * ps + rng.integers(0, ps - 5, size=len(pages))
    f2s_t = torch.as_tensor(f2s, device=device)
    out, after = run_both(torch.as_tensor(reps, device=device), f2s_t, ps, True)
    swa, mapped, valid, f2s_after = model(reps, f2s, ps)
    np.testing.assert_array_equal(out[2].cpu().numpy(), valid)
    assert valid.all()
    np.testing.assert_array_equal(after.cpu().numpy(), f2s_after)


@pytest.mark.parametrize("ps", [3, 16])
def test_validation_flags_bad_pages(ps, device):
    rng = np.random.default_rng(ps)
    f2s = page_dense_mapping(ps, torch.int64, device, [1, 2, 3, 4, 5, 6], rng)
    base = lambda page: page * ps
    swa_of = lambda page: int(f2s[base(page)]) // ps
    f2s[base(1)] = 0  # first slot unmapped, the others mapped (the rep is another slot)
    f2s[base(2) + ps - 1] = (swa_of(3) * ps) + ps - 1  # last slot maps into another SWA page
    f2s[base(4):base(5)] = f2s[base(5):base(6)]  # pages 4 and 5 share one SWA page
    f2s[base(6) + 1] = swa_of(6) * ps  # a slot at the wrong in-page offset
    reps = torch.tensor([base(1) + 1, base(2), base(3) + 2, base(4) + 1, base(5), base(6)],
                        device=device)
    (swa, mapped, valid), after = run_both(reps, f2s, ps, True)
    assert mapped.tolist() == [True] * 6
    assert valid.tolist() == [False, False, True, False, False, False]
    assert (after[base(1):base(7)] == 0).all()  # cleared whole, valid or not
    assert swa[3] == swa[4]


@pytest.mark.parametrize("impl", list(IMPLS))
def test_validation_refuses_before_touching(impl, device):
    ps = 4
    f2s = page_dense_mapping(ps, torch.int32, device, [1, 2, 3], np.random.default_rng(0))
    before = f2s.clone()
    fn = IMPLS[impl]
    with pytest.raises(OverlapError, match="full page 2"):
        fn(torch.tensor([ps, 2 * ps + 3, 2 * ps], device=device), f2s, ps, validate=True)
    assert torch.equal(f2s, before)
    for bad in (f2s.numel(), -1):
        with pytest.raises(PositionError):
            fn(torch.tensor([ps, bad], device=device), f2s, ps, validate=True)
        assert torch.equal(f2s, before)


@pytest.mark.parametrize("validate", [False, True])
@pytest.mark.parametrize("impl", list(IMPLS))
def test_empty_input(impl, validate, device):
    f2s = torch.arange(8, dtype=torch.int64, device=device)
    out = IMPLS[impl](torch.zeros(0, dtype=torch.int32, device=device), f2s, 2,
                      validate=validate)
    assert len(out) == (3 if validate else 2)
    assert all(t.shape == (0,) for t in out)
    assert out[0].dtype == torch.int64 and out[1].dtype == torch.bool
    assert torch.equal(f2s, torch.arange(8, dtype=torch.int64, device=device))
