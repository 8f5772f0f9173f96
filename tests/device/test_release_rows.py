"""Release rows on the device: a ring-mode release split over descriptor rows returns each
ring page exactly once, and in validate mode a page pushed twice in one step reaches the
error word (regressions found from outside)."""

from __future__ import annotations

import numpy as np
import pytest
from small import small

import graphalloc as ga
from graphalloc.kernels.abi import ERR_CODES, REL_EPOCH, REL_N_PAGES, ROW_WIDTH, FaultCode


def test_ring_release_split_over_rows_returns_each_ring_page_once():
    """The reproducer: 65 ring pages in rows of at most 32 pages (3 rows)."""
    a = ga.HybridAllocator(ga.AllocatorConfig(
        page_size=16, num_full_pages=1024, num_swa_pages=260, max_reqs=4,
        max_context_len=8192, sliding_window=1024, swa_ring_pages=65, max_pages_per_row=32))
    rings = []
    for _ in range(2):
        r = a.admit()
        a.alloc_extend([r], [100])
        rings.append(a.state.ring_pages[r, :65].tolist())
        a.release([r])
        assert a.audit() == []
    assert sorted(rings[0]) == sorted(set(rings[0])) and len(set(rings[1])) == 65
    rows = [a.admit() for _ in range(4)]  # 4 x 65 = all 260 SWA pages: no aliasing
    owned = np.concatenate([a.state.ring_pages[r, :65].numpy() for r in rows])
    assert len(np.unique(owned)) == 260
    a.check_integrity()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_validate_mode_reports_a_page_pushed_twice_in_one_step(backend):
    """Two release rows pushing the same FULL page (a corrupted descriptor): the epoch stamp
    of validate mode sees the second push."""
    a = small(backend=backend, validate=True)
    r = a.admit()
    a.alloc_extend([r], [4])
    p = a.plan(release=[r])
    i = p.buffer_index
    buf = a.ring.np_bufs[i]
    n_rel = p.n_release_rows
    buf[n_rel] = buf[n_rel - 1]  # the same segment again, one row later
    buf[n_rel, 6] = buf[n_rel - 1, 6] + buf[n_rel - 1, REL_N_PAGES]  # its own lanes
    assert buf[n_rel, REL_EPOCH] > 0 and buf.shape[1] == ROW_WIDTH
    p.n_release_rows += 1  # launches cover the step's rows: count the injected one
    a.run(p)
    with pytest.raises(ga.DeviceFaultError) as info:
        a.check()
    assert info.value.codes & FaultCode.DUPLICATE_FREE
    assert int(a.state.err_buf[ERR_CODES]) & FaultCode.DUPLICATE_FREE
