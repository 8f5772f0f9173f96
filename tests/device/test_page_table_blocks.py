"""The page-table kernel's page blocks against its Torch twin, launch after launch.

The kernel cuts each lane's page columns into blocks and lets a fixed grid of programs walk
the blocks of all lanes; it zeroes only the block-table columns that the previous launch's
ranges held and the new ones do not (``bt_ranges``). The twin writes every row whole. Here
both run a series of launches on random lane rows -- lanes of many blocks (the block shrunk
to 16 columns), empty lanes between full ones, padded lanes at the end, empty SWA ranges,
lanes that change request or shrink from one launch to the next, entries past a buffer's
capacity -- over every combination of forms and layers, starting from stale buffers, and
every output (and ``bt_ranges``) must be equal after every launch. The Triton kernel runs in
the interpreter on a CPU (TRITON_INTERPRET=1, set by the suite's conftest) and compiled on a
GPU (the ``device`` fixture: the GPU run's on_device phase).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from graphalloc.kernels import page_table
from graphalloc.kernels.abi import (
    PT_END_PAGE,
    PT_FULL_OFF,
    PT_LAST_LEN,
    PT_REQ,
    PT_SEQ_LEN,
    PT_SWA_FIRST,
    PT_SWA_OFF,
    PT_WINDOW_START,
    ROW_WIDTH,
)

PS, N_REQS, WIDTH = 2, 6, 40  # page size, req_to_token rows, block-table width (columns)


def random_rows(rng, n_lanes: int, swa_only: bool) -> torch.Tensor:
    """Lane rows as the planner writes them: offsets are exclusive prefix sums of the lanes'
    FULL and SWA page counts, padded lanes (end 0) carry the running totals."""
    rows = np.zeros((n_lanes, ROW_WIDTH), dtype=np.int64)
    n_real = int(rng.integers(0, n_lanes + 1))
    foff = soff = 0
    for i in range(n_lanes):
        L = 0 if i >= n_real or rng.random() < 0.15 else int(rng.integers(1, WIDTH * PS + 1))
        end = -(-L // PS)
        first = min(end, int(rng.integers(0, end + 1)) if rng.random() < 0.8 else end)
        rows[i, PT_REQ] = rng.integers(0, N_REQS) if L else 0
        rows[i, PT_SEQ_LEN], rows[i, PT_END_PAGE], rows[i, PT_SWA_FIRST] = L, end, first
        rows[i, PT_FULL_OFF], rows[i, PT_SWA_OFF] = foff, soff
        rows[i, PT_LAST_LEN] = L - (end - 1) * PS if L else 0
        rows[i, PT_WINDOW_START] = first * PS
        foff += end
        soff += end - first
    return torch.from_numpy(rows)


def outputs(forms, layers, n_lanes: int, cap: int, device) -> dict:
    out = {}
    for layer in layers:
        if "csr" in forms:
            out[f"{layer}_csr"] = (torch.full((n_lanes + 1,), -7, dtype=torch.int32),
                                   torch.full((cap,), -7, dtype=torch.int32),
                                   torch.full((n_lanes,), -7, dtype=torch.int32))
        if "block_table" in forms:
            out[f"{layer}_block_table"] = torch.full((n_lanes, WIDTH), -7, dtype=torch.int32)
    if "block_table" in forms:
        out["seq_lens"] = torch.full((n_lanes,), -7, dtype=torch.int32)
        out["bt_ranges"] = torch.tensor([[WIDTH, 0, WIDTH]] * n_lanes, dtype=torch.int64)
    return {k: tuple(t.to(device) for t in v) if isinstance(v, tuple) else v.to(device)
            for k, v in out.items()}


def flat(out: dict) -> dict:
    return {f"{k}{i}": t for k, v in out.items()
            for i, t in enumerate(v if isinstance(v, tuple) else (v,))}


COMBOS = [(forms, layers) for forms in (("csr",), ("block_table",), ("csr", "block_table"))
          for layers in (("full",), ("swa",), ("full", "swa"))]


@pytest.mark.parametrize("forms,layers", COMBOS, ids=["+".join(f) + "-" + "+".join(la)
                                                      for f, la in COMBOS])
def test_page_blocks_equal_the_twin_launch_after_launch(forms, layers, monkeypatch, device):
    monkeypatch.setattr(page_table, "BLOCK_COLS_MAX", 16)  # lanes of up to 3 blocks
    rng = np.random.default_rng(len(forms) * 7 + len(layers) * 3 + ("swa" in layers))
    n_lanes = 7
    r2t = torch.from_numpy(rng.integers(0, 50 * PS, (N_REQS, WIDTH * PS))).to(torch.int32)
    f2s = torch.from_numpy(rng.integers(0, 30 * PS, 50 * PS)).to(torch.int32)
    f2s[torch.from_numpy(rng.random(50 * PS) < 0.1)] = 0  # unmapped: the sink
    r2t, f2s = r2t.to(device), f2s.to(device)
    cap = int(n_lanes * WIDTH * 0.6)  # some launches overflow kv_indices: not written
    kernel = outputs(forms, layers, n_lanes, cap, device)
    twin = outputs(forms, layers, n_lanes, cap, device)
    blocks_seen = 0
    for launch in range(6):
        rows = random_rows(rng, n_lanes, "full" not in layers).to(device)
        for fn, out in ((page_table.write_page_tables, kernel),
                        (page_table.write_page_tables_torch, twin)):
            fn(rows, r2t, f2s, page_size=PS, **out)
        for name, t in flat(kernel).items():
            assert torch.equal(t, flat(twin)[name]), (launch, name)
        blocks_seen = max(blocks_seen, int(rows[:, PT_END_PAGE].max()) // 16)
    assert blocks_seen >= 1  # some lane spanned more than one block


def test_without_bt_ranges_every_row_is_written_whole(monkeypatch, device):
    """A launch with no ranges (tables of unknown contents) zeroes whole rows; with ranges
    that say a row is clean, a stale entry outside the range stays -- the ranges are what
    the kernel trusts."""
    monkeypatch.setattr(page_table, "BLOCK_COLS_MAX", 16)
    rng = np.random.default_rng(5)
    r2t = torch.from_numpy(rng.integers(1, 50 * PS, (N_REQS, WIDTH * PS))).to(torch.int32)
    f2s = torch.from_numpy(rng.integers(1, 30 * PS, 50 * PS)).to(torch.int32)
    r2t, f2s = r2t.to(device), f2s.to(device)
    rows = random_rows(np.random.default_rng(1), 4, False)
    rows[0, PT_SEQ_LEN], rows[0, PT_END_PAGE], rows[0, PT_LAST_LEN] = 2 * PS, 2, PS
    rows = rows.to(device)
    whole = torch.full((4, WIDTH), -7, dtype=torch.int32, device=device)
    page_table.write_page_tables(rows, r2t, f2s, page_size=PS, full_block_table=whole)
    assert (whole[0, 2:] == 0).all()
    clean = torch.zeros(4, 3, dtype=torch.int64, device=device)  # "nothing held ids"
    trusted = torch.full((4, WIDTH), -7, dtype=torch.int32, device=device)
    page_table.write_page_tables(rows, r2t, f2s, page_size=PS, full_block_table=trusted,
                                 bt_ranges=clean)
    assert (trusted[0, 2:] == -7).all() and torch.equal(trusted[0, :2], whole[0, :2])
    assert clean[0, 0] == 2  # the range this launch wrote, for the next one


def test_programs_follow_the_device():
    assert page_table.page_table_programs(torch.device("cpu"), 256, 8192) == 4
    assert page_table.page_table_programs(torch.device("cpu"), 1, 1) <= 4
    meta = page_table.page_table_meta(16, 8192, 300)
    assert meta == {"BLOCK_COLS": page_table.BLOCK_COLS_MAX, "MAX_LANES": 512}
