"""The contract at every entry point: garbage in, a typed graphalloc error out, nothing changed.

Hypothesis feeds every public entry point of the allocator (and the config, the graph
executor, the replica layer's constructor, the kernels' public ops) generated garbage --
wrong types, shapes, devices, NaN/inf, huge ints, bools, duplicates, out-of-range
values -- and asserts that the call either succeeds or raises a
:class:`graphalloc.GraphallocError` (never a ``TypeError`` / ``IndexError`` /
``ValueError`` / ``OverflowError`` from numpy or torch), and that a refused call left
host and device state exactly as they were.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import assert_same_snapshot
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import graphalloc as ga
from graphalloc import errors as E
from graphalloc.kernels import get_and_clear_swa_pages_torch, release_pages_torch

GARBAGE_SCALARS = [None, True, False, 1.5, -1, 2**63, -(2**63) - 1, 2**70, math.nan, math.inf,
                   -math.inf, "2", "", b"0", 3 + 0j, object(), np.float32(1), np.int64(-5),
                   np.bool_(True), np.uint64(2**64 - 1)]
GARBAGE_ARRAYS = [[[1]], [0, 0], [1.5], ["0"], [None], [True], [0, -1], [2**62], np.array([2.5]),
                  np.zeros((2, 2), dtype=np.int64), np.array([], dtype=np.float64),
                  torch.tensor([0.5]), torch.zeros(2, 2, dtype=torch.int64),
                  torch.tensor([0], device="meta"), torch.tensor([True]), {0: 1}, {0}, "01",
                  range(0, 9)]
garbage = st.sampled_from(GARBAGE_SCALARS + GARBAGE_ARRAYS) | st.integers(-(2**70), 2**70) | \
    st.lists(st.integers(-5, 12), max_size=4) | st.floats(allow_nan=True, allow_infinity=True)


def make() -> ga.HybridAllocator:
    cfg = ga.AllocatorConfig(page_size=2, num_full_pages=16, num_swa_pages=12, max_reqs=4,
                             max_context_len=16, sliding_window=3, max_handles=2)
    a = ga.HybridAllocator(cfg)
    r, s = a.admit(), a.admit()
    a.alloc_extend([r, s], [7, 4])
    a.take_handle(r, 4)
    return a


ENTRY_POINTS = {
    "admit": lambda a, x, y: a.admit(handle=x),
    "admit_n": lambda a, x, y: a.admit(handle=0, n_tokens=x),
    "alloc_extend": lambda a, x, y: a.alloc_extend(x, y),
    "alloc_extend_rows": lambda a, x, y: a.alloc_extend(x, [1]),
    "alloc_extend_counts": lambda a, x, y: a.alloc_extend([0], x),
    "alloc_decode": lambda a, x, y: a.alloc_decode(x),
    "evict_window": lambda a, x, y: a.evict_window(x),
    "advance_frontier": lambda a, x, y: a.advance_frontier(x, y),
    "advance_frontier_pos": lambda a, x, y: a.advance_frontier([0], x),
    "release": lambda a, x, y: a.release(x),
    "load_back": lambda a, x, y: a.load_back(x, y),
    "take_handle": lambda a, x, y: a.take_handle(x, y),
    "take_handle_n": lambda a, x, y: a.take_handle(0, x),
    "drop_handle": lambda a, x, y: a.drop_handle(x),
    "drop_handle_swa": lambda a, x, y: a.drop_handle_swa(x),
    "handle_info": lambda a, x, y: a.handle_info(x),
    "step_release": lambda a, x, y: a.step(release=x),
    "step_evict": lambda a, x, y: a.step(evict=x),
    "step_evict_all": lambda a, x, y: a.step(evict_all=x),
    "step_advance": lambda a, x, y: a.step(advance=x),
    "step_decode": lambda a, x, y: a.step(decode=x),
    "step_extend": lambda a, x, y: a.step(extend=x),
    "step_extend_pair": lambda a, x, y: a.step(extend=(x, y)),
    "try_step": lambda a, x, y: a.try_step(extend=(x, y)),
    "fits": lambda a, x, y: a.fits(decode=x, extend=(y, [1])),
    "plan": lambda a, x, y: a.run(a.plan(decode=x)),
    "run": lambda a, x, y: a.run(x),
    "mark_submitted": lambda a, x, y: a.mark_submitted(x),
    "launch": lambda a, x, y: a.launch(x),
    "launch_fusable": lambda a, x, y: a.launch(0, fusable=x),
    "n_free": lambda a, x, y: a.n_free(x),
    "seq_len": lambda a, x, y: a.seq_len(x),
    "frontier": lambda a, x, y: a.frontier(x),
    "is_live": lambda a, x, y: a.is_live(x),
    "pages_needed": lambda a, x, y: a.pages_needed(x, y),
    "load_state_dict": lambda a, x, y: a.load_state_dict(x),
}


@pytest.mark.parametrize("name", sorted(ENTRY_POINTS))
@settings(max_examples=25, deadline=None, database=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(x=garbage, y=garbage)
def test_garbage_raises_typed_errors_and_changes_nothing(name, x, y):
    a = make()
    before = a.snapshot()
    try:
        ENTRY_POINTS[name](a, x, y)
    except E.GraphallocError:
        assert_same_snapshot(before, a.snapshot())
        return
    # accepted: the allocator must still be consistent
    if a.pending is not None:
        a.run(a.pending)
    a.check_integrity()


@settings(max_examples=60, deadline=None, database=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(field=st.sampled_from(["page_size", "num_full_pages", "num_swa_pages", "max_reqs",
                              "max_context_len", "sliding_window", "swa_ring_pages",
                              "max_release_rows", "max_pages_per_row", "max_alloc_rows",
                              "max_tokens_per_alloc_row", "max_step_pages", "max_step_tokens",
                              "max_handles", "validate", "index_dtype", "device", "backend"]),
       value=garbage)
def test_config_garbage_raises_config_error(field, value):
    args = dict(page_size=2, num_full_pages=16, num_swa_pages=12, max_reqs=4,
                max_context_len=16, sliding_window=3)
    args[field] = value
    try:
        cfg = ga.AllocatorConfig(**args)
    except E.ConfigError:
        return
    # accepted: then it was a value of the field's kind, normalised
    if field in ("validate",):
        assert isinstance(cfg.validate, bool)
    elif field not in ("index_dtype", "device", "backend"):
        assert type(getattr(cfg, field)) is int and not isinstance(value, (bool, float, str))


@pytest.mark.parametrize("value", [None, 0, "cfg", object()])
def test_constructors_refuse_non_configs(value):
    with pytest.raises(E.ConfigError):
        ga.HybridAllocator(value)
    with pytest.raises(E.ConfigError):
        ga.HybridAllocator(ga.AllocatorConfig(page_size=2, num_full_pages=4, num_swa_pages=4,
                                              max_reqs=1, max_context_len=4, sliding_window=2),
                           executor=value)


@settings(max_examples=40, deadline=None, database=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(x=garbage)
def test_kernel_ops_refuse_garbage_with_typed_errors(x):
    f2s = torch.zeros(16, dtype=torch.int64)
    try:
        get_and_clear_swa_pages_torch(x, f2s, 2)
    except E.GraphallocError:
        pass
    try:
        release_pages_torch(x, torch.zeros(3, 8, dtype=torch.int64), f2s,
                            torch.zeros(9, dtype=torch.int64), torch.zeros(9, dtype=torch.int64),
                            torch.zeros(3, 1, dtype=torch.int64),
                            torch.zeros(8, dtype=torch.int64), page_size=2, n_full_cap=8,
                            n_swa_cap=8, n_lanes=4)
    except E.GraphallocError:
        pass
